//! Delays between attempts while a transfer waits for a cluster lease (pure).
//!
//! Waiting is client-side polling, made fair on the server: the script keeps the oldest
//! live waiter of the shared service pool at the head of a queue and holds room for it, so
//! newcomers cannot starve a large footprint (see `lua/admission.lua`, head-of-line
//! reservation). The client only spreads its polls: attempt `n` sleeps a uniformly random
//! delay in `[d/2, d]` with `d = retry_interval * min(2^n, 8)`, never past the deadline.
//! Backing off to at most 8 intervals keeps Redis load bounded under long saturation while
//! the jitter avoids synchronized retries after a release.

use std::time::Duration;

use rand::Rng;

/// The sleep before attempt `attempt + 1`, given the time left before the deadline.
pub fn next_delay(
    attempt: u32,
    retry_interval: Duration,
    remaining: Duration,
    rng: &mut impl Rng,
) -> Duration {
    let ceiling = retry_interval.saturating_mul(1u32 << attempt.min(3));
    let floor = ceiling / 2;
    let span = (ceiling - floor).as_nanos() as u64;
    let jitter = if span == 0 {
        0
    } else {
        rng.random_range(0..=span)
    };
    (floor + Duration::from_nanos(jitter)).min(remaining)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn delays_are_bounded_and_never_pass_the_deadline(
            attempt in 0u32..100, base_ms in 1u64..1000, remaining_ms in 0u64..100_000, seed in any::<u64>()
        ) {
            use rand::SeedableRng;
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let base = Duration::from_millis(base_ms);
            let remaining = Duration::from_millis(remaining_ms);
            let delay = next_delay(attempt, base, remaining, &mut rng);
            prop_assert!(delay <= remaining);
            prop_assert!(delay <= base * 8);
            if remaining >= base * 8 {
                prop_assert!(delay >= base / 2);
            }
        }
    }
}
