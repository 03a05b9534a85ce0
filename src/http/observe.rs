//! Request metrics middleware: counts and times every request by route template.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;

use super::AppState;
use crate::metrics::{HttpLabels, status_class};

pub async fn record(State(app): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let method = match request.method().as_str() {
        m @ ("GET" | "HEAD" | "POST" | "PUT" | "DELETE") => m.to_string(),
        _ => "other".to_string(),
    };
    let response = next.run(request).await;
    let labels = HttpLabels {
        route,
        method,
        status: status_class(response.status().as_u16()),
    };
    app.metrics.http_requests.get_or_create(&labels).inc();
    app.metrics
        .http_duration
        .get_or_create(&labels)
        .observe(started.elapsed().as_secs_f64());
    response
}
