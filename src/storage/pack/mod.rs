//! The pack-based block store (the default): blocks of an upload are appended to pack
//! files of `pack_size` bytes, an index maps each block to `(pack, offset, length)`, and
//! one commit per upload makes it all durable.
//!
//! ```text
//! upload ──append──> session ──channel──> writer thread: spool file, roll at pack_size
//!                     │ dedup lookup                     seal = footer + medium.publish
//!                     └──commit──> join writer ──> index: one transaction (new entries,
//!                                                  pack rows, reused blocks confirmed)
//! ```
//! Durability order of one upload (STO-1): every pack of the session is published by the
//! medium (local: fdatasync, rename, directory fsync; S3: one PUT) before the index
//! transaction commits, and the caller writes the manifest only after `commit` returns.
//! There is no sync per block. A crash before the index commit leaves an unindexed pack
//! (collected after the grace period); after it, a retry deduplicates against it.
//!
//! The index is either the node's own redb database ([`index`], one node) or the
//! cluster's PostgreSQL tables ([`shared`], every node of a cluster on S3). With the
//! shared index, `commit_manifest` writes the index entries and the manifest in one
//! PostgreSQL transaction together with the commit fence.
//!
//! Modules: [`format`] (pack bytes), [`index`] (redb), [`shared`] (PostgreSQL),
//! [`medium`] (local dir or S3), [`s3`] (the S3 medium), [`runs`] (coalesced reads on S3),
//! [`gc`] (collector, verify, migration), [`cluster_gc`] (the collector over the shared
//! index), [`group`] (small last packs of concurrent uploads published together on S3).

pub mod cli;
pub mod cluster_gc;
pub mod format;
pub mod gc;
pub mod group;
pub mod index;
pub mod medium;
pub mod pause;
pub mod runs;
pub mod s3;
pub mod shared;
pub mod spool;

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;

use self::format::{Entry, RECORD_HEADER};
use self::index::{CommitBatch, Location, PackRecord, RedbIndex};
use self::medium::{Medium, SyncTrace};
use self::shared::PgIndex;
use self::spool::SpoolWriter;
use super::block::{BlockStream, READ_RESPONSES, read_each};
use super::fs::FsBlockStore;
use super::manifest::CommitFence;
use super::{
    BlockStore, CommitReport, CreateOutcome, ManifestStore, PutOutcome, StoreError, StoreFuture,
    WriteSession,
};
use crate::cas::{BlockKey, Manifest};

/// Blocks queued between an upload and its pack writer.
pub const WRITER_QUEUE: usize = 9;

/// How a pack store is built.
#[derive(Clone)]
pub struct PackOptions {
    /// Seal a pack once it reaches this many bytes.
    pub pack_size: u64,
    pub fsync: bool,
    /// Called with each durability step (tests).
    pub trace: Option<SyncTrace>,
}

impl std::fmt::Debug for PackOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackOptions")
            .field("pack_size", &self.pack_size)
            .field("fsync", &self.fsync)
            .finish_non_exhaustive()
    }
}

/// Where the block index lives.
enum Index {
    /// This node's redb database.
    Local(RedbIndex),
    /// The cluster's PostgreSQL tables (`sql/0008_pack_index.sql`).
    Shared(PgIndex),
}

struct Inner {
    index: Index,
    medium: Arc<dyn Medium>,
    spool: PathBuf,
    /// Spool files being written by this process's sessions; the collector's sweep of
    /// crash leftovers skips them, whatever `min_age` is.
    live_spools: LiveSpools,
    options: PackOptions,
    /// Groups the small last packs of concurrent uploads into one pack, on a medium where
    /// every pack is a priced request ([`group`]); `None` elsewhere.
    group: Option<group::GroupWriter>,
    /// The file-per-block directory of older versions, read as a fallback.
    legacy: Option<FsBlockStore>,
    /// Dedup hits of this process's running sessions (STO-23).
    pins: Pins,
}

