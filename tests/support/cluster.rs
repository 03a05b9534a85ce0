//! Separate `graviton serve` processes forming a cluster on one PostgreSQL database.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_graviton");
pub const TOKEN: &str = "test-internal-token-0123456789abcdefghijkl";

/// One node process.
pub struct NodeProcess {
    pub id: String,
    pub config: PathBuf,
    pub url: String,
    pub internal: u16,
    child: Option<Child>,
    log: PathBuf,
}

impl NodeProcess {
    /// Write the node's config (fast test timings) and start it.
    pub fn start(
        dir: &Path,
        id: &str,
        database_url: &str,
        shard_count: u32,
        data_dir: &Path,
    ) -> Self {
        Self::start_with(dir, id, database_url, shard_count, data_dir, "")
    }

    /// Like [`NodeProcess::start`], with `extra` TOML appended to the config (e.g. an
    /// `[admission.redis]` section).
    pub fn start_with(
        dir: &Path,
        id: &str,
        database_url: &str,
        shard_count: u32,
        data_dir: &Path,
        extra: &str,
    ) -> Self {
        let (public, internal, control) =
            (super::free_port(), super::free_port(), super::free_port());
        let config = dir.join(format!("{id}.toml"));
        std::fs::write(
            &config,
            format!(
                r#"[node]
id = "{id}"
listen = "127.0.0.1:{public}"
shutdown_grace = "5s"

[storage]
data_dir = "{data}"
fsync = false

[cluster]
enabled = true
database_url = "{database_url}"
shard_count = {shard_count}
heartbeat_interval = "100ms"
self_fence = "400ms"
node_ttl = "1s"
poll_interval = "250ms"
rebalance_interval = "200ms"
lock_retry_interval = "100ms"
lock_ping_interval = "100ms"

[control]
internal_listen = "127.0.0.1:{internal}"
control_listen = "127.0.0.1:{control}"
internal_token = "{TOKEN}"

{extra}
"#,
                data = data_dir.display()
            ),
        )
        .expect("write node config");
        let log = dir.join(format!("{id}.log"));
        let mut node = Self {
            id: id.to_string(),
            config,
            url: format!("http://127.0.0.1:{public}"),
            internal,
            child: None,
            log,
        };
        node.spawn();
        node
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let child = Command::new(BIN)
            .args(["serve", "--config"])
            .arg(&self.config)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn graviton serve");
        self.child = Some(child);
    }

    /// Start the same node again (after a kill).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL: no drain, no goodbye.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        child.wait().ok()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

pub async fn is_ready(client: &reqwest::Client, url: &str) -> bool {
    matches!(client.get(format!("{url}/readyz")).send().await, Ok(r) if r.status() == 200)
}
