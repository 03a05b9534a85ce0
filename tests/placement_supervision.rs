//! The placement supervisor restarts a crashed placement, health or election actor, and
//! the node keeps heartbeating, routing and standing for manager afterwards.

#[allow(unused_imports)]
mod support;

use std::time::Duration;

use graviton::placement::PlacementChild;
use support::TestDatabase;
use support::placement::eventually;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_placement_actors_are_restarted() {
    let Some(db) = TestDatabase::create("crashed_placement_actors_are_restarted").await else {
        return;
    };
    let handle = support::placement::start_node(db.url(), "a", |c| c.shard_count = 16).await;
    eventually(
        Duration::from_secs(15),
        "a owns all shards and is ready",
        || support::placement::owned(&handle, "a") == 16 && handle.health().ready,
    )
    .await;
    let term_before = handle.leading_term().await;
    assert!(term_before.0 > 0, "the only node leads");

    // Placement actor: after a crash, heartbeats resume (counter grows) and no fence sticks.
    let beats = handle.snapshot().counters.heartbeats;
    handle.inject_actor_failure(PlacementChild::Placement);
    eventually(
        Duration::from_secs(15),
        "heartbeats resume after the restart",
        || handle.snapshot().counters.heartbeats > beats + 5,
    )
    .await;
    assert!(
        handle.snapshot().counters.reregistrations >= 1
            || handle.snapshot().counters.heartbeats > beats
    );
    eventually(Duration::from_secs(15), "ready again", || {
        handle.health().ready
    })
    .await;
    assert!(
        handle.can_ingest(
            handle.owned_shards()[0],
            handle
                .resolve_shard(handle.owned_shards()[0])
                .unwrap()
                .epoch
        )
    );

    // Election: a restarted election wins the lock again, under a higher term.
    handle.inject_actor_failure(PlacementChild::Election);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut term_after = graviton::placement::Term(0);
    while tokio::time::Instant::now() < deadline {
        term_after = handle.leading_term().await;
        if term_after > term_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        term_after > term_before,
        "re-elected with a higher term ({term_before} -> {term_after})"
    );

    // Health: checks keep running after a restart (the check time moves on).
    handle.inject_actor_failure(PlacementChild::Health);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let checked = handle.health().checked_at_ms;
    eventually(
        Duration::from_secs(15),
        "health checks resume after the restart",
        || handle.health().checked_at_ms > checked && handle.health().ready,
    )
    .await;
    handle.shutdown().await;
}
