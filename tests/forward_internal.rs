//! The internal (owner ingest) listener over real sockets: every refusal happens
//! before the body is read. Requests are written by hand on a raw `TcpStream` so a
//! response can be observed while the declared body is still incomplete.

#[allow(unused_imports)]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use graviton::edge::{ApiError, ErrorCode};
use graviton::http::internal::{IngestRequest, OwnerIngest};
use graviton::ids::{NodeId, SessionKey};
use graviton::placement::{Epoch, EpochVerdict, ShardId};
use graviton::relay::protocol::CURRENT_OWNER_HEADER;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TOKEN: &str = "internal-token-0123456789abcdefghijklmnopqrstuvwxyz";
const TENANT: &str = "0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f";
const SESSION: &str = "6ba7b810-9dad-11d1-80b4-00c04fd430c8";
const GUARD: Duration = Duration::from_secs(20);

/// Counts ingest calls and bytes; the body is drained to the end.
#[derive(Default, Clone)]
struct CountingIngest {
    calls: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
}

impl OwnerIngest for CountingIngest {
    fn ingest(
        &self,
        request: IngestRequest,
    ) -> BoxFuture<'static, Result<axum::response::Response, ApiError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let bytes = self.bytes.clone();
        Box::pin(async move {
            let mut stream = request.body.into_data_stream();
            let mut total = 0u64;
            while let Some(frame) = stream.next().await {
                let frame = frame
                    .map_err(|_| ApiError::new(ErrorCode::UploadInterrupted, "body failed"))?;
                total += frame.len() as u64;
                bytes.fetch_add(frame.len() as u64, Ordering::SeqCst);
            }
            Ok(created(
                serde_json::json!({ "size": total, "content_type": request.content_type, "epoch": request.epoch }),
            ))
        })
    }
}

/// The owner's 201 with a JSON body (what `upload::created` answers, minus the receipt).
fn created(body: serde_json::Value) -> axum::response::Response {
    use axum::response::IntoResponse;
    (axum::http::StatusCode::CREATED, axum::Json(body)).into_response()
}

async fn owner(ingest: CountingIngest) -> std::net::SocketAddr {
    let epochs = |_key: &SessionKey, _shard: ShardId, epoch: Epoch| {
        if epoch >= Epoch(5) {
            EpochVerdict::Current
        } else {
            EpochVerdict::Stale {
                current_owner: Some(NodeId::parse("node-c").unwrap()),
                current_epoch: Epoch(5),
            }
        }
    };
    support::node::serve_internal(TOKEN, epochs, ingest).await
}

struct RawResponse {
    status: u16,
    head: String,
    body: String,
}

/// Send `head` plus `partial` body bytes (of a larger declared body) and read one
/// response while the body stays incomplete; the write side is kept open.
async fn send_partial(
    addr: std::net::SocketAddr,
    head: &str,
    partial: &[u8],
) -> (RawResponse, TcpStream) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(partial).await.unwrap();
    stream.flush().await.unwrap();
    let response = tokio::time::timeout(GUARD, read_response(&mut stream))
        .await
        .expect("a response while the body is still incomplete");
    (response, stream)
}

