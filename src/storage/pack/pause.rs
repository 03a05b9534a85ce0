//! A **test-only** pause point for fault tests with real processes.
//!
//! With `GRAVITON_TEST_PAUSE_AFTER=<step>` in its environment, a process that reaches
//! `step` prints `graviton: paused after <step> (GRAVITON_TEST_PAUSE_AFTER)` on stderr and
//! then waits forever at that point, holding whatever it holds there (an open redb write
//! transaction, a claimed pack, an unindexed pack). The fault test reads that line and
//! sends SIGKILL (or SIGSTOP), so the process dies at a known step of a collector run or an
//! upload instead of at a random instant. Unset (always, outside tests) it costs one
//! `OnceLock` read per step. Steps are listed in docs/storage.md ("Fault tests").
//!
//! `GRAVITON_TEST_STOP_AFTER=<step>` is the same, except that the process prints
//! `graviton: stopping after <step> (GRAVITON_TEST_STOP_AFTER)` and sends itself SIGSTOP
//! there: it stays stopped (its sockets open, its PostgreSQL session and advisory lock
//! held) until the test sends SIGCONT, then carries on from that step.
//!
//! **Refused outside test builds unless switched on.** A debug build (the test profile)
//! honours the variables. A release build ignores them unless
//! `GRAVITON_ENABLE_TEST_HOOKS=1` is set as well (the gc benchmark stops its release
//! child this way), so a stray variable can never stop a production process while it
//! holds its PostgreSQL session or the collector's lock. Whenever a hook is set the
//! process says so at WARN when it starts ([`announce`]), whether it will act or not.

use std::sync::OnceLock;
use std::time::Duration;

/// The environment variable naming the step to pause after.
pub const ENV: &str = "GRAVITON_TEST_PAUSE_AFTER";

/// The environment variable naming the step to stop (SIGSTOP) after.
pub const STOP_ENV: &str = "GRAVITON_TEST_STOP_AFTER";

/// The switch that lets a release build honour the hooks.
pub const ENABLE_ENV: &str = "GRAVITON_ENABLE_TEST_HOOKS";

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|s| !s.is_empty())
}

/// Whether this build honours the hooks: always in debug builds, in release builds only
/// with [`ENABLE_ENV`] = `1`.
fn enabled() -> bool {
    cfg!(debug_assertions) || var(ENABLE_ENV).as_deref() == Some("1")
}

/// Say at WARN that a test hook is set, and whether this process will act on it. Called
/// once when a node or a command starts.
pub fn announce() {
    for name in [ENV, STOP_ENV] {
        if let Some(step) = var(name) {
            if enabled() {
                tracing::warn!(hook = name, step = %step, "test hook set: this process will pause at that step");
            } else {
                tracing::warn!(
                    hook = name,
                    "test hook set but ignored: a release build needs {ENABLE_ENV}=1"
                );
            }
        }
    }
}

/// The step this process pauses after, if any.
fn wanted() -> Option<&'static str> {
    static WANTED: OnceLock<Option<String>> = OnceLock::new();
    WANTED
        .get_or_init(|| var(ENV).filter(|_| enabled()))
        .as_deref()
}

/// The step this process stops itself after, if any.
fn stop_wanted() -> Option<&'static str> {
    static WANTED: OnceLock<Option<String>> = OnceLock::new();
    WANTED
        .get_or_init(|| var(STOP_ENV).filter(|_| enabled()))
        .as_deref()
}

/// Pause here forever if `GRAVITON_TEST_PAUSE_AFTER` names `step`, or stop (SIGSTOP) if
/// `GRAVITON_TEST_STOP_AFTER` does (see the module docs).
pub fn after(step: &str) {
    if wanted() == Some(step) {
        eprintln!("graviton: paused after {step} ({ENV})");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    if stop_wanted() == Some(step) {
        eprintln!("graviton: stopping after {step} ({STOP_ENV})");
        // SAFETY: raise only sends a signal to this process.
        unsafe {
            libc::raise(libc::SIGSTOP);
        }
    }
}
