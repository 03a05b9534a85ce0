//! The `ShardManager` actor: the one writer of shard assignments, alive only while its
//! process holds the manager advisory lock (see [`super::manager_election`]).
//!
//! Each round (every `rebalance_interval`, on node/ack notifications, and quickly again
//! while moves are pending) it reads the table and, in one term-fenced transaction:
//! 1. declares nodes dead whose heartbeat (database clock) is older than `node_ttl`;
//! 2. promotes fresh `joining` nodes to `active`;
//! 3. completes moves whose old owner acknowledged, or is dead (`epoch + 1`);
//! 4. runs the pure planner and writes its moves: direct assignment when the owner is
//!    dead or absent, otherwise a revocation the owner must acknowledge.
//!
//! Failure model: a fenced write (another manager has a newer term) stops the actor with
//! an error, which its supervisor treats as "lost leadership". Other database errors are
//! logged and the round is retried on the next tick. Nothing is kept in memory between
//! rounds except the term, so a crash loses nothing.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use sqlx::postgres::PgListener;
use tokio::task::JoinHandle;
use tokio_util::task::AbortOnDropHandle;

use crate::ids::NodeId;
use crate::placement::handoff::{self, Action};
use crate::placement::model::{NodeState, ShardEntry, Term};
use crate::placement::rebalance;
use crate::storage::pg::placement::{
    FencedTx, NOTIFY_CHANNEL, PlacementStore, PlacementStoreError,
};

#[derive(Debug, ractor_cluster::RactorMessage)]
pub enum ShardManagerMsg {
    /// Run one planning round.
    Round,
}

/// Startup arguments.
#[derive(Clone)]
pub struct ShardManagerArgs {
    pub store: PlacementStore,
    pub term: Term,
    pub node_ttl: Duration,
    pub move_budget: u32,
    pub rebalance_interval: Duration,
    pub listen_notify: bool,
}

pub struct ShardManager;

pub struct ShardManagerState {
    args: ShardManagerArgs,
    /// Timers and listener tasks; aborted when the state is dropped, which also happens
    /// when the actor is killed (`post_stop` does not run then).
    tasks: Vec<AbortOnDropHandle<()>>,
    follow_up: Option<AbortOnDropHandle<Result<(), ractor::MessagingErr<ShardManagerMsg>>>>,
}

/// What one round did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoundOutcome {
    pub declared_dead: usize,
    pub assigned: usize,
    pub revoked: usize,
    pub completed: usize,
    /// Moves still waiting for an acknowledgement after this round.
    pub pending: usize,
}

