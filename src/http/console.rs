//! The operator console: `GET /console` (page, script and style embedded in the binary,
//! no CDN) and `GET /v1/admin/console` (its data, admin token).
//!
//! The page holds no data itself: it asks for the admin token (kept in the tab's
//! `sessionStorage`) and polls the data endpoint every two seconds. The data is read from
//! the same sources as `/readyz` (the placement health snapshot), `/metrics` (the metric
//! handles) and `/v1/admin/admission` (the admission snapshot), so a number on the page
//! equals the metric. It never carries tenant or session ids: decision events keep only
//! the keyed tenant hash that admission writes to Redis (shortened), and a value that
//! looks like a raw UUID is dropped.
//!
//! The health summary at the top of the page is [`summarize`] (pure): the placement
//! status, made `degraded` by a dead node, a failing dependency or a self-fence, with one
//! line per problem; draining nodes are listed without degrading (an operator's act).
//! The 5xx rate comes from this node's `graviton_http_requests_total` ([`http_totals`]
//! reads the encoded registry, so the numbers are the scrape's); the page turns two
//! refreshes' totals into a rate.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::edge::ApiError;
use crate::edge::AppState;
use crate::metrics::KindLabels;

const INDEX: &str = include_str!("../../assets/console/index.html");
const SCRIPT: &str = include_str!("../../assets/console/console.js");
const STYLE: &str = include_str!("../../assets/console/console.css");

/// Security headers of every console asset: no framing, no third-party anything.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        body,
    )
        .into_response()
}

/// `GET /console`
pub async fn page() -> Response {
    asset("text/html; charset=utf-8", INDEX)
}

/// `GET /console/console.js`
pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

/// `GET /console/console.css`
pub async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

#[derive(Debug, Serialize)]
pub struct ConsoleData {
    pub node: String,
    pub mode: &'static str,
    pub version: &'static str,
    pub ready: bool,
    pub uptime_seconds: u64,
    /// The readiness snapshot `/readyz` answers with.
    pub health: crate::placement::HealthSnapshot,
    /// The probed dependencies and those failing, as in `/readyz` (`health`).
    pub dependencies: BTreeMap<crate::health::Dependency, crate::health::DependencyState>,
    pub degraded: Vec<crate::health::Dependency>,
    pub fenced: bool,
    /// The health summary the page shows first ([`summarize`]).
    pub summary: Summary,
    pub manager: Manager,
    pub nodes: Vec<ConsoleNode>,
    pub shards: Shards,
    pub sessions: super::ops::SessionCounts,
    pub admission: AdmissionView,
    pub events: Vec<BTreeMap<&'static str, String>>,
    /// Counter values of `/metrics` (the page turns them into rates).
    pub counters: BTreeMap<&'static str, u64>,
}

#[derive(Debug, Serialize)]
pub struct Manager {
    pub term: i64,
    /// The node named in the placement meta row; `None` when unknown (embedded mode, or
    /// the database is unreachable).
    pub node: Option<String>,
    pub this_node: bool,
}

#[derive(Debug, Serialize)]
pub struct ConsoleNode {
    pub id: String,
    pub state: crate::placement::NodeState,
    pub heartbeat_age_ms: i64,
    pub incarnation: i64,
    pub version: String,
    pub shards: usize,
    /// Shards moving onto this node.
    pub incoming: usize,
}

#[derive(Debug, Serialize)]
pub struct Shards {
    pub count: u32,
    /// Owner of each shard, as an index into `nodes`, or -1 when unassigned.
    pub owners: Vec<i32>,
    /// Shards in motion.
    pub moving: Vec<u32>,
}

#[derive(Debug, Serialize)]
pub struct AdmissionView {
    pub snapshot: Option<crate::admission::AdmissionSnapshot>,
    /// Set when the snapshot could not be read (fixed text).
    pub error: Option<&'static str>,
}

