//! [`Admission`]: the one entry point the HTTP layer calls.
//!
//! `admit` reserves local permits first and then, when `[admission.redis]` is configured,
//! a cluster lease, all under `admission.acquisition_timeout` (the cluster wait is further
//! bounded by `admission.redis.wait`). Any failure drops what was already reserved. The
//! returned [`AdmissionPermit`] is an RAII guard: dropping it returns the local permits at
//! once and tells the node's lease holder to release the cluster lease.
//!
//! Traffic quotas (`charge_request`, `charge_egress`) and overrides need Redis; in local
//! mode quotas are not enforced and override calls answer [`Error::NotDistributed`].

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use ractor::{Actor, ActorRef, ActorStatus};
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::acquire::{ClusterLease, wait_for_lease};
use super::budget::{LocalPermit, LocalSnapshot, TransferBudget};
use super::config::{AdmissionConfig, RedisAdmissionConfig};
use super::error::{Error, QuotaKind};
use super::footprint::{Footprint, Operation};
use super::handover::Parked;
use super::lease::Outcome;
use super::lease_holder::{HeldLease, LeaseHolder, LeaseHolderArgs, LeaseHolderMsg, LeaseTiming};
use super::limits::{self, Disagreement, LimitsUpdate};
use super::metrics::{AdmissionMetrics, KindLabels, OperationLabels, OutcomeLabels};
use crate::ids::TenantId;
use crate::storage::redis::reply::{
    ChargeReply, FencingToken, LeaseId, Occupancy, ReleaseReply, SnapshotReply, StoredLimits,
};
use crate::storage::redis::{LeaseRequest, RedisCoordinator};
use crate::values::ByteSize;

/// One transfer asking to run.
#[derive(Debug, Clone)]
pub struct TransferRequest {
    pub operation: Operation,
    pub tenant: Option<TenantId>,
    /// Physical backend label (a small fixed set: `fs`, `s3`, ...).
    pub backend: String,
    pub footprint: Footprint,
}

/// A live tenant override; `None` keeps the configured default for that dimension.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct TenantOverride {
    pub bytes: Option<ByteSize>,
    pub transfers: Option<u32>,
}

/// Local and (when configured) cluster occupancy.
#[derive(Debug, Clone, Serialize)]
pub struct AdmissionSnapshot {
    pub local: LocalSnapshot,
    pub cluster: Option<SnapshotReply>,
}

/// Lease facts a transfer may pass downstream (the fencing token for downstream fencing).
/// Not `Clone`, like the token it carries.
#[derive(Debug, PartialEq, Eq)]
pub struct LeaseInfo {
    pub lease_id: LeaseId,
    pub fencing_token: FencingToken,
    pub policy_version: u64,
    pub occupancy: Occupancy,
}

/// The coordinator of the cell and the section it was built from (the policy half).
struct Cluster {
    coordinator: RedisCoordinator,
    config: RedisAdmissionConfig,
}

/// The admission service of one node. Cheap to clone.
#[derive(Clone)]
pub struct Admission {
    inner: Arc<Inner>,
}

struct Inner {
    config: AdmissionConfig,
    budget: TransferBudget,
    cluster: Option<Cluster>,
    metrics: AdmissionMetrics,
    parked: Parked<AdmissionPermit>,
    /// The node supervisor the lease holder is linked under.
    supervisor: std::sync::OnceLock<ractor::ActorCell>,
    /// The node's one lease holder, started with the first lease (and again if it stopped).
    holder: RwLock<Option<ActorRef<LeaseHolderMsg>>>,
    /// Keys of the leases handed to the holder.
    next_lease: AtomicU64,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("distributed", &self.inner.cluster.is_some())
            .finish_non_exhaustive()
    }
}

impl Admission {
    /// `PING` the Redis coordinator (the node's dependency probe); `None` without
    /// `[admission.redis]`.
    pub async fn probe_coordinator(&self) -> Option<Result<(), Error>> {
        match &self.inner.cluster {
            Some(cluster) => Some(cluster.coordinator.ping().await.map_err(Error::from)),
            None => None,
        }
    }

