//! The `Placement` actor: one per node. Owns this node's registration, heartbeat, local
//! copy of the shard table and revocation acknowledgements.
//!
//! - Refresh: on every NOTIFY on the placement channel (a listener task casts `Refresh`)
//!   and every `poll_interval` regardless, so a lost notification is healed within one
//!   polling interval. A failed read keeps the last table (nodes keep routing) and marks
//!   placement unreadable for health.
//! - Heartbeat: a task of its own, on a connection pool of its own, every
//!   `heartbeat_interval`, so a stalled table read never holds a heartbeat back. Success
//!   extends the self-fence deadline to *request start* + `self_fence`.
//! - Lost registration: a heartbeat refused because the row was declared dead (or is gone)
//!   fences at once ([`LocalView::registration_lost`]) and queues `Reregister`. The node
//!   ingests again only after it re-registered *and* published a table whose read started
//!   after that (LOC-1): a successful heartbeat alone never lifts the fence. A refusal
//!   because another process registered the same node id fences this process for good;
//!   a newer registration made by this process itself (a re-registration that committed
//!   after its deadline fired, so its incarnation was never learned) is told apart by the
//!   registration's process token and registers again. A refusal answered for an older
//!   incarnation (a heartbeat the server answered before the re-registration committed,
//!   delivered after it) is stale: it is ignored, and logged at INFO as "heartbeat refusal
//!   for an older incarnation ignored" (`pg_proxy::a_stale_dead_heartbeat_reply_does_not_fence_a_reregistered_node`
//!   stages it on real connections).
//! - Acks: after each refresh, and whenever the last permit on a shard is dropped, the
//!   node acknowledges revocations of its shards that have no ingest in flight.
//!
//! Failure model: PostgreSQL errors never crash the actor; they are logged (no tenant or
//! session values anywhere here) and retried on the next tick. Every call has a
//! client-side deadline (`call_timeout`), so one stuck connection cannot freeze the actor.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use sqlx::postgres::PgListener;
use tokio::task::JoinHandle;
use tokio_util::task::AbortOnDropHandle;

use crate::placement::handoff;
use crate::placement::model::NodeState;
use crate::placement::view::{LocalView, PlacementCounters};
use crate::storage::pg::placement::{
    HeartbeatReply, NOTIFY_CHANNEL, NodeRegistration, PlacementStore,
};

/// Messages of the placement actor.
#[derive(Debug, ractor_cluster::RactorMessage)]
pub enum PlacementMsg {
    /// Re-read the shard table.
    Refresh,
    /// The registration was lost: register again, then re-read the table.
    Reregister,
    /// Acknowledge revocations whose in-flight ingest has drained.
    CheckAcks,
}

/// Startup arguments.
#[derive(Clone)]
pub struct PlacementArgs {
    /// Table reads, registration and acks.
    pub store: PlacementStore,
    /// Heartbeats only (a pool of its own).
    pub heartbeat_store: PlacementStore,
    pub registration: NodeRegistration,
    pub view: Arc<LocalView>,
    pub heartbeat_interval: Duration,
    pub poll_interval: Duration,
    /// Client-side deadline of every PostgreSQL call.
    pub call_timeout: Duration,
    pub listen_notify: bool,
}

pub struct PlacementActor;

pub struct PlacementState {
    store: PlacementStore,
    registration: NodeRegistration,
    view: Arc<LocalView>,
    incarnation: Arc<AtomicI64>,
    call_timeout: Duration,
    refresh_queued: Arc<AtomicBool>,
    reregister_queued: Arc<AtomicBool>,
    /// Timers and listener tasks; aborted when the state is dropped, which also happens
    /// when the actor is killed (`post_stop` does not run then).
    tasks: Vec<AbortOnDropHandle<()>>,
}