/// The dedup hits of the sessions running in this process, counted per block. The local
/// collector never quarantines a pinned block (STO-23): a session pins a key *before* its
/// lookup and unpins it when the session ends (after its commit confirmed the block), and
/// the collector decides and commits each quarantine batch while it holds this lock. So
/// either the collector sees the pin and keeps the block, or its quarantine committed
/// first and the lookup finds no block and the session stores the bytes again. A block a
/// running upload deduplicated against is therefore never purged under it, however long
/// the upload lasts. (The shared index of a cluster, whose collector may run on another
/// node, refreshes `last_ref` at the hit instead: see [`shared::PgIndex::hit_many`].)
#[derive(Default)]
pub(super) struct Pins(std::sync::Mutex<HashMap<BlockKey, u32>>);

impl Pins {
    fn pin(&self, keys: &[BlockKey]) {
        let mut pins = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for key in keys {
            *pins.entry(*key).or_default() += 1;
        }
    }

    fn unpin(&self, keys: &[BlockKey]) {
        let mut pins = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for key in keys {
            if let Some(count) = pins.get_mut(key) {
                *count -= 1;
                if *count == 0 {
                    pins.remove(key);
                }
            }
        }
    }

    /// The pins, held: the collector's quarantine decides and commits under this.
    pub(super) fn hold(&self) -> std::sync::MutexGuard<'_, HashMap<BlockKey, u32>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Blocks a local commit pinned across the gap between its index commit and the manifest
/// that names them (STO-25), unpinned when dropped, after the manifest is written or the
/// commit failed. In that gap nothing else references the upload's fresh blocks (and a
/// tus upload's confirmed earlier blocks are referenced only by a row the final PATCH is
/// about to complete), so a collector whose mark ran before the manifest would otherwise
/// quarantine them, and with a short `min_age` purge them, under an acknowledged key.
struct CommitPins {
    store: PackStore,
    keys: Vec<BlockKey>,
}

impl Drop for CommitPins {
    fn drop(&mut self) {
        self.store.inner.pins.unpin(&self.keys);
    }
}

/// The set of spool files in use (see `Inner::live_spools`).
type LiveSpools = Arc<std::sync::Mutex<HashSet<PathBuf>>>;

/// Packs on a medium, indexed in redb under `<data_dir>/index.redb`.
#[derive(Clone)]
pub struct PackStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PackStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackStore")
            .field("medium", &self.inner.medium.describe())
            .field("options", &self.inner.options)
            .finish()
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl PackStore {
    /// Local packs under `<data_dir>/packs`.
    pub fn open_local(data_dir: &Path, options: PackOptions) -> Result<Self, StoreError> {
        let medium = medium::LocalMedium::open(
            &data_dir.join("packs"),
            options.fsync,
            options.trace.clone(),
        )?;
        Self::open(data_dir, Arc::new(medium), options)
    }

    /// Packs on `medium`; the index and spool files under `data_dir`.
    pub fn open(
        data_dir: &Path,
        medium: Arc<dyn Medium>,
        options: PackOptions,
    ) -> Result<Self, StoreError> {
        let spool = data_dir.join("packs").join("tmp");
        std::fs::create_dir_all(&spool).map_err(|e| StoreError::io("create spool directory", e))?;
        let index = Index::Local(RedbIndex::open(&data_dir.join("index.redb"))?);
        Self::build(data_dir, medium, options, index)
    }

    /// Packs on `medium` (the cluster's bucket) indexed in the cluster's PostgreSQL
    /// (`index`); only spool files stay under `data_dir`.
    pub fn open_shared(
        data_dir: &Path,
        medium: Arc<dyn Medium>,
        options: PackOptions,
        index: PgIndex,
    ) -> Result<Self, StoreError> {
        let spool = data_dir.join("packs").join("tmp");
        std::fs::create_dir_all(&spool).map_err(|e| StoreError::io("create spool directory", e))?;
        Self::build(data_dir, medium, options, Index::Shared(index))
    }

    fn build(
        data_dir: &Path,
        medium: Arc<dyn Medium>,
        options: PackOptions,
        index: Index,
    ) -> Result<Self, StoreError> {
        let spool = data_dir.join("packs").join("tmp");
        let legacy = if data_dir.join("blocks").is_dir() {
            Some(FsBlockStore::open(data_dir, options.fsync)?)
        } else {
            None
        };
        let live_spools = LiveSpools::default();
        let group = if medium.groups_small_packs() {
            Some(group::GroupWriter::start(group::GroupContext {
                spool: spool.clone(),
                live_spools: live_spools.clone(),
                medium: medium.clone(),
                pack_size: options.pack_size,
            })?)
        } else {
            None
        };
        Ok(Self {
            inner: Arc::new(Inner {
                index,
                medium,
                spool,
                live_spools,
                options,
                legacy,
                group,
                pins: Pins::default(),
            }),
        })
    }

    /// The dedup hits of this process's running sessions (the local collector's view).
    pub(super) fn pins(&self) -> &Pins {
        &self.inner.pins
    }

    /// The node's own (redb) index; an error on a store with the shared index, whose
    /// operations live in [`shared`] and [`cluster_gc`].
    pub fn index(&self) -> Result<&RedbIndex, StoreError> {
        match &self.inner.index {
            Index::Local(index) => Ok(index),
            Index::Shared(_) => Err(StoreError::Unavailable(
                "this operation needs a node-local index; a cluster store uses the shared \
                 PostgreSQL index"
                    .into(),
            )),
        }
    }

    /// The cluster's shared index, when this store uses it.
    pub fn shared(&self) -> Option<&PgIndex> {
        match &self.inner.index {
            Index::Local(_) => None,
            Index::Shared(index) => Some(index),
        }
    }

    /// Where `key` is stored, if indexed (a quarantined block counts as absent).
    async fn locate(&self, key: BlockKey) -> Result<Option<Location>, StoreError> {
        match &self.inner.index {
            Index::Local(_) => {
                let store = self.clone();
                blocking(move || store.index()?.lookup(&key)).await
            }
            Index::Shared(index) => index.lookup(&key).await,
        }
    }

    /// Where each of `keys` is stored, in order, with one index call.
    async fn locate_many(&self, keys: Vec<BlockKey>) -> Result<Vec<Option<Location>>, StoreError> {
        match &self.inner.index {
            Index::Local(_) => {
                let store = self.clone();
                blocking(move || store.index()?.locate_many(&keys)).await
            }
            Index::Shared(index) => index.locate_many(&keys).await,
        }
    }

    /// The blocks of one step of a read plan (see [`runs`]), once its request has begun.
    async fn open_step(
        self,
        step: runs::Step,
        keys: Vec<BlockKey>,
    ) -> Result<BlockStream, StoreError> {
        match step {
            runs::Step::Alone => {
                let block = self.get(keys[0]).await?;
                Ok(futures_util::stream::once(async move { Ok(block) }).boxed())
            }
            runs::Step::Run {
                pack,
                offset,
                len,
                pieces,
            } => match self
                .inner
                .medium
                .clone()
                .open_range(pack, offset, len)
                .await?
            {
                Some(body) => Ok(runs::RunReader::new(pack, pieces, body).into_stream()),
                // The pack went away after the lookup (compaction moved its blocks and
                // the collector purged it): look each block up again.
                None => Ok(read_each(Arc::new(self), keys)),
            },
        }
    }

    pub fn medium(&self) -> &Arc<dyn Medium> {
        &self.inner.medium
    }

    pub fn spool_dir(&self) -> &Path {
        &self.inner.spool
    }

    /// Whether `path` is a spool file a session of this process is writing.
    pub fn spool_in_use(&self, path: &Path) -> bool {
        self.inner
            .live_spools
            .lock()
            .map(|live| live.contains(path))
            .unwrap_or(true)
    }

    pub fn legacy(&self) -> Option<&FsBlockStore> {
        self.inner.legacy.as_ref()
    }

    fn note(&self, step: &'static str) {
        if let Some(trace) = &self.inner.options.trace {
            trace(step);
        }
        pause::after(step);
    }
}

async fn blocking<T, F>(work: F) -> Result<T, StoreError>
where
    F: FnOnce() -> Result<T, StoreError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| StoreError::Unavailable(format!("storage task failed: {e}")))?
}

