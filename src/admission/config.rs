//! The `[admission]` and `[admission.redis]` configuration sections and their validation.
//!
//! `[admission]` holds the process-local limits, which are always enforced. The optional
//! `[admission.redis]` table turns on cluster leases and traffic quotas; when it is absent
//! the node runs local admission only and never needs Redis. Validation returns every
//! [`Problem`] at once, each naming its dotted key.

use serde::{Deserialize, Serialize};

use crate::storage::redis::coordinator::CALL_TIMEOUT;
use crate::storage::redis::{CoordinatorConfig, Limits};
use crate::values::Problem;
use crate::values::Secret;
use crate::values::{ByteSize, HumanDuration};

/// Largest byte value accepted anywhere in admission (1 PiB). Keeps every count exact in
/// Lua's doubles (< 2^53) and far from `u64` overflow when sums are formed.
pub const MAX_BYTES: u64 = 1 << 50;
/// Largest transfer-count limit.
pub const MAX_TRANSFERS: u32 = 1_000_000;

/// `[admission]`: local limits plus the optional cluster coordinator.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Bytes all admitted transfers of this process may hold at once.
    pub process_bytes: ByteSize,
    /// Bytes one tenant's transfers may hold at once in this process.
    pub tenant_bytes: ByteSize,
    /// Concurrent transfers of one tenant in this process.
    pub tenant_transfers: u32,
    /// Concurrent transfers against one storage backend in this process.
    pub backend_transfers: u32,
    /// Tenants tracked at once; the oldest inactive entry is evicted at the bound.
    pub max_tenants: usize,
    /// Backends tracked at once; the oldest inactive entry is evicted at the bound.
    pub max_backends: usize,
    /// One deadline for local permits plus the cluster lease.
    pub acquisition_timeout: HumanDuration,
    /// Multi-tenant data plane: Redis must use TLS, verify certificates, authenticate and
    /// use the cell named by `admission.cell`.
    pub tenant_mode: bool,
    /// The data-plane cell this node serves (required in tenant mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cell: Option<String>,
    /// Cluster coordinator; absent means local admission only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis: Option<RedisAdmissionConfig>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            process_bytes: ByteSize::mib(512),
            tenant_bytes: ByteSize::mib(128),
            tenant_transfers: 16,
            backend_transfers: 64,
            max_tenants: 10_000,
            max_backends: 64,
            acquisition_timeout: HumanDuration::secs(30),
            tenant_mode: false,
            cell: None,
            redis: None,
        }
    }
}

/// What a lease holder does when its cluster lease is lost.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum LeaseLossPolicy {
    /// Cancel the transfer (its bytes stop flowing); the default.
    #[default]
    Cancel,
    /// Count and log the loss, let the transfer finish under the local budget.
    Report,
}

