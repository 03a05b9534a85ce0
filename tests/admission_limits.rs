//! Cluster-wide limits (ADM-12): two in-process nodes on real sockets, one real
//! `redis-server`, one cell, and **different** `[admission.redis]` limits in their files.
//! The first node stores its limits in Redis; the second logs every disagreement at start
//! and enforces the stored ceilings, not its own; a change through the admin API of one
//! node applies on the other; a backend override set through the API applies too.

#[allow(unused_imports)] // the shared harness also exports PostgreSQL helpers
mod support;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use graviton::admission::RedisAdmissionConfig;
use graviton::config::{ByteSize, Config, Secret};
use graviton::ids::{SessionId, TenantId};
use graviton::node::NodeOptions;
use support::RedisServer;
use support::client;
use support::node::TestNode;

const ADMIN_TOKEN: &str = "admin-token-for-tests-0123";

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

fn node_config(
    url: String,
    cell: String,
    edit: impl FnOnce(&mut RedisAdmissionConfig),
) -> impl FnOnce(&mut Config) {
    move |config: &mut Config| {
        let mut redis = RedisAdmissionConfig {
            cell,
            ..support::admission::redis(url, "limits")
        };
        edit(&mut redis);
        support::admission::on_node(config, redis);
        config.admin.token = Some(Secret::new(ADMIN_TOKEN));
    }
}

/// An upload whose body sends one chunk and then never ends: admitted, it holds its lease.
fn held_upload(url: &str, tenant: TenantId) -> tokio::task::JoinHandle<()> {
    let request = client()
        .post(format!("{url}/v1/blobs"))
        .header("x-graviton-tenant-id", tenant.to_string())
        .header(
            "x-graviton-upload-session-id",
            SessionId::new_random().to_string(),
        )
        .body(reqwest::Body::wrap_stream(futures_util::StreamExt::chain(
            futures_util::stream::once(async {
                Ok::<_, std::io::Error>(Bytes::from(vec![7u8; 64 * 1024]))
            }),
            futures_util::stream::pending(),
        )));
    tokio::spawn(async move {
        let _ = request.send().await;
    })
}

async fn admin(
    method: reqwest::Method,
    url: String,
    body: Option<serde_json::Value>,
) -> serde_json::Value {
    let mut request = client().request(method, url).bearer_auth(ADMIN_TOKEN);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 200, "{:?}", response.text().await);
    response.json().await.unwrap()
}

