//! A stopped block store stops the reading of the request body (bounded memory), and
//! shutdown aborts what outlives its grace period without leaving a blob behind.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use graviton::cas::BlockKey;
use graviton::config::HumanDuration;
use graviton::node::{NodeOptions, ShutdownOutcome};
use graviton::storage::pack::{PackOptions, PackStore};
use graviton::storage::{
    BlockStore, CommitReport, PutOutcome, StoreError, StoreFuture, WriteSession,
};
use support::node::{TestNode, random_bytes};
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;

/// A pack store whose block appends wait while the gate is closed.
struct GatedStore {
    inner: PackStore,
    open: watch::Receiver<bool>,
    puts: Arc<AtomicU64>,
}

struct GatedSession {
    inner: Box<dyn WriteSession>,
    open: watch::Receiver<bool>,
    puts: Arc<AtomicU64>,
}

impl WriteSession for GatedSession {
    fn append(&mut self, key: BlockKey, data: Bytes) -> StoreFuture<'_, PutOutcome> {
        Box::pin(async move {
            let _ = self.open.wait_for(|o| *o).await;
            self.puts.fetch_add(1, Ordering::SeqCst);
            self.inner.append(key, data).await
        })
    }
    fn confirm(&mut self, keys: Vec<BlockKey>) {
        self.inner.confirm(keys)
    }
    fn commit(self: Box<Self>) -> StoreFuture<'static, CommitReport> {
        self.inner.commit()
    }
    fn abort(self: Box<Self>) -> StoreFuture<'static, ()> {
        self.inner.abort()
    }
}

impl BlockStore for GatedStore {
    fn begin(&self) -> Result<Box<dyn WriteSession>, StoreError> {
        Ok(Box::new(GatedSession {
            inner: self.inner.begin()?,
            open: self.open.clone(),
            puts: self.puts.clone(),
        }))
    }
    fn get(&self, key: BlockKey) -> StoreFuture<'_, Option<Bytes>> {
        self.inner.get(key)
    }
    fn contains(&self, key: BlockKey) -> StoreFuture<'_, bool> {
        self.inner.contains(key)
    }
}

/// Write `data` as the body of a POST, counting bytes accepted by the socket.
fn spawn_writer(
    addr: std::net::SocketAddr,
    data: Vec<u8>,
    written: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<String> {
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /v1/blobs HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
            data.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        for piece in data.chunks(64 * 1024) {
            if stream.write_all(piece).await.is_err() {
                return String::new();
            }
            written.fetch_add(piece.len() as u64, Ordering::SeqCst);
        }
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer).await;
        answer
    })
}

async fn wait_for_plateau(written: &AtomicU64) -> u64 {
    let mut last = written.load(Ordering::SeqCst);
    let mut stable_since = tokio::time::Instant::now();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = written.load(Ordering::SeqCst);
        if now != last {
            last = now;
            stable_since = tokio::time::Instant::now();
        } else if stable_since.elapsed() > Duration::from_millis(750) {
            return now;
        }
    }
    panic!("the client never stopped being able to write: no back-pressure");
}

// Checks MEM-1: a stopped block store stops the client writing far below the body size.
#[tokio::test]
async fn stopped_block_store_back_pressures_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let (gate, open) = watch::channel(false);
    let store = Arc::new(GatedStore {
        inner: PackStore::open_local(
            dir.path(),
            PackOptions {
                pack_size: 32 << 20,
                fsync: false,
                trace: None,
            },
        )
        .unwrap(),
        open,
        puts: Arc::new(AtomicU64::new(0)),
    });
    let node = TestNode::start_with(
        |_| {},
        NodeOptions {
            blocks: Some(store.clone()),
            ..Default::default()
        },
    )
    .await;

    let total = 128usize << 20;
    let data = random_bytes(total, 11);
    let written = Arc::new(AtomicU64::new(0));
    let writer = spawn_writer(node.addr(), data, written.clone());

    let stalled_at = wait_for_plateau(&written).await;
    // Kernel socket buffers plus the pipeline's bounded queues: far below the body size.
    assert!(
        stalled_at < 48 << 20,
        "client wrote {stalled_at} bytes into a stopped server"
    );
    assert_eq!(store.puts.load(Ordering::SeqCst), 0);

    gate.send(true).unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(60), writer)
        .await
        .unwrap()
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    assert_eq!(written.load(Ordering::SeqCst), total as u64);
    assert!(store.puts.load(Ordering::SeqCst) > 1000);
}

// Checks CAS-2: an upload aborted by the shutdown leaves no manifest.
#[tokio::test]
async fn shutdown_aborts_uploads_that_outlive_the_grace_period() {
    let mut node = TestNode::start_with(
        |c| c.node.shutdown_grace = HumanDuration::millis(300),
        NodeOptions::default(),
    )
    .await;
    let mut stream = tokio::net::TcpStream::connect(node.addr()).await.unwrap();
    stream
        .write_all(b"POST /v1/blobs HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
        .await
        .unwrap();
    stream.write_all(&random_bytes(300_000, 12)).await.unwrap();
    let started = support::wait_until(Duration::from_secs(5), || async {
        node.metric("graviton_upload_bytes_total") == Some(300000)
    })
    .await;
    assert!(started);
    assert_eq!(node.shutdown().await, ShutdownOutcome::Aborted);
    assert_eq!(node.manifest_count(), 0, "an aborted upload leaves no blob");
}
