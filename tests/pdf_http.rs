//! PDF-aware ingest over HTTP with real PDFs (docs/api.md, "PDF bodies"; docs/storage.md):
//! resumable (tus) uploads resume the PDF-aware chunker at their last cut and give the
//! one-shot upload's blocks; the Content-Type rules refuse a contradicted type on tus
//! too, storing nothing; and every real PDF (encrypted, PDF 2.0, linearized, object
//! streams, scanned, truncated, corrupted) is stored byte-exact, or refused with 422 and
//! nothing stored when `[ingest.pdf] unsupported = "reject"`.

mod support;

use graviton::cas::BlobKey;
use graviton::config::{ByteSize, Config};
use reqwest::header::HeaderMap;
use support::node::{TestNode, random_bytes};

const TENANT: &str = "6f1c1a8e-5d0b-4c8e-9f55-3f2a8f0e7a11";
const OCTETS: &str = "application/offset+octet-stream";
/// `filetype` values in `Upload-Metadata` (base64 of the media type).
const FILETYPE_PDF: &str = "filetype YXBwbGljYXRpb24vcGRm";
const FILETYPE_PNG: &str = "filetype aW1hZ2UvcG5n";
const PDF_ALGORITHM: &str = "pdf-objects-v1+fastcdc-2020-v5.0.0";

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn fixture(name: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/pdf")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

/// POST a tus creation; the upload URL.
async fn create(url: &str, length: u64, metadata: Option<&str>) -> String {
    let mut request = client()
        .post(format!("{url}/v1/uploads"))
        .header("tus-resumable", "1.0.0")
        .header("upload-length", length.to_string())
        .header("x-graviton-tenant-id", TENANT);
    if let Some(metadata) = metadata {
        request = request.header("upload-metadata", metadata);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 201, "{:?}", response.text().await);
    format!("{url}{}", header(response.headers(), "location").unwrap())
}

async fn patch(upload: &str, offset: u64, data: &[u8]) -> reqwest::Response {
    client()
        .patch(upload)
        .header("tus-resumable", "1.0.0")
        .header("content-type", OCTETS)
        .header("upload-offset", offset.to_string())
        .body(data.to_vec())
        .send()
        .await
        .unwrap()
}

async fn offset_of(upload: &str) -> u64 {
    let response = client()
        .head(upload)
        .header("tus-resumable", "1.0.0")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    header(response.headers(), "upload-offset")
        .unwrap()
        .parse()
        .unwrap()
}

/// GET a blob: its status and body.
async fn get(url: &str, key: &str) -> (u16, Vec<u8>) {
    let response = client()
        .get(format!("{url}/v1/blobs/{key}"))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.bytes().await.unwrap().to_vec())
}

/// One-shot `POST /v1/blobs`: status and JSON answer.
async fn post(url: &str, body: &[u8], content_type: Option<&str>) -> (u16, serde_json::Value) {
    let mut request = client().post(format!("{url}/v1/blobs")).body(body.to_vec());
    if let Some(value) = content_type {
        request = request.header("content-type", value);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or_default())
}

/// A blob's manifest on a node (its manifest file).
fn manifest(dir: &std::path::Path, key: &BlobKey) -> serde_json::Value {
    let hex = key.to_string();
    let hash = hex.split(':').nth(1).unwrap().to_string();
    let path = dir
        .join("manifests")
        .join(&hash[..2])
        .join(format!("{hash}-{}.json", key.size));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap()
}

/// Small PDF block sizes (16 KiB target, 32 KiB largest block): many cuts, and so many
/// saved states between PATCHes, in a file of a few hundred KiB.
fn small_blocks(config: &mut Config) {
    config.ingest.pdf.target = ByteSize::kib(16);
    config.ingest.pdf.max = ByteSize::kib(32);
}

