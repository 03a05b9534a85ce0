//! The edge below `http` and `grpc`: what every listener shares, and what a client sees
//! of the node before any handler of its own runs.
//!
//! - [`AppState`]: the shared state of the handlers (stores, services, placement,
//!   authentication, metrics), and [`EdgeMetrics`];
//! - [`error`]: the one error vocabulary ([`ErrorCode`], [`ApiError`], [`Answer`]): every
//!   status, `Retry-After` and gRPC code a client sees;
//! - [`readiness`]: whether the node should receive traffic;
//! - [`listener`]: the accept loop of every HTTP/1 listener (timeouts, bounds, TLS,
//!   shutdown) and the connection metrics of every listener;
//! - [`tls`]: rustls configurations of the public, gRPC and internal listeners, the
//!   relay's client identity and the control plane's mutual TLS, with their config types;
//! - [`auth`]: the tenant binding (which caller a request acts for), for HTTP and gRPC;
//! - [`headers`]: the header checks that run before a body is read.
//!
//! It imports neither `http`, `grpc` nor `relay`: they import it.

pub mod auth;
pub mod error;
pub mod headers;
pub mod listener;
pub mod readiness;
pub mod tls;

use std::sync::Arc;
use std::time::Instant;

pub use error::{Answer, ApiError, ErrorCode};
pub use readiness::Readiness;

use crate::actors::SessionRegionHandle;
use crate::config::Config;
use crate::ids::NodeId;
use crate::metrics::Metrics;
use crate::storage::{BlockStore, ManifestStore};

/// What every listener's handlers share (HTTP and gRPC), built once by `node`.
pub struct AppState {
    pub node_id: NodeId,
    pub config: Arc<Config>,
    pub blocks: Arc<dyn BlockStore>,
    pub manifests: Arc<dyn ManifestStore>,
    pub sessions: SessionRegionHandle,
    /// Owner-local ingest, shared by the public and the internal listener.
    pub uploads: Arc<crate::upload::UploadService>,
    pub metrics: Metrics,
    pub admission: crate::admission::Admission,
    pub readiness: Readiness,
    pub started_at: Instant,
    /// Placement: every shard local in embedded mode, the PostgreSQL table in cluster mode.
    pub cluster: Arc<crate::actors::ClusterHandle>,
    /// Bearer-token verification; `None` when `auth.enabled = false`.
    pub auth: Option<Arc<crate::auth::Authenticator>>,
    pub edge: EdgeMetrics,
    /// The pack store and its collector's metrics, when blocks live in packs.
    pub packs: Option<(
        crate::storage::pack::PackStore,
        crate::storage::pack::gc::GcMetrics,
    )>,
    /// The probed state of the block store, PostgreSQL and Redis (`health`).
    pub dependencies: crate::health::DependencyHealth,
}

/// Metrics of the edge: connections of every listener and refused tokens.
#[derive(Clone, Debug, Default)]
pub struct EdgeMetrics {
    pub connections: listener::ConnectionMetrics,
    /// Refused bearer tokens and tenant bindings, by reason (bounded enum).
    pub auth_failures: prometheus_client::metrics::family::Family<
        crate::metrics::ReasonLabels,
        prometheus_client::metrics::counter::Counter,
    >,
}

impl EdgeMetrics {
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        self.connections.register(registry);
        for reason in auth::FAILURE_REASONS {
            drop(
                self.auth_failures
                    .get_or_create(&crate::metrics::ReasonLabels { reason }),
            );
        }
        registry.register(
            "auth_failures",
            "Requests refused by bearer-token authentication, by reason",
            self.auth_failures.clone(),
        );
    }
}

impl AppState {
    /// The manifests as the collector must see them: with the blocks of every live
    /// resumable upload marked (docs/resumable.md).
    pub fn gc_manifests(&self) -> crate::upload::ledger::LiveUploads {
        crate::upload::ledger::LiveUploads {
            manifests: self.manifests.clone(),
            ledger: self.uploads.ledger().clone(),
        }
    }
}
