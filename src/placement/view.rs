//! The node-local view of placement, shared by the placement actor (the only writer) and
//! every request handler (readers).
//!
//! Reads are cheap: owner resolution hashes the key, clones an `Arc` of the current table
//! under an uncontended read lock and indexes a vector (well under a microsecond; see
//! `docs/locality.md`). The writer swaps the whole `Arc<ShardTable>`.
//!
//! Ingest admission: [`LocalView::begin_ingest`] checks ownership, epoch, pending moves and
//! the self-fence, and increments the shard's in-flight count *under the same read lock*
//! the writer takes to publish a table. So once a table announcing a revocation is
//! published, no new permit can be issued for that shard, and a zero in-flight count read
//! after publishing means the owner really stopped ingesting (the acknowledgement rule).
//!
//! The fence has two parts, and [`LocalView::fenced`] is true while either holds:
//! - *heartbeat*: no heartbeat that started within the last `self_fence` succeeded;
//! - *stale table*: the published table was not read under the current registration. A
//!   node that learns it was declared dead (or that re-registers for any reason) calls
//!   [`LocalView::registration_lost`]; only a table whose read *started after* the next
//!   [`LocalView::registered`] lifts this part. A table read before the re-registration
//!   may still list shards the manager has since given to another node (LOC-1).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::{Notify, watch};

use crate::ids::{NodeId, SessionKey};
use crate::placement::handoff;
use crate::placement::hash::shard_of;
use crate::placement::health::HealthSnapshot;
use crate::placement::model::{Epoch, ShardId, ShardTable};

/// Where a session is owned, as this node currently sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Owner {
    pub node: NodeId,
    pub shard: ShardId,
    pub epoch: Epoch,
    pub is_local: bool,
    /// The owner's internal (forwarding) address; `None` if unknown or unparsable.
    pub internal_addr: Option<SocketAddr>,
    /// A move of this shard is in progress: the owner no longer admits new ingest.
    pub moving: bool,
}

/// Process-lifetime counters of the placement runtime on this node (for metrics; no
/// labels, no identifiers).
#[derive(Debug, Default)]
pub struct PlacementCounters {
    pub table_reads: AtomicU64,
    pub table_read_failures: AtomicU64,
    pub heartbeats: AtomicU64,
    pub heartbeat_failures: AtomicU64,
    pub reregistrations: AtomicU64,
    pub acks: AtomicU64,
}

/// A copy of [`PlacementCounters`] at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CounterSnapshot {
    pub table_reads: u64,
    pub table_read_failures: u64,
    pub heartbeats: u64,
    pub heartbeat_failures: u64,
    pub reregistrations: u64,
    pub acks: u64,
}

impl PlacementCounters {
    pub fn snapshot(&self) -> CounterSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            table_reads: get(&self.table_reads),
            table_read_failures: get(&self.table_read_failures),
            heartbeats: get(&self.heartbeats),
            heartbeat_failures: get(&self.heartbeat_failures),
            reregistrations: get(&self.reregistrations),
            acks: get(&self.acks),
        }
    }

    pub(crate) fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }
}

/// Why a session could not be resolved.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("shard {0} has no owner yet")]
    Unassigned(ShardId),
    #[error("the placement table has not been loaded")]
    NotLoaded,
}

/// Shared node-local placement state.
pub struct LocalView {
    node: NodeId,
    shard_count: u32,
    self_fence: Duration,
    origin: Instant,
    table: RwLock<Arc<ShardTable>>,
    /// The nodes' internal addresses, parsed once per published table (written under the
    /// `table` write lock).
    internal_addrs: RwLock<Arc<HashMap<NodeId, SocketAddr>>>,
    /// Nanoseconds since `origin` until which ingest is allowed; 0 = fenced.
    fence_deadline_ns: AtomicU64,
    /// Registration generation: odd while unregistered (at start, and between a lost
    /// registration and the next successful one), even while registered.
    generation: AtomicU64,
    /// The generation under which the published table was read.
    table_generation: AtomicU64,
    read_ok: AtomicBool,
    /// How long permits issued before a revocation stay valid (see `handoff`).
    handoff_grace: Duration,
    /// Per shard: when this node first saw its revocation (ns since `origin`; 0 = none).
    revocation_seen_ns: Box<[AtomicU64]>,
    /// Counters for metrics.
    pub counters: PlacementCounters,
    in_flight: Box<[AtomicU32]>,
    changes: watch::Sender<u64>,
    pub(crate) ack_wake: Notify,
    health: RwLock<HealthSnapshot>,
}

