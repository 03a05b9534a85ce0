//! The Redis side of cluster admission: one connection (one server or a Redis Cluster,
//! see [`super::connection`]), one script, typed calls.
//!
//! * Every call runs `lua/admission.lua` as a Redis Function (`FCALL`, see
//!   [`super::script`]), loaded again when the server answers that it does not have it
//!   (a restart without persistence, a new primary, `FUNCTION FLUSH`; in a cluster the
//!   `FUNCTION LOAD` goes to every primary).
//! * The connection reconnects in the background, but the command that hit a dead
//!   connection fails. Idempotent operations (acquire by lease id, renew, release, abandon, snapshot,
//!   reap) are retried twice on I/O, dropped-connection and timeout errors; policy changes
//!   and quota charges are not (a retry could apply twice) and fail closed instead.
//! * Errors are reduced to a category (`io`, `timeout`, ...) before they become
//!   `CoordinatorError::Unavailable`, so no server message or connection detail leaks.
//!
//! No policy lives here: how long to wait, how to back off, when to give up and what a
//! reply means for a transfer are decided by `admission` (`admission::acquire`). This
//! module only encodes arguments, runs the script and parses its replies.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use redis::{Cmd, RedisError};

use super::batcher::{BatchContext, BatchItem, Batcher};
use super::connection::{self, ConnectSpec, Connection};
use super::error::CoordinatorError as Error;
use super::hashing::IdHasher;
use super::keys::{CellKeys, QuotaKind};
use super::reply::{
    self, AcquireReply, ChargeReply, Dimension, FencingToken, LeaseId, ReleaseReply, RenewReply,
    SnapshotReply, StoredLimits,
};
use super::script::SCRIPT;
use crate::ids::TenantId;
use crate::values::Secret;

/// Response timeout of one Redis call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(1);
const REQUEST_WINDOW_MS: u64 = 60_000;
/// Backend hashes cached per coordinator (labels beyond this are hashed per call).
const BACKEND_HASHES: usize = 64;
const EGRESS_WINDOW_MS: u64 = 3_600_000;

/// Connection and script parameters of one cell, built from `[admission.redis]` by
/// `admission::config` (storage does not read the admission section itself).
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// `redis://` or `rediss://`; no credentials in it. With `cluster`, one seed node.
    pub url: String,
    /// Talk to a Redis Cluster (seeded from `url` and `seeds`) instead of one server.
    pub cluster: bool,
    /// Further cluster seed nodes (same scheme as `url`).
    pub seeds: Vec<String>,
    pub username: Option<String>,
    pub password: Option<Secret>,
    /// With `rediss://`: `false` accepts any server certificate.
    pub verify_tls: bool,
    /// With `rediss://` and verification: PEM file of the roots that replace the system's.
    pub ca_file: Option<std::path::PathBuf>,
    /// HMAC key of tenant and backend ids; `None` = plain SHA-256.
    pub id_secret: Option<Secret>,
    pub key_prefix: String,
    pub cell: String,
    /// Default ceilings sent with every acquire (overrides live in Redis).
    pub limits: Limits,
    pub lease_ttl: Duration,
    /// How long a waiter entry lives without a poll (see `lua/admission.lua`).
    pub waiter_ttl: Duration,
    pub requests_per_minute: u64,
    pub egress_per_hour: u64,
    /// `XTRIM MAXLEN ~` of the event stream (once per script call).
    pub max_events: u64,
    /// Expired leases reaped per call at most.
    pub reap_batch: u32,
    /// Batch calls outstanding at once (see [`super::batcher`]).
    pub batch_in_flight: usize,
}

impl CoordinatorConfig {
    pub fn uses_tls(&self) -> bool {
        self.url.trim().starts_with("rediss://")
    }
}

/// The five default ceilings of a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub service_bytes: u64,
    pub service_transfers: u64,
    pub tenant_bytes: u64,
    pub tenant_transfers: u64,
    pub backend_transfers: u64,
}

