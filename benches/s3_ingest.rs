//! S3 ingest against a real S3-compatible server (Garage from scripts/services.sh;
//! `GRAVITON_TEST_S3_*` say where), printed as ratios from one run over the same bytes:
//!
//! 1. plain PUTs of the bytes in pack-sized (32 MiB) objects, one at a time: the baseline
//!    of the storage target (S3 ingest >= 0.8 of it);
//! 2. the ingest pipeline into S3 packs with the node-local (redb) index;
//! 3. the same into S3 packs with the cluster's shared PostgreSQL index (when
//!    `GRAVITON_TEST_DATABASE_URL` or the local server is reachable): index entries and
//!    the manifest in one transaction, a HEAD per pack;
//!    Then the ingested blob is downloaded through the product's read path (`read_blob`,
//!    verified) and compared with raw whole GETs of the same pack objects from the same
//!    server, one at a time and all at once (the download target: >= 0.8 of raw reads);
//! 4. one PUT per block (FastCDC blocks, BLAKE3-named objects), 16 in flight: the layout
//!    packs replace;
//! 5. 512 small uploads (100 KiB) 32 at a time through the pipeline (group commit of their
//!    last packs, STO-21) against one PUT per upload of the same bytes, as many at a time.
//!
//! Each row prints throughput and the requests it made (PUTs, HEADs). Random data, so
//! nothing deduplicates. Run: `scripts/services.sh` (sourced), then
//! `cargo bench --bench s3_ingest` (`GRAVITON_BENCH_S3_MIB` sets the size, default 128).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use graviton::cas::{AVG_CHUNK, MAX_CHUNK, MIN_CHUNK};
use graviton::config::{HumanDuration, Secret};
use graviton::pipeline::ingest::{IngestLimits, ingest};
use graviton::pipeline::read::read_blob;
use graviton::storage::config::S3Config;
use graviton::storage::fs::FsManifestStore;
use graviton::storage::pack::format::PackId;
use graviton::storage::pack::medium::Medium;
use graviton::storage::pack::s3::S3Medium;
use graviton::storage::pack::shared::PgIndex;
use graviton::storage::pack::{PackOptions, PackStore};
use graviton::storage::pg::PgManifestStore;
use graviton::storage::{BlockStore, ManifestStore};

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use support::node::random_bytes;

const PACK: usize = 32 << 20;
const IN_FLIGHT: usize = 16;

fn s3_config(prefix: &str) -> Option<S3Config> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    Some(S3Config {
        endpoint: var("GRAVITON_TEST_S3_ENDPOINT")?,
        bucket: var("GRAVITON_TEST_S3_BUCKET")?,
        region: var("GRAVITON_TEST_S3_REGION").unwrap_or_else(|| "garage".into()),
        path_style: true,
        prefix: prefix.to_string(),
        access_key_id: var("GRAVITON_TEST_S3_ACCESS_KEY")?,
        secret_access_key: Some(Secret::new(var("GRAVITON_TEST_S3_SECRET_KEY")?)),
        request_timeout: HumanDuration(Duration::from_secs(60)),
        max_retries: 2,
        ..Default::default()
    })
}

async fn medium(prefix: &str) -> Arc<S3Medium> {
    let medium = S3Medium::new(&s3_config(prefix).expect("S3 config"), None).expect("S3 medium");
    medium.probe().await.expect("S3 probe");
    Arc::new(medium)
}

/// Objects under the medium's prefix, then delete them (keeps the bucket small).
async fn count_and_clear(medium: Arc<S3Medium>) -> usize {
    tokio::task::spawn_blocking(move || {
        let listed = medium.list().expect("list");
        for (id, _) in &listed {
            medium.delete(id).expect("delete");
        }
        listed.len()
    })
    .await
    .expect("task")
}

fn frames(data: &Bytes) -> Vec<Result<Bytes, std::io::Error>> {
    (0..data.len())
        .step_by(64 * 1024)
        .map(|at| Ok(data.slice(at..(at + 64 * 1024).min(data.len()))))
        .collect()
}

fn limits_for(data: &Bytes) -> IngestLimits {
    IngestLimits {
        max_size: u64::MAX,
        declared_size: Some(data.len() as u64),
        idle_timeout: Duration::from_secs(120),
        digest: None,
    }
}

fn options() -> PackOptions {
    PackOptions {
        pack_size: PACK as u64,
        fsync: false,
        trace: None,
    }
}

