//! The Redis side of cluster admission: one `ConnectionManager`, one script, typed calls.
//!
//! * Every call runs `lua/admission.lua` by `EVALSHA`; redis-rs reloads the script on
//!   `NOSCRIPT` (after a restart, failover or `SCRIPT FLUSH`).
//! * The manager reconnects in the background, but the command that hit a dead connection
//!   fails. Idempotent operations (acquire by lease id, renew, release, abandon, snapshot,
//!   reap) are retried twice on I/O, dropped-connection and timeout errors; policy changes
//!   and quota charges are not (a retry could apply twice) and fail closed instead.
//! * Errors are reduced to a category (`io`, `timeout`, ...) before they become
//!   [`Error::Unavailable`], so no server message or connection detail leaks.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{IntoConnectionInfo, RedisError, Script, ScriptInvocation};
use tokio::time::Instant;

use super::batcher::{BatchContext, BatchItem, Batcher};
use super::keys::CellKeys;
use crate::actors::lease_holder::{LeaseBackend, Outcome};
use crate::admission::config::RedisAdmissionConfig;
use crate::admission::hashing::IdHasher;
use crate::admission::reply::{
    self, AcquireReply, ChargeReply, Dimension, FencingToken, Occupancy, ReleaseReply, RenewReply,
    SnapshotReply,
};
use crate::admission::{Error, Footprint, Operation, QuotaKind, wait};
use crate::ids::TenantId;

/// The admission script, hashed once per process.
static SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/admission.lua")));

/// Response timeout of one Redis call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(1);
/// A waiter that has not polled for this long loses its place at the head of the queue.
const WAITER_TTL: Duration = Duration::from_secs(2);
const REQUEST_WINDOW_MS: u64 = 60_000;
const EGRESS_WINDOW_MS: u64 = 3_600_000;

/// What one transfer asks of the cluster.
#[derive(Debug, Clone)]
pub struct LeaseRequest {
    /// Chosen once per transfer and reused on every attempt (acquire is idempotent on it).
    pub lease_id: String,
    pub tenant: Option<TenantId>,
    pub backend: String,
    pub footprint: Footprint,
    pub operation: Operation,
}

/// A cluster lease granted by the script.
#[derive(Debug)]
pub struct ClusterLease {
    pub lease_id: String,
    pub token: FencingToken,
    pub policy_version: u64,
    pub occupancy: Occupancy,
    /// When the admitting attempt was sent: the base of the holder's safe deadline.
    pub sent_at: Instant,
}

/// Handle to one cell on one Redis server. Cheap to clone.
#[derive(Clone)]
pub struct RedisCoordinator {
    inner: Arc<Inner>,
}

struct Inner {
    conn: ConnectionManager,
    keys: CellKeys,
    hasher: IdHasher,
    config: RedisAdmissionConfig,
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
    if err.is_timeout() {
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

fn retryable(err: &RedisError) -> bool {
    err.is_io_error() || err.is_connection_dropped() || err.is_timeout()
}

fn fmt_opt(value: Option<u64>) -> String {
    value.map_or_else(|| "-".to_string(), |v| v.to_string())
}

impl RedisCoordinator {
    /// Build the client without connecting: the node starts even while Redis is down, and
    /// admission fails closed until it answers.
    pub fn connect(config: &RedisAdmissionConfig) -> Result<Self, Error> {
        let mut url = config.url.trim().to_string();
        if config.uses_tls() && !config.verify_tls {
            url.push_str("#insecure");
        }
        let mut info = url
            .into_connection_info()
            .map_err(|e| Error::Unavailable(category(&e)))?;
        let mut settings = info.redis_settings().clone();
        if let Some(user) = &config.username {
            settings = settings.set_username(user);
        }
        if let Some(password) = &config.password {
            settings = settings.set_password(password.expose());
        }
        info = info.set_redis_settings(settings);
        let client = redis::Client::open(info).map_err(|e| Error::Unavailable(category(&e)))?;
        let manager_config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(CALL_TIMEOUT))
            .set_connection_timeout(Some(CALL_TIMEOUT))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, manager_config)
            .map_err(|e| Error::Unavailable(category(&e)))?;
        Ok(Self {
            inner: Arc::new(Inner {
                conn,
                keys: CellKeys::new(&config.key_prefix, &config.cell),
                hasher: IdHasher::new(config.id_secret.as_ref().map(|s| s.expose())),
                config: config.clone(),
                batcher: OnceLock::new(),
            }),
        })
    }

    pub fn keys(&self) -> &CellKeys {
        &self.inner.keys
    }

    pub fn hasher(&self) -> &IdHasher {
        &self.inner.hasher
    }

