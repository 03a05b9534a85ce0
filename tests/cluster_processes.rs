//! A three-node cluster of real `graviton serve` processes on one PostgreSQL database,
//! with blocks on the test S3 server (Garage, `GRAVITON_TEST_S3_*` from
//! scripts/services.sh): each process has a data directory of its own, the cluster one
//! key prefix in the bucket, so a blob written by one node is read by the others through
//! S3 and the block index in PostgreSQL, not through a shared directory. Session
//! stickiness, forwarding of a 64 MiB upload to its owner, reads from every node, drain
//! through the CLI, kill -9 of a node, kill -9 of the manager's process, a second
//! standalone manager failing closed, and a restart of every node.

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use graviton::cas::BlobKey;
use graviton::ids::{NodeId, SessionId, SessionKey, TenantId};
use support::client;
use support::cluster::{BIN, NodeProcess, is_ready, upload_retrying, wait_converged};
use support::node::random_bytes;

const SHARDS: u32 = 32;

async fn owners(url: &str) -> graviton::cli::ClusterStatus {
    graviton::cli::cluster_status(url)
        .await
        .expect("cluster status")
}

fn owner_of(status: &graviton::cli::ClusterStatus, key: &SessionKey) -> Option<NodeId> {
    support::cluster::owner_of(status, SHARDS, key)
}

fn session() -> SessionKey {
    SessionKey {
        tenant: TenantId::new_random(),
        session: SessionId::new_random(),
    }
}

