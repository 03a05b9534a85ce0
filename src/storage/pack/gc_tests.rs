//! Collector, verify and migration on a real directory.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;

use std::fs::File;
use std::path::Path;

use super::format::PackId;
use super::gc::{self, GcOptions, Quiet};
use super::medium::Medium;
use super::*;
use crate::cas::{BlobKey, Manifest};
use crate::pipeline::ingest::{IngestLimits, ingest};
use crate::pipeline::read::read_blob;
use crate::storage::ManifestStore;
use crate::storage::fs::FsManifestStore;

fn data(len: usize, seed: u64) -> Vec<u8> {
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

struct Fixture {
    dir: tempfile::TempDir,
    store: PackStore,
    manifests: Arc<FsManifestStore>,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let medium = medium::LocalMedium::open(&dir.path().join("packs"), false, None).unwrap();
        Self::on(dir, Arc::new(medium))
    }

    /// A store on `medium` with its index and manifests under `dir`.
    fn on(dir: tempfile::TempDir, medium: Arc<dyn Medium>) -> Self {
        let store = PackStore::open(
            dir.path(),
            medium,
            PackOptions {
                pack_size: 32 << 20,
                fsync: false,
                trace: None,
            },
        )
        .unwrap();
        let manifests = Arc::new(FsManifestStore::open(dir.path(), false).unwrap());
        Self {
            dir,
            store,
            manifests,
        }
    }

    async fn upload(&self, content: &[u8]) -> BlobKey {
        self.try_upload(content).await.unwrap()
    }

    async fn try_upload(
        &self,
        content: &[u8],
    ) -> Result<BlobKey, crate::pipeline::ingest::IngestError> {
        let pieces: Vec<Result<Bytes, std::io::Error>> = content
            .chunks(100_000)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let limits = IngestLimits {
            max_size: 1 << 30,
            declared_size: None,
            idle_timeout: Duration::from_secs(5),
            digest: None,
        };
        ingest(
            futures_util::stream::iter(pieces),
            limits,
            Arc::new(self.store.clone()),
            self.manifests.clone(),
            |_| {},
        )
        .await
        .map(|stored| stored.key)
    }

    async fn download(&self, key: BlobKey) -> Vec<u8> {
        let manifest: Manifest = self.manifests.get(key).await.unwrap().unwrap();
        let mut stream = Box::pin(read_blob(
            Arc::new(self.store.clone()),
            Arc::new(manifest),
            None,
        ));
        let mut out = Vec::new();
        while let Some(piece) = stream.next().await {
            out.extend_from_slice(&piece.unwrap());
        }
        out
    }

    fn pack_files(&self) -> usize {
        self.store.medium().list().unwrap().len()
    }
}

fn options(min_age: Duration, dry_run: bool, purge: bool) -> GcOptions {
    GcOptions {
        min_age,
        retention: Duration::ZERO,
        compact_below: 0.9,
        dry_run,
        purge,
        // Small batches: every run spans several quarantine and purge transactions.
        batch: 2,
    }
}

