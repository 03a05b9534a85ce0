//! An owner paused inside its commit, on real processes (issue 25, item 3, second target).
//!
//! Three `graviton serve` processes on one database, blocks on the test S3 server (the
//! shared block index in PostgreSQL). One owner is stopped (SIGSTOP, by its own test hook
//! step `commit fenced`) inside its commit transaction while that transaction holds the
//! fence's `FOR SHARE` on its shard row and the row locks of the deduplicated blocks it
//! confirmed; then another node is killed with kill -9. The session bounds (PG-1) must
//! end the stopped transaction, so the manager's rounds are no longer rolled back on that
//! row: the killed node's shards move, and an upload to the third node that deduplicates
//! the same blocks succeeds. Checks PG-1 and LOC-3.

mod support;

use std::time::{Duration, Instant};

use graviton::ids::{SessionId, SessionKey, TenantId};
use graviton::placement::hash::shard_of;
use support::cluster::NodeProcess;

const SHARDS: u32 = 16;

async fn status(url: &str) -> Option<graviton::cli::ClusterStatus> {
    graviton::cli::cluster_status(url).await.ok()
}

/// A new session whose shard `node` owns in `table`, if it owns any.
fn session_owned_by(table: &graviton::cli::ClusterStatus, node: &str) -> Option<SessionKey> {
    (0..10_000)
        .map(|_| SessionKey {
            tenant: TenantId::new_random(),
            session: SessionId::new_random(),
        })
        .find(|key| {
            let shard = shard_of(key, SHARDS);
            table
                .shards
                .iter()
                .any(|s| s.shard == shard && s.owner.as_ref().is_some_and(|o| o.as_str() == node))
        })
}

/// Upload `data` through `url` in a session `node` owns (a session whose shard moved
/// meanwhile is tried again with a new one); the 201 body.
async fn upload_owned(db: &str, url: &str, node: &str, data: &[u8]) -> serde_json::Value {
    for _ in 0..10 {
        let table = status(db).await.expect("cluster status");
        let key = session_owned_by(&table, node).expect("a shard of the node");
        let response = support::cluster::upload_retrying(url, &key, data.to_vec()).await;
        assert_eq!(response.status(), 201, "upload through {url}");
        let body: serde_json::Value = response.json().await.unwrap();
        if body["owner"] == node {
            return body;
        }
    }
    panic!("no upload owned by {node} through {url}");
}

/// The current owners' shard counts: `(node, shards)`.
fn counts(s: &graviton::cli::ClusterStatus) -> Vec<(String, usize)> {
    s.nodes
        .iter()
        .map(|n| (n.id.as_str().to_string(), n.shards))
        .collect()
}

