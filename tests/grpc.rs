//! gRPC `graviton.v1.Blobs` against a real node, with a real tonic client over real
//! sockets: byte-exact round trips (whole blob and a range), `StatBlob`, status codes,
//! authentication before any charge, the egress quota running out mid-stream and Redis
//! stopped mid-stream (real Redis admission), and a call in flight at shutdown.
//!
//! Checks GRPC-1, GRPC-2, GRPC-3, GRPC-4 (docs/invariants.md).

#[allow(unused_imports)] // the shared harness also exports PostgreSQL helpers
mod support;

use std::time::Duration;

use graviton::admission::RedisAdmissionConfig;
use graviton::auth::{AuthConfig, IssuerConfig};
use graviton::config::{ByteSize, Config, HumanDuration};
use graviton::grpc::proto::blobs_client::BlobsClient;
use graviton::grpc::proto::{BlobFrame, ByteRange, GetBlobRequest, StatBlobRequest};
use graviton::ids::TenantId;
use graviton::node::NodeOptions;
use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::json;
use support::RedisServer;
use support::node::{TestNode, random_bytes};
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

const ISSUER: &str = "https://idp.test";
const AUDIENCE: &str = "graviton";
const ORG: &str = "0b9c7a52-7f3e-4a1f-9d2e-2a4c6e8f0a11";

fn with_grpc(config: &mut Config) {
    config.grpc.listen = Some("127.0.0.1:0".parse().unwrap());
}

fn redis_admission(config: &mut Config, url: String, edit: impl FnOnce(&mut RedisAdmissionConfig)) {
    let mut redis = support::admission::redis(url, "grpc");
    edit(&mut redis);
    support::admission::on_node(config, redis);
}

/// A client whose HTTP/2 windows are small: the server can run ahead of the reader by
/// about one window, so a test can act while most of a blob is still unsent.
async fn client(node: &TestNode) -> BlobsClient<Channel> {
    let addr = node
        .node
        .as_ref()
        .unwrap()
        .grpc_addr()
        .expect("grpc listener");
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .connect()
        .await
        .expect("connect to the gRPC listener");
    BlobsClient::new(channel).max_decoding_message_size(4 << 20)
}

async fn upload(node: &TestNode, data: &[u8]) -> (String, String) {
    let response = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("{}/v1/blobs", node.url))
        .body(data.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let etag = response.headers()["etag"].to_str().unwrap().to_string();
    let key = response.json::<serde_json::Value>().await.unwrap()["key"]
        .as_str()
        .unwrap()
        .to_string();
    (key, etag)
}

fn get(key: &str, range: Option<(u64, u64)>) -> GetBlobRequest {
    GetBlobRequest {
        key: key.to_string(),
        range: range.map(|(offset, length)| ByteRange { offset, length }),
    }
}

fn with_tenant<T>(message: T, tenant: &TenantId) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("x-graviton-tenant-id", tenant.to_string().parse().unwrap());
    request
}

/// Every frame until the end or the first error: the bytes (offsets checked to be
/// contiguous from `start`), the frame count, and the status that ended the call.
async fn drain(
    mut stream: tonic::Streaming<BlobFrame>,
    start: u64,
) -> (Vec<u8>, usize, Option<tonic::Status>) {
    let mut bytes = Vec::new();
    let mut frames = 0;
    loop {
        match stream.message().await {
            Ok(Some(frame)) => {
                assert_eq!(
                    frame.offset,
                    start + bytes.len() as u64,
                    "contiguous frames"
                );
                bytes.extend_from_slice(&frame.data);
                frames += 1;
            }
            Ok(None) => return (bytes, frames, None),
            Err(status) => return (bytes, frames, Some(status)),
        }
    }
}

/// The value of the sample named exactly `series`; panics when absent.
fn metric(node: &TestNode, series: &str) -> u64 {
    support::metrics::require(&node.metrics_text(), series)
}

