//! CORS for browser clients of the public API (tower-http's `CorsLayer`).
//!
//! Off unless `http.cors.allowed_origins` lists origins. Preflights allow the methods of
//! the public API (`PATCH` for tus) and the headers a browser upload sends
//! (`Authorization`, `Content-Type`, the two locality headers, the declared digest
//! (`Content-Digest`, `X-Content-Hash`), `Range`, `If-None-Match`, and the tus request
//! headers); responses expose `Location`, `ETag`, `Retry-After`, the
//! range headers and the tus response headers (`Upload-Offset`, `Graviton-Blob-Key`, …),
//! so a browser tus client such as tus-js-client on another origin can resume. No
//! credentials mode: the API uses bearer tokens, not cookies.

use axum::http::{HeaderName, HeaderValue, Method, header};
use tower_http::cors::{AllowOrigin, CorsLayer};

use super::config::CorsConfig;
use crate::edge::headers::{
    CONTENT_DIGEST_HEADER, CONTENT_HASH_HEADER, SESSION_HEADER, TENANT_HEADER,
};
use crate::tus;

/// The layer for `config`, or `None` when CORS is off.
pub fn layer(config: &CorsConfig) -> Option<CorsLayer> {
    if config.allowed_origins.is_empty() {
        return None;
    }
    let origins = if config.allowed_origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            config
                .allowed_origins
                .iter()
                .filter_map(|o| HeaderValue::from_str(o).ok()),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(origins)
            .allow_methods([
                Method::GET,
                Method::HEAD,
                Method::POST,
                Method::PUT,
                Method::DELETE,
                Method::PATCH,
            ])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                HeaderName::from_static(TENANT_HEADER),
                HeaderName::from_static(SESSION_HEADER),
                HeaderName::from_static(CONTENT_DIGEST_HEADER),
                HeaderName::from_static(CONTENT_HASH_HEADER),
                header::RANGE,
                header::IF_NONE_MATCH,
                HeaderName::from_static(tus::TUS_RESUMABLE),
                HeaderName::from_static(tus::UPLOAD_LENGTH),
                HeaderName::from_static(tus::UPLOAD_OFFSET),
                HeaderName::from_static(tus::UPLOAD_METADATA),
                HeaderName::from_static(tus::UPLOAD_CHECKSUM),
            ])
            .expose_headers([
                header::LOCATION,
                header::ETAG,
                header::RETRY_AFTER,
                header::CONTENT_RANGE,
                header::ACCEPT_RANGES,
                HeaderName::from_static(tus::TUS_RESUMABLE),
                HeaderName::from_static(tus::TUS_VERSION),
                HeaderName::from_static(tus::TUS_EXTENSION),
                HeaderName::from_static(tus::TUS_MAX_SIZE),
                HeaderName::from_static(tus::TUS_CHECKSUM_ALGORITHM),
                HeaderName::from_static(tus::UPLOAD_OFFSET),
                HeaderName::from_static(tus::UPLOAD_LENGTH),
                HeaderName::from_static(tus::UPLOAD_EXPIRES),
                HeaderName::from_static(tus::UPLOAD_METADATA),
                HeaderName::from_static(tus::BLOB_KEY),
            ])
            .max_age(config.max_age.get()),
    )
}