/// `[admission.redis]`: cluster leases, quotas and decision events on Redis or Valkey.
#[derive(Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisAdmissionConfig {
    /// `redis://host:port/db` or `rediss://...` for TLS. No credentials in the URL. With
    /// `cluster = true`, one seed node of the cluster.
    pub url: String,
    /// `url` (and `seeds`) name a Redis Cluster: use the cluster client, which follows
    /// `MOVED`/`ASK` and the cluster's failovers. Every key of a cell shares one slot.
    pub cluster: bool,
    /// More cluster seed nodes, tried when `url` is down (only with `cluster = true`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub seeds: Vec<String>,
    /// ACL user name (optional).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// AUTH password.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password: Option<Secret>,
    /// Verify the server certificate with `rediss://` (turn off only in tests).
    pub verify_tls: bool,
    /// PEM file with the CA certificate(s) to trust instead of the system roots
    /// (`rediss://` with `verify_tls = true`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<std::path::PathBuf>,
    /// Cell secret keying the HMAC-SHA-256 of tenant and backend ids in keys and events.
    /// Unset: plain SHA-256. Every node of a cell must use the same value.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id_secret: Option<Secret>,
    /// Cell id: the Redis Cluster hash tag shared by every key of this cell.
    pub cell: String,
    /// First segment of every key.
    pub key_prefix: String,
    /// Lease lifetime without renewal (Redis server time).
    pub lease_ttl: HumanDuration,
    /// Renewal period of a held lease; three renewals must fit in one TTL.
    pub renew_interval: HumanDuration,
    /// Longest a transfer waits for a cluster lease (within `admission.acquisition_timeout`).
    pub wait: HumanDuration,
    /// Base delay between attempts while waiting (jittered, see docs/admission.md).
    pub retry_interval: HumanDuration,
    /// Service-wide admitted bytes.
    pub service_bytes: ByteSize,
    /// Service-wide concurrent transfers.
    pub service_transfers: u32,
    /// Default per-tenant admitted bytes (a live override may change it).
    pub tenant_bytes: ByteSize,
    /// Default per-tenant concurrent transfers (a live override may change it).
    pub tenant_transfers: u32,
    /// Concurrent transfers per backend, cluster-wide.
    pub backend_transfers: u32,
    /// Requests per tenant per Redis-time minute.
    pub tenant_requests_per_minute: u64,
    /// Delivered download bytes per tenant per Redis-time hour.
    pub tenant_egress_per_hour: ByteSize,
    /// Approximate bound (`XADD MAXLEN ~`) of the decision event stream.
    pub max_events: u64,
    /// Expired leases reaped per script call at most.
    pub reap_batch: u32,
    /// Batch script calls of one node outstanding at once (`src/storage/redis/batcher.rs`).
    /// Fewer calls in flight means larger batches: less Redis CPU per admission.
    pub batch_in_flight: u32,
    /// Reaction to a lost lease.
    pub lease_loss: LeaseLossPolicy,
}

impl Default for RedisAdmissionConfig {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379/".to_string(),
            cluster: false,
            seeds: Vec::new(),
            username: None,
            password: None,
            verify_tls: true,
            ca_file: None,
            id_secret: None,
            cell: "default".to_string(),
            key_prefix: "graviton".to_string(),
            lease_ttl: HumanDuration::secs(30),
            renew_interval: HumanDuration::secs(10),
            wait: HumanDuration::secs(10),
            retry_interval: HumanDuration::millis(50),
            service_bytes: ByteSize::gib(4),
            service_transfers: 256,
            tenant_bytes: ByteSize::mib(512),
            tenant_transfers: 32,
            backend_transfers: 192,
            tenant_requests_per_minute: 60_000,
            tenant_egress_per_hour: ByteSize(1 << 40),
            max_events: 100_000,
            reap_batch: 256,
            batch_in_flight: crate::storage::redis::batcher::DEFAULT_IN_FLIGHT as u32,
            lease_loss: LeaseLossPolicy::Cancel,
        }
    }
}

impl std::fmt::Debug for RedisAdmissionConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisAdmissionConfig")
            .field("url", &redact_url(&self.url))
            .field("cluster", &self.cluster)
            .field(
                "seeds",
                &self.seeds.iter().map(|s| redact_url(s)).collect::<Vec<_>>(),
            )
            .field("username", &self.username)
            .field("password", &self.password)
            .field("verify_tls", &self.verify_tls)
            .field("ca_file", &self.ca_file)
            .field("id_secret", &self.id_secret)
            .field("cell", &self.cell)
            .field("key_prefix", &self.key_prefix)
            .field("lease_ttl", &self.lease_ttl)
            .field("renew_interval", &self.renew_interval)
            .field("wait", &self.wait)
            .field("service_bytes", &self.service_bytes)
            .field("service_transfers", &self.service_transfers)
            .field("tenant_bytes", &self.tenant_bytes)
            .field("tenant_transfers", &self.tenant_transfers)
            .field("backend_transfers", &self.backend_transfers)
            .field("lease_loss", &self.lease_loss)
            .finish_non_exhaustive()
    }
}

