//! Real `graviton serve` / `graviton manager` processes for the nemesis suite: each has its
//! own PostgreSQL role (so the test can cut exactly one process off from PostgreSQL), fixed
//! ports across restarts, and a log file. Signals go through `kill(1)`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::cluster::{BIN, TOKEN};

/// Cluster timings of the suite: heartbeat 200 ms, self-fence 800 ms, node TTL 2 s (the
/// node TTL covers self-fence plus margin, so a node paused past the TTL has fenced).
pub const NODE_TTL: Duration = Duration::from_secs(2);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Node { embedded_manager: bool },
    Manager,
}

/// One process of the cluster.
pub struct Proc {
    pub id: String,
    /// The PostgreSQL role this process connects as.
    pub role: String,
    pub kind: Kind,
    pub config: PathBuf,
    pub url: String,
    child: Option<Child>,
    log: PathBuf,
    stopped: bool,
    /// What [`Proc::start`] was given, for [`Proc::sibling`].
    dir: PathBuf,
    database_url: String,
    shard_count: u32,
    storage: String,
}

impl Proc {
    /// Write the config and start the process.
    pub fn start(
        dir: &Path,
        id: &str,
        role: &str,
        database_url: &str,
        shard_count: u32,
        kind: Kind,
        storage: &str,
    ) -> Self {
        let (public, internal, control) = (
            crate::support::free_port(),
            crate::support::free_port(),
            crate::support::free_port(),
        );
        let embedded = match kind {
            Kind::Node { embedded_manager } => embedded_manager,
            Kind::Manager => true,
        };
        let config = dir.join(format!("{id}.toml"));
        std::fs::write(
            &config,
            format!(
                r#"[node]
id = "{id}"
listen = "127.0.0.1:{public}"
shutdown_grace = "3s"

[log]
format = "json"

{storage}

[cluster]
enabled = true
database_url = "{database_url}"
shard_count = {shard_count}
embedded_manager = {embedded}
heartbeat_interval = "200ms"
self_fence = "800ms"
node_ttl = "{ttl}ms"
poll_interval = "250ms"
rebalance_interval = "200ms"
lock_retry_interval = "200ms"
lock_ping_interval = "200ms"

[control]
internal_listen = "127.0.0.1:{internal}"
control_listen = "127.0.0.1:{control}"
internal_token = "{TOKEN}"
"#,
                ttl = NODE_TTL.as_millis(),
            ),
        )
        .expect("write config");
        let mut proc = Self {
            id: id.to_string(),
            role: role.to_string(),
            kind,
            config,
            url: format!("http://127.0.0.1:{public}"),
            child: None,
            log: dir.join(format!("{id}.log")),
            stopped: false,
            dir: dir.to_path_buf(),
            database_url: database_url.to_string(),
            shard_count,
            storage: storage.to_string(),
        };
        proc.spawn();
        proc
    }

    /// Another process like this one (same kind, role, database and storage) under `id`,
    /// on ports of its own, started.
    pub fn sibling(&self, id: &str) -> Self {
        let storage = self.storage.replace(
            &format!("{}", self.dir.join(&self.id).display()),
            &format!("{}", self.dir.join(id).display()),
        );
        Self::start(
            &self.dir,
            id,
            &self.role,
            &self.database_url,
            self.shard_count,
            self.kind,
            &storage,
        )
    }

    pub fn spawn(&mut self) {
        self.spawn_with_env(&[]);
    }

    /// Start the process with `env` added (e.g. a test hook of
    /// `src/storage/pack/pause.rs`: `GRAVITON_TEST_STOP_AFTER=<step>`).
    pub fn spawn_with_env(&mut self, env: &[(&str, &str)]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let command = match self.kind {
            Kind::Node { .. } => "serve",
            Kind::Manager => "manager",
        };
        let child = Command::new(BIN)
            .args([command, "--config"])
            .arg(&self.config)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn graviton");
        self.child = Some(child);
        self.stopped = false;
    }

    /// Send `sig` through `kill(1)`; the delivery must succeed (the process exists).
    fn signal(&self, sig: &str) {
        let child = self
            .child
            .as_ref()
            .unwrap_or_else(|| panic!("{}: kill {sig} with no process running", self.id));
        let status = Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status()
            .expect("run kill(1)");
        assert!(
            status.success(),
            "{}: kill {sig} {} was not delivered ({status})",
            self.id,
            child.id()
        );
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// kill -9, confirmed: the process must have been running and must end by SIGKILL
    /// (not exited on its own before the fault).
    pub fn kill9(&mut self) {
        use std::os::unix::process::ExitStatusExt;
        let mut child = self
            .child
            .take()
            .unwrap_or_else(|| panic!("{}: kill -9 with no process running", self.id));
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "{}: exited on its own ({status}) before kill -9; log tail:\n{}",
                self.id,
                self.log_tail(20)
            );
        }
        child
            .kill()
            .unwrap_or_else(|e| panic!("{}: kill -9 failed: {e}", self.id));
        let status = child.wait().expect("reap after kill -9");
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "{}: ended by {status}, not by the kill -9",
            self.id
        );
        self.stopped = false;
    }

    /// Reap a process that exited on its own (no fault is recorded).
    pub fn reap(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.stopped = false;
    }

    /// SIGSTOP, confirmed from the process state (`T` in /proc) before it returns.
    pub fn sigstop(&mut self) {
        self.signal("-STOP");
        self.stopped = true;
        let pid = self.pid().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !crate::support::process_stopped(pid) {
            assert!(
                Instant::now() < deadline,
                "{}: not stopped 10 s after SIGSTOP",
                self.id
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGCONT, confirmed: the process leaves the stopped state before it returns.
    pub fn sigcont(&mut self) {
        self.signal("-CONT");
        self.stopped = false;
        let pid = self.pid().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while crate::support::process_stopped(pid) {
            assert!(
                Instant::now() < deadline,
                "{}: still stopped 10 s after SIGCONT",
                self.id
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGTERM and wait (bounded) for the exit; kill -9 past the bound.
    pub fn terminate(&mut self) {
        if self.stopped {
            self.sigcont();
        }
        self.signal("-TERM");
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(15);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether the process has exited on its own (a standalone manager failing closed).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        match self.child.as_mut() {
            Some(child) => child.try_wait().ok().flatten(),
            None => None,
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// The process's log file (JSON lines, appended across restarts).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last `lines` log lines, without the ownership records.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text
            .lines()
            .filter(|l| !l.contains(graviton::upload::record::TARGET))
            .collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // No assertions here: a drop may run while a test is already failing.
        self.reap();
    }
}
