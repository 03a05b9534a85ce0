//! Prometheus metrics (prometheus-client), registered once at start-up.
//!
//! Labels are bounded: route templates, status classes, fixed enums. Never tenant or
//! session ids, never blob keys.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    pub route: String,
    pub method: String,
    pub status: &'static str,
}

/// Status class label value ("2xx".."5xx", "other").
pub fn status_class(status: u16) -> &'static str {
    match status {
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "other",
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BlockLabels {
    /// "fresh" or "duplicate"
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// "ok", "client_error" or "server_error"
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActorLabels {
    pub actor: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

/// Every metric handle of the node. Cloning is cheap (handles are `Arc`s).
#[derive(Clone)]
pub struct Metrics {
    pub http_requests: Family<HttpLabels, Counter>,
    pub http_duration: Family<HttpLabels, Histogram>,
    pub upload_bytes: Counter,
    pub uploads: Family<OutcomeLabels, Counter>,
    pub upload_duration: Histogram,
    pub download_bytes: Counter,
    pub downloads: Family<OutcomeLabels, Counter>,
    pub blocks: Family<BlockLabels, Counter>,
    /// Committed uploads by chunker (`fastcdc`, `pdf`).
    pub ingests_by_chunker: Family<KindLabels, Counter>,
    /// Cuts of the PDF-aware chunker by kind (`boundary`, `stream`, `fallback`).
    pub pdf_cuts: Family<KindLabels, Counter>,
    /// Uploads refused by the PDF selection or scanner (`signature_missing`,
    /// `type_mismatch`, `unsupported`).
    pub pdf_refusals: Family<KindLabels, Counter>,
    pub hot_sessions: Gauge,
    pub active_sessions: Gauge,
    pub session_stops: Family<ReasonLabels, Counter>,
    pub actor_restarts: Family<ActorLabels, Counter>,
    pub forwarded_uploads: Counter,
    /// Session uploads by routing decision: local, remote.
    pub routing: Family<KindLabels, Counter>,
    /// Routing failures by stage: resolve, owner_address, forward_config.
    pub routing_failures: Family<KindLabels, Counter>,
    /// Shard counts by kind: configured, assigned, local, moving (refreshed on scrape).
    pub shards: Family<KindLabels, Gauge>,
    pub manager_term: Gauge,
    pub observed_nodes: Gauge,
    pub placement_ready: Gauge,
    /// 1 while this node is self-fenced (no successful heartbeat within the fence window).
    pub placement_fenced: Gauge,
    /// 1 while this node holds the manager lock (embedded manager), else 0.
    pub manager_leading: Gauge,
    /// Placement runtime events by kind (table reads, heartbeats, failures, acks).
    pub placement_events: Family<KindLabels, Counter>,
    registry: Arc<std::sync::Mutex<Registry>>,
}

fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 18))
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("graviton");
        let metrics = Self {
            http_requests: Family::default(),
            http_duration: Family::new_with_constructor(duration_histogram),
            upload_bytes: Counter::default(),
            uploads: Family::default(),
            upload_duration: duration_histogram(),
            download_bytes: Counter::default(),
            downloads: Family::default(),
            blocks: Family::default(),
            ingests_by_chunker: Family::default(),
            pdf_cuts: Family::default(),
            pdf_refusals: Family::default(),
            hot_sessions: Gauge::default(),
            active_sessions: Gauge::default(),
            session_stops: Family::default(),
            actor_restarts: Family::default(),
            forwarded_uploads: Counter::default(),
            routing: Family::default(),
            routing_failures: Family::default(),
            shards: Family::default(),
            manager_term: Gauge::default(),
            observed_nodes: Gauge::default(),
            placement_ready: Gauge::default(),
            placement_fenced: Gauge::default(),
            manager_leading: Gauge::default(),
            placement_events: Family::default(),
            registry: Arc::new(std::sync::Mutex::new(Registry::default())),
        };
        metrics.initialize_series();
        registry.register(
            "http_requests",
            "HTTP requests by route, method and status class",
            metrics.http_requests.clone(),
        );
        registry.register(
            "http_request_duration_seconds",
            "HTTP request duration until the response head",
            metrics.http_duration.clone(),
        );
        registry.register(
            "upload_bytes",
            "Body bytes accepted by uploads",
            metrics.upload_bytes.clone(),
        );
        registry.register(
            "uploads",
            "Finished uploads by outcome",
            metrics.uploads.clone(),
        );
        registry.register(
            "upload_duration_seconds",
            "Duration of successful uploads",
            metrics.upload_duration.clone(),
        );
        registry.register(
            "download_bytes",
            "Bytes sent by downloads",
            metrics.download_bytes.clone(),
        );
        registry.register(
            "downloads",
            "Finished downloads by outcome",
            metrics.downloads.clone(),
        );
        registry.register(
            "blocks",
            "Blocks ingested, fresh or duplicate",
            metrics.blocks.clone(),
        );
        registry.register(
            "ingests_by_chunker",
            "Committed uploads by the chunker that cut them (fastcdc or pdf)",
            metrics.ingests_by_chunker.clone(),
        );
        registry.register(
            "pdf_cuts",
            "Cuts of the PDF-aware chunker: at an object boundary, at or inside large stream data, or FastCDC fallback",
            metrics.pdf_cuts.clone(),
        );
        registry.register(
            "pdf_refusals",
            "Uploads refused by the PDF selection (signature missing, type mismatch) or scanner (unsupported, with reject)",
            metrics.pdf_refusals.clone(),
        );
        registry.register(
            "hot_sessions",
            "Session owners held in memory",
            metrics.hot_sessions.clone(),
        );
        registry.register(
            "active_sessions",
            "Sessions with an upload in progress",
            metrics.active_sessions.clone(),
        );
        registry.register(
            "session_stops",
            "Session owners stopped, by reason",
            metrics.session_stops.clone(),
        );
        registry.register(
            "actor_restarts",
            "Actor restarts by the node supervisor",
            metrics.actor_restarts.clone(),
        );
        registry.register(
            "forwarded_uploads",
            "Session uploads streamed to their owner node",
            metrics.forwarded_uploads.clone(),
        );
        registry.register(
            "routing",
            "Session uploads by routing decision",
            metrics.routing.clone(),
        );
        registry.register(
            "routing_failures",
            "Session upload routing failures by stage",
            metrics.routing_failures.clone(),
        );
        registry.register(
            "shards",
            "Shards by kind as seen by this node",
            metrics.shards.clone(),
        );
        registry.register(
            "manager_term",
            "Manager term in this node's placement table",
            metrics.manager_term.clone(),
        );
        registry.register(
            "observed_nodes",
            "Nodes in this node's placement table",
            metrics.observed_nodes.clone(),
        );
        registry.register(
            "placement_ready",
            "1 when placement considers this node ready",
            metrics.placement_ready.clone(),
        );
        registry.register(
            "placement_fenced",
            "1 while this node is self-fenced",
            metrics.placement_fenced.clone(),
        );
        registry.register(
            "manager_leading",
            "1 while this node is the shard manager",
            metrics.manager_leading.clone(),
        );
        registry.register(
            "placement_events",
            "Placement runtime events by kind",
            metrics.placement_events.clone(),
        );
        *metrics.registry.lock().expect("fresh mutex") = registry;
        metrics
    }

    /// Create every series of the bounded label sets at zero, so `/metrics` lists each
    /// family from the start and `rate()`/`increase()` see the first event (a series that
    /// appears at 1 has no increase).
    pub fn initialize_series(&self) {
        for outcome in ["ok", "client_error", "server_error"] {
            drop(self.uploads.get_or_create(&OutcomeLabels { outcome }));
            drop(self.downloads.get_or_create(&OutcomeLabels { outcome }));
        }
        for kind in ["fresh", "duplicate"] {
            drop(self.blocks.get_or_create(&BlockLabels { kind }));
        }
        for kind in ["fastcdc", "pdf"] {
            drop(self.ingests_by_chunker.get_or_create(&KindLabels { kind }));
        }
        for kind in ["boundary", "stream", "fallback"] {
            drop(self.pdf_cuts.get_or_create(&KindLabels { kind }));
        }
        for kind in ["signature_missing", "type_mismatch", "unsupported"] {
            drop(self.pdf_refusals.get_or_create(&KindLabels { kind }));
        }
        for reason in ["evicted", "idle", "unassigned", "failed"] {
            drop(self.session_stops.get_or_create(&ReasonLabels { reason }));
        }
        drop(self.actor_restarts.get_or_create(&ActorLabels {
            actor: "session_region",
        }));
        for kind in ["local", "remote"] {
            drop(self.routing.get_or_create(&KindLabels { kind }));
        }
        for kind in ["resolve", "owner_address", "forward_config"] {
            drop(self.routing_failures.get_or_create(&KindLabels { kind }));
        }
    }

    /// Copy the placement snapshot into the gauges and counters (called on scrape).
    pub fn sync_placement(&self, snapshot: &crate::placement::PlacementSnapshot) {
        let shard = |kind| self.shards.get_or_create(&KindLabels { kind });
        shard("configured").set(i64::from(snapshot.configured_shards));
        shard("assigned").set(snapshot.assigned_shards as i64);
        shard("local").set(snapshot.local_shards as i64);
        shard("moving").set(snapshot.moving_shards as i64);
        self.manager_term.set(snapshot.manager_term.0);
        self.observed_nodes.set(snapshot.nodes.len() as i64);
        self.placement_ready.set(i64::from(snapshot.health.ready));
        self.placement_fenced.set(i64::from(snapshot.fenced));
        let c = &snapshot.counters;
        for (kind, value) in [
            ("table_reads", c.table_reads),
            ("table_read_failures", c.table_read_failures),
            ("heartbeats", c.heartbeats),
            ("heartbeat_failures", c.heartbeat_failures),
            ("reregistrations", c.reregistrations),
            ("revocation_acks", c.acks),
        ] {
            let counter = self.placement_events.get_or_create(&KindLabels { kind });
            let seen = counter.get();
            if value > seen {
                counter.inc_by(value - seen);
            }
        }
    }

    /// Register more metrics (other subsystems) before serving.
    pub fn register_with(&self, register: impl FnOnce(&mut Registry)) {
        let mut registry = self.registry.lock().expect("metrics registry lock");
        register(&mut registry);
    }

    /// OpenMetrics text of every registered metric.
    pub fn encode(&self) -> String {
        let registry = self.registry.lock().expect("metrics registry lock");
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry)
            .expect("encoding into a String");
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

