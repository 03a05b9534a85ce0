//! The tus ledger under a power loss, with fsync on (TUS-7): a real `graviton serve`
//! process whose data directory (pack store, manifests and the redb ledger
//! `uploads.redb`) is on the LazyFS-style filesystem of `tests/support/lazyfs.rs`, which
//! drops every write a file has not fsynced on [`LazyFs::crash`]. The node is killed with
//! `kill -9` right after a PATCH answered 204, with another PATCH in flight, and the
//! filesystem then loses what was not synced. After a restart, `HEAD` gives the answered
//! offset, and the upload completes to the key of a one-shot upload of the same bytes,
//! which downloads byte-exact.
//!
//! (`Config::for_test` turns fsync off, so the in-process tus tests cannot show this; a
//! kill alone cannot either, since the page cache outlives the process.)

mod support;

use std::path::Path;
use std::time::Duration;

use graviton::cas::BlobKey;
use support::client;
use support::lazyfs::LazyFs;
use support::node::random_bytes;
use support::process::Graviton;

const TENANT: &str = "6f1c1a8e-5d0b-4c8e-9f55-3f2a8f0e7a11";
const OCTETS: &str = "application/offset+octet-stream";

/// A ready `graviton serve` on `data_dir` with fsync on (the default), its log
/// `<logs>/<name>.log`; killed when dropped.
async fn start(data_dir: &Path, logs: &Path, name: &str) -> Graviton {
    let mut node = Graviton::serve_listen(logs.join(format!("{name}.log")), |command| {
        command
            .env("GRAVITON_STORAGE__DATA_DIR", data_dir)
            .env("GRAVITON_STORAGE__FSYNC", "true")
            .env_remove("GRAVITON_TEST_PAUSE_AFTER");
    });
    node.ready(Duration::from_secs(60)).await;
    node
}

async fn patch(upload: &str, offset: usize, data: &[u8]) -> reqwest::Response {
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

fn offset_header(response: &reqwest::Response) -> Option<usize> {
    response
        .headers()
        .get("upload-offset")
        .and_then(|v| v.to_str().ok()?.parse().ok())
}

/// A PATCH on a raw socket that sends only `sent` of its `length` bytes: it is never
/// answered.
fn start_partial_patch(
    port: u16,
    path: &str,
    offset: usize,
    length: usize,
    bytes: &[u8],
) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let head = format!(
        "PATCH {path} HTTP/1.1\r\nHost: x\r\nTus-Resumable: 1.0.0\r\n\
         Content-Type: {OCTETS}\r\nUpload-Offset: {offset}\r\nContent-Length: {length}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(bytes).unwrap();
    stream
}

// Checks TUS-7 (and TUS-1 across a power loss).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answered_offset_survives_kill_9_and_the_upload_completes() {
    let test = "an_answered_offset_survives_kill_9_and_the_upload_completes";
    let Some(fs) = LazyFs::mount(test) else {
        return;
    };
    fs.check_locks();
    let logs = tempfile::tempdir().unwrap();
    let dir = fs.path().join("node");
    let node = start(&dir, logs.path(), "first").await;

    let data = random_bytes(1_500_000, 7_001);
    let created = client()
        .post(format!("{}/v1/uploads", node.url))
        .header("tus-resumable", "1.0.0")
        .header("upload-length", data.len().to_string())
        .header("x-graviton-tenant-id", TENANT)
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let path = created.headers()["location"].to_str().unwrap().to_string();
    let upload = format!("{}{path}", node.url);
    let first = patch(&upload, 0, &data[..400_000]).await;
    assert_eq!(first.status(), 204);
    let second = patch(&upload, 400_000, &data[400_000..900_000]).await;
    assert_eq!(second.status(), 204);
    assert_eq!(offset_header(&second), Some(900_000));
    // A third PATCH is on its way when the power goes: never answered, so its bytes may
    // be kept or not, but the answered offset must hold.
    let in_flight = start_partial_patch(
        node.port(),
        &path,
        900_000,
        300_000,
        &data[900_000..950_000],
    );

    let synced = fs.stats();
    let mut node = node;
    node.kill9();
    drop(in_flight);
    let dropped = fs.crash();
    eprintln!("{test}: {synced:?}; the crash dropped: {dropped:?}");
    assert!(synced.file_syncs() > 0, "the node synced files: {synced:?}");
    assert!(
        !dropped
            .iter()
            .any(|f| f.path.to_string_lossy().contains("uploads.redb")),
        "the ledger left answered writes unsynced: {dropped:?}"
    );

    let node = start(&dir, logs.path(), "after-crash").await;
    let upload = format!("{}{path}", node.url);
    let head = client()
        .head(&upload)
        .header("tus-resumable", "1.0.0")
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 200, "the upload is gone after the crash");
    let offset = offset_header(&head).unwrap();
    assert!(
        offset >= 900_000,
        "the answered offset 900000 was lost (HEAD says {offset}); node log:\n{}",
        node.log_text()
    );
    assert!(offset <= 950_000, "more than was sent: {offset}");

    let last = patch(&upload, offset, &data[offset..]).await;
    assert_eq!(last.status(), 204, "{:?}", last.text().await);
    let key = last.headers()["graviton-blob-key"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(key, BlobKey::of(&data).to_string());
    let one_shot = client()
        .post(format!("{}/v1/blobs", node.url))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert!(one_shot.status().is_success(), "{}", one_shot.status());
    let body: serde_json::Value = one_shot.json().await.unwrap();
    assert_eq!(
        body["key"],
        key.as_str(),
        "a one-shot upload names another key"
    );
    let got = client()
        .get(format!("{}/v1/blobs/{key}", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(got.status(), 200);
    assert!(got.bytes().await.unwrap() == data, "downloads other bytes");
}