/// The URL with any `user:password@` part replaced, for logs and `Debug`.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}[redacted]@{}", &url[..scheme + 3], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

/// The database part of a `redis://host:port/db` URL (`""` when absent).
fn url_database(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let path = rest.split_once('/').map_or("", |(_, path)| path);
    path.split(['?', '#'])
        .next()
        .unwrap_or("")
        .trim_matches('/')
}

fn is_identifier(text: &str, max: usize, extra: &[char]) -> bool {
    !text.is_empty()
        && text.len() <= max
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || extra.contains(&c))
}

impl RedisAdmissionConfig {
    /// True when the URL asks for TLS.
    pub fn uses_tls(&self) -> bool {
        self.url.starts_with("rediss://")
    }

    /// The coordinator's connection and script parameters.
    pub fn coordinator(&self) -> CoordinatorConfig {
        CoordinatorConfig {
            url: self.url.clone(),
            cluster: self.cluster,
            seeds: self.seeds.clone(),
            username: self.username.clone(),
            password: self.password.clone(),
            verify_tls: self.verify_tls,
            ca_file: self.ca_file.clone(),
            id_secret: self.id_secret.clone(),
            key_prefix: self.key_prefix.clone(),
            cell: self.cell.clone(),
            limits: Limits {
                service_bytes: self.service_bytes.bytes(),
                service_transfers: u64::from(self.service_transfers),
                tenant_bytes: self.tenant_bytes.bytes(),
                tenant_transfers: u64::from(self.tenant_transfers),
                backend_transfers: u64::from(self.backend_transfers),
            },
            lease_ttl: self.lease_ttl.get(),
            waiter_ttl: super::acquire::waiter_ttl(self.retry_interval.get()),
            requests_per_minute: self.tenant_requests_per_minute,
            egress_per_hour: self.tenant_egress_per_hour.bytes(),
            max_events: self.max_events,
            reap_batch: self.reap_batch,
            batch_in_flight: self.batch_in_flight as usize,
        }
    }

