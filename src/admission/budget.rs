//! The process-local `TransferBudget`: hard permits every transfer holds, with or without
//! Redis.
//!
//! Order of acquisition (always the same, so two transfers cannot deadlock): the tenant's
//! transfer count, the tenant's bytes, the backend's transfer count, then process bytes.
//! A transfer waiting for its own tenant's permits therefore holds nothing that another
//! tenant needs: one tenant's queue never blocks another tenant on the node (ADM-6).
//! Bytes are counted
//! in whole KiB. The semaphores are tokio's, which are FIFO-fair: a large waiter is not
//! overtaken by smaller ones that arrive after it.
//!
//! Tenants and backends get their semaphores from bounded registries. An entry is *active*
//! while some transfer holds or waits for its permits; at the bound the least recently used
//! inactive entry is evicted, and when every entry is active the reservation fails closed
//! with [`Error::Saturated`]. An active entry is never evicted, since a fresh entry would
//! come with fresh permits and break the limit.
//!
//! Everything is released by dropping the [`LocalPermit`] (success, failure, cancellation,
//! client disconnect alike).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::config::AdmissionConfig;
use super::error::Error;
use super::footprint::Footprint;
use crate::ids::TenantId;
use crate::storage::redis::reply::Dimension;

/// Per-key semaphores in a registry entry.
struct Entry {
    bytes: Arc<Semaphore>,
    transfers: Arc<Semaphore>,
    /// Transfers holding or waiting for this entry's permits.
    users: usize,
    last_used: u64,
}

/// A bounded map of per-key semaphores (pure bookkeeping, no waiting).
pub(crate) struct Registry<K> {
    name: &'static str,
    max: usize,
    bytes_kib: usize,
    transfers: usize,
    clock: u64,
    entries: HashMap<K, Entry>,
}

impl<K: Eq + Hash + Clone> Registry<K> {
    pub(crate) fn new(name: &'static str, max: usize, bytes_kib: usize, transfers: usize) -> Self {
        Self {
            name,
            max,
            bytes_kib,
            transfers,
            clock: 0,
            entries: HashMap::new(),
        }
    }

    /// Mark `key` in use and return its semaphores, creating (and evicting) as needed.
    pub(crate) fn check_out(&mut self, key: &K) -> Result<(Arc<Semaphore>, Arc<Semaphore>), Error> {
        self.clock += 1;
        if !self.entries.contains_key(key) && self.entries.len() >= self.max {
            let victim = self
                .entries
                .iter()
                .filter(|(_, e)| e.users == 0)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone())
                .ok_or(Error::Saturated(self.name))?;
            self.entries.remove(&victim);
        }
        let entry = self.entries.entry(key.clone()).or_insert_with(|| Entry {
            bytes: Arc::new(Semaphore::new(self.bytes_kib)),
            transfers: Arc::new(Semaphore::new(self.transfers)),
            users: 0,
            last_used: 0,
        });
        entry.users += 1;
        entry.last_used = self.clock;
        Ok((entry.bytes.clone(), entry.transfers.clone()))
    }

    pub(crate) fn check_in(&mut self, key: &K) {
        if let Some(entry) = self.entries.get_mut(key) {
            entry.users = entry.users.saturating_sub(1);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    fn active(&self) -> usize {
        self.entries.values().filter(|e| e.users > 0).count()
    }
}

/// Marks a registry entry in use until dropped.
struct InUse<K: Eq + Hash + Clone> {
    registry: Arc<Mutex<Registry<K>>>,
    key: K,
}

impl<K: Eq + Hash + Clone> Drop for InUse<K> {
    fn drop(&mut self) {
        self.registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .check_in(&self.key);
    }
}

/// Local permits of one admitted transfer. Dropping it returns everything.
pub struct LocalPermit {
    // Permits are declared (and so dropped) before the registry marks. The process permit
    // is returned first, in `drop`, so the gauge sees the freed bytes.
    process_permit: Option<OwnedSemaphorePermit>,
    process: Arc<Semaphore>,
    available: Option<Gauge>,
    _tenant_bytes: Option<OwnedSemaphorePermit>,
    _tenant_transfer: Option<OwnedSemaphorePermit>,
    _backend_transfer: OwnedSemaphorePermit,
    _tenant_in_use: Option<InUse<TenantId>>,
    _backend_in_use: InUse<String>,
    footprint: Footprint,
}

impl Drop for LocalPermit {
    fn drop(&mut self) {
        self.process_permit.take();
        if let Some(gauge) = &self.available {
            gauge.set(self.process.available_permits() as i64 * 1024);
        }
    }
}

impl LocalPermit {
    pub fn footprint(&self) -> Footprint {
        self.footprint
    }
}

impl std::fmt::Debug for LocalPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalPermit")
            .field("bytes", &self.footprint.bytes())
            .finish()
    }
}