async fn plain_pack_puts(data: &Bytes) -> (Duration, usize) {
    let medium = medium(&format!("bench-plain-{}", support::unique_suffix())).await;
    let pieces: Vec<Bytes> = (0..data.len())
        .step_by(PACK)
        .map(|at| data.slice(at..(at + PACK).min(data.len())))
        .collect();
    let m = medium.clone();
    let started = Instant::now();
    tokio::task::spawn_blocking(move || {
        for piece in pieces {
            let id = PackId(*blake3::hash(&piece).as_bytes());
            m.put_pack(&id, piece).expect("PUT");
        }
    })
    .await
    .expect("task");
    let elapsed = started.elapsed();
    (elapsed, count_and_clear(medium).await)
}

async fn packs_local_index(data: &Bytes) -> (Duration, usize, Download) {
    let medium = medium(&format!("bench-packs-{}", support::unique_suffix())).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let store: Arc<dyn BlockStore> =
        Arc::new(PackStore::open(dir.path(), medium.clone(), options()).expect("store"));
    let manifests: Arc<dyn ManifestStore> =
        Arc::new(FsManifestStore::open(dir.path(), false).expect("manifests"));
    let started = Instant::now();
    let report = ingest(
        futures_util::stream::iter(frames(data)),
        limits_for(data),
        store.clone(),
        manifests.clone(),
        |_| {},
    )
    .await
    .expect("ingest");
    let elapsed = started.elapsed();
    assert_eq!(report.key.size, data.len() as u64);
    let manifest = Arc::new(
        manifests
            .get(report.key)
            .await
            .expect("get")
            .expect("manifest"),
    );
    let download = download_vs_raw(store, manifest, medium.clone(), data.len()).await;
    (elapsed, count_and_clear(medium).await, download)
}

/// Best of two each: the blob through the product's read path, whole GETs of its pack
/// objects one at a time, and all of them at once.
struct Download {
    product: Duration,
    /// GET requests of one product download.
    product_gets: u64,
    whole: Duration,
    parallel: Duration,
}

async fn download_vs_raw(
    blocks: Arc<dyn BlockStore>,
    manifest: Arc<graviton::cas::Manifest>,
    medium: Arc<S3Medium>,
    size: usize,
) -> Download {
    let ids: Vec<PackId> = {
        let m = medium.clone();
        tokio::task::spawn_blocking(move || m.list().expect("list"))
            .await
            .expect("task")
            .into_iter()
            .map(|(id, _)| id)
            .collect()
    };
    let mut best = Download {
        product: Duration::MAX,
        product_gets: 0,
        whole: Duration::MAX,
        parallel: Duration::MAX,
    };
    for _ in 0..2 {
        let gets_before = medium.block_reads();
        let started = Instant::now();
        let mut stream = Box::pin(read_blob(blocks.clone(), manifest.clone(), None));
        let mut total = 0usize;
        while let Some(piece) = stream.next().await {
            total += piece.expect("block").len();
        }
        best.product = best.product.min(started.elapsed());
        best.product_gets = medium.block_reads() - gets_before;
        assert_eq!(total, size);

        let (m, list) = (medium.clone(), ids.clone());
        let started = Instant::now();
        let total = tokio::task::spawn_blocking(move || {
            list.iter()
                .map(|id| m.read_all(id).expect("GET").len())
                .sum::<usize>()
        })
        .await
        .expect("task");
        best.whole = best.whole.min(started.elapsed());
        assert!(total >= size);

        let started = Instant::now();
        let gets = ids.iter().map(|id| {
            let (m, id) = (medium.clone(), *id);
            tokio::task::spawn_blocking(move || m.read_all(&id).expect("GET").len())
        });
        let total: usize = futures_util::future::join_all(gets)
            .await
            .into_iter()
            .map(|n| n.expect("task"))
            .sum();
        best.parallel = best.parallel.min(started.elapsed());
        assert!(total >= size);
    }
    best
}

