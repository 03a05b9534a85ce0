//! The one restart routine of the node's supervisors (`NodeSupervisor`,
//! `PlacementSupervisor`): which supervision events mean "a child is gone", and how long
//! to wait before starting it again (`crate::backoff::Restart`: exponential, reset after a
//! stable run).

use std::time::Duration;

use ractor::{ActorId, ActorRef, Message, SupervisionEvent};
use tokio::time::Instant;

use crate::backoff;

/// First restart delay of a crashed child.
pub const RESTART_INITIAL: Duration = Duration::from_millis(50);
/// Longest restart delay.
pub const RESTART_MAX: Duration = Duration::from_secs(5);
/// A child that ran this long before exiting restarts at [`RESTART_INITIAL`] again.
pub const RESTART_STABLE_AFTER: Duration = Duration::from_secs(30);

/// The child a supervision event reports gone (stopped or failed), with the reason.
/// Other events (a child started, a process-group change) are `None`.
pub fn exited(event: &SupervisionEvent) -> Option<(ActorId, String)> {
    match event {
        SupervisionEvent::ActorTerminated(cell, _, reason) => Some((
            cell.get_id(),
            reason.clone().unwrap_or_else(|| "stopped".into()),
        )),
        SupervisionEvent::ActorFailed(cell, err) => Some((cell.get_id(), format!("failed: {err}"))),
        _ => None,
    }
}

/// The restart state of one supervised child.
#[derive(Debug, Clone)]
pub struct Restart {
    backoff: backoff::Restart,
}

impl Default for Restart {
    fn default() -> Self {
        Self {
            backoff: backoff::Restart::new(RESTART_INITIAL, RESTART_MAX, RESTART_STABLE_AFTER),
        }
    }
}

impl Restart {
    /// The child (re)started now.
    pub fn started(&mut self) {
        self.backoff.started(Instant::now());
    }

    /// The child exited (`why`) or failed to start: send `restart` to the supervisor after
    /// the next backoff delay.
    pub fn schedule<M: Message>(
        &mut self,
        supervisor: &ActorRef<M>,
        child: &str,
        why: &str,
        restart: impl FnOnce() -> M + Send + 'static,
    ) {
        let delay = self.backoff.next_delay(Instant::now());
        tracing::warn!(child, reason = %why, ?delay, "supervised child is down; restarting");
        supervisor.send_after(delay, restart);
    }
}
