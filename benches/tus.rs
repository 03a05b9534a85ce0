//! Resumable (tus) upload throughput against a one-shot `POST /v1/blobs` of the same size,
//! both measured in the same run against one in-process node over loopback (pack store,
//! fsync on, as in production).
//!
//! Each measurement uploads fresh pseudo-random content (different seeds, so nothing
//! deduplicates between runs): one-shot POST, then tus with PATCHes of 4, 16 and 64 MiB
//! (creation + PATCHes; the final PATCH commits the manifest). Printed: MB/s and the
//! ratio tus / one-shot, per round.
//!
//! Run: `cargo bench --bench tus` (`GRAVITON_BENCH_TUS_MIB` sets the blob size, default
//! 256; `GRAVITON_BENCH_ROUNDS` the rounds, default 2).

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::time::{Duration, Instant};

use graviton::config::Config;
use support::node::random_bytes;

const TENANT: &str = "6f1c1a8e-5d0b-4c8e-9f55-3f2a8f0e7a11";

fn mb_per_s(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e6
}

async fn one_shot(client: &reqwest::Client, url: &str, data: Vec<u8>) -> Duration {
    let started = Instant::now();
    let response = client
        .post(format!("{url}/v1/blobs"))
        .body(data)
        .send()
        .await
        .expect("upload");
    assert_eq!(response.status(), 201, "{:?}", response.text().await);
    started.elapsed()
}

async fn resumable(client: &reqwest::Client, url: &str, data: Vec<u8>, part: usize) -> Duration {
    let data = bytes::Bytes::from(data);
    let started = Instant::now();
    let created = client
        .post(format!("{url}/v1/uploads"))
        .header("tus-resumable", "1.0.0")
        .header("upload-length", data.len().to_string())
        .header("x-graviton-tenant-id", TENANT)
        .send()
        .await
        .expect("create");
    assert_eq!(created.status(), 201);
    let upload = format!(
        "{url}{}",
        created.headers()["location"].to_str().expect("location")
    );
    let mut offset = 0;
    while offset < data.len() {
        let end = (offset + part).min(data.len());
        let response = client
            .patch(&upload)
            .header("tus-resumable", "1.0.0")
            .header("content-type", "application/offset+octet-stream")
            .header("upload-offset", offset.to_string())
            .body(data.slice(offset..end))
            .send()
            .await
            .expect("patch");
        assert_eq!(response.status(), 204, "{:?}", response.text().await);
        offset = end;
    }
    started.elapsed()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mib: usize = std::env::var("GRAVITON_BENCH_TUS_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let rounds: u64 = std::env::var("GRAVITON_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let size = mib << 20;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = Config::for_test(dir.path());
    config.storage.fsync = true;
    let node = graviton::node::start_with(config, Default::default())
        .await
        .expect("start node");
    let url = node.base_url();
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    println!("tus bench: {mib} MiB blobs, pack store with fsync, loopback, {rounds} rounds");
    let mut seed = 1000;
    for round in 1..=rounds {
        seed += 1;
        let base = one_shot(&client, &url, random_bytes(size, seed)).await;
        let base_rate = mb_per_s(size, base);
        println!("round {round}: one-shot POST            {base_rate:8.1} MB/s");
        for part_mib in [4usize, 16, 64] {
            seed += 1;
            let took = resumable(&client, &url, random_bytes(size, seed), part_mib << 20).await;
            let rate = mb_per_s(size, took);
            println!(
                "round {round}: tus, {part_mib:>2} MiB PATCHes ({:>3})  {rate:8.1} MB/s  ratio {:.2}",
                size.div_ceil(part_mib << 20),
                rate / base_rate
            );
        }
    }
    node.shutdown().await;
}
