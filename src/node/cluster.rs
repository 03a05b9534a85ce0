//! Cluster-mode glue: the adapters that connect placement, the control plane and the
//! internal listener to this node's ingest path.
//!
//! - [`PlacementEpochs`]: the owner-side epoch check of forwarded uploads.
//! - [`NodeIngest`]: owner-local ingest of a forwarded upload (same path as a direct one).
//! - [`PlacementResolver`]: re-resolution after a stale epoch (refresh the table, look again).
//! - [`NodeControl`]: answers control-plane requests from peers.
//! - [`keep_peers_current`]: feeds the control transport with the PostgreSQL node table.
//!
//! PostgreSQL stays the source of truth: control messages are hints, and every decision
//! here reads the local placement view.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::control::envelope::{HotStateSnapshot, OwnerReply, Reply, ReplyErrorCode, SessionPhase};
use crate::control::{ControlHandler, ControlTransport, Envelope};
use crate::http::forward::{OwnerResolver, OwnerTarget, StaleEpoch};
use crate::http::internal::{EpochCheck, EpochVerdict, IngestRequest, OwnerIngest};
use crate::http::{ApiError, AppState};
use crate::ids::{NodeId, SessionKey};
use crate::placement::{ClusterHandle, Epoch, Owner, ShardId};
use crate::session::{HotSnapshot, Phase};

/// Owner-side check of the epoch a forwarder routed by.
pub struct PlacementEpochs(pub Arc<ClusterHandle>);

impl EpochCheck for PlacementEpochs {
    fn check(&self, key: &SessionKey, shard: u32, epoch: u64) -> EpochVerdict {
        let cluster = &self.0;
        let stale = || {
            let current = cluster.resolve(key).ok();
            EpochVerdict::Stale {
                current_owner: current.as_ref().map(|o| o.node.clone()),
                current_epoch: current.map(|o| o.epoch.0.max(0) as u64).unwrap_or(0),
            }
        };
        if cluster.shard_of(key) != ShardId(shard) || epoch > i64::MAX as u64 {
            return stale();
        }
        if cluster.can_ingest(ShardId(shard), Epoch(epoch as i64)) {
            EpochVerdict::Current
        } else {
            stale()
        }
    }
}

/// Owner-local ingest of a forwarded upload.
pub struct NodeIngest(pub Arc<AppState>);

impl OwnerIngest for NodeIngest {
    fn ingest(
        &self,
        request: IngestRequest,
    ) -> BoxFuture<'static, Result<serde_json::Value, ApiError>> {
        let app = self.0.clone();
        Box::pin(async move {
            let route = crate::http::upload::LocalRoute {
                key: request.key,
                shard: ShardId(request.shard),
                epoch: Epoch(request.epoch as i64),
            };
            // The pre-flight's admission, when it is still parked; without one (an older
            // forwarder, or a reservation that expired) the ingest admits itself.
            let admitted = request
                .reservation
                .as_deref()
                .and_then(|id| app.admission.adopt(id, &reservation_tag(&request.key)));
            let report = crate::http::upload::ingest_owned(
                &app,
                Some(route),
                admitted,
                request.content_length,
                request.body,
            )
            .await?;
            serde_json::to_value(crate::http::upload::response_body(&app, &report))
                .map_err(|e| ApiError::internal(format!("encode response: {e}")))
        })
    }

    fn reserve(&self, key: &SessionKey) -> BoxFuture<'static, Result<Option<String>, ApiError>> {
        let app = self.0.clone();
        let key = *key;
        Box::pin(async move {
            let permit = crate::http::admission::admit_forwarded(&app, key.tenant).await?;
            Ok(Some(app.admission.park(permit, reservation_tag(&key))))
        })
    }

    fn discard(&self, key: &SessionKey, reservation: &str) {
        self.0.admission.discard(reservation, &reservation_tag(key));
    }
}

/// A parked admission is bound to its session.
fn reservation_tag(key: &SessionKey) -> String {
    format!("{}/{}", key.tenant, key.session)
}

/// Target of a forwarded upload for a resolved owner.
pub fn target_of(owner: &Owner) -> Result<OwnerTarget, ApiError> {
    let internal_addr: SocketAddr = owner.internal_addr.parse().map_err(|_| {
        ApiError::unavailable(
            "owner_unavailable",
            "the session's owner has no reachable internal address",
        )
        .with_retry_after(Duration::from_secs(1))
    })?;
    Ok(OwnerTarget {
        node: owner.node.clone(),
        internal_addr,
        shard: owner.shard.0,
        epoch: owner.epoch.0.max(0) as u64,
    })
}

/// Map a placement resolution failure.
pub fn unresolved(err: crate::placement::ResolveError) -> ApiError {
    ApiError::unavailable(
        "placement_unavailable",
        format!("no owner for this session right now: {err}"),
    )
    .with_retry_after(Duration::from_secs(1))
}

/// Re-resolution after a stale epoch: ask for a fresh table, wait briefly for it, look again.
pub struct PlacementResolver(pub Arc<ClusterHandle>);

impl OwnerResolver for PlacementResolver {
    fn re_resolve<'a>(
        &'a self,
        key: &'a SessionKey,
        stale: &'a StaleEpoch,
    ) -> BoxFuture<'a, Result<OwnerTarget, ApiError>> {
        Box::pin(async move {
            let cluster = &self.0;
            let mut changes = cluster.subscribe();
            changes.borrow_and_update();
            let before = cluster.resolve(key).ok();
            let already_newer = matches!((&before, stale.current_epoch), (Some(o), Some(e)) if o.epoch.0 >= e as i64 && e > 0);
            if !already_newer {
                cluster.refresh();
                let _ = tokio::time::timeout(Duration::from_secs(2), changes.changed()).await;
            }
            let owner = cluster.resolve(key).map_err(unresolved)?;
            target_of(&owner)
        })
    }
}

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
