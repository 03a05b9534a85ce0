//! The public HTTP API of a single node over real sockets.

mod support;

use std::time::Duration;

use graviton::cas::BlobKey;
use support::client;
use support::node::{TestNode, random_bytes, raw_exchange};

async fn upload(url: &str, data: Vec<u8>) -> serde_json::Value {
    let response = client()
        .post(format!("{url}/v1/blobs"))
        .body(data)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201, "{:?}", response.text().await);
    response.json().await.unwrap()
}

// Checks CAS-3: a 64 MiB download is byte-exact (the aborted case: OPS-3 in download_faults.rs).
#[tokio::test]
async fn random_64mib_round_trip_is_byte_exact() {
    let node = TestNode::start().await;
    let data = random_bytes(64 << 20, 1);
    let expected = BlobKey::of(&data);
    let response = client()
        .post(format!("{}/v1/blobs", node.url))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let location = response.headers()["location"].to_str().unwrap().to_string();
    let etag = response.headers()["etag"].to_str().unwrap().to_string();
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["key"], expected.to_string());
    assert_eq!(body["size"], 64 << 20);
    assert_eq!(body["owner"], "local");
    assert_eq!(location, format!("/v1/blobs/{expected}"));
    assert_eq!(etag, expected.etag());
    let blocks = body["blocks"].as_u64().unwrap();
    assert!(
        blocks > 200,
        "64 MiB at 64 KiB average gives hundreds of blocks, got {blocks}"
    );
    assert_eq!(body["fresh_blocks"].as_u64().unwrap(), blocks);

    let download = client()
        .get(format!("{}{location}", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(download.status(), 200);
    assert_eq!(
        download.headers()["content-length"],
        (64u64 << 20).to_string().as_str()
    );
    let bytes = download.bytes().await.unwrap();
    assert_eq!(bytes.len(), data.len());
    assert!(bytes[..] == data[..], "downloaded bytes differ");
}

// Checks CAS-1 (same key, no new block on re-upload) and STO-2 over HTTP.
#[tokio::test]
async fn reupload_stores_no_new_blocks_and_shifted_content_mostly_dedups() {
    let node = TestNode::start().await;
    let data = random_bytes(8 << 20, 2);
    let first = upload(&node.url, data.clone()).await;
    let blocks_on_disk = node.block_count();
    assert_eq!(
        blocks_on_disk as u64,
        first["fresh_blocks"].as_u64().unwrap()
    );

    let again = upload(&node.url, data.clone()).await;
    assert_eq!(again["key"], first["key"]);
    assert_eq!(again["fresh_blocks"], 0);
    assert_eq!(again["duplicate_blocks"], first["blocks"]);
    assert_eq!(node.block_count(), blocks_on_disk, "no block written twice");
    assert_eq!(node.manifest_count(), 1);

    // Content-defined chunking: inserting bytes at the front only disturbs the first blocks.
    let mut shifted = b"a few extra bytes at the front".to_vec();
    shifted.extend_from_slice(&data);
    let third = upload(&node.url, shifted).await;
    assert_ne!(third["key"], first["key"]);
    let fresh = third["fresh_blocks"].as_u64().unwrap();
    assert!(
        fresh <= 2,
        "expected at most 2 new blocks after a prefix insert, got {fresh}"
    );
}

// Checks CAS-3 for ranges: every satisfiable range returns exactly its bytes.
#[tokio::test]
async fn single_range_reads_and_head() {
    let node = TestNode::start().await;
    let data = random_bytes(3 << 20, 3);
    let key = upload(&node.url, data.clone()).await["key"]
        .as_str()
        .unwrap()
        .to_string();
    let url = format!("{}/v1/blobs/{key}", node.url);
    let size = data.len();
    for (header, first, last) in [
        ("bytes=0-0".to_string(), 0, 0),
        ("bytes=100000-900000".to_string(), 100_000, 900_000),
        (format!("bytes={}-", size - 10), size - 10, size - 1),
        ("bytes=-4096".to_string(), size - 4096, size - 1),
        (format!("bytes=5-{}", size * 2), 5, size - 1),
    ] {
        let response = client()
            .get(&url)
            .header("range", &header)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 206, "{header}");
        assert_eq!(
            response.headers()["content-range"],
            format!("bytes {first}-{last}/{size}").as_str()
        );
        let bytes = response.bytes().await.unwrap();
        assert!(bytes[..] == data[first..=last], "{header}");
    }
    let response = client()
        .get(&url)
        .header("range", format!("bytes={size}-"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 416);
    assert_eq!(
        response.headers()["content-range"],
        format!("bytes */{size}").as_str()
    );

    let head = client().head(&url).send().await.unwrap();
    assert_eq!(head.status(), 200);
    assert_eq!(head.headers()["content-length"], size.to_string().as_str());
    assert_eq!(head.headers()["accept-ranges"], "bytes");
    assert!(head.bytes().await.unwrap().is_empty());

    let not_modified = client()
        .get(&url)
        .header("if-none-match", BlobKey::of(&data).etag())
        .send()
        .await
        .unwrap();
    assert_eq!(not_modified.status(), 304);
}

#[tokio::test]
async fn unknown_and_malformed_keys() {
    let node = TestNode::start().await;
    let missing = BlobKey::of(b"never uploaded");
    let response = client()
        .get(format!("{}/v1/blobs/{missing}", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"], "blob_not_found");
    let response = client()
        .get(format!("{}/v1/blobs/not-a-key", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"], "invalid_blob_key");
}

const TENANT: &str = "0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f";
const SESSION: &str = "01890a5d-ac96-774b-bcce-b302099a8057";

// Checks HTTP-1: each header refusal answers while the body is unsent, and no body byte is counted.
#[tokio::test]
async fn bad_headers_are_rejected_before_the_body_is_read() {
    let node = TestNode::start().await;
    let cases: Vec<(String, u16, &str)> = vec![
        (
            format!("X-Graviton-Tenant-Id: {TENANT}\r\nContent-Length: 1000000\r\n"),
            400,
            "incomplete_session_headers",
        ),
        (
            format!("X-Graviton-Upload-Session-Id: {SESSION}\r\nContent-Length: 1000000\r\n"),
            400,
            "incomplete_session_headers",
        ),
        (
            format!(
                "X-Graviton-Tenant-Id: not-a-uuid\r\nX-Graviton-Upload-Session-Id: {SESSION}\r\nContent-Length: 1000000\r\n"
            ),
            400,
            "invalid_tenant_id",
        ),
        (
            "Content-Length: 999999999999999\r\n".to_string(),
            413,
            "blob_too_large",
        ),
        (
            "Content-Type: multipart/form-data; boundary=x\r\nContent-Length: 1000000\r\n"
                .to_string(),
            415,
            "unsupported_media_type",
        ),
    ];
    for (headers, status, code) in cases {
        // Headers plus 10 body bytes of a declared megabyte: the answer must come while
        // 999,990 bytes are still unsent.
        let request = format!("POST /v1/blobs HTTP/1.1\r\nHost: x\r\n{headers}\r\n0123456789");
        let (_stream, answer) = raw_exchange(node.addr(), request.as_bytes()).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")),
            "{headers}: {answer}"
        );
        assert!(
            answer.contains(&format!("\"error\":\"{code}\"")),
            "{headers}: {answer}"
        );
    }
    // A malformed Content-Length is refused by the HTTP layer itself, also before the body.
    let (_stream, answer) = raw_exchange(
        node.addr(),
        b"POST /v1/blobs HTTP/1.1\r\nHost: x\r\nContent-Length: 12a\r\n\r\n0123",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    // No body byte was consumed by any of them.
    assert_eq!(
        node.metric("graviton_upload_bytes_total"),
        Some(0),
        "{}",
        node.metrics_text()
    );
    assert_eq!(node.manifest_count(), 0);
}

// Checks CAS-2: a body cut short leaves no manifest and no blob under either key.
#[tokio::test]
async fn truncated_body_stores_nothing() {
    use tokio::io::AsyncWriteExt;
    let node = TestNode::start().await;
    let data = random_bytes(2 << 20, 4);
    let mut stream = tokio::net::TcpStream::connect(node.addr()).await.unwrap();
    let head = format!(
        "POST /v1/blobs HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        data.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&data[..1 << 20]).await.unwrap();
    stream.shutdown().await.unwrap();
    drop(stream);
    // Wait until the server has seen the whole partial body and given up on it.
    let failed = support::wait_until(Duration::from_secs(10), || async {
        node.metric("graviton_uploads_total{outcome=\"client_error\"}") == Some(1)
    })
    .await;
    assert!(failed, "{}", node.metrics_text());
    assert_eq!(node.manifest_count(), 0);
    for key in [BlobKey::of(&data), BlobKey::of(&data[..1 << 20])] {
        let response = client()
            .get(format!("{}/v1/blobs/{key}", node.url))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 404);
    }
}

#[tokio::test]
async fn ops_endpoints() {
    let mut node = TestNode::start().await;
    assert_eq!(
        client()
            .get(format!("{}/healthz", node.url))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        client()
            .get(format!("{}/readyz", node.url))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    upload(&node.url, random_bytes(100_000, 5)).await;
    let metrics = client()
        .get(format!("{}/metrics", node.url))
        .send()
        .await
        .unwrap();
    assert!(
        metrics.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    let text = metrics.text().await.unwrap();
    assert_eq!(
        support::metrics::count(&text, "graviton_upload_bytes_total"),
        Some(100000),
        "{text}"
    );
    assert_eq!(
        support::metrics::count(
            &text,
            "graviton_http_requests_total{route=\"/v1/blobs\",method=\"POST\",status=\"2xx\"}"
        ),
        Some(1),
        "{text}"
    );
    let cluster: serde_json::Value = client()
        .get(format!("{}/v1/ops/cluster", node.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(cluster["mode"], "embedded");
    assert_eq!(cluster["shards"]["local"], cluster["shards"]["configured"]);
    assert_eq!(
        node.shutdown().await,
        graviton::node::ShutdownOutcome::Drained
    );
}

// Checks CAS-4.
#[tokio::test]
async fn a_declared_sha256_is_checked_before_the_commit_in_both_spellings() {
    use base64::Engine;
    use sha2::Digest;
    let node = TestNode::start().await;
    let data = random_bytes(3 << 20, 9);
    let sha: [u8; 32] = sha2::Sha256::digest(&data).into();
    let hex: String = sha.iter().map(|b| format!("{b:02x}")).collect();
    let rfc = format!(
        "sha-256=:{}:",
        base64::engine::general_purpose::STANDARD.encode(sha)
    );
    let post = |name: &'static str, value: String, body: Vec<u8>| {
        client()
            .post(format!("{}/v1/blobs", node.url))
            .header(name, value)
            .body(body)
            .send()
    };
    // A wrong digest: 400 digest_mismatch, and nothing becomes visible.
    let mut wrong = data.clone();
    wrong[12345] ^= 1;
    let response = post("content-digest", rfc.clone(), wrong.clone())
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"], "digest_mismatch");
    let response = post("x-content-hash", hex.clone(), wrong.clone())
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    assert_eq!(node.manifest_count(), 0);
    let missing = client()
        .get(format!("{}/v1/blobs/{}", node.url, BlobKey::of(&wrong)))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    // A malformed or unsupported digest is refused before the body.
    for (name, value) in [
        ("content-digest", "sha-256=:short:".to_string()),
        ("content-digest", "sha-512=:AAAA:".to_string()),
        ("x-content-hash", "xyz".to_string()),
    ] {
        let response = post(name, value, data.clone()).await.unwrap();
        assert_eq!(response.status(), 400);
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body["error"], "invalid_digest", "{name}");
    }
    // The right digest, in either spelling, commits the blob.
    for (name, value) in [
        ("content-digest", rfc),
        ("x-content-hash", format!("sha256:{hex}")),
    ] {
        let response = post(name, value, data.clone()).await.unwrap();
        assert_eq!(response.status(), 201, "{name}");
    }
    assert_eq!(node.manifest_count(), 1);
}

#[tokio::test]
async fn pdf_bodies_are_selected_by_type_and_signature_and_refusals_store_nothing() {
    // Checks CAS-12 over HTTP: the receipt names the chunker; a type the first bytes
    // contradict is 415 with its code, and no manifest is written.
    let node = TestNode::start().await;
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pdf");
    let pdf = std::fs::read(fixtures.join("plain.pdf")).unwrap();
    let other_pdf = std::fs::read(fixtures.join("rewritten.pdf")).unwrap();
    let post = |body: Vec<u8>, content_type: Option<&'static str>| {
        let mut request = client().post(format!("{}/v1/blobs", node.url)).body(body);
        if let Some(value) = content_type {
            request = request.header("content-type", value);
        }
        request.send()
    };
    // Undeclared, and application/pdf: the PDF chunker; octet-stream random: FastCDC.
    for (body, content_type, chunker) in [
        (pdf.clone(), None, "pdf"),
        (pdf.clone(), Some("application/pdf"), "pdf"),
        (
            random_bytes(100_000, 8),
            Some("application/octet-stream"),
            "fastcdc",
        ),
    ] {
        let response = post(body.clone(), content_type).await.unwrap();
        assert_eq!(response.status(), 201);
        let receipt: serde_json::Value = response.json().await.unwrap();
        assert_eq!(receipt["chunker"], chunker, "{receipt}");
        let key = receipt["key"].as_str().unwrap().to_string();
        let got = client()
            .get(format!("{}/v1/blobs/{key}", node.url))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(&got[..], &body[..]);
    }
    let stored = node.manifest_count();
    for (body, content_type, code) in [
        (
            random_bytes(300_000, 9),
            "application/pdf",
            "pdf_signature_missing",
        ),
        (other_pdf.clone(), "image/png", "pdf_type_mismatch"),
    ] {
        let response = post(body.clone(), Some(content_type)).await.unwrap();
        assert_eq!(response.status(), 415);
        let answer: serde_json::Value = response.json().await.unwrap();
        assert_eq!(answer["error"], code, "{answer}");
        let response = client()
            .get(format!("{}/v1/blobs/{}", node.url, BlobKey::of(&body)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 404);
    }
    assert_eq!(node.manifest_count(), stored);
    let metrics = node.metrics_text();
    for (series, expected) in [
        ("graviton_pdf_refusals_total{kind=\"type_mismatch\"}", 1),
        ("graviton_pdf_refusals_total{kind=\"signature_missing\"}", 1),
        ("graviton_ingests_by_chunker_total{kind=\"pdf\"}", 2),
    ] {
        assert_eq!(
            support::metrics::count(&metrics, series),
            Some(expected),
            "{series} in {metrics}"
        );
    }
}
