//! The `Placement` actor: one per node. Owns this node's registration, heartbeat, local
//! copy of the shard table and revocation acknowledgements.
//!
//! - Refresh: on every NOTIFY on the placement channel (a listener task casts `Refresh`)
//!   and every `poll_interval` regardless, so a lost notification is healed within one
//!   polling interval. A failed read keeps the last table (nodes keep routing) and marks
//!   placement unreadable for health.
//! - Heartbeat: every `heartbeat_interval`; success extends the self-fence deadline to
//!   *request start* + `self_fence`. A heartbeat refused because the row is dead or has a
//!   newer incarnation fences at once; the node then re-registers and refreshes its table
//!   before it may ingest again.
//! - Acks: after each refresh, and whenever the last permit on a shard is dropped, the
//!   node acknowledges revocations of its shards that have no ingest in flight.
//!
//! Failure model: PostgreSQL errors never crash the actor; they are logged (no tenant or
//! session values anywhere here) and retried on the next tick.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use sqlx::postgres::PgListener;
use tokio::task::JoinHandle;
use tokio_util::task::AbortOnDropHandle;

use crate::placement::handoff;
use crate::placement::model::NodeState;
use crate::placement::view::{LocalView, PlacementCounters};
use crate::storage::pg::placement::{NOTIFY_CHANNEL, NodeRegistration, PlacementStore};

/// Messages of the placement actor.
#[derive(Debug, ractor_cluster::RactorMessage)]
pub enum PlacementMsg {
    /// Re-read the shard table.
    Refresh,
    /// Write the heartbeat row.
    Heartbeat,
    /// Acknowledge revocations whose in-flight ingest has drained.
    CheckAcks,
}

/// Startup arguments.
#[derive(Clone)]
pub struct PlacementArgs {
    pub store: PlacementStore,
    pub registration: NodeRegistration,
    pub view: Arc<LocalView>,
    pub heartbeat_interval: Duration,
    pub poll_interval: Duration,
    pub listen_notify: bool,
}

pub struct PlacementActor;

pub struct PlacementState {
    store: PlacementStore,
    registration: NodeRegistration,
    view: Arc<LocalView>,
    incarnation: i64,
    heartbeat_timeout: Duration,
    last_state: Option<NodeState>,
    refresh_queued: Arc<AtomicBool>,
    /// Timers and listener tasks; aborted when the state is dropped, which also happens
    /// when the actor is killed (`post_stop` does not run then).
    tasks: Vec<AbortOnDropHandle<()>>,
}

