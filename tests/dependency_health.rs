//! Health that covers the data path (OPS-4, OPS-5), on a real `graviton serve` process:
//! the node probes its block store and Redis, `/readyz` says `degraded` with the failing
//! dependency (and stays 200), `graviton_dependency_up` follows, and each transition is
//! logged once with the address and without the password.

mod support;

use std::time::Duration;

use graviton::config::{HumanDuration, Secret};
use support::RedisServer;
use support::client;
use support::node::TestNode;
use support::process::{Graviton, Ports};

const PASSWORD: &str = "hunter2-never-in-the-log";

/// `graviton serve` with human logs into a file (not a terminal), probing every 100 ms,
/// with `[admission.redis]` at `redis_url` and a password.
fn serve(dir: &std::path::Path, redis_url: &str) -> Graviton {
    let config = dir.join("node.toml");
    let text = |ports: Ports| {
        format!(
            r#"
[node]
listen = "{listen}"

[storage]
data_dir = "{data}"
fsync = false

[log]
format = "human"

[health]
probe_interval = "100ms"
probe_timeout = "100ms"

[admission.redis]
url = "{redis_url}"
password = "{PASSWORD}"
"#,
            listen = ports.listen(),
            data = dir.join("data").display(),
        )
    };
    Graviton::serve_config(dir.join("node.log"), &config, text, |command| {
        command.env_remove("GRAVITON_CONFIG").env_remove("RUST_LOG");
    })
}

async fn readyz(url: &str) -> (u16, serde_json::Value) {
    let response = client().get(format!("{url}/readyz")).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// Wait until `/readyz` answers 200 with `status` and exactly `degraded` failing.
async fn wait_for(node: &Graviton, status: &str, degraded: &[&str]) -> serde_json::Value {
    let last = std::sync::Mutex::new(serde_json::Value::Null);
    let reached = support::wait_until(Duration::from_secs(20), || async {
        let (code, body) = readyz(&node.url).await;
        let ok = code == 200
            && body["status"] == status
            && body["degraded"] == serde_json::json!(degraded);
        *last.lock().unwrap() = body;
        ok
    })
    .await;
    let last = last.into_inner().unwrap();
    assert!(
        reached,
        "readyz never became {status} {degraded:?}: {last}\n{}",
        node.log_text()
    );
    last
}

async fn dependency_up(url: &str, dependency: &str) -> Option<u64> {
    let text = client()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    support::metrics::count(
        &text,
        &format!("graviton_dependency_up{{dependency=\"{dependency}\"}}"),
    )
}

fn count(text: &str, needle: &str) -> usize {
    text.lines().filter(|line| line.contains(needle)).count()
}

// Checks OPS-4, OPS-5.
#[tokio::test]
async fn readyz_reports_a_failing_dependency_as_degraded_and_logs_each_transition_once() {
    let test = "readyz_reports_a_failing_dependency_as_degraded_and_logs_each_transition_once";
    let Some(mut redis) = RedisServer::start(test) else {
        return;
    };
    // Redis is down when the node starts: the first probe already finds it.
    redis.stop();
    let port = redis.port();
    let dir = tempfile::tempdir().unwrap();
    let mut node = serve(dir.path(), &format!("redis://127.0.0.1:{port}/"));
    node.ready(Duration::from_secs(20)).await;

    let body = wait_for(&node, "degraded", &["redis"]).await;
    let address = format!("redis://127.0.0.1:{port}");
    assert_eq!(body["dependencies"]["redis"]["up"], false, "{body}");
    assert_eq!(body["dependencies"]["redis"]["address"], address.as_str());
    assert_eq!(body["dependencies"]["block_store"]["up"], true, "{body}");
    assert_eq!(dependency_up(&node.url, "redis").await, Some(0));
    assert_eq!(dependency_up(&node.url, "block_store").await, Some(1));
    assert_eq!(
        dependency_up(&node.url, "postgres").await,
        None,
        "not clustered"
    );

    // The block store goes away (its pack directory) and comes back, twice: one log line
    // per transition, whatever the number of probe rounds, and Redis, down all along, is
    // logged once.
    let packs = dir.path().join("data").join("packs");
    let moved = dir.path().join("packs-away");
    for _ in 0..2 {
        std::fs::rename(&packs, &moved).unwrap();
        let body = wait_for(&node, "degraded", &["block_store", "redis"]).await;
        assert!(
            body["dependencies"]["block_store"]["error"]
                .as_str()
                .is_some_and(|e| e.contains("pack directory")),
            "{body}"
        );
        assert_eq!(dependency_up(&node.url, "block_store").await, Some(0));
        std::fs::rename(&moved, &packs).unwrap();
        wait_for(&node, "degraded", &["redis"]).await;
        assert_eq!(dependency_up(&node.url, "block_store").await, Some(1));
    }

    let log = node.log_text();
    let redis_down: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("dependency unreachable") && l.contains("redis"))
        .collect();
    assert_eq!(redis_down.len(), 1, "Redis is down once:\n{log}");
    assert!(redis_down[0].contains(&address), "{log}");
    assert_eq!(
        count(&log, "dependency unreachable"),
        3,
        "Redis once, the block store twice:\n{log}"
    );
    assert_eq!(
        count(&log, "dependency reachable again"),
        2,
        "the block store twice:\n{log}"
    );
    assert!(!log.contains(PASSWORD), "the Redis password leaked:\n{log}");
    assert!(
        !log.contains('\u{1b}'),
        "human logs into a file carry no ANSI colour codes:\n{log}"
    );
}