/// A metric's value, 0 while the series does not exist yet.
fn metric_or_zero(node: &TestNode, series: &str) -> u64 {
    support::metrics::count_or_zero(&node.metrics_text(), series)
}

#[tokio::test]
async fn get_blob_round_trips_byte_exact_with_ranges_and_stat_blob_matches_http() {
    let node = TestNode::start_with(with_grpc, NodeOptions::default()).await;
    let data = random_bytes(3 << 20, 21);
    let (key, etag) = upload(&node, &data).await;
    let mut client = client(&node).await;
    let bytes_before = metric_or_zero(&node, "graviton_download_bytes_total");
    let ok_before = metric_or_zero(&node, "graviton_downloads_total{outcome=\"ok\"}");

    let stream = client.get_blob(get(&key, None)).await.unwrap().into_inner();
    let (bytes, frames, status) = drain(stream, 0).await;
    assert!(status.is_none(), "{status:?}");
    assert!(frames > 1, "one frame per block slice");
    assert!(bytes == data, "whole blob byte-exact");
    // GetBlob feeds the same download metrics as an HTTP GET.
    assert_eq!(
        metric_or_zero(&node, "graviton_download_bytes_total") - bytes_before,
        data.len() as u64
    );
    assert_eq!(
        metric_or_zero(&node, "graviton_downloads_total{outcome=\"ok\"}") - ok_before,
        1
    );

    for (offset, length) in [
        (1000u64, 70_000u64),
        (0, 1),
        (data.len() as u64 - 5, 0),
        (12_345, 1 << 30),
    ] {
        let stream = client
            .get_blob(get(&key, Some((offset, length))))
            .await
            .unwrap()
            .into_inner();
        let (bytes, _, status) = drain(stream, offset).await;
        assert!(status.is_none(), "{status:?}");
        let end = if length == 0 {
            data.len()
        } else {
            (offset + length).min(data.len() as u64) as usize
        };
        assert!(
            bytes == data[offset as usize..end],
            "range {offset}+{length}"
        );
    }

    let stat = client
        .stat_blob(StatBlobRequest { key: key.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stat.size, data.len() as u64);
    assert_eq!(stat.etag, etag, "the HTTP ETag");
    assert!(stat.blocks > 1);

    let missing = format!("blake3:{}:5", "0".repeat(64));
    let err = client.get_blob(get(&missing, None)).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = client
        .stat_blob(StatBlobRequest { key: missing })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = client.get_blob(get("not-a-key", None)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = client
        .stat_blob(StatBlobRequest {
            key: "blake3:zz:1".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = client
        .get_blob(get(&key, Some((data.len() as u64, 1))))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange);
}

fn signing_key() -> (EncodingKey, Jwk) {
    let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let key = EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).unwrap();
    let mut jwk = Jwk::from_encoding_key(&key, Algorithm::ES256).unwrap();
    jwk.common.key_id = Some("k1".into());
    (key, jwk)
}

fn token(key: &EncodingKey, org: &str) -> String {
    let now = jsonwebtoken::get_current_timestamp() as i64;
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some("k1".into());
    let claims = json!({"iss": ISSUER, "aud": AUDIENCE, "sub": "user-1", "org_id": org, "exp": now + 600, "iat": now});
    jsonwebtoken::encode(&header, &claims, key).unwrap()
}

fn bearer<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}

/// Wait until Redis time is at least 10 s away from the end of its current minute (the
/// request quota counts per Redis-time minute).
async fn avoid_minute_boundary(url: &str) {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let into_minute = Duration::from_secs(secs % 60) + Duration::from_micros(micros);
    if into_minute > Duration::from_secs(50) {
        tokio::time::sleep(Duration::from_secs(60) - into_minute + Duration::from_millis(100))
            .await;
    }
}

/// GRPC-1: with auth on, a call without a valid bearer token is UNAUTHENTICATED, and one
/// whose tenant metadata differs from the token's organization PERMISSION_DENIED; both
/// charge nothing, even when they name the tenant in metadata. A valid call is charged
/// exactly one request.
#[tokio::test]
async fn unauthenticated_calls_are_refused_before_any_charge() {
    let Some(server) =
        RedisServer::start("grpc_unauthenticated_calls_are_refused_before_any_charge")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let jwks_path = dir.path().join("jwks.json");
    let (key, jwk) = signing_key();
    std::fs::write(
        &jwks_path,
        serde_json::to_string(&JwkSet { keys: vec![jwk] }).unwrap(),
    )
    .unwrap();
    let url = server.url();
    let node = TestNode::start_with(
        |c| {
            with_grpc(c);
            redis_admission(c, url, |r| r.tenant_requests_per_minute = 1);
            c.auth = AuthConfig {
                enabled: true,
                issuers: vec![IssuerConfig {
                    issuer: ISSUER.into(),
                    audience: vec![AUDIENCE.into()],
                    jwks_file: Some(jwks_path.clone()),
                    leeway: HumanDuration::secs(5),
                    ..IssuerConfig::default()
                }],
            };
        },
        NodeOptions::default(),
    )
    .await;
    let mut client = client(&node).await;
    let org: TenantId = ORG.parse().unwrap();
    let missing = format!("blake3:{}:5", "0".repeat(64));
    avoid_minute_boundary(&server.url()).await;

    // No token, even with the tenant named in metadata.
    let err = client
        .get_blob(with_tenant(get(&missing, None), &org))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    let err = client
        .stat_blob(with_tenant(
            StatBlobRequest {
                key: missing.clone(),
            },
            &org,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    // A malformed token and a token signed by a key the server does not know.
    let err = client
        .stat_blob(bearer(
            StatBlobRequest {
                key: missing.clone(),
            },
            "not.a.jwt",
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    let (foreign, _) = signing_key();
    let err = client
        .get_blob(bearer(get(&missing, None), &token(&foreign, ORG)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    assert!(!err.message().contains("eyJ"), "no token in messages");

    // A valid token whose organization differs from the tenant named in metadata:
    // PERMISSION_DENIED, and still nothing charged.
    let valid = token(&key, ORG);
    let other: TenantId = "5d1e2f3a-4b5c-4d6e-8f70-8192a3b4c5d6".parse().unwrap();
    let mut request = bearer(get(&missing, None), &valid);
    request
        .metadata_mut()
        .insert("x-graviton-tenant-id", other.to_string().parse().unwrap());
    let err = client.get_blob(request).await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    // Nothing was charged: the tenant's single request of the minute is still there.
    let err = client
        .stat_blob(bearer(
            StatBlobRequest {
                key: missing.clone(),
            },
            &valid,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "authenticated and charged once");
    // ... and that call took it: one charge per call.
    let err = client
        .get_blob(bearer(get(&missing, None), &valid))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert!(err.metadata().get("retry-after").is_some());
    assert_eq!(
        node.metric("graviton_admission_quota_rejections_total{kind=\"request\"}"),
        Some(1),
        "{}",
        node.metrics_text()
    );
}

/// GRPC-2, GRPC-3: the egress quota runs out mid-stream; the call ends with
/// RESOURCE_EXHAUSTED after exactly the frames that were charged.
#[tokio::test]
async fn egress_quota_running_out_mid_stream_ends_after_exactly_the_charged_frames() {
    let Some(server) = RedisServer::start("grpc_egress_quota_running_out_mid_stream") else {
        return;
    };
    let url = server.url();
    let node = TestNode::start_with(
        |c| {
            with_grpc(c);
            redis_admission(c, url, |r| r.tenant_egress_per_hour = ByteSize::kib(512));
        },
        NodeOptions::default(),
    )
    .await;
    let data = random_bytes(2 << 20, 22);
    let (key, _) = upload(&node, &data).await;
    let mut client = client(&node).await;
    let tenant = TenantId::new_random();

    let stream = client
        .get_blob(with_tenant(get(&key, None), &tenant))
        .await
        .expect("the window is not spent yet: the call starts")
        .into_inner();
    let (bytes, frames, status) = drain(stream, 0).await;
    let status = status.expect("the call must not end cleanly");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        frames > 0 && bytes.len() <= 512 * 1024,
        "{frames} frames, {} bytes",
        bytes.len()
    );
    assert!(
        bytes == data[..bytes.len()],
        "the delivered prefix is byte-exact"
    );
    assert_eq!(
        metric(&node, "graviton_admission_delivered_egress_bytes_total"),
        bytes.len() as u64,
        "every charged byte was delivered, and nothing uncharged"
    );
}

/// GRPC-3: Redis stops mid-stream; the call ends with UNAVAILABLE.
#[tokio::test]
async fn redis_stopped_mid_stream_ends_with_unavailable() {
    let Some(mut server) = RedisServer::start("grpc_redis_stopped_mid_stream") else {
        return;
    };
    let url = server.url();
    let node = TestNode::start_with(
        |c| {
            with_grpc(c);
            redis_admission(c, url, |r| r.tenant_egress_per_hour = ByteSize::gib(1));
        },
        NodeOptions::default(),
    )
    .await;
    let data = random_bytes(16 << 20, 23);
    let (key, _) = upload(&node, &data).await;
    let mut client = client(&node).await;
    let tenant = TenantId::new_random();

    let mut stream = client
        .get_blob(with_tenant(get(&key, None), &tenant))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().expect("a first frame");
    assert_eq!(first.offset, 0);
    // The small client window holds the server back: most of the blob is still unsent.
    server.stop();
    let (rest, _, status) = drain(stream, first.data.len() as u64).await;
    let status = status.expect("the call must not end cleanly");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(first.data.len() + rest.len() < data.len());
}

/// Shutdown stops the gRPC listener with the node: a call in flight finishes byte-exact
/// within the grace, and a new call afterwards fails.
#[tokio::test]
async fn shutdown_lets_a_running_get_blob_finish() {
    let mut node = TestNode::start_with(
        |c| {
            with_grpc(c);
            c.node.shutdown_grace = HumanDuration::secs(30);
        },
        NodeOptions::default(),
    )
    .await;
    let data = random_bytes(8 << 20, 24);
    let (key, _) = upload(&node, &data).await;
    let mut client = client(&node).await;
    let mut stream = client.get_blob(get(&key, None)).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().expect("a first frame");

    let running = node.node.take().unwrap();
    let stopping = tokio::spawn(running.shutdown());
    let (rest, _, status) = drain(stream, first.data.len() as u64).await;
    assert!(status.is_none(), "{status:?}");
    let mut bytes = first.data.to_vec();
    bytes.extend_from_slice(&rest);
    assert!(bytes == data, "the call in flight finished byte-exact");
    assert_eq!(
        stopping.await.unwrap(),
        graviton::node::ShutdownOutcome::Drained
    );
    let err = client.get_blob(get(&key, None)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
}

/// GRPC-4: `[grpc.tls]`: GetBlob over TLS (ALPN h2) with a client that trusts the test CA is
/// byte-exact; a plaintext client and a client that does not trust the CA get no answer.
#[tokio::test]
async fn the_tls_listener_serves_trusted_clients_only() {
    let pki = support::pki::TestPki::new();
    let (cert, key_file) = pki.issue("grpc-node");
    let node = TestNode::start_with(
        |c| {
            with_grpc(c);
            c.grpc.tls.cert_file = Some(cert.clone());
            c.grpc.tls.key_file = Some(key_file.clone());
        },
        NodeOptions::default(),
    )
    .await;
    let data = random_bytes(1 << 20, 31);
    let (key, _) = upload(&node, &data).await;
    let addr = node.node.as_ref().unwrap().grpc_addr().unwrap();

    let ca = tonic::transport::Certificate::from_pem(std::fs::read(&pki.ca).unwrap());
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(ca)
        .domain_name("localhost");
    let channel = Endpoint::from_shared(format!("https://localhost:{}", addr.port()))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .expect("TLS connect with the test CA");
    let mut client = BlobsClient::new(channel).max_decoding_message_size(4 << 20);
    let stream = client.get_blob(get(&key, None)).await.unwrap().into_inner();
    let (bytes, _, status) = drain(stream, 0).await;
    assert!(status.is_none(), "{status:?}");
    assert!(bytes == data, "byte-exact over TLS");

    // Plaintext HTTP/2 against the TLS listener: no gRPC answer.
    let plain = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10));
    match plain.connect().await {
        Err(_) => {}
        Ok(channel) => {
            let err = BlobsClient::new(channel)
                .stat_blob(StatBlobRequest { key: key.clone() })
                .await
                .unwrap_err();
            assert_ne!(err.code(), Code::Ok);
            assert_ne!(err.code(), Code::NotFound, "no answer from the service");
        }
    }
    // A client that trusts another CA refuses the server's certificate.
    let foreign = support::pki::TestPki::new();
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(
            std::fs::read(&foreign.ca).unwrap(),
        ))
        .domain_name("localhost");
    let untrusted = Endpoint::from_shared(format!("https://localhost:{}", addr.port()))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await;
    assert!(untrusted.is_err(), "an untrusted certificate is refused");
}

/// GRPC-4: the gRPC listener bounds its connections like the HTTP ones: past
/// `grpc.max_connections` a connection is closed at once (and counted), a client that
/// never sends the HTTP/2 preface (or only part of it) is disconnected after
/// `grpc.handshake_timeout` (and counted), and once a slot is free calls work again.
#[tokio::test]
async fn connections_are_bounded_and_silent_clients_are_disconnected() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let node = TestNode::start_with(
        |c| {
            with_grpc(c);
            c.grpc.max_connections = 2;
            c.grpc.handshake_timeout = HumanDuration::secs(1);
        },
        NodeOptions::default(),
    )
    .await;
    let addr = node.node.as_ref().unwrap().grpc_addr().unwrap();
    let missing = format!("blake3:{}:5", "0".repeat(64));

    // A silent client and one that sends half the preface are both disconnected.
    for prefix in [&b""[..], &b"PRI * HTTP/2.0\r\n"[..]] {
        let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
        raw.write_all(prefix).await.unwrap();
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(30), raw.read(&mut buf))
            .await
            .expect("the server closes a stalled connection");
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "closed, not answered: {read:?}"
        );
    }
    assert!(
        metric_or_zero(
            &node,
            "graviton_connection_header_timeouts_total{listener=\"grpc\"}"
        ) >= 2
    );

    // Two working connections fill the bound; a third is closed without an answer.
    let mut first = client(&node).await;
    let mut second = client(&node).await;
    for c in [&mut first, &mut second] {
        let err = c
            .stat_blob(StatBlobRequest {
                key: missing.clone(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound, "served within the bound");
    }
    let third = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10));
    if let Ok(channel) = third.connect().await {
        let err = BlobsClient::new(channel)
            .stat_blob(StatBlobRequest {
                key: missing.clone(),
            })
            .await
            .unwrap_err();
        // The connection is closed before any answer: tonic reports UNAVAILABLE or
        // CANCELLED ("connection closed"), never the service's NOT_FOUND.
        assert!(
            matches!(err.code(), Code::Unavailable | Code::Cancelled),
            "refused over the bound: {err:?}"
        );
    }
    assert!(
        metric_or_zero(
            &node,
            "graviton_connections_refused_total{listener=\"grpc\"}"
        ) >= 1
    );

    // A slot frees up when a connection closes: a new client is served again.
    drop(first);
    let served_again = support::wait_until(Duration::from_secs(30), || async {
        let Ok(channel) = Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
        else {
            return false;
        };
        let err = BlobsClient::new(channel)
            .stat_blob(StatBlobRequest {
                key: missing.clone(),
            })
            .await
            .unwrap_err();
        err.code() == Code::NotFound
    })
    .await;
    assert!(served_again, "a freed slot serves a new client");
    drop(second);
}