async fn packs_shared_index(data: &Bytes, db: &support::TestDatabase) -> (Duration, usize) {
    let pool = sqlx::PgPool::connect(db.url()).await.expect("pool");
    graviton::storage::pg::migrate(&pool)
        .await
        .expect("migrate");
    let medium = medium(&format!("bench-shared-{}", support::unique_suffix())).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = PackStore::open_shared(
        dir.path(),
        medium.clone(),
        options(),
        PgIndex::new(pool.clone()),
    )
    .expect("store");
    let manifests: Arc<dyn ManifestStore> = Arc::new(PgManifestStore::new(pool));
    let started = Instant::now();
    let report = ingest(
        futures_util::stream::iter(frames(data)),
        limits_for(data),
        Arc::new(store),
        manifests,
        |_| {},
    )
    .await
    .expect("ingest");
    let elapsed = started.elapsed();
    assert_eq!(report.key.size, data.len() as u64);
    (elapsed, count_and_clear(medium).await)
}

async fn put_per_block(data: &Bytes) -> (Duration, usize) {
    let medium = medium(&format!("bench-blocks-{}", support::unique_suffix())).await;
    let started = Instant::now();
    let blocks: Vec<Bytes> = fastcdc::v2020::FastCDC::new(data, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK)
        .map(|c| data.slice(c.offset..c.offset + c.length))
        .collect();
    let m = medium.clone();
    futures_util::stream::iter(blocks)
        .map(|block| {
            let m = m.clone();
            tokio::task::spawn_blocking(move || {
                let id = PackId(*blake3::hash(&block).as_bytes());
                m.put_pack(&id, block).expect("PUT");
            })
        })
        .buffer_unordered(IN_FLIGHT)
        .for_each(|done| async move { done.expect("task") })
        .await;
    let elapsed = started.elapsed();
    (elapsed, count_and_clear(medium).await)
}

/// Small uploads committing together (group commit, STO-21): `SMALL_UPLOADS` uploads of
/// `SMALL_SIZE` bytes each, `SMALL_IN_FLIGHT` at a time, through the ingest pipeline into
/// S3 packs (redb index); returns the time and the packs PUT. The baseline is one PUT
/// per upload of the same bytes, as many at a time.
const SMALL_UPLOADS: usize = 512;
const SMALL_SIZE: usize = 100 << 10;
const SMALL_IN_FLIGHT: usize = 32;

async fn small_uploads(data: &Bytes) -> (Duration, u64) {
    let medium = medium(&format!("bench-small-{}", support::unique_suffix())).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let store: Arc<dyn BlockStore> =
        Arc::new(PackStore::open(dir.path(), medium.clone(), options()).expect("store"));
    let manifests: Arc<dyn ManifestStore> =
        Arc::new(FsManifestStore::open(dir.path(), false).expect("manifests"));
    let pieces: Vec<Bytes> = (0..SMALL_UPLOADS)
        .map(|i| data.slice(i * SMALL_SIZE..(i + 1) * SMALL_SIZE))
        .collect();
    let before = medium.pack_puts();
    let started = Instant::now();
    futures_util::stream::iter(pieces)
        .map(|piece| {
            let (store, manifests) = (store.clone(), manifests.clone());
            async move {
                let limits = limits_for(&piece);
                ingest(
                    futures_util::stream::iter(frames(&piece)),
                    limits,
                    store,
                    manifests,
                    |_| {},
                )
                .await
                .expect("ingest")
            }
        })
        .buffer_unordered(SMALL_IN_FLIGHT)
        .for_each(|_| async {})
        .await;
    let elapsed = started.elapsed();
    let puts = medium.pack_puts() - before;
    count_and_clear(medium).await;
    (elapsed, puts)
}

async fn small_plain_puts(data: &Bytes) -> (Duration, usize) {
    let medium = medium(&format!("bench-small-plain-{}", support::unique_suffix())).await;
    let pieces: Vec<Bytes> = (0..SMALL_UPLOADS)
        .map(|i| data.slice(i * SMALL_SIZE..(i + 1) * SMALL_SIZE))
        .collect();
    let m = medium.clone();
    let started = Instant::now();
    futures_util::stream::iter(pieces)
        .map(|piece| {
            let m = m.clone();
            tokio::task::spawn_blocking(move || {
                let id = PackId(*blake3::hash(&piece).as_bytes());
                m.put_pack(&id, piece).expect("PUT");
            })
        })
        .buffer_unordered(SMALL_IN_FLIGHT)
        .for_each(|done| async move { done.expect("task") })
        .await;
    let elapsed = started.elapsed();
    (elapsed, count_and_clear(medium).await)
}