impl BlockStore for PackStore {
    fn begin(&self) -> Result<Box<dyn WriteSession>, StoreError> {
        Ok(Box::new(PackSession {
            store: self.clone(),
            seen: HashSet::new(),
            reused: Vec::new(),
            pinned: Vec::new(),
            writer: None,
            aborted: Arc::new(AtomicBool::new(false)),
            fresh_bytes: 0,
        }))
    }

    fn get(&self, key: BlockKey) -> StoreFuture<'_, Option<Bytes>> {
        let store = self.clone();
        Box::pin(async move {
            let found = match &store.inner.index {
                // One trip to the blocking pool for the lookup and the read together.
                Index::Local(_) => {
                    let store = store.clone();
                    blocking(move || match store.index()?.lookup(&key)? {
                        Some(at) => store
                            .medium()
                            .read(&at.pack, at.offset, u64::from(at.len))
                            .map(Some),
                        None => Ok(None),
                    })
                    .await?
                }
                Index::Shared(index) => match index.lookup(&key).await? {
                    Some(at) => {
                        let medium = store.inner.medium.clone();
                        Some(
                            blocking(move || medium.read(&at.pack, at.offset, u64::from(at.len)))
                                .await?,
                        )
                    }
                    None => None,
                },
            };
            match (found, &store.inner.legacy) {
                (Some(data), _) => Ok(Some(data)),
                (None, Some(legacy)) => legacy.get(key).await,
                (None, None) => Ok(None),
            }
        })
    }

    /// On a medium that coalesces reads (S3), the blocks are located [`runs::LOCATE_BATCH`]
    /// at a time and read one run of adjacent blocks per streamed request (a run may span
    /// lookup batches: [`runs::Planner`]), with the next run's request sent while the
    /// current one is read; otherwise one by one.
    fn read_blocks(self: Arc<Self>, keys: Vec<BlockKey>) -> BlockStream {
        if !self.inner.medium.coalesces_reads() {
            return read_each(self, keys);
        }
        let store = (*self).clone();
        let batches: Vec<Vec<BlockKey>> = keys
            .chunks(runs::LOCATE_BATCH)
            .map(<[BlockKey]>::to_vec)
            .collect();
        let last = batches.len().saturating_sub(1);
        // The planner and the keys of the runs it has not closed yet carry over from one
        // lookup batch to the next; after a failed lookup the stream ends with its error.
        let carried = (runs::Planner::default(), VecDeque::<BlockKey>::new(), false);
        futures_util::stream::iter(batches.into_iter().enumerate())
            .then(move |(i, batch)| {
                let store = store.clone();
                async move {
                    let located = store.locate_many(batch.clone()).await;
                    (store, i, batch, located)
                }
            })
            .scan(
                carried,
                move |(planner, pending, failed), (store, i, batch, located)| {
                    let steps = match located {
                        _ if *failed => return futures_util::future::ready(None),
                        Ok(located) => {
                            pending.extend(batch);
                            let mut steps = planner.push(&located);
                            if i == last {
                                steps.extend(std::mem::take(planner).finish());
                            }
                            steps
                                .into_iter()
                                .map(|step| {
                                    let keys: Vec<BlockKey> =
                                        pending.drain(..step.blocks()).collect();
                                    Ok((store.clone(), step, keys))
                                })
                                .collect()
                        }
                        Err(e) => {
                            *failed = true;
                            vec![Err(e)]
                        }
                    };
                    futures_util::future::ready(Some(futures_util::stream::iter(steps)))
                },
            )
            .flatten()
            .map(|step| {
                // Each step's request is sent on a task of its own, so the next run's
                // round trip overlaps the reading of this one (`READ_RESPONSES`).
                let opened = step.map(|(store, step, keys)| {
                    AbortOnDropHandle::new(tokio::spawn(store.open_step(step, keys)))
                });
                async move {
                    match opened {
                        Ok(task) => task.await.map_err(|e| {
                            StoreError::Unavailable(format!("storage task failed: {e}"))
                        })?,
                        Err(e) => Err(e),
                    }
                }
            })
            .buffered(READ_RESPONSES)
            .flat_map(|opened| match opened {
                Ok(blocks) => blocks,
                Err(e) => futures_util::stream::once(async move { Err(e) }).boxed(),
            })
            .boxed()
    }

    fn contains(&self, key: BlockKey) -> StoreFuture<'_, bool> {
        let store = self.clone();
        Box::pin(async move {
            let indexed = store.locate(key).await?.is_some();
            match (indexed, &store.inner.legacy) {
                (true, _) => Ok(true),
                (false, Some(legacy)) => legacy.contains(key).await,
                (false, None) => Ok(false),
            }
        })
    }

    /// The medium answers (the pack directory, or one `HEAD` in the bucket), and so does
    /// the index (a lookup; on a cluster's shared index, a PostgreSQL query).
    fn probe(&self) -> StoreFuture<'_, ()> {
        let store = self.clone();
        Box::pin(async move {
            let medium = store.inner.medium.clone();
            blocking(move || medium.probe()).await?;
            store
                .locate(BlockKey::of(crate::storage::block::PROBE_KEY))
                .await
                .map(drop)
        })
    }

    fn describe(&self) -> String {
        self.inner.medium.describe()
    }
}