/// A download stream that counts its bytes (`download_bytes`) and records its outcome in
/// `downloads{outcome}` exactly once: `ok` as soon as the last of its `expected` bytes is
/// handed on (an HTTP/1 server drops a body once it has its `Content-Length` bytes,
/// without polling it to its end), `server_error` on an error item (logged),
/// `client_error` when it is dropped before its last byte (the client went away).
/// Every download path (HTTP `GET`, gRPC `GetBlob`) is metered by this one type.
pub struct MeteredDownload<S> {
    inner: std::pin::Pin<Box<S>>,
    metrics: Metrics,
    expected: u64,
    sent: u64,
    done: bool,
}

impl<S> MeteredDownload<S> {
    /// Meter `inner`, which yields `expected` bytes in all.
    pub fn new(inner: S, metrics: Metrics, expected: u64) -> Self {
        Self {
            inner: Box::pin(inner),
            metrics,
            expected,
            sent: 0,
            done: false,
        }
    }

    fn record(&mut self, outcome: &'static str) {
        if !self.done {
            self.done = true;
            self.metrics
                .downloads
                .get_or_create(&OutcomeLabels { outcome })
                .inc();
        }
    }
}

impl<S, E> futures_util::Stream for MeteredDownload<S>
where
    S: futures_util::Stream<Item = Result<bytes::Bytes, E>>,
    E: std::fmt::Display,
{
    type Item = S::Item;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let polled = self.inner.as_mut().poll_next(cx);
        match &polled {
            Poll::Ready(Some(Ok(bytes))) => {
                self.metrics.download_bytes.inc_by(bytes.len() as u64);
                self.sent += bytes.len() as u64;
                if self.sent >= self.expected {
                    self.record("ok");
                }
            }
            Poll::Ready(Some(Err(err))) => {
                // The response is already streaming: it is aborted, never silently short.
                tracing::error!(error = %err, "download aborted");
                self.record("server_error");
            }
            Poll::Ready(None) => self.record("ok"),
            Poll::Pending => {}
        }
        polled
    }
}

impl<S> Drop for MeteredDownload<S> {
    fn drop(&mut self) {
        if self.sent >= self.expected {
            // Every byte was handed on (a zero-length body may never be polled at all).
            self.record("ok");
        } else {
            // Dropped before its last byte: the client went away.
            self.record("client_error");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_encode_with_bounded_labels() {
        let metrics = Metrics::new();
        metrics
            .blocks
            .get_or_create(&BlockLabels { kind: "fresh" })
            .inc_by(3);
        metrics
            .http_requests
            .get_or_create(&HttpLabels {
                route: "/v1/blobs".into(),
                method: "POST".into(),
                status: status_class(201),
            })
            .inc();
        let text = metrics.encode();
        assert!(
            text.contains("graviton_blocks_total{kind=\"fresh\"} 3"),
            "{text}"
        );
        assert!(text.contains("status=\"2xx\""), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }
}