    /// Build the service. With `[admission.redis]` the Redis client is created without
    /// connecting, so a node starts while Redis is down and admission fails closed. Call it
    /// inside a tokio runtime.
    pub fn new(config: &AdmissionConfig, metrics: AdmissionMetrics) -> Result<Self, Error> {
        let cluster = config
            .redis
            .as_ref()
            .map(|redis| {
                Ok::<_, Error>(Cluster {
                    coordinator: RedisCoordinator::connect(&redis.coordinator())?,
                    config: redis.clone(),
                })
            })
            .transpose()?;
        let budget =
            TransferBudget::new(config).with_available_gauge(metrics.local_available_bytes.clone());
        Ok(Self {
            inner: Arc::new(Inner {
                config: config.clone(),
                budget,
                cluster,
                metrics,
                parked: Parked::default(),
                supervisor: std::sync::OnceLock::new(),
                holder: RwLock::new(None),
                next_lease: AtomicU64::new(0),
            }),
        })
    }

    /// Link the lease holder (spawned with the first lease) under `supervisor` (the node's
    /// root), so the node's actor tree holds it. Set once; later calls are ignored.
    pub fn supervise_under(&self, supervisor: ractor::ActorCell) {
        let _ = self.inner.supervisor.set(supervisor);
    }

    pub fn is_distributed(&self) -> bool {
        self.inner.cluster.is_some()
    }

    pub fn coordinator(&self) -> Option<&RedisCoordinator> {
        self.inner.cluster.as_ref().map(|c| &c.coordinator)
    }

    pub fn metrics(&self) -> &AdmissionMetrics {
        &self.inner.metrics
    }

    /// Reserve everything `request` needs before its first byte is read.
    pub async fn admit(&self, request: TransferRequest) -> Result<AdmissionPermit, Error> {
        let cluster = Some(request.footprint);
        self.admit_scoped(request, cluster).await
    }

    /// Local permits only, never a cluster lease: for a relay whose transfer is counted
    /// by the lease of the node that ingests it (see [`Admission::admit_spanning`]).
    pub async fn admit_local(&self, request: TransferRequest) -> Result<AdmissionPermit, Error> {
        self.admit_scoped(request, None).await
    }

    /// Local permits for `request.footprint`, and one cluster lease for the whole
    /// transfer: this node's footprint plus `relay` (the bytes the relaying node holds
    /// under [`Admission::admit_local`]). One lease per transfer, whatever the hops.
    pub async fn admit_spanning(
        &self,
        request: TransferRequest,
        relay: Footprint,
    ) -> Result<AdmissionPermit, Error> {
        let cluster = Footprint::new(request.footprint.bytes().saturating_add(relay.bytes()));
        self.admit_scoped(request, cluster).await
    }

    /// Keep `permit` for a later request of the same transfer (the owner admits in the
    /// forwarder's pre-flight, the POST adopts it). Returns the reservation id. A
    /// reservation not adopted within [`super::handover::PARK_TTL`] is dropped (its lease is
    /// released as `interrupted`).
    pub fn park(&self, permit: AdmissionPermit, tag: String) -> String {
        self.inner.parked.park(permit, tag)
    }

    /// Take a parked permit back, if `id` is live and was parked with `tag`.
    pub fn adopt(&self, id: &str, tag: &str) -> Option<AdmissionPermit> {
        self.inner.parked.adopt(id, tag)
    }

    /// Drop a parked permit now (the request it was parked for was refused).
    pub fn discard(&self, id: &str, tag: &str) {
        drop(self.inner.parked.adopt(id, tag));
    }

    /// Number of parked reservations (for tests and the admin snapshot).
    pub fn parked(&self) -> usize {
        self.inner.parked.len()
    }

