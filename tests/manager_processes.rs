//! The standalone manager (`graviton manager`) as a real process, with nodes that run no
//! embedded manager (blocks on the test S3 server): after its lock connection is killed it
//! takes the lock again and keeps acting (issue 9, item 3), so a node killed afterwards is
//! still evacuated, and a blob that node stored is still read from the other one. Checks
//! LOC-3.

mod support;

use std::process::Command;
use std::time::Duration;

use graviton::ids::{SessionId, SessionKey, TenantId};
use graviton::placement::hash::shard_of;
use support::cluster::NodeProcess;
use support::process::{BIN, Graviton};

const SHARDS: u32 = 16;

/// The cluster status, or an empty one while the database is not bootstrapped yet.
async fn status(url: &str) -> graviton::cli::ClusterStatus {
    match graviton::cli::cluster_status(url).await {
        Ok(status) => status,
        Err(_) => graviton::cli::ClusterStatus {
            shard_count: 0,
            manager_term: graviton::placement::Term(0),
            manager_node: None,
            nodes: Vec::new(),
            unassigned_shards: usize::MAX,
            moving_shards: 0,
            shards: Vec::new(),
        },
    }
}

/// Upload `data` through `url` in session `key` (a documented retryable answer is retried,
/// `support::cluster::upload_retrying`); the 201 answer's body.
async fn upload(url: &str, key: &SessionKey, data: &[u8]) -> serde_json::Value {
    let response = support::cluster::upload_retrying(url, key, data.to_vec()).await;
    assert_eq!(response.status(), 201, "upload through {url}");
    response.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_manager_that_loses_its_lock_takes_it_again_and_keeps_acting() {
    let test = "a_standalone_manager_that_loses_its_lock_takes_it_again_and_keeps_acting";
    let Some(db) =
        support::TestDatabase::create("a_standalone_manager_that_loses_its_lock_takes_it_again")
            .await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("manager-processes-{}", support::unique_suffix());
    let url = db.url().to_string();
    let start = |id: &str| {
        let data = support::cluster::s3_node_data_dir(dir.path(), id);
        let storage = support::cluster::s3_storage_toml(test, &data, &prefix, "")?;
        Some(NodeProcess::start_config(
            dir.path(),
            id,
            &url,
            SHARDS,
            &storage,
            "embedded_manager = false",
            "",
        ))
    };
    let Some(a) = start("node-a") else {
        return;
    };
    let Some(mut b) = start("node-b") else {
        return;
    };
    // The manager's config: node-a's, under its own node id.
    let manager_config = dir.path().join("manager.toml");
    std::fs::write(
        &manager_config,
        std::fs::read_to_string(&a.config)
            .unwrap()
            .replace("id = \"node-a\"", "id = \"manager\""),
    )
    .unwrap();
    let mut command = Command::new(BIN);
    command
        .args(["manager", "--config"])
        .arg(&manager_config)
        .env("RUST_LOG", "info");
    let mut manager = Graviton::spawn(dir.path().join("manager.log"), command);
    let manager_log = || std::fs::read_to_string(dir.path().join("manager.log")).unwrap();

    let converged = support::wait_until(Duration::from_secs(60), || {
        let url = url.clone();
        async move {
            let s = status(&url).await;
            s.manager_node.as_deref() == Some("manager")
                && s.unassigned_shards == 0
                && s.nodes.iter().filter(|n| n.shards > 0).count() == 2
        }
    })
    .await;
    assert!(converged, "no convergence; manager log:\n{}", manager_log());
    let term = status(&url).await.manager_term;

    // A blob stored by node-b (its session's owner), uploaded through node-a; a session
    // whose shard moved meanwhile (a rebalance may still run) is tried again.
    let mut stored = None;
    for seed in 0..5 {
        // New bytes each time: a retry must not deduplicate against the last attempt.
        let blob = support::node::random_bytes(100_000, seed);
        let table = status(&url).await;
        let owned_by_b = |key: &SessionKey| {
            let shard = shard_of(key, SHARDS);
            table.shards.iter().any(|s| {
                s.shard == shard && s.owner.as_ref().is_some_and(|o| o.as_str() == "node-b")
            })
        };
        let session = (0..10_000)
            .map(|_| SessionKey {
                tenant: TenantId::new_random(),
                session: SessionId::new_random(),
            })
            .find(owned_by_b);
        let Some(session) = session else {
            continue; // no table read (or node-b owns nothing right now)
        };
        let body = upload(&a.url, &session, &blob).await;
        if body["owner"] == "node-b" {
            stored = Some((body["key"].as_str().expect("blob key").to_string(), blob));
            break;
        }
    }
    let (blob_key, blob) = stored.expect("a blob stored by node-b");

    // Kill the manager's lock connection (the backend holding the advisory lock in this
    // test's database; other tests run their own managers on the same server).
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(killed, vec![true], "exactly the manager's lock connection");

    let reacquired = support::wait_until(Duration::from_secs(20), || {
        let url = url.clone();
        async move {
            let s = status(&url).await;
            s.manager_term > term && s.manager_node.as_deref() == Some("manager")
        }
    })
    .await;
    assert!(
        reacquired,
        "the standalone manager did not take its lock again; log:\n{}",
        manager_log()
    );
    assert!(
        manager.exited().is_none(),
        "the manager process must keep running"
    );

    // It still acts: node-b killed with kill -9 is evacuated to node-a.
    b.kill9();
    let evacuated = support::wait_until(Duration::from_secs(30), || {
        let url = url.clone();
        async move {
            let s = status(&url).await;
            s.unassigned_shards == 0
                && s.moving_shards == 0
                && s.nodes
                    .iter()
                    .any(|n| n.id.as_str() == "node-a" && n.shards == SHARDS as usize)
        }
    })
    .await;
    assert!(
        evacuated,
        "node-b's shards were not moved; log:\n{}",
        manager_log()
    );
    // node-b's blob is read from node-a: its blocks are in the bucket, on no node's disk.
    let (code, got) = support::download(&a.url, &blob_key).await;
    assert_eq!(code, 200, "read node-b's blob from node-a");
    assert!(got == blob, "node-b's blob differs when read from node-a");
    support::cluster::assert_packs_in_bucket_only(dir.path(), &["node-a", "node-b"], &prefix, 1)
        .await;
    admin.close().await;
    drop(a);
}

/// PG-1 and LOC-3 on real processes: the acting manager is stopped (SIGSTOP, by its own
/// test hook) inside its round's fenced transaction, which holds `FOR SHARE` on
/// `placement_meta`. A standby must win the lock, bump the term (which waits on that
/// share lock until the server ends the stopped session) and act: the stopped node is
/// declared dead and every shard moves to the standby. Without the server-side bound the
/// term bump waited for hours. Prints how long it took from the standby's start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manager_stopped_inside_its_round_transaction_is_replaced() {
    let Some(db) =
        support::TestDatabase::create("a_manager_stopped_inside_its_round_transaction").await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let url = db.url().to_string();
    let data = dir.path().join("shared");
    let mut a = NodeProcess::start(dir.path(), "node-a", &url, SHARDS, &data);
    // The first node wins the manager lock; its next round stops inside the transaction.
    let admin = support::placement::store(&url).await;
    let managing = support::wait_until(Duration::from_secs(60), || {
        let url = url.clone();
        async move { status(&url).await.manager_node.as_deref() == Some("node-a") }
    })
    .await;
    assert!(managing, "node-a never managed; log:\n{}", a.log_text());
    a.restart_with_env(&[("GRAVITON_TEST_STOP_AFTER", "manager round fenced")]);
    let pid = a.pid().unwrap();
    let stopped = support::wait_until(Duration::from_secs(60), || async move {
        support::process_stopped(pid)
    })
    .await;
    assert!(
        stopped,
        "node-a did not stop in a round; log:\n{}",
        a.log_text()
    );
    assert!(
        a.log_text().contains("stopping after manager round fenced"),
        "node-a stopped elsewhere"
    );
    // The stopped session is idle inside its transaction, holding its locks.
    let in_tx: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND state = 'idle in transaction'
           AND application_name LIKE 'graviton-%:node-a'",
    )
    .fetch_one(admin.pool())
    .await
    .unwrap();
    assert!(in_tx >= 1, "the stopped manager holds no open transaction");
    let term = status(&url).await.manager_term;

    let started = std::time::Instant::now();
    let b = NodeProcess::start(dir.path(), "node-b", &url, SHARDS, &data);
    let replaced = support::wait_until(Duration::from_secs(60), || {
        let url = url.clone();
        async move {
            let s = status(&url).await;
            s.manager_node.as_deref() == Some("node-b")
                && s.manager_term > term
                && s.unassigned_shards == 0
                && s.moving_shards == 0
                && s.nodes
                    .iter()
                    .any(|n| n.id.as_str() == "node-b" && n.shards == SHARDS as usize)
        }
    })
    .await;
    assert!(
        replaced,
        "the standby never acted while the old manager was stopped; log:\n{}",
        b.log_text()
    );
    eprintln!(
        "standby acting with every shard {:?} after it started (node_ttl 1 s, statement_timeout 2 s)",
        started.elapsed()
    );
    // Resumed, the old manager finds its transaction gone and its term superseded.
    if let Some(pid) = a.pid() {
        unsafe {
            libc::kill(pid as i32, libc::SIGCONT);
        }
    }
    drop(b);
    drop(a);
    admin.pool().close().await;
}
