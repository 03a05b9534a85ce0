//! Handoff rules: who may ingest, when an owner acknowledges, when a move completes.
//!
//! The protocol (full text in `docs/locality.md`) guarantees that at most one node ingests
//! a session at any instant:
//! 1. The manager never rewrites the owner of a shard whose owner is alive. It first sets
//!    `moving_to` (a *revocation*), which makes [`may_ingest`] false on the owner as soon as
//!    the owner sees the row.
//! 2. The owner acknowledges ([`should_ack`]) once it has seen the revocation and no
//!    ingest permit for the shard is in flight.
//! 3. The manager completes the move (owner := target, `epoch + 1`) only after the ack, or
//!    when the owner has been declared dead, which happens only after its heartbeat is older
//!    than `node_ttl > self_fence`, so the old owner has already fenced itself.

use crate::ids::NodeId;
use crate::placement::model::{Epoch, NodeState, ShardEntry};
use crate::placement::rebalance::Move;

/// May `me` admit a new ingest for this shard at `epoch`, given the local table entry and
/// whether the node is self-fenced?
pub fn may_ingest(entry: &ShardEntry, me: &NodeId, epoch: Epoch, fenced: bool) -> bool {
    !fenced && entry.owner.as_ref() == Some(me) && entry.epoch == epoch && entry.moving_to.is_none()
}

/// Is an ingest permit issued at `epoch` still valid?
pub fn permit_valid(entry: Option<&ShardEntry>, me: &NodeId, epoch: Epoch, fenced: bool) -> bool {
    entry.is_some_and(|e| may_ingest(e, me, epoch, fenced))
}

/// Should `me` acknowledge the revocation of this shard now?
pub fn should_ack(entry: &ShardEntry, me: &NodeId, in_flight: usize) -> bool {
    entry.owner.as_ref() == Some(me)
        && entry.moving_to.is_some()
        && !entry.revoke_acked
        && in_flight == 0
}

/// The shard's owner as the planner should count it: the target of a move in progress.
pub fn effective_owner(entry: &ShardEntry) -> Option<NodeId> {
    entry.moving_to.clone().or_else(|| entry.owner.clone())
}

/// May the manager complete the move in progress on this shard? `owner_state` is the state
/// of the current owner (`None`: unknown node).
pub fn may_complete(
    entry: &ShardEntry,
    owner_state: Option<NodeState>,
    target_state: Option<NodeState>,
) -> bool {
    let target_ok = target_state.is_some_and(NodeState::accepts_shards);
    let owner_gone = !matches!(
        owner_state,
        Some(NodeState::Joining | NodeState::Active | NodeState::Draining)
    );
    entry.moving_to.is_some() && target_ok && (entry.revoke_acked || owner_gone)
}

/// What the manager writes for one planned move.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// No live owner: assign directly (`epoch + 1`).
    AssignNow { to: NodeId },
    /// Live owner: request revocation towards `to` (or retarget a move in progress).
    Revoke { to: NodeId },
    /// The planner wants the shard back on its current owner: cancel the move.
    Cancel,
}

/// Translate a planned move into a write, given the shard row and its owner's state.
pub fn action_for(entry: &ShardEntry, planned: &Move, owner_state: Option<NodeState>) -> Action {
    let owner_alive = matches!(
        owner_state,
        Some(NodeState::Joining | NodeState::Active | NodeState::Draining)
    );
    match &entry.owner {
        Some(owner) if owner_alive => {
            if *owner == planned.to {
                Action::Cancel
            } else {
                Action::Revoke {
                    to: planned.to.clone(),
                }
            }
        }
        _ => Action::AssignNow {
            to: planned.to.clone(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::model::ShardId;

    fn entry(owner: Option<&str>, moving: Option<&str>, acked: bool) -> ShardEntry {
        ShardEntry {
            shard: ShardId(3),
            owner: owner.map(|o| NodeId(o.into())),
            epoch: Epoch(7),
            moving_to: moving.map(|o| NodeId(o.into())),
            revoke_acked: acked,
        }
    }

    #[test]
    fn only_the_settled_owner_at_the_current_epoch_ingests() {
        let a = NodeId("a".into());
        assert!(may_ingest(
            &entry(Some("a"), None, false),
            &a,
            Epoch(7),
            false
        ));
        assert!(!may_ingest(
            &entry(Some("a"), None, false),
            &a,
            Epoch(6),
            false
        ));
        assert!(!may_ingest(
            &entry(Some("a"), None, false),
            &a,
            Epoch(7),
            true
        ));
        assert!(!may_ingest(
            &entry(Some("a"), Some("b"), false),
            &a,
            Epoch(7),
            false
        ));
        assert!(!may_ingest(
            &entry(Some("b"), None, false),
            &a,
            Epoch(7),
            false
        ));
        assert!(!may_ingest(&entry(None, None, false), &a, Epoch(7), false));
    }

    #[test]
    fn ack_waits_for_in_flight_ingest() {
        let a = NodeId("a".into());
        let e = entry(Some("a"), Some("b"), false);
        assert!(!should_ack(&e, &a, 1));
        assert!(should_ack(&e, &a, 0));
        assert!(!should_ack(&entry(Some("a"), Some("b"), true), &a, 0));
        assert!(!should_ack(&entry(Some("a"), None, false), &a, 0));
    }

    #[test]
    fn completion_needs_ack_or_dead_owner_and_an_eligible_target() {
        let moving = entry(Some("a"), Some("b"), false);
        assert!(!may_complete(
            &moving,
            Some(NodeState::Active),
            Some(NodeState::Active)
        ));
        assert!(!may_complete(
            &moving,
            Some(NodeState::Draining),
            Some(NodeState::Active)
        ));
        assert!(may_complete(
            &moving,
            Some(NodeState::Dead),
            Some(NodeState::Active)
        ));
        let acked = entry(Some("a"), Some("b"), true);
        assert!(may_complete(
            &acked,
            Some(NodeState::Draining),
            Some(NodeState::Joining)
        ));
        assert!(!may_complete(
            &acked,
            Some(NodeState::Draining),
            Some(NodeState::Draining)
        ));
        assert!(!may_complete(
            &entry(Some("a"), None, false),
            Some(NodeState::Dead),
            None
        ));
    }

    #[test]
    fn live_owners_are_revoked_never_overwritten() {
        let mv = Move {
            shard: ShardId(3),
            from: Some(NodeId("a".into())),
            to: NodeId("b".into()),
            forced: true,
        };
        let e = entry(Some("a"), None, false);
        assert_eq!(
            action_for(&e, &mv, Some(NodeState::Draining)),
            Action::Revoke {
                to: NodeId("b".into())
            }
        );
        assert_eq!(
            action_for(&e, &mv, Some(NodeState::Dead)),
            Action::AssignNow {
                to: NodeId("b".into())
            }
        );
        assert_eq!(
            action_for(&entry(None, None, false), &mv, None),
            Action::AssignNow {
                to: NodeId("b".into())
            }
        );
        let back = Move {
            to: NodeId("a".into()),
            ..mv
        };
        assert_eq!(
            action_for(
                &entry(Some("a"), Some("c"), false),
                &back,
                Some(NodeState::Active)
            ),
            Action::Cancel
        );
    }
}
