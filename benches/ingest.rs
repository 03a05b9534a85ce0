//! Ingest benchmarks, printed as ratios against baselines measured in the same run.
//!
//! 1. raw: FastCDC cut points + BLAKE3 of every chunk over an in-memory buffer (one thread).
//! 2. in-process ingest: the real pipeline with blocks discarded, into the legacy
//!    file-per-block store (fsync on), and into the pack store (fsync off and on); in the
//!    full run also 1 GiB into the pack store with fsync on.
//! 3. HTTP upload to an in-process node over loopback (fsync on), vs in-process ingest.
//! 4. download from packs (verified) vs raw reads of the same pack files.
//! 5. peak RSS of a `graviton serve` process during a small and a large upload.
//!
//! Durable ingest is also printed against a second baseline, the disk's: the same bytes
//! written into 32 MiB files (the pack size) with one `fdatasync` each and one directory
//! fsync, which is the least the pack store must do. The two ratios say whether the
//! store or the disk is the limit.
//!
//! Run: `cargo bench --bench ingest` (add `-- --quick` for a shorter run,
//! `GRAVITON_BENCH_LARGE_GIB=2` to set the large upload's size,
//! `GRAVITON_BENCH_PACKS_ONLY=1` for raw, discard, disk and durable packs only,
//! `GRAVITON_BENCH_PROFILE=durable` (or `discard`) for raw and that one step five times,
//! to run under `perf record`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use graviton::cas::{AVG_CHUNK, BlockKey, MAX_CHUNK, MIN_CHUNK};
use graviton::config::Config;
use graviton::pipeline::ingest::{IngestLimits, ingest};
use graviton::pipeline::read::read_blob;
use graviton::storage::fs::{FsBlockStore, FsManifestStore};
use graviton::storage::pack::{PackOptions, PackStore};
use graviton::storage::{
    BlockStore, CommitReport, ManifestStore, PutOutcome, StoreError, StoreFuture, WriteSession,
};

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use support::node::random_bytes;

fn mb_per_s(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e6
}

/// Best of `runs` timings.
fn best<F: FnMut() -> Duration>(runs: usize, mut f: F) -> Duration {
    (0..runs).map(|_| f()).min().expect("at least one run")
}

fn raw_cdc_blake3(data: &[u8]) -> Duration {
    let started = Instant::now();
    let mut blocks = 0usize;
    for chunk in fastcdc::v2020::FastCDC::new(data, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK) {
        let hash = blake3::hash(&data[chunk.offset..chunk.offset + chunk.length]);
        blocks += hash.as_bytes()[0] as usize & 1;
    }
    std::hint::black_box(blocks);
    started.elapsed()
}

fn frames(data: &Bytes) -> Vec<Result<Bytes, std::io::Error>> {
    (0..data.len())
        .step_by(64 * 1024)
        .map(|at| Ok(data.slice(at..(at + 64 * 1024).min(data.len()))))
        .collect()
}

/// The disk baseline: `data` written into 32 MiB files in a fresh directory (beside the
/// stores' directories), one `fdatasync` per file, then one directory fsync.
fn synced_pack_files(data: &[u8]) -> Duration {
    use std::io::Write;
    let dir = tempfile::tempdir().expect("tempdir");
    flush_dirty_pages();
    let started = Instant::now();
    for (i, piece) in data.chunks(32 << 20).enumerate() {
        let mut file = std::fs::File::create(dir.path().join(format!("{i}.pack"))).expect("create");
        file.write_all(piece).expect("write");
        file.sync_data().expect("fdatasync");
    }
    std::fs::File::open(dir.path())
        .and_then(|d| d.sync_all())
        .expect("fsync directory");
    started.elapsed()
}

/// Write back earlier runs' dirty pages so each run starts from the same state.
fn flush_dirty_pages() {
    let _ = std::process::Command::new("sync").status();
}

fn pack_options(fsync: bool) -> PackOptions {
    PackOptions {
        pack_size: 32 << 20,
        fsync,
        trace: None,
    }
}

fn limits_for(data: &Bytes) -> IngestLimits {
    IngestLimits {
        max_size: u64::MAX,
        declared_size: Some(data.len() as u64),
        idle_timeout: Duration::from_secs(60),
        digest: None,
    }
}