impl std::fmt::Debug for LocalView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalView")
            .field("node", &self.node)
            .field("shard_count", &self.shard_count)
            .finish()
    }
}

impl LocalView {
    pub fn new(node: NodeId, shard_count: u32, self_fence: Duration) -> Self {
        let (changes, _) = watch::channel(0);
        Self {
            node,
            shard_count,
            self_fence,
            origin: Instant::now(),
            table: RwLock::new(Arc::new(ShardTable::default())),
            internal_addrs: RwLock::default(),
            fence_deadline_ns: AtomicU64::new(0),
            generation: AtomicU64::new(1),
            table_generation: AtomicU64::new(0),
            read_ok: AtomicBool::new(false),
            handoff_grace: Duration::ZERO,
            revocation_seen_ns: (0..shard_count).map(|_| AtomicU64::new(0)).collect(),
            counters: PlacementCounters::default(),
            in_flight: (0..shard_count).map(|_| AtomicU32::new(0)).collect(),
            changes,
            ack_wake: Notify::new(),
            health: RwLock::new(HealthSnapshot::starting(shard_count)),
        }
    }

    /// Let permits issued before a revocation run on for `grace` (graceful handoff).
    pub fn with_handoff_grace(mut self, grace: Duration) -> Self {
        self.handoff_grace = grace;
        self
    }

    pub fn node(&self) -> &NodeId {
        &self.node
    }

    pub fn shard_count(&self) -> u32 {
        self.shard_count
    }

    /// The self-fence window.
    pub fn self_fence(&self) -> Duration {
        self.self_fence
    }

    /// The current table snapshot.
    pub fn table(&self) -> Arc<ShardTable> {
        self.table.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Shard of a session in this cluster.
    pub fn shard_of(&self, key: &SessionKey) -> ShardId {
        shard_of(key, self.shard_count)
    }

    /// Resolve the owner of a session from the local table (no I/O).
    pub fn resolve(&self, key: &SessionKey) -> Result<Owner, ResolveError> {
        self.resolve_shard(self.shard_of(key))
    }

    /// Resolve the owner of a shard from the local table (no I/O).
    pub fn resolve_shard(&self, shard: ShardId) -> Result<Owner, ResolveError> {
        let table = self.table();
        let entry = table.get(shard).ok_or(ResolveError::NotLoaded)?;
        let node = entry.owner.clone().ok_or(ResolveError::Unassigned(shard))?;
        let internal_addr = self
            .internal_addrs
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&node)
            .copied();
        Ok(Owner {
            is_local: node == self.node,
            node,
            shard,
            epoch: entry.epoch,
            internal_addr,
            moving: entry.moving_to.is_some(),
        })
    }

