//! The admin token is checked before anything else of an admin request is looked at.
//!
//! Handlers of admin endpoints check the token themselves, but axum runs their extractors
//! (query string, JSON body) first, so a caller without the token learned from a 400/415/
//! 422 what the endpoint expects. This layer answers 401/403 first for every
//! `/v1/admin/...` request and for `DELETE /v1/blobs/{key}`. Found by `scripts/fuzz-api`.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::edge::AppState;

/// Is this request one of the admin API?
pub fn is_admin(method: &Method, path: &str) -> bool {
    path.starts_with("/v1/admin/") || (method == Method::DELETE && path.starts_with("/v1/blobs/"))
}

/// Middleware: refuse admin requests without a valid admin token before their extractors.
pub async fn check(State(app): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if is_admin(request.method(), request.uri().path())
        && let Err(err) = super::admission::require_admin(&app, request.headers())
    {
        return err.into_response();
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_requests_are_recognised() {
        assert!(is_admin(&Method::PUT, "/v1/admin/tenants/x/admission"));
        assert!(is_admin(&Method::DELETE, "/v1/blobs/blake3:00:1"));
        assert!(!is_admin(&Method::GET, "/v1/blobs/blake3:00:1"));
        assert!(!is_admin(&Method::GET, "/v1/ops/cluster"));
        assert!(!is_admin(&Method::GET, "/console"));
    }
}