/// The health summary: one status for the page's badge and the problems behind it.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct Summary {
    /// The placement status (`starting`, `healthy`, `rebalancing`, `unassigned`,
    /// `unavailable`), or `degraded` when a ready placement has a dead node, a failing
    /// dependency or a self-fence.
    pub status: &'static str,
    /// One line per problem or notable state, most serious first (fixed text plus node
    /// ids, dependency names and probe errors, which carry no secret).
    pub problems: Vec<String>,
    pub nodes: NodeCounts,
    /// This node's HTTP requests since start, all and 5xx (`graviton_http_requests_total`).
    pub http: HttpTotals,
}

#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct NodeCounts {
    pub total: usize,
    pub active: usize,
    pub joining: usize,
    pub draining: usize,
    pub dead: usize,
}

#[derive(Debug, Default, Serialize, PartialEq, Eq, Clone, Copy)]
pub struct HttpTotals {
    pub requests: u64,
    pub errors_5xx: u64,
}

/// Sum `graviton_http_requests_total` over its series, all and `status="5xx"`, from the
/// text exposition of the registry.
pub fn http_totals(exposition: &str) -> HttpTotals {
    let mut totals = HttpTotals::default();
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix("graviton_http_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        // Counters may carry a created timestamp after the value.
        let value = value.split_whitespace().next().unwrap_or("");
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let value = value as u64;
        totals.requests += value;
        if labels.split(',').any(|l| l == "status=\"5xx\"") {
            totals.errors_5xx += value;
        }
    }
    totals
}

/// The page's health summary from what this node knows: its placement snapshot, whether
/// it fenced itself, the node rows of its shard table and its dependency probes.
pub fn summarize(
    placement: &crate::placement::HealthSnapshot,
    fenced: bool,
    nodes: &[ConsoleNode],
    dependencies: &BTreeMap<crate::health::Dependency, crate::health::DependencyState>,
    http: HttpTotals,
) -> Summary {
    use crate::placement::NodeState;
    let mut counts = NodeCounts {
        total: nodes.len(),
        ..NodeCounts::default()
    };
    let mut dead = Vec::new();
    let mut draining = Vec::new();
    for node in nodes {
        match node.state {
            NodeState::Active => counts.active += 1,
            NodeState::Joining => counts.joining += 1,
            NodeState::Draining => {
                counts.draining += 1;
                draining.push(node.id.as_str());
            }
            NodeState::Dead => {
                counts.dead += 1;
                dead.push(node.id.as_str());
            }
        }
    }
    let mut problems = Vec::new();
    if fenced {
        problems.push("this node has fenced itself (no recent heartbeat)".to_string());
    }
    if !placement.status.is_ready() {
        problems.push(format!("not ready: {}", placement.detail));
    }
    for (dependency, state) in dependencies.iter().filter(|(_, s)| !s.up) {
        problems.push(format!(
            "{} down at {}: {}",
            dependency.as_str(),
            state.address,
            state.error.as_deref().unwrap_or("no answer")
        ));
    }
    if !dead.is_empty() {
        problems.push(format!(
            "{} of {} nodes dead: {}",
            dead.len(),
            counts.total,
            dead.join(", ")
        ));
    }
    if !draining.is_empty() {
        problems.push(format!(
            "{} of {} nodes draining: {}",
            draining.len(),
            counts.total,
            draining.join(", ")
        ));
    }
    if placement.moving_shards > 0 {
        problems.push(format!("{} shards moving", placement.moving_shards));
    }
    let unassigned = placement
        .configured_shards
        .saturating_sub(placement.assigned_shards);
    if unassigned > 0 && placement.checked_at_ms.is_some() {
        problems.push(format!("{unassigned} shards unassigned"));
    }
    let failing = dependencies.values().any(|s| !s.up);
    let status = if placement.status.is_ready() && (fenced || failing || counts.dead > 0) {
        "degraded"
    } else {
        placement.status.as_str()
    };
    Summary {
        status,
        problems,
        nodes: counts,
        http,
    }
}

/// Tenant hash prefix shown on the page.
const TENANT_HASH_CHARS: usize = 12;
/// Event fields the page may show; everything else (lease ids, fencing tokens) is dropped.
const EVENT_FIELDS: [&str; 6] = ["at_ms", "kind", "operation", "outcome", "bytes", "tenant"];

