//! Handoff rules: who may ingest, when an owner acknowledges, when a move completes.
//!
//! The protocol (full text in `docs/locality.md`) guarantees that at most one node ingests
//! a session at any instant:
//! 1. The manager never rewrites the owner of a shard whose owner is alive. It first sets
//!    `moving_to` (a *revocation*), which makes [`may_ingest`] false on the owner as soon as
//!    the owner sees the row.
//! 2. The owner acknowledges ([`should_ack`]) once it has seen the revocation and no
//!    ingest permit for the shard is in flight. Permits issued before the revocation stay
//!    valid for the *handoff grace* after the owner first saw it ([`permit_valid`]), so
//!    uploads in flight can finish; past the grace they are revoked. The grace never
//!    outlives the fence: a fenced node's permits are revoked at once.
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

/// Is an ingest permit issued at `epoch` still valid? `in_grace`: the shard's revocation
/// was first seen by this node less than the handoff grace ago.
pub fn permit_valid(
    entry: Option<&ShardEntry>,
    me: &NodeId,
    epoch: Epoch,
    fenced: bool,
    in_grace: bool,
) -> bool {
    entry.is_some_and(|e| {
        !fenced
            && e.owner.as_ref() == Some(me)
            && e.epoch == epoch
            && (e.moving_to.is_none() || in_grace)
    })
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
            owner: owner.map(|o| NodeId::parse(o).unwrap()),
            epoch: Epoch(7),
            moving_to: moving.map(|o| NodeId::parse(o).unwrap()),
            revoke_acked: acked,
        }
    }

    #[test]
    fn only_the_settled_owner_at_the_current_epoch_ingests() {
        let a = NodeId::parse("a").unwrap();
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
    fn running_permits_survive_a_revocation_only_within_the_grace_and_never_a_fence() {
        let a = NodeId::parse("a").unwrap();
        let moving = entry(Some("a"), Some("b"), false);
        assert!(permit_valid(Some(&moving), &a, Epoch(7), false, true));
        assert!(!permit_valid(Some(&moving), &a, Epoch(7), false, false));
        assert!(
            !permit_valid(Some(&moving), &a, Epoch(7), true, true),
            "fenced"
        );
        assert!(
            !permit_valid(Some(&moving), &a, Epoch(6), false, true),
            "old epoch"
        );
        assert!(!may_ingest(&moving, &a, Epoch(7), false), "no new ingest");
        let settled = entry(Some("a"), None, false);
        assert!(permit_valid(Some(&settled), &a, Epoch(7), false, false));
    }

    #[test]
    fn ack_waits_for_in_flight_ingest() {
        let a = NodeId::parse("a").unwrap();
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
            from: Some(NodeId::parse("a").unwrap()),
            to: NodeId::parse("b").unwrap(),
            forced: true,
        };
        let e = entry(Some("a"), None, false);
        assert_eq!(
            action_for(&e, &mv, Some(NodeState::Draining)),
            Action::Revoke {
                to: NodeId::parse("b").unwrap()
            }
        );
        assert_eq!(
            action_for(&e, &mv, Some(NodeState::Dead)),
            Action::AssignNow {
                to: NodeId::parse("b").unwrap()
            }
        );
        assert_eq!(
            action_for(&entry(None, None, false), &mv, None),
            Action::AssignNow {
                to: NodeId::parse("b").unwrap()
            }
        );
        let back = Move {
            to: NodeId::parse("a").unwrap(),
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

    /// A model of the protocol on one shard with three nodes, explored by proptest: every
    /// interleaving of stale views, permits, acknowledgements, manager moves, completions,
    /// self-fencing, death and rejoin keeps at most one node with ingest in flight.
    mod model_check {
        use super::*;
        use proptest::prelude::*;

        const NODES: usize = 3;

        #[derive(Clone, Debug)]
        enum Step {
            Refresh(usize),
            Acquire(usize),
            Release(usize),
            Ack(usize),
            Plan(usize),
            Complete,
            Fence(usize),
            DeclareDead(usize),
            Rejoin(usize),
        }

        fn step() -> impl Strategy<Value = Step> {
            let n = 0..NODES;
            prop_oneof![
                4 => n.clone().prop_map(Step::Refresh),
                4 => n.clone().prop_map(Step::Acquire),
                3 => n.clone().prop_map(Step::Release),
                3 => n.clone().prop_map(Step::Ack),
                3 => n.clone().prop_map(Step::Plan),
                3 => Just(Step::Complete),
                1 => n.clone().prop_map(Step::Fence),
                1 => n.clone().prop_map(Step::DeclareDead),
                1 => n.prop_map(Step::Rejoin),
            ]
        }

        fn id(i: usize) -> NodeId {
            NodeId::parse(format!("n{i}")).unwrap()
        }

        struct World {
            db: ShardEntry,
            state: [NodeState; NODES],
            view: [ShardEntry; NODES],
            in_flight: [usize; NODES],
            fenced: [bool; NODES],
        }

        impl World {
            fn new() -> Self {
                let empty = ShardEntry {
                    shard: crate::placement::model::ShardId(0),
                    owner: None,
                    epoch: Epoch(0),
                    moving_to: None,
                    revoke_acked: false,
                };
                Self {
                    db: empty.clone(),
                    state: [NodeState::Active; NODES],
                    view: [empty.clone(), empty.clone(), empty],
                    in_flight: [0; NODES],
                    fenced: [false; NODES],
                }
            }

            fn state_of(&self, node: &Option<NodeId>) -> Option<NodeState> {
                node.as_ref()
                    .and_then(|n| (0..NODES).find(|i| id(*i) == *n))
                    .map(|i| self.state[i])
            }

            fn apply(&mut self, step: &Step) {
                match *step {
                    Step::Refresh(i) => {
                        // A dead node learns it is dead on its next heartbeat; model: it
                        // cannot refresh its way back without rejoining.
                        if self.state[i] != NodeState::Dead {
                            self.view[i] = self.db.clone();
                        }
                    }
                    Step::Acquire(i) => {
                        let v = &self.view[i];
                        if may_ingest(v, &id(i), v.epoch, self.fenced[i]) {
                            self.in_flight[i] += 1;
                        }
                    }
                    Step::Release(i) => self.in_flight[i] = self.in_flight[i].saturating_sub(1),
                    Step::Ack(i) => {
                        let v = &self.view[i];
                        let db = &self.db;
                        if should_ack(v, &id(i), self.in_flight[i])
                            && db.owner == v.owner
                            && db.epoch == v.epoch
                            && db.moving_to.is_some()
                            && self.state[i] != NodeState::Dead
                        {
                            self.db.revoke_acked = true;
                        }
                    }
                    Step::Plan(to) => {
                        if !self.state[to].accepts_shards() {
                            return;
                        }
                        let planned = Move {
                            shard: self.db.shard,
                            from: self.db.owner.clone(),
                            to: id(to),
                            forced: false,
                        };
                        match action_for(&self.db, &planned, self.state_of(&self.db.owner)) {
                            Action::AssignNow { to } => {
                                self.db.owner = Some(to);
                                self.db.epoch = Epoch(self.db.epoch.0 + 1);
                                self.db.moving_to = None;
                                self.db.revoke_acked = false;
                            }
                            Action::Revoke { to } => self.db.moving_to = Some(to),
                            Action::Cancel => {
                                self.db.moving_to = None;
                                self.db.revoke_acked = false;
                            }
                        }
                    }
                    Step::Complete => {
                        let owner_state = self.state_of(&self.db.owner);
                        let target_state = self.state_of(&self.db.moving_to);
                        if may_complete(&self.db, owner_state, target_state) {
                            self.db.owner = self.db.moving_to.take();
                            self.db.epoch = Epoch(self.db.epoch.0 + 1);
                            self.db.revoke_acked = false;
                        }
                    }
                    Step::Fence(i) => {
                        // Self-fence: no new permits; in-flight ingest is aborted within the
                        // node_ttl - self_fence margin (modelled as immediate).
                        self.fenced[i] = true;
                        self.in_flight[i] = 0;
                    }
                    Step::DeclareDead(i) => {
                        // node_ttl > self_fence: only an already fenced node can be dead.
                        if self.fenced[i] {
                            self.state[i] = NodeState::Dead;
                        }
                    }
                    Step::Rejoin(i) => {
                        if self.state[i] == NodeState::Dead {
                            // Re-register (joining), read the table, then unfence.
                            self.state[i] = NodeState::Joining;
                            self.view[i] = self.db.clone();
                            self.fenced[i] = false;
                        } else if self.fenced[i] {
                            // Heartbeats resumed before the TTL: unfence.
                            self.fenced[i] = false;
                        }
                    }
                }
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
            #[test]
            fn at_most_one_node_ingests(steps in proptest::collection::vec(step(), 1..80)) {
                let mut world = World::new();
                for s in &steps {
                    world.apply(s);
                    let busy = world.in_flight.iter().filter(|c| **c > 0).count();
                    prop_assert!(busy <= 1, "after {:?}: in flight {:?}", s, world.in_flight);
                }
            }
        }
    }
}
