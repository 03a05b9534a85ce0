//! Dependency health: every node probes what its data path depends on (OPS-4).
//!
//! - The block store, always (`BlockStore::probe`: the pack directory on a local disk, a
//!   `HEAD` on the bucket on S3).
//! - PostgreSQL, in cluster mode (`SELECT 1` on the node's own pool).
//! - Redis, when `[admission.redis]` is configured (`PING` on the coordinator's
//!   connection).
//!
//! The first round runs before the node reports ready, then one round every
//! `health.probe_interval`, each probe bounded by `health.probe_timeout`. A dependency
//! that fails its probe makes the node `degraded`: `/readyz` says so in its body, with the
//! failing dependency, and keeps answering 200 (a degraded node may still serve reads
//! that need only what is up, and taking every node out of rotation for a shared
//! dependency helps nobody); `graviton_dependency_up{dependency}` is 0; the console
//! shows it. Each state change is logged once, with the dependency's address (never a
//! password or token: addresses are `scheme://host:port`, see [`endpoint_of`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::values::{HumanDuration, Problem};

/// `[health]`: the dependency probes' schedule.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// Time between two probe rounds.
    pub probe_interval: HumanDuration,
    /// A probe that has not answered within this is a failure.
    pub probe_timeout: HumanDuration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            probe_interval: HumanDuration::secs(5),
            probe_timeout: HumanDuration::secs(2),
        }
    }
}

impl HealthConfig {
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.probe_interval.get().is_zero() {
            problems.push(Problem::new("health.probe_interval", "must be above 0"));
        }
        if self.probe_timeout.get().is_zero() {
            problems.push(Problem::new("health.probe_timeout", "must be above 0"));
        } else if self.probe_timeout.get() > self.probe_interval.get() {
            problems.push(Problem::new(
                "health.probe_timeout",
                "must not exceed health.probe_interval (one round at a time)",
            ));
        }
        problems
    }
}

/// What a node depends on (the `dependency` label: a fixed set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Dependency {
    BlockStore,
    Postgres,
    Redis,
}

impl Dependency {
    pub fn as_str(self) -> &'static str {
        match self {
            Dependency::BlockStore => "block_store",
            Dependency::Postgres => "postgres",
            Dependency::Redis => "redis",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DependencyLabels {
    pub dependency: &'static str,
}

/// One check of a dependency: `Ok` when it answered, else why not (no secrets).
pub type Check = Arc<dyn Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// A dependency, where it is, and how to check it.
#[derive(Clone)]
pub struct Probe {
    pub dependency: Dependency,
    /// Where it is, for logs and `/readyz` (never credentials).
    pub address: String,
    pub check: Check,
}

/// The last probe of one dependency.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DependencyState {
    pub up: bool,
    pub address: String,
    /// Why the last probe failed; absent while up.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The probed state of the node's dependencies, shared by `/readyz`, the console and the
/// metrics. Cheap to clone.
#[derive(Clone)]
pub struct DependencyHealth {
    probes: Arc<Vec<Probe>>,
    states: Arc<Mutex<BTreeMap<Dependency, DependencyState>>>,
    gauges: Family<DependencyLabels, Gauge>,
}

impl std::fmt::Debug for DependencyHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DependencyHealth")
            .field("states", &self.snapshot())
            .finish()
    }
}

impl DependencyHealth {
    /// Health of `probes`, none probed yet.
    pub fn new(probes: Vec<Probe>) -> Self {
        Self {
            probes: Arc::new(probes),
            states: Arc::default(),
            gauges: Family::default(),
        }
    }

