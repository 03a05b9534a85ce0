//! A private Garage (S3) process on free loopback ports, for tests that stop, freeze or
//! kill their S3 server: the shared one of scripts/services.sh serves the other tests of
//! the run in parallel. It uses the binary scripts/services.sh installs
//! (`GRAVITON_GARAGE_BIN`, else `~/.cargo/bin/garage`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The Garage binary, if installed.
pub fn garage_bin() -> Option<String> {
    if let Ok(bin) = std::env::var("GRAVITON_GARAGE_BIN") {
        return Some(bin);
    }
    let home = std::env::var("HOME").ok()?;
    let bin = format!("{home}/.cargo/bin/garage");
    Path::new(&bin).exists().then_some(bin)
}

/// One single-node Garage with one key and one bucket.
pub struct Garage {
    bin: String,
    config: PathBuf,
    pub s3_port: u16,
    pub key_id: String,
    pub secret: String,
    pub bucket: String,
    child: Option<Child>,
}

impl Garage {
    /// The binary (or `None` after the skip report of `test`).
    pub fn bin_for(test: &str) -> Option<String> {
        let bin = garage_bin();
        if bin.is_none() {
            super::missing_service(test, "garage binary (run scripts/services.sh)");
        }
        bin
    }

    /// Write a config under `dir` and start the server with `key_id`, `secret` and
    /// `bucket` created.
    pub fn start(dir: &Path, bin: String, key_id: &str, secret: &str, bucket: &str) -> Self {
        let (s3_port, rpc, admin) = (super::free_port(), super::free_port(), super::free_port());
        let config = dir.join("garage.toml");
        std::fs::write(
            &config,
            format!(
                r#"metadata_dir = "{d}/meta"
data_dir = "{d}/data"
db_engine = "sqlite"
replication_factor = 1
metadata_fsync = true
data_fsync = true
rpc_bind_addr = "127.0.0.1:{rpc}"
rpc_public_addr = "127.0.0.1:{rpc}"
rpc_secret = "{secret}"
[s3_api]
api_bind_addr = "127.0.0.1:{s3_port}"
s3_region = "garage"
[admin]
api_bind_addr = "127.0.0.1:{admin}"
"#,
                d = dir.display(),
                secret = "ab".repeat(32)
            ),
        )
        .unwrap();
        let mut garage = Self {
            bin,
            config,
            s3_port,
            key_id: key_id.into(),
            secret: secret.into(),
            bucket: bucket.into(),
            child: None,
        };
        garage.spawn(true);
        garage
    }

    /// Start the process (again); `first` creates the key and the bucket.
    pub fn spawn(&mut self, first: bool) {
        let mut command = Command::new(&self.bin);
        command.arg("-c").arg(&self.config).arg("server");
        if first {
            command
                .args(["--single-node", "--default-access-key", "--default-bucket"])
                .env("GARAGE_DEFAULT_ACCESS_KEY", &self.key_id)
                .env("GARAGE_DEFAULT_SECRET_KEY", &self.secret)
                .env("GARAGE_DEFAULT_BUCKET", &self.bucket);
        }
        self.child = Some(
            command
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn garage"),
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.s3_port)).is_err() {
            assert!(Instant::now() < deadline, "garage did not listen");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.s3_port)
    }

    /// Send `signal` (`STOP`, `CONT`, ...) to the server process.
    pub fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("garage running");
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} garage");
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Garage {
    fn drop(&mut self) {
        self.kill();
    }
}
