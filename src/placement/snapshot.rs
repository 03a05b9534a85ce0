//! The operator's view of placement, as plain data: the snapshot served at
//! `/v1/ops/cluster` and exported as metrics, one summary per node, and how a drain of
//! this node ended. Built by the runtime (`actors::cluster`) and `graviton cluster status`.

use serde::Serialize;

use super::{CounterSnapshot, HealthSnapshot, NodeState, ShardTable, Term};
use crate::ids::NodeId;

/// How `ClusterHandle::drain_self` (`actors::cluster`) ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainEnd {
    /// This node owns no shard.
    Drained,
    /// No other node can take shards (all draining, dead or gone): the shards stay, and
    /// move when a node that can take them appears.
    NoTarget,
    /// The timeout passed first.
    TimedOut,
}

/// One node in the operator snapshot.
#[derive(Clone, Debug, Serialize)]
pub struct NodeSummary {
    pub id: NodeId,
    pub state: NodeState,
    pub shards: usize,
    pub heartbeat_age_ms: i64,
    pub internal_addr: String,
    pub control_addr: String,
}

/// The operator snapshot served at `/v1/ops/cluster` (no tenant or session values).
#[derive(Clone, Debug, Serialize)]
pub struct PlacementSnapshot {
    pub node: NodeId,
    pub health: HealthSnapshot,
    pub configured_shards: u32,
    pub assigned_shards: usize,
    pub local_shards: usize,
    pub moving_shards: usize,
    pub manager_term: Term,
    pub max_epoch: i64,
    pub fenced: bool,
    pub nodes: Vec<NodeSummary>,
    pub counters: CounterSnapshot,
}

/// One summary per node of `table`.
pub fn summarize(table: &ShardTable) -> Vec<NodeSummary> {
    table
        .nodes
        .values()
        .map(|n| NodeSummary {
            id: n.id.clone(),
            state: n.state,
            shards: table.owned_by(&n.id),
            heartbeat_age_ms: n.heartbeat_age_ms,
            internal_addr: n.internal_addr.clone(),
            control_addr: n.control_addr.clone(),
        })
        .collect()
}
