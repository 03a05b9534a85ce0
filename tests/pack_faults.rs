//! Fault tests of the pack store with real processes: `graviton gc` killed with SIGKILL
//! after each step of a collector run, and `graviton serve` killed at each durability
//! step of an upload. Each process is stopped at a known point by the test-only pause
//! hook (`GRAVITON_TEST_PAUSE_AFTER=<step>`, `src/storage/pack/pause.rs`): the process
//! logs `paused after <step>` and waits there; the test reads that line, then kills it.
//!
//! After every kill: every acknowledged blob downloads byte-exact, deleted and
//! unacknowledged blobs stay absent, the index is recovered on restart, the next collector
//! runs complete, `graviton verify` is clean, and no pack is left that the index does not
//! name (STO-7, STO-12).

mod support;

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::client;
use support::node::{pack_files, random_bytes};
use support::process::{BIN, Graviton};

const ADMIN_TOKEN: &str = "admin-token-for-pack-faults-0123";
const PAUSE: &str = "GRAVITON_TEST_PAUSE_AFTER";

/// The settings every process of these tests shares: fsync on, no grace period and no
/// retention (so one run after the crash finishes the work), compaction of any pack
/// under 90 % live.
fn settings(command: &mut Command, dir: &Path) {
    command
        .env("GRAVITON_STORAGE__DATA_DIR", dir)
        .env("GRAVITON_STORAGE__FSYNC", "true")
        .env("GRAVITON_STORAGE__GC__MIN_AGE", "0s")
        .env("GRAVITON_STORAGE__GC__RETENTION", "0s")
        .env("GRAVITON_STORAGE__GC__COMPACT_BELOW", "0.9")
        // A few blocks per write transaction: a run spans several quarantine and purge
        // batches, so a kill after the first leaves a partly quarantined (purged) store.
        .env("GRAVITON_STORAGE__GC__BATCH", "8")
        .env("GRAVITON_ADMIN__TOKEN", ADMIN_TOKEN)
        .env_remove(PAUSE);
}

/// A `graviton serve` on `dir` (its log `dir/serve.log`); with `pause`, it stops at
/// that step.
fn serve(dir: &Path, pause: Option<&str>) -> Graviton {
    Graviton::serve_listen(dir.join("serve.log"), |command| {
        settings(command, dir);
        if let Some(step) = pause {
            command.env(PAUSE, step);
        }
    })
}

