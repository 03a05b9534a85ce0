//! Waiting for a cluster lease: the poll loop, its back-off and the timeout decision.
//!
//! Waiting is client-side polling, made fair on the server: the script keeps the oldest
//! live waiter of the shared service pool at the head of a queue and holds room for it, so
//! newcomers cannot starve a large footprint (see `lua/admission.lua`, head-of-line
//! reservation). Between attempts the client sleeps [`Backoff::delay_within`] with
//! `min = retry_interval` and `max = 8 · retry_interval`: attempt `n` sleeps a random
//! delay in `[d/2, d]`, `d = retry_interval · min(2^n, 8)`, never past the deadline.
//! Backing off to at most 8 intervals keeps Redis load bounded under long saturation while
//! the jitter avoids synchronized retries after a release.
//!
//! The decision when the wait ends without a lease:
//! - `NEVER` from the script: [`Error::NeverFits`] at once (waiting cannot help);
//! - the deadline passes before any reply arrived: [`Error::Unavailable`] (`timeout`),
//!   the coordinator is unreachable;
//! - the deadline passes after a reply: [`Error::TimedOut`], saturation.
//!
//! A waiter's place in the script's queue lives [`waiter_ttl`] without a poll, derived
//! from this schedule, so backing off never costs a live waiter its place.
//!
//! If the wait ends without a lease (timeout, error, or the future being dropped by a
//! caller that went away), an `abandon` call clears the waiter entry and any lease a lost
//! reply may have granted, recording `timed_out` or `abandoned`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::error::Error;
use crate::backoff::Backoff;
use crate::storage::redis::coordinator::CALL_TIMEOUT;
use crate::storage::redis::reply::{AcquireReply, Dimension, FencingToken, LeaseId, Occupancy};
use crate::storage::redis::{LeaseRequest, RedisCoordinator};

/// Polls back off up to this many retry intervals.
const MAX_POLL_FACTOR: u32 = 8;
/// Attempts of one idempotent coordinator call (the first and two retries).
const CALL_ATTEMPTS: u32 = 3;

/// How long the script keeps a waiter's place without a poll, derived from the retry
/// schedule: the longest sleep between two polls, plus the longest a poll can take (it may
/// queue behind a batch call in flight, then run its own; each up to [`CALL_ATTEMPTS`]
/// attempts of [`CALL_TIMEOUT`]), plus 1 s for scheduling. A live waiter therefore never
/// loses its place however long it backs off (ADM-7); a waiter that died holds the head
/// for at most this long (one that gives up clears its entry with `abandon` at once).
pub fn waiter_ttl(retry_interval: Duration) -> Duration {
    poll_backoff(retry_interval).max + CALL_TIMEOUT * (2 * CALL_ATTEMPTS) + Duration::from_secs(1)
}

/// A cluster lease granted by the script.
#[derive(Debug)]
pub struct ClusterLease {
    pub lease_id: LeaseId,
    pub token: FencingToken,
    pub policy_version: u64,
    pub occupancy: Occupancy,
    /// When the admitting attempt was sent: the base of the holder's safe deadline.
    pub sent_at: Instant,
}

/// The back-off of the polls of one wait.
pub fn poll_backoff(retry_interval: Duration) -> Backoff {
    Backoff::new(
        retry_interval,
        retry_interval.saturating_mul(MAX_POLL_FACTOR),
    )
}

/// Wait for a lease until `deadline`, polling every [`poll_backoff`] delay.
pub async fn wait_for_lease(
    coordinator: &RedisCoordinator,
    request: &LeaseRequest,
    retry_interval: Duration,
    deadline: Instant,
) -> Result<ClusterLease, Error> {
    let mut guard = AbandonOnDrop {
        coordinator: coordinator.clone(),
        request: request.clone(),
        dimension: None,
        armed: true,
        disconnected: true,
    };
    let backoff = poll_backoff(retry_interval);
    // Set once any reply arrived: a deadline that passes before that is an unreachable
    // coordinator (503 admission_unavailable), after it saturation (503 busy).
    let answered = AtomicBool::new(false);
    let attempts = async {
        let mut attempt = 0u32;
        loop {
            let sent_at = Instant::now();
            let reply = coordinator.try_acquire(request, attempt == 0).await?;
            answered.store(true, Ordering::Relaxed);
            match reply {
                AcquireReply::Admitted {
                    token,
                    policy_version,
                    occupancy,
                    ..
                } => {
                    return Ok(ClusterLease {
                        lease_id: request.lease_id.clone(),
                        token,
                        policy_version,
                        occupancy,
                        sent_at,
                    });
                }
                AcquireReply::NeverFits { dimension, .. } => {
                    return Err(Error::NeverFits(dimension));
                }
                AcquireReply::Rejected { dimension, .. } => {
                    guard.dimension = Some(dimension);
                    let remaining = deadline.saturating_duration_since(Instant::now());
                    if remaining.is_zero() {
                        return Err(Error::TimedOut("cluster lease"));
                    }
                    let delay = backoff.delay_within(attempt, remaining, &mut rand::rng());
                    tokio::time::sleep(delay).await;
                    attempt = attempt.saturating_add(1);
                }
            }
        }
    };
    let result = match tokio::time::timeout_at(deadline, attempts).await {
        Ok(result) => result,
        Err(_) if !answered.load(Ordering::Relaxed) => Err(Error::Unavailable("timeout".into())),
        Err(_) => Err(Error::TimedOut("cluster lease")),
    };
    // Reaching this point means the wait ended here, not by the caller dropping it.
    guard.disconnected = false;
    if matches!(result, Ok(_) | Err(Error::NeverFits(_))) {
        guard.armed = false;
    }
    result
}

/// Runs `abandon` in the background unless disarmed: covers timeouts, errors and a caller
/// that drops the wait future (client disconnect) alike.
struct AbandonOnDrop {
    coordinator: RedisCoordinator,
    request: LeaseRequest,
    dimension: Option<Dimension>,
    armed: bool,
    /// Still set when the wait future was dropped mid-wait (the caller went away).
    disconnected: bool,
}

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let coordinator = self.coordinator.clone();
        let request = self.request.clone();
        let (dimension, disconnected) = (self.dimension, self.disconnected);
        runtime.spawn(async move {
            if let Err(err) = coordinator
                .abandon_as(&request, dimension, disconnected)
                .await
            {
                tracing::debug!(error = %err, "abandoning a cluster admission attempt failed; the lease expires by TTL");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Checks ADM-7 (the schedule half): the gap between two polls of a live waiter, the
    // longest sleep plus the longest poll call, is always inside the waiter's TTL.
    #[test]
    fn a_waiter_outlives_the_longest_gap_between_its_polls() {
        for retry_ms in [10u64, 50, 400, 1000, 5000] {
            let retry = Duration::from_millis(retry_ms);
            let longest_sleep = poll_backoff(retry).ceiling(u32::MAX);
            let longest_call = CALL_TIMEOUT * (2 * CALL_ATTEMPTS);
            assert!(
                longest_sleep + longest_call < waiter_ttl(retry),
                "retry {retry_ms} ms"
            );
        }
    }
}
