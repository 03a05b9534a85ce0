//! gRPC `GetBlob` against the HTTP download of the same blob, on one in-process node, in
//! one run: the blob is uploaded once, then downloaded `ROUNDS` times over each path,
//! alternating, and the median throughput of each path is printed. Both read through the
//! same verifying reader (`pipeline::read`); no tenant, so no quota is charged.
//!
//! Run: `cargo bench --bench grpc`. `GRAVITON_BENCH_GRPC_MIB` sets the blob size (default
//! 256), `GRAVITON_BENCH_ROUNDS` the rounds per path (default 5).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use graviton::config::Config;
use graviton::grpc::proto::GetBlobRequest;
use graviton::grpc::proto::blobs_client::BlobsClient;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn mib_s(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / took.as_secs_f64()
}

#[tokio::main]
async fn main() {
    let size = env_u64("GRAVITON_BENCH_GRPC_MIB", 256) << 20;
    let rounds = env_u64("GRAVITON_BENCH_ROUNDS", 5).max(1);
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::for_test(dir.path());
    config.grpc.listen = Some("127.0.0.1:0".parse().unwrap());
    let node = graviton::node::start(config).await.expect("start node");
    let grpc_addr = node.grpc_addr().expect("grpc listener");

    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut data = vec![0u8; size as usize];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let response = http
        .post(format!("{}/v1/blobs", node.base_url()))
        .body(data)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let key = response.json::<serde_json::Value>().await.unwrap()["key"]
        .as_str()
        .unwrap()
        .to_string();

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc_addr}"))
        .unwrap()
        .initial_stream_window_size(4 << 20)
        .initial_connection_window_size(8 << 20)
        .connect()
        .await
        .unwrap();
    let mut grpc = BlobsClient::new(channel);

    let (mut http_runs, mut grpc_runs) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let started = Instant::now();
        let mut body = http
            .get(format!("{}/v1/blobs/{key}", node.base_url()))
            .send()
            .await
            .unwrap()
            .bytes_stream();
        let mut got = 0u64;
        while let Some(chunk) = body.next().await {
            got += chunk.unwrap().len() as u64;
        }
        assert_eq!(got, size);
        http_runs.push(mib_s(size, started.elapsed()));

        let started = Instant::now();
        let mut stream = grpc
            .get_blob(GetBlobRequest {
                key: key.clone(),
                range: None,
            })
            .await
            .unwrap()
            .into_inner();
        let mut got = 0u64;
        while let Some(frame) = stream.message().await.unwrap() {
            got += frame.data.len() as u64;
        }
        assert_eq!(got, size);
        grpc_runs.push(mib_s(size, started.elapsed()));
    }
    let (h, g) = (median(http_runs.clone()), median(grpc_runs.clone()));
    println!(
        "download of a {} MiB blob, {rounds} rounds per path (median; min..max)",
        size >> 20
    );
    let range = |v: &[f64]| {
        let min = v.iter().cloned().fold(f64::MAX, f64::min);
        let max = v.iter().cloned().fold(0.0, f64::max);
        format!("{min:.0}..{max:.0}")
    };
    println!("  HTTP GET       {h:8.0} MiB/s ({})", range(&http_runs));
    println!("  gRPC GetBlob   {g:8.0} MiB/s ({})", range(&grpc_runs));
    println!("  gRPC / HTTP    {:8.2}", g / h);
    node.shutdown().await;
}