/// What a session's pack writer produced.
#[derive(Default)]
struct Written {
    packs: Vec<PackRecord>,
    new: Vec<(BlockKey, Location)>,
}

struct Writer {
    tx: mpsc::Sender<(BlockKey, Bytes)>,
    done: tokio::task::JoinHandle<Result<Written, StoreError>>,
}

struct PackSession {
    store: PackStore,
    /// Blocks of this session already handled (written or found stored).
    seen: HashSet<BlockKey>,
    reused: Vec<BlockKey>,
    /// Keys this session pinned in a local store ([`Pins`]), unpinned when it ends.
    pinned: Vec<BlockKey>,
    writer: Option<Writer>,
    aborted: Arc<AtomicBool>,
    fresh_bytes: u64,
}

impl PackSession {
    fn start_writer(&mut self) -> &mut Writer {
        self.writer.get_or_insert_with(|| {
            let (tx, rx) = mpsc::channel(WRITER_QUEUE);
            let store = self.store.clone();
            let aborted = self.aborted.clone();
            let done = tokio::task::spawn_blocking(move || write_packs(store, rx, aborted));
            Writer { tx, done }
        })
    }
}

impl PackSession {
    /// Seal the last pack and commit the index (and, with the shared index and
    /// `manifest`, the manifest in the same transaction).
    async fn finish(
        mut self: Box<Self>,
        manifest: Option<(&Manifest, Option<&CommitFence>)>,
    ) -> Result<(CommitReport, Option<CreateOutcome>, Option<CommitPins>), StoreError> {
        let written = match self.writer.take() {
            Some(Writer { tx, done }) => {
                drop(tx);
                done.await
                    .map_err(|e| StoreError::Unavailable(format!("pack writer: {e}")))??
            }
            None => Written::default(),
        };
        // Every pack of the upload is published; nothing is indexed yet (a fault test stops
        // an uploader here while a collector runs, STO-14).
        pause::after("upload packs published");
        let report = CommitReport {
            packs: written.packs.len(),
            fresh_bytes: self.fresh_bytes,
        };
        let batch = CommitBatch {
            packs: written.packs,
            new: written.new,
            reused: std::mem::take(&mut self.reused),
            now_ms: now_ms(),
        };
        if let Some(index) = self.store.shared() {
            let outcome = index
                .commit(&batch, &self.store.inner.medium, manifest)
                .await?;
            self.store.note("index committed");
            return Ok((report, outcome, None));
        }
        if batch.packs.is_empty() && batch.new.is_empty() && batch.reused.is_empty() {
            return Ok((report, None, None));
        }
        // Pinned before the index commit (STO-25): the collector's quarantine either sees
        // the pins, or committed first, and then the commit restores a quarantined
        // reused block or fails on a purged one (STO-3). The dedup hits' pins move in too,
        // so they outlive this session until the caller has written the manifest.
        let mut keys: Vec<BlockKey> = batch
            .new
            .iter()
            .map(|(key, _)| *key)
            .chain(batch.reused.iter().copied())
            .collect();
        self.store.inner.pins.pin(&keys);
        keys.append(&mut self.pinned);
        let pins = CommitPins {
            store: self.store.clone(),
            keys,
        };
        let store = self.store.clone();
        blocking(move || {
            let medium = store.medium().clone();
            store.index()?.commit(&batch, &|id| medium.exists(id))
        })
        .await?;
        self.store.note("index committed");
        Ok((report, None, Some(pins)))
    }
}

