//! A private PostgreSQL server per test, for faults that must not touch the machine's
//! shared server (a restart, a stop): `initdb` into a temporary directory owned by the
//! `postgres` OS user, started with `pg_ctl` on a free loopback port, trust authentication
//! for the `postgres` superuser. Stopped (`-m immediate`) and deleted on drop.
//!
//! `fsync = off` only: the faults stop PostgreSQL's processes, never the machine, so WAL in
//! the page cache survives them. `synchronous_commit` stays on: with it off, a commit is
//! acknowledged before its WAL reaches even the page cache, and `stop -m immediate` loses
//! it (the nemesis suite caught exactly that as acknowledged blobs answering 404).
//!
//! PostgreSQL refuses to run as root, so when the tests run as root every `initdb` /
//! `pg_ctl` call goes through `runuser -u postgres --`. The binaries are found in
//! `GRAVITON_PG_BIN` or the newest `/usr/lib/postgresql/*/bin`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// How `pg_ctl` stops the server (its `-m` option).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopMode {
    /// Every backend killed at once, no checkpoint: crash recovery on the next start.
    Immediate,
    /// Sessions terminated, then a clean shutdown checkpoint.
    Fast,
}

impl StopMode {
    fn flag(self) -> &'static str {
        match self {
            Self::Immediate => "immediate",
            Self::Fast => "fast",
        }
    }
}

/// A private `postgres` server on 127.0.0.1:`port` (see the module docs).
pub struct PostgresServer {
    port: u16,
    bin: PathBuf,
    dir: tempfile::TempDir,
    as_postgres: bool,
    running: bool,
    settings: Settings,
}

/// The server settings a caller may change. The tests' default is 60 connections with
/// fsync off (their data need not survive the host); a benchmark that models production
/// turns fsync on and sizes the connections to its nodes.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub max_connections: u32,
    pub fsync: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            max_connections: 60,
            fsync: false,
        }
    }
}

impl PostgresServer {
    /// `initdb` and start a server, or `None` (after a loud skip line) when the PostgreSQL
    /// server binaries are absent. Panics instead of skipping when
    /// `GRAVITON_REQUIRE_SERVICES=1`.
    pub fn start(test: &str) -> Option<Self> {
        Self::start_with(test, Settings::default())
    }

    /// [`start`](Self::start) with other [`Settings`].
    pub fn start_with(test: &str, settings: Settings) -> Option<Self> {
        let Some(bin) = find_bin_dir() else {
            super::missing_service(
                test,
                "PostgreSQL server binaries (initdb, pg_ctl) not found",
            );
            return None;
        };
        let as_postgres = running_as_root();
        let dir = tempfile::Builder::new()
            .prefix("graviton-pg-")
            .tempdir()
            .expect("tempdir for postgres");
        // The postgres user must reach its data directory through the temp dir.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod pg tempdir");
        let mut server = Self {
            port: super::free_port(),
            bin,
            dir,
            as_postgres,
            running: false,
            settings,
        };
        std::fs::create_dir(server.data()).expect("pg data dir");
        if as_postgres {
            let status = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(server.data())
                .status()
                .expect("chown pg data dir");
            assert!(status.success(), "chown postgres {:?}", server.data());
        }
        let data = server.data();
        server.run(
            "initdb",
            &[
                "-D",
                &data.display().to_string(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "--no-instructions",
            ],
        );
        server.start_server();
        Some(server)
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`
    pub fn admin_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `pg_ctl stop -m <mode>` (waits until the server is down).
    pub fn stop(&mut self, mode: StopMode) {
        if self.running {
            let data = self.data().display().to_string();
            self.run("pg_ctl", &["-D", &data, "-m", mode.flag(), "-w", "stop"]);
            self.running = false;
        }
    }

    /// Start a stopped server again on the same port with the same data.
    pub fn start_again(&mut self) {
        if !self.running {
            self.start_server();
        }
    }

    /// `pg_ctl restart -m <mode>`: stop, then start on the same port (waits until it
    /// accepts connections).
    pub fn restart(&mut self, mode: StopMode) {
        self.stop(mode);
        self.start_server();
    }

    /// The postmaster's pid (from `postmaster.pid`), while the server runs.
    pub fn postmaster_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.data().join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// The server's log (for failure messages).
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.log()).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// In the data directory, so the postgres user can write it.
    fn log(&self) -> PathBuf {
        self.data().join("server.log")
    }

    fn start_server(&mut self) {
        let data = self.data().display().to_string();
        let log = self.log().display().to_string();
        let options = format!(
            "-p {port} -c listen_addresses=127.0.0.1 -k {data} -c max_connections={max} -c fsync={fsync}",
            port = self.port,
            max = self.settings.max_connections,
            fsync = if self.settings.fsync { "on" } else { "off" },
        );
        self.run(
            "pg_ctl",
            &[
                "-D", &data, "-l", &log, "-o", &options, "-w", "-t", "60", "start",
            ],
        );
        self.running = true;
    }

    /// Run a PostgreSQL binary (as the postgres user when the tests run as root); panics
    /// with its output on failure.
    fn run(&self, program: &str, args: &[&str]) {
        let binary = self.bin.join(program);
        let mut command = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&binary);
            c
        } else {
            Command::new(&binary)
        };
        let output = command
            .args(args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run {program}: {e}"));
        assert!(
            output.status.success(),
            "{program} {args:?} failed: {}\n{}\n{}\nserver log:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
            self.log_tail(20)
        );
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if self.running {
            let data = self.data().display().to_string();
            let binary = self.bin.join("pg_ctl");
            let mut command = if self.as_postgres {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(&binary);
                c
            } else {
                Command::new(&binary)
            };
            let _ = command
                .args(["-D", &data, "-m", "immediate", "-w", "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn find_bin_dir() -> Option<PathBuf> {
    if let Ok(explicit) = std::env::var("GRAVITON_PG_BIN") {
        return Some(PathBuf::from(explicit));
    }
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            has_server(&bin).then_some((version, bin))
        })
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, bin)| bin)
}

fn has_server(bin: &Path) -> bool {
    bin.join("initdb").is_file() && bin.join("pg_ctl").is_file()
}
