//! The placement store against real PostgreSQL: bootstrap, shard-count fencing, manager
//! term fencing, heartbeats by the database clock, revocation acknowledgements.

#[allow(unused_imports)]
mod support;

use std::time::Duration;

use graviton::ids::NodeId;
use graviton::placement::{Epoch, NodeState, ShardId};
use graviton::storage::pg::PlacementStoreError;
use graviton::storage::pg::placement::NodeRegistration;
use support::TestDatabase;

fn registration(id: &str) -> NodeRegistration {
    NodeRegistration {
        id: NodeId::parse(id).unwrap(),
        public_addr: format!("{id}:1"),
        internal_addr: format!("{id}:2"),
        control_addr: format!("{id}:3"),
        version: "test".into(),
        // Each call stands for a new process.
        process: NodeRegistration::new_process_token(),
    }
}

#[tokio::test]
async fn bootstrap_is_idempotent_and_shard_count_is_fixed() {
    let Some(db) = TestDatabase::create("bootstrap_is_idempotent_and_shard_count_is_fixed").await
    else {
        return;
    };
    let store = support::placement::store(db.url()).await;
    assert_eq!(store.bootstrap(64).await.unwrap().shard_count, 64);
    assert_eq!(store.bootstrap(64).await.unwrap().shard_count, 64);
    let err = store.bootstrap(128).await.unwrap_err();
    assert!(
        matches!(
            err,
            PlacementStoreError::ShardCountMismatch {
                configured: 128,
                stored: 64
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("cluster.shard_count"), "{err}");
    assert_eq!(store.read_table().await.unwrap().shards.len(), 64);
}

#[tokio::test]
async fn zombie_manager_writes_are_refused() {
    let Some(db) = TestDatabase::create("zombie_manager_writes_are_refused").await else {
        return;
    };
    let store = support::placement::store(db.url()).await;
    store.bootstrap(8).await.unwrap();
    store.register_node(&registration("a")).await.unwrap();
    let old = store
        .bump_term(&NodeId::parse("m1").unwrap())
        .await
        .unwrap();
    let new = store
        .bump_term(&NodeId::parse("m2").unwrap())
        .await
        .unwrap();
    assert_eq!(new.0, old.0 + 1);

    // The old manager's write is refused outright.
    let err = store
        .fenced(old)
        .await
        .err()
        .expect("old term must be fenced");
    assert!(
        matches!(err, PlacementStoreError::Fenced { held, current } if held == old && current == new),
        "{err}"
    );
    let err = graviton::actors::shard_manager::run_round(&store, old, 1000, 8)
        .await
        .unwrap_err();
    assert!(matches!(err, PlacementStoreError::Fenced { .. }));

    // A write that passed the check holds the term: a concurrent bump waits for it, and
    // afterwards the same term is refused.
    let mut tx = store.fenced(new).await.unwrap();
    let epoch = tx
        .assign_now(ShardId(0), Epoch(0), &NodeId::parse("a").unwrap())
        .await
        .unwrap();
    assert_eq!(epoch, Some(Epoch(1)));
    let store2 = store.clone();
    let bump = tokio::spawn(async move {
        store2
            .bump_term(&NodeId::parse("m3").unwrap())
            .await
            .unwrap()
    });
    // Wait until PostgreSQL reports the bump blocked on a lock, then check it is still
    // pending: it cannot finish before the fenced transaction ends.
    let since = std::time::Instant::now();
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE 'UPDATE placement_meta SET manager_term%'",
        )
        .fetch_one(store.pool())
        .await
        .unwrap();
        if waiting == 1 {
            break;
        }
        assert!(
            !bump.is_finished(),
            "the term bump must wait for the fenced transaction"
        );
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "the term bump never blocked"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !bump.is_finished(),
        "the term bump must wait for the fenced transaction"
    );
    tx.commit("shards").await.unwrap();
    let newest = bump.await.unwrap();
    assert_eq!(newest.0, new.0 + 1);
    assert!(matches!(
        store.fenced(new).await,
        Err(PlacementStoreError::Fenced { .. })
    ));

    // Epochs only move forward through the conditional update.
    let mut tx = store.fenced(newest).await.unwrap();
    assert_eq!(
        tx.assign_now(ShardId(0), Epoch(0), &NodeId::parse("a").unwrap())
            .await
            .unwrap(),
        None,
        "stale epoch"
    );
    assert_eq!(
        tx.assign_now(ShardId(0), Epoch(1), &NodeId::parse("a").unwrap())
            .await
            .unwrap(),
        Some(Epoch(2))
    );
    tx.commit("shards").await.unwrap();
    let table = store.read_table().await.unwrap();
    assert_eq!(table.shards[0].epoch, Epoch(2));
    assert_eq!(table.manager_term, newest);
}