async fn cluster_transfers(url: &str) -> u64 {
    let snapshot = admin(
        reqwest::Method::GET,
        format!("{url}/v1/admin/admission"),
        None,
    )
    .await;
    snapshot["cluster"]["occupancy"]["service_transfers"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_enforces_the_limits_stored_in_redis_whatever_its_file_says() {
    let Some(server) = RedisServer::start("every_node_enforces_the_limits_stored_in_redis") else {
        return;
    };
    let logs = Captured::default();
    let writer = logs.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || writer.clone())
            .finish(),
    )
    .expect("one subscriber per test binary");
    let cell = format!("limits-{}", support::unique_suffix());

    // Node a bootstraps the cell: 3 transfers service-wide.
    let a = TestNode::start_with(
        node_config(server.url(), cell.clone(), |r| {
            r.service_bytes = ByteSize::mib(512);
            r.service_transfers = 3;
            r.tenant_transfers = 3;
            r.backend_transfers = 3;
        }),
        NodeOptions::default(),
    )
    .await;
    let limits_url = |node: &TestNode| format!("{}/v1/admin/admission/limits", node.url);
    let stored = support::wait_until(Duration::from_secs(20), || async {
        admin(reqwest::Method::GET, limits_url(&a), None).await["service_transfers"] == 3
    })
    .await;
    assert!(stored, "node a stored its limits");

    // Node b's file says 64 transfers: it logs the disagreement and enforces 3.
    let b = TestNode::start_with(
        node_config(server.url(), cell.clone(), |r| {
            r.service_bytes = ByteSize::gib(4);
            r.service_transfers = 64;
            r.tenant_transfers = 32;
            r.backend_transfers = 64;
        }),
        NodeOptions::default(),
    )
    .await;
    let warned = support::wait_until(Duration::from_secs(20), || async {
        let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
        [
            "service_bytes",
            "service_transfers",
            "tenant_transfers",
            "backend_transfers",
        ]
        .iter()
        .all(|key| text.contains(&format!("admission.redis.{key}")))
    })
    .await;
    assert!(
        warned,
        "node b names each disagreeing key at start: {}",
        String::from_utf8_lossy(&logs.0.lock().unwrap())
    );
    let seen_by_b = admin(reqwest::Method::GET, limits_url(&b), None).await;
    assert_eq!(seen_by_b["service_transfers"], 3, "{seen_by_b}");
    assert_eq!(seen_by_b["service_bytes"], 512 << 20, "{seen_by_b}");

    // Three uploads held open through b fill the cluster-wide ceiling of 3 ...
    let held: Vec<_> = (0..3)
        .map(|_| held_upload(&b.url, TenantId::new_random()))
        .collect();
    let full = support::wait_until(Duration::from_secs(20), || async {
        cluster_transfers(&b.url).await == 3
    })
    .await;
    assert!(full, "three uploads admitted");
    // ... so b refuses a fourth, although its own file allows 64.
    let refused = client()
        .post(format!("{}/v1/blobs", b.url))
        .header("x-graviton-tenant-id", TenantId::new_random().to_string())
        .header(
            "x-graviton-upload-session-id",
            SessionId::new_random().to_string(),
        )
        .body(vec![1u8; 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"], "transfer_admission_busy");

    // Raised through a's admin API, the new ceiling applies on b at once.
    let raised = admin(
        reqwest::Method::PUT,
        limits_url(&a),
        Some(serde_json::json!({"service_transfers": 4, "backend_transfers": 4})),
    )
    .await;
    assert_eq!(raised["service_transfers"], 4, "{raised}");
    let fourth = held_upload(&b.url, TenantId::new_random());
    let four = support::wait_until(Duration::from_secs(20), || async {
        cluster_transfers(&b.url).await == 4
    })
    .await;
    assert!(four, "the fourth upload was admitted after the change");

    // An update that breaks the ceilings' order is refused.
    let bad = client()
        .put(limits_url(&b))
        .bearer_auth(ADMIN_TOKEN)
        .json(&serde_json::json!({"tenant_transfers": 5}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);

    // A backend override of 1 through b's API: with 4 held, a fifth (service room raised
    // to 5) is refused on the backend dimension, on a as well.
    admin(
        reqwest::Method::PUT,
        limits_url(&a),
        Some(serde_json::json!({"service_transfers": 5, "backend_transfers": 5})),
    )
    .await;
    let version = admin(
        reqwest::Method::PUT,
        format!("{}/v1/admin/backends/fs/admission", b.url),
        Some(serde_json::json!({"transfers": 1})),
    )
    .await["policy_version"]
        .as_u64()
        .unwrap();
    assert!(version > 0);
    let refused = client()
        .post(format!("{}/v1/blobs", a.url))
        .header("x-graviton-tenant-id", TenantId::new_random().to_string())
        .header(
            "x-graviton-upload-session-id",
            SessionId::new_random().to_string(),
        )
        .body(vec![1u8; 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    admin(
        reqwest::Method::DELETE,
        format!("{}/v1/admin/backends/fs/admission", b.url),
        None,
    )
    .await;
    let accepted = client()
        .post(format!("{}/v1/blobs", a.url))
        .header("x-graviton-tenant-id", TenantId::new_random().to_string())
        .header(
            "x-graviton-upload-session-id",
            SessionId::new_random().to_string(),
        )
        .body(vec![1u8; 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(accepted.status(), 201, "{:?}", accepted.text().await);

    for upload in held.into_iter().chain([fourth]) {
        upload.abort();
    }
}
