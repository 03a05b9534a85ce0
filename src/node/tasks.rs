//! The node's background tasks (the collector schedule, the sweep of expired resumable
//! uploads, the peer feed, the release of lost sessions) as one supervised set: every task runs under the node's stop token, a task
//! that panics is restarted with the supervisors' restart backoff (`actors::restart`), and shutdown cancels and
//! awaits them all. No bare `tokio::spawn` of a long-lived task elsewhere in the node.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::edge::AppState;
use crate::storage::pack::gc::{self, GcOptions};

type TaskFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A set of background tasks, restarted when they panic, stopped together.
pub struct BackgroundTasks {
    stop: CancellationToken,
    set: JoinSet<()>,
}

impl BackgroundTasks {
    pub fn new(stop: CancellationToken) -> Self {
        Self {
            stop,
            set: JoinSet::new(),
        }
    }

    /// Run `make(stop)` until `stop` is cancelled or it returns; restart it if it panics.
    pub fn spawn<F, Fut>(&mut self, name: &'static str, make: F)
    where
        F: Fn(CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let stop = self.stop.clone();
        let make: Arc<dyn Fn(CancellationToken) -> TaskFuture + Send + Sync> =
            Arc::new(move |stop| Box::pin(make(stop)));
        self.set.spawn(async move {
            use crate::actors::restart::{RESTART_INITIAL, RESTART_MAX, RESTART_STABLE_AFTER};
            let mut restart =
                crate::backoff::Restart::new(RESTART_INITIAL, RESTART_MAX, RESTART_STABLE_AFTER);
            loop {
                restart.started(tokio::time::Instant::now());
                let run = tokio::spawn(make(stop.clone()));
                match run.await {
                    Ok(()) => return,
                    Err(err) if err.is_panic() => {
                        tracing::error!(task = name, "background task panicked; restarting");
                    }
                    Err(_) => return,
                }
                let delay = restart.next_delay(tokio::time::Instant::now());
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        });
    }

    /// Cancel every task and wait (up to `within`) until they stopped.
    pub async fn shutdown(mut self, within: Duration) {
        self.stop.cancel();
        let all = async { while self.set.join_next().await.is_some() {} };
        if tokio::time::timeout(within, all).await.is_err() {
            self.set.abort_all();
        }
    }
}

/// Run the collector every `storage.gc.interval` while the node runs, with purge; each
/// run is logged and recorded in the metrics. Returns at once without packs or with a
/// zero interval.
pub async fn collect_on_schedule(app: std::sync::Weak<AppState>, stop: CancellationToken) {
    let Some(interval) = app.upgrade().and_then(|app| {
        let interval = app.config.storage.gc.interval.get();
        (app.packs.is_some() && !interval.is_zero()).then_some(interval)
    }) else {
        return;
    };
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let Some(app) = app.upgrade() else { return };
        let Some((store, metrics)) = &app.packs else {
            return;
        };
        let options = GcOptions::from_config(&app.config.storage.gc, false, true);
        let marked = app.gc_manifests();
        match gc::collect(store, &marked, options, &mut gc::Quiet).await {
            Ok(report) => {
                metrics.record(&report);
                tracing::info!(?report, "collector run finished");
            }
            // In a cluster another node's run holds the lock: that run covers this one.
            Err(crate::storage::StoreError::Busy(detail)) => {
                tracing::info!(%detail, "collector run skipped")
            }
            Err(err) => {
                metrics.failures.inc();
                tracing::warn!(error = %err, "collector run failed")
            }
        }
    }
}

/// Remove expired resumable uploads every `upload.resumable_sweep_interval` (their
/// ledger rows, staged tails and block lists; the blocks are then the collector's).
pub async fn sweep_expired_uploads(app: std::sync::Weak<AppState>, stop: CancellationToken) {
    let Some(interval) = app
        .upgrade()
        .map(|app| app.config.upload.resumable_sweep_interval.get())
    else {
        return;
    };
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let Some(app) = app.upgrade() else { return };
        match app.uploads.sweep_expired().await {
            Ok(0) => {}
            Ok(removed) => tracing::info!(removed, "expired resumable uploads removed"),
            Err(err) => tracing::warn!(error = %err, "resumable upload sweep failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn a_panicking_task_is_restarted_and_shutdown_stops_it() {
        let runs = Arc::new(AtomicU32::new(0));
        let mut tasks = BackgroundTasks::new(CancellationToken::new());
        let counter = runs.clone();
        tasks.spawn("flaky", move |stop| {
            let counter = counter.clone();
            async move {
                if counter.fetch_add(1, Ordering::SeqCst) < 2 {
                    panic!("injected");
                }
                stop.cancelled().await;
            }
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while runs.load(Ordering::SeqCst) < 3 {
            assert!(tokio::time::Instant::now() < deadline, "not restarted");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tasks.shutdown(Duration::from_secs(5)).await;
        assert_eq!(
            runs.load(Ordering::SeqCst),
            3,
            "no restart after a clean stop"
        );
    }
}