impl Drop for PackSession {
    fn drop(&mut self) {
        // A session dropped before `commit` finished is an abort: the writer sees the flag
        // when its queue closes and removes its spool file instead of sealing it.
        self.aborted.store(true, Ordering::SeqCst);
        // Committed (its hits confirmed) or abandoned: its hits need no pin any more.
        self.store.inner.pins.unpin(&self.pinned);
    }
}

impl PackSession {
    /// Which of `keys` are stored already (a hint, confirmed again inside the commit,
    /// STO-3), each hit held against the collector until this session ends (STO-23): in
    /// a local store pinned before the lookup; in the shared index `last_ref` refreshed
    /// by the lookup itself.
    async fn hits(&mut self, keys: &[BlockKey]) -> Result<HashSet<BlockKey>, StoreError> {
        match &self.store.inner.index {
            Index::Local(index) => {
                self.store.inner.pins.pin(keys);
                // One read transaction on a page-cached B-tree: microseconds, so it runs
                // here.
                let known = match index.lookup_many(keys) {
                    Ok(known) => known,
                    Err(err) => {
                        self.store.inner.pins.unpin(keys);
                        return Err(err);
                    }
                };
                let missed: Vec<BlockKey> = keys
                    .iter()
                    .filter(|k| !known.contains(k))
                    .copied()
                    .collect();
                self.store.inner.pins.unpin(&missed);
                self.pinned
                    .extend(keys.iter().filter(|k| known.contains(k)));
                Ok(known)
            }
            Index::Shared(index) => index.hit_many(keys).await,
        }
    }

