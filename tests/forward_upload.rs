//! Forwarding over real loopback sockets: client → front node (axum, forwarder) →
//! owner's internal listener (axum). Bodies are verified with BLAKE3 at the owner.

#[allow(unused_imports)]
mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use graviton::config::Secret;
use graviton::edge::{ApiError, ErrorCode};
use graviton::http::internal::{EpochCheck, IngestRequest, OwnerIngest};
use graviton::ids::{NodeId, SessionKey};
use graviton::placement::{Epoch, EpochVerdict, OwnerTarget, RouteError, ShardId, StaleEpoch};
use graviton::relay::{ForwardOptions, Forwarder, OwnerResolver, Relayed};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "internal-token-0123456789abcdefghijklmnopqrstuvwxyz";
const TENANT: &str = "0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f";
const SESSION: &str = "6ba7b810-9dad-11d1-80b4-00c04fd430c8";
const GUARD: Duration = Duration::from_secs(120);
const FRAME: usize = 64 * 1024;

/// Deterministic pseudo-random bytes, produced frame by frame (xorshift64*).
fn frames(seed: u64, total: usize) -> impl Iterator<Item = Bytes> {
    let mut state = seed | 1;
    let mut left = total;
    std::iter::from_fn(move || {
        if left == 0 {
            return None;
        }
        let n = left.min(FRAME);
        left -= n;
        let mut frame = Vec::with_capacity(n);
        while frame.len() < n {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let word = state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
            frame.extend_from_slice(&word[..(n - frame.len()).min(8)]);
        }
        Some(Bytes::from(frame))
    })
}

fn expected_hash(seed: u64, total: usize) -> String {
    let mut hasher = blake3::Hasher::new();
    for frame in frames(seed, total) {
        hasher.update(&frame);
    }
    hasher.finalize().to_hex().to_string()
}

/// A fake owner: hashes the body, counts bytes, optionally reads slowly, and records
/// the largest gap between bytes the forwarder pulled and bytes that arrived here.
#[derive(Clone)]
struct HashingOwner {
    name: NodeId,
    calls: Arc<AtomicU64>,
    received: Arc<AtomicU64>,
    max_in_flight: Arc<AtomicU64>,
    pulled_by_forwarder: Option<Arc<graviton::relay::ForwardStats>>,
    slow: bool,
    hash: bool,
    /// Answer `409 session_busy` instead of ingesting.
    busy: bool,
}

impl OwnerIngest for HashingOwner {
    fn ingest(
        &self,
        request: IngestRequest,
    ) -> BoxFuture<'static, Result<axum::response::Response, ApiError>> {
        let owner = self.clone();
        owner.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            if owner.busy {
                return Err(ApiError::new(
                    ErrorCode::SessionBusy,
                    "this session is already uploading",
                )
                .with_retry_after(Duration::from_secs(2)));
            }
            let mut hasher = blake3::Hasher::new();
            let mut size = 0u64;
            let mut since_pause = 0usize;
            let mut stream = request.body.into_data_stream();
            while let Some(frame) = stream.next().await {
                let frame = frame
                    .map_err(|_| ApiError::new(ErrorCode::UploadInterrupted, "body failed"))?;
                if owner.hash {
                    hasher.update(&frame);
                }
                size += frame.len() as u64;
                owner
                    .received
                    .fetch_add(frame.len() as u64, Ordering::SeqCst);
                if let Some(stats) = &owner.pulled_by_forwarder {
                    let pulled = stats.bytes_pulled.load(Ordering::SeqCst);
                    owner
                        .max_in_flight
                        .fetch_max(pulled.saturating_sub(size), Ordering::SeqCst);
                }
                since_pause += frame.len();
                if owner.slow && since_pause >= 512 * 1024 {
                    since_pause = 0;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            Ok(created(serde_json::json!({
                "hash": hasher.finalize().to_hex().to_string(),
                "size": size,
                "owner": owner.name.as_str(),
                "content_length": request.content_length,
                "epoch": request.epoch,
            })))
        })
    }
}

