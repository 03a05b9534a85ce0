//! The OpenAPI 3.1 document of the public, operations and admin endpoints, served at
//! `GET /openapi.json`.
//!
//! The document is kept by hand in `docs/openapi.json` and embedded at build time. It is
//! checked against the router both ways by `tests/openapi.rs` (every route documented,
//! every documented path and method routed), and against a live node by `scripts/fuzz-api`
//! (schemathesis).

use axum::http::header;
use axum::response::IntoResponse;

/// The document, as committed in `docs/openapi.json`.
pub const DOCUMENT: &str = include_str!("../../docs/openapi.json");

/// `GET /openapi.json`
pub async fn document() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], DOCUMENT)
}
