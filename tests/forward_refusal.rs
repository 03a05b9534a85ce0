//! A forwarding node relays the owner's refusal: its status, code, message (the reason)
//! and `Retry-After`, on two real `graviton serve` processes on one PostgreSQL database
//! and one real `redis-server`. A tenant override of 1 MiB (set in Redis) makes every
//! upload of the tenant never fit, so the owner refuses it with 429
//! `transfer_admission_limited` in the forwarder's pre-flight, before any body byte.

mod support;

use graviton::ids::SessionKey;
use support::client;
use support::cluster::{NodeProcess, all_nodes_own_shards, session_owned_by, wait_converged};
use support::node::random_bytes;

const SHARDS: u32 = 8;

async fn upload(url: &str, key: &SessionKey) -> (u16, serde_json::Value) {
    let response = client()
        .post(format!("{url}/v1/blobs"))
        .header("x-graviton-tenant-id", key.tenant.to_string())
        .header("x-graviton-upload-session-id", key.session.to_string())
        .body(random_bytes(64 << 10, 3))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or_default())
}

// Checks OPS-8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarding_node_relays_the_owners_refusal_with_its_code_and_reason() {
    let test = "a_forwarding_node_relays_the_owners_refusal_with_its_code_and_reason";
    let Some(db) = support::TestDatabase::create(test).await else {
        return;
    };
    let Some(redis) = support::RedisServer::start(test) else {
        return;
    };
    let cell = format!("refusal-{}", support::unique_suffix());
    let extra = format!(
        "[admission]\nacquisition_timeout = \"3s\"\n[admission.redis]\nurl = \"{}\"\ncell = \"{cell}\"\nwait = \"2s\"\n",
        redis.url()
    );
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("shared");
    let front =
        NodeProcess::start_with_extra(dir.path(), "node-a", db.url(), SHARDS, &data, "", &extra);
    let owner =
        NodeProcess::start_with_extra(dir.path(), "node-b", db.url(), SHARDS, &data, "", &extra);
    let coordinator = support::admission::coordinator(redis.url(), cell.clone());
    wait_converged(
        &[&front, &owner],
        db.url(),
        "both nodes ready, each owning shards",
        |status| all_nodes_own_shards(status) && status.moving_shards == 0,
    )
    .await;
    let status = graviton::cli::cluster_status(db.url()).await.unwrap();
    let owned_by_b = || session_owned_by(&status, SHARDS, "node-b");

    // Two tenants whose every upload exceeds their 1 MiB override.
    let (direct_key, forwarded_key) = (owned_by_b(), owned_by_b());
    for key in [&direct_key, &forwarded_key] {
        coordinator
            .set_policy(&key.tenant, Some(1 << 20), None)
            .await
            .unwrap();
    }

    // What the owner answers itself.
    let (direct_status, direct) = upload(&owner.url, &direct_key).await;
    assert_eq!(direct_status, 429, "{direct}");
    assert_eq!(direct["error"], "transfer_admission_limited", "{direct}");
    let reason = direct["message"].as_str().unwrap().to_string();
    assert!(!reason.is_empty());

    // The same refusal through the forwarding node: same status, code and reason.
    let (status, relayed) = upload(&front.url, &forwarded_key).await;
    assert_eq!(status, 429, "{relayed}\n{}", front.log_text());
    assert_eq!(relayed["error"], "transfer_admission_limited", "{relayed}");
    assert_eq!(
        relayed["message"].as_str(),
        Some(reason.as_str()),
        "the owner's reason is lost: {relayed}"
    );
}