/// Part boundaries: `n` pseudo-random ones in `1..len` (sorted, deduplicated).
fn splits(len: usize, n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed | 1;
    let mut out: Vec<usize> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            1 + (state as usize) % (len - 1)
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Upload `data` through tus in parts ending at `bounds`; returns the blob key answered.
async fn upload_in_parts(
    url: &str,
    data: &[u8],
    metadata: Option<&str>,
    bounds: &[usize],
) -> String {
    let upload = create(url, data.len() as u64, metadata).await;
    let mut offset = 0usize;
    for &end in bounds.iter().chain([&data.len()]) {
        let response = patch(&upload, offset as u64, &data[offset..end]).await;
        assert_eq!(response.status(), 204, "{:?}", response.text().await);
        offset = end;
        assert_eq!(offset_of(&upload).await, offset as u64);
        if offset == data.len() {
            return header(response.headers(), "graviton-blob-key")
                .expect("final PATCH names the key")
                .to_string();
        }
    }
    unreachable!("the last bound is the length")
}

#[tokio::test]
async fn tus_parts_resume_the_pdf_chunker_and_give_the_one_shot_blocks() {
    // Checks CAS-14 and TUS-2 with real PDFs over HTTP: a PDF uploaded through tus in
    // parts split anywhere (inside image streams, dictionaries and strings, and a first
    // part shorter than the signature), declared by `filetype` or only by its first
    // bytes, has the key, the blocks and the chunker of a one-shot upload, and downloads
    // byte-exact.
    let scanned = fixture("scanned.pdf");
    let mut updated = scanned.clone();
    updated.extend_from_slice(&fixture("linearized.pdf"));
    for small in [false, true] {
        let tweak = |config: &mut Config| {
            if small {
                small_blocks(config)
            }
        };
        let node = TestNode::start_with(tweak, Default::default()).await;
        let reference = TestNode::start_with(tweak, Default::default()).await;
        for (name, data) in [("scanned", &scanned), ("scanned+linearized", &updated)] {
            let key = BlobKey::of(data);
            let (status, receipt) = post(&reference.url, data, Some("application/pdf")).await;
            assert_eq!(status, 201, "{receipt}");
            assert_eq!(receipt["chunker"], "pdf");
            let one_shot = manifest(reference.dir.path(), &key);
            assert_eq!(one_shot["chunking"]["algorithm"], PDF_ALGORITHM);
            let mut bound_sets = vec![vec![3usize, 4, 5, 200_000], vec![data.len() - 1]];
            for seed in 1..=3 {
                bound_sets.push(splits(data.len(), 6, seed * 7919));
            }
            for (i, bounds) in bound_sets.iter().enumerate() {
                let metadata = (i % 2 == 0).then_some(FILETYPE_PDF);
                let answered = upload_in_parts(&node.url, data, metadata, bounds).await;
                assert_eq!(answered, key.to_string(), "{name} {bounds:?}");
                let resumed = manifest(node.dir.path(), &key);
                assert_eq!(
                    resumed["blocks"], one_shot["blocks"],
                    "{name}, small={small}, parts ending at {bounds:?}"
                );
                assert_eq!(resumed["chunking"], one_shot["chunking"]);
                let (status, got) = get(&node.url, &key.to_string()).await;
                assert_eq!(status, 200);
                assert!(got == *data, "{name}: downloaded bytes differ");
            }
        }
        let metrics = node.metrics_text();
        assert!(
            metrics.contains("graviton_ingests_by_chunker_total{kind=\"pdf\"} 10"),
            "{metrics}"
        );
    }
}

#[tokio::test]
async fn a_tus_pdf_resumes_after_a_restart_from_the_saved_state() {
    // Checks CAS-14: the chunker state lives in the ledger row, not in the process. A
    // node restarted between two PATCHes of a PDF (small blocks: cuts were made and a
    // large stream's data is open at the boundary) finishes with the one-shot blocks.
    let data = fixture("scanned.pdf");
    let key = BlobKey::of(&data);
    let dir = tempfile::tempdir().unwrap();
    let config = || {
        let mut config = Config::for_test(dir.path());
        small_blocks(&mut config);
        config
    };
    let node = graviton::node::start_with(config(), Default::default())
        .await
        .unwrap();
    let url = node.base_url();
    let upload = create(&url, data.len() as u64, Some(FILETYPE_PDF)).await;
    let half = 150_001;
    assert_eq!(patch(&upload, 0, &data[..half]).await.status(), 204);
    node.shutdown().await;
    let node = graviton::node::start_with(config(), Default::default())
        .await
        .unwrap();
    let url2 = node.base_url();
    let upload = upload.replace(&url, &url2);
    assert_eq!(offset_of(&upload).await, half as u64);
    let done = patch(&upload, half as u64, &data[half..]).await;
    assert_eq!(done.status(), 204);
    assert_eq!(
        header(done.headers(), "graviton-blob-key"),
        Some(key.to_string().as_str())
    );
    let resumed = manifest(dir.path(), &key);
    node.shutdown().await;
    let reference = TestNode::start_with(small_blocks, Default::default()).await;
    assert_eq!(post(&reference.url, &data, None).await.0, 201);
    let one_shot = manifest(reference.dir.path(), &key);
    assert_eq!(resumed["blocks"], one_shot["blocks"]);
    assert_eq!(resumed["chunking"]["algorithm"], PDF_ALGORITHM);
}

#[tokio::test]
async fn tus_refuses_a_type_its_first_bytes_contradict_and_stores_nothing() {
    // Checks CAS-12 on tus: `filetype` application/pdf without the signature, or another
    // type with it, is 415 on the PATCH that brings the first bytes (also when an earlier
    // PATCH left the choice open), the offset stays, and nothing is stored.
    let node = TestNode::start().await;
    let pdf = fixture("scanned.pdf");
    let png = random_bytes(300_000, 3);
    for (data, metadata, first, code) in [
        (&png, FILETYPE_PDF, 0usize, "pdf_signature_missing"),
        (&pdf, FILETYPE_PNG, 0, "pdf_type_mismatch"),
        (&pdf, FILETYPE_PNG, 3, "pdf_type_mismatch"),
    ] {
        let upload = create(&node.url, data.len() as u64, Some(metadata)).await;
        if first > 0 {
            assert_eq!(patch(&upload, 0, &data[..first]).await.status(), 204);
        }
        let response = patch(&upload, first as u64, &data[first..]).await;
        assert_eq!(response.status(), 415);
        let answer: serde_json::Value = response.json().await.unwrap();
        assert_eq!(answer["error"], code, "{answer}");
        assert_eq!(offset_of(&upload).await, first as u64);
        assert_eq!(get(&node.url, &BlobKey::of(data).to_string()).await.0, 404);
    }
    assert_eq!(node.manifest_count(), 0);
    let metrics = node.metrics_text();
    for line in [
        "graviton_pdf_refusals_total{kind=\"type_mismatch\"} 2",
        "graviton_pdf_refusals_total{kind=\"signature_missing\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} not in {metrics}");
    }
    // The same bytes with a type they do not contradict are stored.
    let key = upload_in_parts(&node.url, &png, Some(FILETYPE_PNG), &[100_000]).await;
    assert_eq!(get(&node.url, &key).await.1, png);
}