// Checks STO-6.
#[tokio::test]
async fn deleted_blobs_are_collected_and_live_ones_stay_byte_exact() {
    let f = Fixture::new();
    let (a, b) = (data(2 << 20, 1), data(2 << 20, 2));
    let key_a = f.upload(&a).await;
    let key_b = f.upload(&b).await;
    assert_eq!(f.pack_files(), 2);
    assert!(f.manifests.delete(key_a).await.unwrap());
    tokio::time::sleep(Duration::from_millis(5)).await;

    // young blocks are kept whatever references them
    let young = gc::collect(
        &f.store,
        f.manifests.as_ref(),
        options(Duration::from_secs(3600), false, true),
        &mut Quiet,
    )
    .await
    .unwrap();
    assert_eq!(young.candidates, 0);
    // a dry run reports and changes nothing
    let dry = gc::collect(
        &f.store,
        f.manifests.as_ref(),
        options(Duration::ZERO, true, true),
        &mut Quiet,
    )
    .await
    .unwrap();
    assert!(dry.candidates > 0);
    assert_eq!(dry.packs_retired, 1);
    assert_eq!(f.store.index().unwrap().quarantined().unwrap().len(), 0);
    assert_eq!(f.pack_files(), 2);

    let run = gc::collect(
        &f.store,
        f.manifests.as_ref(),
        options(Duration::ZERO, false, false),
        &mut Quiet,
    )
    .await
    .unwrap();
    assert_eq!(run.quarantined, dry.candidates);
    assert_eq!(run.packs_retired, 1);
    assert_eq!(f.pack_files(), 2, "quarantine deletes no pack");
    // restorable during the retention window (the retired pack is revived)
    assert_eq!(
        f.store.index().unwrap().restore_quarantine().unwrap(),
        run.quarantined
    );
    assert_eq!(
        f.store
            .index()
            .unwrap()
            .packs()
            .unwrap()
            .iter()
            .filter(|p| p.retired)
            .count(),
        0
    );
    let run = gc::collect(
        &f.store,
        f.manifests.as_ref(),
        options(Duration::ZERO, false, true),
        &mut Quiet,
    )
    .await
    .unwrap();
    assert!(run.quarantined > 0);
    // retention counts from retirement: this run retired the pack, the next one purges it
    assert_eq!(run.packs_deleted, 0);
    assert_eq!(f.pack_files(), 2);
    tokio::time::sleep(Duration::from_millis(5)).await;
    let run = gc::collect(
        &f.store,
        f.manifests.as_ref(),
        options(Duration::ZERO, false, true),
        &mut Quiet,
    )
    .await
    .unwrap();
    assert_eq!(run.packs_deleted, 1);
    assert!(run.bytes_reclaimed > 2 << 20);
    assert_eq!(f.pack_files(), 1);
    assert_eq!(f.download(key_b).await, b);
    // uploading the collected content again stores it afresh
    let again = f.upload(&a).await;
    assert_eq!(f.download(again).await, a);
}

#[tokio::test]
async fn sparse_packs_are_rewritten_and_shared_blocks_survive() {
    let f = Fixture::new();
    let whole = data(4 << 20, 3);
    let key_whole = f.upload(&whole).await;
    // the first half shares most of its blocks with the first upload's pack
    let half = whole[..2 << 20].to_vec();
    let key_half = f.upload(&half).await;
    assert!(f.manifests.delete(key_whole).await.unwrap());
    tokio::time::sleep(Duration::from_millis(5)).await;
    let run = gc::collect(
        &f.store,
        f.manifests.as_ref(),
        options(Duration::ZERO, false, true),
        &mut Quiet,
    )
    .await
    .unwrap();
    assert_eq!(run.packs_rewritten, 1, "{run:?}");
    assert_eq!(f.download(key_half).await, half);
    // the old pack is gone; what is left verifies clean
    let verified = gc::verify(&f.store, &mut Quiet).await.unwrap();
    assert!(verified.damaged.is_empty(), "{verified:?}");
    assert_eq!(verified.entries_affected, 0);
}

// Checks STO-4 and STO-19 (one node).
#[tokio::test]
async fn verify_reports_a_damaged_pack() {
    let f = Fixture::new();
    f.upload(&data(1 << 20, 4)).await;
    let clean = gc::verify(&f.store, &mut Quiet).await.unwrap();
    assert_eq!(clean.packs_checked, 1);
    assert!(clean.damaged.is_empty());
    let pack = f.store.index().unwrap().packs().unwrap()[0].id;
    let local = medium::LocalMedium::open(&f.dir.path().join("packs"), false, None).unwrap();
    let path = local.path_of(&pack);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let damaged = gc::verify(&f.store, &mut Quiet).await.unwrap();
    assert_eq!(damaged.damaged.len(), 1, "{damaged:?}");
    assert!(damaged.entries_affected > 0);
}

