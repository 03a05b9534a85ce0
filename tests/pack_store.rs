//! The pack store through the HTTP API and a real `graviton serve` process: deletion and
//! collection, kill -9 during an upload, verify after damage.

mod support;

use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use graviton::config::{Config, HumanDuration, Secret};
use graviton::node::NodeOptions;
use support::client;
use support::node::{TestNode, pack_files, random_bytes};
use support::process::{BIN, Graviton};

const ADMIN_TOKEN: &str = "admin-token-for-pack-tests-0123";

/// Wait until the wall clock, in the whole milliseconds the collector compares, has moved
/// past its reading now: whatever was written before this call is then strictly older
/// than `min_age = 0` (an observable state of the clock, not a guessed sleep).
async fn wait_for_the_next_millisecond() {
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis()
    };
    let start = now_ms();
    while now_ms() <= start {
        tokio::task::yield_now().await;
    }
}

/// Total size of the pack files under `packs` (sealed packs only, not spool files).
fn pack_bytes(packs: &std::path::Path) -> u64 {
    pack_files(packs)
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum()
}

async fn upload(url: &str, data: Vec<u8>) -> serde_json::Value {
    let response = client()
        .post(format!("{url}/v1/blobs"))
        .body(data)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    response.json().await.unwrap()
}

// Checks STO-6.
#[tokio::test]
async fn delete_removes_the_manifest_and_gc_reclaims_only_unreferenced_packs() {
    let node = TestNode::start_with(
        |config: &mut Config| {
            config.admin.token = Some(Secret::new(ADMIN_TOKEN));
            // The pack store's durability path (syncs of packs, directories, index,
            // manifests) runs here too: `Config::for_test` turns it off.
            config.storage.fsync = true;
            config.storage.gc.min_age = HumanDuration(Duration::ZERO);
            config.storage.gc.retention = HumanDuration(Duration::ZERO);
        },
        NodeOptions::default(),
    )
    .await;
    let (a, b) = (random_bytes(3 << 20, 1), random_bytes(3 << 20, 2));
    let key_a = upload(&node.url, a).await["key"]
        .as_str()
        .unwrap()
        .to_string();
    let key_b = upload(&node.url, b.clone()).await["key"]
        .as_str()
        .unwrap()
        .to_string();
    let blob = |key: &str| format!("{}/v1/blobs/{key}", node.url);

    // admin only; checked before anything else
    let response = client().delete(blob(&key_a)).send().await.unwrap();
    assert_eq!(response.status(), 401);
    let response = client()
        .delete(blob(&key_a))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    let response = client()
        .delete(blob(&key_a))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    assert_eq!(
        client().get(blob(&key_a)).send().await.unwrap().status(),
        404
    );
    let bad = client()
        .delete(blob("not-a-key"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);

    let blocks_before = node.block_count();
    let packs_dir = node.dir.path().join("packs");
    let bytes_before = pack_bytes(&packs_dir);
    wait_for_the_next_millisecond().await;
    let gc = |dry: bool| {
        client()
            .post(format!("{}/v1/admin/gc?dry_run={dry}&purge=true", node.url))
            .bearer_auth(ADMIN_TOKEN)
            .send()
    };
    let dry: serde_json::Value = gc(true).await.unwrap().json().await.unwrap();
    assert!(dry["candidates"].as_u64().unwrap() > 0, "{dry}");
    assert_eq!(
        node.block_count(),
        blocks_before,
        "a dry run changes nothing"
    );
    let first: serde_json::Value = gc(false).await.unwrap().json().await.unwrap();
    assert_eq!(first["packs_retired"], 1, "{first}");
    wait_for_the_next_millisecond().await;
    let second: serde_json::Value = gc(false).await.unwrap().json().await.unwrap();
    assert_eq!(second["packs_deleted"], 1, "{second}");
    assert!(node.block_count() < blocks_before);
    // The counters hold what the two real runs reported (the dry run counts nothing), and
    // the bytes reclaimed are the bytes that left the disk.
    let reported = |field: &str| first[field].as_u64().unwrap() + second[field].as_u64().unwrap();
    let metrics = node.metrics_text();
    let metric = |series: &str| support::metrics::count(&metrics, series);
    assert_eq!(metric("graviton_gc_runs_total"), Some(2), "{metrics}");
    assert_eq!(
        metric("graviton_gc_packs_rewritten_total"),
        Some(reported("packs_rewritten")),
        "{metrics}"
    );
    let reclaimed = reported("bytes_reclaimed");
    assert!(reclaimed > 0, "{first} {second}");
    assert_eq!(
        metric("graviton_gc_bytes_reclaimed_total"),
        Some(reclaimed),
        "{metrics}"
    );
    assert_eq!(
        bytes_before - pack_bytes(&packs_dir),
        reclaimed,
        "the reclaimed bytes left the disk"
    );
    let body = client()
        .get(blob(&key_b))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(body[..] == b[..], "the live blob survives byte-exact");
}

/// `graviton serve` on the data directory `dir` with fsync on, its log in `logs`.
fn serve(dir: &std::path::Path, logs: &std::path::Path) -> Graviton {
    Graviton::serve_listen(logs.join("serve.log"), |command| {
        command
            .arg("--data-dir")
            .arg(dir)
            .env("GRAVITON_STORAGE__FSYNC", "true")
            .env("GRAVITON_STORAGE__GC__MIN_AGE", "0s");
    })
}

// Checks STO-7.
#[tokio::test]
async fn kill_9_mid_upload_loses_no_acknowledged_blob_and_shows_no_partial_one() {
    let dir = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut node = serve(dir.path(), logs.path());
    node.ready(Duration::from_secs(20)).await;
    let (url, port) = (node.url.clone(), node.port());
    let acked = random_bytes(6 << 20, 3);
    let key = upload(&url, acked.clone()).await["key"]
        .as_str()
        .unwrap()
        .to_string();

    // Half of a second upload, then kill -9 while the server holds its open pack.
    let partial = random_bytes(8 << 20, 4);
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let head = format!(
        "POST /v1/blobs HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        partial.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&partial[..5 << 20]).unwrap();
    // Kill only once the server is writing the upload's open pack: its spool file holds
    // at least one 1 MiB stage of the upload's blocks (the rest of what was sent waits in
    // the pipeline's queues and the chunker, or in the socket buffers).
    let spool = dir.path().join("packs").join("tmp");
    let spooled = || {
        std::fs::read_dir(&spool)
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum::<u64>()
            })
            .unwrap_or(0)
    };
    support::eventually(
        Duration::from_secs(30),
        "the upload's spool file holds a stage of its blocks",
        || spooled() >= 1 << 20,
    )
    .await;
    eprintln!("killed with {} bytes in the spool", spooled());
    node.kill9();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    assert!(
        !String::from_utf8_lossy(&rest).contains("201"),
        "never acknowledged"
    );

    node.restart();
    node.ready(Duration::from_secs(20)).await;
    let body = client()
        .get(format!("{url}/v1/blobs/{key}"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(
        body[..] == acked[..],
        "acknowledged blob byte-exact after kill -9"
    );
    // No partial blob: neither the bytes that arrived nor the whole content have a key,
    // and the only manifest on disk is the acknowledged one.
    for content in [&partial[..5 << 20], &partial[..]] {
        let partial_key = graviton::cas::BlobKey::of(content).to_string();
        let missing = client()
            .get(format!("{url}/v1/blobs/{partial_key}"))
            .send()
            .await
            .unwrap();
        assert_eq!(missing.status(), 404);
    }
    assert_eq!(
        support::node::count_files(&dir.path().join("manifests")),
        1,
        "only the acknowledged upload has a manifest"
    );
    // the same upload succeeds after the restart
    upload(&url, partial.clone()).await;
    node.kill9();

    // offline tools on the stopped node: verify is clean, gc removes the dead spool file
    let verify = Command::new(BIN)
        .args(["verify"])
        .env("GRAVITON_STORAGE__DATA_DIR", dir.path())
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "{}",
        String::from_utf8_lossy(&verify.stdout)
    );
    let gc = Command::new(BIN)
        .args(["gc", "--purge"])
        .env("GRAVITON_STORAGE__DATA_DIR", dir.path())
        .env("GRAVITON_STORAGE__GC__MIN_AGE", "0s")
        .output()
        .unwrap();
    assert!(
        gc.status.success(),
        "{}",
        String::from_utf8_lossy(&gc.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&gc.stdout).unwrap();
    assert_eq!(
        report["candidates"], 0,
        "every indexed block is referenced: {report}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path().join("packs").join("tmp"))
            .unwrap()
            .count(),
        0,
        "the killed upload's spool file is collected"
    );

    // damage a pack: verify fails loudly, naming it
    let pack = pack_files(&dir.path().join("packs"))[0].clone();
    let mut bytes = std::fs::read(&pack).unwrap();
    bytes[1000] ^= 0x55;
    std::fs::write(&pack, &bytes).unwrap();
    let verify = Command::new(BIN)
        .args(["verify"])
        .env("GRAVITON_STORAGE__DATA_DIR", dir.path())
        .output()
        .unwrap();
    assert_eq!(verify.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&verify.stdout).unwrap();
    assert_eq!(report["damaged"].as_array().unwrap().len(), 1, "{report}");
}