/// Sessions until every node owns at least one of them.
fn sessions_covering(
    status: &graviton::cli::ClusterStatus,
    nodes: &[&str],
) -> HashMap<String, SessionKey> {
    let mut found = HashMap::new();
    while found.len() < nodes.len() {
        let key = session();
        if let Some(owner) = owner_of(status, &key) {
            found.entry(owner.to_string()).or_insert(key);
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_forward_drain_fail_over_and_restart() {
    let Some(db) =
        support::TestDatabase::create("three_processes_forward_drain_fail_over_and_restart").await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let db_url = db.url().to_string();
    let db_url = db_url.as_str();
    let names = ["node-a", "node-b", "node-c"];
    let prefix = format!("cluster-processes-{}", support::unique_suffix());
    let Some(mut nodes) = names
        .iter()
        .map(|id| {
            NodeProcess::start_on_s3(
                "three_processes_forward_drain_fail_over_and_restart",
                dir.path(),
                id,
                db_url,
                SHARDS,
                &prefix,
                "",
            )
        })
        .collect::<Option<Vec<NodeProcess>>>()
    else {
        return;
    };

    // Every node becomes ready (owns shards) and the table covers every shard.
    let refs: Vec<&NodeProcess> = nodes.iter().collect();
    wait_converged(
        &refs,
        db_url,
        "the shards settled, balanced within one",
        |status| {
            let counts: Vec<usize> = status.nodes.iter().map(|n| n.shards).collect();
            let (min, max) = (
                counts.iter().min().copied().unwrap_or(0),
                counts.iter().max().copied().unwrap_or(0),
            );
            status.unassigned_shards == 0 && status.moving_shards == 0 && min > 0 && max - min <= 1
        },
    )
    .await;
    let status = owners(db_url).await;
    let by_owner = sessions_covering(&status, &names);

    // A 64 MiB upload sent to a non-owner lands on the owner, byte-exact, readable everywhere.
    let (owner_id, key) = by_owner
        .iter()
        .next()
        .map(|(o, k)| (o.clone(), *k))
        .unwrap();
    let front = nodes.iter().find(|n| n.id != owner_id).unwrap();
    let big = random_bytes(64 << 20, 31);
    let response = upload_retrying(&front.url, &key, big.clone()).await;
    let status = response.status();
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(status, 201, "{body}");
    assert_eq!(
        body["owner"],
        owner_id.as_str(),
        "the owner ingests, not the front node"
    );
    assert_eq!(body["key"], BlobKey::of(&big).to_string());
    for node in &nodes {
        let got = client()
            .get(format!(
                "{}/v1/blobs/{}",
                node.url,
                body["key"].as_str().unwrap()
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(got.status(), 200, "read from {}", node.id);
        assert!(
            got.bytes().await.unwrap()[..] == big[..],
            "bytes differ when read from {}",
            node.id
        );
    }
    // The blocks are in the bucket (64 MiB in 8 MiB packs), not in a node's directory:
    // the other nodes read them through S3 and the block index in PostgreSQL.
    support::cluster::assert_packs_in_bucket_only(dir.path(), &names, &prefix, 8).await;

    // Sticky: the same session from every node goes to the same owner.
    for (owner, key) in &by_owner {
        for node in &nodes {
            let response = upload_retrying(&node.url, key, random_bytes(10_000, 7)).await;
            let status = response.status();
            let body: serde_json::Value = response.json().await.unwrap();
            assert_eq!(status, 201, "from {}: {body}", node.id);
            assert_eq!(body["owner"], owner.as_str());
        }
    }

    // A second standalone manager fails closed while an embedded manager holds the lock.
    let second = std::process::Command::new(BIN)
        .args(["manager", "--config"])
        .arg(&nodes[0].config)
        .output()
        .unwrap();
    assert_eq!(
        second.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    assert!(
        String::from_utf8_lossy(&second.stderr).contains("another shard manager holds the lock")
    );

    // Drain node-b through the CLI and wait: when it returns, node-b holds no shard
    // (read once, no polling here), and its sessions resolve to survivors.
    let started = Instant::now();
    let drain = std::process::Command::new(BIN)
        .args(["drain", "node-b", "--wait", "--timeout", "20s", "--config"])
        .arg(&nodes[0].config)
        .output()
        .unwrap();
    assert!(
        drain.status.success(),
        "{}",
        String::from_utf8_lossy(&drain.stderr)
    );
    assert!(String::from_utf8_lossy(&drain.stdout).contains("node-b drained"));
    let status = owners(db_url).await;
    let b = status.nodes.iter().find(|n| n.id.as_str() == "node-b");
    assert_eq!(b.map(|n| n.shards), Some(0), "drain --wait returned early");
    assert!(
        status
            .shards
            .iter()
            .all(|s| s.moving_to.as_ref().is_none_or(|m| m.as_str() != "node-b")),
        "a shard is still moving to node-b"
    );
    eprintln!(
        "DRILL drain (CLI request to all shards moved): {:?}",
        started.elapsed()
    );
    let b_session = by_owner["node-b"];
    let response = upload_retrying(&nodes[0].url, &b_session, b"after drain".to_vec()).await;
    assert_eq!(response.status(), 201);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_ne!(body["owner"], "node-b");

    // kill -9 of the manager's process: a standby takes over with a higher term.
    let before = owners(db_url).await;
    let manager = before.manager_node.clone().expect("a manager is acting");
    let term = before.manager_term;
    let killed = Instant::now();
    nodes.iter_mut().find(|n| n.id == manager).unwrap().kill9();
    let took_over = support::wait_until(Duration::from_secs(30), || async {
        let now = owners(db_url).await;
        now.manager_term > term && now.manager_node.as_deref().is_some_and(|m| m != manager)
    })
    .await;
    assert!(
        took_over,
        "no standby manager took over after kill -9 of {manager}"
    );
    eprintln!(
        "DRILL manager kill -9 to new manager acting: {:?}",
        killed.elapsed()
    );

    // The killed node's shards are served elsewhere after the node TTL.
    let reassigned = support::wait_until(Duration::from_secs(30), || async {
        owners(db_url)
            .await
            .nodes
            .iter()
            .filter(|n| n.id.as_str() == manager)
            .all(|n| n.shards == 0)
    })
    .await;
    assert!(reassigned, "shards of the killed node were not reassigned");
    eprintln!(
        "DRILL node kill -9 to shards reassigned: {:?}",
        killed.elapsed()
    );
    let survivor = nodes
        .iter()
        .find(|n| n.id != manager && n.pid().is_some())
        .unwrap();
    let dead_session = by_owner[&manager];
    let response = upload_retrying(&survivor.url, &dead_session, b"after kill".to_vec()).await;
    assert_eq!(response.status(), 201, "{:?}", response.text().await);

    // Every node restarts; placement and blobs survive.
    let table_before: Vec<_> = owners(db_url)
        .await
        .shards
        .iter()
        .map(|s| (s.shard, s.epoch))
        .collect();
    for node in nodes.iter_mut() {
        node.restart();
    }
    let refs: Vec<&NodeProcess> = nodes.iter().collect();
    wait_converged(
        &refs,
        db_url,
        "every node back after a full restart",
        |_| true,
    )
    .await;
    let after = owners(db_url).await;
    for (shard, epoch) in table_before {
        let now = after.shards.iter().find(|s| s.shard == shard).unwrap();
        assert!(now.epoch >= epoch, "epochs never go backwards");
    }
    let got = client()
        .get(format!("{}/v1/blobs/{}", nodes[2].url, BlobKey::of(&big)))
        .send()
        .await
        .unwrap();
    assert_eq!(got.status(), 200);

    // SIGTERM drains and exits cleanly.
    let status = nodes[1].terminate().expect("exit status");
    assert!(status.success(), "exit status {status}");
}

#[tokio::test]
async fn internal_listener_refuses_unauthenticated_requests_before_the_body() {
    let Some(db) = support::TestDatabase::create(
        "internal_listener_refuses_unauthenticated_requests_before_the_body",
    )
    .await
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("cluster-processes-{}", support::unique_suffix());
    let Some(node) = NodeProcess::start_on_s3(
        "internal_listener_refuses_unauthenticated_requests_before_the_body",
        dir.path(),
        "solo",
        db.url(),
        8,
        &prefix,
        "",
    ) else {
        return;
    };
    let http = client();
    assert!(
        support::wait_until(Duration::from_secs(60), || is_ready(&http, &node.url)).await,
        "{}",
        node.log_text()
    );
    let key = session();
    let request = format!(
        "POST /internal/v1/sessions/{}/{}/blobs HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\nX-Graviton-Internal-Token: wrong-token-wrong-token-wrong-token\r\nX-Graviton-Shard: 0\r\nX-Graviton-Shard-Epoch: 1\r\n\r\n0123456789",
        key.tenant, key.session
    );
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", node.internal).parse().unwrap();
    let (_stream, answer) = support::node::raw_exchange(addr, request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
}
