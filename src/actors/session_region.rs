//! `SessionRegion`: the session owners of this node's shards.
//!
//! An owner actor runs only while its session uploads. When the upload ends the region
//! takes the owner's hot state back (a few dozen bytes), stops the actor and keeps the
//! state parked; the next upload of the session starts a new owner from it. Idle sessions
//! therefore cost a table entry, not an actor (an actor costs about 11 KiB).
//!
//! Spawns a [`SessionOwner`] on a session's first upload, keeps at most `max_hot` of them
//! (evicting the least recently active idle one at the bound, refusing when all are
//! active), stops owners idle for `idle_timeout`, and stops owners on request (shard
//! unassignment). The bookkeeping is the pure [`SessionIndex`]; this actor only applies its
//! decisions to actors. Owners are linked to the region, so their exits arrive as
//! supervision events and are removed from the index.

use std::collections::HashMap;
use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use serde::Serialize;
use tokio::time::Instant;

use super::handle::IngestTicket;
use super::session_owner::{OwnerMsg, SessionOwner};
use crate::ids::SessionKey;
use crate::metrics::{Metrics, ReasonLabels};
use crate::session::{HotSnapshot, HotState, IndexAdmission, SessionError, SessionIndex};

/// Settings of a region (from `[sessions]`).
#[derive(Debug, Clone)]
pub struct RegionArgs {
    pub max_hot: usize,
    pub idle_timeout: Duration,
    pub sweep_interval: Duration,
    pub metrics: Metrics,
}

/// Counts for operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RegionStats {
    pub hot_sessions: usize,
    pub active_sessions: usize,
    pub capacity: usize,
}

/// A predicate choosing sessions to stop (e.g. "belongs to a shard this node lost").
pub type SessionFilter = Box<dyn Fn(&SessionKey) -> bool + Send + Sync>;

pub enum RegionMsg {
    /// Start an upload of a session; replies with its ticket (whose drop ends it).
    Begin(SessionKey, RpcReplyPort<Result<IngestTicket, SessionError>>),
    /// The upload of a session ended.
    End {
        key: SessionKey,
        succeeded: bool,
    },
    /// Stop owners idle for longer than the timeout (timer).
    Sweep,
    /// Stop the owners of every *idle* session matching the filter. Sessions running an
    /// upload are left alone (their upload ends under its own ingest permit, and stopping
    /// them would drop the index entry that keeps one upload per session, SES-2).
    StopMatching(SessionFilter, RpcReplyPort<StopReport>),
    Stats(RpcReplyPort<RegionStats>),
    Snapshot(SessionKey, RpcReplyPort<Option<HotSnapshot>>),
}

impl ractor::Message for RegionMsg {}

pub struct SessionRegion;

/// What a `StopMatching` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StopReport {
    /// Idle sessions whose owner (or parked state) was dropped.
    pub stopped: usize,
    /// Matching sessions left alone because they are uploading.
    pub still_uploading: usize,
}

/// How long the region waits for an owner to hand over its state when parking it.
const PARK_TIMEOUT: Duration = Duration::from_secs(1);

/// Spawn the owner of `key` (from its parked state, if any) and record it.
async fn spawn_owner(
    myself: &ActorRef<RegionMsg>,
    state: &mut RegionState,
    key: SessionKey,
    parked: Option<HotState>,
) -> Result<ActorRef<OwnerMsg>, SessionError> {
    match Actor::spawn_linked(None, SessionOwner, parked, myself.get_cell()).await {
        Ok((owner, _)) => {
            state.by_actor.insert(owner.get_id(), key);
            state.owners.insert(key, owner.clone());
            Ok(owner)
        }
        Err(err) => {
            state.index.remove(&key);
            Err(SessionError::Unavailable(format!(
                "spawn session owner: {err}"
            )))
        }
    }
}

pub struct RegionState {
    args: RegionArgs,
    index: SessionIndex<SessionKey>,
    owners: HashMap<SessionKey, ActorRef<OwnerMsg>>,
    by_actor: HashMap<ActorId, SessionKey>,
    /// Hot state of idle sessions whose owner actor was stopped.
    parked: HashMap<SessionKey, HotState>,
    sweeper: Option<tokio::task::JoinHandle<()>>,
}

impl RegionState {
    fn stop_owner(&mut self, key: &SessionKey, reason: &'static str) {
        let parked = self.parked.remove(key).is_some();
        let owner = self.owners.remove(key);
        if let Some(owner) = &owner {
            self.by_actor.remove(&owner.get_id());
            owner.stop(Some(reason.to_string()));
        }
        if parked || owner.is_some() {
            self.args
                .metrics
                .session_stops
                .get_or_create(&ReasonLabels { reason })
                .inc();
        }
    }

    fn publish_gauges(&self) {
        self.args.metrics.hot_sessions.set(self.index.len() as i64);
        self.args
            .metrics
            .active_sessions
            .set(self.index.active() as i64);
    }
}