fn looks_like_uuid(text: &str) -> bool {
    uuid::Uuid::parse_str(text).is_ok()
}

/// Keep the allowed fields of one decision event; shorten the tenant hash.
fn event_view(event: BTreeMap<String, String>) -> BTreeMap<&'static str, String> {
    let mut out = BTreeMap::new();
    for field in EVENT_FIELDS {
        let Some(value) = event.get(field) else {
            continue;
        };
        if looks_like_uuid(value) {
            continue;
        }
        let value = if field == "tenant" {
            value.chars().take(TENANT_HASH_CHARS).collect()
        } else {
            value.clone()
        };
        out.insert(field, value);
    }
    out
}

/// One small lazily connecting pool per database URL for the manager row.
fn meta_pool(url: &str) -> Option<sqlx::PgPool> {
    static POOLS: Mutex<Option<HashMap<String, sqlx::PgPool>>> = Mutex::new(None);
    let mut pools = POOLS.lock().ok()?;
    let pools = pools.get_or_insert_with(HashMap::new);
    if let Some(pool) = pools.get(url) {
        return Some(pool.clone());
    }
    let options =
        crate::storage::pg::connect_options(url, Duration::from_secs(2), "graviton-console")
            .ok()?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(options);
    pools.insert(url.to_string(), pool.clone());
    Some(pool)
}

async fn manager_node(app: &AppState) -> Option<String> {
    let url = app.config.cluster.database_url.as_ref()?;
    let pool = meta_pool(url.expose())?;
    let store = crate::storage::pg::PlacementStore::new(pool);
    match tokio::time::timeout(Duration::from_secs(2), store.meta()).await {
        Ok(Ok(meta)) => meta.manager_node,
        _ => None,
    }
}