#[tokio::test]
async fn heartbeats_use_the_database_clock_and_dead_nodes_must_reregister() {
    let Some(db) =
        TestDatabase::create("heartbeats_use_the_database_clock_and_dead_nodes_must_reregister")
            .await
    else {
        return;
    };
    let store = support::placement::store(db.url()).await;
    store.bootstrap(8).await.unwrap();
    let a = NodeId::parse("a").unwrap();
    let first = registration("a");
    let inc = store.register_node(&first).await.unwrap();
    assert_eq!(
        store.heartbeat(&first, inc).await.unwrap(),
        Some(NodeState::Joining)
    );
    assert_eq!(
        store.heartbeat(&first, inc + 7).await.unwrap(),
        None,
        "other incarnation"
    );
    // Age it by the database clock, then the manager declares it dead.
    sqlx::query("UPDATE placement_nodes SET heartbeat_at = now() - interval '10 seconds'")
        .execute(store.pool())
        .await
        .unwrap();
    let term = store.bump_term(&NodeId::parse("m").unwrap()).await.unwrap();
    let mut tx = store.fenced(term).await.unwrap();
    assert!(tx.mark_dead_if_silent(&a, 5_000).await.unwrap());
    tx.commit("nodes").await.unwrap();
    assert_eq!(
        store.heartbeat(&first, inc).await.unwrap(),
        None,
        "a dead node's heartbeat is refused"
    );
    let second = registration("a");
    let inc2 = store.register_node(&second).await.unwrap();
    assert_eq!(inc2, inc + 1);
    assert_eq!(
        store.heartbeat(&second, inc2).await.unwrap(),
        Some(NodeState::Joining)
    );
    let nodes = store.nodes().await.unwrap();
    assert!(nodes[&a].heartbeat_age_ms < 5_000);
}

#[tokio::test]
async fn acknowledgement_is_bound_to_owner_epoch_and_incarnation() {
    let Some(db) =
        TestDatabase::create("acknowledgement_is_bound_to_owner_epoch_and_incarnation").await
    else {
        return;
    };
    let store = support::placement::store(db.url()).await;
    store.bootstrap(4).await.unwrap();
    let (a, b) = (NodeId::parse("a").unwrap(), NodeId::parse("b").unwrap());
    let inc_a = store.register_node(&registration("a")).await.unwrap();
    store.register_node(&registration("b")).await.unwrap();
    let term = store.bump_term(&a).await.unwrap();
    let mut tx = store.fenced(term).await.unwrap();
    tx.assign_now(ShardId(1), Epoch(0), &a).await.unwrap();
    tx.commit("shards").await.unwrap();
    // No revocation yet: nothing to acknowledge.
    assert!(
        !store
            .ack_revocation(ShardId(1), Epoch(1), &a, inc_a)
            .await
            .unwrap()
    );
    let mut tx = store.fenced(term).await.unwrap();
    assert!(tx.revoke(ShardId(1), Epoch(1), &a, &b).await.unwrap());
    // Completing before the ack is refused by the statement itself.
    assert_eq!(
        tx.complete_move(ShardId(1), Epoch(1), &b).await.unwrap(),
        None
    );
    tx.commit("shards").await.unwrap();
    assert!(
        !store
            .ack_revocation(ShardId(1), Epoch(1), &b, inc_a)
            .await
            .unwrap(),
        "not the owner"
    );
    assert!(
        !store
            .ack_revocation(ShardId(1), Epoch(1), &a, inc_a + 1)
            .await
            .unwrap(),
        "stale incarnation"
    );
    assert!(
        !store
            .ack_revocation(ShardId(1), Epoch(0), &a, inc_a)
            .await
            .unwrap(),
        "stale epoch"
    );
    assert!(
        store
            .ack_revocation(ShardId(1), Epoch(1), &a, inc_a)
            .await
            .unwrap()
    );
    let mut tx = store.fenced(term).await.unwrap();
    assert_eq!(
        tx.complete_move(ShardId(1), Epoch(1), &b).await.unwrap(),
        Some(Epoch(2))
    );
    tx.commit("shards").await.unwrap();
    let entry = store.read_table().await.unwrap().shards[1].clone();
    assert_eq!(
        (
            entry.owner,
            entry.epoch,
            entry.moving_to,
            entry.revoke_acked
        ),
        (Some(b), Epoch(2), None, false)
    );
}