/// Local occupancy, for the admin snapshot and gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LocalSnapshot {
    pub process_bytes_capacity: u64,
    pub process_bytes_available: u64,
    pub tenants_tracked: usize,
    pub backends_tracked: usize,
}

/// The process-wide budget. Cheap to clone.
#[derive(Clone)]
pub struct TransferBudget {
    process: Arc<Semaphore>,
    process_kib: u64,
    /// Set to the free process bytes after every reservation and release.
    available: Option<Gauge>,
    tenant_kib: u64,
    tenants: Arc<Mutex<Registry<TenantId>>>,
    backends: Arc<Mutex<Registry<String>>>,
}

impl TransferBudget {
    pub fn new(config: &AdmissionConfig) -> Self {
        let process_kib = config.process_bytes.bytes().div_ceil(1024);
        let tenant_kib = config.tenant_bytes.bytes().div_ceil(1024);
        Self {
            process: Arc::new(Semaphore::new(process_kib as usize)),
            process_kib,
            available: None,
            tenant_kib,
            tenants: Arc::new(Mutex::new(Registry::new(
                "tenant",
                config.max_tenants,
                tenant_kib as usize,
                config.tenant_transfers as usize,
            ))),
            // Backends have no byte dimension: their byte semaphore is never used.
            backends: Arc::new(Mutex::new(Registry::new(
                "backend",
                config.max_backends,
                0,
                config.backend_transfers as usize,
            ))),
        }
    }

    /// Keep `gauge` equal to the free process bytes.
    pub fn with_available_gauge(mut self, gauge: Gauge) -> Self {
        gauge.set(self.available_bytes() as i64);
        self.available = Some(gauge);
        self
    }

    /// Reserve `footprint` for a transfer of `tenant` (if any) against `backend`, waiting
    /// until `deadline` at most. Cancel-safe: dropping the future releases what it held.
    pub async fn reserve(
        &self,
        tenant: Option<&TenantId>,
        backend: &str,
        footprint: Footprint,
        deadline: Instant,
    ) -> Result<LocalPermit, Error> {
        let kib = footprint.kib();
        if kib > self.process_kib || kib > u64::from(u32::MAX) {
            return Err(Error::NeverFits(Dimension::ProcessBytes));
        }
        if tenant.is_some() && kib > self.tenant_kib {
            return Err(Error::NeverFits(Dimension::TenantBytes));
        }
        let kib = kib as u32;
        let timed_out = |_| Error::TimedOut("local transfer permits");
        // The tenant's own permits first: a transfer queued behind its tenant's limits
        // holds nothing another tenant needs (no cross-tenant blocking, ADM-6).
        let (tenant_in_use, tenant_transfer, tenant_bytes) = match tenant {
            Some(tenant) => {
                let (bytes, transfers) = lock(&self.tenants).check_out(tenant)?;
                let in_use = InUse {
                    registry: self.tenants.clone(),
                    key: *tenant,
                };
                let transfer = tokio::time::timeout_at(deadline, transfers.acquire_owned())
                    .await
                    .map_err(timed_out)?
                    .expect("never closed");
                let bytes = tokio::time::timeout_at(deadline, bytes.acquire_many_owned(kib))
                    .await
                    .map_err(timed_out)?
                    .expect("never closed");
                (Some(in_use), Some(transfer), Some(bytes))
            }
            None => (None, None, None),
        };

        // Then the backend's count (shared only with transfers of the same backend), and
        // the shared process bytes last.
        let key = backend.to_string();
        let (_, transfers) = lock(&self.backends).check_out(&key)?;
        let backend_in_use = InUse {
            registry: self.backends.clone(),
            key,
        };
        let backend_transfer = tokio::time::timeout_at(deadline, transfers.acquire_owned())
            .await
            .map_err(timed_out)?
            .expect("never closed");

        let process =
            tokio::time::timeout_at(deadline, self.process.clone().acquire_many_owned(kib))
                .await
                .map_err(timed_out)?
                .expect("budget semaphores are never closed");

        if let Some(gauge) = &self.available {
            gauge.set(self.available_bytes() as i64);
        }
        Ok(LocalPermit {
            process_permit: Some(process),
            process: self.process.clone(),
            available: self.available.clone(),
            _tenant_bytes: tenant_bytes,
            _tenant_transfer: tenant_transfer,
            _backend_transfer: backend_transfer,
            _tenant_in_use: tenant_in_use,
            _backend_in_use: backend_in_use,
            footprint,
        })
    }

    pub fn available_bytes(&self) -> u64 {
        self.process.available_permits() as u64 * 1024
    }

    pub fn snapshot(&self) -> LocalSnapshot {
        LocalSnapshot {
            process_bytes_capacity: self.process_kib * 1024,
            process_bytes_available: self.available_bytes(),
            tenants_tracked: lock(&self.tenants).len(),
            backends_tracked: lock(&self.backends).len(),
        }
    }
}

