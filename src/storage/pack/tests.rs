//! Pack store behaviour on a real directory.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;

use super::*;
use crate::cas::{BlobKey, Manifest};
use crate::pipeline::ingest::{IngestLimits, ingest};
use crate::pipeline::read::{ReadError, read_blob};
use crate::storage::fs::FsManifestStore;
use crate::storage::{CreateOutcome, ManifestStore};

fn options(pack_size: u64, fsync: bool, trace: Option<SyncTrace>) -> PackOptions {
    PackOptions {
        pack_size,
        fsync,
        trace,
    }
}

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

fn limits() -> IngestLimits {
    IngestLimits {
        max_size: 1 << 30,
        declared_size: None,
        idle_timeout: Duration::from_secs(5),
        digest: None,
    }
}

fn body(content: &[u8]) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Unpin {
    let pieces: Vec<_> = content
        .chunks(100_000)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    futures_util::stream::iter(pieces)
}

async fn download(blocks: Arc<dyn BlockStore>, manifest: Manifest) -> Result<Vec<u8>, ReadError> {
    let mut out = Vec::new();
    let mut stream = Box::pin(read_blob(blocks, Arc::new(manifest), None));
    while let Some(piece) = stream.next().await {
        out.extend_from_slice(&piece?);
    }
    Ok(out)
}

/// A manifest store that records when it creates a manifest in the shared trace.
struct TracedManifests {
    inner: FsManifestStore,
    trace: SyncTrace,
}

impl ManifestStore for TracedManifests {
    fn create(&self, manifest: &Manifest) -> StoreFuture<'_, CreateOutcome> {
        let manifest = manifest.clone();
        Box::pin(async move {
            let outcome = self.inner.create(&manifest).await?;
            (self.trace)("manifest created");
            Ok(outcome)
        })
    }
    fn get(&self, key: BlobKey) -> StoreFuture<'_, Option<Manifest>> {
        self.inner.get(key)
    }
}

// Checks STO-1.
#[tokio::test]
async fn one_upload_syncs_packs_before_the_index_and_the_index_before_the_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let steps = Arc::new(Mutex::new(Vec::<&'static str>::new()));
    let trace: SyncTrace = {
        let steps = steps.clone();
        Arc::new(move |step| steps.lock().unwrap().push(step))
    };
    let store =
        PackStore::open_local(dir.path(), options(1 << 20, true, Some(trace.clone()))).unwrap();
    let manifests = Arc::new(TracedManifests {
        inner: FsManifestStore::open(dir.path(), true).unwrap(),
        trace,
    });
    let content = data(3 << 20, 1);
    let report = ingest(
        body(&content),
        limits(),
        Arc::new(store.clone()),
        manifests,
        |_| {},
    )
    .await
    .unwrap();
    let all = steps.lock().unwrap().clone();
    // Every two-hex directory the upload created had its root entry synced, once.
    let new_dirs = all
        .iter()
        .filter(|s| **s == "new pack directory: root synced")
        .count();
    let dirs = std::fs::read_dir(dir.path().join("packs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            p.is_dir() && name.len() == 2 && name.bytes().all(|b| b.is_ascii_hexdigit())
        })
        .count();
    assert!(dirs >= 1);
    assert_eq!(
        new_dirs, dirs,
        "a new pack directory's entry was not synced: {all:?}"
    );
    let steps: Vec<&str> = all
        .into_iter()
        .filter(|s| *s != "new pack directory: root synced")
        .collect();
    let per_pack = ["pack data synced", "pack renamed", "pack directory synced"];
    let packs = steps.iter().filter(|s| **s == "pack data synced").count();
    assert!(packs >= 3, "3 MiB in 1 MiB packs: {steps:?}");
    let mut expected: Vec<&str> = per_pack.iter().copied().cycle().take(packs * 3).collect();
    expected.extend(["index committed", "manifest created"]);
    assert_eq!(
        steps, expected,
        "one data sync per pack, then one commit, then the manifest"
    );
    assert_eq!(
        store.index().unwrap().block_count().unwrap(),
        report.blocks as u64
    );
    assert_eq!(store.index().unwrap().packs().unwrap().len(), packs);
}

// Checks STO-2.
#[tokio::test]
async fn packs_roll_over_and_every_block_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    // fsync on: the durable publish path (direct spool writes, file, rename and directory
    // syncs) is the one that rolls packs over here, as in production.
    let store = PackStore::open_local(dir.path(), options(1 << 20, true, None)).unwrap();
    let manifests = Arc::new(FsManifestStore::open(dir.path(), true).unwrap());
    let content = data(5 << 20, 2);
    let blocks: Arc<dyn BlockStore> = Arc::new(store.clone());
    let report = ingest(
        body(&content),
        limits(),
        blocks.clone(),
        manifests.clone(),
        |_| {},
    )
    .await
    .unwrap();
    let packs = store.index().unwrap().packs().unwrap();
    assert!(packs.len() >= 4, "{} packs", packs.len());
    // every pack but the last partial one reached the pack size
    assert!(packs.iter().filter(|p| p.size < 1 << 20).count() <= 1);
    assert!(packs.iter().all(|p| p.blocks > 0));
    assert_eq!(store.medium().list().unwrap().len(), packs.len());
    let manifest = manifests.get(report.key).await.unwrap().unwrap();
    assert_eq!(download(blocks.clone(), manifest).await.unwrap(), content);
    // the spool directory is empty after the commit
    assert_eq!(std::fs::read_dir(store.spool_dir()).unwrap().count(), 0);
    // a second upload of the same bytes writes nothing new
    let again = ingest(body(&content), limits(), blocks, manifests, |_| {})
        .await
        .unwrap();
    assert_eq!(again.fresh_blocks, 0);
    assert_eq!(store.index().unwrap().packs().unwrap().len(), packs.len());
}

