//! Power loss under a real `graviton serve` process: its data directory is on the
//! LazyFS-style filesystem of `tests/support/lazyfs.rs`, which keeps every write a file
//! has not fsynced apart and drops all of them on [`LazyFs::crash`]. `kill -9` alone
//! leaves the page cache intact, so it cannot catch a missing sync; kill plus crash can.
//!
//! * With the default `storage.fsync = true`, every acknowledged blob survives a kill and
//!   crash byte-exact, the in-flight upload leaves nothing visible, and `graviton verify`
//!   is clean (STO-20). The layer also drops every directory entry whose directory was
//!   not fsynced, so a missing directory sync (after a pack's rename, for a new two-hex
//!   directory, for the data directory's own files at start) loses a name and fails
//!   the test (STO-24).
//! * The control: with `storage.fsync = false` the same crash loses acknowledged blobs,
//!   so the layer really fails a store that does not sync.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use support::client;
use support::lazyfs::{LazyFs, Unsynced, UnsyncedName};
use support::node::random_bytes;
use support::process::{BIN, Graviton};

/// Small packs, so each blob spans several packs (several publish steps per upload).
const PACK_SIZE: &str = "2MiB";

/// The store's settings for every process of these tests.
fn settings(command: &mut Command, data_dir: &Path, fsync: bool) {
    command
        .env("GRAVITON_STORAGE__DATA_DIR", data_dir)
        .env(
            "GRAVITON_STORAGE__FSYNC",
            if fsync { "true" } else { "false" },
        )
        .env("GRAVITON_STORAGE__PACK_SIZE", PACK_SIZE)
        .env_remove("GRAVITON_TEST_PAUSE_AFTER");
}

/// Start a node on `data_dir` (its log `<logs>/<name>.log`) and wait until it is ready;
/// `Err` with its log if it exits or is not ready within 60 s. Killed with SIGKILL when
/// dropped (also when a test fails, before the filesystem under it is unmounted).
async fn start(data_dir: &Path, fsync: bool, logs: &Path, name: &str) -> Result<Graviton, String> {
    let mut node = Graviton::serve_listen(logs.join(format!("{name}.log")), |command| {
        settings(command, data_dir, fsync);
    });
    node.wait_ready(Duration::from_secs(60)).await?;
    Ok(node)
}

/// Upload `data`; the upload must be acknowledged (201). Returns the blob key.
async fn upload(url: &str, data: &[u8]) -> String {
    let response = client()
        .post(format!("{url}/v1/blobs"))
        .body(data.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201, "upload acknowledged");
    let body: serde_json::Value = response.json().await.unwrap();
    let key = body["key"].as_str().unwrap().to_string();
    assert_eq!(key, graviton::cas::BlobKey::of(data).to_string());
    key
}

/// Start an upload of `data` on a raw socket, sending only its first `sent` bytes: the
/// server is left reading the body, so the upload is never acknowledged.
fn start_partial_upload(port: u16, data: &[u8], sent: usize) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let head = format!(
        "POST /v1/blobs HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        data.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&data[..sent]).unwrap();
    stream
}

/// What a download of one acknowledged blob gave.
#[derive(Debug, PartialEq, Eq)]
enum Download {
    Exact,
    /// A status other than 200.
    Status(u16),
    /// 200, but the body broke off (the error) or differs (length received).
    Broken(String),
    Different(usize),
}

async fn download(url: &str, key: &str, expected: &[u8]) -> Download {
    let response = match client().get(format!("{url}/v1/blobs/{key}")).send().await {
        Ok(response) => response,
        Err(err) => return Download::Broken(err.to_string()),
    };
    let status = response.status().as_u16();
    if status != 200 {
        return Download::Status(status);
    }
    match response.bytes().await {
        Ok(body) if body == expected => Download::Exact,
        Ok(body) => Download::Different(body.len()),
        Err(err) => Download::Broken(err.to_string()),
    }
}

