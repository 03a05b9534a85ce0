//! Many small transfers at once, against a peer in the same run (issue 29, item 1).
//!
//! - **Graviton**: a real `graviton serve` process (this build's binary) on its embedded
//!   default: pack store on the local disk, fsync on (every 201 is durable), one node,
//!   HTTP/1 on loopback (`POST /v1/blobs`, `GET /v1/blobs/{key}`).
//! - **Peer**: the Garage single node of `scripts/services.sh` (data and metadata fsync
//!   on), S3 `PUT`/`GET` of the same objects through `object_store`'s S3 client.
//!
//! Cells: object sizes 4 KiB, 64 KiB and 1 MiB, each at 1, 16 and 64 concurrent clients.
//! Every upload is a fresh object (nothing deduplicates); the downloads read back the
//! objects the same cell uploaded. For each cell and side it prints ops/s, p50 and p99
//! latency, the refusals (any answer but 201/200), and Graviton's ops/s over Garage's.
//! The two sides run alternately, cell by cell, so a slow period of the machine hits both.
//!
//! Run: `source scripts/services.sh && cargo bench --bench concurrency`.
//! `GRAVITON_BENCH_OPS` scales the operations per cell (default 1.0: 768, 384 and 192
//! uploads for the three sizes); `GRAVITON_BENCH_CELLS=4k,64k` picks sizes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, PutPayload};

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

const SIZES: [(&str, usize, usize); 3] = [
    ("4k", 4 << 10, 768),
    ("64k", 64 << 10, 384),
    ("1m", 1 << 20, 192),
];
const CLIENTS: [usize; 3] = [1, 16, 64];

/// Latencies of one side of one cell.
struct Run {
    elapsed: Duration,
    latencies: Vec<Duration>,
    refused: usize,
}

impl Run {
    fn ops_per_s(&self) -> f64 {
        self.latencies.len() as f64 / self.elapsed.as_secs_f64()
    }

    fn percentile(&self, p: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        if sorted.is_empty() {
            return Duration::ZERO;
        }
        let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
        sorted[at]
    }

    fn line(&self, side: &str) -> String {
        format!(
            "{side:<9} {:>9.1} ops/s  p50 {:>8.2} ms  p99 {:>8.2} ms  refused {}",
            self.ops_per_s(),
            self.percentile(0.50).as_secs_f64() * 1e3,
            self.percentile(0.99).as_secs_f64() * 1e3,
            self.refused
        )
    }
}

/// Run `op` over every item with `clients` in flight; collect per-op latencies.
async fn drive<T, F, Fut>(items: Vec<T>, clients: usize, op: F) -> Run
where
    T: Send + 'static,
    F: Fn(T) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let started = Instant::now();
    let results: Vec<(Duration, bool)> = futures_util::stream::iter(items)
        .map(|item| {
            let op = op.clone();
            async move {
                let t = Instant::now();
                let ok = op(item).await;
                (t.elapsed(), ok)
            }
        })
        .buffer_unordered(clients)
        .collect()
        .await;
    let elapsed = started.elapsed();
    let refused = results.iter().filter(|(_, ok)| !ok).count();
    Run {
        elapsed,
        latencies: results
            .into_iter()
            .filter(|(_, ok)| *ok)
            .map(|(d, _)| d)
            .collect(),
        refused,
    }
}

struct Graviton {
    child: std::process::Child,
    base: String,
    _dir: tempfile::TempDir,
}

impl Graviton {
    async fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = support::free_port();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_graviton"))
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--data-dir",
            ])
            .arg(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn graviton serve");
        let base = format!("http://127.0.0.1:{port}");
        let client = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("client");
        let ready = support::wait_until(Duration::from_secs(30), || {
            let client = client.clone();
            let url = format!("{base}/readyz");
            async move { matches!(client.get(url).send().await, Ok(r) if r.status().is_success()) }
        })
        .await;
        assert!(ready, "graviton serve did not become ready");
        Graviton {
            child,
            base,
            _dir: dir,
        }
    }
}

impl Drop for Graviton {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn garage() -> Arc<dyn ObjectStore> {
    let var = |name: &str| {
        std::env::var(name)
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| panic!("{name} is not set: source scripts/services.sh first"))
    };
    let store = AmazonS3Builder::new()
        .with_endpoint(var("GRAVITON_TEST_S3_ENDPOINT"))
        .with_bucket_name(var("GRAVITON_TEST_S3_BUCKET"))
        .with_region(std::env::var("GRAVITON_TEST_S3_REGION").unwrap_or_else(|_| "garage".into()))
        .with_access_key_id(var("GRAVITON_TEST_S3_ACCESS_KEY"))
        .with_secret_access_key(var("GRAVITON_TEST_S3_SECRET_KEY"))
        .with_virtual_hosted_style_request(false)
        .with_client_options(
            ClientOptions::new()
                .with_allow_http(true)
                .with_timeout(Duration::from_secs(60))
                .with_pool_max_idle_per_host(128),
        )
        .build()
        .expect("S3 client");
    Arc::new(store)
}

/// Fresh objects: every one differs from every other in its first 16 bytes and is
/// otherwise pseudo-random, so neither side can deduplicate.
fn objects(size: usize, count: usize, seed: u64) -> Vec<Bytes> {
    let base = support::node::random_bytes(size.max(16), seed);
    (0..count)
        .map(|i| {
            let mut body = base.clone();
            body[..8].copy_from_slice(&(i as u64).to_le_bytes());
            body[8..16].copy_from_slice(&seed.to_le_bytes());
            // a cheap per-object scramble of the rest, so FastCDC blocks differ too
            let key = blake3::hash(&body[..16]);
            for (b, k) in body.iter_mut().skip(16).zip(key.as_bytes().iter().cycle()) {
                *b ^= k;
            }
            Bytes::from(body)
        })
        .collect()
}