impl Actor for SessionRegion {
    type Msg = RegionMsg;
    type State = RegionState;
    type Arguments = RegionArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RegionMsg>,
        args: RegionArgs,
    ) -> Result<RegionState, ActorProcessingErr> {
        let sweeper = myself.send_interval(args.sweep_interval, || RegionMsg::Sweep);
        let state = RegionState {
            index: SessionIndex::new(args.max_hot),
            args,
            owners: HashMap::new(),
            by_actor: HashMap::new(),
            parked: HashMap::new(),
            sweeper: Some(sweeper),
        };
        state.publish_gauges();
        Ok(state)
    }

    async fn post_stop(
        &self,
        myself: ActorRef<RegionMsg>,
        state: &mut RegionState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(sweeper) = state.sweeper.take() {
            sweeper.abort();
        }
        myself.stop_children(Some("session region stopped".to_string()));
        state.args.metrics.hot_sessions.set(0);
        state.args.metrics.active_sessions.set(0);
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<RegionMsg>,
        message: RegionMsg,
        state: &mut RegionState,
    ) -> Result<(), ActorProcessingErr> {
        let now = Instant::now();
        match message {
            RegionMsg::Begin(key, reply) => {
                let result = match state.index.begin(&key, now) {
                    IndexAdmission::Existing => match state.owners.get(&key) {
                        Some(owner) => Ok(owner.clone()),
                        None => {
                            let parked = state.parked.remove(&key);
                            spawn_owner(&myself, state, key, parked).await
                        }
                    },
                    IndexAdmission::Busy => Err(SessionError::Busy),
                    IndexAdmission::Full => Err(SessionError::AtCapacity),
                    IndexAdmission::Inserted { evicted } => {
                        if let Some(evicted) = evicted {
                            state.stop_owner(&evicted, "evicted");
                        }
                        spawn_owner(&myself, state, key, None).await
                    }
                };
                if let Ok(owner) = &result {
                    let _ = owner.cast(OwnerMsg::Begin);
                }
                state.publish_gauges();
                // The session is active from here: the ticket in the answer ends it when
                // dropped, also when the caller is gone and the answer is never read
                // (`send` hands it back, or the channel drops it with its contents).
                let answer = result.map(|owner| IngestTicket::new(myself.clone(), owner, key));
                let _ = reply.send(answer);
            }
            RegionMsg::End { key, succeeded } => {
                state.index.end(&key, now);
                if let Some(owner) = state.owners.get(&key).cloned() {
                    let _ = owner.cast(OwnerMsg::Finish { succeeded });
                    // Park: take the state back (after the Finish above, same sender, FIFO)
                    // and stop the actor. If the owner does not answer, it stays running.
                    if let Ok(CallResult::Success(hot)) =
                        owner.call(OwnerMsg::Park, Some(PARK_TIMEOUT)).await
                    {
                        state.owners.remove(&key);
                        state.by_actor.remove(&owner.get_id());
                        owner.stop(Some("parked".to_string()));
                        if state.index.contains(&key) {
                            state.parked.insert(key, hot);
                        }
                    }
                }
                state.publish_gauges();
            }
            RegionMsg::Sweep => {
                for key in state.index.take_idle(now, state.args.idle_timeout) {
                    state.stop_owner(&key, "idle");
                }
                state.publish_gauges();
            }
            RegionMsg::StopMatching(filter, reply) => {
                let matching: Vec<SessionKey> = state
                    .owners
                    .keys()
                    .chain(state.parked.keys())
                    .filter(|k| filter(k))
                    .copied()
                    .collect();
                let mut report = StopReport::default();
                for key in &matching {
                    if state.index.is_active(key) {
                        report.still_uploading += 1;
                        continue;
                    }
                    state.index.remove(key);
                    state.stop_owner(key, "unassigned");
                    report.stopped += 1;
                }
                state.publish_gauges();
                let _ = reply.send(report);
            }
            RegionMsg::Stats(reply) => {
                let _ = reply.send(RegionStats {
                    hot_sessions: state.index.len(),
                    active_sessions: state.index.active(),
                    capacity: state.index.capacity(),
                });
            }
            RegionMsg::Snapshot(key, reply) => match state.owners.get(&key) {
                Some(owner) => {
                    let owner = owner.clone();
                    // Ask the owner without blocking the region on it.
                    tokio::spawn(async move {
                        let snapshot = owner
                            .call(OwnerMsg::Snapshot, Some(Duration::from_secs(2)))
                            .await;
                        let snapshot = match snapshot {
                            Ok(ractor::rpc::CallResult::Success(s)) => Some(s),
                            _ => None,
                        };
                        let _ = reply.send(snapshot);
                    });
                }
                None => {
                    let _ = reply.send(state.parked.get(&key).map(HotState::snapshot));
                }
            },
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<RegionMsg>,
        event: SupervisionEvent,
        state: &mut RegionState,
    ) -> Result<(), ActorProcessingErr> {
        // An owner exiting never stops the region: forget it, it can be rebuilt on demand.
        let (cell, failed) = match &event {
            SupervisionEvent::ActorTerminated(cell, _, _) => (cell, false),
            SupervisionEvent::ActorFailed(cell, _) => (cell, true),
            _ => return Ok(()),
        };
        if let Some(key) = state.by_actor.remove(&cell.get_id()) {
            state.owners.remove(&key);
            state.index.remove(&key);
            if failed {
                state
                    .args
                    .metrics
                    .session_stops
                    .get_or_create(&ReasonLabels { reason: "failed" })
                    .inc();
            }
            state.publish_gauges();
        }
        Ok(())
    }
}