/// A PostgreSQL call under a client-side deadline.
async fn within<T, E: std::fmt::Display>(
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no answer within {limit:?}")),
    }
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
        args.view.registration_lost();
        let incarnation = within(
            args.call_timeout,
            args.store.register_node(&args.registration),
        )
        .await?;
        args.view.registered();
        args.view.heartbeat_ok(started);
        let ticket = args.view.read_ticket();
        let table = within(args.call_timeout, args.store.read_table()).await?;
        args.view.publish_read(table, ticket);
        tracing::info!(component = "placement", node_id = %args.registration.id, incarnation, "node registered");

        let incarnation = Arc::new(AtomicI64::new(incarnation));
        let refresh_queued = Arc::new(AtomicBool::new(false));
        let reregister_queued = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        tasks.push(AbortOnDropHandle::new(
            myself.send_interval(args.poll_interval, || PlacementMsg::Refresh),
        ));
        tasks.push(AbortOnDropHandle::new(spawn_heartbeats(Heartbeats {
            store: args.heartbeat_store.clone(),
            registration: args.registration.clone(),
            view: args.view.clone(),
            actor: myself.clone(),
            incarnation: incarnation.clone(),
            reregister_queued: reregister_queued.clone(),
            interval: args.heartbeat_interval,
            // A slow heartbeat that succeeds still extends the fence from its *start*, so
            // it may take up to the whole fence window: a per-call limit of one interval
            // fenced loaded nodes needlessly (seen in `cargo bench --bench forward`).
            timeout: args.view.self_fence().max(Duration::from_millis(50)),
        })));
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
            call_timeout: args.call_timeout,
            refresh_queued,
            reregister_queued,
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
            PlacementMsg::Reregister => {
                reregister(state).await;
                state.reregister_queued.store(false, Ordering::SeqCst);
            }
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
        state.view.registration_lost();
        Ok(())
    }
}

