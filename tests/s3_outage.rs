//! The S3 server goes away mid-service: uploads answer 503 with Retry-After and write no
//! manifest; when it returns, the next upload works without a restart. Each test runs its
//! own Garage process (the binary scripts/services.sh installs) on free ports, with a key
//! and a bucket of its own. The server goes away between two uploads, or in the middle of
//! an upload's body after the upload's first pack was stored: killed (connections are
//! refused) or frozen with SIGSTOP (requests time out).

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use graviton::cas::BlobKey;
use graviton::config::{ByteSize, Config, HumanDuration, Secret};
use graviton::node::NodeOptions;
use graviton::storage::config::{Backend, S3Config};
use graviton::storage::pack::medium::Medium;
use graviton::storage::pack::s3::S3Medium;
use support::client;
use support::garage::Garage;
use support::node::{TestNode, random_bytes};

const KEY_ID: &str = "GKoutagetest00001";
const SECRET: &str = "outage-test-secret-0123456789abcdef";

fn s3_config(garage: &Garage, request_timeout: Duration) -> S3Config {
    S3Config {
        endpoint: garage.endpoint(),
        bucket: garage.bucket.clone(),
        region: "garage".into(),
        access_key_id: garage.key_id.clone(),
        secret_access_key: Some(Secret::new(&garage.secret)),
        request_timeout: HumanDuration(request_timeout),
        max_retries: 2,
        ..Default::default()
    }
}

