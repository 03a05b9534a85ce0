//! Operations endpoints: `/healthz`, `/readyz`, `/metrics`, `/v1/ops/cluster`, and
//! `POST /v1/admin/nodes/{node}/drain` (admin token): the same drain request as
//! `graviton drain NODE` (a flag on the node's row that the placement manager acts on).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::edge::AppState;
use crate::edge::{Answer, ApiError, ErrorCode};

#[derive(Serialize)]
struct Status<'a> {
    status: &'a str,
}

#[derive(Serialize)]
struct ReadyStatus {
    /// `ready`, `degraded` (ready, but a dependency failed its last probe) or `not_ready`.
    status: &'static str,
    placement: crate::placement::HealthSnapshot,
    /// Every probed dependency's last state (`health`).
    dependencies:
        std::collections::BTreeMap<crate::health::Dependency, crate::health::DependencyState>,
    /// The dependencies whose last probe failed.
    degraded: Vec<crate::health::Dependency>,
}

pub async fn healthz() -> impl IntoResponse {
    Json(Status { status: "alive" })
}

/// Ready when the node is serving (not starting or shutting down) and placement says so:
/// it owns at least one shard and its table is readable (always true in embedded mode).
/// A ready node whose dependency failed its last probe is `degraded` and still answers
/// 200: it keeps serving what does not need that dependency (docs/operations.md).
pub async fn readyz(State(app): State<Arc<AppState>>) -> Response {
    let placement = app.cluster.health();
    let ready = app.readiness.is_ready() && placement.ready;
    let dependencies = app.dependencies.snapshot();
    let degraded = app.dependencies.failing();
    let body = ReadyStatus {
        status: match (ready, degraded.is_empty()) {
            (false, _) => "not_ready",
            (true, true) => "ready",
            (true, false) => "degraded",
        },
        placement,
        dependencies,
        degraded,
    };
    let status = if ready { Answer::Ok } else { Answer::NotReady };
    (status.status(), Json(body)).into_response()
}

pub async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    app.metrics.sync_placement(&app.cluster.snapshot());
    app.metrics
        .manager_leading
        .set(i64::from(app.cluster.leading_term().await.0 > 0));
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
pub struct NodeOverview {
    pub node: String,
    pub mode: &'static str,
    pub version: &'static str,
    pub ready: bool,
    pub uptime_seconds: u64,
    pub shards: ShardCounts,
    pub sessions: SessionCounts,
    /// Placement detail: health, manager term, epochs, observed nodes, counters.
    pub placement: crate::placement::PlacementSnapshot,
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
    let snapshot = NodeOverview {
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

#[derive(Debug, Serialize)]
pub struct DrainAccepted {
    pub node: String,
    pub status: &'static str,
}

/// `POST /v1/admin/nodes/{node}/drain`: ask the placement manager to move every shard
/// off `node` (202). Embedded mode: 409 `not_clustered`; unknown or dead node: 404.
pub async fn drain(
    State(app): State<Arc<AppState>>,
    Path(node): Path<String>,
    headers: axum::http::HeaderMap,
) -> Result<Response, ApiError> {
    super::admission::require_admin(&app, &headers)?;
    let valid = !node.is_empty()
        && node.len() <= 128
        && node
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !valid {
        return Err(ApiError::new(
            ErrorCode::InvalidNodeId,
            "node ids are ASCII letters, digits, '-', '_' and '.'",
        ));
    }
    if !app.config.cluster.enabled {
        return Err(ApiError::new(
            ErrorCode::NotClustered,
            "this node runs in embedded mode; there is nothing to drain to",
        ));
    }
    let node = crate::ids::NodeId::parse(node)
        .map_err(|e| ApiError::new(ErrorCode::InvalidNodeId, format!("the node id {e}")))?;
    match app.cluster.drain(&node).await {
        Ok(true) => {
            tracing::info!(%node, "drain requested over the admin API");
            Ok((
                Answer::Accepted.status(),
                Json(DrainAccepted {
                    node: node.to_string(),
                    status: "drain_requested",
                }),
            )
                .into_response())
        }
        Ok(false) => Err(ApiError::new(
            ErrorCode::NodeNotFound,
            "no live node with this id in the cluster",
        )),
        Err(err) => {
            tracing::warn!(error = %err, "drain request failed");
            Err(ApiError::drain_unavailable())
        }
    }
}
