//! The placement runtime of one node: starting the placement, health and election actors
//! under the placement supervisor, the [`ClusterHandle`] every request handler reads, and
//! the standalone manager (`graviton manager`).
//!
//! The rules these actors apply live in the pure modules of `placement` (`view`,
//! `handoff`, `rebalance`, `health`); the PostgreSQL I/O in `storage::pg::placement`.

use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorRef};
use sqlx::{Connection, PgConnection, PgPool};

use super::health::{HealthArgs, probe_once};
use super::manager_election::{ElectionArgs, ElectionMode, ElectionMsg, ManagerElection};
use super::placement::PlacementArgs;
pub use super::placement_supervisor::Child as PlacementChild;
use super::placement_supervisor::{
    ElectionSpec, PlacementSupMsg, PlacementSupervisor, PlacementSupervisorArgs,
};
use super::shard_manager::ShardManagerArgs;
use crate::ids::{NodeId, SessionKey};
use crate::placement::routing::{self, EpochVerdict, OwnerTarget, Route, RouteError, StaleEpoch};
use crate::placement::snapshot::summarize;
use crate::placement::{
    ClusterConfig, DrainEnd, Epoch, HealthSnapshot, IngestPermit, LocalView, Owner,
    PlacementSnapshot, ResolveError, ShardEntry, ShardId, ShardTable, Term,
};
use crate::storage::pg::placement::{NodeRegistration, PlacementStore, PlacementStoreError};
use crate::storage::pg::{self as pg};

/// Errors starting or operating the cluster runtime.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster.enabled is false or cluster.database_url is missing")]
    NotConfigured,
    #[error("invalid [cluster] configuration: {0}")]
    InvalidConfig(String),
    #[error(transparent)]
    Store(#[from] PlacementStoreError),
    #[error(
        "another Graviton shard manager holds the PostgreSQL manager lock; refusing to start a second one"
    )]
    ManagerLockHeld,
    #[error("actor failed to start: {0}")]
    Spawn(String),
}

/// Entry points.
pub struct Cluster;

/// A running placement runtime on one node.
pub struct ClusterHandle {
    view: Arc<LocalView>,
    store: Option<PlacementStore>,
    /// Owns and restarts the placement, health and election actors (cluster mode only).
    supervisor: Option<ActorRef<PlacementSupMsg>>,
}

impl Cluster {
    /// Build the pool from `config.database_url`, migrate, and [`Cluster::start`].
    pub async fn connect_and_start(
        node: NodeId,
        config: &ClusterConfig,
        version: &str,
    ) -> Result<ClusterHandle, ClusterError> {
        let pool = connect(config, &node).await?;
        pg::migrate(&pool).await?;
        Self::start(node, config, version, pool).await
    }

    /// Start placement on this node against an already migrated database: bootstrap (or
    /// check) the shard count, register, load the table, start heartbeats, health and,
    /// with `embedded_manager`, the manager election.
    pub async fn start(
        node: NodeId,
        config: &ClusterConfig,
        version: &str,
        pool: PgPool,
    ) -> Result<ClusterHandle, ClusterError> {
        Self::start_under(None, node, config, version, pool).await
    }

