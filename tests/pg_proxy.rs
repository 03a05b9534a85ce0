//! The PostgreSQL TCP proxy of `support::pg_proxy` (real sockets, real server), and a
//! stale heartbeat reply staged with it on real processes (issue 25 item 5), and a request
//! cancelled inside `BEGIN` that must hand its pool no open transaction (PG-2).

mod support;

use std::str::FromStr;
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
    let log = || s.log_text();
    let declared_dead = || {
        let url = url.clone();
        async move {
            status(&url).await.is_some_and(|st| {
                st.nodes
                    .iter()
                    .any(|n| n.id.as_str() == "node-s" && n.state.as_str() == "dead")
            })
        }
    };
    let staged = support::pg_proxy::stage_stale_dead_reply(
        &proxy,
        "node-s",
        &public,
        &log,
        declared_dead,
        6,
    )
    .await;
    if let Err(why) = &staged {
        panic!("{why}; log:\n{}", s.log_text());
    }

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

/// Rows of `probe` with this value, read on a connection of its own (not the pool's).
async fn committed(direct: &mut PgConnection, value: i32) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM probe WHERE v = $1")
        .bind(value)
        .fetch_one(direct)
        .await
        .unwrap()
}

/// Sessions of `name` idle inside a transaction, from `pg_stat_activity`.
async fn idle_in_transaction(direct: &mut PgConnection, name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
    )
    .bind(name)
    .fetch_one(direct)
    .await
    .unwrap()
}

// Checks PG-2 on real connections: a request cancelled while its `BEGIN` is in flight
// (the server ran it; its answer is held by the proxy, so the cancel is certain to land
// inside `begin`) must not hand the pool a connection inside a transaction. sqlx 0.9.0
// does (transact-rs/sqlx#4393): the next borrower's autocommit insert then ran inside
// the stale transaction, was answered OK and was invisible to every other session, to be
// lost when the server ended the session. Then a sweep drops transactions at many points
// (acquire, BEGIN, a statement, COMMIT) through a 15 ms delay each way, and after every
// drop an autocommit insert must be committed when it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_cancelled_inside_begin_hands_no_transaction_to_the_next_borrower() {
    let Some(db) = support::TestDatabase::create("a_request_cancelled_inside_begin").await else {
        return;
    };
    let name = "graviton-probe:cancel";
    let mut direct = connect(db.url(), "probe-direct").await;
    sqlx::query("CREATE TABLE probe (v int NOT NULL)")
        .execute(&mut direct)
        .await
        .unwrap();
    let proxy = PgProxy::start(upstream_of(db.url())).await;
    let url = url_through(db.url(), proxy.port);
    // One connection, so the next borrower gets the very connection the cancel touched.
    let pool = graviton::storage::pg::connect_pool(&url, 1, Duration::from_secs(5), name)
        .await
        .unwrap();
    sqlx::query("SELECT 1").execute(&pool).await.unwrap();
    // The check keeps a healthy connection: the same backend serves call after call.
    let pid = || async {
        sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let first = pid().await;
    for _ in 0..3 {
        assert_eq!(pid().await, first, "a healthy connection was closed");
    }

    // The answer that carries `BEGIN`'s command tag is held (the pool's ping before the
    // acquire passes), so the server has run `BEGIN` and the client is waiting for it.
    proxy.set(
        name,
        Direction::ToClient,
        Fault::HoldFrom(std::sync::Arc::new(b"BEGIN".to_vec())),
    );
    let begin = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.begin().await.map(|_| ()) })
    };
    let caught = support::wait_until(Duration::from_secs(10), || async {
        proxy.held(name, true) > 0
    })
    .await;
    assert!(caught, "the answer to BEGIN was never caught");
    begin.abort();
    assert!(
        begin.await.unwrap_err().is_cancelled(),
        "begin finished before it was cancelled"
    );
    proxy.heal();

    sqlx::query("INSERT INTO probe VALUES (1)")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        committed(&mut direct, 1).await,
        1,
        "an acknowledged autocommit insert is not committed: it ran inside the transaction \
         of the cancelled BEGIN"
    );
    assert_eq!(idle_in_transaction(&mut direct, name).await, 0);

    // The sweep: a transaction dropped after `cut` ms, for cuts across its whole life.
    proxy.set(
        name,
        Direction::Both,
        Fault::Delay(Duration::from_millis(15)),
    );
    let mut dropped = 0;
    for (i, cut) in (1..=140u64).step_by(3).enumerate() {
        let i = i as i32 + 100;
        let pool2 = pool.clone();
        let attempt = tokio::time::timeout(Duration::from_millis(cut), async move {
            let mut tx = pool2.begin().await?;
            sqlx::query("INSERT INTO probe VALUES (0)")
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        })
        .await;
        if attempt.is_err() {
            dropped += 1;
        }
        sqlx::query("INSERT INTO probe VALUES ($1)")
            .bind(i)
            .execute(&pool)
            .await
            .unwrap();
        assert_eq!(
            committed(&mut direct, i).await,
            1,
            "an acknowledged insert after a transaction dropped at {cut} ms is not committed"
        );
    }
    assert!(dropped >= 10, "only {dropped} transactions were cut short");
    proxy.heal();
    assert_eq!(idle_in_transaction(&mut direct, name).await, 0);
}
