//! `NodeSupervisor`: the root of a node's actor tree.
//!
//! It owns the `SessionRegion` (registered under a per-node name so handles can find the
//! current incarnation) and restarts it with exponential backoff when it fails or stops
//! unexpectedly. A child's exit never stops the supervisor (ractor's default would).
//! `shutdown` stops children first and disables restarts.

use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::time::Instant;

use super::handle::SessionRegionHandle;
use super::session_region::{RegionArgs, RegionMsg, SessionRegion};
use crate::backoff::Restart;
use crate::metrics::ActorLabels;

/// Restart delays of crashed children.
const RESTART_INITIAL: Duration = Duration::from_millis(50);
const RESTART_MAX: Duration = Duration::from_secs(5);
const RESTART_STABLE_AFTER: Duration = Duration::from_secs(30);

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
    backoff: Restart,
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
    state.backoff.started(Instant::now());
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
            backoff: Restart::new(RESTART_INITIAL, RESTART_MAX, RESTART_STABLE_AFTER),
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
                    let delay = state.backoff.next_delay(Instant::now());
                    tracing::error!(error = %err, ?delay, "session region failed to restart; retrying");
                    myself.send_after(delay, || SupervisorMsg::RestartRegion);
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
        let (cell, why) = match &event {
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, reason.clone().unwrap_or_else(|| "stopped".into()))
            }
            SupervisionEvent::ActorFailed(cell, err) => (cell, format!("failed: {err}")),
            _ => return Ok(()),
        };
        let is_region = state
            .region
            .as_ref()
            .is_some_and(|r| r.get_id() == cell.get_id());
        if !is_region {
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
        let delay = state.backoff.next_delay(Instant::now());
        tracing::warn!(reason = %why, ?delay, "session region exited; restarting");
        myself.send_after(delay, || SupervisorMsg::RestartRegion);
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