    /// [`Cluster::start`] with the placement supervisor linked under `parent` (the node's
    /// supervisor), so a node has one actor tree.
    pub async fn start_under(
        parent: Option<ractor::ActorCell>,
        node: NodeId,
        config: &ClusterConfig,
        version: &str,
        pool: PgPool,
    ) -> Result<ClusterHandle, ClusterError> {
        // The timing rules (node_ttl > self_fence, ...) are part of the safety argument:
        // refuse to run with a configuration that breaks them, even when called directly.
        let problems: Vec<String> = config
            .problems()
            .iter()
            .filter(|p| p.key != "cluster.database_url")
            .map(|p| p.to_string())
            .collect();
        if !problems.is_empty() {
            return Err(ClusterError::InvalidConfig(problems.join("; ")));
        }
        let store = PlacementStore::new(pg::purpose_pool(&pool, "placement", node.as_str(), 2));
        let heartbeat_store = PlacementStore::new(pg::heartbeat_pool(&pool, node.as_str()));
        let manager_store =
            PlacementStore::new(pg::purpose_pool(&pool, "manager", node.as_str(), 2));
        join_checks(&store, config, config.embedded_manager).await?;
        let view = Arc::new(
            LocalView::new(node.clone(), config.shard_count, config.self_fence.get())
                .with_handoff_grace(config.handoff_grace.get()),
        );
        let registration = NodeRegistration {
            id: node.clone(),
            public_addr: config.public_addr.clone(),
            internal_addr: config.internal_addr.clone(),
            control_addr: config.control_addr.clone(),
            version: if version.is_empty() {
                "unknown".to_string()
            } else {
                version.to_string()
            },
            process: NodeRegistration::new_process_token(),
        };
        let election = config.embedded_manager.then(|| ElectionSpec {
            node: node.clone(),
            lock_options: pg::connection::lock_connection_options(
                (*pool.connect_options())
                    .clone()
                    .application_name(&format!("graviton-lock:{}", node.as_str())),
                config.lock_ping_interval.get(),
            ),
            manager: manager_args(&manager_store, config),
            lock_retry_interval: config.lock_retry_interval.get(),
            lock_ping_interval: config.lock_ping_interval.get(),
        });
        let args = PlacementSupervisorArgs {
            placement: PlacementArgs {
                store: store.clone(),
                heartbeat_store,
                registration,
                view: view.clone(),
                heartbeat_interval: config.heartbeat_interval.get(),
                poll_interval: config.poll_interval.get(),
                call_timeout: config.statement_timeout.get() + Duration::from_millis(500),
                listen_notify: config.listen_notify,
            },
            health: HealthArgs {
                view: view.clone(),
                interval: config.heartbeat_interval.get(),
            },
            election,
        };
        let spawned = match parent {
            Some(parent) => Actor::spawn_linked(None, PlacementSupervisor, args, parent).await,
            None => Actor::spawn(None, PlacementSupervisor, args).await,
        };
        let (supervisor, _) = spawned.map_err(|e| ClusterError::Spawn(e.to_string()))?;
        Ok(ClusterHandle {
            view,
            store: Some(store),
            supervisor: Some(supervisor),
        })
    }

    /// The embedded single node: this node owns every shard at epoch 0, forever; no
    /// PostgreSQL, no actors, same API.
    pub fn single_node(node: NodeId, shard_count: u32) -> ClusterHandle {
        let view = Arc::new(LocalView::new(
            node.clone(),
            shard_count,
            Duration::from_secs(100 * 365 * 24 * 3600),
        ));
        let shards = (0..shard_count)
            .map(|s| ShardEntry {
                shard: ShardId(s),
                owner: Some(node.clone()),
                epoch: Epoch(0),
                moving_to: None,
                revoke_acked: false,
            })
            .collect();
        view.publish(ShardTable {
            shards,
            nodes: Default::default(),
            manager_term: Term(0),
        });
        view.heartbeat_ok(std::time::Instant::now());
        probe_once(&view);
        ClusterHandle {
            view,
            store: None,
            supervisor: None,
        }
    }
}

/// How long a starting node retries its join statements while a row lock blocks them.
const JOIN_LOCK_WAIT: Duration = Duration::from_secs(60);