#[tokio::test]
async fn batched_acknowledgements_skip_stale_entries() {
    let Some(db) = TestDatabase::create("batched_acknowledgements_skip_stale_entries").await else {
        return;
    };
    let store = support::placement::store(db.url()).await;
    store.bootstrap(4).await.unwrap();
    let (a, b) = (NodeId::parse("a").unwrap(), NodeId::parse("b").unwrap());
    let inc_a = store.register_node(&registration("a")).await.unwrap();
    store.register_node(&registration("b")).await.unwrap();
    let term = store.bump_term(&a).await.unwrap();
    let mut tx = store.fenced(term).await.unwrap();
    for s in 0..4 {
        tx.assign_now(ShardId(s), Epoch(0), &a).await.unwrap();
    }
    for s in 0..3 {
        tx.revoke(ShardId(s), Epoch(1), &a, &b).await.unwrap();
    }
    tx.commit("shards").await.unwrap();
    // Shard 2 is quoted at a stale epoch, shard 3 has no move pending.
    let acks = [
        (ShardId(0), Epoch(1)),
        (ShardId(1), Epoch(1)),
        (ShardId(2), Epoch(0)),
        (ShardId(3), Epoch(1)),
    ];
    assert_eq!(store.ack_revocations(&a, inc_a, &acks).await.unwrap(), 2);
    assert_eq!(
        store.ack_revocations(&a, inc_a, &acks).await.unwrap(),
        0,
        "idempotent"
    );
    assert_eq!(
        store
            .ack_revocations(&a, inc_a + 1, &[(ShardId(2), Epoch(1))])
            .await
            .unwrap(),
        0
    );
    let acked: Vec<bool> = store
        .read_table()
        .await
        .unwrap()
        .shards
        .iter()
        .map(|s| s.revoke_acked)
        .collect();
    assert_eq!(acked, vec![true, true, false, false]);
}

/// Issue 9, item 9: re-registering from a running node keeps a drain that was requested,
/// and a heartbeat says why it was refused (dead, taken over by another process, or
/// re-registered by this same process without the process learning the incarnation).
#[tokio::test]
async fn reregistration_keeps_a_drain_and_refusals_say_why() {
    let Some(db) = TestDatabase::create("reregistration_keeps_a_drain_and_refusals_say_why").await
    else {
        return;
    };
    use graviton::storage::pg::placement::HeartbeatReply;
    let store = support::placement::store(db.url()).await;
    store.bootstrap(8).await.unwrap();
    let a = NodeId::parse("a").unwrap();
    let first = registration("a");
    let inc = store.register_node(&first).await.unwrap();
    assert!(store.request_drain(&a).await.unwrap());
    // Another process registers the same id: the first one's heartbeat is superseded.
    let other = registration("a");
    let newer = store.register_node(&other).await.unwrap();
    assert_eq!(
        store.heartbeat_reply(&first, inc).await.unwrap(),
        HeartbeatReply::Superseded { incarnation: newer }
    );
    assert!(store.request_drain(&a).await.unwrap());
    // Declared dead: the reply says so, and re-registering keeps the drain.
    sqlx::query("UPDATE placement_nodes SET state = 'dead'")
        .execute(store.pool())
        .await
        .unwrap();
    assert_eq!(
        store.heartbeat_reply(&other, newer).await.unwrap(),
        HeartbeatReply::Dead
    );
    let back = store.reregister_node(&other).await.unwrap();
    assert_eq!(
        store.heartbeat_reply(&other, back).await.unwrap(),
        HeartbeatReply::Alive(NodeState::Draining)
    );
    // The same process re-registers again but never learns the answer (its deadline
    // fired after the commit): its heartbeats at the old incarnation say so, not
    // "superseded", so it registers again instead of fencing itself for good.
    let unlearned = store.reregister_node(&other).await.unwrap();
    assert_eq!(
        store.heartbeat_reply(&other, back).await.unwrap(),
        HeartbeatReply::Unconfirmed {
            incarnation: unlearned
        }
    );
    // A process start registers as joining.
    let fresh = registration("a");
    let fresh_inc = store.register_node(&fresh).await.unwrap();
    assert_eq!(
        store.heartbeat_reply(&fresh, fresh_inc).await.unwrap(),
        HeartbeatReply::Alive(NodeState::Joining)
    );
    assert_eq!(
        store.heartbeat_reply(&other, unlearned).await.unwrap(),
        HeartbeatReply::Superseded {
            incarnation: fresh_inc
        }
    );
    assert_eq!(
        store
            .heartbeat_reply(&registration("nobody"), 1)
            .await
            .unwrap(),
        HeartbeatReply::Missing
    );
}

