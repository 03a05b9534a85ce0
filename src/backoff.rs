//! The one back-off of the crate (pure): a jittered exponential delay, and a restart
//! helper built on it for supervisors.
//!
//! [`Backoff`]: attempt `n` (0-based) has the ceiling `d = min(max, min · 2^n)` and waits a
//! uniformly random delay in `[d/2, d]` ("equal jitter"). Half the delay is guaranteed (no
//! thundering herd of zero waits) and the other half spreads peers that retry at the same
//! moment. Users:
//!
//! - the control plane's re-dials (`control::cluster`, `min`/`max` from `[control]`);
//! - cluster admission's polls while a transfer waits for a lease (`admission::acquire`:
//!   `min = retry_interval`, `max = 8 · retry_interval`, never past the deadline);
//! - [`Restart`], for the supervisors' restarts of a crashing child.
//!
//! [`Restart`] uses the un-jittered ceiling (restarts of one child are not synchronized
//! with anybody else's) and starts over at `min` after the child ran for `stable_after`.

use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;

/// Exponential back-off bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub min: Duration,
    pub max: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max: max.max(min),
        }
    }

    /// The un-jittered ceiling of `attempt`: `min(max, min · 2^attempt)`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.min
            .checked_mul(factor)
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// The delay before retry `attempt`, jittered with `rng`, in `[ceiling/2, ceiling]`.
    pub fn delay(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling(attempt);
        let half = ceiling / 2;
        let spread = u64::try_from((ceiling - half).as_nanos()).unwrap_or(u64::MAX);
        let jitter = if spread == 0 {
            0
        } else {
            rng.random_range(0..=spread)
        };
        half + Duration::from_nanos(jitter)
    }

    /// [`Backoff::delay`], but never longer than `remaining` (the time to a deadline).
    pub fn delay_within(&self, attempt: u32, remaining: Duration, rng: &mut impl Rng) -> Duration {
        self.delay(attempt, rng).min(remaining)
    }
}

/// Delays between restarts of one crashing child: the exponential ceiling of [`Backoff`]
/// (no jitter), reset to `min` after a run of at least `stable_after`.
#[derive(Debug, Clone)]
pub struct Restart {
    backoff: Backoff,
    stable_after: Duration,
    attempt: u32,
    started_at: Option<Instant>,
}

impl Restart {
    pub fn new(initial: Duration, max: Duration, stable_after: Duration) -> Self {
        Self {
            backoff: Backoff::new(initial, max),
            stable_after,
            attempt: 0,
            started_at: None,
        }
    }

    /// The child started (successfully) at `now`.
    pub fn started(&mut self, now: Instant) {
        self.started_at = Some(now);
    }

    /// The child exited at `now`: how long to wait before restarting it.
    pub fn next_delay(&mut self, now: Instant) -> Duration {
        if let Some(started) = self.started_at.take()
            && now.saturating_duration_since(started) >= self.stable_after
        {
            self.attempt = 0;
        }
        let delay = self.backoff.ceiling(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;

    #[test]
    fn ceilings_double_then_cap() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let got: Vec<_> = (0..6).map(|a| b.ceiling(a).as_millis()).collect();
        assert_eq!(got, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn restarts_double_up_to_the_cap_and_reset_after_a_stable_run() {
        let t = Instant::now();
        let mut b = Restart::new(
            Duration::from_millis(100),
            Duration::from_secs(1),
            Duration::from_secs(30),
        );
        let delays: Vec<_> = (0..6).map(|_| b.next_delay(t).as_millis()).collect();
        assert_eq!(delays, vec![100, 200, 400, 800, 1000, 1000]);
        b.started(t);
        assert_eq!(
            b.next_delay(t + Duration::from_secs(31)),
            Duration::from_millis(100)
        );
        b.started(t);
        assert_eq!(
            b.next_delay(t + Duration::from_secs(1)),
            Duration::from_millis(200)
        );
    }

    proptest! {
        #[test]
        fn delays_stay_within_half_ceiling_and_ceiling(seed in any::<u64>(), attempt in 0u32..100, min_ms in 1u64..1000, extra in 0u64..60_000) {
            let b = Backoff::new(Duration::from_millis(min_ms), Duration::from_millis(min_ms + extra));
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let d = b.delay(attempt, &mut rng);
            prop_assert!(d <= b.ceiling(attempt));
            prop_assert!(d >= b.ceiling(attempt) / 2);
            prop_assert!(d <= b.max);
        }

        #[test]
        fn admission_polls_are_bounded_and_never_pass_the_deadline(
            attempt in 0u32..100, base_ms in 1u64..1000, remaining_ms in 0u64..100_000, seed in any::<u64>()
        ) {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let base = Duration::from_millis(base_ms);
            let remaining = Duration::from_millis(remaining_ms);
            let delay = Backoff::new(base, base * 8).delay_within(attempt, remaining, &mut rng);
            prop_assert!(delay <= remaining);
            prop_assert!(delay <= base * 8);
            if remaining >= base * 8 {
                prop_assert!(delay >= base / 2);
            }
        }
    }
}
