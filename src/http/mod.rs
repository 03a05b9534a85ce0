//! HTTP server: public API, ops endpoints, and the error mapping.
//!
//! - [`upload`]: `POST /v1/blobs`
//! - [`admission`]: transfer admission at the edge, egress charging, admin admission API
//! - [`download`]: `GET`/`HEAD /v1/blobs/{key}`
//! - [`ops`]: `/healthz`, `/readyz`, `/metrics`, `/v1/ops/cluster`
//! - [`headers`]: header checks that run before the body is read
//! - [`error`]: [`ApiError`], the one place errors become responses
//! - [`observe`]: request metrics

pub mod admission;
pub mod download;
pub mod error;
pub mod forward;
pub mod headers;
pub mod internal;
pub mod observe;
pub mod ops;
pub mod upload;

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::routing::{get, post, put};

pub use error::ApiError;

use crate::actors::SessionRegionHandle;
use crate::config::Config;
use crate::ids::NodeId;
use crate::metrics::Metrics;
use crate::storage::{BlockStore, ManifestStore};

/// Everything a request handler may use.
pub struct AppState {
    pub node_id: NodeId,
    pub config: Arc<Config>,
    pub blocks: Arc<dyn BlockStore>,
    pub manifests: Arc<dyn ManifestStore>,
    pub sessions: SessionRegionHandle,
    pub metrics: Metrics,
    pub admission: crate::admission::Admission,
    pub readiness: ops::Readiness,
    pub started_at: Instant,
    /// Placement: every shard local in embedded mode, the PostgreSQL table in cluster mode.
    pub cluster: Arc<crate::placement::ClusterHandle>,
    /// Streams uploads of remotely owned sessions to their owner (cluster mode).
    pub forwarder: Option<forward::Forwarder>,
    /// The pack store and its collector's metrics, when blocks live in packs.
    pub packs: Option<(
        crate::storage::pack::PackStore,
        crate::storage::pack::gc::GcMetrics,
    )>,
}

/// The public router.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/blobs", post(upload::post_blob))
        .route(
            "/v1/blobs/{key}",
            get(download::get_blob).delete(download::delete_blob),
        )
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/v1/ops/cluster", get(ops::cluster))
        .route(
            "/v1/admin/tenants/{tenant}/admission",
            put(admission::put_override).delete(admission::delete_override),
        )
        .route("/v1/admin/admission", get(admission::snapshot))
        .route("/v1/admin/gc", post(download::run_gc))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            observe::record,
        ))
        .with_state(state)
}
