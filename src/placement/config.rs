//! `[cluster]`: multi-node upload locality (placement in PostgreSQL, one shard manager).
//!
//! Disabled by default: a node with no `[cluster]` section is a complete single node that
//! owns every shard. When enabled, the timing keys below drive heartbeats, the self-fence,
//! dead-node detection and the manager's rounds; [`ClusterConfig::problems`] rejects
//! combinations that would break the handoff guarantee (see `docs/locality.md`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::values::HumanDuration;
use crate::values::Problem;
use crate::values::Secret;

/// Default shard count of a new cluster (fixed for the cluster's life once bootstrapped).
pub const SHARD_COUNT_DEFAULT: u32 = 1024;
/// Largest accepted shard count.
pub const SHARD_COUNT_MAX: u32 = 65_536;

/// The `[cluster]` section.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// Turn multi-node placement on. Off: every shard is local, no PostgreSQL.
    pub enabled: bool,
    /// PostgreSQL URL of the placement database (required when enabled). Never logged.
    pub database_url: Option<Secret>,
    /// Number of shards. Stored at bootstrap; a node configured differently refuses to start.
    pub shard_count: u32,
    /// Run the manager election on this node (embedded mode). Off when a standalone
    /// `graviton manager` process runs the manager.
    pub embedded_manager: bool,
    /// Address clients may use to reach this node's public API (informational).
    pub public_addr: String,
    /// Address other nodes use to forward uploads to this node (owner ingest).
    pub internal_addr: String,
    /// Address of this node's control listener.
    pub control_addr: String,
    /// How often the node writes its heartbeat row.
    pub heartbeat_interval: HumanDuration,
    /// A node whose last successful heartbeat started longer ago than this stops admitting
    /// ingest for its shards (and cancels permits in flight).
    pub self_fence: HumanDuration,
    /// The manager declares a node dead (and reassigns its shards) once its heartbeat,
    /// measured by PostgreSQL's clock, is older than this. Must exceed `self_fence`.
    pub node_ttl: HumanDuration,
    /// Upper bound on how stale a node's shard table can be when a NOTIFY is lost.
    pub poll_interval: HumanDuration,
    /// Subscribe to LISTEN/NOTIFY for prompt table refreshes (polling remains the fallback).
    pub listen_notify: bool,
    /// Period of the manager's planning round.
    pub rebalance_interval: HumanDuration,
    /// Most voluntary shard moves per round (evacuating dead or draining nodes is not capped).
    pub move_budget: u32,
    /// How often a standby retries the manager lock.
    pub lock_retry_interval: HumanDuration,
    /// How often the manager checks its lock connection (`SELECT 1`).
    pub lock_ping_interval: HumanDuration,
    /// Size of the placement connection pool.
    pub pool_max_connections: u32,
    /// Statement timeout on placement connections; bounds every placement query.
    pub statement_timeout: HumanDuration,
    /// When a shard starts moving away, uploads already running on it get this long to
    /// finish before they are aborted with a retryable 503 `shard_moved`; new uploads are
    /// refused at once. Zero aborts at once. A SIGTERM drain waits up to this long.
    pub handoff_grace: HumanDuration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            database_url: None,
            shard_count: SHARD_COUNT_DEFAULT,
            embedded_manager: true,
            public_addr: String::new(),
            internal_addr: String::new(),
            control_addr: String::new(),
            heartbeat_interval: HumanDuration::millis(500),
            self_fence: HumanDuration::millis(1500),
            node_ttl: HumanDuration::millis(2500),
            poll_interval: HumanDuration::secs(1),
            listen_notify: true,
            rebalance_interval: HumanDuration::millis(500),
            move_budget: 64,
            lock_retry_interval: HumanDuration::millis(500),
            lock_ping_interval: HumanDuration::millis(500),
            pool_max_connections: 8,
            statement_timeout: HumanDuration::secs(2),
            handoff_grace: HumanDuration::secs(5),
        }
    }
}

