//! Cluster-mode glue with the peers: placement, the control plane and this node's sessions.
//!
//! - [`NodeControl`]: answers control-plane requests from peers.
//! - [`keep_peers_current`]: feeds the control transport with the PostgreSQL node table.
//! - [`release_lost_sessions`]: stops the session owners of shards this node lost.
//!
//! Routing and the owner-side epoch check are placement's (`placement::routing`), and
//! forwarded uploads are ingested by the same `upload::UploadService` as direct ones.
//!
//! PostgreSQL stays the source of truth: control messages are hints, and every decision
//! here reads the local placement view.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::actors::ClusterHandle;
use crate::control::envelope::{HotStateSnapshot, OwnerReply, Reply, ReplyErrorCode, SessionPhase};
use crate::control::{ControlHandler, ControlTransport, Envelope};
use crate::edge::AppState;
use crate::ids::{NodeId, SessionKey};
use crate::placement::ShardId;
use crate::session::{HotSnapshot, Phase};

/// Answers control requests from peers.
pub struct NodeControl {
    pub app: Arc<AppState>,
    pub internal_addr: SocketAddr,
}

fn hot_state(snapshot: HotSnapshot) -> HotStateSnapshot {
    HotStateSnapshot {
        phase: match snapshot.phase {
            Phase::Idle => SessionPhase::Idle,
            Phase::Receiving => SessionPhase::Receiving,
        },
        bytes_seen: snapshot.bytes_seen,
        frames_seen: snapshot.frames_seen,
        uploads_completed: snapshot.uploads_completed,
        uploads_failed: snapshot.uploads_failed,
        started_at_ms: snapshot.started_at_ms,
        last_activity_ms: snapshot.last_activity_ms.max(snapshot.started_at_ms),
    }
}

impl ControlHandler for NodeControl {
    fn handle(&self, request: Envelope) -> BoxFuture<'_, Reply> {
        Box::pin(async move {
            let cluster = &self.app.cluster;
            match request {
                Envelope::ResolveSession(req) | Envelope::ActivateSession(req) => {
                    let key = req.key();
                    let owner = match cluster.resolve(&key) {
                        Ok(owner) => owner,
                        Err(err) => {
                            return Reply::Error {
                                code: ReplyErrorCode::Unavailable,
                                message: err.to_string(),
                            };
                        }
                    };
                    if !owner.is_local {
                        return Reply::Error {
                            code: ReplyErrorCode::NotOwner,
                            message: format!("owned by {} at epoch {}", owner.node, owner.epoch.0),
                        };
                    }
                    let hot = self
                        .app
                        .sessions
                        .snapshot(key)
                        .await
                        .ok()
                        .flatten()
                        .map(hot_state);
                    Reply::Owner(OwnerReply {
                        owner: owner.node,
                        owner_internal_addr: self.internal_addr,
                        shard_epoch: owner.epoch.0.max(0) as u64,
                        hot_state: hot,
                    })
                }
                Envelope::AssignmentChanged { .. } => {
                    cluster.refresh();
                    Reply::Ack
                }
                Envelope::Drain { node } => {
                    cluster.refresh();
                    tracing::info!(%node, "peer announced a drain");
                    Reply::Ack
                }
            }
        })
    }
}

/// Keep the control transport's peer list equal to the node table (every `every`).
pub async fn keep_peers_current(
    cluster: Arc<ClusterHandle>,
    transport: Arc<dyn ControlTransport>,
    every: Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut last: Vec<(NodeId, SocketAddr)> = Vec::new();
    loop {
        let mut peers: Vec<(NodeId, SocketAddr)> = cluster
            .snapshot()
            .nodes
            .into_iter()
            .filter(|n| &n.id != cluster.node_id())
            .filter_map(|n| n.control_addr.parse().ok().map(|addr| (n.id, addr)))
            .collect();
        peers.sort();
        if peers != last {
            transport.set_peers(peers.clone());
            last = peers;
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// Stop the session owners of shards this node no longer owns, whenever the table changes.
pub async fn release_lost_sessions(
    cluster: Arc<ClusterHandle>,
    sessions: crate::actors::SessionRegionHandle,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut changes = cluster.subscribe();
    // The view changes on every heartbeat; scan the sessions only when the set of owned
    // shards changed, or again shortly after a scan that had to leave uploads running.
    let mut last: Option<std::collections::HashSet<ShardId>> = None;
    let mut pending = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(Duration::from_millis(500)), if pending => {}
        }
        let owned: std::collections::HashSet<ShardId> =
            cluster.owned_shards().into_iter().collect();
        if !pending && last.as_ref() == Some(&owned) {
            continue;
        }
        last = Some(owned.clone());
        let probe = cluster.clone();
        let filter = Box::new(move |key: &SessionKey| !owned.contains(&probe.shard_of(key)));
        match sessions.stop_matching(filter).await {
            Ok(report) => {
                pending = report.still_uploading > 0;
                if report.stopped > 0 {
                    tracing::info!(
                        stopped = report.stopped,
                        still_uploading = report.still_uploading,
                        "stopped session owners of shards this node lost"
                    )
                }
            }
            Err(err) => {
                pending = true;
                tracing::debug!(error = %err, "could not release session owners")
            }
        }
    }
}