async fn upload(url: &str, data: &[u8]) -> String {
    let response = client()
        .post(format!("{url}/v1/blobs"))
        .body(data.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let body: serde_json::Value = response.json().await.unwrap();
    body["key"].as_str().unwrap().to_string()
}

async fn delete(url: &str, key: &str) {
    support::delete_blob(url, key, ADMIN_TOKEN).await;
}

/// Send the head and all of `data` of an upload on a raw socket, without waiting for the
/// answer (the server pauses before it answers); returns the socket.
fn start_upload(port: u16, data: &[u8]) -> std::net::TcpStream {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let head = format!(
        "POST /v1/blobs HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        data.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(data).unwrap();
    stream
}

/// Whatever the server answered on `stream` before it died.
fn answer(mut stream: std::net::TcpStream) -> String {
    use std::io::Read;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    String::from_utf8_lossy(&rest).into_owned()
}

/// An offline command on the stopped node's directory (exit status and stdout).
fn offline(dir: &Path, args: &[&str]) -> (bool, serde_json::Value) {
    let mut command = Command::new(BIN);
    command.args(args);
    settings(&mut command, dir);
    let out = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() || args[0] == "verify",
        "graviton {args:?} failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = serde_json::from_str(&stdout).unwrap_or(serde_json::Value::Null);
    (out.status.success(), report)
}

/// Finish the collector's work after a crash and check what is left: two complete runs
/// (the second purges what the first retired), `verify` clean, and every pack file on
/// disk is one the index names.
fn collect_to_the_end(dir: &Path) {
    for _ in 0..2 {
        std::thread::sleep(Duration::from_millis(10));
        offline(dir, &["gc", "--purge"]);
    }
    let (clean, report) = offline(dir, &["verify"]);
    assert!(clean, "verify after the crash and two runs: {report}");
    assert_eq!(report["entries_affected"], 0, "{report}");
    assert_eq!(
        report["packs_checked"].as_u64().unwrap() as usize,
        pack_files(&dir.join("packs")).len(),
        "every pack left is indexed and live: {report}"
    );
    assert_eq!(
        std::fs::read_dir(dir.join("packs").join("tmp"))
            .unwrap()
            .count(),
        0,
        "no spool file is left"
    );
}

/// What the GC crash tests store before the crash.
struct Contents {
    keep: Vec<u8>,
    half: Vec<u8>,
    whole: Vec<u8>,
    gone: Vec<u8>,
    unacked: Vec<u8>,
}

impl Contents {
    fn new() -> Self {
        let whole = random_bytes(4 << 20, 2);
        Self {
            keep: random_bytes(2 << 20, 1),
            half: whole[..2 << 20].to_vec(),
            whole,
            gone: random_bytes(2 << 20, 3),
            unacked: random_bytes(1 << 20, 4),
        }
    }

    fn key(data: &[u8]) -> String {
        graviton::cas::BlobKey::of(data).to_string()
    }

    /// Acknowledged blobs are byte-exact; deleted and unacknowledged ones are absent.
    async fn check(&self, url: &str) {
        for live in [&self.keep, &self.half] {
            let (status, body) = support::download(url, &Self::key(live)).await;
            assert_eq!(status, 200);
            assert!(body == *live, "an acknowledged blob is byte-exact");
        }
        for absent in [&self.whole, &self.gone, &self.unacked] {
            assert_eq!(support::download(url, &Self::key(absent)).await.0, 404);
        }
    }
}

/// Store the contents: `keep` and `half` live; `whole` (which shares half its blocks with
/// `half`, so its pack is compacted) and `gone` deleted; `unacked` killed after its pack
/// was sealed and before the index commit (an orphan pack). Leaves the node stopped.
async fn prepare(dir: &Path, contents: &Contents) {
    let mut node = serve(dir, None);
    node.ready(Duration::from_secs(30)).await;
    let url = node.url.clone();
    upload(&url, &contents.keep).await;
    let whole = upload(&url, &contents.whole).await;
    upload(&url, &contents.half).await;
    let gone = upload(&url, &contents.gone).await;
    delete(&url, &whole).await;
    delete(&url, &gone).await;
    node.kill9();

    node.restart_with_env(&[(PAUSE, "pack directory synced")]);
    node.ready(Duration::from_secs(30)).await;
    let stream = start_upload(node.port(), &contents.unacked);
    node.wait_paused("pack directory synced");
    node.kill9();
    assert!(!answer(stream).contains("201"), "never acknowledged");
}

/// Kill `graviton gc --purge` after `step`, then check the store and finish the work.
async fn gc_killed_after(step: &str, purge_first: bool) {
    let dir = tempfile::tempdir().unwrap();
    let contents = Contents::new();
    prepare(dir.path(), &contents).await;
    if purge_first {
        // a first complete run retires what the crashed run will purge
        offline(dir.path(), &["gc"]);
        std::thread::sleep(Duration::from_millis(10));
    }

    let mut command = Command::new(BIN);
    command.args(["gc", "--purge"]);
    settings(&mut command, dir.path());
    command.env(PAUSE, step);
    let mut gc = Graviton::spawn(dir.path().join("gc.log"), command);
    gc.wait_paused(step);
    gc.kill9();

    // restart: the index is recovered and nothing acknowledged is lost
    let mut node = serve(dir.path(), None);
    node.ready(Duration::from_secs(30)).await;
    let url = node.url.clone();
    contents.check(&url).await;
    node.kill9();

    collect_to_the_end(dir.path());
    node.restart();
    node.ready(Duration::from_secs(30)).await;
    contents.check(&url).await;
    // the store still takes uploads, including of collected content
    let again = upload(&url, &contents.gone).await;
    assert!(support::download(&url, &again).await.1 == contents.gone);
    node.kill9();
}

// Checks STO-12.
#[tokio::test]
async fn gc_killed_after_mark() {
    gc_killed_after("gc mark", false).await;
}

// Checks STO-12.
#[tokio::test]
async fn gc_killed_after_select() {
    gc_killed_after("gc select", false).await;
}

// Checks STO-12.
#[tokio::test]
async fn gc_killed_after_mark_again() {
    gc_killed_after("gc mark again", false).await;
}

// Checks STO-12.
#[tokio::test]
async fn gc_killed_after_quarantine() {
    gc_killed_after("gc quarantine", false).await;
}

// Checks STO-12: killed after the first quarantine batch committed (the rest of the
// candidates still indexed).
#[tokio::test]
async fn gc_killed_after_the_first_quarantine_batch() {
    gc_killed_after("gc quarantine batch", false).await;
}

// Checks STO-12: the rewritten pack is published but the index not yet pointed at it.
#[tokio::test]
async fn gc_killed_after_a_compaction_rewrite_is_published() {
    gc_killed_after("gc compact published", false).await;
}

// Checks STO-12.
#[tokio::test]
async fn gc_killed_after_compaction() {
    gc_killed_after("gc compact", false).await;
}

// Checks STO-12.
#[tokio::test]
async fn gc_killed_after_retire() {
    gc_killed_after("gc retire", false).await;
}

// Checks STO-12.
#[tokio::test]
async fn gc_killed_after_an_orphan_is_deleted() {
    gc_killed_after("gc orphan deleted", false).await;
}

// Checks STO-12.
#[tokio::test]
async fn gc_killed_after_the_quarantine_is_purged() {
    gc_killed_after("gc purge quarantine", true).await;
}

// Checks STO-12: killed after the first purge batch of the quarantine committed.
#[tokio::test]
async fn gc_killed_after_the_first_purge_batch() {
    gc_killed_after("gc purge quarantine batch", true).await;
}

// Checks STO-12: the object is deleted, the transaction removing its row not committed.
#[tokio::test]
async fn gc_killed_after_a_purged_pack_is_deleted() {
    gc_killed_after("gc purge deleted", true).await;
}

// Checks STO-12.
#[tokio::test]
async fn gc_killed_at_the_end_of_a_run() {
    gc_killed_after("gc done", true).await;
}

/// Kill `graviton serve` after `step` of an upload, restart, and check.
async fn upload_killed_after(step: &str) {
    let dir = tempfile::tempdir().unwrap();
    let acked = random_bytes(3 << 20, 11);
    let pending = random_bytes(3 << 20, 12);
    let mut node = serve(dir.path(), None);
    node.ready(Duration::from_secs(30)).await;
    let url = node.url.clone();
    let key = upload(&url, &acked).await;
    node.kill9();

    node.restart_with_env(&[(PAUSE, step)]);
    node.ready(Duration::from_secs(30)).await;
    let stream = start_upload(node.port(), &pending);
    node.wait_paused(step);
    node.kill9();
    assert!(!answer(stream).contains("201"), "never acknowledged");

    node.restart();
    node.ready(Duration::from_secs(30)).await;
    assert!(
        support::download(&url, &key).await.1 == acked,
        "acknowledged blob byte-exact"
    );
    let pending_key = graviton::cas::BlobKey::of(&pending).to_string();
    assert_eq!(
        support::download(&url, &pending_key).await.0,
        404,
        "no partial blob"
    );
    // the retry is acknowledged and byte-exact
    assert_eq!(upload(&url, &pending).await, pending_key);
    assert!(support::download(&url, &pending_key).await.1 == pending);
    node.kill9();
    collect_to_the_end(dir.path());
}

// Checks STO-7: the pack's data is synced, not yet renamed (a spool file is left).
#[tokio::test]
async fn upload_killed_after_the_pack_data_sync() {
    upload_killed_after("pack data synced").await;
}

// Checks STO-7: the pack is published, the index not committed (an orphan pack).
#[tokio::test]
async fn upload_killed_after_the_pack_is_published() {
    upload_killed_after("pack directory synced").await;
}

// Checks STO-7: the index is committed, the manifest not created.
#[tokio::test]
async fn upload_killed_after_the_index_commit() {
    upload_killed_after("index committed").await;
}