impl Actor for PlacementActor {
    type Msg = PlacementMsg;
    type State = PlacementState;
    type Arguments = PlacementArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<PlacementMsg>,
        args: PlacementArgs,
    ) -> Result<PlacementState, ActorProcessingErr> {
        let started = Instant::now();
        let incarnation = args.store.register_node(&args.registration).await?;
        args.view.heartbeat_ok(started);
        let table = args.store.read_table().await?;
        args.view.publish(table);
        tracing::info!(component = "placement", node_id = %args.registration.id, incarnation, "node registered");

        let refresh_queued = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        tasks.push(AbortOnDropHandle::new(
            myself.send_interval(args.poll_interval, || PlacementMsg::Refresh),
        ));
        tasks.push(AbortOnDropHandle::new(
            myself.send_interval(args.heartbeat_interval, || PlacementMsg::Heartbeat),
        ));
        if args.listen_notify {
            tasks.push(AbortOnDropHandle::new(spawn_listener(
                args.store.clone(),
                myself.clone(),
                args.poll_interval,
                refresh_queued.clone(),
            )));
        }
        let view = args.view.clone();
        let me = myself.clone();
        tasks.push(AbortOnDropHandle::new(tokio::spawn(async move {
            loop {
                view.ack_wake.notified().await;
                if me.cast(PlacementMsg::CheckAcks).is_err() {
                    return;
                }
            }
        })));
        Ok(PlacementState {
            store: args.store,
            registration: args.registration,
            view: args.view,
            incarnation,
            heartbeat_timeout: args.heartbeat_interval.max(Duration::from_millis(50)),
            last_state: None,
            refresh_queued,
            tasks,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<PlacementMsg>,
        msg: PlacementMsg,
        state: &mut PlacementState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PlacementMsg::Refresh => {
                state.refresh_queued.store(false, Ordering::SeqCst);
                refresh(state).await;
                check_acks(state).await;
            }
            PlacementMsg::Heartbeat => heartbeat(state).await,
            PlacementMsg::CheckAcks => check_acks(state).await,
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<PlacementMsg>,
        state: &mut PlacementState,
    ) -> Result<(), ActorProcessingErr> {
        for task in state.tasks.drain(..) {
            task.abort();
        }
        // A stopped node admits nothing more.
        state.view.fence_now();
        Ok(())
    }
}

async fn refresh(state: &mut PlacementState) {
    match state.store.read_table().await {
        Ok(table) => {
            if table.shard_count() != state.view.shard_count() {
                tracing::error!(
                    component = "placement",
                    "shard table size differs from the configured shard count"
                );
                state.view.set_read_ok(false);
                return;
            }
            PlacementCounters::bump(&state.view.counters.table_reads, 1);
            state.view.publish(table);
        }
        Err(err) => {
            PlacementCounters::bump(&state.view.counters.table_read_failures, 1);
            if state.view.placement_readable() {
                tracing::warn!(component = "placement", node_id = %state.registration.id, error = %err, "placement table unreadable; routing with the last table");
            }
            state.view.set_read_ok(false);
        }
    }
}

async fn heartbeat(state: &mut PlacementState) {
    let started = Instant::now();
    let node = state.registration.id.clone();
    match tokio::time::timeout(
        state.heartbeat_timeout,
        state.store.heartbeat(&node, state.incarnation),
    )
    .await
    {
        Ok(Ok(Some(node_state))) => {
            PlacementCounters::bump(&state.view.counters.heartbeats, 1);
            state.view.heartbeat_ok(started);
            if state.last_state != Some(node_state) {
                tracing::info!(component = "placement", node_id = %node, state = node_state.as_str(), "node state");
                state.last_state = Some(node_state);
            }
        }
        Ok(Ok(None)) => {
            PlacementCounters::bump(&state.view.counters.reregistrations, 1);
            // Declared dead or superseded: stop ingesting now, then come back as a new
            // incarnation with a table read after the re-registration.
            state.view.fence_now();
            tracing::warn!(component = "placement", node_id = %node, "heartbeat refused (declared dead or superseded); re-registering");
            let started = Instant::now();
            match state.store.register_node(&state.registration).await {
                Ok(incarnation) => {
                    state.incarnation = incarnation;
                    match state.store.read_table().await {
                        Ok(table) => {
                            state.view.publish(table);
                            state.view.heartbeat_ok(started);
                        }
                        Err(err) => {
                            tracing::warn!(component = "placement", error = %err, "table read after re-registration failed")
                        }
                    }
                }
                Err(err) => {
                    tracing::warn!(component = "placement", error = %err, "re-registration failed")
                }
            }
        }
        Ok(Err(err)) => {
            PlacementCounters::bump(&state.view.counters.heartbeat_failures, 1);
            tracing::warn!(component = "placement", node_id = %node, error = %err, "heartbeat failed");
        }
        Err(_) => {
            PlacementCounters::bump(&state.view.counters.heartbeat_failures, 1);
            tracing::warn!(component = "placement", node_id = %node, "heartbeat timed out");
        }
    }
}

async fn check_acks(state: &mut PlacementState) {
    // The table read here was published before the in-flight counts are read, and a
    // published revocation blocks new permits, so a zero count is final.
    let table = state.view.table();
    let me = state.view.node().clone();
    let acks: Vec<_> = table
        .shards
        .iter()
        .filter(|e| handoff::should_ack(e, &me, state.view.in_flight(e.shard)))
        .map(|e| (e.shard, e.epoch))
        .collect();
    match state
        .store
        .ack_revocations(&me, state.incarnation, &acks)
        .await
    {
        Ok(0) => {}
        Ok(n) => {
            PlacementCounters::bump(&state.view.counters.acks, n);
            tracing::debug!(
                component = "placement",
                count = n,
                "revocations acknowledged"
            )
        }
        Err(err) => tracing::warn!(component = "placement", error = %err, "revocation ack failed"),
    }
}

/// LISTEN on the placement channel; every notification (and every reconnect, since
/// notifications sent while disconnected are lost) triggers a refresh. Bursts coalesce:
/// while a refresh is queued and not yet started, further notifications add nothing.
fn spawn_listener(
    store: PlacementStore,
    actor: ActorRef<PlacementMsg>,
    retry: Duration,
    queued: Arc<AtomicBool>,
) -> JoinHandle<()> {
    let wake = move |actor: &ActorRef<PlacementMsg>| {
        if queued.swap(true, Ordering::SeqCst) {
            return true;
        }
        actor.cast(PlacementMsg::Refresh).is_ok()
    };
    tokio::spawn(async move {
        loop {
            let mut listener = match PgListener::connect_with(store.pool()).await {
                Ok(listener) => listener,
                Err(_) => {
                    tokio::time::sleep(retry).await;
                    continue;
                }
            };
            if listener.listen(NOTIFY_CHANNEL).await.is_err() {
                tokio::time::sleep(retry).await;
                continue;
            }
            if !wake(&actor) {
                return;
            }
            // Ok(Some): a notification; Ok(None): reconnected, some may have been lost.
            while listener.try_recv().await.is_ok() {
                if !wake(&actor) {
                    return;
                }
            }
            tokio::time::sleep(retry).await;
        }
    })
}
