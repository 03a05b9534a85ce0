//! The collector at scale: time and peak RSS of `graviton gc --purge` over an index of
//! 100,000 and 1,000,000 blocks (`-- --quick`: 100,000 only).
//!
//! The store is built through the real write path: sessions of 10,000 small (64-byte)
//! blocks each, one pack and one redb commit per session, one manifest per session in the
//! file manifest store. Then every other manifest is deleted, so half of the blocks (half
//! of the packs) are garbage. Each collector run is a separate `graviton gc` process on
//! the stopped store; its peak RSS is the child's `VmHWM` at the end of its run (see
//! [`run_gc`]).
//!
//! Baselines from the same run: the RSS of `graviton gc` on an empty store (what the
//! process costs before any block), and the time of one full scan of the redb index in
//! this process (the least a sweep must read).
//!
//! With more than one size, the last lines compare the peak RSS of the largest store with
//! that of the smallest (the collector's memory must not grow with the garbage: the
//! quarantine and the purge run in bounded batches, docs/storage.md, "Memory").
//!
//! Run: `cargo bench --bench gc` (`GRAVITON_BENCH_GC_BLOCKS=<n>[,<n>...]` for other
//! sizes).

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use graviton::cas::{BlobKey, BlockKey, BlockRef, Manifest};
use graviton::storage::fs::FsManifestStore;
use graviton::storage::pack::{PackOptions, PackStore};
use graviton::storage::{BlockStore, ManifestStore};

const BIN: &str = env!("CARGO_BIN_EXE_graviton");
const PER_SESSION: usize = 10_000;
const BLOCK: usize = 64;

fn block(i: u64) -> Bytes {
    let mut data = vec![0u8; BLOCK];
    for (n, piece) in data.chunks_mut(8).enumerate() {
        piece.copy_from_slice(&(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ n as u64).to_le_bytes());
    }
    Bytes::from(data)
}

/// Build `blocks` blocks in `dir`, one manifest per session; delete every other one.
async fn build(dir: &Path, blocks: u64) -> Duration {
    let started = Instant::now();
    let store = PackStore::open_local(
        dir,
        PackOptions {
            pack_size: 32 << 20,
            fsync: false,
            trace: None,
        },
    )
    .expect("store");
    let manifests: Arc<dyn ManifestStore> =
        Arc::new(FsManifestStore::open(dir, false).expect("manifests"));
    let mut keys = Vec::new();
    let mut next = 0u64;
    while next < blocks {
        let mut session = store.begin().expect("session");
        let mut refs = Vec::with_capacity(PER_SESSION);
        let mut whole = blake3::Hasher::new();
        let mut size = 0u64;
        for _ in 0..PER_SESSION.min((blocks - next) as usize) {
            let data = block(next);
            next += 1;
            whole.update(&data);
            size += data.len() as u64;
            let key = BlockKey::of(&data);
            refs.push(BlockRef {
                key,
                size: data.len() as u32,
            });
            session.append(key, data).await.expect("append");
        }
        let key = BlobKey {
            hash: *whole.finalize().as_bytes(),
            size,
        };
        let manifest = Manifest::new(key, refs, 1);
        session
            .commit_manifest(manifest, manifests.clone(), None)
            .await
            .expect("commit");
        keys.push(key);
    }
    for key in keys.iter().step_by(2) {
        assert!(manifests.delete(*key).await.expect("delete"));
    }
    started.elapsed()
}

/// One `graviton gc --purge` on `dir`: wall time, peak RSS (KiB) and its JSON report.
///
/// The peak is the child's own `VmHWM`, read while it is stopped at the end of its run
/// (the test-only hook `GRAVITON_TEST_STOP_AFTER=gc done`, then SIGCONT). Not the
/// `ru_maxrss` of `wait4`: Linux folds the parent's high-water mark into a spawned
/// child's at `exec` (the child starts on the parent's memory), so that figure was
/// this benchmark's own peak, not the collector's.
// The child is reaped by `wait4`, not by `Child::wait`.
#[allow(clippy::zombie_processes)]
fn run_gc(dir: &Path) -> (Duration, u64, serde_json::Value) {
    let started = Instant::now();
    let mut child = Command::new(BIN)
        .args(["gc", "--purge"])
        .env("GRAVITON_STORAGE__DATA_DIR", dir)
        .env("GRAVITON_STORAGE__FSYNC", "false")
        .env("GRAVITON_STORAGE__GC__MIN_AGE", "0s")
        .env("GRAVITON_STORAGE__GC__RETENTION", "0s")
        .env("GRAVITON_TEST_STOP_AFTER", "gc done")
        // A release build honours the hook only with the explicit switch.
        .env("GRAVITON_ENABLE_TEST_HOOKS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn graviton gc");
    let pid = child.id() as i32;
    let peak_kib = loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next());
        match state {
            Some('T') => break proc_kib(pid, "VmHWM:"),
            Some('Z') | None => panic!("graviton gc ended before its last step"),
            _ => std::thread::sleep(Duration::from_millis(2)),
        }
    };
    // SAFETY: kill only signals our own stopped child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut out)
        .expect("read report");
    let mut status = 0;
    // SAFETY: wait4 on our own child.
    let waited = unsafe { libc::wait4(pid, &mut status, 0, std::ptr::null_mut()) };
    assert_eq!(waited, pid, "wait4");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "gc failed: {out}"
    );
    let elapsed = started.elapsed();
    let report = serde_json::from_str(&out).unwrap_or(serde_json::Value::Null);
    (elapsed, peak_kib, report)
}