    fn now_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }

    /// Is this node fenced: no successful heartbeat within the fence window, or a table
    /// not read under the current registration (see the module docs)?
    pub fn fenced(&self) -> bool {
        self.now_ns() >= self.fence_deadline_ns.load(Ordering::SeqCst) || !self.table_current()
    }

    /// Whether the published table was read under the current registration.
    pub fn table_current(&self) -> bool {
        let generation = self.generation.load(Ordering::SeqCst);
        generation.is_multiple_of(2) && self.table_generation.load(Ordering::SeqCst) == generation
    }

    /// The node's registration is gone (declared dead, superseded, or about to be
    /// renewed): fence at once, and keep the table-part of the fence until a table read
    /// that starts after the next [`Self::registered`] is published.
    pub(crate) fn registration_lost(&self) {
        let _ = self
            .generation
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |g| {
                Some(if g.is_multiple_of(2) { g + 1 } else { g })
            });
        self.fence_now();
    }

    /// A (re-)registration committed: table reads started from now on are current.
    pub(crate) fn registered(&self) {
        let _ = self
            .generation
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |g| {
                Some(if g.is_multiple_of(2) { g } else { g + 1 })
            });
        self.changes.send_modify(|v| *v += 1);
    }

    /// Take before a table read: [`Self::publish_read`] counts the table as current only if
    /// no registration change happened in between.
    pub(crate) fn read_ticket(&self) -> TableTicket {
        TableTicket(self.generation.load(Ordering::SeqCst))
    }

    /// Time left before the self-fence trips (zero when fenced).
    pub fn fence_remaining(&self) -> Duration {
        Duration::from_nanos(
            self.fence_deadline_ns
                .load(Ordering::SeqCst)
                .saturating_sub(self.now_ns()),
        )
    }

    /// Record a successful heartbeat whose request started at `started`.
    pub(crate) fn heartbeat_ok(&self, started: Instant) {
        let deadline =
            (started.saturating_duration_since(self.origin) + self.self_fence).as_nanos() as u64;
        self.fence_deadline_ns.fetch_max(deadline, Ordering::SeqCst);
        self.changes.send_modify(|v| *v += 1);
    }

    /// Fence at once (the node learned its registration is gone).
    pub(crate) fn fence_now(&self) {
        self.fence_deadline_ns.store(0, Ordering::SeqCst);
        self.changes.send_modify(|v| *v += 1);
    }

    /// Whether the last placement read succeeded.
    pub fn placement_readable(&self) -> bool {
        self.read_ok.load(Ordering::SeqCst)
    }

    pub(crate) fn set_read_ok(&self, ok: bool) {
        self.read_ok.store(ok, Ordering::SeqCst);
    }

    /// Publish a table whose read started when `ticket` was taken (placement actor only).
    pub(crate) fn publish_read(&self, table: ShardTable, ticket: TableTicket) {
        {
            let mut guard = self.table.write().unwrap_or_else(|e| e.into_inner());
            let now = self.now_ns().max(1);
            for entry in &table.shards {
                let Some(seen) = self.revocation_seen_ns.get(entry.shard.0 as usize) else {
                    continue;
                };
                if entry.owner.as_ref() == Some(&self.node) && entry.moving_to.is_some() {
                    let _ = seen.compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst);
                } else {
                    seen.store(0, Ordering::SeqCst);
                }
            }
            let addrs = table
                .nodes
                .iter()
                .filter_map(|(id, n)| Some((id.clone(), n.internal_addr.parse().ok()?)))
                .collect();
            *self
                .internal_addrs
                .write()
                .unwrap_or_else(|e| e.into_inner()) = Arc::new(addrs);
            *guard = Arc::new(table);
            // Under the write lock, so no permit is issued between the swap and this.
            self.table_generation.fetch_max(ticket.0, Ordering::SeqCst);
        }
        self.set_read_ok(true);
        self.changes.send_modify(|v| *v += 1);
    }

    /// Publish a table as read under the current registration (the embedded single node,
    /// which never registers, and tests).
    pub(crate) fn publish(&self, table: ShardTable) {
        self.registered();
        let ticket = self.read_ticket();
        self.publish_read(table, ticket);
    }

    /// May this node admit a new ingest for `shard` at `epoch` right now?
    pub fn can_ingest(&self, shard: ShardId, epoch: Epoch) -> bool {
        let table = self.table();
        handoff::permit_valid(table.get(shard), &self.node, epoch, self.fenced(), false)
    }

    /// Time left of the handoff grace of `shard` (`None`: no revocation seen).
    fn grace_left(&self, shard: ShardId) -> Option<Duration> {
        let seen = self
            .revocation_seen_ns
            .get(shard.0 as usize)?
            .load(Ordering::SeqCst);
        if seen == 0 {
            return None;
        }
        let elapsed = Duration::from_nanos(self.now_ns().saturating_sub(seen));
        Some(self.handoff_grace.saturating_sub(elapsed))
    }

    /// May an ingest already admitted at `epoch` go on (the handoff grace applies)?
    fn permit_still_valid(&self, shard: ShardId, epoch: Epoch) -> bool {
        let table = self.table();
        let in_grace = self.grace_left(shard).is_some_and(|left| !left.is_zero());
        handoff::permit_valid(table.get(shard), &self.node, epoch, self.fenced(), in_grace)
    }

    /// Admit an ingest: `Some(permit)` iff [`Self::can_ingest`]. Hold the permit for the whole
    /// ingest; abort the ingest when [`IngestPermit::revoked`] resolves.
    pub fn begin_ingest(self: &Arc<Self>, shard: ShardId, epoch: Epoch) -> Option<IngestPermit> {
        let guard = self.table.read().unwrap_or_else(|e| e.into_inner());
        if !handoff::permit_valid(guard.get(shard), &self.node, epoch, self.fenced(), false) {
            return None;
        }
        self.in_flight
            .get(shard.0 as usize)?
            .fetch_add(1, Ordering::SeqCst);
        drop(guard);
        Some(IngestPermit {
            view: self.clone(),
            shard,
            epoch,
        })
    }

    /// Shards this node owns in its current table (including ones being moved away).
    pub fn owned_shards(&self) -> Vec<ShardId> {
        let table = self.table();
        table
            .shards
            .iter()
            .filter(|s| s.owner.as_ref() == Some(&self.node))
            .map(|s| s.shard)
            .collect()
    }

    /// Ingests in flight on `shard`.
    pub fn in_flight(&self, shard: ShardId) -> usize {
        self.in_flight
            .get(shard.0 as usize)
            .map_or(0, |c| c.load(Ordering::SeqCst) as usize)
    }

    /// The latest readiness snapshot.
    pub fn health(&self) -> HealthSnapshot {
        self.health
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn set_health(&self, snapshot: HealthSnapshot) {
        *self.health.write().unwrap_or_else(|e| e.into_inner()) = snapshot;
    }

    /// A receiver that changes whenever the table or the fence changes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

/// The registration generation at the start of a table read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableTicket(u64);

/// An admitted ingest on a shard; dropping it ends the ingest.
#[derive(Debug)]
pub struct IngestPermit {
    view: Arc<LocalView>,
    shard: ShardId,
    epoch: Epoch,
}

impl IngestPermit {
    pub fn shard(&self) -> ShardId {
        self.shard
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// Still allowed to ingest (owner, same epoch, not fenced, and no move pending or
    /// its handoff grace not yet over)?
    pub fn is_valid(&self) -> bool {
        self.view.permit_still_valid(self.shard, self.epoch)
    }

    /// Resolves once the permit stops being valid: the handoff grace of a requested move
    /// ran out, the epoch changed, or the node fenced itself. Ingest code should abort then.
    pub async fn revoked(&self) {
        let mut changes = self.view.subscribe();
        loop {
            if !self.is_valid() {
                return;
            }
            let mut remaining = self.view.fence_remaining();
            if let Some(left) = self.view.grace_left(self.shard) {
                remaining = remaining.min(left);
            }
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                _ = tokio::time::sleep(remaining) => {}
            }
        }
    }
}

impl Drop for IngestPermit {
    fn drop(&mut self) {
        if let Some(count) = self.view.in_flight.get(self.shard.0 as usize)
            && count.fetch_sub(1, Ordering::SeqCst) == 1
        {
            self.view.ack_wake.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::model::ShardEntry;

    fn table(owner: &str, moving: Option<&str>, epoch: i64) -> ShardTable {
        let shards = (0..4)
            .map(|s| ShardEntry {
                shard: ShardId(s),
                owner: Some(NodeId::parse(owner).unwrap()),
                epoch: Epoch(epoch),
                moving_to: moving.map(|m| NodeId::parse(m).unwrap()),
                revoke_acked: false,
            })
            .collect();
        ShardTable {
            shards,
            nodes: Default::default(),
            manager_term: crate::placement::Term(1),
        }
    }

    fn view() -> Arc<LocalView> {
        let view = Arc::new(LocalView::new(
            NodeId::parse("a").unwrap(),
            4,
            Duration::from_secs(60),
        ));
        view.publish(table("a", None, 1));
        view.heartbeat_ok(Instant::now());
        view
    }

    #[tokio::test]
    async fn permits_count_in_flight_and_wake_the_acker() {
        let view = view();
        let p1 = view.begin_ingest(ShardId(2), Epoch(1)).unwrap();
        let p2 = view.begin_ingest(ShardId(2), Epoch(1)).unwrap();
        assert!(
            view.begin_ingest(ShardId(2), Epoch(0)).is_none(),
            "stale epoch"
        );
        assert_eq!(view.in_flight(ShardId(2)), 2);
        drop(p1);
        assert_eq!(view.in_flight(ShardId(2)), 1);
        let woken = view.ack_wake.notified();
        drop(p2);
        assert_eq!(view.in_flight(ShardId(2)), 0);
        tokio::time::timeout(Duration::from_secs(1), woken)
            .await
            .expect("last permit wakes the acker");
    }

    #[tokio::test]
    async fn a_revocation_stops_admission_and_revokes_permits() {
        let view = view();
        let permit = view.begin_ingest(ShardId(1), Epoch(1)).unwrap();
        assert!(permit.is_valid());
        let v = view.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            v.publish(table("a", Some("b"), 1));
        });
        tokio::time::timeout(Duration::from_secs(5), permit.revoked())
            .await
            .expect("revoked");
        assert!(view.begin_ingest(ShardId(1), Epoch(1)).is_none());
        assert!(!view.can_ingest(ShardId(1), Epoch(1)));
    }

    // Checks LOC-1 with graceful handoff: a revocation refuses new ingest at once, lets a
    // running one go on for the grace, then revokes it; the ack waits for it.
    #[tokio::test]
    async fn a_revocation_lets_running_ingest_finish_within_the_grace() {
        let view = Arc::new(
            LocalView::new(NodeId::parse("a").unwrap(), 4, Duration::from_secs(60))
                .with_handoff_grace(Duration::from_millis(300)),
        );
        view.publish(table("a", None, 1));
        view.heartbeat_ok(Instant::now());
        let permit = view.begin_ingest(ShardId(1), Epoch(1)).unwrap();
        view.publish(table("a", Some("b"), 1));
        assert!(permit.is_valid(), "within the grace");
        assert!(
            view.begin_ingest(ShardId(1), Epoch(1)).is_none(),
            "no new ingest"
        );
        assert_eq!(view.in_flight(ShardId(1)), 1, "the ack must wait");
        // A re-published table does not restart the grace.
        view.publish(table("a", Some("b"), 1));
        tokio::time::timeout(Duration::from_secs(5), permit.revoked())
            .await
            .expect("revoked when the grace ran out");
        assert!(!permit.is_valid());
        // A fence ends the grace at once.
        view.publish(table("a", None, 1));
        let permit = view.begin_ingest(ShardId(2), Epoch(1)).unwrap();
        view.publish(table("a", Some("b"), 1));
        assert!(permit.is_valid());
        view.fence_now();
        assert!(!permit.is_valid());
    }

    #[tokio::test]
    async fn the_self_fence_revokes_permits_when_heartbeats_stop() {
        let view = Arc::new(LocalView::new(
            NodeId::parse("a").unwrap(),
            4,
            Duration::from_millis(50),
        ));
        view.publish(table("a", None, 1));
        view.heartbeat_ok(Instant::now());
        let permit = view
            .begin_ingest(ShardId(0), Epoch(1))
            .expect("fresh heartbeat");
        // No further heartbeat: the fence trips by itself after 50ms.
        tokio::time::timeout(Duration::from_secs(5), permit.revoked())
            .await
            .expect("fenced");
        assert!(view.fenced());
        assert!(view.begin_ingest(ShardId(0), Epoch(1)).is_none());
        view.heartbeat_ok(Instant::now());
        assert!(view.begin_ingest(ShardId(0), Epoch(1)).is_some());
        view.fence_now();
        assert!(!view.can_ingest(ShardId(0), Epoch(1)));
    }

    // Checks LOC-1: a node that lost its registration ingests again only on a table read
    // after it re-registered; a fresh heartbeat alone never un-fences it.
    #[test]
    fn a_lost_registration_needs_a_table_read_after_the_next_registration() {
        let view = view();
        assert!(view.can_ingest(ShardId(0), Epoch(1)));
        // Declared dead: fenced at once.
        view.registration_lost();
        assert!(view.fenced());
        // A heartbeat of the new incarnation succeeds: still fenced (the old table may
        // list shards that moved while this node was away).
        view.heartbeat_ok(Instant::now());
        assert!(view.fenced() && !view.table_current());
        assert!(view.begin_ingest(ShardId(0), Epoch(1)).is_none());
        // A read that started before the re-registration committed does not count.
        let early = view.read_ticket();
        view.registered();
        view.publish_read(table("a", None, 1), early);
        assert!(
            view.fenced(),
            "a table read before the registration is stale"
        );
        // A read started after it does.
        let ticket = view.read_ticket();
        view.publish_read(table("b", None, 2), ticket);
        assert!(view.table_current() && !view.fenced());
        assert!(
            !view.can_ingest(ShardId(0), Epoch(1)),
            "the shard moved to b"
        );
        // A second loss while registered again re-arms the rule.
        view.registration_lost();
        view.registered();
        assert!(view.fenced());
    }

    #[test]
    fn resolution_reports_owner_epoch_and_move() {
        let view = view();
        let key = SessionKey {
            tenant: crate::ids::TenantId::new_random(),
            session: crate::ids::SessionId::new_random(),
        };
        let owner = view.resolve(&key).unwrap();
        assert!(owner.is_local && !owner.moving);
        assert_eq!(owner.epoch, Epoch(1));
        view.publish(table("b", Some("a"), 2));
        let owner = view.resolve(&key).unwrap();
        assert!(!owner.is_local && owner.moving);
        assert_eq!(owner.node, NodeId::parse("b").unwrap());
        let empty = LocalView::new(NodeId::parse("a").unwrap(), 4, Duration::from_secs(1));
        assert_eq!(empty.resolve(&key), Err(ResolveError::NotLoaded));
    }
}
