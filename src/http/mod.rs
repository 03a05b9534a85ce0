//! HTTP server: public API, ops endpoints, and the error mapping.
//!
//! - [`upload`]: `POST /v1/blobs`
//! - [`admission`]: transfer admission at the edge, egress charging, admin admission API
//! - [`download`]: `GET`/`HEAD /v1/blobs/{key}`
//! - [`ops`]: `/healthz`, `/readyz`, `/metrics`, `/v1/ops/cluster`
//! - [`openapi`]: the OpenAPI 3.1 document, `GET /openapi.json`
//! - [`console`]: the operator console, `GET /console` and its data `GET /v1/admin/console`
//! - [`rejections`]: extractor rejections answered in the JSON error format
//! - [`unread`]: `Connection: close` on answers sent before the request body was read
//! - [`admin_gate`]: the admin token checked before an admin request's extractors
//! - [`headers`]: header checks that run before the body is read
//! - [`error`]: [`ApiError`], the one place errors become responses
//! - [`observe`]: request metrics
//! - [`auth`]: the JWT binding of the tenant (which caller a request acts for)
//! - [`cors`]: the CORS layer for browser clients
//! - [`listener`]: the accept loop of every listener (timeouts, bounds, TLS, shutdown)
//! - [`tls`]: rustls configurations of the public and internal listeners
//! - [`config`]: the `[http]` section

pub mod admin_gate;
pub mod admission;
pub mod auth;
pub mod config;
pub mod console;
pub mod cors;
pub mod download;
pub mod error;
pub mod forward;
pub mod headers;
pub mod internal;
pub mod listener;
pub mod observe;
pub mod openapi;
pub mod ops;
pub mod rejections;
pub mod tls;
pub mod tus;
pub mod tus_internal;
pub mod unread;
pub mod upload;

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::routing::{MethodRouter, get, post, put};

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
    /// Owner-local ingest, shared by the public and the internal listener.
    pub uploads: Arc<crate::upload::UploadService>,
    pub metrics: Metrics,
    pub admission: crate::admission::Admission,
    pub readiness: ops::Readiness,
    pub started_at: Instant,
    /// Placement: every shard local in embedded mode, the PostgreSQL table in cluster mode.
    pub cluster: Arc<crate::actors::ClusterHandle>,
    /// Streams uploads of remotely owned sessions to their owner (cluster mode).
    pub forwarder: Option<forward::Forwarder>,
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

/// Serve the public API of `state` on `listener` until `shutdown` completes, with the
/// connection limits, CORS and TLS of `state.config.http` (see [`listener`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let tls = if state.config.http.tls.enabled() {
        Some(
            tls::public_acceptor(&state.config.http.tls)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?,
        )
    } else {
        None
    };
    let options = listener::ServeOptions {
        name: "public",
        limits: state.config.http.public_limits(),
        tls,
        metrics: state.edge.connections.clone(),
    };
    listener::serve(listener, router(state), options, shutdown).await
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

/// The routes of the public router, as `(path, handlers)`. [`router`] serves exactly these;
/// [`route_paths`] lists them for the OpenAPI check (`tests/openapi.rs`). Built without
/// state, so the list can be read without a running node.
pub fn routes() -> Vec<(&'static str, MethodRouter<Arc<AppState>>)> {
    vec![
        ("/v1/blobs", post(upload::post_blob)),
        ("/v1/uploads", post(tus::create).options(tus::options)),
        (
            "/v1/uploads/{id}",
            axum::routing::head(tus::head)
                .patch(tus::patch)
                .delete(tus::delete)
                .options(tus::options),
        ),
        (
            "/v1/blobs/{key}",
            get(download::get_blob).delete(download::delete_blob),
        ),
        ("/healthz", get(ops::healthz)),
        ("/readyz", get(ops::readyz)),
        ("/metrics", get(ops::metrics)),
        ("/v1/ops/cluster", get(ops::cluster)),
        (
            "/v1/admin/tenants/{tenant}/admission",
            put(admission::put_override).delete(admission::delete_override),
        ),
        ("/v1/admin/admission", get(admission::snapshot)),
        (
            "/v1/admin/admission/limits",
            get(admission::get_limits).put(admission::put_limits),
        ),
        (
            "/v1/admin/backends/{backend}/admission",
            put(admission::put_backend_override).delete(admission::delete_backend_override),
        ),
        ("/v1/admin/nodes/{node}/drain", post(ops::drain)),
        ("/v1/admin/gc", post(download::run_gc)),
        // operator surface (src/http/openapi.rs, src/http/console.rs)
        ("/openapi.json", get(openapi::document)),
        ("/console", get(console::page)),
        ("/console/console.js", get(console::script)),
        ("/console/console.css", get(console::style)),
        ("/v1/admin/console", get(console::data)),
    ]
}

/// Paths of [`routes`], in order.
pub fn route_paths() -> Vec<&'static str> {
    routes().into_iter().map(|(path, _)| path).collect()
}

/// The public router.
pub fn router(state: Arc<AppState>) -> Router {
    let cors = cors::layer(&state.config.http.cors);
    let router = routes()
        .into_iter()
        .fold(Router::new(), |router, (path, handlers)| {
            router.route(path, handlers)
        })
        // inner: the admin gate runs after routing, before any extractor
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            admin_gate::check,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            observe::record,
        ))
        .layer(axum::middleware::from_fn(rejections::json_errors))
        .layer(axum::middleware::from_fn(unread::close_if_unread))
        .with_state(state);
    match cors {
        Some(cors) => router.layer(cors),
        None => router,
    }
}
