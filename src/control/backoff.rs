//! Re-dial backoff: exponential with "equal jitter", pure and deterministic given a
//! random source.
//!
//! Attempt `n` (0-based) waits `d = min(max, min * 2^n)`, then a uniform value in
//! `[d/2, d]`. Half the delay is guaranteed (no thundering herd of zero waits) and
//! the other half spreads peers that lost the same node at the same moment.

use std::time::Duration;

use rand::Rng;

/// Backoff bounds.
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

    /// The un-jittered ceiling for `attempt`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.min
            .checked_mul(factor)
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// The delay before re-dial `attempt`, jittered with `rng`.
    pub fn delay(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling(attempt);
        let half = ceiling / 2;
        let spread = u64::try_from((ceiling - half).as_micros()).unwrap_or(u64::MAX);
        half + Duration::from_micros(rng.random_range(0..=spread))
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
    }
}
