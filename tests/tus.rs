//! tus 1.0 resumable uploads over real sockets (docs/api.md, "Resumable uploads (tus 1.0)";
//! docs/resumable.md): every protocol rule and bad input, a dropped connection mid-PATCH,
//! an admission refusal before the body, expiry, the collector, a restart, and an
//! unmodified tus client (tus-js-client from npm).

mod support;

use std::time::Duration;

use base64::Engine;
use graviton::cas::BlobKey;
use graviton::config::{ByteSize, Config, HumanDuration};
use reqwest::header::HeaderMap;
use sha2::Digest;
use support::client;
use support::node::{TestNode, random_bytes, raw_exchange};

const TENANT: &str = "6f1c1a8e-5d0b-4c8e-9f55-3f2a8f0e7a11";
const OCTETS: &str = "application/offset+octet-stream";

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// POST a creation; returns the upload URL (absolute).
async fn create(url: &str, length: u64) -> String {
    let response = client()
        .post(format!("{url}/v1/uploads"))
        .header("tus-resumable", "1.0.0")
        .header("upload-length", length.to_string())
        .header("upload-metadata", "filename aGVsbG8udHh0")
        .header("x-graviton-tenant-id", TENANT)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201, "{:?}", response.text().await);
    assert_eq!(header(response.headers(), "tus-resumable"), Some("1.0.0"));
    assert_eq!(header(response.headers(), "upload-offset"), Some("0"));
    assert!(header(response.headers(), "upload-expires").is_some());
    let location = header(response.headers(), "location").unwrap();
    assert!(location.starts_with("/v1/uploads/"), "{location}");
    format!("{url}{location}")
}

async fn patch(upload: &str, offset: u64, data: Vec<u8>) -> reqwest::Response {
    client()
        .patch(upload)
        .header("tus-resumable", "1.0.0")
        .header("content-type", OCTETS)
        .header("upload-offset", offset.to_string())
        .body(data)
        .send()
        .await
        .unwrap()
}

async fn head(upload: &str) -> reqwest::Response {
    client()
        .head(upload)
        .header("tus-resumable", "1.0.0")
        .send()
        .await
        .unwrap()
}

async fn offset_of(upload: &str) -> u64 {
    let response = head(upload).await;
    assert_eq!(response.status(), 200);
    header(response.headers(), "upload-offset")
        .unwrap()
        .parse()
        .unwrap()
}