// Checks STO-5.
#[tokio::test]
async fn legacy_blocks_migrate_into_packs() {
    let dir = tempfile::tempdir().unwrap();
    let legacy = FsBlockStore::open(dir.path(), false).unwrap();
    let blocks: Vec<Bytes> = (0..20).map(|i| Bytes::from(data(30_000, 10 + i))).collect();
    for block in &blocks {
        legacy
            .put(BlockKey::of(block), block.clone())
            .await
            .unwrap();
    }
    let store = PackStore::open_local(
        dir.path(),
        PackOptions {
            pack_size: 32 << 20,
            fsync: false,
            trace: None,
        },
    )
    .unwrap();
    assert_eq!(gc::migrate_blocks(&store, &mut Quiet).await.unwrap(), 20);
    assert!(legacy.list().unwrap().is_empty());
    for block in &blocks {
        assert!(
            store
                .index()
                .unwrap()
                .lookup(&BlockKey::of(block))
                .unwrap()
                .is_some()
        );
        assert_eq!(
            store.get(BlockKey::of(block)).await.unwrap().as_ref(),
            Some(block)
        );
    }
}

// Checks STO-23: a block an upload of this process deduplicated against is pinned while
// the upload runs. The blob that held it is deleted and collected past min_age,
// retention and purge, twice, while the upload is paused (here: simply not committing);
// the block stays, and the commit succeeds with the block readable. (Before pins, the
// block was quarantined and purged under the upload and its commit failed with 503.)
#[tokio::test]
async fn a_paused_uploaders_dedup_block_is_pinned_until_its_commit() {
    let f = Fixture::new();
    let content = data(1 << 20, 9);
    let key = f.upload(&content).await;
    let manifest = f.manifests.get(key).await.unwrap().unwrap();
    let shared = manifest.blocks[0].key;
    let bytes = Bytes::copy_from_slice(&content[..manifest.blocks[0].size as usize]);

    // the paused upload found the block stored
    let mut session = f.store.begin().unwrap();
    assert_eq!(
        session.append(shared, bytes.clone()).await.unwrap(),
        PutOutcome::Duplicate
    );

    // meanwhile the blob is deleted and collected past min_age, retention, and purge
    assert!(f.manifests.delete(key).await.unwrap());
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut quarantined = 0;
    for _ in 0..2 {
        let report = gc::collect(
            &f.store,
            f.manifests.as_ref(),
            options(Duration::ZERO, false, true),
            &mut Quiet,
        )
        .await
        .unwrap();
        quarantined += report.quarantined;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The collector did collect the blob's other blocks: the run was not a no-op.
    assert_eq!(
        quarantined as usize,
        manifest.blocks.len() - 1,
        "every block but the pinned one was collected"
    );
    assert!(
        f.store.contains(shared).await.unwrap(),
        "the pinned block stays"
    );

    session.commit().await.unwrap();
    assert_eq!(f.store.get(shared).await.unwrap(), Some(bytes));

    // Once the session ended its pin is gone: the block is collectable again.
    for _ in 0..2 {
        gc::collect(
            &f.store,
            f.manifests.as_ref(),
            options(Duration::ZERO, false, true),
            &mut Quiet,
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        !f.store.contains(shared).await.unwrap(),
        "the pin outlived its session"
    );
}

/// A local medium whose next `delete`, once armed, says so and waits for a go-ahead: it
/// holds the collector at the instant between deciding to delete a pack and deleting it.
#[derive(Debug)]
struct GatedDelete {
    inner: medium::LocalMedium,
    gate: std::sync::Mutex<Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>>,
}

impl Medium for GatedDelete {
    fn publish(&self, spool: File, spool_path: &Path, id: &PackId) -> Result<(), StoreError> {
        self.inner.publish(spool, spool_path, id)
    }
    fn read(&self, id: &PackId, offset: u64, len: u64) -> Result<Bytes, StoreError> {
        self.inner.read(id, offset, len)
    }
    fn read_all(&self, id: &PackId) -> Result<Bytes, StoreError> {
        self.inner.read_all(id)
    }
    fn delete(&self, id: &PackId) -> Result<(), StoreError> {
        let gate = self.gate.lock().unwrap().take();
        if let Some((entered, go)) = gate {
            entered.send(()).unwrap();
            go.recv().unwrap();
        }
        self.inner.delete(id)
    }
    fn exists(&self, id: &PackId) -> Result<bool, StoreError> {
        self.inner.exists(id)
    }
    fn list(&self) -> Result<Vec<(PackId, u64)>, StoreError> {
        self.inner.list()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

// Checks STO-11: an upload re-publishes a pack under the name of a retired twin (same
// blocks, same order, so the same name) while the collector purges that twin. The
// collector deletes the object between the upload's publish and its commit. The upload
// must then fail with a retry answer, never commit an index entry over a missing pack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pack_republished_while_its_retired_twin_is_purged_is_never_lost() {
    let dir = tempfile::tempdir().unwrap();
    let (renamed_tx, renamed_rx) = std::sync::mpsc::channel::<()>();
    let renamed_tx = std::sync::Mutex::new(renamed_tx);
    let trace: SyncTrace = Arc::new(move |step| {
        if step == "pack renamed" {
            let _ = renamed_tx.lock().unwrap().send(());
        }
    });
    let local = medium::LocalMedium::open(&dir.path().join("packs"), false, Some(trace)).unwrap();
    let gated = Arc::new(GatedDelete {
        inner: local,
        gate: std::sync::Mutex::new(None),
    });
    let f = Arc::new(Fixture::on(dir, gated.clone()));
    let content = data(1 << 20, 21);
    let key = f.upload(&content).await;
    assert_eq!(f.pack_files(), 1);

    // the blob is deleted and its pack retired by a first run
    assert!(f.manifests.delete(key).await.unwrap());
    tokio::time::sleep(Duration::from_millis(5)).await;
    let run = gc::collect(
        &f.store,
        f.manifests.as_ref(),
        options(Duration::ZERO, false, false),
        &mut Quiet,
    )
    .await
    .unwrap();
    assert_eq!(run.packs_retired, 1, "{run:?}");
    tokio::time::sleep(Duration::from_millis(5)).await;
    while renamed_rx.try_recv().is_ok() {}

    // the purge run stops right before it deletes the retired pack's object
    let (entered_tx, entered_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel();
    *gated.gate.lock().unwrap() = Some((entered_tx, go_rx));
    let purge = {
        let f = f.clone();
        tokio::spawn(async move {
            gc::collect(
                &f.store,
                f.manifests.as_ref(),
                options(Duration::ZERO, false, true),
                &mut Quiet,
            )
            .await
        })
    };
    let entered_rx = tokio::task::spawn_blocking(move || entered_rx.recv().map(|()| entered_rx))
        .await
        .unwrap()
        .unwrap();
    drop(entered_rx);

    // the same content is uploaded again: its pack is published under the same name
    let upload = {
        let f = f.clone();
        let content = content.clone();
        tokio::spawn(async move { f.try_upload(&content).await })
    };
    tokio::task::spawn_blocking(move || renamed_rx.recv())
        .await
        .unwrap()
        .unwrap();
    // now the collector deletes the object
    go_tx.send(()).unwrap();
    let run = purge.await.unwrap().unwrap();
    assert_eq!(run.packs_deleted, 1, "{run:?}");

    match upload.await.unwrap() {
        Ok(again) => {
            // committed: then its blocks must be readable
            let manifest = f.manifests.get(again).await.unwrap().unwrap();
            let mut stream = Box::pin(read_blob(
                Arc::new(f.store.clone()),
                Arc::new(manifest),
                None,
            ));
            let mut out = Vec::new();
            while let Some(piece) = stream.next().await {
                out.extend_from_slice(&piece.unwrap_or_else(|e| {
                    panic!("an acknowledged upload lost its pack to the purge: {e}")
                }));
            }
            assert_eq!(out, content);
        }
        Err(err) => {
            assert!(err.to_string().contains("retry"), "{err}");
            assert!(f.manifests.get(key).await.unwrap().is_none(), "no manifest");
        }
    }
    // every pack the index names is on the medium, and a retry stores the blob
    for pack in f.store.index().unwrap().packs().unwrap() {
        assert!(f.store.medium().exists(&pack.id).unwrap(), "{}", pack.id);
    }
    let again = f.upload(&content).await;
    assert_eq!(f.download(again).await, content);
}
