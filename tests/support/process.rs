//! The one wrapper of a `graviton` process that a test starts: [`Graviton`].
//!
//! * Ports: a serving process gets fresh [`Ports`] from [`super::free_port`] for each
//!   launch attempt, and a process that exits with `Address already in use` before its
//!   public port accepts (another process took a port between the pick and the bind) is
//!   started again on new ports, up to five attempts.
//! * Stderr goes into a log file of the test's directory, which every failure message of
//!   the wrapper quotes ([`Graviton::log_text`]).
//! * The process is killed with SIGKILL when the wrapper is dropped, also when the test
//!   fails (before the test's temporary directory, or a filesystem under it, goes away).
//!
//! [`Graviton::serve`] takes a closure that makes the command for the picked ports, so
//! the same wrapper serves a node configured by flags, by environment variables or by a
//! config file it writes; [`Graviton::spawn`] starts a process that serves no port (the
//! standalone manager, an offline `gc`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_graviton");

/// How many times a process that lost a port race is started again.
const LAUNCH_ATTEMPTS: usize = 5;

/// `graviton` with none of the caller's `GRAVITON_*` configuration inherited (the test
/// environment of `scripts/services.sh` sets some).
pub fn isolated_command() -> Command {
    let mut command = Command::new(BIN);
    for (name, _) in std::env::vars() {
        if name.starts_with("GRAVITON_") {
            command.env_remove(name);
        }
    }
    command
}

/// The loopback ports of one node process, picked anew for each launch attempt.
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    /// The public HTTP listener (the one the port race is detected on).
    pub public: u16,
    pub internal: u16,
    pub control: u16,
}

impl Ports {
    fn pick() -> Self {
        Self {
            public: super::free_port(),
            internal: super::free_port(),
            control: super::free_port(),
        }
    }

    /// `127.0.0.1:<public>`, for `--listen` or `[node] listen`.
    pub fn listen(&self) -> String {
        format!("127.0.0.1:{}", self.public)
    }
}

/// A running `graviton` process; see the module doc.
pub struct Graviton {
    /// `http://127.0.0.1:<public>` (empty for a process that serves no port).
    pub url: String,
    pub ports: Option<Ports>,
    /// What is started again on [`Self::restart`] (the stdio is the wrapper's own).
    command: Command,
    log: PathBuf,
    child: Option<Child>,
}