// The manager's batched statements (one per round for completions, assignments and
// revocations) keep every row's own conditions: a stale epoch, a wrong owner or an
// unacknowledged move of a live owner is skipped, the rest of the batch applies.
#[tokio::test]
async fn batched_moves_apply_row_by_row_conditions() {
    let Some(db) = TestDatabase::create("batched_moves_apply_row_by_row_conditions").await else {
        return;
    };
    let store = support::placement::store(db.url()).await;
    store.bootstrap(6).await.unwrap();
    let (a, b) = (NodeId::parse("a").unwrap(), NodeId::parse("b").unwrap());
    let inc_a = store.register_node(&registration("a")).await.unwrap();
    store.register_node(&registration("b")).await.unwrap();
    let term = store.bump_term(&a).await.unwrap();
    let mut tx = store.fenced(term).await.unwrap();
    // Shard 5 is quoted at a stale epoch: not assigned.
    let mut assigned = tx
        .assign_many(
            &(0..6)
                .map(|s| (ShardId(s), Epoch(if s == 5 { 3 } else { 0 }), a.clone()))
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    assigned.sort();
    assert_eq!(
        assigned,
        (0..5).map(|s| (ShardId(s), Epoch(1))).collect::<Vec<_>>()
    );
    // Shard 3 quoted with the wrong owner, shard 4 at a stale epoch: not revoked.
    let mut revoked = tx
        .revoke_many(&[
            (ShardId(0), Epoch(1), a.clone(), b.clone()),
            (ShardId(1), Epoch(1), a.clone(), b.clone()),
            (ShardId(2), Epoch(1), a.clone(), b.clone()),
            (ShardId(3), Epoch(1), b.clone(), b.clone()),
            (ShardId(4), Epoch(0), a.clone(), b.clone()),
        ])
        .await
        .unwrap();
    revoked.sort();
    assert_eq!(revoked, [ShardId(0), ShardId(1), ShardId(2)]);
    tx.commit("shards").await.unwrap();
    // Only shards 0 and 1 acknowledged: shard 2's live owner has not, so it stays.
    store
        .ack_revocations(&a, inc_a, &[(ShardId(0), Epoch(1)), (ShardId(1), Epoch(1))])
        .await
        .unwrap();
    let mut tx = store.fenced(term).await.unwrap();
    let mut completed = tx
        .complete_moves(&[
            (ShardId(0), Epoch(1), b.clone()),
            (ShardId(1), Epoch(1), b.clone()),
            (ShardId(2), Epoch(1), b.clone()),
        ])
        .await
        .unwrap();
    completed.sort();
    assert_eq!(completed, [(ShardId(0), Epoch(2)), (ShardId(1), Epoch(2))]);
    tx.commit("shards").await.unwrap();
    let table = store.read_table().await.unwrap();
    let owners: Vec<_> = table
        .shards
        .iter()
        .map(|e| (e.owner.clone(), e.epoch, e.moving_to.clone()))
        .collect();
    assert_eq!(
        owners,
        vec![
            (Some(b.clone()), Epoch(2), None),
            (Some(b.clone()), Epoch(2), None),
            (Some(a.clone()), Epoch(1), Some(b.clone())),
            (Some(a.clone()), Epoch(1), None),
            (Some(a.clone()), Epoch(1), None),
            (None, Epoch(0), None),
        ]
    );
}