/// `GET /v1/admin/console` (admin token): everything the console shows.
pub async fn data(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<ConsoleData>, ApiError> {
    super::admission::require_admin(&app, &headers)?;
    let clustered = app.config.cluster.enabled;
    let table = app.cluster.view().table();
    let placement = app.cluster.snapshot();
    let stats = app.sessions.stats().await.ok();

    // Embedded mode has no node rows: the local node owns every shard.
    let mut ids: Vec<&crate::ids::NodeId> = table.nodes.keys().collect();
    if !table.nodes.contains_key(&app.node_id) && table.owned_by(&app.node_id) > 0 {
        ids.push(&app.node_id);
    }
    let index: HashMap<&crate::ids::NodeId, i32> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (*id, i as i32))
        .collect();
    let nodes: Vec<ConsoleNode> = ids
        .iter()
        .map(|id| {
            let row = table.nodes.get(*id);
            ConsoleNode {
                id: id.to_string(),
                state: row.map_or(crate::placement::NodeState::Active, |n| n.state),
                heartbeat_age_ms: row.map_or(0, |n| n.heartbeat_age_ms),
                incarnation: row.map_or(0, |n| n.incarnation),
                version: row.map_or_else(
                    || env!("CARGO_PKG_VERSION").to_string(),
                    |n| n.version.clone(),
                ),
                shards: table.owned_by(id),
                incoming: table
                    .shards
                    .iter()
                    .filter(|s| s.moving_to.as_ref() == Some(*id))
                    .count(),
            }
        })
        .collect();
    let shards = Shards {
        count: table.shard_count(),
        owners: table
            .shards
            .iter()
            .map(|s| {
                s.owner
                    .as_ref()
                    .and_then(|o| index.get(o).copied())
                    .unwrap_or(-1)
            })
            .collect(),
        moving: table
            .shards
            .iter()
            .filter(|s| s.moving_to.is_some())
            .map(|s| s.shard.0)
            .collect(),
    };

    let leading = app.cluster.leading_term().await.0 > 0;
    let manager = Manager {
        term: placement.manager_term.0,
        node: if clustered {
            manager_node(&app).await
        } else {
            None
        },
        this_node: leading,
    };

    let admission = match app
        .admission
        .snapshot(None, Some(crate::admission::BACKEND))
        .await
    {
        Ok(snapshot) => AdmissionView {
            snapshot: Some(snapshot),
            error: None,
        },
        Err(_) => AdmissionView {
            snapshot: None,
            error: Some("the admission coordinator is unreachable"),
        },
    };
    let events = match app.admission.coordinator() {
        Some(coordinator) => coordinator
            .recent_events(20)
            .await
            .map(|events| events.into_iter().map(event_view).collect())
            .unwrap_or_default(),
        None => Vec::new(),
    };

    let m = &app.metrics;
    let kind = |family: &prometheus_client::metrics::family::Family<
        KindLabels,
        prometheus_client::metrics::counter::Counter,
    >,
                kind: &'static str| family.get_or_create(&KindLabels { kind }).get();
    let counters = BTreeMap::from([
        ("routing_local", kind(&m.routing, "local")),
        ("routing_remote", kind(&m.routing, "remote")),
        ("forwarded_uploads", m.forwarded_uploads.get()),
        (
            "routing_failures_resolve",
            kind(&m.routing_failures, "resolve"),
        ),
        (
            "routing_failures_owner_address",
            kind(&m.routing_failures, "owner_address"),
        ),
        (
            "routing_failures_forward_config",
            kind(&m.routing_failures, "forward_config"),
        ),
        ("upload_bytes", m.upload_bytes.get()),
        ("download_bytes", m.download_bytes.get()),
    ]);

    let dependencies = app.dependencies.snapshot();
    let summary = summarize(
        &placement.health,
        placement.fenced,
        &nodes,
        &dependencies,
        http_totals(&m.encode()),
    );

    Ok(Json(ConsoleData {
        node: app.node_id.to_string(),
        mode: if clustered { "cluster" } else { "embedded" },
        version: env!("CARGO_PKG_VERSION"),
        ready: app.readiness.is_ready() && placement.health.ready,
        uptime_seconds: app.started_at.elapsed().as_secs(),
        health: placement.health.clone(),
        degraded: dependencies
            .iter()
            .filter(|(_, s)| !s.up)
            .map(|(d, _)| *d)
            .collect(),
        dependencies,
        fenced: placement.fenced,
        summary,
        manager,
        nodes,
        shards,
        sessions: super::ops::SessionCounts {
            hot: stats.map(|s| s.hot_sessions).unwrap_or(0),
            active: stats.map(|s| s.active_sessions).unwrap_or(0),
            capacity: stats
                .map(|s| s.capacity)
                .unwrap_or(app.config.sessions.max_hot),
        },
        admission,
        events,
        counters,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_keep_only_allowed_fields_and_a_short_tenant_hash() {
        let event = BTreeMap::from([
            ("kind".to_string(), "acquire".to_string()),
            ("lease".to_string(), "lease-secret-id".to_string()),
            ("fencing_token".to_string(), "42".to_string()),
            ("tenant".to_string(), "a".repeat(64)),
            ("outcome".to_string(), "admitted".to_string()),
        ]);
        let view = event_view(event);
        assert_eq!(view.get("tenant").map(String::len), Some(TENANT_HASH_CHARS));
        assert!(!view.contains_key("lease") && !view.contains_key("fencing_token"));
        assert_eq!(view.get("outcome").map(String::as_str), Some("admitted"));
    }

    #[test]
    fn a_raw_tenant_uuid_never_reaches_the_page() {
        let raw = "2f1c7a8e-35eb-4cd0-8c35-74a5381818eb";
        let view = event_view(BTreeMap::from([("tenant".to_string(), raw.to_string())]));
        assert!(!view.contains_key("tenant"));
    }

    fn placement(status: crate::placement::HealthStatus) -> crate::placement::HealthSnapshot {
        let mut snapshot = crate::placement::HealthSnapshot::starting(64);
        snapshot.status = status;
        snapshot.ready = status.is_ready();
        snapshot.assigned_shards = 64;
        snapshot.checked_at_ms = Some(1);
        snapshot.detail = "placement is settled";
        snapshot
    }

    fn node(id: &str, state: crate::placement::NodeState) -> ConsoleNode {
        ConsoleNode {
            id: id.into(),
            state,
            heartbeat_age_ms: 10,
            incarnation: 1,
            version: "0.1.0".into(),
            shards: 0,
            incoming: 0,
        }
    }

    fn dependency(up: bool) -> crate::health::DependencyState {
        crate::health::DependencyState {
            up,
            address: "redis://127.0.0.1:6379".into(),
            error: (!up).then(|| "connection refused".into()),
        }
    }

    // Checks OPS-11.
    #[test]
    fn a_dead_node_or_a_failing_dependency_degrades_a_healthy_placement() {
        use crate::health::Dependency;
        use crate::placement::{HealthStatus, NodeState};
        let healthy = placement(HealthStatus::Healthy);
        let up = BTreeMap::from([(Dependency::Redis, dependency(true))]);
        let nodes = [
            node("node-1", NodeState::Active),
            node("node-2", NodeState::Active),
        ];
        let all_well = summarize(&healthy, false, &nodes, &up, HttpTotals::default());
        assert_eq!(all_well.status, "healthy");
        assert!(all_well.problems.is_empty(), "{:?}", all_well.problems);

        let nodes = [
            node("node-1", NodeState::Active),
            node("node-2", NodeState::Dead),
            node("node-3", NodeState::Draining),
        ];
        let summary = summarize(&healthy, false, &nodes, &up, HttpTotals::default());
        assert_eq!(summary.status, "degraded");
        assert_eq!((summary.nodes.dead, summary.nodes.draining), (1, 1));
        assert!(
            summary
                .problems
                .contains(&"1 of 3 nodes dead: node-2".to_string())
        );
        assert!(
            summary
                .problems
                .contains(&"1 of 3 nodes draining: node-3".to_string())
        );

        let down = BTreeMap::from([(Dependency::Redis, dependency(false))]);
        let summary = summarize(&healthy, false, &nodes[..1], &down, HttpTotals::default());
        assert_eq!(summary.status, "degraded");
        assert_eq!(
            summary.problems,
            ["redis down at redis://127.0.0.1:6379: connection refused"]
        );
    }

    #[test]
    fn draining_alone_does_not_degrade_and_a_worse_placement_status_stays() {
        use crate::placement::{HealthStatus, NodeState};
        let nodes = [
            node("node-1", NodeState::Active),
            node("node-3", NodeState::Draining),
        ];
        let summary = summarize(
            &placement(HealthStatus::Healthy),
            false,
            &nodes,
            &BTreeMap::new(),
            HttpTotals::default(),
        );
        assert_eq!(summary.status, "healthy");
        assert_eq!(summary.problems, ["1 of 2 nodes draining: node-3"]);

        // Not ready stays what placement says, with the reason first.
        let mut unavailable = placement(HealthStatus::Unavailable);
        unavailable.detail = "placement unreadable";
        let dead = [node("node-2", NodeState::Dead)];
        let summary = summarize(
            &unavailable,
            true,
            &dead,
            &BTreeMap::new(),
            HttpTotals::default(),
        );
        assert_eq!(summary.status, "unavailable");
        assert_eq!(
            summary.problems[..2],
            [
                "this node has fenced itself (no recent heartbeat)".to_string(),
                "not ready: placement unreadable".to_string()
            ]
        );
    }

    // Checks OPS-11.
    #[test]
    fn http_totals_sum_every_series_and_the_5xx_ones() {
        let metrics = crate::metrics::Metrics::new();
        for (route, status, n) in [
            ("/v1/blobs", 201, 5),
            ("/v1/blobs/{key}", 200, 3),
            ("/v1/blobs/{key}", 503, 2),
            ("/readyz", 500, 1),
            ("/v1/blobs", 404, 4),
        ] {
            metrics
                .http_requests
                .get_or_create(&crate::metrics::HttpLabels {
                    route: route.into(),
                    method: "GET".into(),
                    status: crate::metrics::status_class(status),
                })
                .inc_by(n);
        }
        assert_eq!(
            http_totals(&metrics.encode()),
            HttpTotals {
                requests: 15,
                errors_5xx: 3
            }
        );
        assert_eq!(http_totals(""), HttpTotals::default());
    }
}
