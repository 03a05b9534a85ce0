//! Connection hygiene, CORS and TLS of the listeners, against real sockets: slowloris
//! clients are cut off by the header-read timeout while others are served, the
//! connection bound refuses (and counts) the excess, oversized heads get 431, a browser
//! preflight is answered, and TLS is verified by curl with `--cacert`.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use graviton::config::{ByteSize, HumanDuration};
use graviton::node::NodeOptions;
use support::node::TestNode;
use support::pki::TestPki;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Read until the server closes the connection (EOF or reset); `None` if it is still
/// open after `limit`. Returns what was read.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(out),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
}

async fn slow_clients(addr: SocketAddr, each: usize) -> Vec<TcpStream> {
    let mut streams = Vec::new();
    for i in 0..each * 2 {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let partial: &[u8] = if i % 2 == 0 {
            b"POST /v1/bl" // half a request line
        } else {
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: still-typ" // unfinished headers
        };
        stream.write_all(partial).await.expect("write partial head");
        streams.push(stream);
    }
    streams
}

/// The value of the sample named exactly `series`, 0 while it does not exist yet.
fn metric(text: &str, series: &str) -> u64 {
    support::metrics::count_or_zero(text, series)
}

// Checks EDGE-5.
#[tokio::test]
async fn slowloris_clients_are_disconnected_while_others_are_served() {
    let node = TestNode::start_with(
        |c| c.http.header_read_timeout = HumanDuration::secs(1),
        NodeOptions::default(),
    )
    .await;
    let started = std::time::Instant::now();
    let mut slow = slow_clients(node.addr(), 10).await;
    // While 20 connections dribble their heads, a well-behaved client is served.
    let client = reqwest::Client::new();
    let health = client
        .get(format!("{}/healthz", node.url))
        .send()
        .await
        .expect("healthz while slow clients hang");
    assert_eq!(health.status(), 200);
    // Every slow client is closed by the server (the configured timeout is 1 s; the
    // bound here only keeps a broken server from hanging the test).
    for (i, stream) in slow.iter_mut().enumerate() {
        let closed = read_until_closed(stream, Duration::from_secs(20)).await;
        assert!(closed.is_some(), "slow client {i} still connected");
    }
    eprintln!(
        "FIGURE 20 slowloris clients all disconnected after {:?} (header_read_timeout 1s)",
        started.elapsed()
    );
    let text = node.metrics_text();
    assert!(
        metric(
            &text,
            "graviton_connection_header_timeouts_total{listener=\"public\"}"
        ) >= 20,
        "{text}"
    );
    // And the server still serves new connections afterwards.
    let health = client
        .get(format!("{}/healthz", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
}

// Checks EDGE-5.
#[tokio::test]
async fn internal_listener_cuts_slowloris_clients_too() {
    // The internal router served the way a cluster node serves it (`serve_with`).
    use graviton::edge::listener::{ConnectionLimits, ServeOptions};
    use graviton::http::internal::{self, InternalState};
    use graviton::placement::{Epoch, EpochVerdict, ShardId};
    struct NoIngest;
    impl internal::OwnerIngest for NoIngest {
        fn ingest(
            &self,
            _: internal::IngestRequest,
        ) -> futures_util::future::BoxFuture<
            'static,
            Result<axum::response::Response, graviton::edge::ApiError>,
        > {
            Box::pin(async { Err(graviton::edge::ApiError::internal("unused")) })
        }
    }
    let state = InternalState {
        token: graviton::config::Secret::new("test-internal-token-0123456789abcdefghijkl"),
        epochs: std::sync::Arc::new(|_: &_, _: ShardId, _: Epoch| EpochVerdict::Current),
        ingest: std::sync::Arc::new(NoIngest),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut options = ServeOptions::plain("internal");
    options.limits = ConnectionLimits {
        header_read_timeout: Duration::from_secs(1),
        ..ConnectionLimits::default()
    };
    let metrics = options.metrics.clone();
    tokio::spawn(internal::serve_with(
        listener,
        internal::router(state),
        options,
        std::future::pending(),
    ));
    let mut slow = slow_clients(addr, 5).await;
    // A well-formed (unauthenticated) request on a fresh connection is still answered.
    let (_s, answer) = support::node::raw_exchange(
        addr,
        b"HEAD /internal/v1/sessions/a/b/blobs HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    for (i, stream) in slow.iter_mut().enumerate() {
        assert!(
            read_until_closed(stream, Duration::from_secs(20))
                .await
                .is_some(),
            "slow client {i} still connected"
        );
    }
    let timeouts = metrics
        .header_timeouts
        .get_or_create(&graviton::edge::listener::ListenerLabels {
            listener: "internal",
        })
        .get();
    assert!(timeouts >= 10, "{timeouts}");
}

// Checks EDGE-5.
#[tokio::test]
async fn connections_over_the_bound_are_refused_with_503_and_counted() {
    let node = TestNode::start_with(
        |c| {
            c.http.max_connections = 4;
            c.http.header_read_timeout = HumanDuration::secs(30);
        },
        NodeOptions::default(),
    )
    .await;
    // Four idle connections hold every slot.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(node.addr()).await.unwrap());
    }
    // Give the accept loop a moment to take all four (they are accepted in order).
    let counted = support::wait_until(Duration::from_secs(5), || async {
        metric(
            &node.metrics_text(),
            "graviton_connections_open{listener=\"public\"}",
        ) == 4
    })
    .await;
    assert!(counted, "{}", node.metrics_text());
    // The fifth and sixth are answered 503 and closed at once.
    for _ in 0..2 {
        let mut extra = TcpStream::connect(node.addr()).await.unwrap();
        let answer = read_until_closed(&mut extra, Duration::from_secs(10))
            .await
            .expect("refused connection is closed");
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(
            answer.contains("\"error\":\"too_many_connections\""),
            "{answer}"
        );
    }
    drop(held);
    // Slots free again: a normal request succeeds, and the refusals were counted.
    let served = support::wait_until(Duration::from_secs(5), || async {
        reqwest::get(format!("{}/healthz", node.url))
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    assert!(served);
    let text = node.metrics_text();
    assert_eq!(
        metric(
            &text,
            "graviton_connections_refused_total{listener=\"public\"}"
        ),
        2,
        "{text}"
    );
}

#[tokio::test]
async fn oversized_request_heads_get_431() {
    let node = TestNode::start_with(
        |c| c.http.max_header_size = ByteSize::kib(4),
        NodeOptions::default(),
    )
    .await;
    let big = "a".repeat(6000);
    let request = format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n");
    let mut stream = TcpStream::connect(node.addr()).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let answer = read_until_closed(&mut stream, Duration::from_secs(10))
        .await
        .expect("closed after 431");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    let (_s, ok) =
        support::node::raw_exchange(node.addr(), b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
}

// An upload refused before its body is read (413 on the declared length) is answered
// with `Connection: close`, and the server does close: a keep-alive client must not
// send its next request on that connection. An upload read to its end keeps it.
#[tokio::test]
async fn an_answer_before_the_body_is_read_says_connection_close() {
    let node = TestNode::start_with(
        |c| c.upload.max_blob_size = ByteSize::mib(1),
        NodeOptions::default(),
    )
    .await;
    let request = "POST /v1/blobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\nContent-Length: 10485760\r\n\r\n";
    let mut stream = TcpStream::connect(node.addr()).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    stream.write_all(&[7u8; 4096]).await.unwrap();
    let answer = read_until_closed(&mut stream, Duration::from_secs(10))
        .await
        .expect("the server closes after refusing an unread body");
    let answer = String::from_utf8_lossy(&answer).to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 413"), "{answer}");
    assert!(answer.contains("\r\nconnection: close\r\n"), "{answer}");

    let client = support::client();
    let response = client
        .post(format!("{}/v1/blobs", node.url))
        .body(vec![1u8; 1000])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert!(
        response.headers().get("connection").is_none(),
        "{response:?}"
    );
}

#[tokio::test]
async fn cors_preflight_allows_the_locality_and_tus_headers_and_exposes_location() {
    let node = TestNode::start_with(
        |c| c.http.cors.allowed_origins = vec!["https://app.example".into()],
        NodeOptions::default(),
    )
    .await;
    let client = reqwest::Client::new();
    let preflight = client
        .request(reqwest::Method::OPTIONS, format!("{}/v1/blobs", node.url))
        .header("Origin", "https://app.example")
        .header("Access-Control-Request-Method", "POST")
        .header(
            "Access-Control-Request-Headers",
            "authorization, content-type, x-graviton-tenant-id, x-graviton-upload-session-id, \
             content-digest, x-content-hash",
        )
        .send()
        .await
        .unwrap();
    assert!(preflight.status().is_success(), "{}", preflight.status());
    let headers = preflight.headers();
    assert_eq!(
        headers["access-control-allow-origin"],
        "https://app.example"
    );
    let allowed = headers["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    for name in [
        "authorization",
        "content-type",
        "x-graviton-tenant-id",
        "x-graviton-upload-session-id",
        // A browser client declares a digest (CAS-4) in either spelling.
        "content-digest",
        "x-content-hash",
    ] {
        assert!(allowed.contains(name), "{name} missing from {allowed}");
    }
    assert!(
        headers["access-control-allow-methods"]
            .to_str()
            .unwrap()
            .contains("POST")
    );
    // The actual upload response exposes Location, ETag and Retry-After.
    let upload = client
        .post(format!("{}/v1/blobs", node.url))
        .header("Origin", "https://app.example")
        .body(b"cors body".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(upload.status(), 201);
    let exposed = upload.headers()["access-control-expose-headers"]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    for name in ["location", "etag", "retry-after"] {
        assert!(exposed.contains(name), "{name} missing from {exposed}");
    }
    // A browser tus client on the origin: PATCH and the tus headers are allowed, and the
    // tus answers' headers are readable.
    let preflight = client
        .request(reqwest::Method::OPTIONS, format!("{}/v1/uploads/x", node.url))
        .header("Origin", "https://app.example")
        .header("Access-Control-Request-Method", "PATCH")
        .header(
            "Access-Control-Request-Headers",
            "tus-resumable, upload-offset, upload-length, upload-metadata, upload-checksum, content-type",
        )
        .send()
        .await
        .unwrap();
    assert!(preflight.status().is_success(), "{}", preflight.status());
    let allowed = preflight.headers()["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    for name in [
        "tus-resumable",
        "upload-offset",
        "upload-length",
        "upload-metadata",
        "upload-checksum",
    ] {
        assert!(allowed.contains(name), "{name} missing from {allowed}");
    }
    assert!(
        preflight.headers()["access-control-allow-methods"]
            .to_str()
            .unwrap()
            .contains("PATCH")
    );
    let created = client
        .post(format!("{}/v1/uploads", node.url))
        .header("Origin", "https://app.example")
        .header("Tus-Resumable", "1.0.0")
        .header("Upload-Length", "5")
        .header(
            "X-Graviton-Tenant-Id",
            "0b9c7a52-7f3e-4a1f-9d2e-2a4c6e8f0a11",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let exposed = created.headers()["access-control-expose-headers"]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    for name in [
        "location",
        "upload-offset",
        "upload-expires",
        "tus-resumable",
        "graviton-blob-key",
    ] {
        assert!(exposed.contains(name), "{name} missing from {exposed}");
    }
    // An origin that is not listed gets no CORS grant.
    let other = client
        .request(reqwest::Method::OPTIONS, format!("{}/v1/blobs", node.url))
        .header("Origin", "https://evil.example")
        .header("Access-Control-Request-Method", "POST")
        .send()
        .await
        .unwrap();
    assert!(other.headers().get("access-control-allow-origin").is_none());
}

#[tokio::test]
async fn cors_is_off_by_default() {
    let node = TestNode::start().await;
    let preflight = reqwest::Client::new()
        .request(reqwest::Method::OPTIONS, format!("{}/v1/blobs", node.url))
        .header("Origin", "https://app.example")
        .header("Access-Control-Request-Method", "POST")
        .send()
        .await
        .unwrap();
    assert!(
        preflight
            .headers()
            .get("access-control-allow-origin")
            .is_none()
    );
}

/// Run curl without blocking the runtime that serves the node.
async fn curl(args: &[&str]) -> std::process::Output {
    tokio::process::Command::new("curl")
        .args(["--silent", "--show-error", "--max-time", "20"])
        .args(args)
        .output()
        .await
        .expect("run curl")
}

#[tokio::test]
async fn tls_public_listener_is_verified_by_curl_with_cacert() {
    let pki = TestPki::new();
    let (cert, key) = pki.issue("public");
    let node = TestNode::start_with(
        |c| {
            c.http.tls.cert_file = Some(cert.clone());
            c.http.tls.key_file = Some(key.clone());
        },
        NodeOptions::default(),
    )
    .await;
    let port = node.addr().port();
    let data = node.dir.path().join("upload.bin");
    std::fs::write(&data, b"bytes over TLS").unwrap();
    let url = format!("https://127.0.0.1:{port}/v1/blobs");
    let out = curl(&[
        "--cacert",
        pki.ca.to_str().unwrap(),
        "--data-binary",
        &format!("@{}", data.display()),
        "-H",
        "Content-Type: application/octet-stream",
        "--write-out",
        "\n%{http_code}",
        &url,
    ])
    .await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.trim_end().ends_with("201"), "{text}");
    let body: serde_json::Value =
        serde_json::from_str(text.lines().next().unwrap()).expect("JSON body");
    let key_text = body["key"].as_str().unwrap().to_string();
    // Download it back over TLS.
    let out = curl(&[
        "--cacert",
        pki.ca.to_str().unwrap(),
        &format!("https://127.0.0.1:{port}/v1/blobs/{key_text}"),
    ])
    .await;
    assert_eq!(out.stdout, b"bytes over TLS");
    // Without the CA, curl refuses the server (it is not publicly trusted).
    let out = curl(&[&format!("https://127.0.0.1:{port}/healthz")]).await;
    assert!(!out.status.success());
    // Plaintext HTTP on the TLS port gets no HTTP answer.
    let plain = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{port}/healthz"))
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    assert!(plain.is_err() || plain.unwrap().status() != 200);
}

#[tokio::test]
async fn tls_handshake_that_never_starts_is_cut_by_the_header_timeout() {
    let pki = TestPki::new();
    let (cert, key) = pki.issue("public");
    let node = TestNode::start_with(
        |c| {
            c.http.tls.cert_file = Some(cert.clone());
            c.http.tls.key_file = Some(key.clone());
            c.http.header_read_timeout = HumanDuration::secs(1);
        },
        NodeOptions::default(),
    )
    .await;
    let mut stream = TcpStream::connect(node.addr()).await.unwrap();
    stream.write_all(&[0x16, 0x03, 0x01]).await.unwrap(); // a third of a record header
    assert!(
        read_until_closed(&mut stream, Duration::from_secs(20))
            .await
            .is_some()
    );
    let out = curl(&[
        "--cacert",
        pki.ca.to_str().unwrap(),
        &format!("https://localhost:{}/healthz", node.addr().port()),
    ])
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn graceful_shutdown_still_finishes_in_flight_requests() {
    let mut node = TestNode::start().await;
    let (_stream, answer) =
        support::node::raw_exchange(node.addr(), b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 200"));
    // An idle keep-alive connection does not hold the shutdown up.
    assert_eq!(
        node.shutdown().await,
        graviton::node::ShutdownOutcome::Drained
    );
}
