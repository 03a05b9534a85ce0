//! The `Health` actor: probes the node-local placement view on a fixed cadence and stores
//! the readiness snapshot ([`crate::placement::health`]) where the HTTP layer reads it.
//!
//! The probe does no I/O of its own: the placement actor already reads PostgreSQL every
//! polling interval and records whether that worked, so "placement readable" here means
//! "the last table read succeeded". Status transitions are logged at info/warn with the
//! node id only.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio_util::task::AbortOnDropHandle;

use crate::placement::health::{self, Probe, ProbeFailure};
use crate::placement::view::LocalView;

#[derive(Debug, ractor_cluster::RactorMessage)]
pub enum HealthMsg {
    Probe,
}

#[derive(Clone)]
pub struct HealthArgs {
    pub view: Arc<LocalView>,
    pub interval: Duration,
}

pub struct HealthActor;

pub struct HealthState {
    view: Arc<LocalView>,
    /// Aborted on drop, so a killed actor leaves no timer behind.
    timer: AbortOnDropHandle<()>,
}

/// Run one probe against the view and store the result.
pub fn probe_once(view: &LocalView) {
    let table = view.table();
    let result = if view.fenced() {
        Err(ProbeFailure::SelfFenced)
    } else if !view.placement_readable() {
        Err(ProbeFailure::PlacementUnreadable)
    } else {
        Ok(Probe {
            configured_shards: view.shard_count(),
            assigned_shards: table.assigned() as u32,
            local_shards: table.owned_by(view.node()) as u32,
            moving_shards: table.moving() as u32,
            observed_nodes: table.observed_owners() as u32,
        })
    };
    let prev = view.health();
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let next = health::next(&prev, result, now_ms);
    if next.status != prev.status {
        if next.ready {
            tracing::info!(component = "placement", operation = "health_check", node_id = %view.node(), status = next.status.as_str(), "health status changed");
        } else {
            tracing::warn!(component = "placement", operation = "health_check", node_id = %view.node(), status = next.status.as_str(), detail = next.detail, "health status changed");
        }
    }
    view.set_health(next);
}

impl Actor for HealthActor {
    type Msg = HealthMsg;
    type State = HealthState;
    type Arguments = HealthArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<HealthMsg>,
        args: HealthArgs,
    ) -> Result<HealthState, ActorProcessingErr> {
        let timer =
            AbortOnDropHandle::new(myself.send_interval(args.interval, || HealthMsg::Probe));
        Ok(HealthState {
            view: args.view,
            timer,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<HealthMsg>,
        msg: HealthMsg,
        state: &mut HealthState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            HealthMsg::Probe => probe_once(&state.view),
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<HealthMsg>,
        state: &mut HealthState,
    ) -> Result<(), ActorProcessingErr> {
        state.timer.abort();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::NodeId;
    use crate::placement::health::HealthStatus;
    use crate::placement::model::{Epoch, ShardEntry, ShardId, ShardTable};

    #[tokio::test]
    async fn actor_publishes_probes_of_the_view() {
        let view = Arc::new(LocalView::new(
            NodeId::parse("a").unwrap(),
            2,
            Duration::from_secs(60),
        ));
        let (actor, handle) = Actor::spawn(
            None,
            HealthActor,
            HealthArgs {
                view: view.clone(),
                interval: Duration::from_millis(10),
            },
        )
        .await
        .unwrap();
        // Fenced before any heartbeat: unavailable.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while view.health().status != HealthStatus::Unavailable {
            assert!(tokio::time::Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let shards = (0..2)
            .map(|s| ShardEntry {
                shard: ShardId(s),
                owner: Some(NodeId::parse("a").unwrap()),
                epoch: Epoch(1),
                moving_to: None,
                revoke_acked: false,
            })
            .collect();
        view.publish(ShardTable {
            shards,
            nodes: Default::default(),
            manager_term: crate::placement::Term(1),
        });
        view.heartbeat_ok(std::time::Instant::now());
        while view.health().status != HealthStatus::Healthy {
            assert!(tokio::time::Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(view.health().ready);
        actor.stop(None);
        handle.await.unwrap();
    }
}