fn main() {
    let mib: usize = std::env::var("GRAVITON_BENCH_S3_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128);
    let size = mib << 20;
    if s3_config("probe").is_none() {
        eprintln!("s3_ingest: GRAVITON_TEST_S3_* not set; source scripts/services.sh first");
        std::process::exit(2);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let data = Bytes::from(random_bytes(size, 11));
    let gib = size as f64 / (1u64 << 30) as f64;
    println!("graviton S3 ingest benchmark: {mib} MiB of random data, one run each");
    let row = |name: &str, d: Duration, requests: String, base: Option<Duration>| {
        let rate = size as f64 / d.as_secs_f64() / 1e6;
        let ratio = base
            .map(|b| format!("{:.2}", b.as_secs_f64() / d.as_secs_f64()))
            .unwrap_or_else(|| "baseline".into());
        println!("{name:<48} {rate:>8.1} MB/s  ratio {ratio:>8}  {requests}");
    };
    runtime.block_on(async {
        let (plain, plain_puts) = plain_pack_puts(&data).await;
        row(
            "plain PUTs, 32 MiB objects, one at a time",
            plain,
            format!("{plain_puts} PUTs ({:.0}/GiB)", plain_puts as f64 / gib),
            None,
        );
        let (local, local_puts, download) = packs_local_index(&data).await;
        row(
            "ingest into S3 packs, redb index",
            local,
            format!("{local_puts} PUTs ({:.0}/GiB)", local_puts as f64 / gib),
            Some(plain),
        );
        row(
            "raw whole GETs of those packs, one at a time",
            download.whole,
            format!("{local_puts} GETs (download baseline)"),
            None,
        );
        row(
            "raw whole GETs of those packs, all at once",
            download.parallel,
            format!("{local_puts} GETs"),
            Some(download.whole),
        );
        row(
            "download from S3 packs (verified, read_blob)",
            download.product,
            format!(
                "{} GETs ({:.0}/GiB), vs whole GETs one at a time",
                download.product_gets,
                download.product_gets as f64 / gib
            ),
            Some(download.whole),
        );
        println!(
            "download from S3 packs / fastest raw GETs of the same packs: {:.2} (target >= 0.8)",
            download.whole.min(download.parallel).as_secs_f64() / download.product.as_secs_f64()
        );
        match support::TestDatabase::create("bench_s3_ingest").await {
            Some(db) => {
                let (shared, shared_puts) = packs_shared_index(&data, &db).await;
                row(
                    "ingest into S3 packs, shared PostgreSQL index",
                    shared,
                    format!(
                        "{shared_puts} PUTs + {shared_puts} HEADs ({:.0} requests/GiB)",
                        2.0 * shared_puts as f64 / gib
                    ),
                    Some(plain),
                );
            }
            None => println!("ingest into S3 packs, shared PostgreSQL index: no database"),
        }
        let (per_block, block_puts) = put_per_block(&data).await;
        row(
            &format!("one PUT per block, {IN_FLIGHT} in flight"),
            per_block,
            format!("{block_puts} PUTs ({:.0}/GiB)", block_puts as f64 / gib),
            Some(plain),
        );
        println!(
            "packs vs one PUT per block: {:.2}x the throughput, {:.0}x fewer requests",
            per_block.as_secs_f64() / local.as_secs_f64(),
            block_puts as f64 / local_puts.max(1) as f64
        );
        if size >= SMALL_UPLOADS * SMALL_SIZE {
            let small_bytes = (SMALL_UPLOADS * SMALL_SIZE) as f64;
            let small_gib = small_bytes / (1u64 << 30) as f64;
            let (plain, plain_puts) = small_plain_puts(&data).await;
            let (grouped, puts) = small_uploads(&data).await;
            println!(
                "{SMALL_UPLOADS} uploads of {} KiB, {SMALL_IN_FLIGHT} at a time: one PUT per upload \
                 {:.1} MB/s ({plain_puts} PUTs); ingest with group commit {:.1} MB/s, ratio {:.2}, \
                 {puts} PUTs ({:.3} per upload, {:.0}/GiB)",
                SMALL_SIZE >> 10,
                small_bytes / plain.as_secs_f64() / 1e6,
                small_bytes / grouped.as_secs_f64() / 1e6,
                plain.as_secs_f64() / grouped.as_secs_f64(),
                puts as f64 / SMALL_UPLOADS as f64,
                puts as f64 / small_gib
            );
        }
    });
}