/// A `kB` line of `/proc/<pid>/status` (0 if unreadable).
fn proc_kib(pid: i32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn index_scan(dir: &Path) -> Duration {
    let store = PackStore::open_local(
        dir,
        PackOptions {
            pack_size: 32 << 20,
            fsync: false,
            trace: None,
        },
    )
    .expect("store");
    let started = Instant::now();
    let mut n = 0u64;
    store
        .index()
        .expect("index")
        .for_each_block(&mut |_, _| {
            n += 1;
            Ok(())
        })
        .expect("scan");
    std::hint::black_box(n);
    started.elapsed()
}

fn rss_kib() -> u64 {
    proc_kib(std::process::id() as i32, "VmRSS:")
}

/// Resident memory (KiB) of a mark set of `n` keys: the `HashSet` the collector used
/// before, and the sorted prefix `MarkSet` it uses now (both built from the same keys).
fn mark_set_kib(n: u64) -> (u64, u64) {
    let keys: Vec<BlockKey> = (0..n).map(|i| BlockKey::of(&i.to_le_bytes())).collect();
    let before = rss_kib();
    let set: std::collections::HashSet<BlockKey> = keys.iter().copied().collect();
    let hashed = rss_kib().saturating_sub(before);
    std::hint::black_box(&set);
    drop(set);
    let before = rss_kib();
    let sorted = graviton::storage::pack::gc::MarkSet::from_keys(keys.clone());
    let vec = rss_kib().saturating_sub(before);
    std::hint::black_box(&sorted);
    (hashed, vec)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let sizes: Vec<u64> = match std::env::var("GRAVITON_BENCH_GC_BLOCKS") {
        Ok(n) => n
            .split(',')
            .map(|n| n.trim().parse().expect("GRAVITON_BENCH_GC_BLOCKS"))
            .collect(),
        Err(_) if quick => vec![100_000],
        Err(_) => vec![100_000, 1_000_000],
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");

    println!(
        "graviton gc benchmark: {BLOCK}-byte blocks, {PER_SESSION} per pack and manifest, half deleted"
    );
    let empty = tempfile::tempdir().expect("tempdir");
    let (_, empty_rss, _) = run_gc(empty.path());
    println!(
        "graviton gc on an empty store: peak RSS {} MiB (baseline)",
        empty_rss / 1024
    );
    let mut peaks: Vec<(u64, u64, u64)> = Vec::new();
    for blocks in sizes {
        let (hashed, sorted) = mark_set_kib(blocks);
        println!(
            "mark set of {blocks} keys: HashSet {} MiB, sorted MarkSet {} MiB (ratio {:.2})",
            hashed / 1024,
            sorted / 1024,
            sorted as f64 / hashed.max(1) as f64
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let built = runtime.block_on(build(dir.path(), blocks));
        let index_mib = std::fs::metadata(dir.path().join("index.redb"))
            .map(|m| m.len() >> 20)
            .unwrap_or(0);
        let scan = index_scan(dir.path());
        let (first, first_rss, report) = run_gc(dir.path());
        std::thread::sleep(Duration::from_millis(10));
        let (second, second_rss, purged) = run_gc(dir.path());
        println!(
            "{blocks} blocks (built in {:.1} s, index {index_mib} MiB): index scan {:.2} s (baseline)",
            built.as_secs_f64(),
            scan.as_secs_f64()
        );
        println!(
            "  gc run 1 (mark, quarantine {}, retire {}): {:.2} s = {:.1}x the scan, peak RSS {} MiB (+{} MiB over empty)",
            report["quarantined"],
            report["packs_retired"],
            first.as_secs_f64(),
            first.as_secs_f64() / scan.as_secs_f64(),
            first_rss / 1024,
            first_rss.saturating_sub(empty_rss) / 1024
        );
        println!(
            "  gc run 2 (purge {} entries, {} packs): {:.2} s, peak RSS {} MiB (+{} MiB over empty)",
            purged["purged_entries"],
            purged["packs_deleted"],
            second.as_secs_f64(),
            second_rss / 1024,
            second_rss.saturating_sub(empty_rss) / 1024
        );
        peaks.push((blocks, first_rss, second_rss));
    }
    if let (Some(small), Some(large)) = (peaks.first(), peaks.last())
        && large.0 > small.0
    {
        let over = |rss: u64| rss.saturating_sub(empty_rss).max(1) as f64;
        println!(
            "peak RSS {} blocks / {} blocks ({:.0}x the blocks): gc run {:.2} (over empty {:.2}), purge {:.2} (over empty {:.2})",
            large.0,
            small.0,
            large.0 as f64 / small.0 as f64,
            large.1 as f64 / small.1 as f64,
            over(large.1) / over(small.1),
            large.2 as f64 / small.2 as f64,
            over(large.2) / over(small.2),
        );
    }
}
