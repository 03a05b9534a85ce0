//! A private `redis-server` process per test.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` child process bound to 127.0.0.1 on its own port. Killed on drop.
pub struct RedisServer {
    port: u16,
    binary: PathBuf,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl RedisServer {
    /// Start a server, or return `None` (after a loud skip line) if `redis-server` is absent.
    /// Panics instead of skipping when `GRAVITON_REQUIRE_SERVICES=1`.
    pub fn start(test: &str) -> Option<Self> {
        let Some(binary) = find_binary() else {
            super::missing_service(test, "redis-server binary not found on PATH");
            return None;
        };
        let mut server = Self {
            port: super::free_port(),
            binary,
            dir: tempfile::tempdir().expect("tempdir for redis"),
            child: None,
        };
        server.spawn().expect("start redis-server");
        Some(server)
    }

    /// `redis://127.0.0.1:<port>/`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kill the server hard (SIGKILL), keeping the port for [`RedisServer::restart`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start the server again on the same port (after [`RedisServer::stop`]). Data is gone.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn().expect("restart redis-server");
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let child = Command::new(&self.binary)
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
            ])
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if ping(self.port) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(std::io::Error::other(format!(
            "redis-server did not answer PING on port {} within 10s",
            self.port
        )))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 16];
    matches!(stream.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
}

fn find_binary() -> Option<PathBuf> {
    if let Ok(explicit) = std::env::var("GRAVITON_REDIS_SERVER") {
        return Some(PathBuf::from(explicit));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join("redis-server"))
        .find(|candidate| candidate.is_file())
}