/// Under `GRAVITON_BENCH_PROFILE`, print `CLOCK_MONOTONIC` at the edges of each timed
/// ingest (`perf record -k CLOCK_MONOTONIC` timestamps match them).
fn profile_mark(what: &str) {
    if std::env::var_os("GRAVITON_BENCH_PROFILE").is_some() {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid out pointer for the call.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
        eprintln!("profile {what} {}.{:09}", now.tv_sec, now.tv_nsec);
    }
}

/// Ingest into a store opened in a fresh directory; returns the time and the directory.
async fn in_process_into(
    data: &Bytes,
    open: impl FnOnce(&std::path::Path) -> Arc<dyn BlockStore>,
    fsync: bool,
) -> (
    Duration,
    tempfile::TempDir,
    Arc<dyn BlockStore>,
    Arc<dyn ManifestStore>,
) {
    let dir = tempfile::tempdir().expect("tempdir");
    let blocks = open(dir.path());
    let manifests: Arc<dyn ManifestStore> =
        Arc::new(FsManifestStore::open(dir.path(), fsync).expect("manifests"));
    let body = futures_util::stream::iter(frames(data));
    flush_dirty_pages();
    let started = Instant::now();
    profile_mark("start");
    let report = ingest(
        body,
        limits_for(data),
        blocks.clone(),
        manifests.clone(),
        |_| {},
    )
    .await
    .expect("ingest");
    let elapsed = started.elapsed();
    profile_mark("end");
    assert_eq!(report.key.size, data.len() as u64);
    (elapsed, dir, blocks, manifests)
}

async fn in_process_packs(data: &Bytes, fsync: bool) -> Duration {
    in_process_into(
        data,
        |dir| Arc::new(PackStore::open_local(dir, pack_options(fsync)).expect("packs")),
        fsync,
    )
    .await
    .0
}

async fn in_process_legacy(data: &Bytes, fsync: bool) -> Duration {
    in_process_into(
        data,
        |dir| Arc::new(FsBlockStore::open(dir, fsync).expect("blocks")),
        fsync,
    )
    .await
    .0
}

/// Download the blob from packs, then read the same pack files raw (both page-cached),
/// then read them again and BLAKE3 them in `AVG_CHUNK` pieces on one thread (what a
/// verified download would cost if its hashing ran on one core).
async fn download_vs_raw(data: &Bytes) -> (Duration, Duration, Duration) {
    let (_, dir, blocks, manifests) = in_process_into(
        data,
        |dir| Arc::new(PackStore::open_local(dir, pack_options(false)).expect("packs")),
        false,
    )
    .await;
    let key = graviton::cas::BlobKey::of(data);
    let manifest = Arc::new(manifests.get(key).await.expect("get").expect("manifest"));
    let mut download = Duration::MAX;
    let mut raw = Duration::MAX;
    let mut hashed = Duration::MAX;
    for _ in 0..3 {
        let started = Instant::now();
        let mut stream = Box::pin(read_blob(blocks.clone(), manifest.clone(), None));
        let mut total = 0usize;
        while let Some(piece) = stream.next().await {
            total += piece.expect("block").len();
        }
        download = download.min(started.elapsed());
        assert_eq!(total, data.len());

        let started = Instant::now();
        let mut total = 0usize;
        for entry in walk(&dir.path().join("packs")) {
            total += std::fs::read(entry).expect("read pack").len();
        }
        raw = raw.min(started.elapsed());
        assert!(total >= data.len());

        let started = Instant::now();
        for entry in walk(&dir.path().join("packs")) {
            let bytes = std::fs::read(entry).expect("read pack");
            for piece in bytes.chunks(AVG_CHUNK) {
                std::hint::black_box(blake3::hash(piece));
            }
        }
        hashed = hashed.min(started.elapsed());
    }
    (download, raw, hashed)
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read dir").flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else if path.extension().is_some_and(|e| e == "pack") {
            out.push(path);
        }
    }
    out
}

/// A block store that keeps nothing (isolates the pipeline from the filesystem).
struct Discard;
struct DiscardSession;

