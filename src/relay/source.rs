//! The inbound body of one forward: shared between its attempts, pulled by at most one
//! tap at a time, reclaimable for a retry only while untouched (a body with pulled bytes
//! is never replayed), and the clock of the owner's silence (`forward_read_timeout`).

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, BodyDataStream};
use bytes::Bytes;
use futures_util::Stream;

use super::ForwardStats;

/// The inbound body, shared between the attempts of one forward. It is pulled by at
/// most one tap at a time, and can be reclaimed for a retry only while no byte of it
/// has been pulled.
#[derive(Clone)]
pub(super) struct Source(Arc<Mutex<SourceState>>);

struct SourceState {
    stream: Option<BodyDataStream>,
    /// Bumped on reclaim; taps of an older generation see end-of-stream.
    generation: u64,
    pulled: u64,
    failed: bool,
    /// Last time the owner's side pulled (polled) the body.
    last_pull: std::time::Instant,
    /// The last poll found no client bytes: the forwarder is waiting on the client.
    waiting_on_client: bool,
}

impl Source {
    pub(super) fn new(body: Body) -> Self {
        Self(Arc::new(Mutex::new(SourceState {
            stream: Some(body.into_data_stream()),
            generation: 0,
            pulled: 0,
            failed: false,
            last_pull: std::time::Instant::now(),
            waiting_on_client: false,
        })))
    }

    /// Resolves once the owner has been silent for `limit`: it neither pulled the body
    /// while client bytes were available, nor (after the body ended) answered. Time
    /// spent waiting on the client does not count.
    pub(super) async fn owner_silent(&self, limit: Duration) {
        {
            let mut state = self.lock();
            state.last_pull = std::time::Instant::now();
            state.waiting_on_client = false;
        }
        let tick = (limit / 4).max(Duration::from_millis(20));
        loop {
            tokio::time::sleep(tick).await;
            let mut state = self.lock();
            if state.waiting_on_client {
                state.last_pull = std::time::Instant::now();
            } else if state.last_pull.elapsed() >= limit {
                return;
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, SourceState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn tap(&self, stats: Arc<ForwardStats>) -> Tap {
        let generation = self.lock().generation;
        Tap {
            source: self.clone(),
            generation,
            stats,
        }
    }

    pub(super) fn untouched(&self) -> bool {
        let state = self.lock();
        state.pulled == 0 && !state.failed
    }

    pub(super) fn failed(&self) -> bool {
        self.lock().failed
    }

    /// Detach the current tap and keep the body for another attempt, if intact.
    pub(super) fn reclaim(&self) -> bool {
        let mut state = self.lock();
        if state.pulled == 0 && !state.failed {
            state.generation += 1;
            if state.stream.is_none() {
                // An empty body that already ended: resend it empty.
                state.stream = Some(Body::empty().into_data_stream());
            }
            true
        } else {
            false
        }
    }
}

/// The stream handed to reqwest: pulls the shared source frame by frame.
pub(super) struct Tap {
    source: Source,
    generation: u64,
    stats: Arc<ForwardStats>,
}

impl Stream for Tap {
    type Item = Result<Bytes, axum::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut state = self.source.lock();
        if state.generation != self.generation {
            return Poll::Ready(None);
        }
        let Some(stream) = state.stream.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(stream).poll_next(cx);
        state.last_pull = std::time::Instant::now();
        state.waiting_on_client = polled.is_pending();
        match &polled {
            Poll::Ready(Some(Ok(bytes))) => {
                state.pulled += bytes.len() as u64;
                self.stats
                    .bytes_pulled
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            }
            Poll::Ready(Some(Err(_))) => state.failed = true,
            Poll::Ready(None) => state.stream = None,
            Poll::Pending => {}
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    fn body(frames: usize) -> Body {
        let stream = futures_util::stream::iter(
            (0..frames).map(|i| Ok::<_, std::io::Error>(Bytes::from(vec![i as u8; 10]))),
        );
        Body::from_stream(stream)
    }

    #[tokio::test]
    async fn an_untouched_body_can_be_reclaimed_and_old_taps_go_quiet() {
        let stats = Arc::new(ForwardStats::default());
        let source = Source::new(body(3));
        let mut old = source.tap(stats.clone());
        assert!(source.untouched());
        assert!(source.reclaim());
        assert!(old.next().await.is_none(), "a detached tap yields nothing");
        let mut new = source.tap(stats.clone());
        let mut total = 0;
        while let Some(frame) = new.next().await {
            total += frame.unwrap().len();
        }
        assert_eq!(total, 30);
        assert_eq!(stats.bytes_pulled.load(Ordering::Relaxed), 30);
    }

    #[tokio::test]
    async fn a_body_with_pulled_bytes_is_never_replayed() {
        let stats = Arc::new(ForwardStats::default());
        let source = Source::new(body(3));
        let mut tap = source.tap(stats);
        assert!(tap.next().await.is_some());
        assert!(!source.untouched());
        assert!(!source.reclaim());
    }

    #[tokio::test]
    async fn an_empty_body_that_ended_can_be_resent_empty() {
        let stats = Arc::new(ForwardStats::default());
        let source = Source::new(Body::empty());
        let mut tap = source.tap(stats.clone());
        assert!(tap.next().await.is_none());
        assert!(source.reclaim());
        assert!(source.tap(stats).next().await.is_none());
    }
}
