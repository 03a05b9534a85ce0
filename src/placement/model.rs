//! Plain data of the placement model: shards, epochs, node states, the shard table.
//!
//! The [`ShardTable`] is an immutable snapshot indexed by shard; nodes publish a new
//! `Arc<ShardTable>` on every refresh so readers never block writers.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::NodeId;

/// A shard number in `0..shard_count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ShardId(pub u32);

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The ownership generation of one shard; bumped by exactly one on every move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Epoch(pub i64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The manager term: bumped each time a node wins the manager lock. Every manager write
/// is fenced by it (a write under an older term is refused).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Term(pub i64);

impl fmt::Display for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Lifecycle of a node row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    /// Registered, not yet given shards.
    Joining,
    /// Eligible for shards.
    Active,
    /// Being emptied: keeps heartbeating, receives no shards, loses its shards at once.
    Draining,
    /// Declared dead by the manager (heartbeat older than the TTL); must re-register.
    Dead,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Joining => "joining",
            NodeState::Active => "active",
            NodeState::Draining => "draining",
            NodeState::Dead => "dead",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "joining" => NodeState::Joining,
            "active" => NodeState::Active,
            "draining" => NodeState::Draining,
            "dead" => NodeState::Dead,
            _ => return None,
        })
    }

    /// May this node receive shards?
    pub fn accepts_shards(self) -> bool {
        matches!(self, NodeState::Joining | NodeState::Active)
    }
}

/// One node as seen in the `nodes` table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: NodeId,
    pub public_addr: String,
    pub internal_addr: String,
    pub control_addr: String,
    pub version: String,
    pub state: NodeState,
    pub incarnation: i64,
    /// Age of the last heartbeat by the database clock, in milliseconds.
    pub heartbeat_age_ms: i64,
}

/// One row of the shard table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub shard: ShardId,
    /// Current owner; `None` before the first assignment.
    pub owner: Option<NodeId>,
    pub epoch: Epoch,
    /// A move in progress: the owner must stop ingesting and acknowledge.
    pub moving_to: Option<NodeId>,
    /// The owner has acknowledged the revocation (it ingests nothing for this shard).
    pub revoke_acked: bool,
}

/// An immutable snapshot of the whole shard table plus the node rows it refers to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardTable {
    /// Indexed by shard number; `len() == shard_count`.
    pub shards: Vec<ShardEntry>,
    pub nodes: BTreeMap<NodeId, NodeInfo>,
    /// The manager term current when the table was read.
    pub manager_term: Term,
}

impl ShardTable {
    pub fn shard_count(&self) -> u32 {
        self.shards.len() as u32
    }

    pub fn get(&self, shard: ShardId) -> Option<&ShardEntry> {
        self.shards.get(shard.0 as usize)
    }

    /// Shards owned by `node` (including those being moved away).
    pub fn owned_by(&self, node: &NodeId) -> usize {
        self.shards
            .iter()
            .filter(|s| s.owner.as_ref() == Some(node))
            .count()
    }

    /// Shards `node` still holds in a drain: owned by it, or moving to it.
    pub fn held_by(&self, node: &NodeId) -> usize {
        self.shards
            .iter()
            .filter(|s| s.owner.as_ref() == Some(node) || s.moving_to.as_ref() == Some(node))
            .count()
    }

    /// Whether a node other than `node` can take shards (`joining` or `active`): when
    /// none can, a drain of `node` has nowhere to move them and ends at once (every node
    /// of a cluster stopped together).
    pub fn others_take_shards(&self, node: &NodeId) -> bool {
        self.nodes
            .values()
            .any(|n| &n.id != node && n.state.accepts_shards())
    }

    /// Shards with an owner.
    pub fn assigned(&self) -> usize {
        self.shards.iter().filter(|s| s.owner.is_some()).count()
    }

    /// Distinct owners in the table.
    pub fn observed_owners(&self) -> usize {
        let mut owners: Vec<&NodeId> = self
            .shards
            .iter()
            .filter_map(|s| s.owner.as_ref())
            .collect();
        owners.sort();
        owners.dedup();
        owners.len()
    }

    /// Shards being moved right now.
    pub fn moving(&self) -> usize {
        self.shards.iter().filter(|s| s.moving_to.is_some()).count()
    }

    /// Highest epoch of any shard.
    pub fn max_epoch(&self) -> Epoch {
        self.shards
            .iter()
            .map(|s| s.epoch)
            .max()
            .unwrap_or(Epoch(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(shard: u32, owner: Option<&str>, moving_to: Option<&str>) -> ShardEntry {
        let node = |id: &str| NodeId::parse(id.to_string()).unwrap();
        ShardEntry {
            shard: ShardId(shard),
            owner: owner.map(node),
            epoch: Epoch(1),
            moving_to: moving_to.map(node),
            revoke_acked: false,
        }
    }

    #[test]
    fn a_drain_is_done_only_when_no_shard_is_owned_by_or_moving_to_the_node() {
        let a = NodeId::parse("node-a".to_string()).unwrap();
        let mut table = ShardTable {
            shards: vec![
                entry(0, Some("node-a"), Some("node-b")),
                entry(1, Some("node-b"), Some("node-a")),
                entry(2, Some("node-b"), None),
                entry(3, None, None),
            ],
            ..ShardTable::default()
        };
        assert_eq!(table.held_by(&a), 2);
        // The move away is acknowledged and the row changes owner: one left (moving in).
        table.shards[0] = entry(0, Some("node-b"), None);
        assert_eq!(table.held_by(&a), 1);
        table.shards[1] = entry(1, Some("node-b"), None);
        assert_eq!(table.held_by(&a), 0);
    }

    // Checks OPS-9.
    #[test]
    fn a_drain_has_a_target_only_while_another_node_takes_shards() {
        let node = |id: &str, state| {
            let id = NodeId::parse(id.to_string()).unwrap();
            (
                id.clone(),
                NodeInfo {
                    id,
                    public_addr: String::new(),
                    internal_addr: String::new(),
                    control_addr: String::new(),
                    version: String::new(),
                    state,
                    incarnation: 1,
                    heartbeat_age_ms: 0,
                },
            )
        };
        let a = NodeId::parse("node-a".to_string()).unwrap();
        let mut table = ShardTable {
            nodes: [
                node("node-a", NodeState::Draining),
                node("node-b", NodeState::Active),
                node("node-c", NodeState::Draining),
            ]
            .into_iter()
            .collect(),
            ..ShardTable::default()
        };
        assert!(table.others_take_shards(&a));
        table.nodes.insert(
            node("node-b", NodeState::Dead).0,
            node("node-b", NodeState::Dead).1,
        );
        assert!(!table.others_take_shards(&a), "all others draining or dead");
        table.nodes.insert(
            node("node-d", NodeState::Joining).0,
            node("node-d", NodeState::Joining).1,
        );
        assert!(table.others_take_shards(&a), "a joining node takes shards");
        // The draining node itself never counts, whatever its state says.
        table
            .nodes
            .remove(&NodeId::parse("node-d".to_string()).unwrap());
        table.nodes.insert(
            node("node-a", NodeState::Active).0,
            node("node-a", NodeState::Active).1,
        );
        assert!(!table.others_take_shards(&a));
    }
}