impl Actor for ShardManager {
    type Msg = ShardManagerMsg;
    type State = ShardManagerState;
    type Arguments = ShardManagerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ShardManagerMsg>,
        args: ShardManagerArgs,
    ) -> Result<ShardManagerState, ActorProcessingErr> {
        tracing::info!(
            component = "shard_manager",
            term = args.term.0,
            "shard manager acting"
        );
        let mut tasks = vec![AbortOnDropHandle::new(
            myself.send_interval(args.rebalance_interval, || ShardManagerMsg::Round),
        )];
        if args.listen_notify {
            tasks.push(AbortOnDropHandle::new(spawn_listener(
                args.store.clone(),
                myself.clone(),
                args.rebalance_interval,
            )));
        }
        Ok(ShardManagerState {
            args,
            tasks,
            follow_up: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<ShardManagerMsg>,
        msg: ShardManagerMsg,
        state: &mut ShardManagerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ShardManagerMsg::Round => {
                let args = &state.args;
                let ttl_ms = args.node_ttl.as_millis() as i64;
                match run_round(&args.store, args.term, ttl_ms, args.move_budget as usize).await {
                    Ok(outcome) => {
                        if outcome != RoundOutcome::default() {
                            tracing::debug!(component = "shard_manager", ?outcome, "round");
                        }
                        if outcome.pending > 0
                            && state.follow_up.as_ref().is_none_or(|h| h.is_finished())
                        {
                            let quick = (args.rebalance_interval / 4)
                                .clamp(Duration::from_millis(20), Duration::from_millis(100));
                            state.follow_up = Some(AbortOnDropHandle::new(
                                myself.send_after(quick, || ShardManagerMsg::Round),
                            ));
                        }
                    }
                    Err(err @ PlacementStoreError::Fenced { .. }) => {
                        tracing::warn!(component = "shard_manager", term = args.term.0, error = %err, "fenced; stepping down");
                        return Err(Box::new(err));
                    }
                    Err(err) => {
                        tracing::warn!(component = "shard_manager", term = args.term.0, error = %err, "round failed");
                    }
                }
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ShardManagerMsg>,
        state: &mut ShardManagerState,
    ) -> Result<(), ActorProcessingErr> {
        for task in state.tasks.drain(..) {
            task.abort();
        }
        if let Some(h) = state.follow_up.take() {
            h.abort();
        }
        Ok(())
    }
}

/// One planning round at `term` (see the module docs). Public for tests.
pub async fn run_round(
    store: &PlacementStore,
    term: Term,
    ttl_ms: i64,
    budget: usize,
) -> Result<RoundOutcome, PlacementStoreError> {
    let table = store.read_table().await?;
    if table.manager_term != term {
        return Err(PlacementStoreError::Fenced {
            held: term,
            current: table.manager_term,
        });
    }
    let mut tx = store.fenced(term).await?;
    // Fault tests stop a manager here, inside its fenced transaction (PG-1).
    crate::storage::pack::pause::after("manager round fenced");
    let mut outcome = RoundOutcome::default();
    let mut changed = false;
    let mut states: BTreeMap<NodeId, NodeState> = table
        .nodes
        .iter()
        .map(|(id, n)| (id.clone(), n.state))
        .collect();
    let mut locked: HashMap<NodeId, Option<NodeState>> = HashMap::new();

    for node in table.nodes.values() {
        if node.state != NodeState::Dead && node.heartbeat_age_ms > ttl_ms {
            if tx.mark_dead_if_silent(&node.id, ttl_ms).await? {
                tracing::warn!(component = "shard_manager", node_id = %node.id, age_ms = node.heartbeat_age_ms, "node declared dead");
                states.insert(node.id.clone(), NodeState::Dead);
                outcome.declared_dead += 1;
                changed = true;
            }
        } else if node.state == NodeState::Joining && tx.activate(&node.id).await? {
            states.insert(node.id.clone(), NodeState::Active);
            changed = true;
        }
    }

    let mut shards: Vec<ShardEntry> = table.shards.clone();
    // Completions, then assignments and revocations, each as one statement over every
    // shard of the round (a drain of hundreds of shards is three round trips, not
    // hundreds); every row keeps its own conditions.
    let mut completing = Vec::new();
    for entry in shards.iter() {
        let Some(target) = entry.moving_to.clone() else {
            continue;
        };
        let owner_state = entry.owner.as_ref().and_then(|o| states.get(o).copied());
        if !handoff::may_complete(entry, owner_state, states.get(&target).copied()) {
            continue;
        }
        if !entry.revoke_acked
            && !owner_confirmed_gone(&mut tx, &mut locked, entry.owner.as_ref()).await?
        {
            continue;
        }
        completing.push((entry.shard, entry.epoch, target));
    }
    for (shard, epoch) in tx.complete_moves(&completing).await? {
        let entry = &mut shards[shard.0 as usize];
        entry.owner = entry.moving_to.take();
        entry.epoch = epoch;
        entry.revoke_acked = false;
        outcome.completed += 1;
        changed = true;
    }

    let owners: Vec<Option<NodeId>> = shards.iter().map(handoff::effective_owner).collect();
    let moves = rebalance::plan(&owners, &states, budget);
    let (mut assigning, mut revoking) = (Vec::new(), Vec::new());
    for planned in &moves {
        let entry = &mut shards[planned.shard.0 as usize];
        let owner_state = entry.owner.as_ref().and_then(|o| states.get(o).copied());
        match handoff::action_for(entry, planned, owner_state) {
            Action::AssignNow { to } => {
                if entry.owner.is_some()
                    && !owner_confirmed_gone(&mut tx, &mut locked, entry.owner.as_ref()).await?
                {
                    continue;
                }
                assigning.push((entry.shard, entry.epoch, to));
            }
            Action::Revoke { to } => {
                if entry.moving_to.as_ref() == Some(&to) {
                    continue;
                }
                let owner = entry.owner.clone().expect("revoke has an owner");
                revoking.push((entry.shard, entry.epoch, owner, to));
            }
            Action::Cancel => {
                let owner = entry.owner.clone().expect("cancel has an owner");
                if entry.moving_to.is_some()
                    && tx.cancel_move(entry.shard, entry.epoch, &owner).await?
                {
                    entry.moving_to = None;
                    entry.revoke_acked = false;
                    changed = true;
                }
            }
        }
    }
    let assign_to: HashMap<u32, NodeId> = assigning.iter().map(|m| (m.0.0, m.2.clone())).collect();
    for (shard, epoch) in tx.assign_many(&assigning).await? {
        let to = assign_to.get(&shard.0).cloned();
        let entry = &mut shards[shard.0 as usize];
        entry.owner = to;
        entry.epoch = epoch;
        entry.moving_to = None;
        entry.revoke_acked = false;
        outcome.assigned += 1;
        changed = true;
    }
    let revoke_to: HashMap<u32, NodeId> = revoking.iter().map(|m| (m.0.0, m.3.clone())).collect();
    for shard in tx.revoke_many(&revoking).await? {
        let to = revoke_to.get(&shard.0).cloned();
        shards[shard.0 as usize].moving_to = to;
        outcome.revoked += 1;
        changed = true;
    }
    outcome.pending = shards.iter().filter(|s| s.moving_to.is_some()).count();
    if changed {
        tx.commit("shards").await?;
    } else {
        tx.rollback().await?;
    }
    Ok(outcome)
}

/// Confirm under a row lock that `owner` is dead (or unknown) before taking its shards.
async fn owner_confirmed_gone(
    tx: &mut FencedTx,
    locked: &mut HashMap<NodeId, Option<NodeState>>,
    owner: Option<&NodeId>,
) -> Result<bool, PlacementStoreError> {
    let Some(owner) = owner else { return Ok(true) };
    let state = match locked.get(owner) {
        Some(state) => *state,
        None => {
            let state = tx.lock_node_state(owner).await?;
            locked.insert(owner.clone(), state);
            state
        }
    };
    Ok(matches!(state, None | Some(NodeState::Dead)))
}

/// LISTEN for node changes and acknowledgements; each triggers a round.
fn spawn_listener(
    store: PlacementStore,
    actor: ActorRef<ShardManagerMsg>,
    retry: Duration,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            if let Ok(mut listener) = PgListener::connect_with(store.pool()).await
                && listener.listen(NOTIFY_CHANNEL).await.is_ok()
            {
                loop {
                    let wake = match listener.try_recv().await {
                        Ok(Some(n)) => matches!(n.payload(), "nodes" | "ack"),
                        // Reconnected: notifications may have been lost.
                        Ok(None) => true,
                        Err(_) => break,
                    };
                    if wake && actor.cast(ShardManagerMsg::Round).is_err() {
                        return;
                    }
                }
            }
            tokio::time::sleep(retry).await;
        }
    })
}
