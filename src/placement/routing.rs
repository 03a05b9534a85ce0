//! The routing port: where an upload session's bytes go, as this node sees it, and the
//! owner-side answer to "may I ingest this forwarded upload at this epoch?".
//!
//! Typed with [`ShardId`] and [`Epoch`] end to end; owner addresses are parsed once, when
//! the table is published (see [`LocalView`](super::LocalView)).
//!
//! # Which check binds (LOC-1)
//! Three checks look at the same ownership, and only the last one binds:
//! 1. [`LocalView::route`] and [`LocalView::check_forwarded`] read the local table.
//!    They are advice: they keep a doomed upload from starting, and name the current owner
//!    to a forwarder that routed by an old epoch.
//! 2. [`LocalView::begin_ingest`] issues the ingest permit, which a revocation cancels.
//! 3. The commit: the manifest is written only if `(shard, node, epoch)` still holds in
//!    the store's commit transaction (`storage::manifest::CommitFence`). A node that lost
//!    its shard between 2 and 3 gets `StoreError::Fenced` and nothing becomes visible.

use std::net::SocketAddr;
use std::time::Duration;

use super::{Epoch, LocalView, ResolveError, ShardId};
use crate::ids::{NodeId, SessionKey};

/// How long a re-resolution waits for a fresher table after a stale epoch.
pub const RE_RESOLVE_WAIT: Duration = Duration::from_secs(2);

/// A session upload that this node owns: the session and the shard epoch it was routed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalRoute {
    pub key: SessionKey,
    pub shard: ShardId,
    pub epoch: Epoch,
}

/// Where to forward an upload owned by another node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerTarget {
    pub node: NodeId,
    /// The owner's internal listener.
    pub internal_addr: SocketAddr,
    pub shard: ShardId,
    /// The shard epoch this route was resolved at.
    pub epoch: Epoch,
}

/// Where an upload of a session goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// This node owns the session's shard: ingest here.
    Local(LocalRoute),
    /// Another node owns it: stream the body there.
    Remote(OwnerTarget),
}

/// Why a session has no route right now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    Unresolved(#[from] ResolveError),
    #[error("the session's owner {0} has no reachable internal address")]
    NoInternalAddr(NodeId),
}

/// What the owner said when it refused a stale epoch (as the forwarder saw it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleEpoch {
    pub refused_by: NodeId,
    pub current_owner: Option<NodeId>,
    pub current_epoch: Option<Epoch>,
}

/// The owner-side verdict on the epoch a forwarder routed by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EpochVerdict {
    /// This node owns the shard at this epoch: ingest may start (the commit still binds).
    Current,
    /// The caller routed by an old epoch, or this node no longer owns the shard.
    Stale {
        current_owner: Option<NodeId>,
        current_epoch: Epoch,
    },
}

impl LocalView {
    /// Route an upload of `key` by the local table (no I/O).
    pub fn route(&self, key: &SessionKey) -> Result<Route, RouteError> {
        let owner = self.resolve(key)?;
        if owner.is_local {
            return Ok(Route::Local(LocalRoute {
                key: *key,
                shard: owner.shard,
                epoch: owner.epoch,
            }));
        }
        target_of(owner).map(Route::Remote)
    }

    /// Owner side of a forwarded upload: does this node own `key`'s shard at `epoch`? An
    /// advisory check (see the module docs); the commit fence binds.
    pub fn check_forwarded(&self, key: &SessionKey, shard: ShardId, epoch: Epoch) -> EpochVerdict {
        if self.shard_of(key) == shard && self.can_ingest(shard, epoch) {
            return EpochVerdict::Current;
        }
        let current = self.resolve(key).ok();
        EpochVerdict::Stale {
            current_owner: current.as_ref().map(|o| o.node.clone()),
            current_epoch: current.map_or(Epoch(0), |o| o.epoch),
        }
    }
}

/// Where to forward to `owner`, or why it cannot be reached.
pub fn target_of(owner: super::Owner) -> Result<OwnerTarget, RouteError> {
    let internal_addr = owner
        .internal_addr
        .ok_or_else(|| RouteError::NoInternalAddr(owner.node.clone()))?;
    Ok(OwnerTarget {
        node: owner.node,
        internal_addr,
        shard: owner.shard,
        epoch: owner.epoch,
    })
}