async fn read_response(stream: &mut TcpStream) -> RawResponse {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let length = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().to_string())
                })
                .map(|v| v.parse::<usize>().unwrap())
                .unwrap_or(0);
            while buf.len() < end + 4 + length {
                let n = stream.read(&mut chunk).await.unwrap();
                assert!(n > 0, "connection closed mid-response");
                buf.extend_from_slice(&chunk[..n]);
            }
            let status = head[9..12].parse().unwrap();
            let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + length]).to_string();
            return RawResponse { status, head, body };
        }
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(n > 0, "connection closed before a response");
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn request_head(path: &str, extra: &[&str]) -> String {
    let mut head = format!("POST {path} HTTP/1.1\r\nHost: owner\r\n");
    for line in extra {
        head.push_str(line);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    head
}

fn path() -> String {
    format!("/internal/v1/sessions/{TENANT}/{SESSION}/blobs")
}

const BIG: &str = "Content-Length: 10485760";
const TOKEN_LINE: &str =
    "X-Graviton-Internal-Token: internal-token-0123456789abcdefghijklmnopqrstuvwxyz";

#[tokio::test]
async fn unauthenticated_requests_are_refused_before_the_body_is_read() {
    let ingest = CountingIngest::default();
    let addr = owner(ingest.clone()).await;
    for auth in [
        None,
        Some("X-Graviton-Internal-Token: wrong-token-0123456789abcdefghijklmnopqrstuvwxyz"),
        Some("Authorization: Bearer short"),
        Some("Authorization: Basic aW50ZXJuYWw="),
    ] {
        let mut extra = vec![BIG, "X-Graviton-Shard: 1", "X-Graviton-Shard-Epoch: 5"];
        extra.extend(auth);
        let (response, _open) =
            send_partial(addr, &request_head(&path(), &extra), &[7u8; 1000]).await;
        assert_eq!(response.status, 401, "{auth:?}");
        assert!(
            response.body.contains("\"unauthorized\""),
            "{}",
            response.body
        );
        assert!(!response.body.contains("internal-token"), "no token echo");
    }
    assert_eq!(ingest.calls.load(Ordering::SeqCst), 0);
    assert_eq!(ingest.bytes.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn stale_epoch_is_refused_before_the_body_is_read_and_names_the_owner() {
    let ingest = CountingIngest::default();
    let addr = owner(ingest.clone()).await;
    let bearer = format!("Authorization: Bearer {TOKEN}");
    for auth in [TOKEN_LINE, bearer.as_str()] {
        let extra = [
            BIG,
            auth,
            "X-Graviton-Shard: 1",
            "X-Graviton-Shard-Epoch: 4",
        ];
        let (response, _open) =
            send_partial(addr, &request_head(&path(), &extra), &[7u8; 1000]).await;
        assert_eq!(response.status, 409);
        let json: serde_json::Value = serde_json::from_str(&response.body).unwrap();
        assert_eq!(json["error"], "stale_epoch");
        assert_eq!(json["current_owner"], "node-c");
        assert_eq!(json["current_epoch"], 5);
        assert!(
            response
                .head
                .to_ascii_lowercase()
                .contains(&format!("{CURRENT_OWNER_HEADER}: node-c"))
        );
    }
    assert_eq!(ingest.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn malformed_heads_get_400_before_the_body_is_read() {
    let ingest = CountingIngest::default();
    let addr = owner(ingest.clone()).await;
    let good_path = path();
    let bad_path = format!("/internal/v1/sessions/{{{TENANT}}}/{SESSION}/blobs");
    let nil_path =
        format!("/internal/v1/sessions/00000000-0000-0000-0000-000000000000/{SESSION}/blobs");
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        (
            &bad_path,
            vec![
                BIG,
                TOKEN_LINE,
                "X-Graviton-Shard: 1",
                "X-Graviton-Shard-Epoch: 5",
            ],
            "invalid_session",
        ),
        (
            &nil_path,
            vec![
                BIG,
                TOKEN_LINE,
                "X-Graviton-Shard: 1",
                "X-Graviton-Shard-Epoch: 5",
            ],
            "invalid_session",
        ),
        (
            &good_path,
            vec![BIG, TOKEN_LINE, "X-Graviton-Shard-Epoch: 5"],
            "invalid_shard",
        ),
        (
            &good_path,
            vec![
                BIG,
                TOKEN_LINE,
                "X-Graviton-Shard: -1",
                "X-Graviton-Shard-Epoch: 5",
            ],
            "invalid_shard",
        ),
        (
            &good_path,
            vec![BIG, TOKEN_LINE, "X-Graviton-Shard: 1"],
            "invalid_epoch",
        ),
        (
            &good_path,
            vec![
                BIG,
                TOKEN_LINE,
                "X-Graviton-Shard: 1",
                "X-Graviton-Shard-Epoch: 5e0",
            ],
            "invalid_epoch",
        ),
        (
            &good_path,
            vec![
                BIG,
                TOKEN_LINE,
                "X-Graviton-Shard: 1",
                "X-Graviton-Shard-Epoch: +5",
            ],
            "invalid_epoch",
        ),
        (
            &good_path,
            vec![
                BIG,
                TOKEN_LINE,
                "X-Graviton-Shard: 1",
                "X-Graviton-Shard-Epoch: 5",
                "Content-Type: nonsense",
            ],
            "invalid_content_type",
        ),
    ];
    for (path, extra, code) in cases {
        let (response, _open) = send_partial(addr, &request_head(path, &extra), &[7u8; 1000]).await;
        assert_eq!(response.status, 400, "{code}: {}", response.body);
        assert!(response.body.contains(code), "{code}: {}", response.body);
    }
    // A Content-Length that is not plain digits never reaches a handler: hyper refuses
    // it at the protocol level, with 400 as well.
    for length in ["+10", "1e3", "0x10", "-1"] {
        let line = format!("Content-Length: {length}");
        let extra = [
            line.as_str(),
            TOKEN_LINE,
            "X-Graviton-Shard: 1",
            "X-Graviton-Shard-Epoch: 5",
        ];
        let (response, _open) =
            send_partial(addr, &request_head(&path(), &extra), b"0123456789").await;
        assert_eq!(response.status, 400, "{length}");
    }
    assert_eq!(ingest.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_valid_forward_is_ingested_and_preflight_agrees() {
    let ingest = CountingIngest::default();
    let addr = owner(ingest.clone()).await;
    let client = support::client();
    let url = format!("http://{addr}{}", path());
    let head = |epoch: u64| {
        client
            .head(&url)
            .header("x-graviton-internal-token", TOKEN)
            .header("x-graviton-shard", "1")
            .header("x-graviton-shard-epoch", epoch.to_string())
    };
    assert_eq!(head(5).send().await.unwrap().status(), 204);
    let stale = head(3).send().await.unwrap();
    assert_eq!(stale.status(), 409);
    assert_eq!(stale.headers()[CURRENT_OWNER_HEADER], "node-c");
    assert_eq!(ingest.calls.load(Ordering::SeqCst), 0);

    let response = client
        .post(&url)
        .header("x-graviton-internal-token", TOKEN)
        .header("x-graviton-shard", "1")
        .header("x-graviton-shard-epoch", "6")
        .header("content-type", "application/pdf")
        .body(vec![1u8; 100_000])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let json: serde_json::Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    assert_eq!(json["size"], 100_000);
    assert_eq!(json["content_type"], "application/pdf");
}