impl Graviton {
    /// Start a serving process: `build` makes its command for newly picked ports (and
    /// writes any config file it needs); stderr goes to `log`. Returns once the public port
    /// accepts, or the process exited for another reason than a lost port race, or 10 s
    /// passed: wait for readiness with [`Self::ready`].
    pub fn serve(log: impl Into<PathBuf>, mut build: impl FnMut(Ports) -> Command) -> Self {
        let log = log.into();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let ports = Ports::pick();
            let mut process = Self {
                url: format!("http://{}", ports.listen()),
                ports: Some(ports),
                command: build(ports),
                log: log.clone(),
                child: None,
            };
            // A fresh log per launch: a lost port race is read from it.
            let _ = std::fs::remove_file(&log);
            process.launch(&[]);
            if attempt == LAUNCH_ATTEMPTS || !process.lost_a_port_race() {
                return process;
            }
        }
    }

    /// `graviton serve --listen <public port>` with stderr to `log`; `settings` adds the
    /// rest (more flags, the environment).
    pub fn serve_listen(log: impl Into<PathBuf>, mut settings: impl FnMut(&mut Command)) -> Self {
        Self::serve(log, |ports| {
            let mut command = Command::new(BIN);
            command.args(["serve", "--listen", &ports.listen()]);
            settings(&mut command);
            command
        })
    }

    /// `graviton serve --config <config>` with stderr to `log`: for each launch attempt
    /// `text` gives the file's contents for the picked ports, and `settings` adds the
    /// environment.
    pub fn serve_config(
        log: impl Into<PathBuf>,
        config: &Path,
        mut text: impl FnMut(Ports) -> String,
        mut settings: impl FnMut(&mut Command),
    ) -> Self {
        Self::serve(log, |ports| {
            std::fs::write(config, text(ports))
                .unwrap_or_else(|e| panic!("write {}: {e}", config.display()));
            let mut command = Command::new(BIN);
            command.args(["serve", "--config"]).arg(config);
            settings(&mut command);
            command
        })
    }

    /// Start a process that serves no port (the standalone manager, an offline `gc`),
    /// stderr to `log`.
    pub fn spawn(log: impl Into<PathBuf>, command: Command) -> Self {
        let log = log.into();
        let _ = std::fs::remove_file(&log);
        let mut process = Self {
            url: String::new(),
            ports: None,
            command,
            log,
            child: None,
        };
        process.launch(&[]);
        process
    }

    /// The public port (panics for a process that serves none).
    pub fn port(&self) -> u16 {
        self.ports.expect("a serving process").public
    }

    fn launch(&mut self, env: &[(&str, &str)]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap_or_else(|e| panic!("open the log {}: {e}", self.log.display()));
        let mut command = Command::new(self.command.get_program());
        command.args(self.command.get_args());
        for (name, value) in self.command.get_envs() {
            match value {
                Some(value) => command.env(name, value),
                None => command.env_remove(name),
            };
        }
        if let Some(dir) = self.command.get_current_dir() {
            command.current_dir(dir);
        }
        let child = command
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {:?}: {e}", self.command.get_program()));
        self.child = Some(child);
    }

    /// Whether the process exited at start because a port was taken meanwhile (polled
    /// until its public port accepts, it exits, or 10 s pass).
    fn lost_a_port_race(&mut self) -> bool {
        let port = self.port();
        let mut lost = false;
        super::poll_blocking(Duration::from_secs(10), || {
            if self.exited().is_some() {
                lost = self.log_text().contains("Address already in use");
                return true;
            }
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        lost
    }

    /// Wait until `GET /readyz` answers 200; `Err` naming why (the exit status, or no
    /// answer within `within`) with the process's log.
    pub async fn wait_ready(&mut self, within: Duration) -> Result<(), String> {
        let client = super::client();
        let ready = format!("{}/readyz", self.url);
        let mut exited = None;
        let answered = super::wait_until(within, || {
            exited = self.exited();
            let request = client.get(&ready).send();
            let gone = exited.is_some();
            async move { gone || request.await.is_ok_and(|r| r.status() == 200) }
        })
        .await;
        let failure = match exited {
            Some(status) => format!("exited: {status}"),
            None if answered => return Ok(()),
            None => format!("no answer within {within:?}"),
        };
        Err(format!(
            "graviton at {} did not become ready ({failure}):\n{}",
            self.url,
            self.log_text()
        ))
    }

    /// [`Self::wait_ready`] that panics with the reason and the log.
    pub async fn ready(&mut self, within: Duration) {
        if let Err(failure) = self.wait_ready(within).await {
            self.kill9();
            panic!("{failure}");
        }
    }

    /// Wait until the public port accepts a TCP connection (for a test that must not send
    /// a request before its own); panics with the log if it does not within `within`.
    pub fn wait_listening(&mut self, within: Duration) {
        let port = self.port();
        if !super::poll_blocking(within, || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        }) {
            self.kill9();
            panic!(
                "graviton did not listen on {port} within {within:?}:\n{}",
                self.log_text()
            );
        }
    }

    /// Wait until the log holds `line` (e.g. a `GRAVITON_TEST_PAUSE_AFTER` pause line);
    /// panics with the log if the process exits first or `within` passes.
    pub fn wait_for_log(&mut self, line: &str, within: Duration) {
        let mut exited = None;
        let seen = super::poll_blocking(within, || {
            exited = self.exited();
            self.log_text().contains(line) || exited.is_some()
        });
        if !seen || !self.log_text().contains(line) {
            let log = self.log_text();
            self.kill9();
            match exited {
                Some(status) => panic!("the process ended ({status}) before {line:?}:\n{log}"),
                None => panic!("no {line:?} within {within:?}:\n{log}"),
            }
        }
    }

    /// Wait until a process started with `GRAVITON_TEST_PAUSE_AFTER=<step>` pauses there.
    pub fn wait_paused(&mut self, step: &str) {
        let line = format!("paused after {step} (GRAVITON_TEST_PAUSE_AFTER)");
        self.wait_for_log(&line, Duration::from_secs(120));
    }

    /// The exit status if the process has ended (`None` while it runs or when none runs).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL: no drain, no goodbye; the process is reaped.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait for the exit (SIGKILL after 30 s); `None` when none ran.
    pub fn terminate(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let mut status = None;
        super::poll_blocking(Duration::from_secs(30), || {
            status = child.try_wait().ok().flatten();
            status.is_some()
        });
        if status.is_none() {
            let _ = child.kill();
            status = child.wait().ok();
        }
        status
    }

    /// Start the same command again (after a kill; a running process is killed first),
    /// on the same ports, its log appended to.
    pub fn restart(&mut self) {
        self.restart_with_env(&[]);
    }

    /// [`Self::restart`] with `env` added to the environment (e.g. a test-only pause hook
    /// of `src/storage/pack/pause.rs`).
    pub fn restart_with_env(&mut self, env: &[(&str, &str)]) {
        self.kill9();
        self.launch(env);
    }

    /// Everything the process (all its launches since the last port pick) wrote to stderr.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }
}

impl Drop for Graviton {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// One `kB` field of `/proc/<pid>/status` (`VmHWM`, `VmRSS`, `RssAnon`, ...), in bytes.
pub fn status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    for line in status.lines() {
        if let Some(rest) = line.strip_prefix(field).and_then(|r| r.strip_prefix(':')) {
            let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().unwrap();
            return kib * 1024;
        }
    }
    panic!("no {field} in /proc/{pid}/status");
}

/// Reset the process's peak resident size (`VmHWM`) to its current size.
pub fn reset_peak_resident(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset VmHWM");
}