async fn refresh(state: &mut PlacementState) {
    let ticket = state.view.read_ticket();
    match within(state.call_timeout, state.store.read_table()).await {
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
            state.view.publish_read(table, ticket);
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

/// Register again after the registration was lost, then read the table under the new
/// registration. On failure the node stays fenced; the next refused heartbeat retries.
async fn reregister(state: &mut PlacementState) {
    PlacementCounters::bump(&state.view.counters.reregistrations, 1);
    state.view.registration_lost();
    let started = Instant::now();
    match within(
        state.call_timeout,
        state.store.reregister_node(&state.registration),
    )
    .await
    {
        Ok(incarnation) => {
            state.incarnation.store(incarnation, Ordering::SeqCst);
            state.view.registered();
            state.view.heartbeat_ok(started);
            tracing::info!(component = "placement", node_id = %state.registration.id, incarnation, "re-registered; fenced until the table is re-read");
            refresh(state).await;
        }
        Err(err) => {
            tracing::warn!(component = "placement", node_id = %state.registration.id, error = %err, "re-registration failed")
        }
    }
}

struct Heartbeats {
    store: PlacementStore,
    registration: NodeRegistration,
    view: Arc<LocalView>,
    actor: ActorRef<PlacementMsg>,
    incarnation: Arc<AtomicI64>,
    reregister_queued: Arc<AtomicBool>,
    interval: Duration,
    timeout: Duration,
}

impl Heartbeats {
    /// The registration is lost: fence at once and queue one `Reregister` (`log` says why;
    /// nothing more while one is queued). False when the placement actor is gone.
    fn fence_and_reregister(&self, log: impl FnOnce()) -> bool {
        self.view.registration_lost();
        if !self.reregister_queued.swap(true, Ordering::SeqCst) {
            log();
            return self.actor.cast(PlacementMsg::Reregister).is_ok();
        }
        true
    }
}

/// The heartbeat loop. Stops for good when another process registered the same node id.
fn spawn_heartbeats(hb: Heartbeats) -> JoinHandle<()> {
    tokio::spawn(async move {
        let node = hb.view.node().clone();
        let mut ticker = tokio::time::interval(hb.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_state: Option<NodeState> = None;
        loop {
            ticker.tick().await;
            let started = Instant::now();
            let incarnation = hb.incarnation.load(Ordering::SeqCst);
            match within(
                hb.timeout,
                hb.store.heartbeat_reply(&hb.registration, incarnation),
            )
            .await
            {
                Ok(HeartbeatReply::Alive(node_state)) => {
                    PlacementCounters::bump(&hb.view.counters.heartbeats, 1);
                    hb.view.heartbeat_ok(started);
                    if last_state != Some(node_state) {
                        tracing::info!(component = "placement", node_id = %node, state = node_state.as_str(), "node state");
                        last_state = Some(node_state);
                    }
                }
                Ok(
                    reply @ (HeartbeatReply::Dead
                    | HeartbeatReply::Missing
                    | HeartbeatReply::Unconfirmed { .. }),
                ) => {
                    let current = hb.incarnation.load(Ordering::SeqCst);
                    let queued = hb.reregister_queued.load(Ordering::SeqCst);
                    if incarnation != current
                        && matches!(reply, HeartbeatReply::Dead | HeartbeatReply::Missing)
                    {
                        // A refusal of the registration this node already replaced
                        // (answered before the re-registration committed): stale.
                        tracing::info!(component = "placement", node_id = %node, incarnation, current, reply = ?reply, "heartbeat refusal for an older incarnation ignored");
                    }
                    if lost_registration(reply, incarnation, current, queued) {
                        last_state = None;
                        if !hb.fence_and_reregister(|| tracing::warn!(component = "placement", node_id = %node, incarnation, reply = ?reply, "heartbeat refused (declared dead, missing or registered again unconfirmed); fenced, re-registering")) {
                            return;
                        }
                    }
                }
                Ok(HeartbeatReply::Superseded { incarnation: row }) => {
                    hb.view.registration_lost();
                    tracing::error!(component = "placement", node_id = %node, incarnation, newer = row, "another process registered this node id; this process stays fenced");
                    return;
                }
                Err(err) => {
                    PlacementCounters::bump(&hb.view.counters.heartbeat_failures, 1);
                    tracing::warn!(component = "placement", node_id = %node, error = %err, "heartbeat failed");
                }
            }
        }
    })
}

/// Whether a heartbeat's refusal means this process's registration is lost (fence and
/// register again), given the incarnation the heartbeat was sent with (`sent`), the one
/// the process holds now (`current`) and whether a re-registration is already queued.
///
/// A refusal answered for an older incarnation than the current one is stale: a
/// re-registration committed while the heartbeat was in flight, and acting on it would
/// fence the newly registered node, with nothing left to lift the fence once the queued
/// re-registration had already finished (LOC-3). An `Unconfirmed` row at the current
/// incarnation, or while a re-registration is queued, is this process's own registration
/// committing; only an unconfirmed row newer than anything it learned needs another.
fn lost_registration(reply: HeartbeatReply, sent: i64, current: i64, queued: bool) -> bool {
    if sent != current {
        return false;
    }
    match reply {
        HeartbeatReply::Dead | HeartbeatReply::Missing => true,
        HeartbeatReply::Unconfirmed { incarnation: row } => !queued && row != current,
        HeartbeatReply::Alive(_) | HeartbeatReply::Superseded { .. } => false,
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
    let incarnation = state.incarnation.load(Ordering::SeqCst);
    match within(
        state.call_timeout,
        state.store.ack_revocations(&me, incarnation, &acks),
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_answered_for_an_older_incarnation_is_stale() {
        // Checks LOC-3: the stale "dead" reply of a heartbeat sent before the
        // re-registration committed never fences the re-registered node.
        for reply in [
            HeartbeatReply::Dead,
            HeartbeatReply::Missing,
            HeartbeatReply::Unconfirmed { incarnation: 8 },
        ] {
            for queued in [false, true] {
                assert!(
                    !lost_registration(reply, 7, 8, queued),
                    "{reply:?} {queued}"
                );
            }
        }
    }

    #[test]
    fn a_current_refusal_fences_and_an_own_commit_does_not() {
        assert!(lost_registration(HeartbeatReply::Dead, 7, 7, false));
        assert!(lost_registration(HeartbeatReply::Missing, 7, 7, false));
        // Declared dead again while a re-registration is queued: still lost (the queued
        // one registers; fencing again is harmless).
        assert!(lost_registration(HeartbeatReply::Dead, 7, 7, true));
        // A newer row by this process, never learned: register again…
        assert!(lost_registration(
            HeartbeatReply::Unconfirmed { incarnation: 9 },
            7,
            7,
            false
        ));
        // …unless the queued re-registration is the one committing.
        assert!(!lost_registration(
            HeartbeatReply::Unconfirmed { incarnation: 9 },
            7,
            7,
            true
        ));
        assert!(!lost_registration(
            HeartbeatReply::Alive(NodeState::Active),
            7,
            7,
            false
        ));
    }
}
