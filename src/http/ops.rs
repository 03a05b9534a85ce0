//! Operations endpoints: `/healthz`, `/readyz`, `/metrics`, `/v1/ops/cluster`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::AppState;

/// Whether this node should receive traffic. In embedded mode it becomes ready once the
/// stores are open and the actors run (every shard is local), and stops being ready when
/// shutdown begins.
#[derive(Debug, Clone, Default)]
pub struct Readiness {
    ready: Arc<AtomicBool>,
}

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

#[derive(Serialize)]
struct Status<'a> {
    status: &'a str,
}

#[derive(Serialize)]
struct ReadyStatus {
    status: &'static str,
    placement: crate::placement::HealthSnapshot,
}

pub async fn healthz() -> impl IntoResponse {
    Json(Status { status: "alive" })
}

/// Ready when the node is serving (not starting or shutting down) and placement says so:
/// it owns at least one shard and its table is readable (always true in embedded mode).
pub async fn readyz(State(app): State<Arc<AppState>>) -> Response {
    let placement = app.cluster.health();
    let ready = app.readiness.is_ready() && placement.ready;
    let body = ReadyStatus {
        status: if ready { "ready" } else { "not_ready" },
        placement,
    };
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

pub async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.encode(),
    )
        .into_response()
}

/// Operator snapshot. Never carries tenant or session values.
#[derive(Debug, Serialize)]
pub struct ClusterSnapshot {
    pub node: String,
    pub mode: &'static str,
    pub version: &'static str,
    pub ready: bool,
    pub uptime_seconds: u64,
    pub shards: ShardCounts,
    pub sessions: SessionCounts,
    /// Placement detail: health, manager term, epochs, observed nodes, counters.
    pub placement: crate::placement::ClusterSnapshot,
}

#[derive(Debug, Serialize)]
pub struct ShardCounts {
    pub configured: u32,
    pub assigned: usize,
    pub local: usize,
}

#[derive(Debug, Serialize)]
pub struct SessionCounts {
    pub hot: usize,
    pub active: usize,
    pub capacity: usize,
}

pub async fn cluster(State(app): State<Arc<AppState>>) -> Response {
    let stats = app.sessions.stats().await.ok();
    let placement = app.cluster.snapshot();
    let snapshot = ClusterSnapshot {
        node: app.node_id.to_string(),
        mode: if app.config.cluster.enabled {
            "cluster"
        } else {
            "embedded"
        },
        version: env!("CARGO_PKG_VERSION"),
        ready: app.readiness.is_ready() && placement.health.ready,
        uptime_seconds: app.started_at.elapsed().as_secs(),
        shards: ShardCounts {
            configured: placement.configured_shards,
            assigned: placement.assigned_shards,
            local: placement.local_shards,
        },
        sessions: SessionCounts {
            hot: stats.map(|s| s.hot_sessions).unwrap_or(0),
            active: stats.map(|s| s.active_sessions).unwrap_or(0),
            capacity: stats
                .map(|s| s.capacity)
                .unwrap_or(app.config.sessions.max_hot),
        },
        placement,
    };
    Json(snapshot).into_response()
}