/// `graviton verify` on the stopped node's directory: exit status and report.
fn verify(data_dir: &Path, fsync: bool) -> (bool, serde_json::Value, String) {
    let mut command = Command::new(BIN);
    command.arg("verify");
    settings(&mut command, data_dir, fsync);
    let out = command.output().expect("run graviton verify");
    let report = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (
        out.status.success(),
        report,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn show(dropped: &[Unsynced]) -> String {
    dropped
        .iter()
        .map(|f| {
            format!(
                "{} ({} -> {} bytes)",
                f.path.display(),
                f.len,
                f.durable_len
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether `path` (relative to the mount) is a published pack or a manifest: data an
/// acknowledgement stands on.
fn acknowledged_data(path: &Path) -> bool {
    let path = path.to_string_lossy();
    (path.starts_with("node/packs/") && path.ends_with(".pack"))
        || path.starts_with("node/manifests/")
}

/// Scratch space whose names need not survive a crash: spool files and temporary files.
fn scratch(path: &Path) -> bool {
    path.starts_with("node/packs/tmp/") || path.starts_with("node/tmp/")
}

/// Several blobs of a few MiB (distinct content, so no block is shared).
fn blobs() -> Vec<Vec<u8>> {
    [3usize, 5, 4, 3]
        .iter()
        .enumerate()
        .map(|(i, mib)| random_bytes(mib << 20, 2000 + i as u64))
        .collect()
}

// Checks STO-20.
#[tokio::test]
async fn acknowledged_blobs_survive_a_power_loss_with_fsync() {
    let test = "acknowledged_blobs_survive_a_power_loss_with_fsync";
    let Some(fs) = LazyFs::mount(test) else {
        return;
    };
    fs.check_locks();
    let logs = tempfile::tempdir().unwrap();
    let dir = fs.path().join("node");
    let mut node = start(&dir, true, logs.path(), "first")
        .await
        .unwrap_or_else(|log| panic!("{log}"));
    // redb's file locks hold on the mount: an offline command refuses the open index
    let (clean, report, stderr) = verify(&dir, true);
    assert!(
        !clean && stderr.to_lowercase().contains("lock"),
        "verify beside the running node must find the index locked: {report} {stderr}"
    );

    let blobs = blobs();
    let mut keys = Vec::new();
    for blob in &blobs {
        keys.push(upload(&node.url, blob).await);
    }
    // one more upload in flight: 1.5 MiB of its 6 MiB body sent, less than a pack, so
    // its spool file is written and never synced (nor sealed), and it is never
    // acknowledged
    let pending = random_bytes(6 << 20, 2100);
    let pending_key = graviton::cas::BlobKey::of(&pending).to_string();
    let stream = start_partial_upload(node.port(), &pending, 3 << 19);
    support::eventually(
        Duration::from_secs(60),
        "the in-flight upload writes to a spool file",
        || {
            fs.unsynced()
                .iter()
                .any(|f| f.path.starts_with("node/packs/tmp") && f.len > 0)
        },
    )
    .await;
    let synced = fs.stats();
    node.kill9();
    drop(stream);
    // Checks STO-24: every name an acknowledgement or a restart stands on (packs, their
    // two-hex directories, manifests, the index and ledger files, the data directory's
    // own directories) is durable in its directory; only scratch names are not.
    let names = fs.unsynced_names();
    let lost: Vec<_> = names
        .iter()
        .filter(|name| match name {
            UnsyncedName::Added(path) => !scratch(path),
            UnsyncedName::Removed(_) => false,
        })
        .collect();
    assert!(
        lost.is_empty(),
        "names whose directory was not synced, lost by the crash: {lost:?}"
    );
    assert!(
        names
            .iter()
            .any(|name| matches!(name, UnsyncedName::Added(p) if scratch(p))),
        "the in-flight upload's spool file has no durable name: {names:?}"
    );
    let dropped = fs.crash();
    eprintln!("{test}: {synced:?}; the crash dropped: {}", show(&dropped));
    assert!(
        synced.file_syncs() > 0 && synced.dir_fsyncs > 0,
        "the uploads synced files and directories: {synced:?}"
    );
    assert!(
        dropped.iter().any(|f| f.path.starts_with("node/packs/tmp")),
        "the crash dropped the in-flight upload's unsynced spool bytes: {}",
        show(&dropped)
    );
    assert!(
        !dropped.iter().any(|f| acknowledged_data(&f.path)),
        "an acknowledged upload left data unsynced: {}",
        show(&dropped)
    );

    let mut node = start(&dir, true, logs.path(), "after-crash")
        .await
        .unwrap_or_else(|log| panic!("the node does not start after the crash: {log}"));
    for (key, blob) in keys.iter().zip(&blobs) {
        assert_eq!(
            download(&node.url, key, blob).await,
            Download::Exact,
            "acknowledged blob {key} after the crash; node log:\n{}",
            node.log_text()
        );
    }
    assert_eq!(
        download(&node.url, &pending_key, &pending).await,
        Download::Status(404),
        "the unacknowledged upload left no blob"
    );
    node.kill9();

    let (clean, report, stderr) = verify(&dir, true);
    assert!(clean, "graviton verify after the crash: {report} {stderr}");
    assert_eq!(report["entries_affected"], 0, "{report}");
    assert_eq!(report["damaged"], serde_json::json!([]), "{report}");
    assert!(
        report["packs_checked"].as_u64().unwrap_or(0) >= blobs.len() as u64,
        "{report}"
    );
}

// Checks STO-20: the control. Without fsync the same crash loses acknowledged blobs,
// which shows the layer fails a store that skips the syncs.
#[tokio::test]
async fn without_fsync_a_power_loss_loses_acknowledged_blobs() {
    let test = "without_fsync_a_power_loss_loses_acknowledged_blobs";
    let Some(fs) = LazyFs::mount(test) else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let dir = fs.path().join("node");
    let mut node = start(&dir, false, logs.path(), "first")
        .await
        .unwrap_or_else(|log| panic!("{log}"));
    let blobs = blobs();
    let mut keys = Vec::new();
    for blob in &blobs {
        keys.push(upload(&node.url, blob).await);
    }
    // every acknowledged blob reads back before the crash (a kill alone loses nothing)
    for (key, blob) in keys.iter().zip(&blobs) {
        assert_eq!(download(&node.url, key, blob).await, Download::Exact);
    }
    let synced = fs.stats();
    node.kill9();
    let dropped = fs.crash();
    eprintln!("{test}: {synced:?}; the crash dropped: {}", show(&dropped));
    assert!(
        dropped.iter().any(|f| acknowledged_data(&f.path)),
        "the crash dropped acknowledged data (packs or manifests): {}",
        show(&dropped)
    );

    // What survived: the node may refuse to start, or serve some blobs wrong.
    let mut lost = Vec::new();
    let started = start(&dir, false, logs.path(), "after-crash").await;
    match started {
        Ok(mut node) => {
            for (key, blob) in keys.iter().zip(&blobs) {
                let got = download(&node.url, key, blob).await;
                if got != Download::Exact {
                    lost.push(format!("{key}: {got:?}"));
                }
            }
            node.kill9();
        }
        Err(log) => lost.push(format!("the node refused to start: {log}")),
    }
    let (clean, report, stderr) = verify(&dir, false);
    let damaged = !clean
        || report["entries_affected"].as_u64() != Some(0)
        || report["damaged"] != serde_json::json!([]);
    eprintln!(
        "{test}: after the crash: lost {lost:?}; graviton verify clean={clean}: {report} {}",
        stderr.trim()
    );
    assert!(
        !lost.is_empty() || damaged,
        "without fsync a crash dropping unsynced writes lost nothing acknowledged: the \
         layer does not model a power loss"
    );
}

// The layer itself, without graviton: only what an fsync covered survives a crash (data
// here, names in `the_layer_keeps_only_the_names_a_directory_sync_covered`); a listing
// survives removals made during it.
#[tokio::test]
async fn the_layer_keeps_exactly_what_was_fsynced() {
    use std::io::Write;
    let Some(fs) = LazyFs::mount("the_layer_keeps_exactly_what_was_fsynced") else {
        return;
    };
    let root = fs.path();
    let open = |name: &str| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(root.join(name))
            .unwrap()
    };
    // synced, then appended to without a sync
    let mut appended = open("appended");
    appended.write_all(b"synced").unwrap();
    appended.sync_data().unwrap();
    appended.write_all(b" and lost").unwrap();
    // never synced: the name survives, the bytes do not
    open("unsynced").write_all(b"lost").unwrap();
    // synced, then truncated without a sync
    let truncated = open("truncated");
    (&truncated).write_all(b"twelve bytes").unwrap();
    truncated.sync_all().unwrap();
    truncated.set_len(3).unwrap();
    // the publish pattern: write, sync, rename over an older file, sync the directory
    std::fs::create_dir(root.join("dir")).unwrap();
    std::fs::write(root.join("dir/target"), b"old").unwrap();
    let staged = open("staged");
    (&staged).write_all(b"new").unwrap();
    staged.sync_data().unwrap();
    std::fs::rename(root.join("staged"), root.join("dir/target")).unwrap();
    std::fs::File::open(root.join("dir"))
        .unwrap()
        .sync_all()
        .unwrap();
    // removed: stays removed
    std::fs::write(root.join("removed"), b"x").unwrap();
    std::fs::remove_file(root.join("removed")).unwrap();
    drop((appended, truncated, staged));
    // every name above as it is now is made durable (names are the other test's subject)
    sync_dir(root);

    let stats = fs.stats();
    assert_eq!(
        (stats.fsyncs, stats.fdatasyncs, stats.dir_fsyncs),
        (1, 2, 2)
    );
    assert_eq!(
        std::fs::read(root.join("appended")).unwrap(),
        b"synced and lost"
    );
    let dropped: Vec<_> = fs
        .crash()
        .into_iter()
        .map(|f| (f.path.to_string_lossy().into_owned(), f.len, f.durable_len))
        .collect();
    assert_eq!(
        dropped,
        [
            ("appended".to_string(), 15, 6),
            ("truncated".to_string(), 3, 12),
            ("unsynced".to_string(), 4, 0),
        ]
    );
    assert_eq!(std::fs::read(root.join("appended")).unwrap(), b"synced");
    assert_eq!(std::fs::read(root.join("unsynced")).unwrap(), b"");
    assert_eq!(
        std::fs::read(root.join("truncated")).unwrap(),
        b"twelve bytes"
    );
    assert_eq!(std::fs::read(root.join("dir/target")).unwrap(), b"new");
    assert!(!root.join("removed").exists());
    assert!(!root.join("staged").exists());
    assert!(fs.unsynced().is_empty(), "a crash leaves nothing unsynced");

    // a directory listed while its entries are removed lists each entry once
    let many = root.join("many");
    std::fs::create_dir(&many).unwrap();
    for i in 0..300 {
        std::fs::write(many.join(format!("file-{i:03}")), b"").unwrap();
    }
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(&many).unwrap() {
        let entry = entry.unwrap();
        seen.push(entry.file_name().to_string_lossy().into_owned());
        std::fs::remove_file(entry.path()).unwrap();
    }
    seen.sort();
    let expected: Vec<String> = (0..300).map(|i| format!("file-{i:03}")).collect();
    assert_eq!(seen, expected);
    std::fs::remove_dir(&many).unwrap();
}

fn sync_dir(dir: &Path) {
    std::fs::File::open(dir).unwrap().sync_all().unwrap();
}

// Checks STO-24 (the layer's half): a name survives a crash only if its directory was
// fsynced after the name was made, and a removal only if the directory was fsynced after
// it; a file's own fsync makes its data durable, never its name; a new directory whose
// parent was not synced is lost with everything under it.
#[tokio::test]
async fn the_layer_keeps_only_the_names_a_directory_sync_covered() {
    let Some(fs) = LazyFs::mount("the_layer_keeps_only_the_names_a_directory_sync_covered") else {
        return;
    };
    let root = fs.path();
    let synced_file = |path: &Path, data: &[u8]| {
        let file = std::fs::File::create(path).unwrap();
        (&file).write_all(data).unwrap();
        file.sync_all().unwrap();
    };
    use std::io::Write;
    std::fs::create_dir(root.join("d")).unwrap();
    sync_dir(root);
    synced_file(&root.join("d/kept"), b"kept");
    synced_file(&root.join("d/unlinked"), b"back");
    synced_file(&root.join("d/moved"), b"moved");
    sync_dir(&root.join("d"));
    // after the last sync of d: a new name, a removal and a rename, all undone by a crash
    synced_file(&root.join("d/new"), b"new");
    std::fs::remove_file(root.join("d/unlinked")).unwrap();
    std::fs::rename(root.join("d/moved"), root.join("d/renamed")).unwrap();
    // a new directory, synced inside, but whose own name in the root never was
    std::fs::create_dir(root.join("fresh")).unwrap();
    synced_file(&root.join("fresh/inner"), b"inner");
    sync_dir(&root.join("fresh"));
    assert!(root.join("fresh/inner").exists() && !root.join("d/unlinked").exists());

    let added = |p: &str| UnsyncedName::Added(PathBuf::from(p));
    let removed = |p: &str| UnsyncedName::Removed(PathBuf::from(p));
    assert_eq!(
        fs.unsynced_names(),
        [
            added("d/new"),
            added("d/renamed"),
            added("fresh"),
            removed("d/moved"),
            removed("d/unlinked"),
        ]
    );
    assert!(fs.crash().is_empty(), "every file's data was synced");
    assert_eq!(std::fs::read(root.join("d/kept")).unwrap(), b"kept");
    assert_eq!(std::fs::read(root.join("d/unlinked")).unwrap(), b"back");
    assert_eq!(std::fs::read(root.join("d/moved")).unwrap(), b"moved");
    assert!(
        !root.join("d/new").exists(),
        "a name its directory never synced"
    );
    assert!(
        !root.join("d/renamed").exists(),
        "a rename its directory never synced"
    );
    assert!(
        !root.join("fresh").exists(),
        "a directory its parent never synced"
    );
    let mut listed: Vec<String> = std::fs::read_dir(root.join("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    listed.sort();
    assert_eq!(listed, ["kept", "moved", "unlinked"]);
    assert!(
        fs.unsynced_names().is_empty(),
        "a crash leaves no unsynced name"
    );
}
