//! Resumable (tus) throughput of a real `graviton serve` process against one-shot upload to
//! the same process and against `@tus/server` with its file store, all in the same run
//! (issue 29, item 2).
//!
//! - **Graviton**: this build's `graviton serve` on its embedded default (pack store on
//!   the local disk, fsync on: every 201/204 is durable), HTTP/1 on loopback.
//! - **Peer**: `@tus/server` 2.4.5 with `@tus/file-store` 2.1.1 on Node (pinned by
//!   `benches/tus-peer/package-lock.json`, installed by `scripts/tus-peer-deps` into
//!   `target/tus-peer`). Its file store writes through the page cache and never calls
//!   fsync, so its figures are an upper bound for a durable peer.
//!
//! Each round uploads fresh pseudo-random content (a new seed per upload, nothing
//! deduplicates): a one-shot `POST /v1/blobs` of the blob, then for each PATCH size (4, 16,
//! 64 MiB) a Graviton tus upload (creation + PATCHes; the last PATCH commits) and the same
//! upload to the peer, alternately. Then creations per second on both (sequential and 16
//! at once; `Upload-Length` 1 MiB, no data). Printed: MB/s, tus / one-shot, Graviton /
//! peer.
//!
//! Run: `cargo bench --bench tus_peer` (release). `GRAVITON_BENCH_TUS_MIB` sets the blob
//! size (default 256), `GRAVITON_BENCH_ROUNDS` the rounds (default 2),
//! `GRAVITON_BENCH_CREATIONS` the creations per measurement (default 400).

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;

const TENANT: &str = "6f1c1a8e-5d0b-4c8e-9f55-3f2a8f0e7a11";
const PARTS_MIB: [usize; 3] = [4, 16, 64];

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Process {
    child: Child,
    base: String,
    dir: tempfile::TempDir,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn wait_answering(base: &str, path: &str) {
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let url = format!("{base}{path}");
    let ready = support::wait_until(Duration::from_secs(30), || {
        let client = client.clone();
        let url = url.clone();
        async move { client.get(url).send().await.is_ok() }
    })
    .await;
    assert!(ready, "{base} did not answer");
}

async fn start_graviton() -> Process {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = support::free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_graviton"))
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn graviton serve");
    let base = format!("http://127.0.0.1:{port}");
    wait_answering(&base, "/readyz").await;
    Process { child, base, dir }
}

fn start_peer() -> Process {
    let out = Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/tus-peer-deps"
    ))
    .stderr(Stdio::inherit())
    .output()
    .expect("scripts/tus-peer-deps");
    assert!(
        out.status.success(),
        "scripts/tus-peer-deps failed (npm needed)"
    );
    let peer_dir = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let port = support::free_port();
    let child = Command::new("node")
        .arg(format!("{peer_dir}/server.mjs"))
        .arg(port.to_string())
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn node (Node 20 needed)");
    Process {
        child,
        base: format!("http://127.0.0.1:{port}"),
        dir,
    }
}

fn mb_per_s(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e6
}

async fn one_shot(client: &reqwest::Client, base: &str, data: Bytes) -> Duration {
    let started = Instant::now();
    let response = client
        .post(format!("{base}/v1/blobs"))
        .body(data)
        .send()
        .await
        .expect("upload");
    assert_eq!(response.status(), 201, "{:?}", response.text().await);
    started.elapsed()
}

/// `POST {create}` with `Upload-Length`; the upload's absolute URL.
async fn create(client: &reqwest::Client, base: &str, create: &str, length: usize) -> String {
    let created = client
        .post(format!("{base}{create}"))
        .header("tus-resumable", "1.0.0")
        .header("upload-length", length.to_string())
        .header("x-graviton-tenant-id", TENANT)
        .send()
        .await
        .expect("create");
    assert_eq!(created.status(), 201, "{:?}", created.text().await);
    let location = created.headers()["location"].to_str().expect("location");
    if location.starts_with("http") {
        location.to_string()
    } else {
        format!("{base}{location}")
    }
}

/// Creation plus PATCHes of `part` bytes; the time of the whole upload.
async fn resumable(
    client: &reqwest::Client,
    base: &str,
    create_path: &str,
    data: Bytes,
    part: usize,
) -> Duration {
    let started = Instant::now();
    let upload = create(client, base, create_path, data.len()).await;
    let mut offset = 0;
    while offset < data.len() {
        let end = (offset + part).min(data.len());
        let response = client
            .patch(&upload)
            .header("tus-resumable", "1.0.0")
            .header("content-type", "application/offset+octet-stream")
            .header("upload-offset", offset.to_string())
            .header("x-graviton-tenant-id", TENANT)
            .body(data.slice(offset..end))
            .send()
            .await
            .expect("patch");
        assert_eq!(response.status(), 204, "{:?}", response.text().await);
        offset = end;
    }
    started.elapsed()
}

/// Creations per second, `count` of them with `concurrency` in flight.
async fn creations(
    client: &reqwest::Client,
    base: &str,
    create_path: &str,
    count: usize,
    concurrency: usize,
) -> f64 {
    let started = Instant::now();
    futures_util::stream::iter(0..count)
        .map(|_| create(client, base, create_path, 1 << 20))
        .buffer_unordered(concurrency)
        .collect::<Vec<_>>()
        .await;
    count as f64 / started.elapsed().as_secs_f64()
}

/// Remove the peer's finished uploads so the disk does not fill over rounds.
fn clear(dir: &std::path::Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let _ = std::fs::remove_file(entry.path());
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mib: usize = env_or("GRAVITON_BENCH_TUS_MIB", 256);
    let rounds: u64 = env_or("GRAVITON_BENCH_ROUNDS", 2);
    let count: usize = env_or("GRAVITON_BENCH_CREATIONS", 400);
    let size = mib << 20;
    let graviton = start_graviton().await;
    let peer = start_peer();
    wait_answering(&peer.base, "/files").await;
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    println!(
        "tus_peer bench: {mib} MiB blobs, graviton serve (pack store, fsync on) vs @tus/server file store (no fsync), loopback, {rounds} rounds, load {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut seed = 7000;
    let mut fresh = || {
        seed += 1;
        Bytes::from(support::node::random_bytes(size, seed))
    };
    for round in 1..=rounds {
        let base_rate = mb_per_s(size, one_shot(&client, &graviton.base, fresh()).await);
        println!("round {round}: graviton one-shot POST          {base_rate:8.1} MB/s");
        for part_mib in PARTS_MIB {
            let part = part_mib << 20;
            let ours = mb_per_s(
                size,
                resumable(&client, &graviton.base, "/v1/uploads", fresh(), part).await,
            );
            let theirs = mb_per_s(
                size,
                resumable(&client, &peer.base, "/files", fresh(), part).await,
            );
            clear(peer.dir.path());
            println!(
                "round {round}: tus {part_mib:>2} MiB PATCHes ({:>3}): graviton {ours:8.1} MB/s  @tus/server {theirs:8.1} MB/s  \
                 graviton/one-shot {:.2}  graviton/@tus/server {:.2}",
                size.div_ceil(part),
                ours / base_rate,
                ours / theirs
            );
        }
        for concurrency in [1usize, 16] {
            let ours = creations(&client, &graviton.base, "/v1/uploads", count, concurrency).await;
            let theirs = creations(&client, &peer.base, "/files", count, concurrency).await;
            clear(peer.dir.path());
            println!(
                "round {round}: creations, {concurrency:>2} at once: graviton {ours:8.0}/s  @tus/server {theirs:8.0}/s  ratio {:.2}",
                ours / theirs
            );
        }
    }
    let _ = graviton.dir.path();
}