    async fn admit_scoped(
        &self,
        request: TransferRequest,
        cluster: Option<Footprint>,
    ) -> Result<AdmissionPermit, Error> {
        let started = Instant::now();
        let result = self.admit_inner(&request, cluster, started).await;
        let metrics = &self.inner.metrics;
        match &result {
            Ok(permit) => {
                metrics.decision(request.operation, "admitted");
                metrics
                    .wait_seconds
                    .get_or_create(&OperationLabels {
                        operation: request.operation.as_str(),
                    })
                    .observe(started.elapsed().as_secs_f64());
                if let Some(lease) = &permit.lease {
                    metrics.observe_occupancy(&lease.occupancy);
                }
            }
            Err(err) => metrics.decision(request.operation, err.outcome()),
        }
        result
    }

    async fn admit_inner(
        &self,
        request: &TransferRequest,
        cluster_footprint: Option<Footprint>,
        started: Instant,
    ) -> Result<AdmissionPermit, Error> {
        let deadline = started + self.inner.config.acquisition_timeout.get();
        let local = self
            .inner
            .budget
            .reserve(
                request.tenant.as_ref(),
                &request.backend,
                request.footprint,
                deadline,
            )
            .await?;
        let cancel = CancellationToken::new();
        let outcome = Arc::new(AtomicU8::new(Outcome::Interrupted.to_u8()));
        let (Some(cluster), Some(cluster_footprint)) = (&self.inner.cluster, cluster_footprint)
        else {
            return Ok(AdmissionPermit {
                local: Some(local),
                holder: None,
                lease: None,
                cancel,
                outcome,
            });
        };
        let redis = &cluster.config;
        let coordinator = &cluster.coordinator;
        let lease_request = LeaseRequest {
            lease_id: LeaseId::random(),
            tenant: request.tenant,
            backend: request.backend.clone(),
            bytes: cluster_footprint.bytes(),
            operation: request.operation.as_str(),
        };
        let cluster_deadline = deadline.min(Instant::now() + redis.wait.get());
        // On error `local` is dropped here, returning the local permits.
        let lease = wait_for_lease(
            coordinator,
            &lease_request,
            redis.retry_interval.get(),
            cluster_deadline,
        )
        .await?;
        let ClusterLease {
            lease_id,
            token,
            policy_version,
            occupancy,
            sent_at,
        } = lease;
        let info = LeaseInfo {
            lease_id: lease_id.clone(),
            fencing_token: token.duplicate(),
            policy_version,
            occupancy,
        };
        let lease = HeldLease {
            lease_id,
            token,
            sent_at,
            operation: request.operation,
            cancel: cancel.clone(),
            outcome: outcome.clone(),
        };
        let key = self.inner.next_lease.fetch_add(1, Ordering::Relaxed);
        // From here the lease is live in Redis. Handing it to the holder (which may have
        // to be spawned first) runs in a task of its own, so a caller dropped meanwhile
        // (its request cancelled) cannot leave the lease unheld until its TTL: the task
        // finishes the hand-over and, finding nobody to take the permit, releases it.
        let (answer, taken) = tokio::sync::oneshot::channel();
        let this = self.clone();
        let request = lease_request.clone();
        tokio::spawn(async move {
            let Some(cluster) = this.inner.cluster.as_ref() else {
                return;
            };
            let held = match this.holder(cluster).await {
                Some(holder) => holder
                    .send_message(LeaseHolderMsg::Hold(key, lease))
                    .is_ok()
                    .then_some(holder),
                None => None,
            };
            match held {
                Some(holder) => {
                    if answer.send(Some(holder.clone())).is_err() {
                        // The caller is gone: nobody will drop the permit.
                        let _ = holder.send_message(LeaseHolderMsg::Release(key, None));
                    }
                }
                None => {
                    // The token went down with the holder: drop the lease by id (abandon),
                    // whether or not the caller still waits.
                    let _ = cluster.coordinator.abandon(&request, None).await;
                    let _ = answer.send(None);
                }
            }
        });
        let held = taken.await.unwrap_or(None);
        match held {
            Some(holder) => Ok(AdmissionPermit {
                local: Some(local),
                holder: Some((holder, key)),
                lease: Some(info),
                cancel,
                outcome,
            }),
            // The hand-over abandoned the lease: answer as a coordinator failure.
            None => Err(Error::Unavailable("lease_holder_spawn".into())),
        }
    }

