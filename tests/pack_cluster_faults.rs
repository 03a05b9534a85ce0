//! Fault tests of the cluster's pack store (PostgreSQL index, packs on the test S3
//! server) with real processes.
//!
//! **An uploader stopped past `min_age` (STO-14).** An uploader **process** stopped with
//! SIGSTOP in the middle of an upload, past the collector's `min_age`, while a collector
//! of the cluster runs and purges. A cluster node (`graviton serve`) stops itself with
//! the test-only hook `GRAVITON_TEST_STOP_AFTER=upload packs published`
//! (`src/storage/pack/pause.rs`): every pack of the upload is in the bucket, nothing is
//! indexed yet. While it is stopped, a separate `graviton gc --purge` process (the
//! cluster collector, `min_age` 1 s, `retention` 0 s) runs over the same database and
//! bucket, so what the stopped upload wrote or deduplicated is garbage by every rule the
//! collector has. Then SIGCONT. The upload must either answer 201 and download
//! byte-exact, or fail with 503 and leave no manifest; never a 201 for a blob whose
//! blocks were collected. In both cases here the collector did collect them, so the
//! answer must be the 503, and a retry must store the blob again.
//!
//! (On one node the collector runs inside the stopped process itself, and `graviton gc`
//! refuses while the node holds the index, so the process case exists only in a
//! cluster; in one process the block is pinned instead, STO-23:
//! `storage::pack::gc_tests::a_paused_uploaders_dedup_block_is_pinned_until_its_commit`.)
//!
//! **The cluster collector killed after each step (STO-16).** `graviton gc --purge`
//! against the cluster is killed with SIGKILL after each step of its run
//! (`GRAVITON_TEST_PAUSE_AFTER`), like the single node's in `tests/pack_faults.rs`. Then
//! the advisory lock is free again, acknowledged blobs download byte-exact, deleted and
//! unacknowledged ones stay absent, two more runs complete, and a dry run finds no
//! object that no row names.

mod support;

use std::time::Duration;

use support::client;
use support::cluster::{NodeProcess, is_ready, s3_storage_toml};
use support::node::random_bytes;

const SHARDS: u32 = 16;
const ADMIN: &str = "admin-token-for-stopped-uploader-01";
const STEP: &str = "upload packs published";

/// `POST /v1/blobs`: the status, the body, and whether a `Retry-After` came with it.
async fn post(url: &str, data: Vec<u8>) -> (u16, String, bool) {
    let response = client()
        .post(format!("{url}/v1/blobs"))
        .body(data)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let retry_after = response.headers().contains_key("retry-after");
    (
        status,
        response.text().await.unwrap_or_default(),
        retry_after,
    )
}

