//! Upload sessions over HTTP: owners, the hot-state bound, idle eviction, one upload per
//! session at a time.

mod support;

use std::time::Duration;

use graviton::config::HumanDuration;
use graviton::node::NodeOptions;
use support::client;
use support::node::{TestNode, random_bytes};

async fn session_upload(
    url: &str,
    tenant: &str,
    session: &str,
    data: Vec<u8>,
) -> reqwest::Response {
    client()
        .post(format!("{url}/v1/blobs"))
        .header("x-graviton-tenant-id", tenant)
        .header("x-graviton-upload-session-id", session)
        .body(data)
        .send()
        .await
        .unwrap()
}

async fn hot_sessions(url: &str) -> u64 {
    let snapshot: serde_json::Value = client()
        .get(format!("{url}/v1/ops/cluster"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    snapshot["sessions"]["hot"].as_u64().unwrap()
}

// Checks SES-1 over HTTP: never more than `max_hot` hot sessions.
#[tokio::test]
async fn hot_state_is_bounded_and_idle_sessions_are_evicted() {
    let node = TestNode::start_with(
        |c| {
            c.sessions.max_hot = 3;
            c.sessions.idle_timeout = HumanDuration::secs(2);
            c.sessions.sweep_interval = HumanDuration::millis(50);
        },
        NodeOptions::default(),
    )
    .await;
    let tenant = uuid::Uuid::new_v4().to_string();
    for i in 0..10u64 {
        let session = uuid::Uuid::new_v4().to_string();
        let response = session_upload(&node.url, &tenant, &session, random_bytes(50_000, i)).await;
        assert_eq!(response.status(), 201);
        assert!(
            hot_sessions(&node.url).await <= 3,
            "bound exceeded after {i} sessions"
        );
    }
    let stops = |reason: &str| {
        let text = node.metrics_text();
        support::metrics::count_or_zero(
            &text,
            &format!("graviton_session_stops_total{{reason=\"{reason}\"}}"),
        )
    };
    assert!(
        stops("evicted") >= 1,
        "the bound must have evicted idle owners"
    );
    assert_eq!(
        hot_sessions(&node.url).await + stops("evicted") + stops("idle"),
        10
    );
    let drained = support::wait_until(Duration::from_secs(10), || async {
        hot_sessions(&node.url).await == 0
    })
    .await;
    assert!(drained, "idle owners were not stopped");
    assert_eq!(stops("evicted") + stops("idle"), 10);
    assert!(stops("idle") >= 1);
}

// Checks SES-2 over HTTP: a second upload of a busy session gets 409; others are unaffected.
#[tokio::test]
async fn a_session_runs_one_upload_at_a_time() {
    use tokio::io::AsyncWriteExt;
    let node = TestNode::start().await;
    let tenant = uuid::Uuid::new_v4().to_string();
    let session = uuid::Uuid::new_v4().to_string();
    // Start an upload and keep it open (half the body sent).
    let mut stream = tokio::net::TcpStream::connect(node.addr()).await.unwrap();
    let head = format!(
        "POST /v1/blobs HTTP/1.1\r\nHost: x\r\nX-Graviton-Tenant-Id: {tenant}\r\nX-Graviton-Upload-Session-Id: {session}\r\nContent-Length: 200000\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&random_bytes(100_000, 9)).await.unwrap();
    let busy = support::wait_until(Duration::from_secs(5), || async {
        session_upload(&node.url, &tenant, &session, b"second".to_vec())
            .await
            .status()
            == 409
    })
    .await;
    assert!(
        busy,
        "a concurrent upload of the same session must get 409 session_busy"
    );
    // Another session of the same tenant is unaffected.
    let other = uuid::Uuid::new_v4().to_string();
    assert_eq!(
        session_upload(&node.url, &tenant, &other, b"other".to_vec())
            .await
            .status(),
        201
    );
    // Abandon the first upload: the session becomes usable again.
    drop(stream);
    let free = support::wait_until(Duration::from_secs(5), || async {
        session_upload(&node.url, &tenant, &session, b"third".to_vec())
            .await
            .status()
            == 201
    })
    .await;
    assert!(free);
}
