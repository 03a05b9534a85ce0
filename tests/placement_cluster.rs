//! Multi-node placement against real PostgreSQL: several `ClusterHandle`s in one process
//! on one database, with distinct node ids and fast timings (heartbeat 100ms, self-fence
//! 400ms, node TTL 1s, polling 250ms). Every wait is a poll with a generous deadline.

#[allow(unused_imports)]
mod support;

use std::time::{Duration, Instant};

use graviton::actors::ClusterError;
use graviton::ids::NodeId;
use graviton::placement::{self, HealthStatus, NodeState};
use graviton::storage::pg::PlacementStoreError;
use support::TestDatabase;
use support::placement::{eventually, owned, random_key, settled, start_node};

const GENEROUS: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_share_shards_evenly_with_one_manager() {
    let Some(db) = TestDatabase::create("three_nodes_share_shards_evenly_with_one_manager").await
    else {
        return;
    };
    let a = start_node(db.url(), "a", |_| {}).await;
    let b = start_node(db.url(), "b", |_| {}).await;
    let c = start_node(db.url(), "c", |_| {}).await;
    eventually(
        GENEROUS,
        "64 shards spread over a, b, c and agreed by all",
        || settled(&[&a, &b, &c], &["a", "b", "c"]),
    )
    .await;

    let terms = [
        a.leading_term().await,
        b.leading_term().await,
        c.leading_term().await,
    ];
    assert_eq!(
        terms.iter().filter(|t| t.0 > 0).count(),
        1,
        "exactly one manager: {terms:?}"
    );

    // Owner resolution agrees on every node; exactly one node may ingest.
    for _ in 0..200 {
        let key = random_key();
        let owners: Vec<_> = [&a, &b, &c]
            .iter()
            .map(|h| h.resolve(&key).unwrap())
            .collect();
        assert!(
            owners
                .iter()
                .all(|o| o.node == owners[0].node && o.epoch == owners[0].epoch)
        );
        assert_eq!(owners.iter().filter(|o| o.is_local).count(), 1);
        assert_eq!(
            owners[0].internal_addr,
            Some(
                support::placement::internal_addr(owners[0].node.as_str())
                    .parse()
                    .unwrap()
            )
        );
        let ingestible = [&a, &b, &c]
            .iter()
            .filter(|h| h.can_ingest(owners[0].shard, owners[0].epoch))
            .count();
        assert_eq!(ingestible, 1);
    }
    eventually(GENEROUS, "all three ready", || {
        [&a, &b, &c]
            .iter()
            .all(|h| h.health().status == HealthStatus::Healthy)
    })
    .await;
    let snapshot = a.snapshot();
    assert_eq!(snapshot.configured_shards, 64);
    assert_eq!(snapshot.assigned_shards, 64);
    assert_eq!(snapshot.nodes.len(), 3);
    assert!(snapshot.manager_term.0 >= 1);
    assert!(snapshot.counters.table_reads > 0 && snapshot.counters.heartbeats > 0);
    assert_eq!(snapshot.local_shards, a.owned_shards().len());
    let json = serde_json::to_string(&snapshot).unwrap();
    assert!(
        json.contains("\"status\":\"healthy\"") && json.contains("\"state\":\"active\""),
        "{json}"
    );

    let status = graviton::cli::cluster_status(db.url()).await.unwrap();
    assert_eq!(status.shard_count, 64);
    assert_eq!(status.unassigned_shards, 0);
    assert_eq!(status.nodes.iter().map(|n| n.shards).sum::<usize>(), 64);
    for h in [a, b, c] {
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_moves_shards_immediately() {
    let Some(db) = TestDatabase::create("drain_moves_shards_immediately").await else {
        return;
    };
    let a = start_node(db.url(), "a", |_| {}).await;
    let b = start_node(db.url(), "b", |_| {}).await;
    let c = start_node(db.url(), "c", |_| {}).await;
    eventually(GENEROUS, "balanced", || {
        settled(&[&a, &b, &c], &["a", "b", "c"])
    })
    .await;
    let epochs_before: Vec<_> = a.view().table().shards.iter().map(|s| s.epoch).collect();

    let started = Instant::now();
    assert!(a.drain(&NodeId::parse("c").unwrap()).await.unwrap());
    eventually(GENEROUS, "c empty and a, b balanced, on every node", || {
        settled(&[&a, &b, &c], &["a", "b"]) && owned(&a, "c") == 0
    })
    .await;
    let took = started.elapsed();
    println!("FIGURE drain_to_all_moved_ms={}", took.as_millis());
    // Each moved shard moved once, with its epoch bumped by exactly one.
    let table = a.view().table();
    for (entry, before) in table.shards.iter().zip(&epochs_before) {
        assert!(entry.epoch.0 == before.0 || entry.epoch.0 == before.0 + 1);
    }
    assert_eq!(
        table.nodes[&NodeId::parse("c").unwrap()].state,
        NodeState::Draining
    );
    eventually(GENEROUS, "drained node unassigned", || {
        c.health().status == HealthStatus::Unassigned
    })
    .await;
    assert!(!c.health().ready);
    assert!(
        c.snapshot().counters.acks > 0,
        "c acknowledged its revocations"
    );
    // Readiness is recomputed by each node's health actor on its own interval: poll it.
    eventually(GENEROUS, "a and b ready after the drain", || {
        a.health().ready && b.health().ready
    })
    .await;
    // Drain is generous-bounded here; the figure is recorded in docs/locality.md.
    assert!(took < Duration::from_secs(10));
    for h in [a, b, c] {
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_node_loses_its_shards_after_the_ttl() {
    let Some(db) = TestDatabase::create("silent_node_loses_its_shards_after_the_ttl").await else {
        return;
    };
    let a = start_node(db.url(), "a", |_| {}).await;
    let b = start_node(db.url(), "b", |_| {}).await;
    let c = start_node(db.url(), "c", |c| c.embedded_manager = false).await;
    eventually(GENEROUS, "balanced", || {
        settled(&[&a, &b, &c], &["a", "b", "c"])
    })
    .await;

    let c_id = NodeId::parse("c").unwrap();
    let former: Vec<i32> = a
        .view()
        .table()
        .shards
        .iter()
        .filter(|s| s.owner.as_ref() == Some(&c_id))
        .map(|s| s.shard.0 as i32)
        .collect();
    let stopped = Instant::now();
    c.shutdown().await; // stops heartbeating without draining (like a crash)
    eventually(GENEROUS, "c's shards reassigned to a and b", || {
        settled(&[&a, &b], &["a", "b"]) && owned(&a, "c") == 0
    })
    .await;
    println!(
        "FIGURE silent_node_to_reassigned_ms={} (node_ttl=1000ms)",
        stopped.elapsed().as_millis()
    );
    // Evidence from the database clock: every one of c's shards was rewritten more than
    // node_ttl after c's last heartbeat.
    let store = support::placement::store(db.url()).await;
    let min_gap_ms: f64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM min(s.updated_at - n.heartbeat_at))::float8 * 1000
         FROM placement_shards s, placement_nodes n WHERE n.id = 'c' AND s.shard = ANY($1)",
    )
    .bind(&former)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert!(
        min_gap_ms > 1000.0,
        "a shard moved {min_gap_ms}ms after c's last heartbeat"
    );
    assert_eq!(
        a.view().table().nodes[&NodeId::parse("c").unwrap()].state,
        NodeState::Dead
    );
    for h in [a, b] {
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_failover_to_a_standby_with_a_higher_term() {
    let Some(db) = TestDatabase::create("manager_failover_to_a_standby_with_a_higher_term").await
    else {
        return;
    };
    let a = start_node(db.url(), "a", |_| {}).await;
    let b = start_node(db.url(), "b", |_| {}).await;
    eventually(GENEROUS, "balanced", || settled(&[&a, &b], &["a", "b"])).await;
    let store = support::placement::store(db.url()).await;
    let term1 = store.meta().await.unwrap().manager_term;
    let (leader, standby) = if a.leading_term().await == term1 {
        (a, b)
    } else {
        (b, a)
    };
    assert_eq!(leader.leading_term().await, term1);
    assert_eq!(standby.leading_term().await.0, 0);

    // 1. Kill the leader's lock connection from the server side.
    let killed = Instant::now();
    let n: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_locks
         WHERE locktype = 'advisory' AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(n, 1, "exactly one advisory lock holder");
    let mut term2 = term1;
    while term2 == term1 {
        assert!(
            killed.elapsed() < GENEROUS,
            "no new manager term after the lock connection died"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
        term2 = store.meta().await.unwrap().manager_term;
    }
    println!(
        "FIGURE lock_connection_killed_to_new_term_ms={}",
        killed.elapsed().as_millis()
    );
    assert!(term2 > term1);
    // The old term can no longer write.
    assert!(matches!(
        store.fenced(term1).await,
        Err(PlacementStoreError::Fenced { .. })
    ));
    // The old leader stepped down: exactly one node leads, under the newest term.
    let since = Instant::now();
    loop {
        let current = store.meta().await.unwrap().manager_term;
        let mut terms = [leader.leading_term().await, standby.leading_term().await];
        terms.sort();
        if terms == [placement::Term(0), current] {
            break;
        }
        assert!(
            since.elapsed() < GENEROUS,
            "leadership did not settle: {terms:?} vs {current}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let term2 = store.meta().await.unwrap().manager_term;

    // 2. Stop the current leader's process-level actors: the other node takes over.
    let current = store.meta().await.unwrap().manager_node.unwrap();
    let (gone, survivor) = if leader.node_id().as_str() == current {
        (leader, standby)
    } else {
        (standby, leader)
    };
    let stopped = Instant::now();
    gone.shutdown().await;
    let term3 = loop {
        let t = survivor.leading_term().await;
        if t > term2 {
            break t;
        }
        assert!(stopped.elapsed() < GENEROUS, "standby did not take over");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    println!(
        "FIGURE leader_stopped_to_standby_acting_ms={}",
        stopped.elapsed().as_millis()
    );
    assert_eq!(
        store.meta().await.unwrap().manager_node.as_deref(),
        Some(survivor.node_id().as_str())
    );
    // The new manager acts: the stopped node's shards end up on the survivor.
    let name = survivor.node_id().to_string();
    eventually(GENEROUS, "survivor owns everything", || {
        owned(&survivor, &name) == 64
    })
    .await;
    assert!(term3 > term2);
    survivor.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_standalone_manager_fails_closed() {
    let Some(db) = TestDatabase::create("second_standalone_manager_fails_closed").await else {
        return;
    };
    let config = support::placement::config(db.url(), "m1");
    let first = graviton::actors::run_standalone_manager(NodeId::parse("m1").unwrap(), &config)
        .await
        .unwrap();
    let term1 = first.term().await;
    assert!(term1.0 >= 1);
    let err = graviton::actors::run_standalone_manager(NodeId::parse("m2").unwrap(), &config)
        .await
        .err()
        .expect("second manager must fail");
    assert!(matches!(err, ClusterError::ManagerLockHeld), "{err}");
    assert!(err.to_string().contains("another Graviton shard manager"));

    // The standalone manager assigns shards to a node that runs no manager itself.
    let n = start_node(db.url(), "n", |c| c.embedded_manager = false).await;
    eventually(GENEROUS, "node n owns all shards", || owned(&n, "n") == 64).await;

    first.shutdown().await;
    // No manager runs now: `graviton drain --wait` gives up at its timeout and says how
    // many shards the node still holds; an unknown node is refused.
    let wait = Some(Duration::from_millis(300));
    let n_id = NodeId::parse("n").unwrap();
    let ghost = NodeId::parse("ghost").unwrap();
    assert_eq!(
        graviton::cli::drain(db.url(), &n_id, wait, |_| {})
            .await
            .unwrap(),
        graviton::cli::DrainOutcome::TimedOut { held: 64 }
    );
    assert_eq!(
        graviton::cli::drain(db.url(), &ghost, wait, |_| {})
            .await
            .unwrap(),
        graviton::cli::DrainOutcome::UnknownNode
    );
    let second = graviton::actors::run_standalone_manager(NodeId::parse("m2").unwrap(), &config)
        .await
        .unwrap();
    assert!(second.term().await > term1);
    second.shutdown().await;
    n.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observer_heals_lost_notifications_within_the_polling_bound() {
    let Some(db) =
        TestDatabase::create("observer_heals_lost_notifications_within_the_polling_bound").await
    else {
        return;
    };
    let a = start_node(db.url(), "a", |_| {}).await;
    let b = start_node(db.url(), "b", |_| {}).await;
    // The observer never LISTENs: only polling (250ms) can tell it anything.
    let o = start_node(db.url(), "o", |c| {
        c.listen_notify = false;
        c.embedded_manager = false;
    })
    .await;
    eventually(GENEROUS, "balanced", || {
        settled(&[&a, &b, &o], &["a", "b", "o"])
    })
    .await;
    let mut worst = Duration::ZERO;
    for victim in ["b", "a"] {
        assert_eq!(
            graviton::cli::drain(db.url(), &NodeId::parse(victim).unwrap(), None, |_| {})
                .await
                .unwrap(),
            graviton::cli::DrainOutcome::Requested
        );
        // Wait on the listening nodes, then time how long the observer lags behind.
        eventually(GENEROUS, "listeners see the drain", || {
            let t = a.view().table();
            t.moving() == 0 && t.owned_by(&NodeId::parse(victim).unwrap()) == 0
        })
        .await;
        let seen = a.view().table().shards.clone();
        let lag = eventually(
            Duration::from_secs(5),
            "observer converges within the polling bound",
            || o.view().table().shards == seen,
        )
        .await;
        worst = worst.max(lag);
    }
    println!(
        "FIGURE observer_lag_without_notify_ms={} (poll_interval=250ms)",
        worst.as_millis()
    );
    // Polling bound (250ms) plus one read and scheduling slack; generous on a loaded box.
    assert!(worst < Duration::from_secs(3), "{worst:?}");
    for h in [a, b, o] {
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_survives_a_restart_of_all_nodes() {
    let Some(db) = TestDatabase::create("placement_survives_a_restart_of_all_nodes").await else {
        return;
    };
    let a = start_node(db.url(), "a", |_| {}).await;
    let b = start_node(db.url(), "b", |_| {}).await;
    let c = start_node(db.url(), "c", |_| {}).await;
    eventually(GENEROUS, "balanced", || {
        settled(&[&a, &b, &c], &["a", "b", "c"])
    })
    .await;
    let before = a.view().table().shards.clone();
    let term_before = a.view().table().manager_term;
    tokio::join!(a.shutdown(), b.shutdown(), c.shutdown());

    let (a, b, c) = tokio::join!(
        start_node(db.url(), "a", |_| {}),
        start_node(db.url(), "b", |_| {}),
        start_node(db.url(), "c", |_| {})
    );
    eventually(GENEROUS, "restarted nodes agree and a manager runs", || {
        settled(&[&a, &b, &c], &["a", "b", "c"]) && a.view().table().manager_term > term_before
    })
    .await;
    let after = a.view().table().shards.clone();
    assert_eq!(after, before, "owners and epochs survive a full restart");
    for h in [a, b, c] {
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_count_mismatch_refuses_to_start() {
    let Some(db) = TestDatabase::create("shard_count_mismatch_refuses_to_start").await else {
        return;
    };
    let a = start_node(db.url(), "a", |_| {}).await;
    let mut config = support::placement::config(db.url(), "b");
    config.shard_count = 128;
    let err =
        graviton::actors::Cluster::connect_and_start(NodeId::parse("b").unwrap(), &config, "test")
            .await
            .err()
            .expect("must refuse");
    assert!(
        matches!(
            err,
            ClusterError::Store(PlacementStoreError::ShardCountMismatch {
                configured: 128,
                stored: 64
            })
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("64") && text.contains("128") && text.contains("cluster.shard_count"),
        "{text}"
    );
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_placement() {
    let Some(db) = TestDatabase::create("readiness_follows_placement").await else {
        return;
    };
    // A node that runs no manager: nobody assigns it anything yet.
    let a = start_node(db.url(), "a", |c| c.embedded_manager = false).await;
    eventually(GENEROUS, "unassigned before any manager", || {
        a.health().status == HealthStatus::Unassigned
    })
    .await;
    assert!(!a.health().ready);

    let b = start_node(db.url(), "b", |_| {}).await;
    eventually(GENEROUS, "both healthy", || {
        a.health().status == HealthStatus::Healthy && b.health().status == HealthStatus::Healthy
    })
    .await;

    // During a drain the remaining owner reports rebalancing and stays ready.
    let c = start_node(db.url(), "c", |c| c.embedded_manager = false).await;
    // Balanced, and every node's own health probe has seen its shards (the probe runs
    // on its own interval, so a table can settle before the probes catch up).
    eventually(GENEROUS, "balanced over three, seen by every probe", || {
        settled(&[&a, &b, &c], &["a", "b", "c"]) && [&a, &b, &c].iter().all(|n| n.health().ready)
    })
    .await;
    assert_eq!(
        a.drain_self(GENEROUS).await.unwrap(),
        graviton::placement::DrainEnd::Drained,
        "a drained itself"
    );
    eventually(GENEROUS, "a unassigned after its drain", || {
        a.health().status == HealthStatus::Unassigned
    })
    .await;
    assert!(b.health().ready && c.health().ready);

    // Placement unreadable: unavailable, not ready, last success kept; then recovery.
    let good = b.health().last_successful_at_ms.unwrap();
    let store = support::placement::store(db.url()).await;
    sqlx::query("ALTER TABLE placement_shards RENAME TO placement_shards_hidden")
        .execute(store.pool())
        .await
        .unwrap();
    eventually(
        GENEROUS,
        "unavailable while the table is unreadable",
        || b.health().status == HealthStatus::Unavailable,
    )
    .await;
    let h = b.health();
    assert!(!h.ready);
    assert!(h.last_successful_at_ms.unwrap() >= good);
    assert!(h.checked_at_ms.unwrap() >= h.last_successful_at_ms.unwrap());
    // Routing continues with the last table.
    assert!(b.resolve(&random_key()).is_ok());
    sqlx::query("ALTER TABLE placement_shards_hidden RENAME TO placement_shards")
        .execute(store.pool())
        .await
        .unwrap();
    eventually(GENEROUS, "ready again", || b.health().ready).await;
    for h in [a, b, c] {
        h.shutdown().await;
    }
}

#[tokio::test]
async fn single_node_mode_owns_everything_without_postgres() {
    let handle = graviton::actors::Cluster::single_node(NodeId::parse("local").unwrap(), 1024);
    let key = random_key();
    let owner = handle.resolve(&key).unwrap();
    assert!(owner.is_local);
    assert_eq!(owner.shard, handle.shard_of(&key));
    assert!(handle.can_ingest(owner.shard, owner.epoch));
    assert!(handle.begin_ingest(owner.shard, owner.epoch).is_some());
    assert_eq!(handle.health().status, HealthStatus::Healthy);
    assert_eq!(handle.snapshot().local_shards, 1024);
}

#[tokio::test]
async fn unsafe_timings_refuse_to_start() {
    let Some(db) = TestDatabase::create("unsafe_timings_refuse_to_start").await else {
        return;
    };
    let mut config = support::placement::config(db.url(), "a");
    config.node_ttl = graviton::config::HumanDuration::millis(300); // below self_fence (400ms)
    let err =
        graviton::actors::Cluster::connect_and_start(NodeId::parse("a").unwrap(), &config, "test")
            .await
            .err()
            .expect("must refuse");
    assert!(matches!(err, ClusterError::InvalidConfig(_)), "{err}");
    assert!(err.to_string().contains("cluster.node_ttl"), "{err}");
}

/// Issue 9, item 4: the fencing timings are cluster-wide. The first node stores its
/// `self_fence`/`node_ttl`; a node that would fence later, or a manager that would
/// declare nodes dead sooner, refuses to start and names the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timings_that_disagree_with_the_cluster_refuse_to_start() {
    use graviton::config::HumanDuration;
    let Some(db) = TestDatabase::create("timings_that_disagree_with_the_cluster").await else {
        return;
    };
    // Stored: self_fence 400ms, node_ttl 1s.
    let a = support::placement::start_node(db.url(), "a", |_| {}).await;
    let start = |config: graviton::placement::ClusterConfig, name: &'static str| async move {
        graviton::actors::Cluster::connect_and_start(NodeId::parse(name).unwrap(), &config, "test")
            .await
    };

    let mut late_fence = support::placement::config(db.url(), "b");
    late_fence.self_fence = HumanDuration::millis(800);
    late_fence.node_ttl = HumanDuration::secs(2);
    let err = start(late_fence, "b").await.err().expect("must refuse");
    assert!(err.to_string().contains("cluster.self_fence"), "{err}");

    let mut quick_manager = support::placement::config(db.url(), "c");
    quick_manager.self_fence = HumanDuration::millis(200);
    quick_manager.node_ttl = HumanDuration::millis(500);
    let err = start(quick_manager.clone(), "c")
        .await
        .err()
        .expect("must refuse");
    assert!(err.to_string().contains("cluster.node_ttl"), "{err}");

    // The same timings on a node that runs no manager are safe: it fences sooner.
    quick_manager.embedded_manager = false;
    let c = start(quick_manager, "c")
        .await
        .expect("a node that fences sooner may join");
    c.shutdown().await;
    a.shutdown().await;
}

/// Graceful handoff (issue 9): a drain refuses new ingest on the draining node at once, but
/// an ingest already running keeps its permit for `handoff_grace`, and the shard moves
/// only after it ends (the ack waits for it). Checks LOC-1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_lets_a_running_ingest_finish_before_its_shard_moves() {
    use graviton::config::HumanDuration;
    let Some(db) = TestDatabase::create("a_drain_lets_a_running_ingest_finish").await else {
        return;
    };
    let grace = |c: &mut graviton::placement::ClusterConfig| {
        c.handoff_grace = HumanDuration::secs(30);
    };
    let a = support::placement::start_node(db.url(), "a", grace).await;
    let b = support::placement::start_node(db.url(), "b", grace).await;
    support::placement::eventually(Duration::from_secs(20), "balanced", || {
        support::placement::settled(&[&a, &b], &["a", "b"])
    })
    .await;
    let a_id = NodeId::parse("a").unwrap();
    let shard = a.view().owned_shards()[0];
    let epoch = a.view().table().get(shard).unwrap().epoch;
    let running = a.begin_ingest(shard, epoch).expect("a owns the shard");

    assert!(a.drain(&a_id).await.unwrap());
    support::placement::eventually(Duration::from_secs(20), "every other shard left a", || {
        let t = a.view().table();
        t.owned_by(&a_id) == 1 && t.get(shard).unwrap().moving_to.is_some()
    })
    .await;
    assert!(running.is_valid(), "the running ingest may finish");
    assert!(a.begin_ingest(shard, epoch).is_none(), "no new ingest on a");
    assert!(
        !b.can_ingest(shard, epoch)
            && b.view().table().get(shard).unwrap().owner == Some(a_id.clone()),
        "the shard has not moved while the ingest runs"
    );

    drop(running); // the upload finished: a acknowledges, the move completes
    support::placement::eventually(Duration::from_secs(20), "the shard moved to b", || {
        let entry = b.view().table().get(shard).cloned().unwrap();
        entry.owner == Some(NodeId::parse("b").unwrap()) && entry.moving_to.is_none()
    })
    .await;
    a.shutdown().await;
    b.shutdown().await;
}