    /// The node's lease holder, started on first use (linked under the supervisor when one
    /// is set) and started again if it stopped.
    async fn holder(&self, cluster: &Cluster) -> Option<ActorRef<LeaseHolderMsg>> {
        let alive = |actor: &ActorRef<LeaseHolderMsg>| {
            matches!(
                actor.get_status(),
                ActorStatus::Starting | ActorStatus::Running | ActorStatus::Upgrading
            )
        };
        let current = self
            .inner
            .holder
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(actor) = current.filter(alive) {
            return Some(actor);
        }
        let redis = &cluster.config;
        let metrics = self.inner.metrics.clone();
        let release_metrics = self.inner.metrics.clone();
        let args = LeaseHolderArgs {
            backend: Arc::new(cluster.coordinator.clone()),
            timing: LeaseTiming {
                ttl: redis.lease_ttl.get(),
                renew_interval: redis.renew_interval.get(),
                retry_interval: redis.retry_interval.get().max(Duration::from_millis(20)),
            },
            policy: redis.lease_loss,
            on_loss: Arc::new(move |operation| {
                metrics
                    .lease_losses
                    .get_or_create(&OperationLabels {
                        operation: operation.as_str(),
                    })
                    .inc();
            }),
            on_release: Arc::new(move |reply| {
                let outcome = match reply {
                    Ok(ReleaseReply::Released) => "released",
                    Ok(ReleaseReply::Missing) => "missing",
                    Ok(ReleaseReply::Stale) => "stale",
                    Err(_) => "error",
                };
                release_metrics
                    .releases
                    .get_or_create(&OutcomeLabels { outcome })
                    .inc();
            }),
        };
        let spawned = match self.inner.supervisor.get() {
            Some(parent) => Actor::spawn_linked(None, LeaseHolder, args, parent.clone()).await,
            None => Actor::spawn(None, LeaseHolder, args).await,
        };
        let (actor, _join) = spawned.ok()?;
        let mut slot = self.inner.holder.write().unwrap_or_else(|p| p.into_inner());
        match slot.as_ref().filter(|a| alive(a)) {
            // Another admission started one meanwhile: use that one.
            Some(existing) => {
                actor.stop(None);
                Some(existing.clone())
            }
            None => {
                *slot = Some(actor.clone());
                Some(actor)
            }
        }
    }

    /// Charge one request to the tenant's per-minute quota (no-op in local mode).
    pub async fn charge_request(&self, tenant: &TenantId) -> Result<(), Error> {
        self.charge(tenant, QuotaKind::Requests, 1).await
    }

    /// Charge `bytes` about to be sent to the tenant's per-hour egress quota.
    pub async fn charge_egress(&self, tenant: &TenantId, bytes: u64) -> Result<(), Error> {
        if bytes == 0 {
            return Ok(());
        }
        self.charge(tenant, QuotaKind::Egress, bytes).await?;
        self.inner.metrics.egress_bytes.inc_by(bytes);
        Ok(())
    }

    /// Refuse (429 with `Retry-After`) when the tenant's egress window is already spent,
    /// before a download sends its head. Charges nothing.
    pub async fn check_egress(&self, tenant: &TenantId) -> Result<(), Error> {
        self.charge(tenant, QuotaKind::Egress, 0).await
    }