/// Upload until it is acknowledged (a node just resumed may still be re-acquiring its
/// shards, which answers 503 meanwhile); returns the key.
async fn upload_acknowledged(url: &str, data: &[u8]) -> String {
    let mut last = (0, String::new(), false);
    for _ in 0..100 {
        last = post(url, data.to_vec()).await;
        if last.0 == 201 {
            let body: serde_json::Value = serde_json::from_str(&last.1).unwrap();
            return body["key"].as_str().unwrap().to_string();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("upload never acknowledged: {last:?}");
}

/// `graviton gc --purge` against the node's cluster (a process of its own); its report.
async fn collect(node: &NodeProcess) -> serde_json::Value {
    collect_with(node, &["--purge"]).await
}

/// `graviton gc <args>` against the node's cluster; its report.
async fn collect_with(node: &NodeProcess, args: &[&str]) -> serde_json::Value {
    let config = node.config.clone();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_graviton"))
            .arg("gc")
            .args(&args)
            .arg("--config")
            .arg(&config)
            .env_remove("GRAVITON_TEST_STOP_AFTER")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "graviton gc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A one-node cluster on S3 (`min_age` 1 s, `retention` 0 s), or `None` when the test
/// services are missing.
async fn cluster(test: &str) -> Option<(support::TestDatabase, tempfile::TempDir, NodeProcess)> {
    let db = support::TestDatabase::create(test).await?;
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("stopped-uploader-{}", support::unique_suffix());
    // Batches of 8: a run spans several quarantine and purge statements.
    let gc = "\n[storage.gc]\nmin_age = \"1s\"\nretention = \"0s\"\nbatch = 8";
    let storage = s3_storage_toml(test, &dir.path().join("node-a"), &prefix, gc)?;
    let admin = format!("[admin]\ntoken = \"{ADMIN}\"");
    let node =
        NodeProcess::start_with_storage(dir.path(), "node-a", db.url(), SHARDS, &storage, &admin);
    wait_ready(&node).await;
    Some((db, dir, node))
}

async fn wait_ready(node: &NodeProcess) {
    let http = client();
    let ready = support::wait_until(Duration::from_secs(60), || is_ready(&http, &node.url)).await;
    assert!(ready, "node not ready:\n{}", node.log_text());
}

/// Start uploading `data` to a node restarted with the stop hook; returns once the node
/// has stopped itself after publishing the upload's packs, with the pending answer.
async fn upload_stopped(
    node: &mut NodeProcess,
    data: Vec<u8>,
) -> tokio::task::JoinHandle<(u16, String, bool)> {
    node.restart_with_env(&[("GRAVITON_TEST_STOP_AFTER", STEP)]);
    wait_ready(node).await;
    let url = node.url.clone();
    let pending = tokio::spawn(async move { post(&url, data).await });
    let pid = node.pid().unwrap();
    let stopped = support::wait_until(Duration::from_secs(60), || async {
        support::process_stopped(pid)
    })
    .await;
    assert!(stopped, "the node did not stop:\n{}", node.log_text());
    assert!(
        node.log_text().contains(&format!("stopping after {STEP}")),
        "stopped at the wrong step:\n{}",
        node.log_text()
    );
    pending
}

fn resume(node: &NodeProcess) {
    // SAFETY: kill sends a signal to the node process this test started.
    assert_eq!(
        unsafe { libc::kill(node.pid().unwrap() as i32, libc::SIGCONT) },
        0
    );
}

/// The answer of the resumed upload of `data` after the collector took its blocks: a
/// 503 (retry), no manifest; then a retry is acknowledged and byte-exact.
async fn check_refused_then_retried(
    node: &mut NodeProcess,
    pending: tokio::task::JoinHandle<(u16, String, bool)>,
    data: &[u8],
    reason: &str,
) {
    resume(node);
    let (status, body, retry_after) = tokio::time::timeout(Duration::from_secs(60), pending)
        .await
        .expect("the resumed upload answers")
        .unwrap();
    let key = graviton::cas::BlobKey::of(data).to_string();
    // A 201 would be allowed only if every byte were still there; the collector took
    // them (the caller checked its report), so it would be an acknowledged blob with no
    // bytes.
    assert_ne!(
        status, 201,
        "201 for a blob whose blocks were collected: {body}"
    );
    assert_eq!(status, 503, "a documented retry answer: {body}");
    assert!(body.contains("storage_unavailable"), "{body}");
    assert!(retry_after, "503 with Retry-After");
    assert!(
        node.log_text().contains(reason),
        "refused for the expected reason ({reason}):\n{}",
        node.log_text()
    );
    assert_eq!(
        support::download(&node.url, &key).await.0,
        404,
        "no manifest for the refused upload"
    );
    // Restart without the hook (the stop step would stop every later upload too).
    node.restart_with_env(&[]);
    wait_ready(node).await;
    assert_eq!(upload_acknowledged(&node.url, data).await, key);
    let (got, bytes) = support::download(&node.url, &key).await;
    assert_eq!(got, 200);
    assert!(bytes == data, "the retried blob is byte-exact");
}

// Checks STO-14 (and STO-10 with real processes): the stopped upload's fresh pack is in
// the bucket but named by no row, and older than min_age, so the collector deletes it as
// an orphan while the uploader is stopped. Resumed, the commit's HEAD finds it gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploader_stopped_after_publishing_loses_its_fresh_pack_and_gets_503() {
    let test = "an_uploader_stopped_after_publishing_loses_its_fresh_pack_and_gets_503";
    let Some((_db, _dir, mut node)) = cluster(test).await else {
        return;
    };
    let kept = random_bytes(1 << 20, 61);
    let kept_key = upload_acknowledged(&node.url, &kept).await;

    let data = random_bytes(3 << 20, 62);
    let pending = upload_stopped(&mut node, data.clone()).await;
    tokio::time::sleep(Duration::from_millis(2000)).await; // past min_age
    let report = collect(&node).await;
    assert!(
        report["orphan_packs_deleted"].as_u64().unwrap() >= 1,
        "the stopped upload's pack was collected: {report}"
    );
    check_refused_then_retried(
        &mut node,
        pending,
        &data,
        "was deleted by the collector before the upload committed",
    )
    .await;
    assert!(support::download(&node.url, &kept_key).await.1 == kept);
}

// Checks STO-14 (and STO-3 with real processes): the stopped upload deduplicated every
// block against a deleted blob's; the collector quarantines, purges and deletes those
// blocks and their pack while the uploader is stopped. Resumed, the commit's dedup
// confirmation finds them gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploader_stopped_after_dedup_hits_loses_them_and_gets_503() {
    let test = "an_uploader_stopped_after_dedup_hits_loses_them_and_gets_503";
    let Some((_db, _dir, mut node)) = cluster(test).await else {
        return;
    };
    let data = random_bytes(3 << 20, 63);
    let key = upload_acknowledged(&node.url, &data).await;
    let response = client()
        .delete(format!("{}/v1/blobs/{key}", node.url))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    tokio::time::sleep(Duration::from_millis(1500)).await; // past min_age

    let pending = upload_stopped(&mut node, data.clone()).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The first run quarantines the blocks and retires their pack; the second (past the
    // zero retention) purges both.
    let first = collect(&node).await;
    assert!(first["quarantined"].as_u64().unwrap() > 0, "{first}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let report = collect(&node).await;
    assert!(
        report["purged_entries"].as_u64().unwrap() > 0
            && report["packs_deleted"].as_u64().unwrap() >= 1,
        "the deduplicated blocks and their pack were purged: {report}"
    );
    check_refused_then_retried(
        &mut node,
        pending,
        &data,
        "was collected while the upload ran",
    )
    .await;
}

async fn delete(url: &str, key: &str) {
    support::delete_blob(url, key, ADMIN).await;
}

/// Kill the cluster's `graviton gc --purge` after `step` (with `purge_first`, after a
/// complete run that leaves quarantined blocks and retired packs to purge), then check
/// the cluster and finish the work (STO-16).
async fn cluster_gc_killed_after(test: &str, step: &str, purge_first: bool) {
    let Some((_db, _dir, mut node)) = cluster(test).await else {
        return;
    };
    let url = node.url.clone();
    let keep = random_bytes(2 << 20, 71);
    let gone = random_bytes(2 << 20, 72);
    let unacked = random_bytes(1 << 20, 73);
    let keep_key = upload_acknowledged(&url, &keep).await;
    let gone_key = upload_acknowledged(&url, &gone).await;
    delete(&url, &gone_key).await;
    // A sparse pack for the compaction: a blob kept that shares its first blocks with a
    // deleted one (content-defined chunks: the same prefix cuts the same first blocks).
    let wide = random_bytes(2 << 20, 74);
    let narrow = wide[..384 << 10].to_vec();
    let wide_key = upload_acknowledged(&url, &wide).await;
    let narrow_key = upload_acknowledged(&url, &narrow).await;
    delete(&url, &wide_key).await;
    // An upload killed after its pack is in the bucket and before its commit: an orphan.
    node.restart_with_env(&[("GRAVITON_TEST_STOP_AFTER", STEP)]);
    wait_ready(&node).await;
    let pending = {
        let url = url.clone();
        let unacked = unacked.clone();
        tokio::spawn(async move {
            client()
                .post(format!("{url}/v1/blobs"))
                .body(unacked)
                .send()
                .await
                .map(|r| r.status().as_u16())
        })
    };
    let pid = node.pid().unwrap();
    assert!(
        support::wait_until(Duration::from_secs(60), || async {
            support::process_stopped(pid)
        })
        .await,
        "the uploader did not stop:\n{}",
        node.log_text()
    );
    node.restart_with_env(&[]);
    assert!(
        !matches!(pending.await.unwrap(), Ok(201)),
        "never acknowledged"
    );
    wait_ready(&node).await;
    tokio::time::sleep(Duration::from_millis(1200)).await; // past min_age
    if purge_first {
        let report = collect_with(&node, &[]).await;
        assert!(report["quarantined"].as_u64().unwrap() > 0, "{report}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let config = node.config.clone();
    let mut command = std::process::Command::new(support::process::BIN);
    command
        .args(["gc", "--purge", "--config"])
        .arg(&config)
        .env("GRAVITON_TEST_PAUSE_AFTER", step);
    let log = config.with_file_name("gc.log");
    let step_owned = step.to_string();
    let mut gc = tokio::task::spawn_blocking(move || {
        let mut gc = support::process::Graviton::spawn(log, command);
        gc.wait_paused(&step_owned);
        gc
    })
    .await
    .unwrap();
    gc.kill9();

    let check = || async {
        for (key, data) in [(&keep_key, &keep), (&narrow_key, &narrow)] {
            let (status, body) = support::download(&url, key).await;
            assert_eq!(status, 200);
            assert!(body == *data, "an acknowledged blob is byte-exact");
        }
        for absent in [&gone, &unacked, &wide] {
            let key = graviton::cas::BlobKey::of(absent).to_string();
            assert_eq!(support::download(&url, &key).await.0, 404);
        }
    };
    check().await;
    // The lock died with the collector's connection: two more runs complete.
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        collect(&node).await;
    }
    check().await;
    let dry = collect_with(&node, &["--dry-run"]).await;
    assert_eq!(
        dry["orphan_packs_deleted"], 0,
        "every object is indexed: {dry}"
    );
    assert_eq!(dry["candidates"], 0, "{dry}");
    // The cluster still takes uploads, including of collected content.
    assert_eq!(
        upload_acknowledged(&url, &gone).await,
        gone_key,
        "collected content is stored again"
    );
    assert!(support::download(&url, &gone_key).await.1 == gone);
}

macro_rules! cluster_gc_killed {
    ($($name:ident: $step:expr, $purge_first:expr;)*) => {$(
        // Checks STO-16.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            cluster_gc_killed_after(stringify!($name), $step, $purge_first).await;
        }
    )*};
}

cluster_gc_killed! {
    cluster_gc_killed_after_mark: "gc mark", false;
    cluster_gc_killed_after_select: "gc select", false;
    cluster_gc_killed_after_mark_again: "gc mark again", false;
    cluster_gc_killed_after_the_first_quarantine_batch: "gc quarantine batch", false;
    cluster_gc_killed_after_quarantine: "gc quarantine", false;
    cluster_gc_killed_after_a_compaction_rewrite_is_published: "gc compact published", false;
    cluster_gc_killed_after_compaction: "gc compact", false;
    cluster_gc_killed_after_retire: "gc retire", false;
    cluster_gc_killed_after_an_orphan_is_deleted: "gc orphan deleted", false;
    cluster_gc_killed_after_the_first_purge_batch: "gc purge quarantine batch", true;
    cluster_gc_killed_after_the_quarantine_is_purged: "gc purge quarantine", true;
    cluster_gc_killed_at_the_end_of_a_run: "gc done", true;
}
