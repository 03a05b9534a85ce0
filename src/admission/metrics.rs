//! Prometheus handles of admission. Labels are bounded: operation, outcome, kind; never
//! tenant or backend ids. The node registers them once with [`AdmissionMetrics::register`].

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::footprint::Operation;
use crate::storage::redis::reply::Occupancy;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub operation: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    pub operation: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

fn wait_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// Every admission metric. Clones share the same series.
#[derive(Clone, Debug)]
pub struct AdmissionMetrics {
    /// `graviton_admission_decisions_total{operation,outcome}`
    pub decisions: Family<DecisionLabels, Counter>,
    /// `graviton_admission_wait_seconds{operation}` (admitted transfers)
    pub wait_seconds: Family<OperationLabels, Histogram, fn() -> Histogram>,
    /// `graviton_admission_lease_loss_total{operation}`
    pub lease_losses: Family<OperationLabels, Counter>,
    /// `graviton_admission_releases_total{outcome}`: released, missing, stale, error
    pub releases: Family<OutcomeLabels, Counter>,
    /// `graviton_admission_quota_rejections_total{kind}`: request, egress
    pub quota_rejections: Family<KindLabels, Counter>,
    /// `graviton_admission_delivered_egress_bytes_total`
    pub egress_bytes: Counter,
    /// `graviton_admission_local_available_bytes`
    pub local_available_bytes: Gauge,
    /// `graviton_admission_cluster_service_bytes` (last observed)
    pub cluster_service_bytes: Gauge,
    /// `graviton_admission_cluster_service_transfers` (last observed)
    pub cluster_service_transfers: Gauge,
}

impl Default for AdmissionMetrics {
    fn default() -> Self {
        Self {
            decisions: Family::default(),
            wait_seconds: Family::new_with_constructor(wait_histogram),
            lease_losses: Family::default(),
            releases: Family::default(),
            quota_rejections: Family::default(),
            egress_bytes: Counter::default(),
            local_available_bytes: Gauge::default(),
            cluster_service_bytes: Gauge::default(),
            cluster_service_transfers: Gauge::default(),
        }
    }
}

impl AdmissionMetrics {
    /// Register under `admission_`; the node's registry carries the `graviton` prefix.
    pub fn register(&self, registry: &mut Registry) {
        self.initialize_series();
        let r = registry.sub_registry_with_prefix("admission");
        r.register(
            "decisions",
            "Admission decisions by operation and outcome",
            self.decisions.clone(),
        );
        r.register(
            "wait_seconds",
            "Time to admission of admitted transfers",
            self.wait_seconds.clone(),
        );
        r.register(
            "lease_loss",
            "Cluster leases lost while their transfer ran",
            self.lease_losses.clone(),
        );
        r.register(
            "releases",
            "Cluster lease releases by reply",
            self.releases.clone(),
        );
        r.register(
            "quota_rejections",
            "Traffic quota rejections by kind",
            self.quota_rejections.clone(),
        );
        r.register(
            "delivered_egress_bytes",
            "Download bytes charged to egress quotas",
            self.egress_bytes.clone(),
        );
        r.register(
            "local_available_bytes",
            "Free bytes of the process transfer budget",
            self.local_available_bytes.clone(),
        );
        r.register(
            "cluster_service_bytes",
            "Last observed cluster-wide admitted bytes",
            self.cluster_service_bytes.clone(),
        );
        r.register(
            "cluster_service_transfers",
            "Last observed cluster-wide admitted transfers",
            self.cluster_service_transfers.clone(),
        );
    }

    /// Create every series of the bounded label sets at zero, so each family is listed
    /// in `/metrics` from the start and the first event shows as an increase.
    fn initialize_series(&self) {
        for operation in Operation::ALL {
            let operation = operation.as_str();
            for outcome in [
                "admitted",
                "never_fits",
                "timed_out",
                "saturated",
                "quota_exceeded",
                "unavailable",
                "protocol_error",
            ] {
                drop(
                    self.decisions
                        .get_or_create(&DecisionLabels { operation, outcome }),
                );
            }
            drop(
                self.lease_losses
                    .get_or_create(&OperationLabels { operation }),
            );
            drop(
                self.wait_seconds
                    .get_or_create(&OperationLabels { operation }),
            );
        }
        for outcome in ["released", "missing", "stale", "error"] {
            drop(self.releases.get_or_create(&OutcomeLabels { outcome }));
        }
        for kind in ["request", "egress"] {
            drop(self.quota_rejections.get_or_create(&KindLabels { kind }));
        }
    }

    pub fn decision(&self, operation: Operation, outcome: &'static str) {
        self.decisions
            .get_or_create(&DecisionLabels {
                operation: operation.as_str(),
                outcome,
            })
            .inc();
    }

    pub fn observe_occupancy(&self, occupancy: &Occupancy) {
        self.cluster_service_bytes
            .set(occupancy.service_bytes.min(i64::MAX as u64) as i64);
        self.cluster_service_transfers
            .set(occupancy.service_transfers.min(i64::MAX as u64) as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_metrics_render_without_tenant_labels() {
        let metrics = AdmissionMetrics::default();
        metrics.decision(Operation::Upload, "admitted");
        metrics
            .lease_losses
            .get_or_create(&OperationLabels {
                operation: "download",
            })
            .inc();
        let mut registry = Registry::with_prefix("graviton");
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(
                "graviton_admission_decisions_total{operation=\"upload\",outcome=\"admitted\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("graviton_admission_lease_loss_total{operation=\"download\"} 1"),
            "{text}"
        );
        assert!(!text.contains("tenant"));
    }
}