    pub fn config(&self) -> &RedisAdmissionConfig {
        &self.inner.config
    }

    fn tenant_hash(&self, tenant: Option<&TenantId>) -> String {
        tenant.map_or_else(|| "-".to_string(), |t| self.inner.hasher.tenant(t))
    }

    fn invocation(&self, op: &str) -> ScriptInvocation<'static> {
        let mut inv = SCRIPT.prepare_invoke();
        for key in self.inner.keys.admission() {
            inv.key(key);
        }
        inv.arg(op)
            .arg(self.inner.config.max_events)
            .arg(self.inner.config.reap_batch);
        inv
    }

    async fn call(
        &self,
        inv: &ScriptInvocation<'_>,
        idempotent: bool,
    ) -> Result<Vec<String>, Error> {
        invoke(&self.inner.conn, inv, idempotent).await
    }

    /// The node's batch queue, started on first use (inside the runtime).
    fn batcher(&self) -> &Batcher {
        self.inner.batcher.get_or_init(|| {
            let c = &self.inner.config;
            Batcher::spawn(BatchContext {
                conn: self.inner.conn.clone(),
                script: &SCRIPT,
                keys: self.inner.keys.admission().to_vec(),
                common: [c.max_events.to_string(), c.reap_batch.to_string()],
                defaults: [
                    c.service_bytes.bytes().to_string(),
                    c.service_transfers.to_string(),
                    c.tenant_bytes.bytes().to_string(),
                    c.tenant_transfers.to_string(),
                    c.backend_transfers.to_string(),
                    (c.lease_ttl.get().as_millis() as u64).to_string(),
                    (WAITER_TTL.as_millis() as u64).to_string(),
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
            lease_id: request.lease_id.clone(),
            tenant: self.tenant_hash(request.tenant.as_ref()),
            backend: self.inner.hasher.backend(&request.backend),
            bytes: request.footprint.bytes(),
            operation: request.operation.as_str(),
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
        inv.arg(&request.lease_id)
            .arg(self.tenant_hash(request.tenant.as_ref()))
            .arg(self.inner.hasher.backend(&request.backend))
            .arg(request.footprint.bytes())
            .arg(c.service_bytes.bytes())
            .arg(c.service_transfers)
            .arg(c.tenant_bytes.bytes())
            .arg(c.tenant_transfers)
            .arg(c.backend_transfers)
            .arg(c.lease_ttl.get().as_millis() as u64)
            .arg(request.operation.as_str())
            .arg(WAITER_TTL.as_millis() as u64)
            .arg(if first { "1" } else { "0" });
        Ok(reply::parse_acquire(&self.call(&inv, true).await?)?)
    }

    /// Wait for a lease until `deadline`, polling with jitter (see [`wait`]). A footprint
    /// that can never fit fails at once. If the wait ends without a lease (timeout, error,
    /// or the future being dropped), an `abandon` call clears the waiter entry and any
    /// lease a lost reply may have granted.
    pub async fn acquire(
        &self,
        request: &LeaseRequest,
        deadline: Instant,
    ) -> Result<ClusterLease, Error> {
        let mut guard = AbandonOnDrop {
            coordinator: self.clone(),
            request: request.clone(),
            dimension: None,
            armed: true,
            disconnected: true,
        };
        let retry_interval = self.inner.config.retry_interval.get();
        // Set once any reply arrived: a deadline that passes before that is an unreachable
        // coordinator (503 admission_unavailable), after it saturation (503 busy).
        let answered = AtomicBool::new(false);
        let attempts = async {
            let mut attempt = 0u32;
            loop {
                let sent_at = Instant::now();
                let reply = self.try_acquire(request, attempt == 0).await?;
                answered.store(true, Ordering::Relaxed);
                match reply {
                    AcquireReply::Admitted {
                        token,
                        policy_version,
                        occupancy,
                        ..
                    } => {
                        return Ok(ClusterLease {
                            lease_id: request.lease_id.clone(),
                            token,
                            policy_version,
                            occupancy,
                            sent_at,
                        });
                    }
                    AcquireReply::NeverFits { dimension, .. } => {
                        return Err(Error::NeverFits(dimension));
                    }
                    AcquireReply::Rejected { dimension, .. } => {
                        guard.dimension = Some(dimension);
                        let remaining = deadline.saturating_duration_since(Instant::now());
                        if remaining.is_zero() {
                            return Err(Error::TimedOut("cluster lease"));
                        }
                        let delay =
                            wait::next_delay(attempt, retry_interval, remaining, &mut rand::rng());
                        tokio::time::sleep(delay).await;
                        attempt = attempt.saturating_add(1);
                    }
                }
            }
        };
        let result = match tokio::time::timeout_at(deadline, attempts).await {
            Ok(result) => result,
            Err(_) if !answered.load(Ordering::Relaxed) => {
                Err(Error::Unavailable("timeout".into()))
            }
            Err(_) => Err(Error::TimedOut("cluster lease")),
        };
        // Reaching this point means the wait ended here, not by the caller dropping it.
        guard.disconnected = false;
        if matches!(result, Ok(_) | Err(Error::NeverFits(_))) {
            guard.armed = false;
        }
        result
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
            lease_id: request.lease_id.clone(),
            tenant: self.tenant_hash(request.tenant.as_ref()),
            backend: self.inner.hasher.backend(&request.backend),
            bytes: request.footprint.bytes(),
            operation: request.operation.as_str(),
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

    pub async fn renew(&self, lease_id: &str, token: &FencingToken) -> Result<RenewReply, Error> {
        let mut inv = self.invocation("renew");
        inv.arg(lease_id)
            .arg(token.value())
            .arg(self.inner.config.lease_ttl.get().as_millis() as u64);
        Ok(reply::parse_renew(&self.call(&inv, true).await?)?)
    }

    pub async fn release(
        &self,
        lease_id: &str,
        token: &FencingToken,
        outcome: Outcome,
    ) -> Result<ReleaseReply, Error> {
        let item = BatchItem::Release {
            lease_id: lease_id.to_string(),
            token: token.value(),
            outcome: outcome.as_str(),
        };
        Ok(reply::parse_release(&self.batcher().submit(item).await?)?)
    }

    /// A release as its own script call (`release` op), without batching.
    pub async fn release_unbatched(
        &self,
        lease_id: &str,
        token: &FencingToken,
        outcome: Outcome,
    ) -> Result<ReleaseReply, Error> {
        let mut inv = self.invocation("release");
        inv.arg(lease_id).arg(token.value()).arg(outcome.as_str());
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
            .arg(backend.map_or_else(|| "-".to_string(), |b| self.inner.hasher.backend(b)));
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

    /// Charge `amount` to the tenant's request or egress window (Redis time).
    pub async fn charge(
        &self,
        tenant: &TenantId,
        kind: QuotaKind,
        amount: u64,
    ) -> Result<ChargeReply, Error> {
        let (limit, window) = match kind {
            QuotaKind::Requests => (
                self.inner.config.tenant_requests_per_minute,
                REQUEST_WINDOW_MS,
            ),
            QuotaKind::Egress => (
                self.inner.config.tenant_egress_per_hour.bytes(),
                EGRESS_WINDOW_MS,
            ),
        };
        let mut inv = self.invocation("charge");
        inv.key(
            self.inner
                .keys
                .traffic(kind, &self.inner.hasher.tenant(tenant)),
        )
        .arg(kind.as_str())
        .arg(amount)
        .arg(limit)
        .arg(window);
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
    conn: &ConnectionManager,
    inv: &ScriptInvocation<'_>,
    idempotent: bool,
) -> Result<T, Error> {
    let mut backoff = Duration::from_millis(20);
    let mut attempt = 0;
    loop {
        let mut conn = conn.clone();
        match inv.invoke_async::<T>(&mut conn).await {
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

/// Runs `abandon` in the background unless disarmed: covers timeouts, errors and a caller
/// that drops the acquire future (client disconnect) alike.
struct AbandonOnDrop {
    coordinator: RedisCoordinator,
    request: LeaseRequest,
    dimension: Option<Dimension>,
    armed: bool,
    /// Still set when the acquire future was dropped mid-wait (the caller went away).
    disconnected: bool,
}

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let coordinator = self.coordinator.clone();
        let request = self.request.clone();
        let (dimension, disconnected) = (self.dimension, self.disconnected);
        runtime.spawn(async move {
            if let Err(err) = coordinator
                .abandon_as(&request, dimension, disconnected)
                .await
            {
                tracing::debug!(error = %err, "abandoning a cluster admission attempt failed; the lease expires by TTL");
            }
        });
    }
}

impl LeaseBackend for RedisCoordinator {
    fn renew<'a>(
        &'a self,
        lease_id: &'a str,
        token: &'a FencingToken,
    ) -> BoxFuture<'a, Result<RenewReply, Error>> {
        Box::pin(RedisCoordinator::renew(self, lease_id, token))
    }

    fn release<'a>(
        &'a self,
        lease_id: &'a str,
        token: &'a FencingToken,
        outcome: Outcome,
    ) -> BoxFuture<'a, Result<ReleaseReply, Error>> {
        Box::pin(RedisCoordinator::release(self, lease_id, token, outcome))
    }
}
