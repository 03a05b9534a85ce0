//! Admission at the HTTP edge over real sockets: status mapping with `Retry-After`, bodies
//! left unread when admission refuses, downloads aborted by the egress quota, and the admin
//! admission endpoints.

#[allow(unused_imports)] // the shared harness also exports PostgreSQL helpers
mod support;

use std::time::Duration;

use bytes::Bytes;
use graviton::admission::RedisAdmissionConfig;
use graviton::config::{ByteSize, Config, Secret};
use graviton::ids::{SessionId, TenantId};
use graviton::node::NodeOptions;
use support::RedisServer;
use support::client;
use support::metrics::{count, count_or_zero as sample, require};
use support::node::{TestNode, random_bytes};

const ADMIN_TOKEN: &str = "admin-token-for-tests-0123";

fn with_redis(
    url: String,
    edit: impl FnOnce(&mut RedisAdmissionConfig),
) -> impl FnOnce(&mut Config) {
    move |config: &mut Config| {
        let mut redis = support::admission::redis(url, "http");
        edit(&mut redis);
        support::admission::on_node(config, redis);
        config.admin.token = Some(Secret::new(ADMIN_TOKEN));
    }
}

/// A body that sends one chunk and then never ends: only a server that refuses before
/// reading can answer it.
fn endless_body() -> reqwest::Body {
    let first = futures_util::stream::once(async {
        Ok::<_, std::io::Error>(Bytes::from(vec![7u8; 64 * 1024]))
    });
    reqwest::Body::wrap_stream(futures_util::StreamExt::chain(
        first,
        futures_util::stream::pending(),
    ))
}

async fn upload_as(url: &str, tenant: TenantId, body: reqwest::Body) -> reqwest::Response {
    tokio::time::timeout(
        Duration::from_secs(10),
        client()
            .post(format!("{url}/v1/blobs"))
            .header("x-graviton-tenant-id", tenant.to_string())
            .header(
                "x-graviton-upload-session-id",
                SessionId::new_random().to_string(),
            )
            .body(body)
            .send(),
    )
    .await
    .expect("the server answered without reading the whole body")
    .unwrap()
}