    /// Store a block not seen before in this session; `known` is the index's answer (a
    /// hint, confirmed again inside the commit, STO-3).
    async fn store_block(
        &mut self,
        key: BlockKey,
        data: Bytes,
        known: bool,
    ) -> Result<PutOutcome, StoreError> {
        if known {
            self.reused.push(key);
            return Ok(PutOutcome::Duplicate);
        }
        self.fresh_bytes += data.len() as u64;
        let writer = self.start_writer();
        if writer.tx.send((key, data)).await.is_err() {
            // The writer stopped: its error explains why.
            let writer = self.writer.take().expect("writer present");
            return Err(match writer.done.await {
                Ok(Err(err)) => err,
                _ => StoreError::Unavailable("pack writer stopped".into()),
            });
        }
        Ok(PutOutcome::Fresh)
    }
}

impl WriteSession for PackSession {
    fn append(&mut self, key: BlockKey, data: Bytes) -> StoreFuture<'_, PutOutcome> {
        Box::pin(async move {
            if !self.seen.insert(key) {
                return Ok(PutOutcome::Duplicate);
            }
            let known = self.hits(&[key]).await?.contains(&key);
            self.store_block(key, data, known).await
        })
    }

    fn append_many(&mut self, blocks: Vec<(BlockKey, Bytes)>) -> StoreFuture<'_, Vec<PutOutcome>> {
        Box::pin(async move {
            let mut outcomes = Vec::with_capacity(blocks.len());
            // One lookup for the whole batch (a hint, confirmed in the commit, STO-3).
            let unseen: Vec<BlockKey> = blocks
                .iter()
                .map(|(key, _)| *key)
                .filter(|key| !self.seen.contains(key))
                .collect();
            let known = self.hits(&unseen).await?;
            for (key, data) in blocks {
                if !self.seen.insert(key) {
                    outcomes.push(PutOutcome::Duplicate);
                    continue;
                }
                outcomes.push(self.store_block(key, data, known.contains(&key)).await?);
            }
            Ok(outcomes)
        })
    }

    fn confirm(&mut self, keys: Vec<BlockKey>) {
        // Confirmed in the index commit with the dedup hits (refreshing `last_ref`, or
        // restoring a quarantined block while its pack exists), each key once.
        for key in keys {
            if self.seen.insert(key) {
                self.reused.push(key);
            }
        }
    }

    fn commit(self: Box<Self>) -> StoreFuture<'static, CommitReport> {
        Box::pin(async move { self.finish(None).await.map(|(report, _, _)| report) })
    }

    fn commit_manifest(
        self: Box<Self>,
        manifest: Manifest,
        manifests: Arc<dyn ManifestStore>,
        fence: Option<CommitFence>,
    ) -> StoreFuture<'static, (CommitReport, CreateOutcome)> {
        Box::pin(async move {
            let shared_tx = self.store.shared().is_some() && manifests.database().is_some();
            if shared_tx {
                // Index entries, dedup confirmations, fence and manifest: one transaction.
                let (report, outcome, _) = self.finish(Some((&manifest, fence.as_ref()))).await?;
                let outcome = outcome.ok_or_else(|| {
                    StoreError::Unavailable("the manifest was not created".into())
                })?;
                return Ok((report, outcome));
            }
            // The pins hold the manifest's blocks until it is written (STO-25).
            let (report, _, pins) = self.finish(None).await?;
            let outcome = manifests.create_fenced(&manifest, fence.as_ref()).await;
            drop(pins);
            Ok((report, outcome?))
        })
    }

    fn abort(self: Box<Self>) -> StoreFuture<'static, ()> {
        Box::pin(async move {
            self.aborted.store(true, Ordering::SeqCst);
            drop(self);
            Ok(())
        })
    }
}