impl WriteSession for DiscardSession {
    fn append(&mut self, _key: BlockKey, _data: Bytes) -> StoreFuture<'_, PutOutcome> {
        Box::pin(async { Ok(PutOutcome::Fresh) })
    }
    fn confirm(&mut self, _keys: Vec<BlockKey>) {}
    fn commit(self: Box<Self>) -> StoreFuture<'static, CommitReport> {
        Box::pin(async { Ok(CommitReport::default()) })
    }
    fn abort(self: Box<Self>) -> StoreFuture<'static, ()> {
        Box::pin(async { Ok(()) })
    }
}

impl BlockStore for Discard {
    fn begin(&self) -> Result<Box<dyn WriteSession>, StoreError> {
        Ok(Box::new(DiscardSession))
    }
    fn get(&self, _key: BlockKey) -> StoreFuture<'_, Option<Bytes>> {
        Box::pin(async { Ok(None) })
    }
    fn contains(&self, _key: BlockKey) -> StoreFuture<'_, bool> {
        Box::pin(async { Ok(false) })
    }
}

async fn in_process_discard(data: &Bytes) -> Duration {
    in_process_into(data, |_| Arc::new(Discard), false).await.0
}

async fn http_upload(data: &Bytes, fsync: bool) -> Duration {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = Config::for_test(dir.path());
    config.storage.fsync = fsync;
    let node = graviton::node::start(config).await.expect("node");
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    flush_dirty_pages();
    let started = Instant::now();
    let response = client
        .post(format!("{}/v1/blobs", node.base_url()))
        .body(data.clone())
        .send()
        .await
        .expect("upload");
    assert_eq!(response.status(), 201);
    let _ = response.bytes().await;
    let elapsed = started.elapsed();
    node.shutdown().await;
    elapsed
}