/// Bootstrap the table and agree on timings, retrying (with the crate's back-off, for at
/// most [`JOIN_LOCK_WAIT`]) while they fail on a lock or statement timeout: a manager
/// stopped inside its round holds `placement_meta` `FOR SHARE` until the server ends its
/// session (PG-1), and a node starting meanwhile waits for that instead of exiting.
async fn join_checks(
    store: &PlacementStore,
    config: &ClusterConfig,
    runs_manager: bool,
) -> Result<(), ClusterError> {
    let deadline = tokio::time::Instant::now() + JOIN_LOCK_WAIT;
    let backoff = crate::backoff::Backoff::new(Duration::from_millis(200), Duration::from_secs(2));
    let mut attempt = 0;
    loop {
        let result = match store.bootstrap(config.shard_count).await {
            Ok(_) => check_timings(store, config, runs_manager).await,
            Err(err) => Err(err.into()),
        };
        let waiting_on_a_lock = matches!(
            &result,
            Err(ClusterError::Store(PlacementStoreError::Database(err)))
                if err.as_database_error().and_then(|e| e.code()).is_some_and(|c| c == "55P03" || c == "57014")
        );
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if !waiting_on_a_lock || remaining.is_zero() {
            return result;
        }
        tracing::warn!(
            component = "placement",
            attempt,
            "joining the cluster waits on a PostgreSQL lock (a manager stopped inside its round?); retrying"
        );
        let delay = backoff.delay_within(attempt, remaining, &mut rand::rng());
        tokio::time::sleep(delay).await;
        attempt += 1;
    }
}

/// Refuse to run with timings that break the cluster's fencing argument (see
/// [`ClusterConfig::timing_problems`]).
async fn check_timings(
    store: &PlacementStore,
    config: &ClusterConfig,
    runs_manager: bool,
) -> Result<(), ClusterError> {
    let stored = store.agree_timings(config.timings()).await?;
    let problems: Vec<String> = config
        .timing_problems(stored, runs_manager)
        .iter()
        .map(|p| p.to_string())
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ClusterError::InvalidConfig(problems.join("; ")))
    }
}

fn manager_args(store: &PlacementStore, config: &ClusterConfig) -> ShardManagerArgs {
    ShardManagerArgs {
        store: store.clone(),
        term: Term(0),
        node_ttl: config.node_ttl.get(),
        move_budget: config.move_budget,
        rebalance_interval: config.rebalance_interval.get(),
        listen_notify: config.listen_notify,
    }
}

/// A pool for the placement database from `[cluster]`, its sessions named
/// `graviton-data:<node>`.
pub async fn connect(config: &ClusterConfig, node: &NodeId) -> Result<PgPool, ClusterError> {
    let url = config
        .database_url
        .as_ref()
        .ok_or(ClusterError::NotConfigured)?;
    let pool = pg::connect_pool(
        url.expose(),
        config.pool_max_connections,
        config.statement_timeout.get(),
        &format!("graviton-data:{}", node.as_str()),
    )
    .await?;
    pg::check_server_version(&pool).await?;
    Ok(pool)
}

/// A running standalone manager (`graviton manager`).
pub struct StandaloneManager {
    election: ActorRef<ElectionMsg>,
    join: tokio::task::JoinHandle<()>,
    pool: PgPool,
}

/// `graviton manager --config FILE`: take the manager lock once and run the shard manager.
/// Fails closed with [`ClusterError::ManagerLockHeld`] if another manager holds the lock.
pub async fn run_standalone_manager(
    node: NodeId,
    config: &ClusterConfig,
) -> Result<StandaloneManager, ClusterError> {
    let pool = connect(config, &node).await?;
    pg::migrate(&pool).await?;
    let store = PlacementStore::new(pool.clone());
    join_checks(&store, config, true).await?;
    let lock_options = pg::connection::lock_connection_options(
        (*pool.connect_options())
            .clone()
            .application_name(&format!("graviton-lock:{}", node.as_str())),
        config.lock_ping_interval.get(),
    );
    let mut conn = PgConnection::connect_with(&lock_options)
        .await
        .map_err(PlacementStoreError::Database)?;
    if !pg::connection::try_lock(&mut conn)
        .await
        .map_err(PlacementStoreError::Database)?
    {
        let _ = conn.close().await;
        return Err(ClusterError::ManagerLockHeld);
    }
    let (election, join) = Actor::spawn(
        None,
        ManagerElection,
        ElectionArgs {
            node,
            mode: ElectionMode::FailClosed,
            lock_options,
            held: Some(conn),
            manager: manager_args(&store, config),
            lock_retry_interval: config.lock_retry_interval.get(),
            lock_ping_interval: config.lock_ping_interval.get(),
        },
    )
    .await
    .map_err(|e| ClusterError::Spawn(e.to_string()))?;
    Ok(StandaloneManager {
        election,
        join,
        pool,
    })
}

