//! STO-25: a collector that runs in the gap between an upload's index commit and its
//! manifest, with `min_age` 0 and `retention` 0 (quarantine and purge at once), takes
//! none of the blocks that manifest names. On one node the index (redb) and the manifest
//! store are two commits, so in that gap nothing else references the upload's fresh
//! blocks; the commit pins them across it.
//!
//! The collector is run from inside the gap (the pack store's step trace at `index
//! committed`, before the manifest is written), on real redb and a real manifest store:
//! the file manifest store, and the PostgreSQL one. The test confirms that the fault
//! landed: the manifest did not exist yet and the upload's blocks were the collector's
//! candidates (referenced by no manifest at its mark).

#[allow(unused_imports)]
mod support;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use graviton::cas::BlobKey;
use graviton::pipeline::ingest::{IngestLimits, ingest};
use graviton::pipeline::read::read_blob;
use graviton::storage::fs::FsManifestStore;
use graviton::storage::pack::gc::{self, GcOptions, GcReport, Quiet};
use graviton::storage::pack::{PackOptions, PackStore};
use graviton::storage::{BlockStore, ManifestStore};
use support::TestDatabase;

fn content(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed + 1;
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u8
        })
        .collect()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// What the collector run inside the gap saw.
struct InGap {
    manifest_existed: bool,
    report: GcReport,
}

/// Upload `data` into a local pack store with `manifests`, running a collector (min_age
/// 0, retention 0, purge) when the index has committed and the manifest is not yet
/// written; then download the key. Returns what the collector saw and the download.
async fn upload_with_a_collector_in_the_gap(
    dir: &std::path::Path,
    manifests: Arc<dyn ManifestStore>,
    data: Vec<u8>,
) -> (InGap, Result<Vec<u8>, String>) {
    let key = BlobKey::of(&data);
    let store_cell: Arc<OnceLock<PackStore>> = Arc::new(OnceLock::new());
    let seen: Arc<Mutex<Option<InGap>>> = Arc::new(Mutex::new(None));
    let trace: Arc<dyn Fn(&'static str) + Send + Sync> = {
        let (store_cell, seen, manifests) = (store_cell.clone(), seen.clone(), manifests.clone());
        Arc::new(move |step| {
            if step != "index committed" || seen.lock().unwrap().is_some() {
                return;
            }
            let store = store_cell.get().expect("store set").clone();
            let manifests = manifests.clone();
            // Run the collector here, inside the gap, to completion.
            let gap = tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(async move {
                    // The blocks' last_ref is the commit's clock: let the clock pass it,
                    // so min_age 0 makes them candidates (an observable state).
                    let entered = now_ms();
                    while now_ms() < entered + 2 {
                        tokio::task::yield_now().await;
                    }
                    let manifest_existed = manifests.get(key).await.unwrap().is_some();
                    let report = gc::collect(
                        &store,
                        manifests.as_ref(),
                        GcOptions {
                            min_age: Duration::ZERO,
                            retention: Duration::ZERO,
                            compact_below: 0.5,
                            dry_run: false,
                            purge: true,
                            batch: 64,
                        },
                        &mut Quiet,
                    )
                    .await
                    .unwrap();
                    InGap {
                        manifest_existed,
                        report,
                    }
                })
            });
            *seen.lock().unwrap() = Some(gap);
        })
    };
    let store = PackStore::open_local(
        dir,
        PackOptions {
            pack_size: 1 << 20,
            fsync: false,
            trace: Some(trace),
        },
    )
    .unwrap();
    store_cell.set(store.clone()).ok().unwrap();
    let blocks: Arc<dyn BlockStore> = Arc::new(store.clone());
    let pieces: Vec<Result<Bytes, std::io::Error>> = data
        .chunks(100_000)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    let report = ingest(
        futures_util::stream::iter(pieces),
        IngestLimits {
            max_size: 1 << 30,
            declared_size: None,
            idle_timeout: Duration::from_secs(5),
            digest: None,
        },
        blocks.clone(),
        manifests.clone(),
        |_| {},
    )
    .await
    .expect("the upload is acknowledged");
    assert_eq!(report.key, key);
    let gap = seen
        .lock()
        .unwrap()
        .take()
        .expect("the collector ran in the gap");
    let manifest = manifests.get(key).await.unwrap().expect("manifest written");
    let mut out = Vec::new();
    let mut stream = Box::pin(read_blob(blocks, Arc::new(manifest), None));
    let mut failed = None;
    while let Some(piece) = stream.next().await {
        match piece {
            Ok(piece) => out.extend_from_slice(&piece),
            Err(err) => {
                failed = Some(format!("{err}"));
                break;
            }
        }
    }
    (gap, failed.map_or(Ok(out), Err))
}

fn check(gap: InGap, download: Result<Vec<u8>, String>, data: &[u8]) {
    // The fault landed: the collector ran before the manifest, and the upload's blocks
    // were its candidates.
    assert!(
        !gap.manifest_existed,
        "the collector ran after the manifest"
    );
    assert!(
        gap.report.candidates > 0,
        "the upload's blocks were not candidates: {:?}",
        gap.report
    );
    assert_eq!(
        gap.report.quarantined, 0,
        "the collector quarantined blocks of the acknowledged upload: {:?}",
        gap.report
    );
    match download {
        Ok(got) => assert!(got == data, "the download is not byte-exact"),
        Err(err) => panic!("the acknowledged blob does not download: {err}"),
    }
}

// Checks STO-25 on redb with the file manifest store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_in_the_gap_before_the_manifest_takes_none_of_its_blocks_on_redb() {
    let dir = tempfile::tempdir().unwrap();
    let manifests: Arc<dyn ManifestStore> =
        Arc::new(FsManifestStore::open(dir.path(), false).unwrap());
    let data = content(1_500_000, 7);
    let (gap, download) =
        upload_with_a_collector_in_the_gap(dir.path(), manifests, data.clone()).await;
    check(gap, download, &data);
}

// Checks STO-25 on redb with the PostgreSQL manifest store (the interleaving test's
// PostgreSQL setup, where this was found with min_age 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_in_the_gap_before_the_manifest_takes_none_of_its_blocks_on_postgres() {
    let Some(db) = TestDatabase::create("a_collector_in_the_gap_on_postgres").await else {
        return;
    };
    let pool = graviton::storage::pg::connect_pool(
        db.url(),
        4,
        Duration::from_secs(5),
        "graviton-commit-pins",
    )
    .await
    .unwrap();
    graviton::storage::pg::migrate(&pool).await.unwrap();
    let manifests: Arc<dyn ManifestStore> =
        Arc::new(graviton::storage::pg::PgManifestStore::new(pool));
    let dir = tempfile::tempdir().unwrap();
    let data = content(1_500_000, 8);
    let (gap, download) =
        upload_with_a_collector_in_the_gap(dir.path(), manifests, data.clone()).await;
    check(gap, download, &data);
}