async fn graviton_puts(base: &str, bodies: Vec<Bytes>, clients: usize) -> (Run, Vec<String>) {
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(clients)
        .build()
        .expect("client");
    let keys = Arc::new(std::sync::Mutex::new(Vec::new()));
    let url = format!("{base}/v1/blobs");
    let k = keys.clone();
    let run = drive(bodies, clients, move |body: Bytes| {
        let client = client.clone();
        let url = url.clone();
        let keys = k.clone();
        async move {
            let Ok(response) = client.post(&url).body(body).send().await else {
                return false;
            };
            if response.status() != 201 {
                return false;
            }
            let Ok(receipt) = response.json::<serde_json::Value>().await else {
                return false;
            };
            match receipt["key"].as_str() {
                Some(key) => {
                    keys.lock().expect("keys").push(key.to_string());
                    true
                }
                None => false,
            }
        }
    })
    .await;
    let keys = keys.lock().expect("keys").clone();
    (run, keys)
}

async fn graviton_gets(base: &str, keys: Vec<String>, clients: usize) -> Run {
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(clients)
        .build()
        .expect("client");
    let base = base.to_string();
    drive(keys, clients, move |key: String| {
        let client = client.clone();
        let url = format!("{base}/v1/blobs/{key}");
        async move {
            match client.get(&url).send().await {
                Ok(r) if r.status() == 200 => r.bytes().await.is_ok(),
                _ => false,
            }
        }
    })
    .await
}

async fn garage_puts(
    store: Arc<dyn ObjectStore>,
    prefix: &str,
    bodies: Vec<Bytes>,
    clients: usize,
) -> (Run, Vec<ObjectPath>) {
    let items: Vec<(ObjectPath, Bytes)> = bodies
        .into_iter()
        .enumerate()
        .map(|(i, b)| (ObjectPath::from(format!("{prefix}/{i:06}")), b))
        .collect();
    let paths: Vec<ObjectPath> = items.iter().map(|(p, _)| p.clone()).collect();
    let run = drive(items, clients, move |(path, body): (ObjectPath, Bytes)| {
        let store = store.clone();
        async move { store.put(&path, PutPayload::from_bytes(body)).await.is_ok() }
    })
    .await;
    (run, paths)
}

async fn garage_gets(store: Arc<dyn ObjectStore>, paths: Vec<ObjectPath>, clients: usize) -> Run {
    drive(paths, clients, move |path: ObjectPath| {
        let store = store.clone();
        async move {
            match store.get(&path).await {
                Ok(r) => r.bytes().await.is_ok(),
                Err(_) => false,
            }
        }
    })
    .await
}

async fn clear(store: Arc<dyn ObjectStore>, paths: Vec<ObjectPath>) {
    futures_util::stream::iter(paths)
        .for_each_concurrent(32, |p| {
            let store = store.clone();
            async move {
                let _ = store.delete(&p).await;
            }
        })
        .await;
}

#[tokio::main]
async fn main() {
    let scale: f64 = std::env::var("GRAVITON_BENCH_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0);
    let cells: Option<Vec<String>> = std::env::var("GRAVITON_BENCH_CELLS")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let store = garage();
    let node = Graviton::start().await;
    let run_id = support::unique_suffix();
    println!(
        "graviton concurrency benchmark: fresh objects, graviton serve (packs, fsync on) vs Garage (fsync on)"
    );
    let mut summary = Vec::new();
    for (name, size, base_ops) in SIZES {
        if cells.as_ref().is_some_and(|c| !c.iter().any(|n| n == name)) {
            continue;
        }
        for clients in CLIENTS {
            let count = ((base_ops as f64 * scale) as usize).max(clients * 2);
            let seed = (size as u64) << 8 | clients as u64;
            let bodies = objects(size, count, seed);
            println!("\n{name} x {clients} clients, {count} objects");
            // uploads: Graviton first in odd cells, Garage first in even ones
            let prefix = format!("bench-concurrency-{run_id}/{name}-{clients}");
            let (g_put, keys, s_put, paths) = if clients == 16 {
                let (s_put, paths) =
                    garage_puts(store.clone(), &prefix, bodies.clone(), clients).await;
                let (g_put, keys) = graviton_puts(&node.base, bodies, clients).await;
                (g_put, keys, s_put, paths)
            } else {
                let (g_put, keys) = graviton_puts(&node.base, bodies.clone(), clients).await;
                let (s_put, paths) = garage_puts(store.clone(), &prefix, bodies, clients).await;
                (g_put, keys, s_put, paths)
            };
            println!("  PUT  {}", g_put.line("graviton"));
            println!("  PUT  {}", s_put.line("garage"));
            let g_get = graviton_gets(&node.base, keys, clients).await;
            let s_get = garage_gets(store.clone(), paths.clone(), clients).await;
            println!("  GET  {}", g_get.line("graviton"));
            println!("  GET  {}", s_get.line("garage"));
            let put_ratio = g_put.ops_per_s() / s_put.ops_per_s();
            let get_ratio = g_get.ops_per_s() / s_get.ops_per_s();
            println!(
                "  ratio graviton / garage: PUT {put_ratio:.2}  GET {get_ratio:.2}  (target PUT >= 2.0)"
            );
            summary.push((name, clients, put_ratio, get_ratio));
            clear(store.clone(), paths).await;
        }
    }
    println!("\nsummary (graviton ops/s / garage ops/s, same run)");
    println!("{:<6} {:>8} {:>8} {:>8}", "size", "clients", "PUT", "GET");
    for (name, clients, put, get) in summary {
        println!("{name:<6} {clients:>8} {put:>8.2} {get:>8.2}");
    }
}
