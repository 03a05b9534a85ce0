//! Downloads that fail honestly (OPS-2, OPS-3): a block store that fails before the first
//! block answers 503 `storage_unavailable` with `Retry-After`, one that fails after the
//! head aborts the connection, and both count as errors in the download and HTTP metrics.
//!
//! The outage is a real pack store behind a switch that makes its reads fail, as a stopped
//! S3 server or an unreadable disk does, from a chosen block on.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use graviton::cas::BlockKey;
use graviton::node::NodeOptions;
use graviton::storage::pack::{PackOptions, PackStore};
use graviton::storage::{BlockStore, StoreError, StoreFuture, WriteSession};
use support::client;
use support::node::{TestNode, random_bytes};

/// A pack store whose block reads fail from the `fail_from`-th read on.
struct FailingReads {
    inner: PackStore,
    reads: AtomicUsize,
    fail_from: AtomicUsize,
}

impl FailingReads {
    /// Reads fail after `ok` more blocks (`usize::MAX`: never).
    fn fail_after(&self, ok: usize) {
        self.reads.store(0, Ordering::SeqCst);
        self.fail_from.store(ok, Ordering::SeqCst);
    }
}

impl BlockStore for FailingReads {
    fn begin(&self) -> Result<Box<dyn WriteSession>, StoreError> {
        self.inner.begin()
    }
    fn get(&self, key: BlockKey) -> StoreFuture<'_, Option<Bytes>> {
        let read = self.reads.fetch_add(1, Ordering::SeqCst);
        if read >= self.fail_from.load(Ordering::SeqCst) {
            return Box::pin(async {
                Err(StoreError::Unavailable(
                    "injected outage: the block store does not answer".into(),
                ))
            });
        }
        self.inner.get(key)
    }
    fn contains(&self, key: BlockKey) -> StoreFuture<'_, bool> {
        self.inner.contains(key)
    }
}

async fn node_with_failing_reads() -> (TestNode, Arc<FailingReads>) {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(FailingReads {
        inner: PackStore::open_local(
            dir.path(),
            PackOptions {
                pack_size: 32 << 20,
                fsync: false,
                trace: None,
            },
        )
        .unwrap(),
        reads: AtomicUsize::new(0),
        fail_from: AtomicUsize::new(usize::MAX),
    });
    // The store's directory lives as long as the test: leak the guard.
    std::mem::forget(dir);
    let node = TestNode::start_with(
        |_| {},
        NodeOptions {
            blocks: Some(store.clone()),
            ..Default::default()
        },
    )
    .await;
    (node, store)
}

async fn upload(url: &str, data: &[u8]) -> String {
    let response = client()
        .post(format!("{url}/v1/blobs"))
        .body(data.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    response.json::<serde_json::Value>().await.unwrap()["key"]
        .as_str()
        .unwrap()
        .to_string()
}

use support::metrics::count_or_zero as sample;

const GET_2XX: &str =
    "graviton_http_requests_total{route=\"/v1/blobs/{key}\",method=\"GET\",status=\"2xx\"}";
const GET_5XX: &str =
    "graviton_http_requests_total{route=\"/v1/blobs/{key}\",method=\"GET\",status=\"5xx\"}";
const SERVER_ERROR: &str = "graviton_downloads_total{outcome=\"server_error\"}";
const OK: &str = "graviton_downloads_total{outcome=\"ok\"}";

// Checks OPS-2.
#[tokio::test]
async fn a_block_store_failing_before_the_first_block_answers_503_with_retry_after() {
    let (node, store) = node_with_failing_reads().await;
    let data = random_bytes(1 << 20, 2);
    let key = upload(&node.url, &data).await;

    store.fail_after(0);
    for range in [None, Some("bytes=500000-")] {
        let mut request = client().get(format!("{}/v1/blobs/{key}", node.url));
        if let Some(range) = range {
            request = request.header("range", range);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 503, "{range:?}");
        assert_eq!(response.headers()["retry-after"], "5");
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body["error"], "storage_unavailable", "{body}");
    }
    let metrics = node.metrics_text();
    assert_eq!(sample(&metrics, SERVER_ERROR), 2, "{metrics}");
    assert_eq!(sample(&metrics, GET_5XX), 2, "{metrics}");
    assert_eq!(sample(&metrics, GET_2XX), 0, "{metrics}");

    // The store is back: the same blob downloads byte-exact.
    store.fail_after(usize::MAX);
    let response = client()
        .get(format!("{}/v1/blobs/{key}", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(&response.bytes().await.unwrap()[..], &data[..]);
    assert_eq!(sample(&node.metrics_text(), OK), 1);
}

// Checks OPS-3.
#[tokio::test]
async fn a_block_store_failing_mid_stream_aborts_the_connection_and_counts_as_an_error() {
    let (node, store) = node_with_failing_reads().await;
    let data = random_bytes(4 << 20, 3);
    let key = upload(&node.url, &data).await;

    // About 64 blocks: ten are read, then the store fails.
    store.fail_after(10);
    let response = client()
        .get(format!("{}/v1/blobs/{key}", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "the first block was read");
    assert_eq!(
        response.headers()["content-length"],
        data.len().to_string().as_str()
    );
    let mut body = response.bytes_stream();
    let mut received = Vec::new();
    let mut failed = false;
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(chunk) => received.extend_from_slice(&chunk),
            Err(_) => {
                failed = true;
                break;
            }
        }
    }
    assert!(
        failed,
        "the client must see an error, not a short body taken as complete ({} of {} bytes)",
        received.len(),
        data.len()
    );
    assert!(received.len() < data.len());
    assert_eq!(
        &received[..],
        &data[..received.len()],
        "what arrived is a prefix"
    );

    // The request is counted when the server drops the aborted body.
    let counted = support::wait_until(Duration::from_secs(10), || {
        let metrics = node.metrics_text();
        async move { sample(&metrics, GET_5XX) == 1 }
    })
    .await;
    let metrics = node.metrics_text();
    assert!(counted, "{metrics}");
    assert_eq!(sample(&metrics, GET_2XX), 0, "{metrics}");
    assert_eq!(sample(&metrics, SERVER_ERROR), 1, "{metrics}");
    assert_eq!(sample(&metrics, OK), 0, "{metrics}");
}