/// A spool file being filled.
/// Keeps a spool path in the live set while its pack is open.
struct SpoolGuard {
    path: PathBuf,
    live: Arc<std::sync::Mutex<HashSet<PathBuf>>>,
}

impl Drop for SpoolGuard {
    fn drop(&mut self) {
        if let Ok(mut live) = self.live.lock() {
            live.remove(&self.path);
        }
    }
}

struct OpenPack {
    _guard: SpoolGuard,
    out: SpoolWriter,
    path: PathBuf,
    entries: Vec<Entry>,
}

/// A full pack whose bytes are written and whose medium publish (local: fdatasync,
/// rename, directory fsync) has not run yet.
struct SealedSpool {
    _guard: SpoolGuard,
    file: File,
    path: PathBuf,
    id: format::PackId,
    size: u64,
    entries: Vec<Entry>,
}

impl OpenPack {
    fn create(store: &PackStore) -> Result<Self, StoreError> {
        Self::create_in(
            &store.inner.spool,
            &store.inner.live_spools,
            store.inner.medium.direct_spool(),
            store.inner.options.fsync,
        )
    }

    /// A new spool file in `spool`, kept in `live` while the pack is open; `direct` and
    /// `writeback` choose how its bytes are written ([`spool`]).
    fn create_in(
        spool: &Path,
        live: &LiveSpools,
        direct: bool,
        writeback: bool,
    ) -> Result<Self, StoreError> {
        let path = spool.join(format!("{}.spool", uuid::Uuid::new_v4().simple()));
        let live = live.clone();
        if let Ok(mut set) = live.lock() {
            set.insert(path.clone());
        }
        let guard = SpoolGuard {
            path: path.clone(),
            live,
        };
        let out = SpoolWriter::create(&path, direct, writeback)?;
        Ok(Self {
            _guard: guard,
            out,
            path,
            entries: Vec::new(),
        })
    }

    /// Bytes of the pack so far.
    fn len(&self) -> u64 {
        self.out.len()
    }

    fn append(&mut self, key: BlockKey, data: Bytes) -> Result<(), StoreError> {
        self.entries.push(Entry {
            key,
            offset: self.out.len() + RECORD_HEADER,
            len: data.len() as u32,
        });
        let header = format::record_header(&key, data.len() as u32);
        self.out.append(header, data)
    }

    /// Write every record appended so far to the spool file.
    fn write_pending(&mut self) -> Result<(), StoreError> {
        self.out.flush()
    }

    /// Write the footer: the pack's bytes are complete, its publish still to run.
    fn finish(self) -> Result<SealedSpool, StoreError> {
        let (footer, id) = format::footer(&self.entries);
        let size = self.out.len() + footer.len() as u64;
        let file = match self.out.finish(&footer) {
            Ok(file) => file,
            Err(err) => {
                let _ = std::fs::remove_file(&self.path);
                return Err(err);
            }
        };
        Ok(SealedSpool {
            size,
            _guard: self._guard,
            file,
            path: self.path,
            id,
            entries: self.entries,
        })
    }

    fn discard(self) {
        let path = self.path.clone();
        drop(self);
        let _ = std::fs::remove_file(path);
    }
}