/// What one transfer asks of the cluster, as the script sees it.
#[derive(Debug, Clone)]
pub struct LeaseRequest {
    /// Chosen once per transfer and reused on every attempt (acquire is idempotent on it).
    pub lease_id: LeaseId,
    pub tenant: Option<TenantId>,
    /// Backend label (hashed before it reaches Redis).
    pub backend: String,
    pub bytes: u64,
    /// Operation label recorded in events (`upload`, `download`, ...).
    pub operation: &'static str,
}

/// Handle to one cell on one Redis server. Cheap to clone.
#[derive(Clone)]
pub struct RedisCoordinator {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Connection,
    keys: CellKeys,
    hasher: IdHasher,
    /// Backend label -> its hash: backends are a handful of labels, hashed on every
    /// acquire otherwise (bounded by [`BACKEND_HASHES`]).
    backend_hashes: std::sync::Mutex<std::collections::HashMap<String, String>>,
    config: CoordinatorConfig,
    batcher: OnceLock<Batcher>,
}

impl std::fmt::Debug for RedisCoordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCoordinator")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

fn category(err: &RedisError) -> String {
    if connection::is_certificate_error(err) {
        "tls_certificate_rejected".into()
    } else if err.is_timeout() {
        "timeout".into()
    } else if err.is_connection_refusal() {
        "connection_refused".into()
    } else if err.is_connection_dropped() {
        "connection_dropped".into()
    } else if err.is_io_error() {
        "io".into()
    } else {
        format!("{:?}", err.kind()).to_lowercase()
    }
}

/// A refused certificate is not retried: the next handshake meets the same certificate.
fn retryable(err: &RedisError) -> bool {
    !connection::is_certificate_error(err)
        && (err.is_io_error() || err.is_connection_dropped() || err.is_timeout())
}

fn fmt_opt(value: Option<u64>) -> String {
    value.map_or_else(|| "-".to_string(), |v| v.to_string())
}

impl RedisCoordinator {
    /// Build the client without connecting: the node starts even while Redis is down, and
    /// admission fails closed until it answers.
    pub fn connect(config: &CoordinatorConfig) -> Result<Self, Error> {
        let ca_pem = match &config.ca_file {
            Some(path) if config.uses_tls() && config.verify_tls => Some(
                std::fs::read(path).map_err(|_| Error::Unavailable("ca_file_unreadable".into()))?,
            ),
            _ => None,
        };
        let mut urls = vec![config.url.clone()];
        if config.cluster {
            urls.extend(config.seeds.iter().cloned());
        }
        let conn = connection::connect(&ConnectSpec {
            urls,
            cluster: config.cluster,
            username: config.username.as_deref(),
            password: config.password.as_ref().map(|p| p.expose()),
            verify_tls: config.verify_tls,
            ca_pem,
            call_timeout: CALL_TIMEOUT,
        })
        .map_err(|e| Error::Unavailable(category(&e)))?;
        let keys = CellKeys::new(&config.key_prefix, &config.cell);
        // ADM-9: every script call names keys of one hash slot, so it runs on one primary
        // and is atomic there (the cell id cannot contain braces, so this always holds).
        let traffic = keys.traffic(QuotaKind::Egress, "0");
        let all = keys.admission().iter().map(String::as_str);
        if !connection::check_one_slot(all.chain([traffic.as_str()])) {
            return Err(Error::Unavailable("keys_span_slots".into()));
        }
        Ok(Self {
            inner: Arc::new(Inner {
                conn,
                keys,
                hasher: IdHasher::new(config.id_secret.as_ref().map(|s| s.expose())),
                config: config.clone(),
                backend_hashes: Default::default(),
                batcher: OnceLock::new(),
            }),
        })
    }