/// `scanned.pdf` with the first direct `/Length` changed (same width), so the scanner
/// finds its stream's end by search (`stream_length_mismatch`).
fn corrupted() -> Vec<u8> {
    let mut data = fixture("scanned.pdf");
    let at = data
        .windows(8)
        .position(|w| w == b"/Length ")
        .expect("a /Length")
        + 8;
    let digit = &mut data[at];
    *digit = if *digit == b'1' { b'2' } else { b'1' };
    data
}

#[tokio::test]
async fn real_pdfs_are_stored_exactly_or_refused_cleanly() {
    // Checks CAS-13 over HTTP: real PDFs written by real tools (encrypted, PDF 2.0,
    // linearized, object streams, scanned images), a truncated one, a corrupted one and
    // a non-PDF body declared as PDF: stored byte-exact (the PDF-aware chunker where the
    // body is a PDF), or refused with nothing stored.
    let scanned = fixture("scanned.pdf");
    let truncated = scanned[..scanned.len() * 2 / 3].to_vec();
    let corrupt = corrupted();
    let fallback = TestNode::start().await;
    let strict = TestNode::start_with(
        |config| config.ingest.pdf.unsupported = graviton::config::PdfUnsupported::Reject,
        Default::default(),
    )
    .await;
    for name in [
        "encrypted.pdf",
        "pdf20.pdf",
        "linearized.pdf",
        "objstm.pdf",
        "scanned.pdf",
    ] {
        let data = fixture(name);
        for node in [&fallback, &strict] {
            let (status, receipt) = post(&node.url, &data, Some("application/pdf")).await;
            assert_eq!(status, 201, "{name}: {receipt}");
            assert_eq!(receipt["chunker"], "pdf", "{name}");
            let (status, got) = get(&node.url, receipt["key"].as_str().unwrap()).await;
            assert!(status == 200 && got == data, "{name}: not byte-exact");
        }
    }
    // Truncated and corrupted: stored exactly by default, refused when strict.
    for (what, data) in [("truncated", &truncated), ("corrupted", &corrupt)] {
        let (status, receipt) = post(&fallback.url, data, Some("application/pdf")).await;
        assert_eq!(status, 201, "{what}: {receipt}");
        let (status, got) = get(&fallback.url, receipt["key"].as_str().unwrap()).await;
        assert!(status == 200 && got == *data, "{what}: not byte-exact");
        let before = strict.manifest_count();
        let (status, answer) = post(&strict.url, data, None).await;
        assert_eq!(status, 422, "{what}: {answer}");
        assert_eq!(answer["error"], "pdf_unsupported");
        // The same refusal at the final PATCH of a resumable upload.
        let upload = create(&strict.url, data.len() as u64, Some(FILETYPE_PDF)).await;
        assert_eq!(patch(&upload, 0, &data[..100_000]).await.status(), 204);
        let last = patch(&upload, 100_000, &data[100_000..]).await;
        assert_eq!(last.status(), 422, "{what}");
        assert_eq!(offset_of(&upload).await, 100_000);
        assert_eq!(strict.manifest_count(), before, "{what}: stored nothing");
        let key = BlobKey::of(data).to_string();
        assert_eq!(get(&strict.url, &key).await.0, 404);
    }
    // A body that is not a PDF, declared as one.
    let text = b"Dear customer, this is not a PDF.\n".repeat(2000);
    for node in [&fallback, &strict] {
        let (status, answer) = post(&node.url, &text, Some("application/pdf")).await;
        assert_eq!(status, 415);
        assert_eq!(answer["error"], "pdf_signature_missing");
        assert_eq!(get(&node.url, &BlobKey::of(&text).to_string()).await.0, 404);
    }
}

#[tokio::test]
async fn graviton_put_shows_which_chunker_stored_the_blob() {
    // The CLI's `put` prints the receipt's chunker: `pdf` for a PDF file (its first bytes
    // select the PDF-aware chunker), `fastcdc` for anything else.
    let node = TestNode::start().await;
    let dir = tempfile::tempdir().unwrap();
    for (name, data, chunker) in [
        ("scan.pdf", fixture("scanned.pdf"), "chunker pdf,"),
        ("noise.bin", random_bytes(200_000, 5), "chunker fastcdc,"),
    ] {
        let file = dir.path().join(name);
        std::fs::write(&file, &data).unwrap();
        let url = node.url.clone();
        let put = tokio::task::spawn_blocking(move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_graviton"))
                .args(["put", "--server", &url])
                .arg(&file)
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        let stderr = String::from_utf8_lossy(&put.stderr);
        assert!(put.status.success(), "{stderr}");
        assert_eq!(
            String::from_utf8_lossy(&put.stdout).trim(),
            BlobKey::of(&data).to_string()
        );
        assert!(stderr.contains(chunker), "{name}: {stderr}");
    }
}