    fn problems(&self, problems: &mut Vec<Problem>) {
        let url = self.url.trim();
        if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
            problems.push(Problem::new(
                "admission.redis.url",
                "must start with redis:// or rediss://",
            ));
        }
        if url.contains('@') {
            problems.push(Problem::new(
                "admission.redis.url",
                "must not carry credentials; set admission.redis.username and admission.redis.password",
            ));
        }
        if !self.seeds.is_empty() && !self.cluster {
            problems.push(Problem::new(
                "admission.redis.seeds",
                "only with admission.redis.cluster = true",
            ));
        }
        for seed in &self.seeds {
            let seed = seed.trim();
            let scheme = if url.starts_with("rediss://") {
                "rediss://"
            } else {
                "redis://"
            };
            if !seed.starts_with(scheme) || seed.contains('@') {
                problems.push(Problem::new(
                    "admission.redis.seeds",
                    "every seed must use the scheme of admission.redis.url and carry no credentials",
                ));
                break;
            }
        }
        if self.cluster && !matches!(url_database(url), "" | "0") {
            problems.push(Problem::new(
                "admission.redis.url",
                "a Redis Cluster has only database 0",
            ));
        }
        if let Some(path) = &self.ca_file {
            if !self.uses_tls() {
                problems.push(Problem::new(
                    "admission.redis.ca_file",
                    "only with rediss://",
                ));
            } else if std::fs::metadata(path)
                .map(|m| !m.is_file())
                .unwrap_or(true)
            {
                problems.push(Problem::new(
                    "admission.redis.ca_file",
                    "is not a readable file",
                ));
            }
        }
        if matches!(&self.username, Some(u) if u.is_empty() || u.len() > 128) {
            problems.push(Problem::new(
                "admission.redis.username",
                "must be 1 to 128 characters when set",
            ));
        }
        if matches!(&self.password, Some(p) if p.expose().is_empty() || p.expose().len() > 1024) {
            problems.push(Problem::new(
                "admission.redis.password",
                "must be 1 to 1024 characters when set",
            ));
        }
        if matches!(&self.id_secret, Some(s) if s.expose().len() < 16) {
            problems.push(Problem::new(
                "admission.redis.id_secret",
                "must be at least 16 characters when set",
            ));
        }
        if !is_identifier(&self.cell, 120, &['-', '_', '.']) {
            problems.push(Problem::new(
                "admission.redis.cell",
                "must be 1 to 120 ASCII letters, digits, '-', '_' or '.'",
            ));
        }
        if !is_identifier(&self.key_prefix, 64, &['-', '_']) {
            problems.push(Problem::new(
                "admission.redis.key_prefix",
                "must be 1 to 64 ASCII letters, digits, '-' or '_'",
            ));
        }
        let ttl = self.lease_ttl.get();
        let renew = self.renew_interval.get();
        if ttl.as_millis() < 1_000 {
            problems.push(Problem::new(
                "admission.redis.lease_ttl",
                "must be at least 1s",
            ));
        }
        if renew.as_millis() < 50 {
            problems.push(Problem::new(
                "admission.redis.renew_interval",
                "must be at least 50ms",
            ));
        }
        if renew.saturating_mul(3) > ttl {
            problems.push(Problem::new(
                "admission.redis.renew_interval",
                "three renewal intervals must fit in admission.redis.lease_ttl (unsafe lease timing)",
            ));
        } else if renew.saturating_mul(2) + CALL_TIMEOUT > ttl {
            // The holder renews after one interval and declares loss one interval before
            // the TTL ends: one whole renew attempt (its call timeout) must fit between.
            problems.push(Problem::new(
                "admission.redis.lease_ttl",
                "must be at least two renewal intervals plus the 1s renew call timeout (unsafe lease timing)",
            ));
        }
        if self.wait.get().is_zero() {
            problems.push(Problem::new(
                "admission.redis.wait",
                "must be greater than zero",
            ));
        }
        if self.retry_interval.get().is_zero() {
            problems.push(Problem::new(
                "admission.redis.retry_interval",
                "must be greater than zero",
            ));
        } else if self.retry_interval.get() > self.wait.get() {
            problems.push(Problem::new(
                "admission.redis.retry_interval",
                "must not exceed admission.redis.wait",
            ));
        } else if self.retry_interval.get() >= renew {
            problems.push(Problem::new(
                "admission.redis.retry_interval",
                "must be shorter than admission.redis.renew_interval (a failed renewal is retried before the loss deadline)",
            ));
        }
        bytes_in_range(
            problems,
            "admission.redis.service_bytes",
            self.service_bytes,
        );
        bytes_in_range(problems, "admission.redis.tenant_bytes", self.tenant_bytes);
        bytes_in_range(
            problems,
            "admission.redis.tenant_egress_per_hour",
            self.tenant_egress_per_hour,
        );
        count_in_range(
            problems,
            "admission.redis.service_transfers",
            self.service_transfers,
        );
        count_in_range(
            problems,
            "admission.redis.tenant_transfers",
            self.tenant_transfers,
        );
        count_in_range(
            problems,
            "admission.redis.backend_transfers",
            self.backend_transfers,
        );
        if self.tenant_bytes > self.service_bytes {
            problems.push(Problem::new(
                "admission.redis.tenant_bytes",
                "must not exceed admission.redis.service_bytes (inconsistent ceilings)",
            ));
        }
        if self.tenant_transfers > self.service_transfers {
            problems.push(Problem::new(
                "admission.redis.tenant_transfers",
                "must not exceed admission.redis.service_transfers (inconsistent ceilings)",
            ));
        }
        if self.backend_transfers > self.service_transfers {
            problems.push(Problem::new(
                "admission.redis.backend_transfers",
                "must not exceed admission.redis.service_transfers (inconsistent ceilings)",
            ));
        }
        if self.tenant_requests_per_minute == 0 || self.tenant_requests_per_minute > MAX_BYTES {
            problems.push(Problem::new(
                "admission.redis.tenant_requests_per_minute",
                "must be between 1 and 2^50",
            ));
        }
        if !(1_000..=10_000_000).contains(&self.max_events) {
            problems.push(Problem::new(
                "admission.redis.max_events",
                "must be between 1000 and 10000000",
            ));
        }
        if !(1..=4096).contains(&self.reap_batch) {
            problems.push(Problem::new(
                "admission.redis.reap_batch",
                "must be between 1 and 4096",
            ));
        }
        if !(1..=16).contains(&self.batch_in_flight) {
            problems.push(Problem::new(
                "admission.redis.batch_in_flight",
                "must be between 1 and 16",
            ));
        }
    }
}