impl HashingOwner {
    fn new(name: &str) -> Self {
        Self {
            name: NodeId::parse(name).unwrap(),
            calls: Arc::default(),
            received: Arc::default(),
            max_in_flight: Arc::default(),
            pulled_by_forwarder: None,
            slow: false,
            hash: true,
            busy: false,
        }
    }
}

/// The owner's 201 with a JSON body.
fn created(body: serde_json::Value) -> axum::response::Response {
    use axum::response::IntoResponse;
    (axum::http::StatusCode::CREATED, axum::Json(body)).into_response()
}

/// Start an owner whose current epoch is `epoch`; older epochs are told `moved_to`.
async fn start_owner(ingest: HashingOwner, epoch: u64, moved_to: &str) -> SocketAddr {
    let moved_to = NodeId::parse(moved_to).unwrap();
    let epochs = move |_: &SessionKey, _: ShardId, presented: Epoch| {
        if presented == Epoch(epoch as i64) {
            EpochVerdict::Current
        } else {
            EpochVerdict::Stale {
                current_owner: Some(moved_to.clone()),
                current_epoch: Epoch(epoch as i64 + 1),
            }
        }
    };
    start_owner_with(ingest, epochs).await
}

async fn start_owner_with(ingest: HashingOwner, epochs: impl EpochCheck) -> SocketAddr {
    support::node::serve_internal(TOKEN, epochs, ingest).await
}

/// Re-resolution answers a fixed target and counts calls.
struct FixedResolver {
    next: OwnerTarget,
    calls: AtomicU64,
}

impl OwnerResolver for FixedResolver {
    fn re_resolve<'a>(
        &'a self,
        _: &'a SessionKey,
        stale: &'a StaleEpoch,
    ) -> BoxFuture<'a, Result<OwnerTarget, RouteError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        assert!(
            stale.current_owner.is_some(),
            "the owner named its successor"
        );
        let next = self.next.clone();
        Box::pin(async move { Ok(next) })
    }
}

#[derive(Clone)]
struct Front {
    forwarder: Forwarder,
    first: OwnerTarget,
    resolver: Arc<FixedResolver>,
}