fn lock<K>(registry: &Mutex<Registry<K>>) -> std::sync::MutexGuard<'_, Registry<K>> {
    registry.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::values::{ByteSize, HumanDuration};
    use proptest::prelude::*;
    use std::time::Duration;

    fn config() -> AdmissionConfig {
        AdmissionConfig {
            process_bytes: ByteSize::mib(64),
            tenant_bytes: ByteSize::mib(32),
            tenant_transfers: 1,
            backend_transfers: 2,
            max_tenants: 2,
            max_backends: 4,
            acquisition_timeout: HumanDuration::secs(5),
            ..AdmissionConfig::default()
        }
    }

    fn mib(n: u64) -> Footprint {
        Footprint::new(n << 20).unwrap()
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(100)
    }

    fn tenant() -> TenantId {
        TenantId::new_random()
    }

    #[tokio::test]
    async fn backpressure_until_release() {
        use futures_util::FutureExt;
        let budget = TransferBudget::new(&config());
        let held = budget.reserve(None, "fs", mib(48), soon()).await.unwrap();
        assert_eq!(budget.available_bytes(), 16 << 20);
        let err = budget
            .reserve(None, "fs", mib(32), soon())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::TimedOut(_)), "{err:?}");
        assert_eq!(
            budget.available_bytes(),
            16 << 20,
            "a timed-out waiter holds nothing"
        );
        // One poll queues the waiter on the process bytes (its answer is not ready: it
        // waits); releasing the held bytes then admits it.
        let mut waiter =
            Box::pin(budget.reserve(None, "fs", mib(32), Instant::now() + Duration::from_secs(5)));
        assert!(
            (&mut waiter).now_or_never().is_none(),
            "32 MiB must wait while only 16 MiB are free"
        );
        // The queued head waiter collects what is free while it waits (tokio's semaphore
        // is FIFO: no smaller request that arrives later can take those bytes).
        assert_eq!(
            budget.available_bytes(),
            0,
            "the head waiter holds the free bytes"
        );
        assert!(
            budget
                .reserve(None, "fs", mib(1), soon())
                .now_or_never()
                .is_none(),
            "a later, smaller request does not overtake the waiter"
        );
        drop(held);
        let permit = waiter.await.unwrap();
        assert_eq!(budget.available_bytes(), 32 << 20);
        drop(permit);
        assert_eq!(budget.available_bytes(), 64 << 20);
    }

    #[tokio::test]
    async fn the_gauge_follows_reservations_and_releases() {
        let gauge = Gauge::default();
        let budget = TransferBudget::new(&config()).with_available_gauge(gauge.clone());
        assert_eq!(gauge.get(), 64 << 20);
        let permit = budget.reserve(None, "fs", mib(8), soon()).await.unwrap();
        assert_eq!(gauge.get(), 56 << 20);
        drop(permit);
        assert_eq!(gauge.get(), 64 << 20);
    }

    #[tokio::test]
    async fn cancellation_releases_everything() {
        use futures_util::FutureExt;
        let budget = TransferBudget::new(&config());
        let t = tenant();
        let held = budget
            .reserve(Some(&t), "fs", mib(8), soon())
            .await
            .unwrap();
        let tenant_users = |budget: &TransferBudget| lock(&budget.tenants).entries[&t].users;
        assert_eq!(tenant_users(&budget), 1);
        // A second transfer of the same tenant waits for the tenant count (one poll: not
        // ready, and registered as a user of the tenant's entry); cancel it by dropping.
        let mut waiting = Box::pin(budget.reserve(
            Some(&t),
            "fs",
            mib(8),
            Instant::now() + Duration::from_secs(5),
        ));
        assert!((&mut waiting).now_or_never().is_none(), "the waiter waits");
        assert_eq!(
            tenant_users(&budget),
            2,
            "the waiter holds the tenant entry"
        );
        drop(waiting);
        assert_eq!(
            tenant_users(&budget),
            1,
            "the cancelled waiter let go of it"
        );
        assert_eq!(budget.available_bytes(), 56 << 20);
        drop(held);
        assert_eq!(tenant_users(&budget), 0);
        assert_eq!(lock(&budget.tenants).active(), 0);
        assert_eq!(budget.available_bytes(), 64 << 20);
        // Everything is free again: the same tenant is admitted on the first poll.
        assert!(matches!(
            budget
                .reserve(Some(&t), "fs", mib(32), soon())
                .now_or_never(),
            Some(Ok(_))
        ));
    }

    #[tokio::test]
    async fn footprints_that_never_fit_fail_at_once() {
        use futures_util::FutureExt;
        let budget = TransferBudget::new(&config());
        let far = Instant::now() + Duration::from_secs(30);
        // "At once" is the first poll: the answer is ready without ever waiting.
        assert!(matches!(
            budget.reserve(None, "fs", mib(65), far).now_or_never(),
            Some(Err(Error::NeverFits(Dimension::ProcessBytes)))
        ));
        assert!(matches!(
            budget
                .reserve(Some(&tenant()), "fs", mib(33), far)
                .now_or_never(),
            Some(Err(Error::NeverFits(Dimension::TenantBytes)))
        ));
        assert_eq!(budget.available_bytes(), 64 << 20, "nothing was reserved");
        assert_eq!(budget.snapshot().tenants_tracked, 0);
    }

    #[tokio::test]
    async fn tenants_are_independent_and_backends_are_limited() {
        let budget = TransferBudget::new(&config());
        let (a, b) = (tenant(), tenant());
        let _a1 = budget
            .reserve(Some(&a), "fs", mib(1), soon())
            .await
            .unwrap();
        assert!(matches!(
            budget.reserve(Some(&a), "s3", mib(1), soon()).await,
            Err(Error::TimedOut(_))
        ));
        let _b1 = budget
            .reserve(Some(&b), "fs", mib(1), soon())
            .await
            .unwrap();
        // Backend "fs" now has 2 of 2 transfers.
        assert!(matches!(
            budget.reserve(None, "fs", mib(1), soon()).await,
            Err(Error::TimedOut(_))
        ));
        budget.reserve(None, "s3", mib(1), soon()).await.unwrap();
    }

    // Checks ADM-6: transfers queued behind their own tenant's limit hold no process bytes,
    // so another tenant is admitted at once (before the fix they took the node's bytes
    // first and this reservation timed out).
    #[tokio::test]
    async fn a_tenant_queued_behind_its_own_limit_never_blocks_another_tenant() {
        let budget = TransferBudget::new(&config());
        let (a, b) = (tenant(), tenant());
        let far = Instant::now() + Duration::from_secs(30);
        let _held = budget
            .reserve(Some(&a), "fs", mib(8), soon())
            .await
            .unwrap();
        // Seven more transfers of tenant A queue behind A's one-transfer limit; with the
        // old order they would hold 7 x 8 MiB of the 64 MiB process pool.
        let queued: Vec<_> = (0..7)
            .map(|_| {
                let budget = budget.clone();
                tokio::spawn(async move { budget.reserve(Some(&a), "s3", mib(8), far).await })
            })
            .collect();
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            budget.available_bytes(),
            56 << 20,
            "queued transfers hold no bytes"
        );
        let other = budget.reserve(Some(&b), "s3", mib(8), soon()).await;
        assert!(
            other.is_ok(),
            "tenant B was blocked by tenant A's queue: {other:?}"
        );
        for task in queued {
            task.abort();
        }
    }

    #[tokio::test]
    async fn registry_evicts_inactive_and_fails_closed_when_all_active() {
        let budget = TransferBudget::new(&config());
        let (a, b, c) = (tenant(), tenant(), tenant());
        drop(
            budget
                .reserve(Some(&a), "fs", mib(1), soon())
                .await
                .unwrap(),
        );
        let _b = budget
            .reserve(Some(&b), "fs", mib(1), soon())
            .await
            .unwrap();
        // a is inactive: c evicts it.
        let _c = budget
            .reserve(Some(&c), "fs", mib(1), soon())
            .await
            .unwrap();
        assert_eq!(budget.snapshot().tenants_tracked, 2);
        // b and c active: a new tenant fails closed, and holds nothing afterwards.
        let before = budget.available_bytes();
        assert!(matches!(
            budget.reserve(Some(&a), "fs", mib(1), soon()).await,
            Err(Error::Saturated("tenant"))
        ));
        assert_eq!(budget.available_bytes(), before);
    }

    proptest! {
        #[test]
        fn registry_stays_bounded_and_never_evicts_active(ops in proptest::collection::vec((0u8..8, any::<bool>()), 1..200)) {
            let mut registry: Registry<u8> = Registry::new("tenant", 4, 1, 1);
            let mut users: HashMap<u8, usize> = HashMap::new();
            for (key, check_out) in ops {
                if check_out {
                    match registry.check_out(&key) {
                        Ok(_) => *users.entry(key).or_default() += 1,
                        Err(_) => {
                            let active = users.values().filter(|n| **n > 0).count();
                            prop_assert_eq!(active, 4, "saturated only when every entry is active");
                        }
                    }
                } else if users.get(&key).copied().unwrap_or(0) > 0 {
                    registry.check_in(&key);
                    *users.get_mut(&key).unwrap() -= 1;
                }
                prop_assert!(registry.len() <= 4);
                let active = users.values().filter(|n| **n > 0).count();
                prop_assert_eq!(registry.active(), active);
            }
        }
    }
}
