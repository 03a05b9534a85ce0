//! One running node: stores, actors, and the HTTP server, started and stopped together.
//!
//! `start` opens the stores, starts the actor tree and binds the listener; the node is
//! ready when it returns. `shutdown` marks the node not ready, stops accepting
//! connections, gives in-flight requests `node.shutdown_grace` to finish, aborts what is
//! left (aborted uploads write no manifest), and stops the actors.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::actors::SupervisorHandle;
use crate::actors::session_region::RegionArgs;
use crate::actors::supervisor::SupervisorArgs;
use crate::config::Config;
use crate::http::{AppState, ops::Readiness, router};
use crate::ids::NodeId;
use crate::metrics::Metrics;
use crate::storage::fs::{FsBlockStore, FsManifestStore};
use crate::storage::{BlockStore, ManifestStore};

/// Replaceable parts of a node (tests inject instrumented stores).
#[derive(Default)]
pub struct NodeOptions {
    pub blocks: Option<Arc<dyn BlockStore>>,
    pub manifests: Option<Arc<dyn ManifestStore>>,
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("open storage under {path}: {source}")]
    Storage {
        path: String,
        #[source]
        source: crate::storage::StoreError,
    },
    #[error("bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("start actors: {0}")]
    Actors(String),
    #[error("admission: {0}")]
    Admission(String),
}

/// A started node.
pub struct RunningNode {
    addr: SocketAddr,
    state: Arc<AppState>,
    stop_accepting: CancellationToken,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    supervisor: SupervisorHandle,
}

/// How a shutdown went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownOutcome {
    /// Every in-flight request finished within the grace period.
    Drained,
    /// The grace period ran out; remaining requests were aborted.
    Aborted,
}

pub async fn start(config: Config) -> Result<RunningNode, StartError> {
    start_with(config, NodeOptions::default()).await
}

pub async fn start_with(config: Config, options: NodeOptions) -> Result<RunningNode, StartError> {
    let data_dir = config.storage.data_dir.clone();
    let storage_err = |source| StartError::Storage {
        path: data_dir.display().to_string(),
        source,
    };
    let blocks: Arc<dyn BlockStore> = match options.blocks {
        Some(blocks) => blocks,
        None => Arc::new(FsBlockStore::open(&data_dir, config.storage.fsync).map_err(storage_err)?),
    };
    let manifests: Arc<dyn ManifestStore> = match options.manifests {
        Some(manifests) => manifests,
        None => {
            Arc::new(FsManifestStore::open(&data_dir, config.storage.fsync).map_err(storage_err)?)
        }
    };

    let metrics = Metrics::new();
    let admission = crate::admission::Admission::new(
        &config.admission,
        crate::admission::AdmissionMetrics::default(),
    )
    .map_err(|e| StartError::Admission(e.to_string()))?;
    metrics.register_with(|registry| admission.metrics().register(registry));
    let node_id = NodeId(config.node.id.clone());
    let supervisor = SupervisorHandle::start(SupervisorArgs {
        region_name: format!(
            "graviton.{}.{}.session-region",
            node_id,
            uuid::Uuid::new_v4().simple()
        ),
        region: RegionArgs {
            max_hot: config.sessions.max_hot,
            idle_timeout: config.sessions.idle_timeout.get(),
            sweep_interval: config.sessions.sweep_interval.get(),
            metrics: metrics.clone(),
        },
    })
    .await
    .map_err(|e| StartError::Actors(e.to_string()))?;

    let listen = config.node.listen;
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| StartError::Bind {
            addr: listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| StartError::Bind {
        addr: listen,
        source,
    })?;

    let state = Arc::new(AppState {
        node_id,
        config: Arc::new(config),
        blocks,
        manifests,
        sessions: supervisor.sessions(),
        metrics,
        admission,
        readiness: Readiness::default(),
        started_at: Instant::now(),
    });
    let app = router(state.clone());
    let stop_accepting = CancellationToken::new();
    let server = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(stop_accepting.clone().cancelled_owned())
            .into_future(),
    );
    state.readiness.set(true);
    tracing::info!(%addr, node = %state.node_id, data_dir = %state.config.storage.data_dir.display(), "graviton node serving");
    Ok(RunningNode {
        addr,
        state,
        stop_accepting,
        server,
        supervisor,
    })
}

impl RunningNode {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Graceful stop, bounded by `node.shutdown_grace`.
    pub async fn shutdown(mut self) -> ShutdownOutcome {
        self.state.readiness.set(false);
        self.stop_accepting.cancel();
        let grace = self.state.config.node.shutdown_grace.get();
        let outcome = match tokio::time::timeout(grace, &mut self.server).await {
            Ok(_) => ShutdownOutcome::Drained,
            Err(_) => {
                tracing::warn!(
                    ?grace,
                    "in-flight requests outlived the shutdown grace; aborting them"
                );
                self.server.abort();
                let _ = (&mut self.server).await;
                ShutdownOutcome::Aborted
            }
        };
        self.supervisor.shutdown().await;
        tracing::info!(?outcome, "graviton node stopped");
        outcome
    }

    /// Serve until SIGINT or SIGTERM, then shut down gracefully.
    pub async fn run_until_signal(self) -> ShutdownOutcome {
        wait_for_signal().await;
        tracing::info!("shutdown signal received; draining");
        self.shutdown().await
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