async fn public_upload(State(front): State<Front>, headers: HeaderMap, body: Body) -> Response {
    let key = SessionKey {
        tenant: headers["x-graviton-tenant-id"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap(),
        session: headers["x-graviton-upload-session-id"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap(),
    };
    front
        .forwarder
        .relay(
            front.first.clone(),
            Relayed::Upload(key),
            &headers,
            body,
            front.resolver.as_ref(),
        )
        .await
}

fn forwarder() -> Forwarder {
    forwarder_with(Duration::from_secs(10))
}

fn forwarder_with(read_timeout: Duration) -> Forwarder {
    Forwarder::new(ForwardOptions {
        token: Secret::new(TOKEN),
        connect_timeout: Duration::from_secs(2),
        read_timeout,
    })
    .unwrap()
}

async fn start_front(
    forwarder: Forwarder,
    first: OwnerTarget,
    next: OwnerTarget,
) -> (SocketAddr, Arc<FixedResolver>) {
    let resolver = Arc::new(FixedResolver {
        next,
        calls: AtomicU64::new(0),
    });
    let front = Front {
        forwarder,
        first,
        resolver: resolver.clone(),
    };
    let router = axum::Router::new()
        .route("/v1/blobs", post(public_upload))
        .with_state(front);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    (addr, resolver)
}

fn target(node: &str, addr: SocketAddr, epoch: u64) -> OwnerTarget {
    OwnerTarget {
        node: NodeId::parse(node).unwrap(),
        internal_addr: addr,
        shard: ShardId(3),
        epoch: Epoch(epoch as i64),
    }
}

async fn upload(front: SocketAddr, seed: u64, total: usize) -> (u16, serde_json::Value) {
    let client = support::client();
    let body = futures_util::stream::iter(frames(seed, total).map(Ok::<_, std::io::Error>));
    let response = tokio::time::timeout(
        GUARD,
        client
            .post(format!("http://{front}/v1/blobs"))
            .header("x-graviton-tenant-id", TENANT)
            .header("x-graviton-upload-session-id", SESSION)
            .header("content-type", "application/octet-stream")
            .header("content-length", total.to_string())
            .body(reqwest::Body::wrap_stream(body))
            .send(),
    )
    .await
    .expect("no hang")
    .unwrap();
    let status = response.status().as_u16();
    let bytes = response.bytes().await.unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

/// A raw client for answers that come before the body is consumed: it declares
/// `total` bytes, keeps writing them in the background (ignoring write errors once the
/// front closes) and reads the response concurrently. Returns (lowercased head, body).
async fn raw_upload(front: SocketAddr, total: usize, seed: u64) -> (String, String) {
    let mut stream = tokio::net::TcpStream::connect(front).await.unwrap();
    let head = format!(
        "POST /v1/blobs HTTP/1.1\r\nHost: front\r\nContent-Type: application/octet-stream\r\n\
         Content-Length: {total}\r\nX-Graviton-Tenant-Id: {TENANT}\r\nX-Graviton-Upload-Session-Id: {SESSION}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let feeder = tokio::spawn(async move {
        for frame in frames(seed, total) {
            if writer.write_all(&frame).await.is_err() {
                return;
            }
        }
    });
    let response = tokio::time::timeout(GUARD, async {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = reader.read(&mut chunk).await.unwrap();
            assert!(n > 0, "front closed without answering");
            buf.extend_from_slice(&chunk[..n]);
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| {
                        l.strip_prefix("content-length:")
                            .map(|v| v.trim().parse().unwrap())
                    })
                    .unwrap_or(0);
                while buf.len() < end + 4 + length {
                    let n = reader.read(&mut chunk).await.unwrap();
                    assert!(n > 0);
                    buf.extend_from_slice(&chunk[..n]);
                }
                return (
                    head,
                    String::from_utf8_lossy(&buf[end + 4..end + 4 + length]).to_string(),
                );
            }
        }
    })
    .await
    .expect("the front answers instead of hanging");
    feeder.abort();
    response
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_mib_body_lands_byte_exact_with_bounded_bytes_in_flight() {
    const TOTAL: usize = 64 * 1024 * 1024;
    let forwarder = forwarder();
    let mut owner = HashingOwner::new("node-b");
    owner.slow = true;
    owner.pulled_by_forwarder = Some(forwarder.stats().clone());
    let owner_addr = start_owner(owner.clone(), 1, "node-x").await;
    let (front, resolver) = start_front(
        forwarder.clone(),
        target("node-b", owner_addr, 1),
        target("node-b", owner_addr, 1),
    )
    .await;

    let (status, json) = upload(front, 42, TOTAL).await;
    assert_eq!(status, 201, "{json}");
    assert_eq!(json["hash"], expected_hash(42, TOTAL));
    assert_eq!(json["size"], TOTAL as u64);
    assert_eq!(
        json["content_length"], TOTAL as u64,
        "Content-Length is copied"
    );
    assert_eq!(json["owner"], "node-b");
    assert_eq!(owner.calls.load(Ordering::SeqCst), 1);
    assert_eq!(resolver.calls.load(Ordering::SeqCst), 0);
    assert_eq!(
        forwarder.stats().bytes_pulled.load(Ordering::SeqCst),
        TOTAL as u64,
        "pulled exactly once"
    );
    let max_in_flight = owner.max_in_flight.load(Ordering::SeqCst);
    println!(
        "FIGURE forwarder max bytes in flight (pulled by forwarder - received by owner) for 64 MiB: {max_in_flight}"
    );
    // Loopback socket buffers (send + receive, autotuned) plus a few frames: far below
    // the body size. A buffering forwarder would reach tens of MiB with a slow owner.
    assert!(
        max_in_flight < 16 * 1024 * 1024,
        "forwarder buffered {max_in_flight} bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_epoch_is_re_resolved_once_and_succeeds() {
    let old = HashingOwner::new("node-b");
    let new = HashingOwner::new("node-c");
    let old_addr = start_owner(old.clone(), 2, "node-c").await;
    let new_addr = start_owner(new.clone(), 3, "node-x").await;
    // The front still routes by epoch 1 to node-b; node-c owns the shard at epoch 3.
    let (front, resolver) = start_front(
        forwarder(),
        target("node-b", old_addr, 1),
        target("node-c", new_addr, 3),
    )
    .await;

    let total = 3 * 1024 * 1024 + 17;
    let (status, json) = upload(front, 7, total).await;
    assert_eq!(status, 201, "{json}");
    assert_eq!(json["owner"], "node-c");
    assert_eq!(json["epoch"], 3);
    assert_eq!(json["hash"], expected_hash(7, total));
    assert_eq!(
        resolver.calls.load(Ordering::SeqCst),
        1,
        "re-resolved exactly once"
    );
    assert_eq!(
        old.calls.load(Ordering::SeqCst),
        0,
        "the stale owner never ingested"
    );
    assert_eq!(old.received.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_stale_answer_is_503_owner_moved_without_a_second_re_resolve() {
    let old = HashingOwner::new("node-b");
    let also_old = HashingOwner::new("node-c");
    let old_addr = start_owner(old.clone(), 2, "node-c").await;
    let also_old_addr = start_owner(also_old.clone(), 9, "node-d").await;
    let (front, resolver) = start_front(
        forwarder(),
        target("node-b", old_addr, 1),
        target("node-c", also_old_addr, 3),
    )
    .await;

    let (head, body) = raw_upload(front, 4 * 1024 * 1024, 9).await;
    assert!(head.starts_with("http/1.1 503"), "{head}");
    assert!(head.contains("retry-after: 1"), "{head}");
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["error"], "owner_moved");
    assert_eq!(resolver.calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        old.calls.load(Ordering::SeqCst) + also_old.calls.load(Ordering::SeqCst),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_owner_is_503_owner_unavailable() {
    let dead = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let (front, _) = start_front(
        forwarder(),
        target("node-b", dead, 1),
        target("node-b", dead, 1),
    )
    .await;
    let (head, body) = raw_upload(front, 4 * 1024 * 1024, 1).await;
    assert!(head.starts_with("http/1.1 503"), "{head}");
    assert!(head.contains("retry-after: 1"), "{head}");
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["error"], "owner_unavailable");
}

/// An owner that passes the pre-flight, reads 1 MiB of the POST body, then dies
/// (closes the socket), like a process killed mid-stream; or, with `hang`, keeps the
/// socket open and stops reading, like a paused process.
async fn dying_owner(hang: bool) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = vec![0u8; 64 * 1024];
                loop {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_string();
                    buf.drain(..end + 4);
                    if head.starts_with("HEAD ") {
                        if socket
                            .write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
                            .await
                            .is_err()
                        {
                            return;
                        }
                        continue;
                    }
                    let mut got = buf.len();
                    while got < 1024 * 1024 {
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got += n,
                        }
                    }
                    if hang {
                        tokio::time::sleep(GUARD).await;
                    }
                    return; // dropped: the connection dies mid-body
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_dying_mid_stream_is_a_clean_502_not_a_hang() {
    let owner = dying_owner(false).await;
    let (front, _) = start_front(
        forwarder(),
        target("node-b", owner, 1),
        target("node-b", owner, 1),
    )
    .await;

    let (head, body) = raw_upload(front, 64 * 1024 * 1024, 3).await;
    assert!(head.starts_with("http/1.1 502"), "{head}");
    assert!(head.contains("retry-after: 1"), "{head}");
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["error"], "owner_unavailable");
}

/// A body of `total` bytes made of one repeated 1 MiB buffer (cheap to produce, so the
/// client does not dominate the measurement).
fn repeated_body(total: usize) -> reqwest::Body {
    let block = Bytes::from(
        frames(11, 1024 * 1024)
            .flat_map(|b| b.to_vec())
            .collect::<Vec<u8>>(),
    );
    let count = total / block.len();
    reqwest::Body::wrap_stream(futures_util::stream::iter(
        (0..count).map(move |_| Ok::<_, std::io::Error>(block.clone())),
    ))
}

async fn timed_post(request: reqwest::RequestBuilder, total: usize) -> Duration {
    let started = std::time::Instant::now();
    let response = tokio::time::timeout(
        GUARD,
        request
            .header("content-length", total.to_string())
            .body(repeated_body(total))
            .send(),
    )
    .await
    .expect("no hang")
    .unwrap();
    assert_eq!(response.status(), 201);
    let _ = response.bytes().await.unwrap();
    started.elapsed()
}

/// Prints forwarded vs direct-to-owner throughput on loopback. No timing assertion:
/// the figure is recorded in docs/control-plane.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_versus_direct_throughput_figures() {
    const TOTAL: usize = 256 * 1024 * 1024;
    let mut owner = HashingOwner::new("node-b");
    owner.hash = false;
    let owner_addr = start_owner(owner.clone(), 1, "node-x").await;
    let (front, _) = start_front(
        forwarder(),
        target("node-b", owner_addr, 1),
        target("node-b", owner_addr, 1),
    )
    .await;
    let client = support::client();
    let direct = || {
        client
            .post(format!(
                "http://{owner_addr}/internal/v1/sessions/{TENANT}/{SESSION}/blobs"
            ))
            .header("x-graviton-internal-token", TOKEN)
            .header("x-graviton-shard", "3")
            .header("x-graviton-shard-epoch", "1")
    };
    let forwarded = || {
        client
            .post(format!("http://{front}/v1/blobs"))
            .header("x-graviton-tenant-id", TENANT)
            .header("x-graviton-upload-session-id", SESSION)
    };
    let (mut best_direct, mut best_forwarded) = (Duration::MAX, Duration::MAX);
    for _ in 0..3 {
        best_direct = best_direct.min(timed_post(direct(), TOTAL).await);
        best_forwarded = best_forwarded.min(timed_post(forwarded(), TOTAL).await);
    }
    let mbps = |d: Duration| TOTAL as f64 / d.as_secs_f64() / 1e6;
    println!(
        "FIGURE loopback upload of 256 MiB, best of 3: direct to owner {:.0} MB/s, forwarded via non-owner {:.0} MB/s, ratio {:.2}",
        mbps(best_direct),
        mbps(best_forwarded),
        best_direct.as_secs_f64() / best_forwarded.as_secs_f64()
    );
    assert_eq!(owner.received.load(Ordering::SeqCst), 6 * TOTAL as u64);
}

/// The epoch moves between the pre-flight and the POST: the owner passes the HEAD but
/// refuses the POST (before reading it). The client holds its body back until the
/// forwarder has reclaimed it, so no byte was pulled: the forwarder re-resolves and
/// the same, untouched body lands byte-exact at the new owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_post_after_a_passing_preflight_retries_with_the_untouched_body() {
    let old = HashingOwner::new("node-b");
    let new = HashingOwner::new("node-c");
    let checks = Arc::new(AtomicU64::new(0));
    let seen = checks.clone();
    let old_addr = start_owner_with(old.clone(), move |_: &SessionKey, _: ShardId, _: Epoch| {
        if seen.fetch_add(1, Ordering::SeqCst) == 0 {
            EpochVerdict::Current // the pre-flight
        } else {
            EpochVerdict::Stale {
                current_owner: Some(NodeId::parse("node-c").unwrap()),
                current_epoch: Epoch(3),
            }
        }
    })
    .await;
    let new_addr = start_owner(new.clone(), 3, "node-x").await;
    let forwarder = forwarder();
    let (front, resolver) = start_front(
        forwarder.clone(),
        target("node-b", old_addr, 2),
        target("node-c", new_addr, 3),
    )
    .await;

    let total = 2 * 1024 * 1024 + 5;
    let mut stream = tokio::net::TcpStream::connect(front).await.unwrap();
    let head = format!(
        "POST /v1/blobs HTTP/1.1\r\nHost: front\r\nContent-Type: application/octet-stream\r\n\
         Content-Length: {total}\r\nX-Graviton-Tenant-Id: {TENANT}\r\nX-Graviton-Upload-Session-Id: {SESSION}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    support::eventually(GUARD, "a stale retry", || {
        forwarder.stats().stale_retries.load(Ordering::SeqCst) > 0
    })
    .await;
    for frame in frames(21, total) {
        stream.write_all(&frame).await.unwrap();
    }
    let mut answer = Vec::new();
    tokio::time::timeout(GUARD, async {
        let mut chunk = [0u8; 4096];
        while !String::from_utf8_lossy(&answer).contains("}") {
            let n = stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed before the answer");
            answer.extend_from_slice(&chunk[..n]);
        }
    })
    .await
    .expect("no hang");
    let text = String::from_utf8_lossy(&answer).to_string();
    assert!(text.starts_with("HTTP/1.1 201"), "{text}");
    let json: serde_json::Value =
        serde_json::from_str(&text[text.find("\r\n\r\n").unwrap() + 4..]).unwrap();
    assert_eq!(json["owner"], "node-c");
    assert_eq!(json["hash"], expected_hash(21, total));
    assert_eq!(
        checks.load(Ordering::SeqCst),
        2,
        "HEAD passed, POST refused"
    );
    assert_eq!(old.calls.load(Ordering::SeqCst), 0);
    assert_eq!(resolver.calls.load(Ordering::SeqCst), 1);
}