impl StandaloneManager {
    /// The term this manager acts under (0 once it lost the lock).
    pub async fn term(&self) -> Term {
        ractor::call_t!(self.election, ElectionMsg::Term, 2000).unwrap_or_default()
    }

    /// Resolves if the election actor stops by itself (it should not: after losing the
    /// lock it stands by). The process should then exit rather than idle.
    pub async fn stopped(&self) {
        while self.election.get_status() != ractor::ActorStatus::Stopped {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Stop the manager and release the lock.
    pub async fn shutdown(self) {
        let _ = self
            .election
            .stop_and_wait(None, Some(Duration::from_secs(5)))
            .await;
        let _ = self.join.await;
        self.pool.close().await;
    }
}

impl ClusterHandle {
    pub fn node_id(&self) -> &NodeId {
        self.view.node()
    }

    /// The shared local view (for hot paths that want to hold it directly).
    pub fn view(&self) -> &Arc<LocalView> {
        &self.view
    }

    pub fn shard_of(&self, key: &SessionKey) -> ShardId {
        self.view.shard_of(key)
    }

    /// Owner of a session from the local table (no I/O; well under a microsecond).
    pub fn resolve(&self, key: &SessionKey) -> Result<Owner, ResolveError> {
        self.view.resolve(key)
    }

    /// Owner of a shard from the local table, e.g. to name the current owner when a
    /// forwarded request carries a stale epoch.
    pub fn resolve_shard(&self, shard: ShardId) -> Result<Owner, ResolveError> {
        self.view.resolve_shard(shard)
    }

    /// May this node admit ingest for `shard` at `epoch` (owner, current epoch, no move
    /// pending, not self-fenced)?
    pub fn can_ingest(&self, shard: ShardId, epoch: Epoch) -> bool {
        self.view.can_ingest(shard, epoch)
    }

    /// Admit one ingest (see [`IngestPermit`]).
    pub fn begin_ingest(&self, shard: ShardId, epoch: Epoch) -> Option<IngestPermit> {
        self.view.begin_ingest(shard, epoch)
    }

    /// Request a drain of `node` (any node may ask). Returns false for an unknown or dead
    /// node. The manager moves the node's shards at once.
    pub async fn drain(&self, node: &NodeId) -> Result<bool, ClusterError> {
        match &self.store {
            Some(store) => Ok(store.request_drain(node).await?),
            None => Ok(false),
        }
    }

    /// Drain this node and wait (up to `timeout`) until it owns no shard, or until no
    /// other node can take shards (every other node draining, dead or gone: nothing will
    /// move, so waiting would only spend the timeout).
    pub async fn drain_self(&self, timeout: Duration) -> Result<DrainEnd, ClusterError> {
        if self.store.is_none() {
            return Ok(DrainEnd::TimedOut);
        }
        self.drain(self.view.node()).await?;
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changes = self.view.subscribe();
        loop {
            let table = self.view.table();
            if table.owned_by(self.view.node()) == 0 {
                return Ok(DrainEnd::Drained);
            }
            if !table.others_take_shards(self.view.node()) {
                return Ok(DrainEnd::NoTarget);
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                return Ok(DrainEnd::TimedOut);
            }
        }
    }

    /// Shards this node owns in its local table (e.g. to stop session owners of shards
    /// that moved away; pair with [`ClusterHandle::subscribe`]).
    pub fn owned_shards(&self) -> Vec<ShardId> {
        self.view.owned_shards()
    }

    /// Changes whenever the local table or the self-fence changes.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.view.subscribe()
    }

    /// The readiness snapshot.
    pub fn health(&self) -> HealthSnapshot {
        self.view.health()
    }

    /// The operator snapshot (from the local table; no I/O).
    pub fn snapshot(&self) -> PlacementSnapshot {
        let table = self.view.table();
        PlacementSnapshot {
            node: self.view.node().clone(),
            health: self.view.health(),
            configured_shards: self.view.shard_count(),
            assigned_shards: table.assigned(),
            local_shards: table.owned_by(self.view.node()),
            moving_shards: table.moving(),
            manager_term: table.manager_term,
            max_epoch: table.max_epoch().0,
            fenced: self.view.fenced(),
            nodes: summarize(&table),
            counters: self.view.counters.snapshot(),
        }
    }

    /// The manager term this node leads under, 0 when it is not the manager.
    pub async fn leading_term(&self) -> Term {
        match &self.supervisor {
            Some(s) => ractor::call_t!(s, PlacementSupMsg::Term, 3000).unwrap_or_default(),
            None => Term(0),
        }
    }

    /// Route an upload of `key` by the local table (no I/O; see `placement::routing`).
    pub fn route(&self, key: &SessionKey) -> Result<Route, RouteError> {
        self.view.route(key)
    }

    /// Owner side of a forwarded upload: does this node own `key`'s shard at `epoch`?
    pub fn check_forwarded(&self, key: &SessionKey, shard: ShardId, epoch: Epoch) -> EpochVerdict {
        self.view.check_forwarded(key, shard, epoch)
    }

    /// The current owner after a stale epoch: unless the local table already knows an
    /// epoch at least as new as the one the owner named, ask for a fresh table and wait
    /// for it (up to [`routing::RE_RESOLVE_WAIT`]), then route again.
    pub async fn re_resolve(
        &self,
        key: &SessionKey,
        stale: &StaleEpoch,
    ) -> Result<OwnerTarget, RouteError> {
        let mut changes = self.subscribe();
        changes.borrow_and_update();
        let known = self.resolve(key).ok().map(|o| o.epoch);
        let already_newer = matches!((known, stale.current_epoch), (Some(k), Some(named)) if named.0 > 0 && k >= named);
        if !already_newer {
            self.refresh();
            let _ = tokio::time::timeout(routing::RE_RESOLVE_WAIT, changes.changed()).await;
        }
        // A session that moved here meanwhile is forwarded to this node's own internal
        // listener, which ingests it like any forwarded upload.
        routing::target_of(self.resolve(key)?)
    }

    /// Ask the placement actor to re-read the table now.
    pub fn refresh(&self) {
        if let Some(s) = &self.supervisor {
            let _ = s.cast(PlacementSupMsg::Refresh);
        }
    }

    /// Fault injection for tests and drills: kill one placement actor as if it crashed.
    /// The placement supervisor restarts it.
    pub fn inject_actor_failure(&self, child: PlacementChild) {
        if let Some(s) = &self.supervisor {
            let _ = s.cast(PlacementSupMsg::Kill(child));
        }
    }

    /// Stop the election (releasing the manager lock), health and placement actors. The
    /// node fences itself; its row stays, and the manager reassigns its shards after the TTL
    /// unless it was drained first.
    pub async fn shutdown(&self) {
        if let Some(s) = &self.supervisor {
            // The supervisor stops the election, health and placement actors in that order.
            let _ = s.stop_and_wait(None, Some(Duration::from_secs(20))).await;
        }
        self.view.fence_now();
    }
}

impl Drop for ClusterHandle {
    /// A handle dropped without [`ClusterHandle::shutdown`] still stops its actors (without
    /// waiting), so the election releases the lock and heartbeats stop.
    fn drop(&mut self) {
        if let Some(s) = &self.supervisor {
            s.stop(None);
        }
        self.view.fence_now();
    }
}