/// Peak RSS (VmHWM, KiB) of a fresh `graviton serve` after uploading `size` bytes.
fn served_peak_rss_kib(size: u64) -> Option<(u64, u64)> {
    use std::io::{Read, Write};
    let bin = env!("CARGO_BIN_EXE_graviton");
    let dir = tempfile::tempdir().ok()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let mut child = std::process::Command::new(bin)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(dir.path())
        .env("GRAVITON_STORAGE__FSYNC", "false")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let hwm = |pid: u32| -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    let mut stream = loop {
        if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            break s;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let idle = hwm(child.id());
    let head = format!(
        "POST /v1/blobs HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {size}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).ok()?;
    let piece = random_bytes(1 << 20, 99);
    let mut sent = 0u64;
    let mut counter = 0u64;
    let mut buf = piece.clone();
    while sent < size {
        // vary the content so nothing deduplicates
        counter += 1;
        buf[..8].copy_from_slice(&counter.to_le_bytes());
        let take = (size - sent).min(buf.len() as u64) as usize;
        stream.write_all(&buf[..take]).ok()?;
        sent += take as u64;
    }
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    let peak = hwm(child.id());
    let _ = child.kill();
    let _ = child.wait();
    Some((idle, peak))
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let size = if quick { 64 << 20 } else { 256 << 20 };
    let runs = if quick { 2 } else { 3 };
    // Only raw, discard, disk and durable packs (iterating on the pack writer).
    let packs_only = std::env::var("GRAVITON_BENCH_PACKS_ONLY").is_ok();
    let data = Bytes::from(random_bytes(size, 7));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");

    println!(
        "graviton ingest benchmark: {} MiB of random data, best of {runs}",
        size >> 20
    );
    let row = |name: &str, bytes: usize, d: Duration, base: Option<(&str, Duration)>| match base {
        Some((base_name, b)) => println!(
            "{name:<52} {:>8.1} MB/s   ratio vs {base_name}: {:.2}",
            mb_per_s(bytes, d),
            b.as_secs_f64() / d.as_secs_f64()
        ),
        None => println!("{name:<52} {:>8.1} MB/s   (baseline)", mb_per_s(bytes, d)),
    };
    let raw = best(runs, || raw_cdc_blake3(&data));
    row(
        "raw FastCDC + BLAKE3 (1 thread, in memory)",
        size,
        raw,
        None,
    );
    // One step only, five times (under `perf record`): `durable` or `discard`.
    if let Ok(step) = std::env::var("GRAVITON_BENCH_PROFILE") {
        for _ in 0..5 {
            let took = match step.as_str() {
                "discard" => runtime.block_on(in_process_discard(&data)),
                _ => runtime.block_on(in_process_packs(&data, true)),
            };
            row(&format!("profile: {step}"), size, took, Some(("raw", raw)));
        }
        return;
    }
    let ingest_discard = best(runs, || runtime.block_on(in_process_discard(&data)));
    row(
        "in-process ingest, blocks discarded",
        size,
        ingest_discard,
        Some(("raw", raw)),
    );
    if !packs_only {
        let legacy_sync = best(1, || runtime.block_on(in_process_legacy(&data, true)));
        row(
            "in-process ingest, file per block (fsync on)",
            size,
            legacy_sync,
            Some(("raw", raw)),
        );
        let packs_nosync = best(runs, || runtime.block_on(in_process_packs(&data, false)));
        row(
            "in-process ingest to packs (fsync off)",
            size,
            packs_nosync,
            Some(("raw", raw)),
        );
    }
    let disk = best(runs, || synced_pack_files(&data));
    row(
        "disk: 32 MiB files, one fdatasync each (baseline)",
        size,
        disk,
        None,
    );
    let packs_sync = best(runs, || runtime.block_on(in_process_packs(&data, true)));
    row(
        "in-process ingest to packs (fsync on, default)",
        size,
        packs_sync,
        Some(("raw", raw)),
    );
    row(
        "in-process ingest to packs (fsync on, default)",
        size,
        packs_sync,
        Some(("disk", disk)),
    );
    if packs_only {
        return;
    }
    let http = best(runs, || runtime.block_on(http_upload(&data, true)));
    row(
        "HTTP upload, one node, loopback (fsync on)",
        size,
        http,
        Some(("in-process", packs_sync)),
    );
    let (download, raw_read, hashed_read) = runtime.block_on(download_vs_raw(&data));
    row(
        "raw read of the pack files (page cache)",
        size,
        raw_read,
        None,
    );
    row(
        "raw read + BLAKE3 per 64 KiB, one thread",
        size,
        hashed_read,
        Some(("raw read", raw_read)),
    );
    row(
        "download from packs (verified, page cache)",
        size,
        download,
        Some(("raw read", raw_read)),
    );

    if !quick || std::env::var("GRAVITON_BENCH_GIB").is_ok() {
        let gib = Bytes::from(random_bytes(1 << 30, 8));
        let raw = best(2, || raw_cdc_blake3(&gib));
        row("1 GiB: raw FastCDC + BLAKE3", 1 << 30, raw, None);
        let disk = best(2, || synced_pack_files(&gib));
        row(
            "1 GiB: disk, 32 MiB files, one fdatasync each",
            1 << 30,
            disk,
            None,
        );
        let packs_sync = best(2, || runtime.block_on(in_process_packs(&gib, true)));
        row(
            "1 GiB: ingest to packs (fsync on, default)",
            1 << 30,
            packs_sync,
            Some(("raw", raw)),
        );
        row(
            "1 GiB: ingest to packs (fsync on, default)",
            1 << 30,
            packs_sync,
            Some(("disk", disk)),
        );
    }

    let large_gib: u64 = std::env::var("GRAVITON_BENCH_LARGE_GIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let small = 64u64 << 20;
    let large = if quick { 512u64 << 20 } else { large_gib << 30 };
    if let (Some((idle_s, peak_s)), Some((idle_l, peak_l))) =
        (served_peak_rss_kib(small), served_peak_rss_kib(large))
    {
        println!(
            "peak RSS of graviton serve: idle {} MiB; {} MiB upload -> {} MiB; {} MiB upload -> {} MiB (ratio large/small {:.2})",
            idle_s.max(idle_l) / 1024,
            small >> 20,
            peak_s / 1024,
            large >> 20,
            peak_l / 1024,
            peak_l as f64 / peak_s.max(1) as f64
        );
    } else {
        println!("peak RSS: could not run graviton serve");
    }
}
