//! How `lua/admission.lua` is run: as a Redis Function (`FCALL`), loaded on demand.
//!
//! The file is one library with one function, `run(keys, args)`. It is loaded with
//! `FUNCTION LOAD REPLACE` under a name that carries the hash of its code
//! (`graviton_admission_<sha1 prefix>`), so nodes running different versions during a
//! rolling upgrade each call their own code. A call answered `Function not found` (a new
//! or emptied server, a node added to a cluster) loads the library and is sent again;
//! in a cluster `FUNCTION LOAD` goes to every primary. Functions are replicated and
//! persisted with the data set, so a promoted replica already has the library.
//!
//! A function keeps its helpers between calls: `FUNCTION LOAD` runs the file's top level
//! once, and each `FCALL` only runs `run`. Under `EVALSHA` the whole file (about forty
//! closures and their tables) was rebuilt on every call; measured in docs/admission.md.
//!
//! Servers without Functions (Redis before 7.0) answer `unknown command`; then the same
//! file is sent by `EVALSHA` (`SCRIPT LOAD` on `NOSCRIPT`), where its last lines call
//! `run(KEYS, ARGV)` themselves: one code path in Lua, two ways to reach it.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, Ordering};

use redis::{Cmd, FromRedisValue, RedisError, RedisResult, Value, cmd};

use super::connection::Connection;

const CODE: &str = include_str!("../../../lua/admission.lua");

/// The admission library: its code, the names it is loaded and called under.
pub struct AdmissionScript {
    /// `#!lua name=<library>` and a local naming the function, then the file.
    library: String,
    function: String,
    /// SHA-1 of the file, for `EVALSHA`.
    sha: String,
}

/// Set once a server answered `unknown command` to `FCALL`; later calls use `EVALSHA`.
static NO_FUNCTIONS: AtomicBool = AtomicBool::new(false);

pub static SCRIPT: LazyLock<AdmissionScript> = LazyLock::new(|| {
    let sha = redis::Script::new(CODE).get_hash().to_string();
    let function = format!("graviton_admission_{}", &sha[..16]);
    AdmissionScript {
        library: format!("#!lua name={function}\nlocal FUNCTION_NAME = '{function}'\n{CODE}"),
        function,
        sha,
    }
});

impl AdmissionScript {
    /// A call with `keys`, to which the caller appends the script arguments.
    pub fn call<'a>(&self, keys: impl IntoIterator<Item = &'a str>) -> Cmd {
        let keys: Vec<&str> = keys.into_iter().collect();
        let mut command = cmd("FCALL");
        command.arg(&self.function).arg(keys.len());
        for key in keys {
            command.arg(key);
        }
        command
    }

    /// Send `call` (built by [`AdmissionScript::call`]), loading the library when the
    /// server does not have it.
    pub async fn run<T: FromRedisValue>(&self, conn: &Connection, call: &Cmd) -> RedisResult<T> {
        if NO_FUNCTIONS.load(Ordering::Relaxed) {
            return self.run_eval(conn, call).await;
        }
        let mut c = conn.clone();
        match call.query_async::<T>(&mut c).await {
            Ok(value) => Ok(value),
            Err(err) if function_missing(&err) => {
                let _: Value = cmd("FUNCTION")
                    .arg("LOAD")
                    .arg("REPLACE")
                    .arg(&self.library)
                    .query_async(&mut c)
                    .await?;
                call.query_async::<T>(&mut c).await
            }
            Err(err) if unknown_command(&err) => {
                NO_FUNCTIONS.store(true, Ordering::Relaxed);
                self.run_eval(conn, call).await
            }
            Err(err) => Err(err),
        }
    }

    /// The same call by `EVALSHA` (servers without Functions).
    async fn run_eval<T: FromRedisValue>(&self, conn: &Connection, call: &Cmd) -> RedisResult<T> {
        let mut eval = cmd("EVALSHA");
        eval.arg(&self.sha);
        for arg in call.args_iter().skip(2) {
            if let redis::Arg::Simple(bytes) = arg {
                eval.arg(bytes);
            }
        }
        let mut c = conn.clone();
        match eval.query_async::<T>(&mut c).await {
            Ok(value) => Ok(value),
            Err(err)
                if err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                let _: Value = cmd("SCRIPT")
                    .arg("LOAD")
                    .arg(CODE)
                    .query_async(&mut c)
                    .await?;
                eval.query_async::<T>(&mut c).await
            }
            Err(err) => Err(err),
        }
    }
}

fn function_missing(err: &RedisError) -> bool {
    err.detail()
        .is_some_and(|d| d.starts_with("Function not found"))
}

fn unknown_command(err: &RedisError) -> bool {
    err.detail()
        .is_some_and(|d| d.starts_with("unknown command") && d.contains("FCALL"))
        || err.to_string().contains("unknown command 'FCALL'")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_is_named_after_its_code_and_registers_that_name() {
        let script = &*SCRIPT;
        assert!(script.function.starts_with("graviton_admission_"));
        assert_eq!(script.function.len(), "graviton_admission_".len() + 16);
        let first = script.library.lines().next().unwrap();
        assert_eq!(first, format!("#!lua name={}", script.function));
        assert!(CODE.contains("redis.register_function(FUNCTION_NAME, run)"));
        let call = script.call(["a", "b"]);
        let args: Vec<Vec<u8>> = call
            .args_iter()
            .filter_map(|arg| match arg {
                redis::Arg::Simple(bytes) => Some(bytes.to_vec()),
                _ => None,
            })
            .collect();
        let expected: [&[u8]; 5] = [b"FCALL", script.function.as_bytes(), b"2", b"a", b"b"];
        assert_eq!(args, expected.map(<[u8]>::to_vec));
    }
}