fn bytes_in_range(problems: &mut Vec<Problem>, key: &'static str, value: ByteSize) {
    if value.bytes() == 0 || value.bytes() > MAX_BYTES {
        problems.push(Problem::new(key, "must be between 1B and 1024TiB"));
    }
}

fn count_in_range(problems: &mut Vec<Problem>, key: &'static str, value: u32) {
    if value == 0 || value > MAX_TRANSFERS {
        problems.push(Problem::new(key, "must be between 1 and 1000000"));
    }
}

impl AdmissionConfig {
    /// Every problem of both sections, including the cross-section rules.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        bytes_in_range(&mut problems, "admission.process_bytes", self.process_bytes);
        bytes_in_range(&mut problems, "admission.tenant_bytes", self.tenant_bytes);
        count_in_range(
            &mut problems,
            "admission.tenant_transfers",
            self.tenant_transfers,
        );
        count_in_range(
            &mut problems,
            "admission.backend_transfers",
            self.backend_transfers,
        );
        if self.tenant_bytes > self.process_bytes {
            problems.push(Problem::new(
                "admission.tenant_bytes",
                "must not exceed admission.process_bytes (inconsistent ceilings)",
            ));
        }
        if self.max_tenants == 0 {
            problems.push(Problem::new("admission.max_tenants", "must be at least 1"));
        }
        if self.max_backends == 0 {
            problems.push(Problem::new("admission.max_backends", "must be at least 1"));
        }
        if self.acquisition_timeout.get().is_zero() {
            problems.push(Problem::new(
                "admission.acquisition_timeout",
                "must be greater than zero",
            ));
        }
        if let Some(cell) = &self.cell
            && !is_identifier(cell, 120, &['-', '_', '.'])
        {
            problems.push(Problem::new(
                "admission.cell",
                "must be 1 to 120 ASCII letters, digits, '-', '_' or '.'",
            ));
        }
        match &self.redis {
            None => {
                if self.tenant_mode {
                    problems.push(Problem::new(
                        "admission.redis",
                        "tenant mode requires the cluster coordinator ([admission.redis])",
                    ));
                }
            }
            Some(redis) => {
                redis.problems(&mut problems);
                if redis.service_bytes < self.process_bytes {
                    problems.push(Problem::new(
                        "admission.redis.service_bytes",
                        "must be at least admission.process_bytes (undersized service pool)",
                    ));
                }
                if redis.wait > self.acquisition_timeout {
                    problems.push(Problem::new(
                        "admission.redis.wait",
                        "must not exceed admission.acquisition_timeout",
                    ));
                }
                if self.tenant_mode {
                    if !redis.uses_tls() {
                        problems.push(Problem::new(
                            "admission.redis.url",
                            "tenant mode requires TLS (rediss://)",
                        ));
                    }
                    if !redis.verify_tls {
                        problems.push(Problem::new(
                            "admission.redis.verify_tls",
                            "tenant mode requires certificate verification",
                        ));
                    }
                    if redis.password.is_none() {
                        problems.push(Problem::new(
                            "admission.redis.password",
                            "tenant mode requires authentication",
                        ));
                    }
                    if self.cell.as_deref() != Some(redis.cell.as_str()) {
                        problems.push(Problem::new(
                            "admission.redis.cell",
                            "tenant mode requires it to equal admission.cell",
                        ));
                    }
                }
            }
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn keys(config: &AdmissionConfig) -> Vec<&'static str> {
        config.problems().iter().map(|p| p.key).collect()
    }