impl SealedSpool {
    /// Publish the pack on the medium; returns its record and block locations.
    fn publish(
        self,
        medium: &dyn Medium,
    ) -> Result<(PackRecord, Vec<(BlockKey, Location)>), StoreError> {
        let id = self.id;
        if let Err(err) = medium.publish(self.file, &self.path, &id) {
            let _ = std::fs::remove_file(&self.path);
            return Err(err);
        }
        let record = PackRecord {
            id,
            size: self.size,
            blocks: self.entries.len() as u32,
            sealed_ms: now_ms(),
            retired: false,
        };
        let locations = self
            .entries
            .iter()
            .map(|e| {
                (
                    e.key,
                    Location {
                        pack: id,
                        offset: e.offset,
                        len: e.len,
                        last_ref_ms: 0,
                    },
                )
            })
            .collect();
        Ok((record, locations))
    }
}

/// A pack being published on its own thread while the writer fills the next one.
type Publishing =
    std::thread::JoinHandle<Result<(PackRecord, Vec<(BlockKey, Location)>), StoreError>>;

fn publish_behind(store: &PackStore, sealed: SealedSpool) -> Result<Publishing, StoreError> {
    let medium = store.inner.medium.clone();
    std::thread::Builder::new()
        .name("pack-publish".into())
        .spawn(move || sealed.publish(medium.as_ref()))
        .map_err(|e| StoreError::io("start pack publish thread", e))
}

/// Wait for a publish and record its pack.
fn published(handle: Publishing, written: &mut Written) -> Result<(), StoreError> {
    let (record, locations) = handle
        .join()
        .map_err(|_| StoreError::Unavailable("pack publish thread panicked".into()))??;
    written.packs.push(record);
    written.new.extend(locations);
    Ok(())
}

/// The writer thread of one session. On a medium that allows it (local: fdatasync, rename,
/// directory fsync), a full pack is published on a helper thread while this thread writes
/// the next pack; at most
/// one publish runs at a time (packs are published in order), and the last is joined
/// before the writer returns, so the commit still follows the data syncs of every pack
/// of the session (STO-1).
fn write_packs(
    store: PackStore,
    mut rx: mpsc::Receiver<(BlockKey, Bytes)>,
    aborted: Arc<AtomicBool>,
) -> Result<Written, StoreError> {
    let mut written = Written::default();
    let mut open: Option<OpenPack> = None;
    let mut publishing: Option<Publishing> = None;
    let mut seal = |pack: OpenPack, written: &mut Written| -> Result<(), StoreError> {
        let sealed = pack.finish()?;
        if let Some(previous) = publishing.take() {
            published(previous, written)?;
        }
        if store.inner.medium.publish_behind() {
            publishing = Some(publish_behind(&store, sealed)?);
        } else {
            let (record, locations) = sealed.publish(store.inner.medium.as_ref())?;
            written.packs.push(record);
            written.new.extend(locations);
        }
        Ok(())
    };
    let result = (|| {
        while let Some((key, data)) = rx.blocking_recv() {
            let pack = match &mut open {
                Some(pack) => pack,
                None => open.insert(OpenPack::create(&store)?),
            };
            pack.append(key, data)?;
            if pack.len() >= store.inner.options.pack_size {
                seal(open.take().expect("open pack"), &mut written)?;
            }
        }
        if aborted.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable("upload aborted".into()));
        }
        if let Some(pack) = open.take() {
            match &store.inner.group {
                // A small last pack on S3: published with those of concurrent uploads.
                Some(group) if pack.len() < store.inner.options.pack_size / group::GROUP_BELOW => {
                    let (record, locations) = group.submit(pack)?;
                    written.packs.push(record);
                    written.new.extend(locations);
                }
                _ => seal(pack, &mut written)?,
            }
        }
        Ok(())
    })();
    // The last publish ends before the writer returns, whatever happened (an aborted
    // upload's published packs are unindexed orphans, collected after the grace period).
    let last = match publishing.take() {
        Some(handle) => published(handle, &mut written),
        None => Ok(()),
    };
    if let Some(pack) = open.take() {
        pack.discard();
    }
    result.and(last).map(|()| written)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod gc_tests;
