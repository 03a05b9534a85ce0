//! One cluster lease per forwarded upload, with two real `graviton serve` processes on one
//! PostgreSQL database and one real `redis-server`, cluster `tenant_transfers = 1`.
//!
//! Checks ADM-1 (one lease per transfer across hops) and ADM-2 (a forwarded upload is
//! refused by the owner's admission before the edge reads a byte, with the owner's code
//! and `Retry-After`).

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use graviton::admission::acquire::wait_for_lease;
use graviton::admission::{Footprint, Operation, Outcome};
use graviton::cas::chunker::MAX_CHUNK;
use graviton::ids::{SessionKey, TenantId};
use graviton::storage::redis::{LeaseId, LeaseRequest, RedisCoordinator};
use support::client;
use support::cluster::{NodeProcess, all_nodes_own_shards, session_owned_by, wait_converged};
use support::node::{random_bytes, raw_exchange};

const SHARDS: u32 = 8;

fn admission_toml(redis_url: &str, cell: &str) -> String {
    format!(
        r#"[admission]
acquisition_timeout = "3s"

[admission.redis]
url = "{redis_url}"
cell = "{cell}"
lease_ttl = "3s"
renew_interval = "1s"
wait = "2s"
retry_interval = "20ms"
tenant_transfers = 1
"#
    )
}

async fn upload(url: &str, key: &SessionKey, data: Vec<u8>) -> reqwest::Response {
    tokio::time::timeout(
        Duration::from_secs(30),
        client()
            .post(format!("{url}/v1/blobs"))
            .header("x-graviton-tenant-id", key.tenant.to_string())
            .header("x-graviton-upload-session-id", key.session.to_string())
            .body(data)
            .send(),
    )
    .await
    .expect("upload answered in time")
    .unwrap()
}

/// Events of one tenant, oldest first.
async fn tenant_events(
    coordinator: &RedisCoordinator,
    tenant: &TenantId,
) -> Vec<BTreeMap<String, String>> {
    let hash = coordinator.hasher().tenant(tenant);
    coordinator
        .recent_events(1000)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.get("tenant") == Some(&hash))
        .collect()
}

fn kinds(events: &[BTreeMap<String, String>]) -> Vec<(String, String)> {
    events
        .iter()
        .map(|e| (e["kind"].clone(), e["operation"].clone()))
        .collect()
}

