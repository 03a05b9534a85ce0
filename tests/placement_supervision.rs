//! The placement supervisor restarts a crashed placement, health or election actor, and
//! the node keeps heartbeating, routing and standing for manager afterwards.

#[allow(unused_imports)]
mod support;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use graviton::actors::PlacementChild;
use support::TestDatabase;
use support::placement::eventually;

/// The test process's log lines (INFO and up), for the supervisor's restart records.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Lines that contain every one of `needles`.
    fn count(&self, needles: &[&str]) -> usize {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        text.lines()
            .filter(|line| needles.iter().all(|n| line.contains(n)))
            .count()
    }
}

/// The node's registration incarnation, read from PostgreSQL (the store, not the node).
async fn incarnation(pool: &sqlx::PgPool, node: &str) -> i64 {
    sqlx::query_scalar("SELECT incarnation FROM placement_nodes WHERE id = $1")
        .bind(node)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_placement_actors_are_restarted() {
    let Some(db) = TestDatabase::create("crashed_placement_actors_are_restarted").await else {
        return;
    };
    let logs = Captured::default();
    let writer = logs.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish(),
    )
    .expect("one subscriber per test binary");
    let pool = sqlx::PgPool::connect(db.url()).await.unwrap();
    let handle = support::placement::start_node(db.url(), "a", |c| c.shard_count = 16).await;
    eventually(
        Duration::from_secs(15),
        "a owns all shards and is ready",
        || support::placement::owned(&handle, "a") == 16 && handle.health().ready,
    )
    .await;
    let term_before = handle.leading_term().await;
    assert!(term_before.0 > 0, "the only node leads");

    // Placement actor: after a crash, the restarted actor registers again (a new
    // incarnation in PostgreSQL, which only a new registration writes), heartbeats resume
    // (the counter grows) and no fence sticks.
    let registered = incarnation(&pool, "a").await;
    let beats = handle.snapshot().counters.heartbeats;
    handle.inject_actor_failure(PlacementChild::Placement);
    let reregistered = support::wait_until(Duration::from_secs(15), || async {
        incarnation(&pool, "a").await > registered
    })
    .await;
    assert!(
        reregistered,
        "the crashed placement actor was never restarted: incarnation still {registered}"
    );
    eventually(
        Duration::from_secs(15),
        "heartbeats resume after the restart",
        || handle.snapshot().counters.heartbeats > beats + 5,
    )
    .await;
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

    // Election: a restarted election wins the lock again, under a higher term (LOC-3: the
    // cluster regains an acting manager).
    handle.inject_actor_failure(PlacementChild::Election);
    let term_after = std::sync::Mutex::new(graviton::placement::Term(0));
    let reelected = support::wait_until(Duration::from_secs(20), || async {
        let term = handle.leading_term().await;
        *term_after.lock().unwrap() = term;
        term > term_before
    })
    .await;
    let term_after = term_after.into_inner().unwrap();
    assert!(
        reelected,
        "re-elected with a higher term ({term_before} -> {term_after})"
    );

    // Health: the supervisor restarts the killed actor (its record says so), and checks
    // run again afterwards (the check time moves on past the restart).
    let health_restarts = || logs.count(&["placement child restarted", "Health"]);
    let restarted_before = health_restarts();
    handle.inject_actor_failure(PlacementChild::Health);
    eventually(
        Duration::from_secs(15),
        "the supervisor restarts the health actor",
        || health_restarts() > restarted_before,
    )
    .await;
    let checked = handle.health().checked_at_ms;
    eventually(
        Duration::from_secs(15),
        "health checks resume after the restart",
        || handle.health().checked_at_ms > checked && handle.health().ready,
    )
    .await;
    handle.shutdown().await;
}
