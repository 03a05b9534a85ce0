//! HTTP server: the public API, ops and admin endpoints, and the owner side of relayed
//! requests (the internal listener). What it shares with gRPC (the state, error
//! vocabulary, listener loop, TLS, tenant binding and header checks) is `edge`'s; the
//! node-to-node client is `relay`.
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
//! - [`observe`]: request metrics
//! - [`cors`]: the CORS layer for browser clients
//! - [`internal`], [`tus_internal`]: the owner side of relayed uploads and tus requests
//! - [`config`]: the `[http]` section

pub mod admin_gate;
pub mod admission;
pub mod config;
pub mod console;
pub mod cors;
pub mod download;
pub mod internal;
pub mod observe;
pub mod openapi;
pub mod ops;
pub mod rejections;
pub mod tus;
pub mod tus_internal;
pub mod unread;
pub mod upload;

use std::sync::Arc;

use axum::Router;
use axum::extract::FromRef;
use axum::routing::{MethodRouter, get, post, put};

use crate::edge::AppState;
use crate::edge::{listener, tls};
use crate::relay::Forwarder;

/// The public router's state: the shared [`AppState`], and the relay to sessions' owners
/// (cluster mode), which only the upload and tus handlers use. Handlers extract either.
#[derive(Clone)]
pub struct PublicState {
    pub app: Arc<AppState>,
    pub relay: Relay,
}

/// The relay of the public API: streams requests of remotely owned sessions to their
/// owner; `None` when this node forwards nothing (embedded mode).
#[derive(Clone, Default)]
pub struct Relay(pub Option<Forwarder>);

impl FromRef<PublicState> for Arc<AppState> {
    fn from_ref(state: &PublicState) -> Self {
        state.app.clone()
    }
}

impl FromRef<PublicState> for Relay {
    fn from_ref(state: &PublicState) -> Self {
        state.relay.clone()
    }
}

/// Serve the public API of `state` on `listener` until `shutdown` completes, with the
/// connection limits, CORS and TLS of `state.config.http` (see `edge::listener`);
/// requests of sessions owned elsewhere go through `relay`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    relay: Option<Forwarder>,
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
        name: listener::PUBLIC,
        limits: state.config.http.public_limits(),
        tls,
        metrics: state.edge.connections.clone(),
    };
    let router = router(PublicState {
        app: state,
        relay: Relay(relay),
    });
    listener::serve(listener, router, options, shutdown).await
}

/// The routes of the public router, as `(path, handlers)`. [`router`] serves exactly these;
/// [`route_paths`] lists them for the OpenAPI check (`tests/openapi.rs`). Built without
/// state, so the list can be read without a running node.
pub fn routes() -> Vec<(&'static str, MethodRouter<PublicState>)> {
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
pub fn router(state: PublicState) -> Router {
    let app = state.app.clone();
    let cors = cors::layer(&app.config.http.cors);
    let router = routes()
        .into_iter()
        .fold(Router::new(), |router, (path, handlers)| {
            router.route(path, handlers)
        })
        // inner: the admin gate runs after routing, before any extractor
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            admin_gate::check,
        ))
        .route_layer(axum::middleware::from_fn_with_state(app, observe::record))
        .layer(axum::middleware::from_fn(rejections::json_errors))
        .layer(axum::middleware::from_fn(unread::close_if_unread))
        .with_state(state);
    match cors {
        Some(cors) => router.layer(cors),
        None => router,
    }
}
