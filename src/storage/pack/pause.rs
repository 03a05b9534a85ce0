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

use std::sync::OnceLock;
use std::time::Duration;

/// The environment variable naming the step to pause after.
pub const ENV: &str = "GRAVITON_TEST_PAUSE_AFTER";

/// The environment variable naming the step to stop (SIGSTOP) after.
pub const STOP_ENV: &str = "GRAVITON_TEST_STOP_AFTER";

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|s| !s.is_empty())
}

/// The step this process pauses after, if any.
fn wanted() -> Option<&'static str> {
    static WANTED: OnceLock<Option<String>> = OnceLock::new();
    WANTED.get_or_init(|| var(ENV)).as_deref()
}

/// The step this process stops itself after, if any.
fn stop_wanted() -> Option<&'static str> {
    static WANTED: OnceLock<Option<String>> = OnceLock::new();
    WANTED.get_or_init(|| var(STOP_ENV)).as_deref()
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