// Checks PG-1 and LOC-3: an owner stopped inside its fenced, deduplicating commit holds
// row locks only within the session bounds; another node's shards still move and a
// deduplicating upload elsewhere succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_stopped_inside_its_commit_blocks_no_move_and_no_dedup() {
    let test = "an_owner_stopped_inside_its_commit_blocks_no_move_and_no_dedup";
    let Some(db) = support::TestDatabase::create("an_owner_stopped_inside_its_commit").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("owner-processes-{}", support::unique_suffix());
    let url = db.url().to_string();
    let start =
        |id: &str| NodeProcess::start_on_s3(test, dir.path(), id, &url, SHARDS, &prefix, "");
    // node-c starts first and becomes the manager (it is never stopped).
    let Some(c) = start("node-c") else {
        return;
    };
    let managing = support::wait_until(Duration::from_secs(60), || {
        let url = url.clone();
        async move {
            status(&url)
                .await
                .is_some_and(|s| s.manager_node.as_deref() == Some("node-c"))
        }
    })
    .await;
    assert!(managing, "node-c never managed; log:\n{}", c.log_text());
    let mut a = start("node-a").expect("S3 checked above");
    let mut b = start("node-b").expect("S3 checked above");
    // node-a stops itself inside its first fenced commit.
    a.restart_with_env(&[("GRAVITON_TEST_STOP_AFTER", "commit fenced")]);
    let converged = support::wait_until(Duration::from_secs(60), || {
        let url = url.clone();
        async move {
            status(&url).await.is_some_and(|s| {
                s.manager_node.as_deref() == Some("node-c")
                    && s.unassigned_shards == 0
                    && s.moving_shards == 0
                    && ["node-a", "node-b", "node-c"]
                        .iter()
                        .all(|id| s.nodes.iter().any(|n| n.id.as_str() == *id && n.shards > 0))
            })
        }
    })
    .await;
    assert!(
        converged,
        "no convergence: {:?}; node-a log:\n{}",
        status(&url).await.map(|s| counts(&s)),
        a.log_text()
    );

    // The blocks: stored by node-c. Then node-a deduplicates them in its commit.
    let base = support::node::random_bytes(3 << 20, 25_001);
    let stored = upload_owned(&url, &c.url, "node-c", &base).await;
    let with_suffix = |seed: u64| {
        let mut data = base.clone();
        data.extend_from_slice(&support::node::random_bytes(200_000, seed));
        data
    };
    let paused_data = with_suffix(25_002);
    // A session node-a owns, uploaded to node-a: its commit stops the process. A shard
    // that moved away meanwhile (the rebalance may still run) forwards the upload to its
    // new owner instead: tried again with another session then.
    let pid = a.pid().unwrap();
    let mut paused = None;
    for _ in 0..10 {
        let table = status(&url).await.expect("status");
        let Some(key) = session_owned_by(&table, "node-a") else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let a_url = a.url.clone();
        let data = paused_data.clone();
        let upload = tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap();
            let response = client
                .post(format!("{a_url}/v1/blobs"))
                .header("x-graviton-tenant-id", key.tenant.to_string())
                .header("x-graviton-upload-session-id", key.session.to_string())
                .body(data)
                .send()
                .await;
            match response {
                Ok(r) => {
                    let code = r.status().as_u16();
                    (code, r.json::<serde_json::Value>().await.ok())
                }
                Err(_) => (0, None),
            }
        });
        // The fault, confirmed: node-a is stopped (process state) at the hook step ...
        let stopped = support::wait_until(Duration::from_secs(30), || async {
            support::process_stopped(pid) || upload.is_finished()
        })
        .await;
        if stopped && support::process_stopped(pid) {
            paused = Some((key, upload));
            break;
        }
        let answer = upload.await.unwrap();
        eprintln!("an upload to node-a did not stop it (shard moved?): {answer:?}");
    }
    let (paused_key, paused_upload) = paused
        .unwrap_or_else(|| panic!("node-a never stopped in a commit; log:\n{}", a.log_text()));
    let paused_shard = shard_of(&paused_key, SHARDS);
    let stopped_at = Instant::now();
    assert!(
        a.log_text()
            .contains("stopping after commit fenced (GRAVITON_TEST_STOP_AFTER)"),
        "node-a stopped elsewhere; log:\n{}",
        a.log_text()
    );
    // ... and its session holds the fence's share lock and the dedup update's locks.
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let held: Vec<(String, String)> = sqlx::query_as(
        "SELECT l.relation::regclass::text, l.mode FROM pg_locks l
         JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE a.datname = current_database() AND a.application_name = 'graviton-blocks:node-a'
           AND a.state = 'idle in transaction' AND l.granted AND l.locktype = 'relation'",
    )
    .fetch_all(&admin)
    .await
    .unwrap();
    let holds = |rel: &str, mode: &str| held.iter().any(|(r, m)| r == rel && m == mode);
    assert!(
        holds("placement_shards", "RowShareLock") && holds("pack_blocks", "RowExclusiveLock"),
        "the stopped owner's transaction holds {held:?}"
    );
    // Row level: the fenced shard row and some block row cannot be locked now.
    let shard_row =
        sqlx::query("SELECT 1 FROM placement_shards WHERE shard = $1 FOR UPDATE NOWAIT")
            .bind(paused_shard.0 as i32)
            .execute(&admin)
            .await;
    let block_rows = sqlx::query("SELECT 1 FROM pack_blocks FOR UPDATE NOWAIT")
        .execute(&admin)
        .await;
    let lock_unavailable = |r: &Result<sqlx::postgres::PgQueryResult, sqlx::Error>| matches!(r, Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03"));
    assert!(
        lock_unavailable(&shard_row) && lock_unavailable(&block_rows),
        "row locks not held: shard row {shard_row:?}, block rows {block_rows:?}"
    );

    // Another node killed with kill -9: its shards must move (node_ttl 1 s + 2 s).
    b.kill9();
    let killed_at = Instant::now();
    let moved = support::wait_until(Duration::from_secs(60), || {
        let url = url.clone();
        async move {
            status(&url).await.is_some_and(|s| {
                s.unassigned_shards == 0
                    && s.moving_shards == 0
                    && s.shards
                        .iter()
                        .all(|e| e.owner.as_ref().is_some_and(|o| o.as_str() == "node-c"))
            })
        }
    })
    .await;
    let took = killed_at.elapsed();
    assert!(
        moved,
        "the killed node's shards never moved while an owner was stopped in its commit: {:?}; \
         node-c log:\n{}",
        status(&url).await.map(|s| counts(&s)),
        c.log_text()
    );
    eprintln!(
        "every shard on node-c {took:?} after kill -9 of node-b ({:?} after node-a stopped; \
         node_ttl 1 s, statement_timeout 2 s, bound node_ttl + 2 s = 3 s)",
        stopped_at.elapsed()
    );

    // An upload to the third node that deduplicates the same blocks succeeds.
    let dedup = with_suffix(25_003);
    let body = upload_owned(&url, &c.url, "node-c", &dedup).await;
    eprintln!("deduplicating upload on node-c: {body}");
    assert!(
        body["duplicate_blocks"].as_u64().unwrap() > 0,
        "the upload on node-c deduplicated nothing: {body}"
    );
    let (code, got) = support::download(&c.url, body["key"].as_str().unwrap()).await;
    assert_eq!(code, 200);
    assert!(got == dedup, "the deduplicated blob differs");
    let (code, got) = support::download(&c.url, stored["key"].as_str().unwrap()).await;
    assert_eq!(code, 200);
    assert!(got == base, "the base blob differs");

    // Resumed, node-a's commit finds its session gone: its upload is not acknowledged,
    // or (if it is) it downloads exactly.
    unsafe {
        libc::kill(pid as i32, libc::SIGCONT);
    }
    let (code, answer) = paused_upload.await.unwrap();
    eprintln!("the paused upload answered {code}: {answer:?}");
    if code == 201 {
        let key = answer.as_ref().and_then(|a| a["key"].as_str()).unwrap();
        let (code, got) = support::download(&c.url, key).await;
        assert_eq!(code, 200, "an acknowledged upload must be readable");
        assert!(got == paused_data, "the acknowledged paused upload differs");
    }
    admin.close().await;
    drop((a, b, c));
}
