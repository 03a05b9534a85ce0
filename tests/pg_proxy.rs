//! The PostgreSQL TCP proxy of `support::pg_proxy` (real sockets, real server), and a
//! stale heartbeat reply staged with it on real processes (issue 25 item 5).

mod support;

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use graviton::ids::{SessionId, SessionKey, TenantId};
use graviton::placement::hash::shard_of;
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use support::cluster::NodeProcess;
use support::pg_proxy::{Direction, Fault, PgProxy, upstream_of, url_through};

async fn connect(url: &str, name: &str) -> PgConnection {
    let options = PgConnectOptions::from_str(url)
        .unwrap()
        .application_name(name);
    PgConnection::connect_with(&options).await.unwrap()
}

async fn one(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT 1")
        .fetch_one(conn)
        .await
        .unwrap()
}

// The proxy's own contract: a held connection gets no answer (and stays open) while
// another connection through the same proxy is served; healed, the held request is
// answered; a delayed connection is answered no sooner than its delay each way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_holds_and_delays_one_labelled_connection() {
    let Some(db) = support::TestDatabase::create("the_proxy_holds_and_delays").await else {
        return;
    };
    let proxy = PgProxy::start(upstream_of(db.url())).await;
    let url = url_through(db.url(), proxy.port);
    let mut a = connect(&url, "probe-a").await;
    let mut b = connect(&url, "probe-b").await;
    assert_eq!(one(&mut a).await, 1);
    assert!(proxy.labels().iter().any(|l| l == "probe-a"));

    proxy.set("probe-a", Direction::Both, Fault::Hold);
    let held = tokio::spawn(async move {
        let answer = one(&mut a).await;
        (answer, a)
    });
    let caught = support::wait_until(Duration::from_secs(10), || async {
        proxy.held("probe-a", false) > 0
    })
    .await;
    assert!(caught, "the held connection's request was not caught");
    // The other connection is served while a's request is held.
    assert_eq!(one(&mut b).await, 1);
    assert!(!held.is_finished(), "a held request was answered");
    assert_eq!(
        proxy.open_connections("probe-a"),
        1,
        "a held connection stays open"
    );
    proxy.heal();
    let (answer, _a) = held.await.unwrap();
    assert_eq!(answer, 1, "the held request is answered once healed");
    assert_eq!(proxy.held("probe-a", false), 0);

    let delay = Duration::from_millis(200);
    proxy.set("probe-b", Direction::Both, Fault::Delay(delay));
    let started = Instant::now();
    assert_eq!(one(&mut b).await, 1);
    let took = started.elapsed();
    assert!(
        proxy.delayed("probe-b", false) > 0 && proxy.delayed("probe-b", true) > 0,
        "no chunk was delayed"
    );
    // A lower bound: the answer cannot come sooner than one delay each way.
    assert!(
        took >= delay * 2,
        "answered in {took:?} through a {delay:?} delay"
    );
}

/// How many times `needle` occurs in the node's log.
fn count(node: &NodeProcess, needle: &str) -> usize {
    node.log_text().matches(needle).count()
}

async fn status(url: &str) -> Option<graviton::cli::ClusterStatus> {
    graviton::cli::cluster_status(url).await.ok()
}

const SHARDS: u32 = 16;