    async fn charge(&self, tenant: &TenantId, kind: QuotaKind, amount: u64) -> Result<(), Error> {
        let Some(cluster) = &self.inner.cluster else {
            return Ok(());
        };
        match cluster.coordinator.charge(tenant, kind, amount).await? {
            ChargeReply::Charged { .. } => Ok(()),
            ChargeReply::Rejected { retry_after, .. } => {
                self.inner
                    .metrics
                    .quota_rejections
                    .get_or_create(&KindLabels {
                        kind: kind.as_str(),
                    })
                    .inc();
                Err(Error::QuotaExceeded { kind, retry_after })
            }
        }
    }

    /// Apply a live tenant override on every node of the cell; returns the policy version.
    pub async fn set_override(
        &self,
        tenant: &TenantId,
        value: TenantOverride,
    ) -> Result<u64, Error> {
        let cluster = self.inner.cluster.as_ref().ok_or(Error::NotDistributed)?;
        if value.bytes.is_none() && value.transfers.is_none() {
            return Err(Error::InvalidOverride(
                "set bytes, transfers, or both (or clear the override)",
            ));
        }
        // Checked against the cluster-wide service limits stored in Redis (ADM-12).
        let stored = cluster.coordinator.bootstrap_limits().await?;
        let service_bytes = stored
            .service_bytes
            .unwrap_or(cluster.config.service_bytes.bytes());
        let service_transfers = stored
            .service_transfers
            .unwrap_or(u64::from(cluster.config.service_transfers));
        if let Some(bytes) = value.bytes
            && (bytes.bytes() == 0 || bytes.bytes() > service_bytes)
        {
            return Err(Error::InvalidOverride(
                "bytes must be between 1 and the service ceiling",
            ));
        }
        if let Some(transfers) = value.transfers
            && (transfers == 0 || u64::from(transfers) > service_transfers)
        {
            return Err(Error::InvalidOverride(
                "transfers must be between 1 and the service ceiling",
            ));
        }
        Ok(cluster
            .coordinator
            .set_policy(
                tenant,
                value.bytes.map(ByteSize::bytes),
                value.transfers.map(u64::from),
            )
            .await?)
    }

    /// The cluster-wide limits of the cell, bootstrapping absent ones from this node's file;
    /// logs a warning naming every limit where this node's file disagrees with the cluster
    /// (the cluster's value is enforced) and returns those disagreements (ADM-12).
    pub async fn bootstrap_limits(&self) -> Result<Vec<Disagreement>, Error> {
        let cluster = self.inner.cluster.as_ref().ok_or(Error::NotDistributed)?;
        let stored = cluster.coordinator.bootstrap_limits().await?;
        let found = limits::disagreements(&cluster.config, &stored);
        for d in &found {
            tracing::warn!(
                key = d.key,
                file = d.file,
                cluster = d.cluster,
                "this node's admission limit differs from the cluster-wide value stored in Redis; the cluster value is enforced (change it with PUT /v1/admin/admission/limits)"
            );
        }
        Ok(found)
    }

