//! Restart backoff: exponential with a cap, reset after a stable run.

use std::time::Duration;

use tokio::time::Instant;

/// Delay before each restart of a crashing child.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    stable_after: Duration,
    attempt: u32,
    started_at: Option<Instant>,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration, stable_after: Duration) -> Self {
        Self {
            initial,
            max,
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
        let factor = 1u32.checked_shl(self.attempt.min(16)).unwrap_or(u32::MAX);
        self.attempt = self.attempt.saturating_add(1);
        self.initial.saturating_mul(factor).min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_resets_after_a_stable_run() {
        let t = Instant::now();
        let mut b = Backoff::new(
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
}