    fn with_redis(edit: impl FnOnce(&mut RedisAdmissionConfig)) -> AdmissionConfig {
        let mut redis = RedisAdmissionConfig::default();
        edit(&mut redis);
        AdmissionConfig {
            redis: Some(redis),
            ..AdmissionConfig::default()
        }
    }

    #[test]
    fn defaults_are_valid_with_and_without_redis() {
        assert!(AdmissionConfig::default().problems().is_empty());
        assert!(
            with_redis(|_| {}).problems().is_empty(),
            "{:?}",
            with_redis(|_| {}).problems()
        );
    }

    #[test]
    fn unsafe_lease_interval_is_rejected() {
        let config = with_redis(|r| {
            r.lease_ttl = HumanDuration::secs(3);
            r.renew_interval = HumanDuration::millis(1001);
        });
        assert_eq!(keys(&config), ["admission.redis.renew_interval"]);
        // 3 x 800ms fits in 2.5s, but 2 x 800ms + the 1s renew call timeout does not.
        let config = with_redis(|r| {
            r.lease_ttl = HumanDuration::millis(2500);
            r.renew_interval = HumanDuration::millis(800);
        });
        assert_eq!(keys(&config), ["admission.redis.lease_ttl"]);
        let config = with_redis(|r| {
            r.lease_ttl = HumanDuration::secs(30);
            r.renew_interval = HumanDuration::secs(1);
            r.retry_interval = HumanDuration::secs(1);
        });
        assert_eq!(keys(&config), ["admission.redis.retry_interval"]);
        let ok = with_redis(|r| {
            r.lease_ttl = HumanDuration::secs(3);
            r.renew_interval = HumanDuration::secs(1);
        });
        assert!(ok.problems().is_empty());
    }

    #[test]
    fn inconsistent_ceilings_are_rejected() {
        let config = with_redis(|r| {
            r.tenant_bytes = ByteSize::gib(8);
            r.tenant_transfers = 300;
            r.backend_transfers = 300;
        });
        assert_eq!(
            keys(&config),
            [
                "admission.redis.tenant_bytes",
                "admission.redis.tenant_transfers",
                "admission.redis.backend_transfers"
            ]
        );
        let local = AdmissionConfig {
            tenant_bytes: ByteSize::gib(1),
            ..AdmissionConfig::default()
        };
        assert_eq!(keys(&local), ["admission.tenant_bytes"]);
    }

    #[test]
    fn undersized_service_pool_and_long_wait_are_rejected() {
        let mut config = with_redis(|r| {
            r.service_bytes = ByteSize::mib(256);
            r.tenant_bytes = ByteSize::mib(128);
            r.wait = HumanDuration::secs(60);
        });
        config.acquisition_timeout = HumanDuration::secs(30);
        assert_eq!(
            keys(&config),
            ["admission.redis.service_bytes", "admission.redis.wait"]
        );
    }