async fn error_code(response: reqwest::Response) -> String {
    let body: serde_json::Value = response.json().await.unwrap();
    body["error"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn refused_uploads_leave_the_body_unread_with_429_or_503() {
    let Some(mut server) =
        RedisServer::start("refused_uploads_leave_the_body_unread_with_429_or_503")
    else {
        return;
    };
    let node = TestNode::start_with(
        with_redis(server.url(), |r| {
            r.tenant_bytes = ByteSize::mib(1); // below the upload footprint: never fits
            r.tenant_requests_per_minute = 2;
        }),
        NodeOptions::default(),
    )
    .await;
    let tenant = TenantId::new_random();
    // The request quota counts per Redis-time minute: keep the three requests below
    // inside one window.
    avoid_minute_boundary(&server.url()).await;

    let response = upload_as(&node.url, tenant, endless_body()).await;
    assert_eq!(response.status(), 429);
    assert!(response.headers().get("retry-after").is_none());
    assert_eq!(error_code(response).await, "transfer_admission_limited");

    // Second request of the minute is still admitted by the quota (and refused by the
    // footprint); the third is refused by the request quota with Retry-After.
    let response = upload_as(&node.url, tenant, endless_body()).await;
    assert_eq!(response.status(), 429);
    assert!(response.headers().get("retry-after").is_none());
    assert_eq!(error_code(response).await, "transfer_admission_limited");
    let response = upload_as(&node.url, tenant, endless_body()).await;
    assert_eq!(response.status(), 429);
    let retry: u64 = response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert_eq!(error_code(response).await, "quota_exceeded");

    server.stop();
    let response = upload_as(&node.url, TenantId::new_random(), endless_body()).await;
    assert_eq!(response.status(), 503);
    assert!(response.headers().get("retry-after").is_some());
    assert_eq!(error_code(response).await, "admission_unavailable");

    assert_eq!(
        node.metric("graviton_upload_bytes_total"),
        Some(0),
        "no body byte was ingested"
    );
    assert_eq!(node.block_count(), 0);
    assert_eq!(node.manifest_count(), 0);
}

/// Wait until Redis time is at least 10 s away from the end of its current minute.
async fn avoid_minute_boundary(url: &str) {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let into_minute =
        std::time::Duration::from_secs(secs % 60) + std::time::Duration::from_micros(micros);
    if into_minute > std::time::Duration::from_secs(50) {
        let rest = std::time::Duration::from_secs(60) - into_minute
            + std::time::Duration::from_millis(100);
        tokio::time::sleep(rest).await;
    }
}

#[tokio::test]
async fn download_is_aborted_when_the_egress_quota_runs_out() {
    let Some(server) = RedisServer::start("download_is_aborted_when_the_egress_quota_runs_out")
    else {
        return;
    };
    let node = TestNode::start_with(
        with_redis(server.url(), |r| {
            r.tenant_egress_per_hour = ByteSize::kib(512)
        }),
        NodeOptions::default(),
    )
    .await;
    let data = random_bytes(2 << 20, 9);
    let response = client()
        .post(format!("{}/v1/blobs", node.url))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let key = response.json::<serde_json::Value>().await.unwrap()["key"]
        .as_str()
        .unwrap()
        .to_string();

    // Without a tenant there is no quota: the whole blob arrives.
    let whole = client()
        .get(format!("{}/v1/blobs/{key}", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(whole.bytes().await.unwrap().len(), data.len());

    let tenant = TenantId::new_random();
    let response = client()
        .get(format!("{}/v1/blobs/{key}", node.url))
        .header("x-graviton-tenant-id", tenant.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status(),
        200,
        "the quota is charged per chunk, after the head"
    );
    assert_eq!(
        response.headers()["content-length"],
        (2u64 << 20).to_string().as_str()
    );
    match response.bytes().await {
        Err(_) => {}
        Ok(body) => panic!(
            "a quota-limited download must abort, got {} bytes",
            body.len()
        ),
    }
    let metrics = node.metrics_text();
    assert_eq!(
        count(
            &metrics,
            "graviton_admission_quota_rejections_total{kind=\"egress\"}"
        ),
        Some(1),
        "{metrics}"
    );
    let delivered = require(&metrics, "graviton_admission_delivered_egress_bytes_total");
    assert!(delivered > 0 && delivered <= 512 * 1024, "{delivered}");
}

#[tokio::test]
async fn download_admission_failure_is_503_before_the_manifest_is_read() {
    let Some(mut server) =
        RedisServer::start("download_admission_failure_is_503_before_the_manifest_is_read")
    else {
        return;
    };
    let node = TestNode::start_with(with_redis(server.url(), |_| {}), NodeOptions::default()).await;
    server.stop();
    // The key does not exist: a 404 would mean the manifest store was consulted first.
    let key = format!("blake3:{}:5", "0".repeat(64));
    let response = client()
        .get(format!("{}/v1/blobs/{key}", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    assert!(response.headers().get("retry-after").is_some());
    assert_eq!(error_code(response).await, "admission_unavailable");
}

#[tokio::test]
async fn admin_endpoints_set_and_clear_overrides_and_report_occupancy() {
    let Some(server) =
        RedisServer::start("admin_endpoints_set_and_clear_overrides_and_report_occupancy")
    else {
        return;
    };
    let node = TestNode::start_with(with_redis(server.url(), |_| {}), NodeOptions::default()).await;
    let tenant = TenantId::new_random();
    let url = format!("{}/v1/admin/tenants/{tenant}/admission", node.url);
    let unauthorized = client()
        .put(&url)
        .json(&serde_json::json!({"transfers": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(unauthorized.status(), 401);
    let set = client()
        .put(&url)
        .bearer_auth(ADMIN_TOKEN)
        .json(&serde_json::json!({"bytes": "64MiB", "transfers": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(set.status(), 200);
    let v1 = set.json::<serde_json::Value>().await.unwrap()["policy_version"]
        .as_u64()
        .unwrap();
    let cleared = client()
        .delete(&url)
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    let v2 = cleared.json::<serde_json::Value>().await.unwrap()["policy_version"]
        .as_u64()
        .unwrap();
    assert!(v2 > v1 && v1 >= 1);
    let invalid = client()
        .put(&url)
        .bearer_auth(ADMIN_TOKEN)
        .json(&serde_json::json!({"transfers": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(invalid.status(), 400);
    let snapshot = client()
        .get(format!("{}/v1/admin/admission?tenant={tenant}", node.url))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(snapshot.status(), 200);
    let body: serde_json::Value = snapshot.json().await.unwrap();
    assert_eq!(body["cluster"]["policy_version"].as_u64().unwrap(), v2);
    assert_eq!(body["cluster"]["occupancy"]["service_transfers"], 0);
    assert!(body["local"]["process_bytes_capacity"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn embedded_default_admits_without_redis_and_has_no_overrides() {
    let node = TestNode::start_with(
        |config: &mut Config| config.admin.token = Some(Secret::new(ADMIN_TOKEN)),
        NodeOptions::default(),
    )
    .await;
    let data = random_bytes(300_000, 3);
    let response = client()
        .post(format!("{}/v1/blobs", node.url))
        .body(data)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let tenant = TenantId::new_random();
    let response = client()
        .put(format!("{}/v1/admin/tenants/{tenant}/admission", node.url))
        .bearer_auth(ADMIN_TOKEN)
        .json(&serde_json::json!({"transfers": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 409);
    assert_eq!(error_code(response).await, "admission_not_distributed");
    let metrics = node.metrics_text();
    assert_eq!(
        count(
            &metrics,
            "graviton_admission_decisions_total{operation=\"upload\",outcome=\"admitted\"}"
        ),
        Some(1),
        "{metrics}"
    );
}

// Checks ADM-5.
#[tokio::test]
async fn a_spent_egress_window_is_429_with_retry_after_before_the_head() {
    let Some(server) = RedisServer::start("a_spent_egress_window_is_429_before_the_head") else {
        return;
    };
    let cell = format!("egress-{}", support::unique_suffix());
    let node = TestNode::start_with(
        with_redis(server.url(), {
            let cell = cell.clone();
            move |r| {
                r.tenant_egress_per_hour = ByteSize::kib(512);
                r.cell = cell;
            }
        }),
        NodeOptions::default(),
    )
    .await;
    let response = client()
        .post(format!("{}/v1/blobs", node.url))
        .body(random_bytes(64 << 10, 3))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let key = response.json::<serde_json::Value>().await.unwrap()["key"]
        .as_str()
        .unwrap()
        .to_string();
    // Spend the tenant's whole window from another client of the same cell.
    let tenant = TenantId::new_random();
    let coordinator = graviton::storage::redis::RedisCoordinator::connect(
        &RedisAdmissionConfig {
            url: server.url(),
            cell,
            tenant_egress_per_hour: ByteSize::kib(512),
            ..RedisAdmissionConfig::default()
        }
        .coordinator(),
    )
    .unwrap();
    coordinator
        .charge(&tenant, graviton::admission::QuotaKind::Egress, 512 * 1024)
        .await
        .unwrap();
    let response = client()
        .get(format!("{}/v1/blobs/{key}", node.url))
        .header("x-graviton-tenant-id", tenant.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert!(response.headers().contains_key("retry-after"));
    assert_eq!(error_code(response).await, "quota_exceeded");
    // Another tenant still downloads the blob.
    let other = client()
        .get(format!("{}/v1/blobs/{key}", node.url))
        .header("x-graviton-tenant-id", TenantId::new_random().to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 200);
    assert_eq!(other.bytes().await.unwrap().len(), 64 << 10);
}

// Checks OPS-1.
#[tokio::test]
async fn successful_downloads_count_as_ok_and_release_their_lease_as_completed() {
    let test = "successful_downloads_count_as_ok_and_release_their_lease_as_completed";
    let Some(server) = RedisServer::start(test) else {
        return;
    };
    let cell = format!("ok-{}", support::unique_suffix());
    let node = TestNode::start_with(
        with_redis(server.url(), {
            let cell = cell.clone();
            move |r| r.cell = cell
        }),
        NodeOptions::default(),
    )
    .await;
    let data = random_bytes(3 << 20, 26);
    let response = client()
        .post(format!("{}/v1/blobs", node.url))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let key = response.json::<serde_json::Value>().await.unwrap()["key"]
        .as_str()
        .unwrap()
        .to_string();
    let tenant = TenantId::new_random();
    let get = |range: Option<&'static str>| {
        let mut request = client()
            .get(format!("{}/v1/blobs/{key}", node.url))
            .header("x-graviton-tenant-id", tenant.to_string());
        if let Some(range) = range {
            request = request.header("range", range);
        }
        request.send()
    };

    // The whole blob, byte-exact.
    let whole = get(None).await.unwrap();
    assert_eq!(whole.status(), 200);
    assert_eq!(&whole.bytes().await.unwrap()[..], &data[..]);
    // A range in the middle, byte-exact.
    let part = get(Some("bytes=1000000-1999999")).await.unwrap();
    assert_eq!(part.status(), 206);
    assert_eq!(
        &part.bytes().await.unwrap()[..],
        &data[1_000_000..2_000_000]
    );
    // HEAD moves no body and is no download.
    let head = client()
        .head(format!("{}/v1/blobs/{key}", node.url))
        .header("x-graviton-tenant-id", tenant.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 200);
    assert_eq!(
        head.headers()["content-length"],
        data.len().to_string().as_str()
    );

    let metrics = node.metrics_text();
    assert_eq!(
        sample(&metrics, "graviton_downloads_total{outcome=\"ok\"}"),
        2,
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            "graviton_downloads_total{outcome=\"client_error\"}"
        ),
        0,
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            "graviton_downloads_total{outcome=\"server_error\"}"
        ),
        0,
        "{metrics}"
    );
    let bytes = sample(&metrics, "graviton_download_bytes_total");
    assert_eq!(bytes, (data.len() + 1_000_000) as u64, "{metrics}");

    // Each download's lease is released with the outcome `completed`.
    let coordinator = support::admission::coordinator(server.url(), cell);
    let hash = coordinator.hasher().tenant(&tenant);
    let downloads = || {
        let coordinator = coordinator.clone();
        let hash = hash.clone();
        async move {
            coordinator
                .recent_events(1000)
                .await
                .unwrap()
                .into_iter()
                .filter(|e| e.get("tenant") == Some(&hash) && e["kind"] == "completed")
                .collect::<Vec<_>>()
        }
    };
    let released = support::wait_until(Duration::from_secs(10), || {
        let downloads = downloads();
        async move { downloads.await.len() >= 2 }
    })
    .await;
    let events = downloads().await;
    assert!(released, "both leases were released: {events:?}");
    assert_eq!(events.len(), 2, "{events:?}");
    for event in &events {
        assert_eq!(event["operation"], "download", "{event:?}");
        assert_eq!(event["outcome"], "completed", "{event:?}");
    }
}