// Issue 25 item 5 on real connections: node-s's heartbeat, sent with its old incarnation,
// is answered `Dead` by the server before node-s's re-registration commits, and the
// proxy delivers that answer after node-s learned its new incarnation. The node must not
// be fenced by it: it gets shards from the manager and acknowledges uploads as owner.
// The stale delivery is confirmed from the node's own log line for an ignored refusal;
// staging is retried (a fresh death each time) if the answer missed the heartbeat's
// deadline (the node's self_fence, 400 ms in the test timings). The answer lands while
// the re-registration's closing table read is held, so the re-registration is still
// queued: the old code (no incarnation check on `Dead`) fenced the node for good there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_dead_heartbeat_reply_does_not_fence_a_reregistered_node() {
    let Some(db) = support::TestDatabase::create("a_stale_dead_heartbeat_reply").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("shared");
    let url = db.url().to_string();
    let m = NodeProcess::start(dir.path(), "node-m", &url, SHARDS, &data);
    let managing = support::wait_until(Duration::from_secs(60), || {
        let url = url.clone();
        async move {
            status(&url)
                .await
                .is_some_and(|s| s.manager_node.as_deref() == Some("node-m"))
        }
    })
    .await;
    assert!(managing, "node-m never managed; log:\n{}", m.log_text());
    let proxy = PgProxy::start(upstream_of(&url)).await;
    let s = NodeProcess::start(
        dir.path(),
        "node-s",
        &url_through(&url, proxy.port),
        SHARDS,
        &data,
    );
    let has_shards = |url: String| async move {
        status(&url).await.is_some_and(|st| {
            st.nodes
                .iter()
                .any(|n| n.id.as_str() == "node-s" && n.shards > 0 && n.state.as_str() == "active")
        })
    };
    assert!(
        support::wait_until(Duration::from_secs(60), || has_shards(url.clone())).await,
        "node-s never got shards; log:\n{}",
        s.log_text()
    );

    let public = s.url.trim_start_matches("http://").to_string();
    const HB: &str = "graviton-heartbeat:node-s";
    const ACTOR: &str = "graviton-placement:node-s";
    const IGNORED: &str = "heartbeat refusal for an older incarnation ignored";
    const REREGISTERED: &str = "re-registered; fenced until the table is re-read";
    let mut staged = false;
    for attempt in 1..=6 {
        // 1. Cut node-s's heartbeats and its placement actor (registration, table reads)
        //    until the manager declared it dead.
        proxy.set(HB, Direction::Both, Fault::Hold);
        proxy.set(ACTOR, Direction::Both, Fault::Hold);
        let dead = support::wait_until(Duration::from_secs(30), || {
            let url = url.clone();
            async move {
                status(&url).await.is_some_and(|st| {
                    st.nodes
                        .iter()
                        .any(|n| n.id.as_str() == "node-s" && n.state.as_str() == "dead")
                })
            }
        })
        .await;
        assert!(dead, "node-s was never declared dead while cut off");
        // 2. Heartbeats through, answers held; then let the held answers go once, so a
        //    live heartbeat learns `Dead` and queues the re-registration (held: the actor
        //    is cut off).
        let refused = count(&s, "heartbeat refused");
        let reregistered = count(&s, REREGISTERED);
        proxy.set(HB, Direction::Both, Fault::Pass);
        let learned = support::wait_until(Duration::from_secs(10), || async {
            count(&s, "heartbeat refused") > refused
        })
        .await;
        assert!(learned, "node-s never learned it was declared dead");
        // 3. Hold the answer of the next heartbeat: sent with the old incarnation,
        //    answered `Dead` (the re-registration cannot reach the server yet). Held from
        //    the chunk that carries the row's state `dead` (a new connection's statement
        //    preparation answers first and must pass).
        proxy.set(
            HB,
            Direction::ToClient,
            Fault::HoldFrom(Arc::new(b"dead".to_vec())),
        );
        let caught = support::wait_until(Duration::from_secs(10), || async {
            proxy.held(HB, true) > 0
        })
        .await;
        assert!(caught, "no heartbeat answer was held");
        let held_at = Instant::now();
        // 4. Let the re-registration through (its INSERT binds node-s's public address),
        //    up to its COMMIT; the statement after it, the table read that ends the
        //    re-registration, is held, so the re-registration is still under way (queued)
        //    when the stale answer lands (the window in which the old code fenced the node
        //    for good). Wait until node-s has learned its new incarnation (its log says so
        //    right after storing it) and that table read is caught ...
        proxy.set(ACTOR, Direction::Both, Fault::Pass);
        proxy.set(
            ACTOR,
            Direction::ToServer,
            Fault::HoldAfter(Arc::new(vec![
                public.as_bytes().to_vec(),
                b"COMMIT".to_vec(),
            ])),
        );
        let done = support::wait_until(Duration::from_secs(10), || async {
            count(&s, REREGISTERED) > reregistered
        })
        .await;
        assert!(done, "node-s never re-registered; log:\n{}", s.log_text());
        let read_held = support::wait_until(Duration::from_millis(300), || async {
            proxy.held(ACTOR, false) > 0
        })
        .await;
        // 5. ... then deliver the held `Dead` answer for the old incarnation.
        proxy.set(HB, Direction::ToClient, Fault::Pass);
        let released_after = held_at.elapsed();
        let ignored =
            support::wait_until(Duration::from_secs(2), || async { count(&s, IGNORED) > 0 }).await;
        let still_held = proxy.held(ACTOR, false) > 0;
        proxy.heal();
        eprintln!(
            "attempt {attempt}: held answer released {released_after:?} after it was caught; \
             stale refusal seen by the node: {ignored}; re-registration's table read held \
             before: {read_held}, after: {still_held}"
        );
        if !ignored {
            let log = s.log_text();
            let tail: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("graviton::actors::placement"))
                .collect();
            eprintln!(
                "node-s placement log tail:\n{}",
                tail[tail.len().saturating_sub(8)..].join("\n")
            );
        }
        if ignored && read_held && still_held {
            staged = true;
            break;
        }
    }
    assert!(
        staged,
        "a stale Dead answer never reached node-s within its heartbeat deadline in 6 attempts"
    );

    // Not fenced: the manager gives node-s shards, and it acknowledges uploads as owner.
    assert!(
        support::wait_until(Duration::from_secs(30), || has_shards(url.clone())).await,
        "node-s got no shards after the stale answer; log:\n{}",
        s.log_text()
    );
    let mut owned = false;
    for seed in 0..20u64 {
        let table = status(&url).await.expect("status");
        let Some(key) = (0..10_000)
            .map(|_| SessionKey {
                tenant: TenantId::new_random(),
                session: SessionId::new_random(),
            })
            .find(|key| {
                let shard = shard_of(key, SHARDS);
                table.shards.iter().any(|e| {
                    e.shard == shard && e.owner.as_ref().is_some_and(|o| o.as_str() == "node-s")
                })
            })
        else {
            continue;
        };
        let blob = support::node::random_bytes(50_000, 5_000 + seed);
        let response = support::cluster::upload_retrying(&s.url, &key, blob.clone()).await;
        if response.status() != 201 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let body: serde_json::Value = response.json().await.unwrap();
        if body["owner"] == "node-s" {
            let (code, got) = support::download(&m.url, body["key"].as_str().unwrap()).await;
            assert_eq!(code, 200);
            assert!(got == blob);
            owned = true;
            break;
        }
    }
    assert!(
        owned,
        "node-s never acknowledged an upload as owner after the stale answer; log:\n{}",
        s.log_text()
    );
    drop(s);
    drop(m);
}