// Checks ADM-1, ADM-2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_upload_takes_one_lease_and_owner_refusals_reach_the_client() {
    let test = "a_forwarded_upload_takes_one_lease_and_owner_refusals_reach_the_client";
    let Some(db) = support::TestDatabase::create(test).await else {
        return;
    };
    let Some(redis) = support::RedisServer::start(test) else {
        return;
    };
    let cell = format!("fwd-{}", support::unique_suffix());
    let extra = admission_toml(&redis.url(), &cell);
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("admission-forward-{}", support::unique_suffix());
    let db_url = db.url().to_string();
    let Some(nodes) = ["node-a", "node-b"]
        .iter()
        .map(|id| NodeProcess::start_on_s3(test, dir.path(), id, &db_url, SHARDS, &prefix, &extra))
        .collect::<Option<Vec<NodeProcess>>>()
    else {
        return;
    };
    let refs: Vec<&NodeProcess> = nodes.iter().collect();
    wait_converged(
        &refs,
        &db_url,
        "both nodes ready, each owning shards",
        all_nodes_own_shards,
    )
    .await;
    let status = graviton::cli::cluster_status(&db_url).await.unwrap();
    // A session owned by node-b, sent to node-a.
    let owned_by_b = || session_owned_by(&status, SHARDS, "node-b");
    let front = &nodes[0];
    let coordinator = support::admission::coordinator(redis.url(), cell.clone());

    // 1. Forwarded with tenant_transfers = 1: admitted (it used to wait out `wait` and get
    //    503, because the relay and the owner each took a lease).
    let key = owned_by_b();
    let response = upload(&front.url, &key, random_bytes(8 << 20, 5)).await;
    assert_eq!(response.status(), 201);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["owner"], "node-b", "ingested by the owner");
    // The owner releases the lease just after it answered: wait for `completed`.
    support::wait_for(Duration::from_secs(10), "the lease to be released", || {
        let coordinator = coordinator.clone();
        async move {
            tenant_events(&coordinator, &key.tenant)
                .await
                .iter()
                .any(|e| e["kind"] == "completed")
        }
    })
    .await;
    let events = tenant_events(&coordinator, &key.tenant).await;
    assert_eq!(
        kinds(&events),
        [
            ("admitted".to_string(), "upload".to_string()),
            ("completed".to_string(), "upload".to_string())
        ],
        "exactly one lease for the whole transfer: {events:?}"
    );
    let spanning = Footprint::for_operation(Operation::Upload, MAX_CHUNK as u64).bytes()
        + Footprint::for_operation(Operation::ForwardedUpload, MAX_CHUNK as u64).bytes();
    assert_eq!(
        events[0]["bytes"],
        spanning.to_string(),
        "the lease covers owner and relay"
    );
    assert_eq!(events[0]["tenant_transfers"], "1");
    assert_eq!(events[1]["outcome"], "completed");
    let snapshot = coordinator.snapshot(Some(&key.tenant), None).await.unwrap();
    assert_eq!(snapshot.occupancy.tenant_transfers, Some(0));

    // 2. The tenant's one transfer is taken elsewhere: the owner refuses in the pre-flight
    //    and the client gets the owner's 503 and Retry-After, although it never sent a
    //    byte of its body (so the edge cannot have read one).
    let key = owned_by_b();
    let holder = LeaseRequest {
        lease_id: LeaseId::random(),
        tenant: Some(key.tenant),
        backend: "fs".into(),
        bytes: 1024,
        operation: Operation::Upload.as_str(),
    };
    let lease = wait_for_lease(
        &coordinator,
        &holder,
        Duration::from_millis(50),
        tokio::time::Instant::now() + Duration::from_secs(2),
    )
    .await
    .unwrap();
    let head = format!(
        "POST /v1/blobs HTTP/1.1\r\nHost: graviton\r\nContent-Length: 8388608\r\n\
         X-Graviton-Tenant-Id: {}\r\nX-Graviton-Upload-Session-Id: {}\r\n\r\n",
        key.tenant, key.session
    );
    let addr: std::net::SocketAddr = front.url.trim_start_matches("http://").parse().unwrap();
    let (_stream, answer) = raw_exchange(addr, head.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("transfer_admission_busy"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: "),
        "{answer}"
    );
    let events = tenant_events(&coordinator, &key.tenant).await;
    let operations: Vec<_> = kinds(&events).into_iter().map(|(_, op)| op).collect();
    assert!(
        operations.iter().all(|op| op == "upload"),
        "no relay lease is ever taken: {events:?}"
    );
    assert!(
        events
            .iter()
            .any(|e| e["kind"] == "queued" && e["outcome"] == "tenant_transfers"),
        "{events:?}"
    );
    coordinator
        .release(&holder.lease_id, &lease.token, Outcome::Completed.as_str())
        .await
        .unwrap();

    // 3. A footprint the tenant's override can never fit: the owner's 429 reaches the
    //    client at once.
    let key = owned_by_b();
    coordinator
        .set_policy(&key.tenant, Some(1 << 20), None)
        .await
        .unwrap();
    let response = upload(&front.url, &key, random_bytes(1 << 20, 6)).await;
    assert_eq!(response.status(), 429);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"], "transfer_admission_limited");

    // Nothing stays counted once the transfers are over.
    let snapshot = coordinator.snapshot(None, None).await.unwrap();
    assert_eq!(snapshot.occupancy.service_transfers, 0, "{snapshot:?}");
}