#[tokio::test]
async fn an_aborted_session_leaves_no_spool_file_and_no_entry() {
    let dir = tempfile::tempdir().unwrap();
    let store = PackStore::open_local(dir.path(), options(32 << 20, false, None)).unwrap();
    let mut session = store.begin().unwrap();
    let block = Bytes::from(data(70_000, 3));
    let key = BlockKey::of(&block);
    assert_eq!(
        session.append(key, block.clone()).await.unwrap(),
        PutOutcome::Fresh
    );
    assert_eq!(
        session.append(key, block).await.unwrap(),
        PutOutcome::Duplicate
    );
    session.abort().await.unwrap();
    // the writer thread removes its spool file once it sees the abort
    for _ in 0..100 {
        if std::fs::read_dir(store.spool_dir()).unwrap().count() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(std::fs::read_dir(store.spool_dir()).unwrap().count(), 0);
    assert!(!store.contains(key).await.unwrap());
    assert!(store.medium().list().unwrap().is_empty());
}

// Checks STO-4.
#[tokio::test]
async fn a_corrupt_or_truncated_pack_fails_the_download_loudly() {
    let dir = tempfile::tempdir().unwrap();
    let store = PackStore::open_local(dir.path(), options(32 << 20, false, None)).unwrap();
    let manifests = Arc::new(FsManifestStore::open(dir.path(), false).unwrap());
    let content = data(1 << 20, 4);
    let blocks: Arc<dyn BlockStore> = Arc::new(store.clone());
    let report = ingest(
        body(&content),
        limits(),
        blocks.clone(),
        manifests.clone(),
        |_| {},
    )
    .await
    .unwrap();
    let manifest = manifests.get(report.key).await.unwrap().unwrap();
    let pack = store.index().unwrap().packs().unwrap()[0].id;
    let local = medium::LocalMedium::open(&dir.path().join("packs"), false, None).unwrap();
    let path = local.path_of(&pack);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[5000] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let err = download(blocks.clone(), manifest.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, ReadError::CorruptBlock(_)), "{err}");
    // truncated: the read fails instead of serving short data
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = download(blocks, manifest).await.unwrap_err();
    assert!(
        matches!(
            err,
            ReadError::CorruptBlock(_) | ReadError::Store(StoreError::Corrupt(_))
        ),
        "{err}"
    );
}

// Checks STO-5.
#[tokio::test]
async fn blocks_of_the_file_per_block_layout_are_still_read() {
    let dir = tempfile::tempdir().unwrap();
    let legacy = FsBlockStore::open(dir.path(), false).unwrap();
    let block = Bytes::from(data(10_000, 5));
    let key = BlockKey::of(&block);
    legacy.put(key, block.clone()).await.unwrap();
    let store = PackStore::open_local(dir.path(), options(32 << 20, false, None)).unwrap();
    assert!(store.contains(key).await.unwrap());
    assert_eq!(store.get(key).await.unwrap(), Some(block));
}
