//! The one restart routine of the node's supervisors (`NodeSupervisor`,
//! `PlacementSupervisor`, the control plane's `ControlSupervisor`): which supervision
//! events mean "a child is gone", how long to wait before starting it again
//! (`crate::backoff::Restart`: exponential, reset after a stable run), and, for a
//! supervisor that gives up, how many restarts it may make in a window
//! ([`RestartBudget`]).

use std::collections::VecDeque;
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

/// At most `max` restarts within any `window`: the bound of a supervisor that gives up
/// rather than restart a child that keeps failing (pure; the caller passes the clock).
#[derive(Debug, Clone)]
pub struct RestartBudget {
    max: usize,
    window: Duration,
    recent: VecDeque<Instant>,
}

impl RestartBudget {
    pub fn new(max: usize, window: Duration) -> Self {
        Self {
            max,
            window,
            recent: VecDeque::with_capacity(max + 1),
        }
    }

    /// A restart is wanted at `now`: `true` (and counted) if fewer than `max` restarts
    /// happened in the `window` before `now`, else `false` (give up).
    pub fn allow(&mut self, now: Instant) -> bool {
        while self
            .recent
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) >= self.window)
        {
            self.recent.pop_front();
        }
        if self.recent.len() >= self.max {
            return false;
        }
        self.recent.push_back(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Checks LOC-8 (the bound of the control plane's restarts).
    #[test]
    fn the_budget_allows_max_restarts_per_window_then_refuses() {
        let t = Instant::now();
        let mut budget = RestartBudget::new(3, Duration::from_secs(60));
        let ms = Duration::from_millis;
        assert!(budget.allow(t));
        assert!(budget.allow(t + ms(100)));
        assert!(budget.allow(t + ms(200)));
        assert!(
            !budget.allow(t + ms(300)),
            "a fourth restart within the window"
        );
        // Restarts older than the window no longer count.
        assert!(budget.allow(t + Duration::from_secs(60)));
        assert!(!budget.allow(t + Duration::from_secs(60) + ms(50)));
        assert!(budget.allow(t + Duration::from_secs(61)));
        let mut never = RestartBudget::new(0, Duration::from_secs(1));
        assert!(!never.allow(t));
    }
}
