//! The S3 server goes away mid-service: uploads answer 503 with Retry-After and write no
//! manifest; when it returns, the next upload works without a restart. The test runs its
//! own Garage process (the binary scripts/services.sh installs) on free ports.

mod support;

use std::time::Duration;

use graviton::config::{Config, HumanDuration, Secret};
use graviton::node::NodeOptions;
use graviton::storage::config::{Backend, S3Config};
use support::garage::Garage;
use support::node::{TestNode, random_bytes};

const KEY_ID: &str = "GKoutagetest00001";
const SECRET: &str = "outage-test-secret-0123456789abcdef";

// Checks STO-9.
#[tokio::test]
async fn a_stopped_s3_server_gives_503_and_no_manifest_then_recovers_without_restart() {
    let Some(bin) = Garage::bin_for("s3_outage") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut garage = Garage::start(dir.path(), bin, KEY_ID, SECRET, "outage");
    let s3 = S3Config {
        endpoint: garage.endpoint(),
        bucket: "outage".into(),
        region: "garage".into(),
        access_key_id: KEY_ID.into(),
        secret_access_key: Some(Secret::new(SECRET)),
        request_timeout: HumanDuration(Duration::from_secs(5)),
        max_retries: 2,
        ..Default::default()
    };
    // the bucket may take a moment to be usable after the first start
    let mut node = None;
    for _ in 0..50 {
        let s3 = s3.clone();
        let started = tokio::spawn(async move {
            TestNode::start_with(
                move |config: &mut Config| {
                    config.storage.backend = Some(Backend::S3);
                    config.storage.s3 = s3;
                },
                NodeOptions::default(),
            )
            .await
        })
        .await;
        if let Ok(started) = started {
            node = Some(started);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let node = node.expect("node on garage");
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let post = |data: Vec<u8>| {
        client
            .post(format!("{}/v1/blobs", node.url))
            .body(data)
            .send()
    };

    let first = random_bytes(2 << 20, 1);
    let response = post(first.clone()).await.unwrap();
    assert_eq!(response.status(), 201);
    let first_key: serde_json::Value = response.json().await.unwrap();

    garage.kill();
    let second = random_bytes(2 << 20, 2);
    let response = post(second.clone()).await.unwrap();
    assert_eq!(response.status(), 503, "never 201 while the store is down");
    assert!(response.headers().get("retry-after").is_some());
    let second_key = graviton::cas::BlobKey::of(&second).to_string();
    let missing = client
        .get(format!("{}/v1/blobs/{second_key}", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404, "no manifest for the failed upload");
    assert_eq!(node.manifest_count(), 1);

    garage.spawn(false);
    let response = post(second.clone()).await.unwrap();
    assert_eq!(response.status(), 201, "works again with no node restart");
    let body = client
        .get(format!(
            "{}/v1/blobs/{}",
            node.url,
            first_key["key"].as_str().unwrap()
        ))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(body[..] == first[..]);
}