    /// `true` when connected to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.inner.conn.is_cluster()
    }

    pub fn keys(&self) -> &CellKeys {
        &self.inner.keys
    }

    pub fn hasher(&self) -> &IdHasher {
        &self.inner.hasher
    }

    pub fn config(&self) -> &CoordinatorConfig {
        &self.inner.config
    }

    /// The hash of a backend label, computed once per label (up to [`BACKEND_HASHES`]).
    fn backend_hash(&self, backend: &str) -> String {
        let mut cache = self
            .inner
            .backend_hashes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(hash) = cache.get(backend) {
            return hash.clone();
        }
        let hash = self.inner.hasher.backend(backend);
        if cache.len() < BACKEND_HASHES {
            cache.insert(backend.to_string(), hash.clone());
        }
        hash
    }

    fn tenant_hash(&self, tenant: Option<&TenantId>) -> String {
        tenant.map_or_else(|| "-".to_string(), |t| self.inner.hasher.tenant(t))
    }

    fn invocation(&self, op: &str) -> Cmd {
        self.invocation_with(op, None)
    }

    /// A call of `op`; `extra_key` is `KEYS[9]` (a quota charge's traffic key).
    fn invocation_with(&self, op: &str, extra_key: Option<&str>) -> Cmd {
        let keys = self.inner.keys.admission().iter().map(String::as_str);
        let mut inv = SCRIPT.call(keys.chain(extra_key));
        inv.arg(op)
            .arg(self.inner.config.max_events)
            .arg(self.inner.config.reap_batch);
        inv
    }

    async fn call(&self, inv: &Cmd, idempotent: bool) -> Result<Vec<String>, Error> {
        invoke(&self.inner.conn, inv, idempotent).await
    }

    /// The node's batch queue, started on first use (inside the runtime).
    fn batcher(&self) -> &Batcher {
        self.inner.batcher.get_or_init(|| {
            let c = &self.inner.config;
            Batcher::spawn(BatchContext {
                conn: self.inner.conn.clone(),
                in_flight: c.batch_in_flight.max(1),
                keys: self.inner.keys.admission().to_vec(),
                common: [c.max_events.to_string(), c.reap_batch.to_string()],
                defaults: [
                    c.limits.service_bytes.to_string(),
                    c.limits.service_transfers.to_string(),
                    c.limits.tenant_bytes.to_string(),
                    c.limits.tenant_transfers.to_string(),
                    c.limits.backend_transfers.to_string(),
                    (c.lease_ttl.as_millis() as u64).to_string(),
                    (c.waiter_ttl.as_millis() as u64).to_string(),
                ],
            })
        })
    }

    /// One acquire attempt. `first` records a `queued` event if it is rejected.
    pub async fn try_acquire(
        &self,
        request: &LeaseRequest,
        first: bool,
    ) -> Result<AcquireReply, Error> {
        let item = BatchItem::Acquire {
            lease_id: request.lease_id.to_string(),
            tenant: self.tenant_hash(request.tenant.as_ref()),
            backend: self.backend_hash(&request.backend),
            bytes: request.bytes,
            operation: request.operation,
            first,
        };
        Ok(reply::parse_acquire(&self.batcher().submit(item).await?)?)
    }

    /// One acquire attempt as its own script call (`acquire` op), without batching.
    pub async fn try_acquire_unbatched(
        &self,
        request: &LeaseRequest,
        first: bool,
    ) -> Result<AcquireReply, Error> {
        let c = &self.inner.config;
        let mut inv = self.invocation("acquire");
        inv.arg(request.lease_id.as_str())
            .arg(self.tenant_hash(request.tenant.as_ref()))
            .arg(self.backend_hash(&request.backend))
            .arg(request.bytes)
            .arg(c.limits.service_bytes)
            .arg(c.limits.service_transfers)
            .arg(c.limits.tenant_bytes)
            .arg(c.limits.tenant_transfers)
            .arg(c.limits.backend_transfers)
            .arg(c.lease_ttl.as_millis() as u64)
            .arg(request.operation)
            .arg(c.waiter_ttl.as_millis() as u64)
            .arg(if first { "1" } else { "0" });
        Ok(reply::parse_acquire(&self.call(&inv, true).await?)?)
    }

    /// Clear the waiter entry of `request` and drop any lease it holds; record `timed_out`
    /// with the blocking dimension when one is given.
    pub async fn abandon(
        &self,
        request: &LeaseRequest,
        dimension: Option<Dimension>,
    ) -> Result<bool, Error> {
        self.abandon_as(request, dimension, false).await
    }

    /// [`RedisCoordinator::abandon`], recording `abandoned` instead of `timed_out` when
    /// `disconnected` (the caller dropped the wait: e.g. the client went away).
    pub async fn abandon_as(
        &self,
        request: &LeaseRequest,
        dimension: Option<Dimension>,
        disconnected: bool,
    ) -> Result<bool, Error> {
        let item = BatchItem::Abandon {
            lease_id: request.lease_id.to_string(),
            tenant: self.tenant_hash(request.tenant.as_ref()),
            backend: self.backend_hash(&request.backend),
            bytes: request.bytes,
            operation: request.operation,
            dimension: dimension.map_or("-", Dimension::as_str),
            kind: if disconnected {
                "abandoned"
            } else {
                "timed_out"
            },
        };
        let reply = self.batcher().submit(item).await?;
        Ok(reply::parse_count(&reply, "ABANDONED")? == 1)
    }

    pub async fn renew(
        &self,
        lease_id: &LeaseId,
        token: &FencingToken,
    ) -> Result<RenewReply, Error> {
        let mut inv = self.invocation("renew");
        inv.arg(lease_id.as_str())
            .arg(token.value())
            .arg(self.inner.config.lease_ttl.as_millis() as u64);
        Ok(reply::parse_renew(&self.call(&inv, true).await?)?)
    }

    /// Release with `outcome` (`completed`, `failed`, `interrupted`), recorded in the
    /// `completed` event.
    pub async fn release(
        &self,
        lease_id: &LeaseId,
        token: &FencingToken,
        outcome: &'static str,
    ) -> Result<ReleaseReply, Error> {
        let item = BatchItem::Release {
            lease_id: lease_id.to_string(),
            token: token.value(),
            outcome,
        };
        Ok(reply::parse_release(&self.batcher().submit(item).await?)?)
    }

    /// A release as its own script call (`release` op), without batching.
    pub async fn release_unbatched(
        &self,
        lease_id: &LeaseId,
        token: &FencingToken,
        outcome: &'static str,
    ) -> Result<ReleaseReply, Error> {
        let mut inv = self.invocation("release");
        inv.arg(lease_id.as_str()).arg(token.value()).arg(outcome);
        Ok(reply::parse_release(&self.call(&inv, true).await?)?)
    }

    /// Expire overdue leases now (bounded by `reap_batch`); returns how many.
    pub async fn reap(&self) -> Result<u64, Error> {
        let inv = self.invocation("reap");
        Ok(reply::parse_count(&self.call(&inv, true).await?, "REAPED")?)
    }

    pub async fn snapshot(
        &self,
        tenant: Option<&TenantId>,
        backend: Option<&str>,
    ) -> Result<SnapshotReply, Error> {
        let mut inv = self.invocation("snapshot");
        inv.arg(self.tenant_hash(tenant))
            .arg(backend.map_or_else(|| "-".to_string(), |b| self.backend_hash(b)));
        Ok(reply::parse_snapshot(&self.call(&inv, true).await?)?)
    }

    /// Set (values) or clear (`None`s) a tenant override; returns the new policy version.
    pub async fn set_policy(
        &self,
        tenant: &TenantId,
        bytes: Option<u64>,
        transfers: Option<u64>,
    ) -> Result<u64, Error> {
        let mut inv = self.invocation("policy");
        inv.arg(self.inner.hasher.tenant(tenant))
            .arg(fmt_opt(bytes))
            .arg(fmt_opt(transfers));
        Ok(reply::parse_policy(&self.call(&inv, false).await?)?)
    }

    /// The cluster-wide limits stored in the cell, bootstrapping the absent ones from this
    /// node's configured limits first (the first node to call sets them for everyone).
    pub async fn bootstrap_limits(&self) -> Result<StoredLimits, Error> {
        let l = self.inner.config.limits;
        self.limits_call(
            "bootstrap",
            [
                Some(l.service_bytes),
                Some(l.service_transfers),
                Some(l.tenant_bytes),
                Some(l.tenant_transfers),
                Some(l.backend_transfers),
            ],
            true,
        )
        .await
    }

    /// Set the given cluster-wide limits (`None` = unchanged); returns what is stored now.
    pub async fn set_limits(&self, values: [Option<u64>; 5]) -> Result<StoredLimits, Error> {
        self.limits_call("set", values, false).await
    }

    /// The cluster-wide limits stored in the cell.
    pub async fn read_limits(&self) -> Result<StoredLimits, Error> {
        self.limits_call("read", [None; 5], true).await
    }

    async fn limits_call(
        &self,
        mode: &str,
        values: [Option<u64>; 5],
        idempotent: bool,
    ) -> Result<StoredLimits, Error> {
        let mut inv = self.invocation("limits");
        inv.arg(mode);
        for value in values {
            inv.arg(fmt_opt(value));
        }
        Ok(reply::parse_limits(&self.call(&inv, idempotent).await?)?)
    }

    /// Set (`Some`) or clear a backend's cluster-wide transfer override; returns the new
    /// policy version.
    pub async fn set_backend_policy(
        &self,
        backend: &str,
        transfers: Option<u64>,
    ) -> Result<u64, Error> {
        let mut inv = self.invocation("backend_policy");
        inv.arg(self.backend_hash(backend)).arg(fmt_opt(transfers));
        Ok(reply::parse_policy(&self.call(&inv, false).await?)?)
    }

    /// Charge `amount` to the tenant's request or egress window (Redis time).
    pub async fn charge(
        &self,
        tenant: &TenantId,
        kind: QuotaKind,
        amount: u64,
    ) -> Result<ChargeReply, Error> {
        let (limit, window) = match kind {
            QuotaKind::Requests => (self.inner.config.requests_per_minute, REQUEST_WINDOW_MS),
            QuotaKind::Egress => (self.inner.config.egress_per_hour, EGRESS_WINDOW_MS),
        };
        let traffic = self
            .inner
            .keys
            .traffic(kind, &self.inner.hasher.tenant(tenant));
        let mut inv = self.invocation_with("charge", Some(&traffic));
        inv.arg(kind.as_str()).arg(amount).arg(limit).arg(window);
        Ok(reply::parse_charge(&self.call(&inv, false).await?)?)
    }

    /// The newest `count` decision events, oldest first, as field maps.
    pub async fn recent_events(
        &self,
        count: usize,
    ) -> Result<Vec<BTreeMap<String, String>>, Error> {
        let mut conn = self.inner.conn.clone();
        let reply: redis::streams::StreamRangeReply = redis::cmd("XREVRANGE")
            .arg(self.inner.keys.events())
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(count)
            .query_async(&mut conn)
            .await
            .map_err(|e| Error::Unavailable(category(&e)))?;
        let mut events: Vec<_> = reply
            .ids
            .into_iter()
            .map(|entry| {
                entry
                    .map
                    .into_iter()
                    .map(|(k, v)| (k, redis::from_redis_value::<String>(v).unwrap_or_default()))
                    .collect()
            })
            .collect();
        events.reverse();
        Ok(events)
    }

    /// Length of the decision event stream.
    pub async fn event_count(&self) -> Result<u64, Error> {
        let mut conn = self.inner.conn.clone();
        redis::cmd("XLEN")
            .arg(self.inner.keys.events())
            .query_async(&mut conn)
            .await
            .map_err(|e| Error::Unavailable(category(&e)))
    }

    /// `PING`, for readiness checks.
    pub async fn ping(&self) -> Result<(), Error> {
        let mut conn = self.inner.conn.clone();
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .map(|_| ())
            .map_err(|e| Error::Unavailable(category(&e)))
    }
}

/// Run one script invocation, retrying idempotent ones twice on I/O, dropped-connection
/// and timeout errors. Errors are reduced to a category.
pub(super) async fn invoke<T: redis::FromRedisValue>(
    conn: &Connection,
    inv: &Cmd,
    idempotent: bool,
) -> Result<T, Error> {
    let mut backoff = Duration::from_millis(20);
    let mut attempt = 0;
    loop {
        match SCRIPT.run::<T>(conn, inv).await {
            Ok(reply) => return Ok(reply),
            Err(err) if idempotent && attempt < 2 && retryable(&err) => {
                attempt += 1;
                tokio::time::sleep(backoff).await;
                backoff *= 3;
            }
            Err(err) => {
                let category = category(&err);
                tracing::debug!(%category, "admission coordinator call failed");
                return Err(Error::Unavailable(category));
            }
        }
    }
}