    #[test]
    fn tenant_mode_requires_tls_verification_auth_and_cell() {
        let mut config = with_redis(|r| r.verify_tls = false);
        config.tenant_mode = true;
        config.cell = Some("eu-1".to_string());
        assert_eq!(
            keys(&config),
            [
                "admission.redis.url",
                "admission.redis.verify_tls",
                "admission.redis.password",
                "admission.redis.cell"
            ]
        );
        let mut good = with_redis(|r| {
            r.url = "rediss://redis.internal:6380/".to_string();
            r.password = Some(Secret::new("correct horse battery"));
            r.cell = "eu-1".to_string();
        });
        good.tenant_mode = true;
        good.cell = Some("eu-1".to_string());
        assert!(good.problems().is_empty(), "{:?}", good.problems());
        let no_redis = AdmissionConfig {
            tenant_mode: true,
            ..AdmissionConfig::default()
        };
        assert_eq!(keys(&no_redis), ["admission.redis"]);
    }

    #[test]
    fn cluster_seeds_and_ca_file_are_checked() {
        let ok = with_redis(|r| {
            r.cluster = true;
            r.seeds = vec![
                "redis://10.0.0.2:7001".into(),
                "redis://10.0.0.3:7002/".into(),
            ];
        });
        assert!(ok.problems().is_empty(), "{:?}", ok.problems());
        let seeds_alone = with_redis(|r| r.seeds = vec!["redis://10.0.0.2:7001".into()]);
        assert_eq!(keys(&seeds_alone), ["admission.redis.seeds"]);
        let mixed = with_redis(|r| {
            r.cluster = true;
            r.seeds = vec!["rediss://10.0.0.2:7001".into()];
        });
        assert_eq!(keys(&mixed), ["admission.redis.seeds"]);
        let db = with_redis(|r| {
            r.cluster = true;
            r.url = "redis://10.0.0.1:7000/3".into();
        });
        assert_eq!(keys(&db), ["admission.redis.url"]);
        assert_eq!(url_database("redis://h:1/0?x=1"), "0");
        assert_eq!(url_database("redis://h:1"), "");
        let plain_ca = with_redis(|r| r.ca_file = Some("/etc/hostname".into()));
        assert_eq!(keys(&plain_ca), ["admission.redis.ca_file"]);
        let missing_ca = with_redis(|r| {
            r.url = "rediss://h:6380/".into();
            r.ca_file = Some("/nonexistent/ca.pem".into());
        });
        assert_eq!(keys(&missing_ca), ["admission.redis.ca_file"]);
        let seeded = with_redis(|r| {
            r.cluster = true;
            r.seeds = vec!["redis://user:hunter2-pw@h:1".into()];
        });
        assert!(!format!("{seeded:?}").contains("hunter2-pw"));
    }

    #[test]
    fn credentials_in_url_are_rejected_and_never_printed() {
        let config = with_redis(|r| {
            r.url = "redis://user:hunter2-pw@host:6379/".to_string();
            r.password = Some(Secret::new("another-secret-pw"));
        });
        assert_eq!(keys(&config), ["admission.redis.url"]);
        let debug = format!("{config:?}");
        assert!(!debug.contains("hunter2-pw"), "{debug}");
        assert!(!debug.contains("another-secret-pw"), "{debug}");
        let shown = config
            .problems()
            .iter()
            .map(ToString::to_string)
            .collect::<String>();
        assert!(!shown.contains("hunter2-pw"), "{shown}");
    }

    #[test]
    fn bad_identifiers_and_bounds_are_named() {
        let config = with_redis(|r| {
            r.cell = "a{b}".to_string();
            r.key_prefix = String::new();
            r.max_events = 10;
            r.reap_batch = 0;
            r.batch_in_flight = 0;
            r.retry_interval = HumanDuration(Duration::from_secs(11));
        });
        assert_eq!(
            keys(&config),
            [
                "admission.redis.cell",
                "admission.redis.key_prefix",
                "admission.redis.retry_interval",
                "admission.redis.max_events",
                "admission.redis.reap_batch",
                "admission.redis.batch_in_flight"
            ]
        );
    }

    #[test]
    fn redact_url_hides_userinfo() {
        assert_eq!(redact_url("redis://u:p@h:1/"), "redis://[redacted]@h:1/");
        assert_eq!(redact_url("redis://h:1/"), "redis://h:1/");
    }
}