impl ClusterConfig {
    /// Fast timings for tests: heartbeat 100ms, self-fence 400ms, node TTL 1s, polling 250ms.
    pub fn fast_for_tests(database_url: &str) -> Self {
        Self {
            enabled: true,
            database_url: Some(Secret::new(database_url)),
            shard_count: 64,
            heartbeat_interval: HumanDuration::millis(100),
            self_fence: HumanDuration::millis(400),
            node_ttl: HumanDuration::secs(1),
            poll_interval: HumanDuration::millis(250),
            rebalance_interval: HumanDuration::millis(200),
            lock_retry_interval: HumanDuration::millis(100),
            lock_ping_interval: HumanDuration::millis(100),
            statement_timeout: HumanDuration::secs(2),
            ..Self::default()
        }
    }

    pub fn heartbeat(&self) -> Duration {
        self.heartbeat_interval.get()
    }

    /// Every problem with this section (empty when valid).
    /// The timings this process proposes as the cluster's (stored at bootstrap).
    pub fn timings(&self) -> ClusterTimings {
        ClusterTimings {
            self_fence: self.self_fence.get(),
            node_ttl: self.node_ttl.get(),
        }
    }

    /// Problems of this configuration against the cluster's stored timings. Safety needs
    /// every node's fence window to end before any manager's TTL: so a node may not fence
    /// later than the stored `self_fence`, and a manager may not declare nodes dead
    /// sooner than the stored `node_ttl` (the stored pair passed [`Self::problems`]).
    pub fn timing_problems(&self, stored: ClusterTimings, runs_manager: bool) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.self_fence.get() > stored.self_fence {
            problems.push(Problem::new(
                "cluster.self_fence",
                format!(
                    "is {} but the cluster was bootstrapped with {}; a node may not fence later than the cluster's self_fence",
                    humantime::format_duration(self.self_fence.get()),
                    humantime::format_duration(stored.self_fence)
                ),
            ));
        }
        if runs_manager && self.node_ttl.get() < stored.node_ttl {
            problems.push(Problem::new(
                "cluster.node_ttl",
                format!(
                    "is {} but the cluster was bootstrapped with {}; a manager may not declare nodes dead sooner than the cluster's node_ttl",
                    humantime::format_duration(self.node_ttl.get()),
                    humantime::format_duration(stored.node_ttl)
                ),
            ));
        }
        problems
    }

    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.shard_count == 0 || self.shard_count > SHARD_COUNT_MAX {
            problems.push(Problem::new(
                "cluster.shard_count",
                format!("must be between 1 and {SHARD_COUNT_MAX}"),
            ));
        }
        let positive: [(&'static str, HumanDuration); 7] = [
            ("cluster.heartbeat_interval", self.heartbeat_interval),
            ("cluster.self_fence", self.self_fence),
            ("cluster.node_ttl", self.node_ttl),
            ("cluster.poll_interval", self.poll_interval),
            ("cluster.rebalance_interval", self.rebalance_interval),
            ("cluster.lock_retry_interval", self.lock_retry_interval),
            ("cluster.lock_ping_interval", self.lock_ping_interval),
        ];
        for (key, value) in positive {
            if value.get().is_zero() {
                problems.push(Problem::new(key, "must be greater than zero"));
            }
        }
        if self.self_fence.get() < self.heartbeat_interval.get() * 2 {
            problems.push(Problem::new(
                "cluster.self_fence",
                "must be at least twice cluster.heartbeat_interval (one lost heartbeat must not fence a node)",
            ));
        }
        // The manager may hand a silent node's shards to another node only after that
        // node has certainly fenced itself: the TTL must exceed the fence window with margin.
        let margin = self
            .heartbeat_interval
            .get()
            .max(Duration::from_millis(100));
        if self.node_ttl.get() < self.self_fence.get() + margin {
            problems.push(Problem::new(
                "cluster.node_ttl",
                "must exceed cluster.self_fence by at least one heartbeat interval (and 100ms)",
            ));
        }
        if self.move_budget == 0 {
            problems.push(Problem::new("cluster.move_budget", "must be at least 1"));
        }
        if self.pool_max_connections < 2 {
            problems.push(Problem::new(
                "cluster.pool_max_connections",
                "must be at least 2",
            ));
        }
        if self.statement_timeout.get().is_zero() {
            problems.push(Problem::new(
                "cluster.statement_timeout",
                "must be greater than zero",
            ));
        }
        if self.enabled {
            match &self.database_url {
                None => problems.push(Problem::new(
                    "cluster.database_url",
                    "is required when cluster.enabled = true",
                )),
                Some(url)
                    if !(url.expose().starts_with("postgres://")
                        || url.expose().starts_with("postgresql://")) =>
                {
                    problems.push(Problem::new(
                        "cluster.database_url",
                        "must be a postgres:// or postgresql:// URL",
                    ))
                }
                Some(_) => {}
            }
            if self.internal_addr.trim().is_empty() {
                problems.push(Problem::new(
                    "cluster.internal_addr",
                    "is required when cluster.enabled = true",
                ));
            } else if self.internal_addr.parse::<std::net::SocketAddr>().is_err() {
                // Peers forward to this address as it is; host names are not resolved.
                problems.push(Problem::new(
                    "cluster.internal_addr",
                    "must be an IP address and port (for example 10.0.0.5:7071); host names are not resolved",
                ));
            }
            if !self.control_addr.trim().is_empty()
                && self.control_addr.parse::<std::net::SocketAddr>().is_err()
            {
                // Peers dial the control plane at this address as it is.
                problems.push(Problem::new(
                    "cluster.control_addr",
                    "must be an IP address and port (for example 10.0.0.5:7072); host names are not resolved",
                ));
            }
        }
        problems
    }
}