// Checks OPS-4.
#[tokio::test]
async fn the_console_shows_a_failing_block_store_and_the_routing_failure_kinds() {
    const ADMIN: &str = "admin-token-for-console-tests";
    let node = TestNode::start_with(
        |c| {
            c.admin.token = Some(Secret::new(ADMIN));
            c.health.probe_interval = HumanDuration::millis(50);
            c.health.probe_timeout = HumanDuration::millis(50);
        },
        Default::default(),
    )
    .await;
    let console = || async {
        client()
            .get(format!("{}/v1/admin/console", node.url))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap()
            .json::<serde_json::Value>()
            .await
            .unwrap()
    };
    let data = console().await;
    assert_eq!(data["degraded"], serde_json::json!([]), "{data}");
    assert_eq!(data["dependencies"]["block_store"]["up"], true, "{data}");
    // The counters are the metric's own kinds (there is no `permit` stage).
    let counters = data["counters"].as_object().unwrap();
    assert!(
        counters.contains_key("routing_failures_owner_address"),
        "{data}"
    );
    assert!(!counters.contains_key("routing_failures_permit"), "{data}");
    let metrics = node.metrics_text();
    assert!(!metrics.contains("kind=\"permit\""), "{metrics}");

    let packs = node.dir.path().join("packs");
    let moved = node.dir.path().join("packs-away");
    std::fs::rename(&packs, &moved).unwrap();
    let last = std::sync::Mutex::new(serde_json::Value::Null);
    let seen = support::wait_until(Duration::from_secs(10), || async {
        let data = console().await;
        let down = data["degraded"] == serde_json::json!(["block_store"]);
        *last.lock().unwrap() = data;
        down
    })
    .await;
    let last = last.into_inner().unwrap();
    assert!(
        seen,
        "the console never showed the block store down: {last}"
    );
    assert_eq!(last["dependencies"]["block_store"]["up"], false, "{last}");
    std::fs::rename(&moved, &packs).unwrap();

    // Without admin.token the console's sign-in says which key to set.
    let bare = TestNode::start().await;
    let refused = client()
        .get(format!("{}/v1/admin/console", bare.url))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"], "admin_disabled");
    assert!(
        body["message"].as_str().unwrap().contains("admin.token"),
        "{body}"
    );
}