/// Issue 9, item 8: `forward_read_timeout` bounds the owner's silence, not the upload. A
/// client that trickles 2 MiB over about 3 s through a forwarder with a 1 s timeout gets
/// 201 with the right content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_outlasting_the_read_timeout_still_lands() {
    let owner = start_owner(HashingOwner::new("node-b"), 1, "node-b").await;
    let (front, _) = start_front(
        forwarder_with(Duration::from_secs(1)),
        target("node-b", owner, 1),
        target("node-b", owner, 1),
    )
    .await;
    let total = 2 * 1024 * 1024;
    let pieces: Vec<Bytes> = frames(9, total).collect();
    let per_piece = Duration::from_millis(3000 / pieces.len().max(1) as u64);
    let slow = futures_util::stream::iter(pieces).then(move |piece| async move {
        tokio::time::sleep(per_piece).await;
        Ok::<_, std::io::Error>(piece)
    });
    let started = std::time::Instant::now();
    let response = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("http://{front}/v1/blobs"))
        .header("x-graviton-tenant-id", TENANT)
        .header("x-graviton-upload-session-id", SESSION)
        .header("content-length", total.to_string())
        .body(reqwest::Body::wrap_stream(slow))
        .send()
        .await
        .unwrap();
    assert!(
        started.elapsed() > Duration::from_secs(2),
        "the client was slow"
    );
    assert_eq!(response.status(), 201);
    let json: serde_json::Value = response.json().await.unwrap();
    assert_eq!(json["hash"], expected_hash(9, total));
}