/// A node with its blocks on `s3` (`pack_size` when given). The bucket may take a moment
/// to be usable after Garage's first start, so a failed start is tried again.
async fn start_node(s3: S3Config, pack_size: Option<ByteSize>) -> TestNode {
    for _ in 0..50 {
        let s3 = s3.clone();
        let started = tokio::spawn(async move {
            TestNode::start_with(
                move |config: &mut Config| {
                    config.storage.backend = Some(Backend::S3);
                    config.storage.s3 = s3;
                    if let Some(size) = pack_size {
                        config.storage.pack_size = size;
                    }
                },
                NodeOptions::default(),
            )
            .await
        })
        .await;
        if let Ok(started) = started {
            return started;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("node on garage did not start");
}

// Checks STO-9.
#[tokio::test]
async fn a_stopped_s3_server_gives_503_and_no_manifest_then_recovers_without_restart() {
    let Some(bin) = Garage::bin_for("s3_outage") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut garage = Garage::start(dir.path(), bin, KEY_ID, SECRET, "outage");
    let node = start_node(s3_config(&garage, Duration::from_secs(5)), None).await;
    let client = client();
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

/// How the S3 server goes away in the middle of a body.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// kill -9: the node's next request is refused.
    Kill,
    /// SIGSTOP: the node's next request times out (`request_timeout`).
    Stop,
}

/// The size of the blob sent in the middle of an outage, in 1 MiB packs.
const BLOB: usize = 16 << 20;
/// Body bytes sent before the fault: several packs' worth, so packs are stored.
const BEFORE_FAULT: usize = 4 << 20;
/// Body frames.
const FRAME: usize = 256 << 10;

/// The shared body of the mid-body tests: a streamed upload, of which the first
/// `BEFORE_FAULT` bytes are sent and at least one pack is stored in the bucket before
/// `fault` hits the server; then the rest of the body is sent. The upload answers 503
/// `storage_unavailable` with `Retry-After` and leaves no manifest; once the server is
/// back the same upload is stored and reads back byte-exact, with the same node.
async fn outage_in_the_middle_of_a_body(test: &str, key_id: &str, bucket: &str, fault: Fault) {
    let Some(bin) = Garage::bin_for(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut garage = Garage::start(dir.path(), bin, key_id, SECRET, bucket);
    // A frozen server is noticed after `request_timeout` (no retry is left after it).
    let s3 = s3_config(&garage, Duration::from_secs(3));
    // The smallest pack size: packs are PUT while the body still streams.
    let node = start_node(s3.clone(), Some(ByteSize::mib(1))).await;
    let medium = Arc::new(S3Medium::new(&s3, None).unwrap());
    let packs = || {
        let medium = medium.clone();
        async move {
            // Medium calls block (the store runs them on the blocking pool).
            tokio::task::spawn_blocking(move || medium.list().map(|packs| packs.len()))
                .await
                .unwrap()
        }
    };
    assert_eq!(packs().await.unwrap(), 0, "an empty bucket to start with");
    let client = client();
    let data = Bytes::from(random_bytes(BLOB, 11));
    let key = BlobKey::of(&data).to_string();
    let manifests_before = node.manifest_count();

    // The body is whatever the test pushes into the channel, sent as it comes (chunked):
    // `Some(frame)`, then `None` for the end of the body. A channel closed without that
    // end breaks the body (the client gives the request up), so a shortened body is
    // never taken for a whole one and its connection is never used again.
    let (tx, rx) = tokio::sync::mpsc::channel::<Option<Bytes>>(1);
    let body = reqwest::Body::wrap_stream(futures_util::stream::unfold(rx, |mut rx| async {
        match rx.recv().await {
            Some(Some(frame)) => Some((Ok(frame), rx)),
            Some(None) => None,
            None => Some((Err(std::io::Error::other("body given up")), rx)),
        }
    }));
    let request = tokio::spawn(
        client
            .post(format!("{}/v1/blobs", node.url))
            .body(body)
            .send(),
    );
    let frames: Vec<Bytes> = (0..BLOB)
        .step_by(FRAME)
        .map(|at| data.slice(at..(at + FRAME).min(BLOB)))
        .collect();
    let (head, rest) = frames.split_at(BEFORE_FAULT / FRAME);
    for frame in head {
        tx.send(Some(frame.clone()))
            .await
            .expect("the node reads the body");
    }
    let stored = support::wait_until(Duration::from_secs(20), || async {
        packs().await.is_ok_and(|n| n > 0)
    })
    .await;
    assert!(stored, "no pack was stored while the body streamed");
    assert!(!request.is_finished(), "the upload is still open");

    match fault {
        Fault::Kill => garage.kill(),
        Fault::Stop => garage.signal("STOP"),
    }
    // The rest of the body; the node stops reading it once it has answered.
    let rest = rest.to_vec();
    let feeder = tokio::spawn(async move {
        for frame in rest.into_iter().map(Some).chain([None]) {
            if tx.send(frame).await.is_err() {
                break;
            }
        }
    });
    let response = tokio::time::timeout(Duration::from_secs(60), request)
        .await
        .expect("the node answered the upload")
        .unwrap()
        .unwrap_or_else(|err| panic!("{fault:?}: no answer to the upload, {err:?}"));
    // Stop sending what is left of the body: the request is given up, not completed.
    feeder.abort();
    assert_eq!(
        response.status(),
        503,
        "{fault:?}: never 201 while the store is down"
    );
    let retry: u64 = response
        .headers()
        .get("retry-after")
        .expect("Retry-After")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1, "Retry-After {retry}");
    let error: serde_json::Value = response.json().await.unwrap();
    assert_eq!(error["error"], "storage_unavailable", "{error}");

    let missing = client
        .get(format!("{}/v1/blobs/{key}", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404, "no manifest for the failed upload");
    assert_eq!(node.manifest_count(), manifests_before);

    match fault {
        Fault::Kill => garage.spawn(false),
        Fault::Stop => garage.signal("CONT"),
    }
    let response = client
        .post(format!("{}/v1/blobs", node.url))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    let status = response.status();
    let created: serde_json::Value = response.json().await.unwrap();
    assert_eq!(status, 201, "works again with no node restart: {created}");
    assert_eq!(created["key"], key.as_str());
    assert_eq!(node.manifest_count(), manifests_before + 1);
    let body = client
        .get(format!("{}/v1/blobs/{key}", node.url))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(body == data, "byte-exact after the outage");
}

// Checks STO-9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_server_killed_mid_body_gives_503_and_no_manifest_then_recovers() {
    outage_in_the_middle_of_a_body(
        "an_s3_server_killed_mid_body_gives_503_and_no_manifest_then_recovers",
        "GKoutagetest00002",
        "outage-kill",
        Fault::Kill,
    )
    .await;
}

// Checks STO-9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_server_frozen_mid_body_gives_503_and_no_manifest_then_recovers() {
    outage_in_the_middle_of_a_body(
        "an_s3_server_frozen_mid_body_gives_503_and_no_manifest_then_recovers",
        "GKoutagetest00003",
        "outage-stop",
        Fault::Stop,
    )
    .await;
}