async fn download(url: &str, key: &str) -> Vec<u8> {
    let response = client()
        .get(format!("{url}/v1/blobs/{key}"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap().to_vec()
}

/// The block list of a blob's manifest on a node (from its manifest file).
fn manifest_blocks(node: &TestNode, key: &BlobKey) -> Vec<serde_json::Value> {
    let hex = key.to_string();
    let hash = hex.split(':').nth(1).unwrap().to_string();
    let path = node
        .dir
        .path()
        .join("manifests")
        .join(&hash[..2])
        .join(format!("{hash}-{}.json", key.size));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    manifest["blocks"].as_array().unwrap().clone()
}

#[tokio::test]
async fn options_advertise_the_version_extensions_and_limits() {
    let node = TestNode::start().await;
    let response = client()
        .request(reqwest::Method::OPTIONS, format!("{}/v1/uploads", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    let h = response.headers();
    assert_eq!(header(h, "tus-resumable"), Some("1.0.0"));
    assert_eq!(header(h, "tus-version"), Some("1.0.0"));
    let extensions = header(h, "tus-extension").unwrap();
    for ext in [
        "creation",
        "creation-with-upload",
        "termination",
        "expiration",
        "checksum",
    ] {
        assert!(extensions.split(',').any(|e| e == ext), "{extensions}");
    }
    assert_eq!(header(h, "tus-checksum-algorithm"), Some("sha1,sha256"));
    let config = Config::for_test(node.dir.path());
    assert_eq!(
        header(h, "tus-max-size"),
        Some(config.upload.max_blob_size.bytes().to_string().as_str())
    );
}

#[tokio::test]
async fn patches_resume_at_the_last_cut_and_equal_a_one_shot_upload() {
    // Checks TUS-2 (same key, same blocks as a one-shot upload) and TUS-1 (HEAD reports
    // the bytes accepted).
    let node = TestNode::start().await;
    let data = random_bytes((5 << 20) + 12_345, 77);
    let expected = BlobKey::of(&data);
    let upload = create(&node.url, data.len() as u64).await;
    // Uneven parts, none on a cut point: 700 KiB, 1 MiB + 13, 1 byte, the rest.
    let cuts = [
        0usize,
        700 << 10,
        (700 << 10) + (1 << 20) + 13,
        (1724 << 10) + 14,
    ];
    let mut offset = 0u64;
    for pair in cuts.windows(2) {
        let response = patch(&upload, offset, data[pair[0]..pair[1]].to_vec()).await;
        assert_eq!(response.status(), 204, "{:?}", response.text().await);
        offset = pair[1] as u64;
        assert_eq!(
            header(response.headers(), "upload-offset"),
            Some(offset.to_string().as_str())
        );
        assert!(header(response.headers(), "graviton-blob-key").is_none());
        assert_eq!(offset_of(&upload).await, offset);
    }
    let last = patch(&upload, offset, data[offset as usize..].to_vec()).await;
    assert_eq!(last.status(), 204);
    assert_eq!(
        header(last.headers(), "graviton-blob-key"),
        Some(expected.to_string().as_str())
    );
    let status = head(&upload).await;
    let h = status.headers();
    assert_eq!(
        header(h, "upload-offset"),
        Some(data.len().to_string().as_str())
    );
    assert_eq!(
        header(h, "upload-length"),
        Some(data.len().to_string().as_str())
    );
    assert_eq!(header(h, "cache-control"), Some("no-store"));
    assert_eq!(header(h, "upload-metadata"), Some("filename aGVsbG8udHh0"));
    assert_eq!(
        header(h, "graviton-blob-key"),
        Some(expected.to_string().as_str())
    );
    // A PATCH after completion conflicts.
    assert_eq!(patch(&upload, offset, vec![1]).await.status(), 409);

    let got = download(&node.url, &expected.to_string()).await;
    assert!(got == data, "downloaded bytes differ");

    // The same bytes uploaded in one shot on a fresh node: same key, same blocks.
    let other = TestNode::start().await;
    let response = client()
        .post(format!("{}/v1/blobs", other.url))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["key"], expected.to_string());
    assert_eq!(
        manifest_blocks(&node, &expected),
        manifest_blocks(&other, &expected)
    );
}

#[tokio::test]
async fn protocol_refusals_and_bad_headers() {
    // Checks TUS-3 (refusals before the body; a checksum mismatch keeps nothing).
    let node = TestNode::start().await;
    let url = &node.url;
    let post = |headers: Vec<(&'static str, String)>| {
        let mut request = client().post(format!("{url}/v1/uploads"));
        for (k, v) in headers {
            request = request.header(k, v);
        }
        request.send()
    };
    let v = || ("tus-resumable", "1.0.0".to_string());
    let t = || ("x-graviton-tenant-id", TENANT.to_string());
    let len = |n: &str| ("upload-length", n.to_string());
    let code = |r: reqwest::Response| async move {
        let status = r.status().as_u16();
        let body: serde_json::Value = r.json().await.unwrap_or_default();
        (
            status,
            body["error"].as_str().unwrap_or_default().to_string(),
        )
    };

    // Tus-Resumable missing or unsupported: 412 with Tus-Version.
    let r = post(vec![t(), len("10")]).await.unwrap();
    assert_eq!(header(r.headers(), "tus-version"), Some("1.0.0"));
    assert_eq!(code(r).await, (412, "unsupported_tus_version".into()));
    let r = post(vec![("tus-resumable", "0.2.2".into()), t(), len("10")])
        .await
        .unwrap();
    assert_eq!(r.status(), 412);
    // Length missing, malformed, deferred, too large.
    assert_eq!(
        code(post(vec![v(), t()]).await.unwrap()).await,
        (400, "invalid_upload_length".into())
    );
    assert_eq!(
        code(post(vec![v(), t(), len("-5")]).await.unwrap()).await.0,
        400
    );
    let deferred = post(vec![v(), t(), ("upload-defer-length", "1".into())])
        .await
        .unwrap();
    assert_eq!(code(deferred).await, (400, "invalid_upload_length".into()));
    let huge = post(vec![v(), t(), len("99999999999999")]).await.unwrap();
    assert_eq!(code(huge).await, (413, "blob_too_large".into()));
    // Metadata malformed; no tenant.
    let meta = post(vec![v(), t(), len("1"), ("upload-metadata", "a !!".into())])
        .await
        .unwrap();
    assert_eq!(code(meta).await, (400, "invalid_upload_metadata".into()));
    assert_eq!(
        code(post(vec![v(), len("1")]).await.unwrap()).await,
        (400, "tenant_required".into())
    );
    // A session with a live upload: 409.
    let session = (
        "x-graviton-upload-session-id",
        "0b8e2f3a-1c4d-4e5f-8a9b-0c1d2e3f4a5b".to_string(),
    );
    assert_eq!(
        post(vec![v(), t(), len("10"), session.clone()])
            .await
            .unwrap()
            .status(),
        201
    );
    assert_eq!(
        code(post(vec![v(), t(), len("10"), session]).await.unwrap()).await,
        (409, "upload_exists".into())
    );

    let upload = create(url, 10).await;
    let send = |method: reqwest::Method, headers: Vec<(&'static str, String)>, body: Vec<u8>| {
        let mut request = client().request(method, &upload);
        for (k, v) in headers {
            request = request.header(k, v);
        }
        request.body(body).send()
    };
    let ct = || ("content-type", OCTETS.to_string());
    let off = |n: &str| ("upload-offset", n.to_string());
    use reqwest::Method;
    // HEAD / PATCH / DELETE without Tus-Resumable: 412.
    assert_eq!(
        send(Method::HEAD, vec![], vec![]).await.unwrap().status(),
        412
    );
    assert_eq!(
        send(Method::PATCH, vec![ct(), off("0")], vec![1])
            .await
            .unwrap()
            .status(),
        412
    );
    assert_eq!(
        send(Method::DELETE, vec![], vec![]).await.unwrap().status(),
        412
    );
    // Wrong media type, missing or malformed offset.
    let r = send(
        Method::PATCH,
        vec![
            v(),
            off("0"),
            ("content-type", "application/octet-stream".into()),
        ],
        vec![1],
    )
    .await
    .unwrap();
    assert_eq!(code(r).await, (415, "unsupported_media_type".into()));
    let r = send(Method::PATCH, vec![v(), ct()], vec![1]).await.unwrap();
    assert_eq!(code(r).await, (400, "invalid_upload_offset".into()));
    let r = send(Method::PATCH, vec![v(), ct(), off("x")], vec![1])
        .await
        .unwrap();
    assert_eq!(code(r).await.0, 400);
    // Wrong offset: 409 with the current offset.
    let r = send(Method::PATCH, vec![v(), ct(), off("3")], vec![1])
        .await
        .unwrap();
    assert_eq!(header(r.headers(), "upload-offset"), Some("0"));
    assert_eq!(code(r).await, (409, "offset_mismatch".into()));
    // A Content-Length past the declared length: 413 before the body.
    let r = send(Method::PATCH, vec![v(), ct(), off("0")], vec![0; 11])
        .await
        .unwrap();
    assert_eq!(code(r).await, (413, "upload_length_exceeded".into()));
    // A chunked body running past the length: 413, nothing of it kept.
    let stream = futures_util::stream::iter(vec![
        Ok::<_, std::io::Error>(bytes::Bytes::from(vec![1u8; 6])),
        Ok(bytes::Bytes::from(vec![2u8; 6])),
    ]);
    let r = client()
        .patch(&upload)
        .header("tus-resumable", "1.0.0")
        .header("content-type", OCTETS)
        .header("upload-offset", "0")
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    assert_eq!(code(r).await, (413, "upload_length_exceeded".into()));
    assert_eq!(offset_of(&upload).await, 0);
    // Checksums: malformed 400; mismatch 460 `digest_mismatch` and the offset stays.
    let b64 = |d: &[u8]| base64::engine::general_purpose::STANDARD.encode(d);
    let r = send(
        Method::PATCH,
        vec![v(), ct(), off("0"), ("upload-checksum", "md5 AAAA".into())],
        vec![1],
    )
    .await
    .unwrap();
    assert_eq!(code(r).await, (400, "invalid_checksum".into()));
    let wrong = sha2::Sha256::digest(b"other");
    let r = send(
        Method::PATCH,
        vec![
            v(),
            ct(),
            off("0"),
            ("upload-checksum", format!("sha256 {}", b64(&wrong))),
        ],
        vec![5; 4],
    )
    .await
    .unwrap();
    assert_eq!(code(r).await, (460, "digest_mismatch".into()));
    assert_eq!(offset_of(&upload).await, 0);
    // Matching sha1 then sha256 checksums advance it.
    let sha1 = sha1::Sha1::digest([5u8; 4]);
    let r = send(
        Method::PATCH,
        vec![
            v(),
            ct(),
            off("0"),
            ("upload-checksum", format!("sha1 {}", b64(&sha1))),
        ],
        vec![5; 4],
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 204);
    let sha256 = sha2::Sha256::digest([6u8; 6]);
    let r = send(
        Method::PATCH,
        vec![
            v(),
            ct(),
            off("4"),
            ("upload-checksum", format!("sha256 {}", b64(&sha256))),
        ],
        vec![6; 6],
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 204);
    let mut data = vec![5u8; 4];
    data.extend([6u8; 6]);
    let key = header(r.headers(), "graviton-blob-key")
        .unwrap()
        .to_string();
    assert_eq!(key, BlobKey::of(&data).to_string());
    assert_eq!(download(url, &key).await, data);

    // Unknown and malformed ids: 404.
    let unknown = format!("{url}/v1/uploads/{TENANT}.0b8e2f3a-1c4d-4e5f-8a9b-0c1d2e3f4aff");
    assert_eq!(head(&unknown).await.status(), 404);
    assert_eq!(
        head(&format!("{url}/v1/uploads/garbage")).await.status(),
        404
    );
    assert_eq!(patch(&unknown, 0, vec![1]).await.status(), 404);

    // Termination: 204, then the upload is gone (404).
    let doomed = create(url, 100).await;
    assert_eq!(patch(&doomed, 0, vec![9; 30]).await.status(), 204);
    let r = client()
        .delete(&doomed)
        .header("tus-resumable", "1.0.0")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(head(&doomed).await.status(), 404);
    assert_eq!(patch(&doomed, 30, vec![1]).await.status(), 404);
    let again = client()
        .delete(&doomed)
        .header("tus-resumable", "1.0.0")
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 404);
}

#[tokio::test]
async fn creation_with_upload_and_an_empty_upload_complete_at_once() {
    let node = TestNode::start().await;
    let data = random_bytes(300_000, 3);
    let response = client()
        .post(format!("{}/v1/uploads", node.url))
        .header("tus-resumable", "1.0.0")
        .header("upload-length", (data.len() + 1000).to_string())
        .header("x-graviton-tenant-id", TENANT)
        .header("content-type", OCTETS)
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(
        header(response.headers(), "upload-offset"),
        Some(data.len().to_string().as_str())
    );
    let upload = format!(
        "{}{}",
        node.url,
        header(response.headers(), "location").unwrap()
    );
    let tail = random_bytes(1000, 4);
    let done = patch(&upload, data.len() as u64, tail.clone()).await;
    assert_eq!(done.status(), 204);
    let mut all = data;
    all.extend(tail);
    let key = BlobKey::of(&all).to_string();
    assert_eq!(
        header(done.headers(), "graviton-blob-key"),
        Some(key.as_str())
    );
    assert_eq!(download(&node.url, &key).await, all);

    let empty = client()
        .post(format!("{}/v1/uploads", node.url))
        .header("tus-resumable", "1.0.0")
        .header("upload-length", "0")
        .header("x-graviton-tenant-id", TENANT)
        .send()
        .await
        .unwrap();
    assert_eq!(empty.status(), 201);
    assert_eq!(
        header(empty.headers(), "graviton-blob-key"),
        Some(BlobKey::of(b"").to_string().as_str())
    );
}

#[tokio::test]
async fn a_dropped_connection_keeps_only_durable_bytes_and_resumes_byte_exact() {
    // Checks TUS-1: after a connection drops mid-PATCH the offset counts only bytes that
    // are durable, and resuming from it gives a byte-exact blob.
    let node = TestNode::start().await;
    let data = random_bytes(3 << 20, 9);
    let upload = create(&node.url, data.len() as u64).await;
    let path = upload.trim_start_matches(&node.url).to_string();
    let sent = (1 << 20) + 4321;
    {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(node.addr()).await.unwrap();
        let head = format!(
            "PATCH {path} HTTP/1.1\r\nhost: x\r\ntus-resumable: 1.0.0\r\ncontent-type: {OCTETS}\r\nupload-offset: 0\r\ncontent-length: {}\r\n\r\n",
            data.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(&data[..sent]).await.unwrap();
        stream.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        // dropped here: the server sees the body break
    }
    // The broken PATCH ends on the server and releases its session ticket: until then an
    // empty PATCH at the current offset is refused (409 session_busy or offset_mismatch);
    // afterwards it is accepted (204) and changes nothing.
    let settled = support::wait_until(Duration::from_secs(30), || {
        let upload = upload.clone();
        async move {
            let offset = offset_of(&upload).await;
            patch(&upload, offset, vec![]).await.status() == 204
        }
    })
    .await;
    assert!(settled, "the broken PATCH never finished");
    let offset = offset_of(&upload).await;
    assert!(
        offset <= sent as u64,
        "offset {offset} counts bytes never sent ({sent})"
    );
    // Every byte sent reached the server before the close (FIN after the data), and the
    // PATCH carried no checksum, so all of it was kept: cut blocks plus the staged tail.
    assert_eq!(offset, sent as u64, "the bytes that arrived were kept");
    let resumed = patch(&upload, offset, data[offset as usize..].to_vec()).await;
    assert_eq!(resumed.status(), 204, "{:?}", resumed.text().await);
    let key = BlobKey::of(&data).to_string();
    assert_eq!(
        header(resumed.headers(), "graviton-blob-key"),
        Some(key.as_str())
    );
    assert!(download(&node.url, &key).await == data);
}

#[tokio::test]
async fn a_refused_part_leaves_its_body_unread_and_holds_nothing() {
    // Checks TUS-3. The part's footprint (`Footprint::for_part`: min(part_footprint,
    // remaining) = 32 MiB) never fits a tenant limit of 16 MiB: 429 before the body, and
    // the permits are all free afterwards. A part of 1000 bytes reserves the upload
    // footprint (about 13.3 MiB, ADM-14), which fits.
    let node = TestNode::start_with(
        |config| {
            config.admission.tenant_bytes = ByteSize::mib(16);
            // One transfer per tenant: a slot leaked by the refusal would block the next.
            config.admission.tenant_transfers = 1;
            config.admission.acquisition_timeout = HumanDuration(Duration::from_secs(2));
        },
        Default::default(),
    )
    .await;
    let upload = create(&node.url, 32 << 20).await;
    let path = upload.trim_start_matches(&node.url).to_string();
    let head = format!(
        "PATCH {path} HTTP/1.1\r\nhost: x\r\ntus-resumable: 1.0.0\r\ncontent-type: {OCTETS}\r\nupload-offset: 0\r\ncontent-length: {}\r\n\r\n",
        8 << 20
    );
    let mut request = head.into_bytes();
    request.extend_from_slice(&[7u8; 1000]);
    // The answer arrives while 8 MiB - 1000 bytes of the body were never sent.
    let (_stream, answer) = raw_exchange(node.addr(), &request).await;
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert!(answer.contains("transfer_admission_limited"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("tus-resumable: 1.0.0"),
        "{answer}"
    );
    assert_eq!(offset_of(&upload).await, 0);
    // Nothing held: a part that fits is admitted at once, on the same tenant.
    let small = create(&node.url, 1000).await;
    for _ in 0..3 {
        let again = patch(&upload, 0, vec![7; 8 << 20]).await;
        assert_eq!(again.status(), 429);
    }
    let answer = patch(&small, 0, vec![1; 1000]).await;
    assert_eq!(answer.status(), 204, "{:?}", answer.text().await);
}

#[tokio::test]
async fn expired_uploads_answer_gone_then_are_swept() {
    // Checks TUS-4 (expiry and the sweep).
    let node = TestNode::start_with(
        |config| {
            config.upload.resumable_expiry = HumanDuration(Duration::from_secs(1));
            config.upload.resumable_sweep_interval = HumanDuration(Duration::from_millis(300));
        },
        Default::default(),
    )
    .await;
    let upload = create(&node.url, 100).await;
    assert_eq!(patch(&upload, 0, vec![1; 10]).await.status(), 204);
    // Gone: 410 until the sweep removes the row, then 404; never 200 again.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let swept = support::wait_until(Duration::from_secs(30), || {
        let upload = upload.clone();
        let seen = seen.clone();
        async move {
            let status = head(&upload).await.status().as_u16();
            seen.lock().unwrap().push(status);
            status == 404
        }
    })
    .await;
    let seen = seen.lock().unwrap().clone();
    assert!(swept, "never swept: {seen:?}");
    assert!(seen.iter().all(|s| [200, 410, 404].contains(s)), "{seen:?}");
    assert_eq!(patch(&upload, 10, vec![1; 10]).await.status(), 404);
}

#[tokio::test]
async fn blocks_of_an_incomplete_upload_survive_the_collector_and_a_restart() {
    // Checks TUS-4. The collector with min_age 0 would take every unreferenced block; the ledger keeps
    // the upload's blocks live. A restart loses the in-memory hasher: it is rebuilt from
    // the stored blocks and the key is still right.
    let dir = tempfile::tempdir().unwrap();
    let admin = "admin-token-for-tests-0123";
    let config = || {
        let mut config = Config::for_test(dir.path());
        config.storage.gc.min_age = HumanDuration(Duration::ZERO);
        config.admin.token = Some(graviton::config::Secret::new(admin));
        config
    };
    let node = graviton::node::start_with(config(), Default::default())
        .await
        .unwrap();
    let url = node.base_url();
    let data = random_bytes(4 << 20, 21);
    let upload = create(&url, data.len() as u64).await;
    let half = 2 << 20;
    assert_eq!(patch(&upload, 0, data[..half].to_vec()).await.status(), 204);
    let gc = client()
        .post(format!("{url}/v1/admin/gc?purge=true"))
        .bearer_auth(admin)
        .send()
        .await
        .unwrap();
    assert_eq!(gc.status(), 200, "{:?}", gc.text().await);
    let report: serde_json::Value = gc.json().await.unwrap();
    assert_eq!(report["candidates"], 0, "{report}");
    node.shutdown().await;

    let node = graviton::node::start_with(config(), Default::default())
        .await
        .unwrap();
    let url2 = node.base_url();
    let upload = upload.replace(&url, &url2);
    assert_eq!(offset_of(&upload).await, half as u64);
    let done = patch(&upload, half as u64, data[half..].to_vec()).await;
    assert_eq!(done.status(), 204);
    let key = BlobKey::of(&data).to_string();
    assert_eq!(
        header(done.headers(), "graviton-blob-key"),
        Some(key.as_str())
    );
    assert!(download(&url2, &key).await == data);
    node.shutdown().await;
}

/// The tus-js-client install (scripts/tus-client-deps): its node_modules directory.
fn tus_client_modules(test: &str) -> Option<String> {
    let root = env!("CARGO_MANIFEST_DIR");
    let deps = std::process::Command::new(format!("{root}/scripts/tus-client-deps"))
        .current_dir(root)
        .output()
        .expect("run scripts/tus-client-deps");
    if !deps.status.success() {
        support::missing_service(
            test,
            &format!(
                "tus-js-client could not be installed: {}",
                String::from_utf8_lossy(&deps.stderr)
            ),
        );
        return None;
    }
    Some(String::from_utf8_lossy(&deps.stdout).trim().to_string())
}

/// Run tests/tus_client/upload.cjs; its JSON line.
async fn run_tus_js(
    modules: &str,
    endpoint: &str,
    file: &std::path::Path,
    chunk: usize,
    stop_after: u32,
    resume: Option<&str>,
) -> serde_json::Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/tus_client/upload.cjs");
    let mut command = tokio::process::Command::new("node");
    command
        .arg(script)
        .arg(modules)
        .arg(endpoint)
        .arg(file)
        .arg(chunk.to_string())
        .arg(TENANT)
        .arg(stop_after.to_string());
    if let Some(url) = resume {
        command.arg(url);
    }
    let output = tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .expect("tus-js-client finished within 120 s")
        .expect("run node");
    assert!(
        output.status.success(),
        "tus-js-client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&output.stdout)))
}

#[tokio::test]
async fn tus_js_client_uploads_in_several_patches_byte_exact() {
    // Checks TUS-2 with a tus client this project did not write: tus-js-client uploads in
    // 512 KiB PATCHes, goes away after two, resumes from the server's offset, and the
    // blob equals a one-shot upload of the same bytes.
    let Some(modules) = tus_client_modules("tus_js_client") else {
        return;
    };
    let node = TestNode::start().await;
    let data = random_bytes((3 << 20) + 777, 31);
    let file = node.dir.path().join("upload.bin");
    std::fs::write(&file, &data).unwrap();
    let endpoint = format!("{}/v1/uploads", node.url);
    let chunk = 512 << 10;

    let first = run_tus_js(&modules, &endpoint, &file, chunk, 2, None).await;
    assert_eq!(first["aborted"], true, "{first}");
    let url = first["url"].as_str().unwrap().to_string();
    assert!(url.starts_with(&endpoint), "{url}");
    assert_eq!(offset_of(&url).await, 2 * chunk as u64);
    assert!(first["blobKey"].is_null());

    let second = run_tus_js(&modules, &endpoint, &file, chunk, 0, Some(&url)).await;
    assert_eq!(second["aborted"], false, "{second}");
    assert_eq!(second["url"], url);
    assert!(
        second["heads"].as_u64().unwrap() >= 1,
        "resumed with a HEAD: {second}"
    );
    let rest = data.len() - 2 * chunk;
    assert_eq!(
        second["patches"].as_u64().unwrap(),
        rest.div_ceil(chunk) as u64,
        "{second}"
    );
    let expected = BlobKey::of(&data);
    assert_eq!(second["blobKey"], expected.to_string());
    assert!(download(&node.url, &expected.to_string()).await == data);

    let other = TestNode::start().await;
    let response = client()
        .post(format!("{}/v1/blobs", other.url))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(
        manifest_blocks(&node, &expected),
        manifest_blocks(&other, &expected)
    );
}

/// A request that a well-behaved tus client retries: 503 with `Retry-After` (a shard in
/// motion, an owner being replaced).
async fn retrying(make: impl Fn() -> reqwest::RequestBuilder) -> reqwest::Response {
    for _ in 0..50 {
        let response = make().send().await.unwrap();
        if !(response.status() == 503 && response.headers().contains_key("retry-after")) {
            return response;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    make().send().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_forwards_to_the_owner_and_resumes_after_the_owner_is_killed() {
    // Checks TUS-1 and TUS-2 across nodes: created and patched through a non-owner
    // (forwarded, PATCH pre-flighted), then the owner is killed with kill -9, its shard
    // moves, and the client resumes through the other node to a byte-exact blob.
    use graviton::ids::{SessionId, SessionKey};
    use support::cluster::{NodeProcess, wait_converged};
    const SHARDS: u32 = 8;
    let Some(db) = support::TestDatabase::create("tus_cluster_owner_killed").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("tus-cluster-{}", support::unique_suffix());
    let db_url = db.url().to_string();
    let Some(mut nodes) = ["tus-a", "tus-b"]
        .iter()
        .map(|id| {
            NodeProcess::start_on_s3(
                "tus_cluster_owner_killed",
                dir.path(),
                id,
                &db_url,
                SHARDS,
                &prefix,
                "",
            )
        })
        .collect::<Option<Vec<NodeProcess>>>()
    else {
        return;
    };
    let refs: Vec<&NodeProcess> = nodes.iter().collect();
    wait_converged(
        &refs,
        &db_url,
        "both nodes ready and owning shards, none moving",
        |status| {
            status.unassigned_shards == 0
                && status.moving_shards == 0
                && status.nodes.iter().filter(|n| n.shards > 0).count() == 2
        },
    )
    .await;
    let status = graviton::cli::cluster_status(&db_url).await.unwrap();
    let owner_of = |status: &graviton::cli::ClusterStatus, key: &SessionKey| {
        support::cluster::owner_of(status, SHARDS, key).map(|o| o.to_string())
    };
    // A session owned by tus-a; the client talks to tus-b.
    let key = loop {
        let key = SessionKey {
            tenant: TENANT.parse().unwrap(),
            session: SessionId::new_random(),
        };
        if owner_of(&status, &key).as_deref() == Some("tus-a") {
            break key;
        }
    };
    let (a, b) = (nodes[0].url.clone(), nodes[1].url.clone());
    let data = random_bytes((3 << 20) + 99, 55);
    let created = retrying(|| {
        client()
            .post(format!("{b}/v1/uploads"))
            .header("tus-resumable", "1.0.0")
            .header("upload-length", data.len().to_string())
            .header("x-graviton-tenant-id", TENANT)
            .header("x-graviton-upload-session-id", key.session.to_string())
    })
    .await;
    assert_eq!(created.status(), 201, "{:?}", created.text().await);
    let location = header(created.headers(), "location").unwrap().to_string();
    assert_eq!(
        location,
        format!("/v1/uploads/{}.{}", key.tenant, key.session)
    );
    let first = (1 << 20) + 5;
    let part = |url: &str, offset: usize, bytes: Vec<u8>| {
        let url = format!("{url}{location}");
        let bytes = bytes::Bytes::from(bytes);
        async move {
            retrying(|| {
                client()
                    .patch(&url)
                    .header("tus-resumable", "1.0.0")
                    .header("content-type", OCTETS)
                    .header("upload-offset", offset.to_string())
                    .body(bytes.clone())
            })
            .await
        }
    };
    // Send data[from..to] as a tus client does: after a retryable failure (5xx with
    // Retry-After), HEAD for the offset the server kept and resume from there.
    let send_range = |url: String, from: usize, to: usize| {
        let data = &data;
        let location = &location;
        async move {
            let upload = format!("{url}{location}");
            let mut offset = from;
            for _ in 0..20 {
                let response = part(&url, offset, data[offset..to].to_vec()).await;
                let status = response.status().as_u16();
                if !(status >= 500 && response.headers().contains_key("retry-after")) {
                    return response;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                let head =
                    retrying(|| client().head(&upload).header("tus-resumable", "1.0.0")).await;
                offset = header(head.headers(), "upload-offset")
                    .and_then(|o| o.parse().ok())
                    .unwrap_or(offset);
            }
            panic!("the PATCH never went through");
        }
    };
    let patched = send_range(b.clone(), 0, first).await;
    assert_eq!(
        patched.status(),
        204,
        "{:?}\n--- tus-a:\n{}\n--- tus-b:\n{}",
        patched.text().await,
        nodes[0].log_text(),
        nodes[1].log_text()
    );
    assert_eq!(
        header(patched.headers(), "upload-offset"),
        Some(first.to_string().as_str())
    );
    // The owner's view, directly; and a wrong offset refused in the forwarded pre-flight.
    assert_eq!(offset_of(&format!("{a}{location}")).await, first as u64);
    let forwarded_head = retrying(|| {
        client()
            .head(format!("{b}{location}"))
            .header("tus-resumable", "1.0.0")
    })
    .await;
    assert_eq!(forwarded_head.status(), 200);
    assert_eq!(
        header(forwarded_head.headers(), "upload-offset"),
        Some(first.to_string().as_str())
    );
    assert_eq!(
        header(forwarded_head.headers(), "cache-control"),
        Some("no-store")
    );
    let wrong = part(&b, 7, vec![1; 10]).await;
    assert_eq!(wrong.status(), 409);
    assert_eq!(
        header(wrong.headers(), "upload-offset"),
        Some(first.to_string().as_str())
    );

    // kill -9 of the owner; its shards move to tus-b.
    nodes[0].kill9();
    let moved = support::wait_until(Duration::from_secs(60), || {
        let db_url = db_url.clone();
        async move {
            let status = graviton::cli::cluster_status(&db_url).await.unwrap();
            status.moving_shards == 0 && owner_of(&status, &key).as_deref() == Some("tus-b")
        }
    })
    .await;
    assert!(moved, "the shard never moved:\n{}", nodes[1].log_text());
    let upload = format!("{b}{location}");
    let head = retrying(|| client().head(&upload).header("tus-resumable", "1.0.0")).await;
    assert_eq!(head.status(), 200);
    let offset: usize = header(head.headers(), "upload-offset")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(offset, first, "the offset survived the owner");
    let done = send_range(b.clone(), offset, data.len()).await;
    assert_eq!(done.status(), 204, "{:?}", done.text().await);
    let expected = BlobKey::of(&data).to_string();
    assert_eq!(
        header(done.headers(), "graviton-blob-key"),
        Some(expected.as_str())
    );
    assert!(download(&b, &expected).await == data);
}

#[tokio::test]
async fn with_auth_on_the_upload_belongs_to_the_tokens_organization() {
    // The tenant rules of plain uploads: the token is checked before anything else, the
    // upload's tenant is the token's organization, and another organization's token is
    // refused (403) on every request for the upload.
    use jsonwebtoken::{Algorithm, EncodingKey, Header};
    const ISSUER: &str = "https://idp.test";
    let other = "5d1e2f30-4a5b-4c6d-8e7f-9a0b1c2d3e4f";
    let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let key = EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).unwrap();
    let mut jwk = jsonwebtoken::jwk::Jwk::from_encoding_key(&key, Algorithm::ES256).unwrap();
    jwk.common.key_id = Some("k1".into());
    let dir = tempfile::tempdir().unwrap();
    let jwks = dir.path().join("jwks.json");
    std::fs::write(
        &jwks,
        serde_json::to_string(&jsonwebtoken::jwk::JwkSet { keys: vec![jwk] }).unwrap(),
    )
    .unwrap();
    let token = |org: &str| {
        let now = jsonwebtoken::get_current_timestamp();
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some("k1".into());
        let claims = serde_json::json!({"iss": ISSUER, "aud": "graviton", "sub": "u",
            "org_id": org, "exp": now + 600, "iat": now});
        jsonwebtoken::encode(&header, &claims, &key).unwrap()
    };
    let node = TestNode::start_with(
        |c| {
            c.auth = graviton::auth::AuthConfig {
                enabled: true,
                issuers: vec![graviton::auth::IssuerConfig {
                    issuer: ISSUER.into(),
                    audience: vec!["graviton".into()],
                    jwks_file: Some(jwks.clone()),
                    ..Default::default()
                }],
            };
        },
        Default::default(),
    )
    .await;
    let post = |bearer: Option<String>| {
        let mut request = client()
            .post(format!("{}/v1/uploads", node.url))
            .header("tus-resumable", "1.0.0")
            .header("upload-length", "4");
        if let Some(bearer) = bearer {
            request = request.bearer_auth(bearer);
        }
        request.send()
    };
    assert_eq!(post(None).await.unwrap().status(), 401);
    let created = post(Some(token(TENANT))).await.unwrap();
    assert_eq!(created.status(), 201);
    let location = header(created.headers(), "location").unwrap().to_string();
    assert!(
        location.starts_with(&format!("/v1/uploads/{TENANT}.")),
        "{location}"
    );
    let upload = format!("{}{location}", node.url);
    let send = |method: reqwest::Method, bearer: Option<String>| {
        let mut request = client()
            .request(method.clone(), &upload)
            .header("tus-resumable", "1.0.0");
        if method == reqwest::Method::PATCH {
            request = request
                .header("content-type", OCTETS)
                .header("upload-offset", "0")
                .body(vec![1u8; 4]);
        }
        if let Some(bearer) = bearer {
            request = request.bearer_auth(bearer);
        }
        request.send()
    };
    use reqwest::Method;
    for method in [Method::HEAD, Method::PATCH, Method::DELETE] {
        assert_eq!(send(method.clone(), None).await.unwrap().status(), 401);
        let refused = send(method.clone(), Some(token(other))).await.unwrap();
        assert_eq!(refused.status(), 403, "{method}");
    }
    let done = send(Method::PATCH, Some(token(TENANT))).await.unwrap();
    assert_eq!(done.status(), 204);
    assert_eq!(
        header(done.headers(), "graviton-blob-key"),
        Some(BlobKey::of(&[1u8; 4]).to_string().as_str())
    );
}

#[tokio::test]
async fn the_postgres_ledger_keeps_the_same_contract() {
    // The cluster's ledger (sql/0009_uploads.sql): compare-and-set advance, blocks in
    // order, completion, expiry sweep, the collector's view.
    use bytes::Bytes;
    use graviton::cas::{BlockKey, BlockRef};
    use graviton::tus::UploadId;
    use graviton::upload::ledger::{Advance, PgLedger, RowVersion, UploadLedger, UploadRow};
    let Some(db) = support::TestDatabase::create("tus_pg_ledger").await else {
        return;
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(db.url())
        .await
        .unwrap();
    graviton::storage::pg::migrate(&pool).await.unwrap();
    let ledger = PgLedger::new(pool);
    let id = |n: u8| -> UploadId {
        format!("{TENANT}.0b8e2f3a-1c4d-4e5f-8a9b-0c1d2e3f4a{n:02x}")
            .parse()
            .unwrap()
    };
    let row = |expires_ms| UploadRow {
        length: 100,
        offset: 0,
        expires_ms,
        created_ms: 1,
        metadata: Some("k dg==".into()),
        block_count: 0,
        blob_key: None,
        generation: 41,
        chunker: Bytes::new(),
    };
    let at = |offset| RowVersion {
        generation: 41,
        offset,
    };
    let block = |n: u8, size| BlockRef {
        key: BlockKey([n; 32]),
        size,
    };
    let step = |offset, tail: &'static [u8], blocks| Advance {
        offset,
        tail: Bytes::from_static(tail),
        // Checks CAS-14: the saved chunker state travels with the tail.
        chunker: Bytes::copy_from_slice(&tail.len().to_le_bytes()),
        blocks,
        expires_ms: 5000,
        blob_key: None,
    };
    assert!(ledger.create(id(1), &row(1000), 10, None).await.unwrap());
    assert!(!ledger.create(id(1), &row(1000), 10, None).await.unwrap());
    assert!(
        ledger
            .advance(id(1), at(0), step(40, b"xy", vec![block(1, 38)]), None)
            .await
            .unwrap()
    );
    assert!(
        !ledger
            .advance(id(1), at(0), step(40, b"zz", vec![block(9, 38)]), None)
            .await
            .unwrap()
    );
    assert!(
        ledger
            .advance(
                id(1),
                at(40),
                step(90, b"abc", vec![block(2, 47), block(3, 1)]),
                None
            )
            .await
            .unwrap()
    );
    let (got, tail) = ledger.get(id(1)).await.unwrap().unwrap();
    assert_eq!((got.offset, got.block_count, got.expires_ms), (90, 3, 5000));
    assert_eq!(got.metadata.as_deref(), Some("k dg=="));
    assert_eq!(&tail[..], b"abc");
    assert_eq!(&got.chunker[..], &3usize.to_le_bytes()[..]);
    assert_eq!(
        ledger.blocks(id(1), at(90)).await.unwrap(),
        Some(vec![block(1, 38), block(2, 47), block(3, 1)])
    );
    assert_eq!(ledger.blocks(id(1), at(40)).await.unwrap(), None);
    let mut marked = Vec::new();
    ledger
        .for_each_block(&mut |k| marked.push(k))
        .await
        .unwrap();
    assert_eq!(marked.len(), 3);
    let key = BlobKey {
        hash: [7; 32],
        size: 100,
    };
    let done = Advance {
        blob_key: Some(key),
        ..step(100, b"", vec![])
    };
    assert!(ledger.advance(id(1), at(90), done, None).await.unwrap());
    let (got, tail) = ledger.get(id(1)).await.unwrap().unwrap();
    assert_eq!(got.blob_key, Some(key.to_string()));
    assert!(tail.is_empty() && ledger.blocks(id(1), at(100)).await.unwrap().is_none());
    // Expiry: swept with its blocks; an expired id may be created again.
    assert!(ledger.create(id(2), &row(100), 0, None).await.unwrap());
    assert!(
        ledger
            .advance(
                id(2),
                at(0),
                Advance {
                    expires_ms: 100,
                    ..step(5, b"12345", vec![block(4, 1)])
                },
                None
            )
            .await
            .unwrap()
    );
    let expired = ledger.expired(4000).await.unwrap();
    assert_eq!(expired, vec![id(2)], "only the expired one");
    assert_eq!(ledger.delete_expired(expired, 4000, None).await.unwrap(), 1);
    assert!(ledger.get(id(2)).await.unwrap().is_none());
    assert!(ledger.blocks(id(2), at(5)).await.unwrap().is_none());
    assert!(ledger.create(id(3), &row(100), 0, None).await.unwrap());
    assert!(ledger.create(id(3), &row(9000), 200, None).await.unwrap());
    assert!(ledger.delete(id(3), None).await.unwrap());
    assert!(!ledger.delete(id(3), None).await.unwrap());
    // Checks CAS-7: terminated and created again under the same id, the upload is another
    // generation; a PATCH that read the old one (same offset) gets neither its blocks nor
    // an advance.
    let old = |offset| RowVersion {
        generation: 7,
        offset,
    };
    let new = |offset| RowVersion {
        generation: 8,
        offset,
    };
    let open_row = |generation| UploadRow {
        generation,
        ..row(u64::MAX >> 2)
    };
    assert!(ledger.create(id(5), &open_row(7), 0, None).await.unwrap());
    assert!(
        ledger
            .advance(id(5), old(0), step(40, b"t", vec![block(1, 39)]), None)
            .await
            .unwrap()
    );
    assert!(ledger.delete(id(5), None).await.unwrap());
    assert!(ledger.create(id(5), &open_row(8), 0, None).await.unwrap());
    assert!(
        ledger
            .advance(id(5), new(0), step(40, b"t", vec![block(2, 39)]), None)
            .await
            .unwrap()
    );
    assert_eq!(ledger.blocks(id(5), old(40)).await.unwrap(), None);
    assert!(
        !ledger
            .advance(id(5), old(40), step(50, b"u", vec![block(3, 10)]), None)
            .await
            .unwrap()
    );
    assert_eq!(
        ledger.blocks(id(5), new(40)).await.unwrap(),
        Some(vec![block(2, 39)])
    );
    assert_eq!(ledger.get(id(5)).await.unwrap().unwrap().0.generation, 8);
}

/// POST a creation for a chosen session on `url`; returns the upload URL (absolute).
async fn create_for_session(url: &str, length: u64, session: &str) -> String {
    let response = client()
        .post(format!("{url}/v1/uploads"))
        .header("tus-resumable", "1.0.0")
        .header("upload-length", length.to_string())
        .header("x-graviton-tenant-id", TENANT)
        .header("x-graviton-upload-session-id", session)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201, "{:?}", response.text().await);
    let location = header(response.headers(), "location").unwrap();
    format!("{url}{location}")
}

async fn terminate(upload: &str) -> u16 {
    client()
        .delete(upload)
        .header("tus-resumable", "1.0.0")
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// Body bytes a node's ingest has read so far (`graviton_upload_bytes_total`).
fn upload_bytes_read(node: &TestNode) -> u64 {
    node.metrics_text()
        .lines()
        .find_map(|line| line.strip_prefix("graviton_upload_bytes_total "))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0)
}

/// One-shot upload; returns the key it answered.
async fn one_shot(url: &str, data: &[u8]) -> String {
    let response = client()
        .post(format!("{url}/v1/blobs"))
        .body(data.to_vec())
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    let body: serde_json::Value = response.json().await.unwrap();
    body["key"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_patch_whose_upload_was_deleted_commits_nothing() {
    // Checks CAS-7 and CAS-6: a tus DELETE that lands while the final PATCH streams its
    // body (tus-js-client's `abort(true)`) leaves no manifest under the whole key, so a
    // later one-shot upload of the same bytes stores them and they download byte-exact.
    // (Before the row version was checked, the final PATCH built a manifest of its own
    // blocks only under the real key: every later GET answered 500 corrupt.)
    let node = TestNode::start().await;
    let data = random_bytes(1_600_000, 31);
    let upload = create(&node.url, data.len() as u64).await;
    assert_eq!(
        patch(&upload, 0, data[..800_000].to_vec()).await.status(),
        204
    );
    let before = upload_bytes_read(&node);

    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(1);
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|chunk| (Ok::<_, std::io::Error>(bytes::Bytes::from(chunk)), rx))
    });
    let final_patch = tokio::spawn(
        client()
            .patch(&upload)
            .header("tus-resumable", "1.0.0")
            .header("content-type", OCTETS)
            .header("upload-offset", "800000")
            .header("content-length", "800000")
            .body(reqwest::Body::wrap_stream(body))
            .send(),
    );
    tx.send(data[800_000..1_200_000].to_vec()).await.unwrap();
    // The PATCH has read its row and is ingesting the body: the node counted its bytes.
    let reading = support::wait_until(Duration::from_secs(30), || {
        let read = upload_bytes_read(&node);
        async move { read >= before + 300_000 }
    })
    .await;
    assert!(reading, "the final PATCH never started reading its body");
    assert_eq!(
        terminate(&upload).await,
        204,
        "DELETE during the final PATCH"
    );
    tx.send(data[1_200_000..].to_vec()).await.unwrap();
    drop(tx);
    let answer = final_patch.await.unwrap().unwrap();
    assert_eq!(answer.status(), 404, "{:?}", answer.text().await);
    assert_eq!(
        node.manifest_count(),
        0,
        "a manifest was written for a gone upload"
    );

    let key = one_shot(&node.url, &data).await;
    assert_eq!(key, BlobKey::of(&data).to_string());
    let got = download(&node.url, &key).await;
    assert!(got == data, "downloaded bytes differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_upload_on_another_node_never_uses_the_old_hasher() {
    // Checks CAS-7 across nodes: two nodes share one ledger, one block store and one
    // manifest store (as cluster nodes share PostgreSQL and S3) and each keeps its own
    // hasher cache. Node A hashes part P1; the upload is terminated and created again
    // under the same id through node B, which takes it to the same offset with other
    // bytes Q1; the final part Q2 runs on A. The key must be BLAKE3(Q1‖Q2), the bytes
    // the blob holds, never BLAKE3(P1‖Q2) (which would poison that key for every tenant).
    let a = TestNode::start().await;
    let state = a.node.as_ref().unwrap().state().clone();
    let b = TestNode::start_with(
        |_| {},
        graviton::node::NodeOptions {
            blocks: Some(state.blocks.clone()),
            manifests: Some(state.manifests.clone()),
            ledger: Some(state.uploads.ledger().clone()),
        },
    )
    .await;
    let p1 = random_bytes(700_000, 41);
    let q1 = random_bytes(700_000, 42);
    let q2 = random_bytes(300_000, 43);
    let length = (p1.len() + q2.len()) as u64;
    let session = graviton::ids::SessionId::new_random().to_string();

    let on_a = create_for_session(&a.url, length, &session).await;
    assert_eq!(patch(&on_a, 0, p1.clone()).await.status(), 204);
    let on_b = on_a.replace(&a.url, &b.url);
    assert_eq!(terminate(&on_b).await, 204);
    let again = create_for_session(&b.url, length, &session).await;
    assert_eq!(again, on_b, "the same session names the same upload");
    assert_eq!(patch(&on_b, 0, q1.clone()).await.status(), 204);

    let last = patch(&on_a, p1.len() as u64, q2.clone()).await;
    assert_eq!(last.status(), 204, "{:?}", last.text().await);
    let held = [q1.clone(), q2.clone()].concat();
    let key = header(last.headers(), "graviton-blob-key")
        .unwrap()
        .to_string();
    assert_eq!(
        key,
        BlobKey::of(&held).to_string(),
        "the key names other bytes"
    );
    assert!(download(&a.url, &key).await == held);

    // The bytes of the first upload, uploaded in one shot anywhere, are their own blob.
    let poisoned = [p1, q2].concat();
    let other = one_shot(&b.url, &poisoned).await;
    assert_eq!(other, BlobKey::of(&poisoned).to_string());
    assert!(download(&b.url, &other).await == poisoned);
}

/// The cluster database of the two-node tests below: migrated, its placement table
/// bootstrapped for `shard_count` shards with nodes `node-a` and `node-b` registered.
async fn placement_db(db: &support::TestDatabase, shard_count: u32) -> sqlx::PgPool {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(db.url())
        .await
        .unwrap();
    graviton::storage::pg::migrate(&pool).await.unwrap();
    graviton::storage::pg::PlacementStore::new(pool.clone())
        .bootstrap(shard_count)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO placement_nodes (id, public_addr, internal_addr, control_addr, version, state)
         VALUES ('node-a', '', '', '', 't', 'active'), ('node-b', '', '', '', 't', 'active')",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool
}

/// Give every shard to `owner` in the placement table. The nodes here are embedded nodes
/// whose own tables say they own every shard at epoch 0 (a node that has not yet learnt
/// of a move), so the move changes the owner and keeps the epoch: the fence compares
/// both, and the epoch half is checked by `pg_manifest::a_fenced_commit_is_refused_once_the_shard_moved`.
async fn give_every_shard_to(pool: &sqlx::PgPool, owner: &str) {
    sqlx::query("UPDATE placement_shards SET node_id = $1, epoch = 0")
        .bind(owner)
        .execute(pool)
        .await
        .unwrap();
}

/// Two embedded nodes `node-a` and `node-b` sharing one PostgreSQL ledger (over `pool`),
/// one block store and one manifest store (a's), as cluster nodes share PostgreSQL and S3.
async fn two_nodes_on_one_ledger(
    pool: &sqlx::PgPool,
    tweak: impl Fn(&mut Config) + Copy,
) -> (TestNode, TestNode) {
    let ledger: std::sync::Arc<dyn graviton::upload::ledger::UploadLedger> =
        std::sync::Arc::new(graviton::upload::ledger::PgLedger::new(pool.clone()));
    let a = TestNode::start_with(
        |config| {
            config.node.id = "node-a".into();
            tweak(config);
        },
        graviton::node::NodeOptions {
            ledger: Some(ledger.clone()),
            ..Default::default()
        },
    )
    .await;
    let state = a.node.as_ref().unwrap().state().clone();
    let b = TestNode::start_with(
        |config| {
            config.node.id = "node-b".into();
            tweak(config);
        },
        graviton::node::NodeOptions {
            blocks: Some(state.blocks.clone()),
            manifests: Some(state.manifests.clone()),
            ledger: Some(ledger),
        },
    )
    .await;
    (a, b)
}

/// The upload id of a tus upload URL.
fn upload_id_of(upload: &str) -> graviton::tus::UploadId {
    upload.rsplit('/').next().unwrap().parse().unwrap()
}

/// Status, `code` and `Retry-After` of an answer.
async fn refusal(response: reqwest::Response) -> (u16, String, Option<String>) {
    let status = response.status().as_u16();
    let retry = header(response.headers(), "retry-after").map(str::to_string);
    let body: serde_json::Value = response.json().await.unwrap_or_default();
    (
        status,
        body["error"].as_str().unwrap_or_default().to_string(),
        retry,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_out_owner_cannot_create_advance_or_delete_an_upload() {
    // Checks TUS-5: every ledger write of the tus path carries the writer's fence. Node A
    // created an upload and took it to 300 kB; the shard then moved to node B, but A has
    // not learnt of it yet (its own table still says it owns every shard). A's PATCH,
    // DELETE and creation are refused with the retryable 503 `shard_moved` and the rows
    // are untouched; B, the owner, completes the upload byte-exact.
    let Some(db) = support::TestDatabase::create("tus_fenced_out_owner").await else {
        return;
    };
    let shards = Config::default().cluster.shard_count;
    let pool = placement_db(&db, shards).await;
    give_every_shard_to(&pool, "node-a").await;
    let (a, b) = two_nodes_on_one_ledger(&pool, |_| {}).await;
    let ledger = graviton::upload::ledger::PgLedger::new(pool.clone());
    use graviton::upload::ledger::UploadLedger;

    let data = random_bytes(900_000, 51);
    let session = graviton::ids::SessionId::new_random().to_string();
    let on_a = create_for_session(&a.url, data.len() as u64, &session).await;
    assert_eq!(
        patch(&on_a, 0, data[..300_000].to_vec()).await.status(),
        204
    );
    let id = upload_id_of(&on_a);
    let (before, before_tail) = ledger.get(id).await.unwrap().unwrap();
    assert_eq!(before.offset, 300_000);

    give_every_shard_to(&pool, "node-b").await;
    let shard_moved = |what: &str, (status, code, retry): (u16, String, Option<String>)| {
        assert_eq!(
            (status, code.as_str()),
            (503, "shard_moved"),
            "{what} on the fenced-out node"
        );
        assert!(retry.is_some(), "{what}: a 503 says when to retry");
    };
    shard_moved(
        "a PATCH",
        refusal(patch(&on_a, 300_000, data[300_000..600_000].to_vec()).await).await,
    );
    let deleted = client()
        .delete(&on_a)
        .header("tus-resumable", "1.0.0")
        .send()
        .await
        .unwrap();
    shard_moved("a DELETE", refusal(deleted).await);
    let (after, after_tail) = ledger.get(id).await.unwrap().unwrap();
    assert_eq!(after, before, "the row moved under a fenced-out writer");
    assert_eq!(after_tail, before_tail);

    let other = graviton::ids::SessionId::new_random().to_string();
    let created = client()
        .post(format!("{}/v1/uploads", a.url))
        .header("tus-resumable", "1.0.0")
        .header("upload-length", "1000")
        .header("x-graviton-tenant-id", TENANT)
        .header("x-graviton-upload-session-id", &other)
        .send()
        .await
        .unwrap();
    shard_moved("a creation", refusal(created).await);
    let other_id: graviton::tus::UploadId = format!("{TENANT}.{other}").parse().unwrap();
    assert!(ledger.get(other_id).await.unwrap().is_none(), "row created");

    // The owner resumes where the row says and completes the upload.
    let on_b = on_a.replace(&a.url, &b.url);
    assert_eq!(offset_of(&on_b).await, 300_000);
    let last = patch(&on_b, 300_000, data[300_000..].to_vec()).await;
    assert_eq!(last.status(), 204, "{:?}", last.text().await);
    let key = header(last.headers(), "graviton-blob-key")
        .unwrap()
        .to_string();
    assert_eq!(key, BlobKey::of(&data).to_string());
    assert!(download(&b.url, &key).await == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_sweeps_an_upload_on_its_own_clock() {
    // Checks TUS-6: every node of a cluster sweeps the shared ledger, each on its own
    // clock; only the owner of an upload's shard removes it. Node B's clock runs two days
    // ahead (its sweep is called with that time): it leaves A's upload alone, and A's
    // sweep at the same instant removes it. After the shard moves to B, B's sweep does.
    let Some(db) = support::TestDatabase::create("tus_owner_sweeps").await else {
        return;
    };
    let shards = Config::default().cluster.shard_count;
    let pool = placement_db(&db, shards).await;
    give_every_shard_to(&pool, "node-a").await;
    let (a, b) = two_nodes_on_one_ledger(&pool, |_| {}).await;
    let uploads = |node: &TestNode| node.node.as_ref().unwrap().state().uploads.clone();
    let ahead = graviton::tus::now_ms() + 48 * 3_600_000;

    let first = create(&a.url, 500).await;
    assert_eq!(patch(&first, 0, vec![7; 200]).await.status(), 204);
    assert_eq!(uploads(&b).sweep_expired_at(ahead).await.unwrap(), 0);
    assert_eq!(
        offset_of(&first).await,
        200,
        "swept by a node that does not own it"
    );
    assert_eq!(uploads(&a).sweep_expired_at(ahead).await.unwrap(), 1);
    assert_eq!(head(&first).await.status(), 404);

    let second = create(&a.url, 500).await;
    give_every_shard_to(&pool, "node-b").await;
    assert_eq!(uploads(&a).sweep_expired_at(ahead).await.unwrap(), 0);
    assert_eq!(uploads(&b).sweep_expired_at(ahead).await.unwrap(), 1);
    assert_eq!(head(&second.replace(&a.url, &b.url)).await.status(), 404);
}
