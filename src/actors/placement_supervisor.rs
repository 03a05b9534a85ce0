//! `PlacementSupervisor`: owns a cluster node's placement, health and (embedded mode)
//! manager-election actors, and restarts any of them that fails or stops unexpectedly,
//! with exponential backoff. It never stops because a child exited.
//!
//! While a child is down the node stays safe without it: without the placement actor,
//! heartbeats stop and the node fences itself after `cluster.self_fence`; without the
//! health actor, readiness keeps its last value; without the election, this node simply
//! does not stand for manager. A restarted placement actor re-registers (a new
//! incarnation) and reloads the table; a restarted election stands by for the lock again.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use sqlx::postgres::PgConnectOptions;

use super::health::{HealthActor, HealthArgs, HealthMsg, probe_once};
use super::manager_election::{ElectionArgs, ElectionMode, ElectionMsg, ManagerElection};
use super::placement::{PlacementActor, PlacementArgs, PlacementMsg};
use super::restart::{Restart, exited};
use super::shard_manager::ShardManagerArgs;
use crate::ids::NodeId;

const STOP_WAIT: Duration = Duration::from_secs(5);

/// What is needed to (re)start a standby election.
#[derive(Clone)]
pub struct ElectionSpec {
    pub node: NodeId,
    pub lock_options: PgConnectOptions,
    pub manager: ShardManagerArgs,
    pub lock_retry_interval: Duration,
    pub lock_ping_interval: Duration,
}

impl ElectionSpec {
    fn args(&self) -> ElectionArgs {
        ElectionArgs {
            node: self.node.clone(),
            mode: ElectionMode::Standby,
            lock_options: self.lock_options.clone(),
            held: None,
            manager: self.manager.clone(),
            lock_retry_interval: self.lock_retry_interval,
            lock_ping_interval: self.lock_ping_interval,
        }
    }
}

pub struct PlacementSupervisorArgs {
    pub placement: PlacementArgs,
    pub health: HealthArgs,
    pub election: Option<ElectionSpec>,
}

/// The supervised children.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Child {
    Placement,
    Health,
    Election,
}

pub enum PlacementSupMsg {
    Restart(Child),
    /// The manager term this node leads under (0 when not leading).
    Term(RpcReplyPort<crate::placement::Term>),
    /// Ask the placement actor to re-read the table now.
    Refresh,
    /// Fault injection for tests and drills: kill a child as if it had crashed.
    Kill(Child),
}

impl ractor::Message for PlacementSupMsg {}

pub struct PlacementSupervisor;

pub struct SupervisorState {
    args: PlacementSupervisorArgs,
    placement: Option<ActorRef<PlacementMsg>>,
    health: Option<ActorRef<HealthMsg>>,
    election: Option<ActorRef<ElectionMsg>>,
    restart: [Restart; 3],
}

impl Child {
    fn name(self) -> &'static str {
        match self {
            Child::Placement => "placement",
            Child::Health => "health",
            Child::Election => "manager_election",
        }
    }
}

fn index(child: Child) -> usize {
    match child {
        Child::Placement => 0,
        Child::Health => 1,
        Child::Election => 2,
    }
}

async fn spawn_child(
    myself: &ActorRef<PlacementSupMsg>,
    state: &mut SupervisorState,
    child: Child,
) -> Result<(), ActorProcessingErr> {
    let cell = myself.get_cell();
    match child {
        Child::Placement => {
            let (actor, _) =
                Actor::spawn_linked(None, PlacementActor, state.args.placement.clone(), cell)
                    .await?;
            state.placement = Some(actor);
            probe_once(&state.args.placement.view);
        }
        Child::Health => {
            let (actor, _) =
                Actor::spawn_linked(None, HealthActor, state.args.health.clone(), cell).await?;
            state.health = Some(actor);
        }
        Child::Election => {
            let Some(spec) = &state.args.election else {
                return Ok(());
            };
            let (actor, _) = Actor::spawn_linked(None, ManagerElection, spec.args(), cell).await?;
            state.election = Some(actor);
        }
    }
    state.restart[index(child)].started();
    Ok(())
}

impl Actor for PlacementSupervisor {
    type Msg = PlacementSupMsg;
    type State = SupervisorState;
    type Arguments = PlacementSupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<PlacementSupMsg>,
        args: PlacementSupervisorArgs,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let mut state = SupervisorState {
            args,
            placement: None,
            health: None,
            election: None,
            restart: Default::default(),
        };
        for child in [Child::Placement, Child::Health, Child::Election] {
            spawn_child(&myself, &mut state, child).await?;
        }
        Ok(state)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<PlacementSupMsg>,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        // Election first (releases the manager lock), then health, then placement.
        if let Some(election) = state.election.take() {
            let _ = election.stop_and_wait(None, Some(STOP_WAIT)).await;
        }
        if let Some(health) = state.health.take() {
            let _ = health.stop_and_wait(None, Some(STOP_WAIT)).await;
        }
        if let Some(placement) = state.placement.take() {
            let _ = placement.stop_and_wait(None, Some(STOP_WAIT)).await;
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<PlacementSupMsg>,
        message: PlacementSupMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            PlacementSupMsg::Restart(child) => {
                let running = match child {
                    Child::Placement => state.placement.is_some(),
                    Child::Health => state.health.is_some(),
                    Child::Election => state.election.is_some(),
                };
                if running {
                    return Ok(());
                }
                match spawn_child(&myself, state, child).await {
                    Ok(()) => tracing::info!(?child, "placement child restarted"),
                    Err(err) => {
                        let why = format!("restart failed: {err}");
                        state.restart[index(child)].schedule(
                            &myself,
                            child.name(),
                            &why,
                            move || PlacementSupMsg::Restart(child),
                        );
                    }
                }
            }
            PlacementSupMsg::Term(reply) => {
                let term = match &state.election {
                    Some(election) => {
                        ractor::call_t!(election, ElectionMsg::Term, 2000).unwrap_or_default()
                    }
                    None => crate::placement::Term(0),
                };
                let _ = reply.send(term);
            }
            PlacementSupMsg::Refresh => {
                if let Some(placement) = &state.placement {
                    let _ = placement.cast(PlacementMsg::Refresh);
                }
            }
            PlacementSupMsg::Kill(child) => match child {
                Child::Placement => state.placement.iter().for_each(|a| a.kill()),
                Child::Health => state.health.iter().for_each(|a| a.kill()),
                Child::Election => state.election.iter().for_each(|a| a.kill()),
            },
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<PlacementSupMsg>,
        event: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let Some((id, why)) = exited(&event) else {
            return Ok(());
        };
        let child = if state.placement.as_ref().is_some_and(|a| a.get_id() == id) {
            state.placement = None;
            Child::Placement
        } else if state.health.as_ref().is_some_and(|a| a.get_id() == id) {
            state.health = None;
            Child::Health
        } else if state.election.as_ref().is_some_and(|a| a.get_id() == id) {
            state.election = None;
            Child::Election
        } else {
            return Ok(());
        };
        state.restart[index(child)].schedule(&myself, child.name(), &why, move || {
            PlacementSupMsg::Restart(child)
        });
        Ok(())
    }
}