    /// Register `graviton_dependency_up{dependency}`: a series per probed dependency.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "dependency_up",
            "1 while the dependency answered its last probe, 0 when it failed",
            self.gauges.clone(),
        );
    }

    /// Every probed dependency's last state, in a fixed order.
    pub fn snapshot(&self) -> BTreeMap<Dependency, DependencyState> {
        self.states.lock().expect("health lock").clone()
    }

    /// The dependencies whose last probe failed.
    pub fn failing(&self) -> Vec<Dependency> {
        self.snapshot()
            .into_iter()
            .filter(|(_, state)| !state.up)
            .map(|(dependency, _)| dependency)
            .collect()
    }

    /// Record one probe result; a change of state (or the first result) is logged once.
    pub fn record(&self, probe: &Probe, result: Result<(), String>) {
        let dependency = probe.dependency.as_str();
        let up = result.is_ok();
        self.gauges
            .get_or_create(&DependencyLabels { dependency })
            .set(i64::from(up));
        let state = DependencyState {
            up,
            address: probe.address.clone(),
            error: result.err(),
        };
        let before = self
            .states
            .lock()
            .expect("health lock")
            .insert(probe.dependency, state.clone())
            .map(|s| s.up);
        match (before, up) {
            (Some(true), true) | (Some(false), false) => {}
            (None, true) => {
                tracing::info!(dependency, address = %probe.address, "dependency reachable")
            }
            (Some(false), true) => {
                tracing::info!(dependency, address = %probe.address, "dependency reachable again")
            }
            (_, false) => tracing::warn!(
                dependency,
                address = %probe.address,
                error = state.error.as_deref().unwrap_or(""),
                "dependency unreachable: the node is degraded"
            ),
        }
    }

    /// Probe every dependency once, at the same time, each within `timeout`.
    pub async fn probe_all(&self, timeout: Duration) {
        let rounds = self.probes.iter().map(|probe| async move {
            let result = match tokio::time::timeout(timeout, (probe.check)()).await {
                Ok(result) => result,
                Err(_) => Err(format!(
                    "no answer within health.probe_timeout ({})",
                    HumanDuration(timeout)
                )),
            };
            self.record(probe, result);
        });
        futures_util::future::join_all(rounds).await;
    }

    /// Probe every `interval` until `stop` (the first round is the caller's, at start).
    pub async fn run(self, interval: Duration, timeout: Duration, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
            self.probe_all(timeout).await;
        }
    }
}

/// `scheme://host:port` of a URL, without user, password, path or query: the address a
/// log line or `/readyz` may show for a database or Redis URL.
pub fn endpoint_of(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(at) => (&url[..at + 3], &url[at + 3..]),
        None => ("", url),
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = match authority.rfind('@') {
        Some(at) => &authority[at + 1..],
        None => authority,
    };
    format!("{scheme}{host}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_drop_credentials_paths_and_queries() {
        assert_eq!(
            endpoint_of("postgres://graviton:s3cret@db.internal:5432/graviton?sslmode=require"),
            "postgres://db.internal:5432"
        );
        assert_eq!(
            endpoint_of("rediss://:p%40ss@redis:6380/0"),
            "rediss://redis:6380"
        );
        assert_eq!(
            endpoint_of("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(endpoint_of("postgres://u@h/db?password=x"), "postgres://h");
    }

    fn probe(dependency: Dependency, up: Arc<std::sync::atomic::AtomicBool>) -> Probe {
        Probe {
            dependency,
            address: "redis://127.0.0.1:1".into(),
            check: Arc::new(move || {
                let up = up.load(std::sync::atomic::Ordering::SeqCst);
                Box::pin(async move { if up { Ok(()) } else { Err("refused".into()) } })
            }),
        }
    }

    #[tokio::test]
    async fn states_and_gauges_follow_the_probes() {
        let up = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let health = DependencyHealth::new(vec![probe(Dependency::Redis, up.clone())]);
        let mut registry = prometheus_client::registry::Registry::with_prefix("graviton");
        health.register(&mut registry);
        health.probe_all(Duration::from_secs(1)).await;
        assert_eq!(health.failing(), vec![Dependency::Redis]);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("graviton_dependency_up{dependency=\"redis\"} 0"),
            "{text}"
        );
        up.store(true, std::sync::atomic::Ordering::SeqCst);
        health.probe_all(Duration::from_secs(1)).await;
        assert!(health.failing().is_empty());
        assert_eq!(
            health.snapshot()[&Dependency::Redis],
            DependencyState {
                up: true,
                address: "redis://127.0.0.1:1".into(),
                error: None
            }
        );
    }

    #[test]
    fn a_timeout_above_the_interval_is_a_problem() {
        let config = HealthConfig {
            probe_interval: HumanDuration::secs(1),
            probe_timeout: HumanDuration::secs(2),
        };
        assert_eq!(config.problems().len(), 1);
        assert!(HealthConfig::default().problems().is_empty());
    }
}
