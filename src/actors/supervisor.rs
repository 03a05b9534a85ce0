//! `NodeSupervisor`: the root of a node's actor tree.
//!
//! It owns the `SessionRegion` (registered under a per-node name so handles can find the
//! current incarnation) and restarts it with exponential backoff when it fails or stops
//! unexpectedly. A child's exit never stops the supervisor (ractor's default would).
//! `shutdown` stops children first and disables restarts.

use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

use super::handle::SessionRegionHandle;
use super::restart::{Restart, exited};
use super::session_region::{RegionArgs, RegionMsg, SessionRegion};
use crate::metrics::ActorLabels;

pub struct SupervisorArgs {
    /// Registered name of the session region (unique per node in a process).
    pub region_name: String,
    pub region: RegionArgs,
}

pub enum SupervisorMsg {
    RestartRegion,
    Shutdown(RpcReplyPort<()>),
}

impl ractor::Message for SupervisorMsg {}

pub struct NodeSupervisor;

pub struct SupervisorState {
    args: SupervisorArgs,
    region: Option<ActorRef<RegionMsg>>,
    restart: Restart,
    shutting_down: bool,
}

async fn spawn_region(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState,
) -> Result<(), ActorProcessingErr> {
    let (region, _) = Actor::spawn_linked(
        Some(state.args.region_name.clone()),
        SessionRegion,
        state.args.region.clone(),
        myself.get_cell(),
    )
    .await?;
    state.region = Some(region);
    state.restart.started();
    Ok(())
}

impl Actor for NodeSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let mut state = SupervisorState {
            args,
            region: None,
            restart: Restart::default(),
            shutting_down: false,
        };
        spawn_region(&myself, &mut state).await?;
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        message: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            SupervisorMsg::RestartRegion => {
                if state.shutting_down || state.region.is_some() {
                    return Ok(());
                }
                if let Err(err) = spawn_region(&myself, state).await {
                    let why = format!("restart failed: {err}");
                    state.restart.schedule(&myself, "session_region", &why, || {
                        SupervisorMsg::RestartRegion
                    });
                } else {
                    tracing::info!("session region restarted");
                }
            }
            SupervisorMsg::Shutdown(reply) => {
                state.shutting_down = true;
                if let Some(region) = state.region.take() {
                    let _ = region
                        .stop_and_wait(Some("node shutdown".into()), Some(Duration::from_secs(5)))
                        .await;
                }
                let _ = reply.send(());
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let Some((id, why)) = exited(&event) else {
            return Ok(());
        };
        if state.region.as_ref().is_none_or(|r| r.get_id() != id) {
            // Another child: the placement group (which restarts its own children) or a
            // per-transfer lease holder (which ends with its transfer).
            if matches!(event, SupervisionEvent::ActorFailed(..)) {
                tracing::error!(reason = %why, "a supervised actor failed");
            } else if !state.shutting_down {
                tracing::debug!(reason = %why, "a supervised actor exited");
            }
            return Ok(());
        }
        state.region = None;
        if state.shutting_down {
            return Ok(());
        }
        state
            .args
            .region
            .metrics
            .actor_restarts
            .get_or_create(&ActorLabels {
                actor: "session_region",
            })
            .inc();
        state.restart.schedule(&myself, "session_region", &why, || {
            SupervisorMsg::RestartRegion
        });
        Ok(())
    }
}

/// The running supervisor of a node.
pub struct SupervisorHandle {
    actor: ActorRef<SupervisorMsg>,
    join: tokio::task::JoinHandle<()>,
    region: SessionRegionHandle,
}

impl SupervisorHandle {
    pub async fn start(args: SupervisorArgs) -> Result<Self, ractor::SpawnErr> {
        let region = SessionRegionHandle::new(args.region_name.clone());
        let (actor, join) = Actor::spawn(None, NodeSupervisor, args).await?;
        Ok(Self {
            actor,
            join,
            region,
        })
    }

    pub fn sessions(&self) -> SessionRegionHandle {
        self.region.clone()
    }

    /// The root of the node's actor tree: groups that supervise their own children (the
    /// placement group) are linked under it, so one tree holds every long-lived actor.
    pub fn root(&self) -> ActorCell {
        self.actor.get_cell()
    }

    /// Stop children (no restarts), then the supervisor itself.
    pub async fn shutdown(self) {
        let _ = self
            .actor
            .call(SupervisorMsg::Shutdown, Some(Duration::from_secs(10)))
            .await
            .map(|r| {
                if let CallResult::Timeout = r {
                    tracing::warn!("supervisor shutdown timed out");
                }
            });
        self.actor.stop(None);
        let _ = self.join.await;
    }
}