/// The other side of the same rule: an owner that stops reading mid-body (a paused
/// process) is answered 502 `owner_unavailable` with `Retry-After` after its silence,
/// not held until the client gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_stops_reading_is_a_502_after_the_read_timeout() {
    let owner = dying_owner(true).await;
    let (front, _) = start_front(
        forwarder_with(Duration::from_secs(1)),
        target("node-b", owner, 1),
        target("node-b", owner, 1),
    )
    .await;
    let (head, body) = tokio::time::timeout(GUARD, raw_upload(front, 64 * 1024 * 1024, 5))
        .await
        .expect("answered before the guard");
    assert!(head.starts_with("http/1.1 502"), "{head}");
    assert!(head.contains("retry-after: 1"), "{head}");
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["error"], "owner_unavailable");
}

/// Issue 9, item 9: a `409 session_busy` from the owner reaches the client as it is,
/// `Retry-After` included; it is not mistaken for a stale epoch (which would re-route and answer 503 `owner_moved`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_s_session_busy_answer_is_relayed_not_treated_as_a_move() {
    let mut busy = HashingOwner::new("node-b");
    busy.busy = true;
    let owner = start_owner(busy, 1, "node-b").await;
    let (front, resolver) = start_front(
        forwarder(),
        target("node-b", owner, 1),
        target("node-b", owner, 1),
    )
    .await;
    let response = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("http://{front}/v1/blobs"))
        .header("x-graviton-tenant-id", TENANT)
        .header("x-graviton-upload-session-id", SESSION)
        .body(vec![7u8; 100_000])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 409);
    // The owner's Retry-After reaches the client through the forwarder.
    assert_eq!(response.headers()["retry-after"], "2");
    let json: serde_json::Value = response.json().await.unwrap();
    assert_eq!(json["error"], "session_busy");
    assert_eq!(resolver.calls.load(Ordering::SeqCst), 0, "no re-resolution");
}