    /// Run [`Admission::bootstrap_limits`] in the background at start, retrying every
    /// second until Redis answers once (a node starts while Redis is down). Without
    /// `[admission.redis]` it does nothing.
    pub fn bootstrap_limits_in_background(&self) {
        if self.inner.cluster.is_none() {
            return;
        }
        let admission = self.clone();
        tokio::spawn(async move {
            while admission.bootstrap_limits().await.is_err() {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }

    /// The cluster-wide limits stored in the cell (bootstrapping absent ones).
    pub async fn cluster_limits(&self) -> Result<StoredLimits, Error> {
        let cluster = self.inner.cluster.as_ref().ok_or(Error::NotDistributed)?;
        Ok(cluster.coordinator.bootstrap_limits().await?)
    }

    /// Change the cluster-wide limits for every node of the cell; returns what is stored.
    pub async fn set_cluster_limits(&self, update: LimitsUpdate) -> Result<StoredLimits, Error> {
        let cluster = self.inner.cluster.as_ref().ok_or(Error::NotDistributed)?;
        let stored = cluster.coordinator.bootstrap_limits().await?;
        let file = limits::file_values(&cluster.config);
        let mut current = file;
        for (slot, value) in current.iter_mut().zip(limits::stored_values(&stored)) {
            if let Some(value) = value {
                *slot = value;
            }
        }
        limits::check(current, &update).map_err(Error::InvalidOverride)?;
        Ok(cluster.coordinator.set_limits(update.values()).await?)
    }

    /// Set (`Some`) or clear a backend's cluster-wide transfer override; returns the policy
    /// version.
    pub async fn set_backend_override(
        &self,
        backend: &str,
        transfers: Option<u32>,
    ) -> Result<u64, Error> {
        let cluster = self.inner.cluster.as_ref().ok_or(Error::NotDistributed)?;
        if transfers == Some(0) || transfers.is_some_and(|t| t > super::config::MAX_TRANSFERS) {
            return Err(Error::InvalidOverride(
                "transfers must be between 1 and 1000000",
            ));
        }
        Ok(cluster
            .coordinator
            .set_backend_policy(backend, transfers.map(u64::from))
            .await?)
    }

    /// Remove a tenant override (back to configured defaults); returns the policy version.
    pub async fn clear_override(&self, tenant: &TenantId) -> Result<u64, Error> {
        let cluster = self.inner.cluster.as_ref().ok_or(Error::NotDistributed)?;
        Ok(cluster.coordinator.set_policy(tenant, None, None).await?)
    }

    pub async fn snapshot(
        &self,
        tenant: Option<&TenantId>,
        backend: Option<&str>,
    ) -> Result<AdmissionSnapshot, Error> {
        let local = self.inner.budget.snapshot();
        let cluster = match &self.inner.cluster {
            Some(cluster) => {
                let snap = cluster.coordinator.snapshot(tenant, backend).await?;
                self.inner.metrics.observe_occupancy(&snap.occupancy);
                Some(snap)
            }
            None => None,
        };
        Ok(AdmissionSnapshot { local, cluster })
    }
}

/// Everything one admitted transfer holds. Drop it when the transfer ends; set the outcome
/// first with [`AdmissionPermit::set_outcome`] (the default is `interrupted`).
pub struct AdmissionPermit {
    local: Option<LocalPermit>,
    /// The node's lease holder and this lease's key there.
    holder: Option<(ActorRef<LeaseHolderMsg>, u64)>,
    lease: Option<LeaseInfo>,
    cancel: CancellationToken,
    outcome: Arc<AtomicU8>,
}

impl std::fmt::Debug for AdmissionPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionPermit")
            .field("local", &self.local)
            .field("lease", &self.lease)
            .finish()
    }
}

impl AdmissionPermit {
    /// Cancelled when the cluster lease is lost and the loss policy is `cancel`.
    pub fn cancellation(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// The cluster lease, absent in local mode.
    pub fn lease(&self) -> Option<&LeaseInfo> {
        self.lease.as_ref()
    }

    pub fn footprint(&self) -> Option<Footprint> {
        self.local.as_ref().map(LocalPermit::footprint)
    }

    pub fn set_outcome(&self, outcome: Outcome) {
        self.outcome.store(outcome.to_u8(), Ordering::Release);
    }

    /// Record `outcome`, release everything, and wait until the cluster release finished.
    pub async fn finish(mut self, outcome: Outcome) {
        self.set_outcome(outcome);
        self.local.take();
        if let Some((holder, key)) = self.holder.take() {
            let (done, released) = tokio::sync::oneshot::channel();
            if holder
                .send_message(LeaseHolderMsg::Release(key, Some(done)))
                .is_ok()
            {
                let _ = released.await;
            }
        }
    }
}

impl Drop for AdmissionPermit {
    fn drop(&mut self) {
        self.local.take();
        if let Some((holder, key)) = self.holder.take() {
            let _ = holder.send_message(LeaseHolderMsg::Release(key, None));
        }
    }
}