/// The cluster-wide timings of the fencing argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClusterTimings {
    pub self_fence: Duration,
    pub node_ttl: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_are_checked_against_the_clusters() {
        let stored = ClusterConfig::default().timings();
        let same = ClusterConfig::default();
        assert!(same.timing_problems(stored, true).is_empty());
        let later_fence = ClusterConfig {
            self_fence: HumanDuration::secs(2),
            node_ttl: HumanDuration::secs(3),
            ..ClusterConfig::default()
        };
        let keys: Vec<_> = later_fence
            .timing_problems(stored, true)
            .iter()
            .map(|p| p.key)
            .collect();
        assert_eq!(keys, ["cluster.self_fence"]);
        let short_ttl = ClusterConfig {
            self_fence: HumanDuration::secs(1),
            node_ttl: HumanDuration::millis(1600),
            ..ClusterConfig::default()
        };
        let keys: Vec<_> = short_ttl
            .timing_problems(stored, true)
            .iter()
            .map(|p| p.key)
            .collect();
        assert_eq!(keys, ["cluster.node_ttl"]);
        assert!(
            short_ttl.timing_problems(stored, false).is_empty(),
            "a node without a manager may fence sooner"
        );
    }

    #[test]
    fn defaults_are_valid() {
        assert!(ClusterConfig::default().problems().is_empty());
    }

    #[test]
    fn test_timings_are_valid() {
        let mut config = ClusterConfig::fast_for_tests("postgres://postgres@127.0.0.1/x");
        config.internal_addr = "127.0.0.1:1".into();
        assert!(config.problems().is_empty(), "{:?}", config.problems());
    }

    #[test]
    fn ttl_must_exceed_self_fence() {
        // Default self_fence 1.5s, heartbeat 500ms: the TTL needs at least 2s.
        let config = ClusterConfig {
            node_ttl: HumanDuration::millis(1900),
            ..ClusterConfig::default()
        };
        let keys: Vec<_> = config.problems().iter().map(|p| p.key).collect();
        assert_eq!(keys, vec!["cluster.node_ttl"]);
    }

    #[test]
    fn enabled_requires_url_and_internal_addr() {
        let config = ClusterConfig {
            enabled: true,
            ..ClusterConfig::default()
        };
        let keys: Vec<_> = config.problems().iter().map(|p| p.key).collect();
        assert_eq!(keys, vec!["cluster.database_url", "cluster.internal_addr"]);
    }

    #[test]
    fn cluster_section_loads_from_toml_and_names_bad_keys() {
        let config = crate::config::Config::from_toml_str(
            "[cluster]\nnode_ttl = \"10s\"\nshard_count = 256\n",
        )
        .unwrap();
        assert_eq!(config.cluster.node_ttl, HumanDuration::secs(10));
        assert_eq!(config.cluster.shard_count, 256);
        let err = crate::config::Config::from_toml_str("[cluster]\nself_fence = \"10s\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("cluster.node_ttl"), "{err}");
        let err = crate::config::Config::from_toml_str(
            "[cluster]\nenabled = true\ninternal_addr = \"x:1\"\ndatabase_url = \"mysql://u:hunter2@h/db\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("cluster.database_url") && !err.contains("hunter2"),
            "{err}"
        );
    }
}
