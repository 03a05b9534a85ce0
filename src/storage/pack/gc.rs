//! The collector (mark and sweep with a minimum age, quarantine, purge, compaction),
//! `verify`, and the migration from the file-per-block layout.
//!
//! One run, in order (STO-6):
//! 1. **mark**: every block key of every manifest;
//! 2. **select**: index entries not marked whose last reference (write or dedup commit)
//!    is older than `min_age` before the run started, so in-flight uploads are never
//!    selected;
//! 3. **mark again** right before changing anything, and drop re-marked candidates;
//! 4. **quarantine**: move the candidates' entries to the quarantine table, re-checking
//!    their last reference inside that transaction (a dedup commit that raced the run
//!    wins, and a dedup commit after it restores the entry while the pack lives);
//! 5. **compact**: packs whose live bytes fall below `compact_below` of their size are
//!    rewritten (live blocks copied to a new pack, published, then the index relocated);
//!    packs with no live entry are **retired** (checked inside one write transaction);
//! 6. **orphans**: packs on the medium that no index row names, and spool files, older
//!    than `min_age` (crash leftovers) are deleted;
//! 7. **purge** (explicit, `--purge`, or on the schedule): quarantined entries and
//!    retired packs older than `retention` are removed for good.
//!
//! One collector per data directory: the redb file is opened by one process only, and
//! within a process runs are serialised by a mutex.
//!
//! **Memory.** Nothing the collector holds grows with the garbage: the candidates of a
//! run are spilled to an unnamed temporary file ([`Candidates`], 36 bytes per block, in
//! the index's key order), and the quarantine, the purge of the quarantine and the
//! restore each run as write transactions of at most `gc.batch` entries. What remains
//! is the mark set ([`MarkSet`], 8 bytes per live block), the per-pack table (one entry
//! per pack) and redb's page cache (capped at [`super::index::INDEX_CACHE_BYTES`]).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

use super::format::{self, PackId};
use super::index::{Location, PackRecord};
use super::pause;
use super::{PackStore, now_ms};
use crate::cas::BlockKey;
use crate::storage::{BlockStore, ManifestStore, StoreError};

/// How a run behaves.
#[derive(Debug, Clone, Copy)]
pub struct GcOptions {
    pub min_age: Duration,
    pub retention: Duration,
    pub compact_below: f64,
    /// Report what would happen; change nothing.
    pub dry_run: bool,
    /// Also purge what the retention window allows.
    pub purge: bool,
    /// Entries per write transaction of the quarantine and the purge (`gc.batch`).
    pub batch: usize,
}

impl GcOptions {
    /// The options of `[storage.gc]`, with the run's own `dry_run` and `purge`.
    pub fn from_config(
        config: &crate::storage::config::GcConfig,
        dry_run: bool,
        purge: bool,
    ) -> Self {
        Self {
            min_age: config.min_age.get(),
            retention: config.retention.get(),
            compact_below: config.compact_below,
            dry_run,
            purge,
            batch: config.batch.max(1),
        }
    }
}

/// What a run did (or, dry, would do).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct GcReport {
    pub dry_run: bool,
    pub live_blocks: u64,
    pub candidates: u64,
    pub quarantined: u64,
    pub quarantined_bytes: u64,
    pub packs_rewritten: u64,
    pub packs_retired: u64,
    pub orphan_packs_deleted: u64,
    pub spool_files_deleted: u64,
    pub purged_entries: u64,
    pub packs_deleted: u64,
    /// Pack bytes deleted from the medium (purged retired packs and orphans).
    pub bytes_reclaimed: u64,
    pub duration_ms: u64,
}

/// Progress callbacks (the CLI draws a bar).
pub trait Progress: Send {
    fn phase(&mut self, name: &'static str, total: u64);
    fn advance(&mut self, n: u64);
}

/// No progress output.
pub struct Quiet;

impl Progress for Quiet {
    fn phase(&mut self, _: &'static str, _: u64) {}
    fn advance(&mut self, _: u64) {}
}

/// What one quarantine batch read and did.
#[derive(Default)]
struct QuarantineStep {
    read: u64,
    candidates: u64,
    bytes: u64,
    quarantined: u64,
}

/// The collector's metrics.
#[derive(Clone)]
pub struct GcMetrics {
    pub bytes_reclaimed: Counter,
    pub packs_rewritten: Counter,
    pub runs: Counter,
    /// Collector runs that ended in an error (scheduled or over the admin API).
    pub failures: Counter,
    pub duration: Histogram,
}

impl Default for GcMetrics {
    fn default() -> Self {
        Self {
            bytes_reclaimed: Counter::default(),
            packs_rewritten: Counter::default(),
            runs: Counter::default(),
            failures: Counter::default(),
            duration: Histogram::new([0.1, 1.0, 10.0, 60.0, 600.0, 3600.0]),
        }
    }
}

impl GcMetrics {
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "gc_bytes_reclaimed",
            "Pack bytes deleted by the collector",
            self.bytes_reclaimed.clone(),
        );
        registry.register(
            "gc_packs_rewritten",
            "Sparse packs rewritten by compaction",
            self.packs_rewritten.clone(),
        );
        registry.register("gc_runs", "Collector runs", self.runs.clone());
        registry.register(
            "gc_failures",
            "Collector runs that failed",
            self.failures.clone(),
        );
        registry.register(
            "gc_duration_seconds",
            "Duration of collector runs",
            self.duration.clone(),
        );
    }

    pub fn record(&self, report: &GcReport) {
        self.bytes_reclaimed.inc_by(report.bytes_reclaimed);
        self.packs_rewritten.inc_by(report.packs_rewritten);
        self.runs.inc();
        self.duration.observe(report.duration_ms as f64 / 1000.0);
    }
}

static RUNNING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The mark set: the first 8 bytes of every block key some manifest references, sorted
/// and deduplicated: 8 bytes per live block (the `HashSet<BlockKey>` it replaced cost
/// 56 bytes per key at 300 k keys, see docs/performance.md, "Collector").
///
/// A prefix can only make [`MarkSet::contains`] answer yes for a key that is not marked
/// (another live key shares its first 64 bits), never no for a marked one. So a
/// collision keeps a garbage block alive, and never collects a live one. Keys are BLAKE3
/// hashes: among a billion live blocks, a given garbage block collides with
/// probability about 5e-11.
pub struct MarkSet(Vec<u64>);

fn prefix(key: &BlockKey) -> u64 {
    u64::from_be_bytes(key.0[..8].try_into().expect("8"))
}

impl MarkSet {
    /// Build from keys in any order, with repeats.
    pub fn from_keys(keys: impl IntoIterator<Item = BlockKey>) -> Self {
        Self::from_prefixes(keys.into_iter().map(|k| prefix(&k)).collect())
    }

    fn from_prefixes(mut prefixes: Vec<u64>) -> Self {
        prefixes.sort_unstable();
        prefixes.dedup();
        prefixes.shrink_to_fit();
        Self(prefixes)
    }

    /// Whether `key` is marked (or shares its first 8 bytes with a marked key).
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.0.binary_search(&prefix(key)).is_ok()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The mark phase (both collectors): every block some manifest references.
pub(super) async fn mark(manifests: &dyn ManifestStore) -> Result<MarkSet, StoreError> {
    let mut prefixes: Vec<u64> = Vec::new();
    manifests
        .for_each_block(&mut |key| {
            if prefixes.len() == prefixes.capacity() && prefixes.len() >= 4096 {
                // Manifests share blocks: drop repeats before the vector grows.
                prefixes.sort_unstable();
                prefixes.dedup();
            }
            prefixes.push(prefix(&key));
        })
        .await?;
    Ok(MarkSet::from_prefixes(prefixes))
}

/// The candidates of one run (both collectors), spilled to an unnamed temporary file in
/// the spool directory as they are selected: 36 bytes per block (key, length), read
/// back in batches. The file has no name (or loses it at once), so a killed collector
/// leaves nothing behind, and its pages are page cache, not the collector's memory.
pub(super) struct Candidates {
    file: std::io::BufWriter<std::fs::File>,
    count: u64,
}

const CANDIDATE_BYTES: usize = 36;

impl Candidates {
    pub(super) fn new(dir: &std::path::Path) -> Result<Self, StoreError> {
        let file = tempfile::tempfile_in(dir)
            .map_err(|e| StoreError::io("create the collector's candidate file", e))?;
        Ok(Self {
            file: std::io::BufWriter::with_capacity(1 << 16, file),
            count: 0,
        })
    }

    pub(super) fn push(&mut self, key: &BlockKey, len: u32) -> Result<(), StoreError> {
        use std::io::Write;
        let mut record = [0u8; CANDIDATE_BYTES];
        record[..32].copy_from_slice(&key.0);
        record[32..].copy_from_slice(&len.to_le_bytes());
        self.file
            .write_all(&record)
            .map_err(|e| StoreError::io("write the collector's candidate file", e))?;
        self.count += 1;
        Ok(())
    }

    pub(super) fn len(&self) -> u64 {
        self.count
    }

    /// Read the candidates back from the first.
    pub(super) fn into_reader(self) -> Result<CandidateReader, StoreError> {
        use std::io::Seek;
        let err = |e| StoreError::io("rewind the collector's candidate file", e);
        let mut file = self.file.into_inner().map_err(|e| err(e.into_error()))?;
        file.rewind().map_err(err)?;
        Ok(CandidateReader(std::io::BufReader::with_capacity(
            1 << 16,
            file,
        )))
    }
}

/// Reads [`Candidates`] back in batches.
pub(super) struct CandidateReader(std::io::BufReader<std::fs::File>);

impl CandidateReader {
    /// The next (up to) `n` candidates, as `(key, length)`; empty at the end.
    pub(super) fn next_batch(&mut self, n: usize) -> Result<Vec<(BlockKey, u32)>, StoreError> {
        use std::io::Read;
        let mut out = Vec::with_capacity(n.min(1 << 16));
        let mut record = [0u8; CANDIDATE_BYTES];
        while out.len() < n {
            match self.0.read_exact(&mut record) {
                Ok(()) => out.push((
                    BlockKey(record[..32].try_into().expect("32")),
                    u32::from_le_bytes(record[32..].try_into().expect("4")),
                )),
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
                Err(e) => return Err(StoreError::io("read the collector's candidate file", e)),
            }
        }
        Ok(out)
    }
}

/// The one thread that does all the index and file work of a local collector run.
///
/// Every step of a run (select, each quarantine batch, compaction, retire, orphans, each
/// purge batch) is sent here in turn, so the run's allocations (redb's page cache, the
/// per-pack table, the batches) stay in one malloc arena. One `spawn_blocking` per step
/// lands the steps on whichever blocking-pool threads are free, each with an arena of
/// its own, and the freed memory of one arena is not reused by the next: at 1,000,000
/// blocks that cost 25-30 MiB of peak RSS (docs/performance.md, "Collector"). The thread
/// ends with the run (the worker is dropped); a panic in a step ends it too and fails the
/// run with [`StoreError::Unavailable`], like a failed blocking task.
pub(super) struct Worker {
    jobs: std::sync::mpsc::Sender<Box<dyn FnOnce() + Send>>,
}

impl Worker {
    pub(super) fn start() -> Result<Self, StoreError> {
        let (jobs, queue) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
        std::thread::Builder::new()
            .name("graviton-gc".into())
            .spawn(move || queue.into_iter().for_each(|job| job()))
            .map_err(|e| StoreError::io("start the collector's thread", e))?;
        Ok(Self { jobs })
    }

    /// Run `work` on the worker's thread, after the steps sent before it.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let failed = || StoreError::Unavailable("collector task failed".into());
        let (done, result) = tokio::sync::oneshot::channel();
        self.jobs
            .send(Box::new(move || {
                let _ = done.send(work());
            }))
            .map_err(|_| failed())?;
        result.await.map_err(|_| failed())?
    }
}

/// Run file work on the blocking pool (the cluster collector, whose index is PostgreSQL).
pub(super) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| StoreError::Unavailable(format!("collector task failed: {e}")))?
}

/// One collector run over `store` with the manifests of `manifests`.
pub async fn collect(
    store: &PackStore,
    manifests: &dyn ManifestStore,
    options: GcOptions,
    progress: &mut dyn Progress,
) -> Result<GcReport, StoreError> {
    if let Some(index) = store.shared() {
        // A cluster store: one collector in the whole cluster, under the advisory lock.
        return super::cluster_gc::collect(store, index, manifests, options, progress).await;
    }
    let _one_at_a_time = RUNNING.lock().await;
    let worker = Worker::start()?;
    let started = Instant::now();
    let start_ms = now_ms();
    let cutoff = start_ms.saturating_sub(options.min_age.as_millis() as u64);
    let mut report = GcReport {
        dry_run: options.dry_run,
        ..Default::default()
    };

    // 1. mark
    progress.phase("mark", 0);
    let live = mark(manifests).await?;
    report.live_blocks = live.len() as u64;
    pause::after("gc mark");

    // 2. select: unmarked entries older than the cutoff, spilled to the candidate file
    let index_len = {
        let store = store.clone();
        worker.run(move || store.index()?.block_count()).await?
    };
    progress.phase("select", index_len);
    let (candidates, per_pack) = {
        let store = store.clone();
        worker
            .run(move || {
                let mut candidates = Candidates::new(store.spool_dir())?;
                let mut per_pack: HashMap<PackId, u64> = HashMap::new();
                store.index()?.for_each_block(&mut |key, at: Location| {
                    if !live.contains(&key) && at.last_ref_ms < cutoff {
                        candidates.push(&key, at.len)?;
                    } else {
                        *per_pack.entry(at.pack).or_default() +=
                            u64::from(at.len) + format::RECORD_HEADER;
                    }
                    Ok(())
                })?;
                Ok((candidates, per_pack))
            })
            .await?
    };
    progress.advance(index_len);
    pause::after("gc select");

    // 3. mark again, just before changing anything
    progress.phase("mark again", 0);
    let live_again = mark(manifests).await?;
    pause::after("gc mark again");

    let packs = {
        let store = store.clone();
        worker.run(move || store.index()?.packs()).await?
    };
    let record_of: HashMap<PackId, PackRecord> = packs.iter().map(|p| (p.id, *p)).collect();

    // 4. quarantine, in write transactions of `batch` candidates; the candidates marked
    //    again are dropped. Dry, only counted.
    progress.phase("quarantine", candidates.len());
    // The reader and the second mark set go to the worker with each batch and come back.
    let mut state = (candidates.into_reader()?, live_again);
    loop {
        let (batch, dry_run, store) = (options.batch, options.dry_run, store.clone());
        let (back, step) = worker
            .run(move || {
                let (reader, live_again) = &mut state;
                let read = reader.next_batch(batch)?;
                let mut step = QuarantineStep {
                    read: read.len() as u64,
                    ..Default::default()
                };
                let keys: Vec<BlockKey> = read
                    .into_iter()
                    .filter(|(key, _)| !live_again.contains(key))
                    .map(|(key, len)| {
                        step.bytes += u64::from(len);
                        key
                    })
                    .collect();
                step.candidates = keys.len() as u64;
                if !dry_run && !keys.is_empty() {
                    // Decided and committed under the pins: a block a running upload of
                    // this process deduplicated against stays (STO-23).
                    let pins = store.pins().hold();
                    let keys: Vec<BlockKey> =
                        keys.into_iter().filter(|k| !pins.contains_key(k)).collect();
                    step.quarantined = store.index()?.quarantine(&keys, cutoff, now_ms())?;
                    drop(pins);
                }
                Ok((state, step))
            })
            .await?;
        state = back;
        if step.read == 0 {
            break;
        }
        progress.advance(step.read);
        report.quarantined_bytes += step.bytes;
        report.candidates += step.candidates;
        report.quarantined += step.quarantined;
        if !options.dry_run && step.candidates > 0 {
            pause::after("gc quarantine batch");
        }
    }
    drop(state);
    if !options.dry_run && report.candidates > 0 {
        pause::after("gc quarantine");
    }

    // 5. compact sparse packs, retire empty ones (only packs older than the cutoff)
    let mut to_retire = Vec::new();
    let mut to_compact = Vec::new();
    for pack in packs.iter().filter(|p| !p.retired && p.sealed_ms < cutoff) {
        let live_bytes = per_pack.get(&pack.id).copied().unwrap_or(0);
        if live_bytes == 0 {
            to_retire.push(pack.id);
        } else if (live_bytes as f64) < options.compact_below * pack.size as f64 {
            to_compact.push(pack.id);
        }
    }
    if !options.dry_run {
        progress.phase("compact", to_compact.len() as u64);
        for id in &to_compact {
            if compact_pack(&worker, store, id).await? {
                report.packs_rewritten += 1;
                to_retire.push(*id);
            }
            progress.advance(1);
        }
        if !to_compact.is_empty() {
            pause::after("gc compact");
        }
        let store2 = store.clone();
        let ids = to_retire.clone();
        report.packs_retired = worker
            .run(move || store2.index()?.retire_packs(&ids))
            .await?
            .len() as u64;
        if report.packs_retired > 0 {
            pause::after("gc retire");
        }
    } else {
        report.packs_rewritten = to_compact.len() as u64;
        report.packs_retired = to_retire.len() as u64;
    }

    // 6. orphans: packs no index row names, and spool files, older than the cutoff
    progress.phase("orphans", 0);
    let listed = {
        let store = store.clone();
        worker.run(move || store.medium().list()).await?
    };
    for (id, modified) in listed {
        if record_of.contains_key(&id) || modified >= cutoff {
            continue;
        }
        if options.dry_run {
            report.orphan_packs_deleted += 1;
            continue;
        }
        // Deleted inside a write transaction that checks again that no row names it, so
        // no commit can name it meanwhile (STO-11).
        let store2 = store.clone();
        let deleted = worker
            .run(move || {
                let medium = store2.medium().clone();
                store2.index()?.delete_orphan(&id, &|id| medium.delete(id))
            })
            .await?;
        if deleted {
            report.orphan_packs_deleted += 1;
            pause::after("gc orphan deleted");
        }
    }
    for entry in std::fs::read_dir(store.spool_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        if !store.spool_in_use(&entry.path()) && super::medium::modified_ms(&entry.path()) < cutoff
        {
            report.spool_files_deleted += 1;
            if !options.dry_run {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    // 7. purge
    if options.purge {
        progress.phase("purge", 0);
        let before = start_ms.saturating_sub(options.retention.as_millis() as u64);
        let store2 = store.clone();
        let packs = worker.run(move || store2.index()?.packs()).await?;
        let expired: Vec<PackRecord> = packs
            .into_iter()
            .filter(|p| p.retired && p.sealed_ms < before)
            .collect();
        if options.dry_run {
            report.packs_deleted = expired.len() as u64;
            report.bytes_reclaimed = expired.iter().map(|p| p.size).sum();
        } else {
            // In write transactions of `batch` entries each, from a cursor.
            let mut cursor = None;
            loop {
                let store2 = store.clone();
                let batch = options.batch;
                let (purged, next) = worker
                    .run(move || {
                        store2
                            .index()?
                            .purge_quarantine_batch(before, cursor.as_ref(), batch)
                    })
                    .await?;
                report.purged_entries += purged;
                if purged > 0 {
                    pause::after("gc purge quarantine batch");
                }
                match next {
                    Some(key) => cursor = Some(key),
                    None => break,
                }
            }
            pause::after("gc purge quarantine");
            for pack in expired {
                let store2 = store.clone();
                // The object is deleted inside the write transaction that removes the row
                // (no commit or revival in between, STO-11); a crash before that commit
                // leaves a retired row with no object, which the next purge removes.
                let deleted = worker
                    .run(move || {
                        let medium = store2.medium().clone();
                        store2.index()?.purge_retired_pack(&pack.id, before, &|id| {
                            medium.delete(id)?;
                            pause::after("gc purge deleted");
                            Ok(())
                        })
                    })
                    .await?;
                if deleted {
                    report.packs_deleted += 1;
                    report.bytes_reclaimed += pack.size;
                }
            }
        }
    }
    pause::after("gc done");
    report.duration_ms = started.elapsed().as_millis() as u64;
    Ok(report)
}

/// Copy the live blocks of `id` into a new pack and point the index at it. Returns
/// whether the pack was rewritten.
async fn compact_pack(worker: &Worker, store: &PackStore, id: &PackId) -> Result<bool, StoreError> {
    let store = store.clone();
    let id = *id;
    worker
        .run(move || {
            let index = store.index()?;
            let rewritten = rewrite_pack(&store, &id, &mut |entry| {
                Ok(index.lookup(&entry.key)?.is_some_and(|at| at.pack == id))
            })?;
            let Some((record, moved)) = rewritten else {
                return Ok(false);
            };
            index.relocate(&id, &record, &moved)?;
            Ok(true)
        })
        .await
}

/// What [`rewrite_pack`] made: the new pack, and where each kept block now lives.
pub(super) type Rewrite = (PackRecord, Vec<(BlockKey, Location)>);

/// The rewrite step of compaction, one place for both indexes: read pack `id`, check its
/// name and every block hash (a damaged pack is never copied), copy the blocks that
/// `keep` accepts into a new pack named by its own bytes, and publish it on the store's
/// medium. Returns the new pack and where each kept block now lives, or `None` when no
/// block is kept. The caller points its index at the new pack; until then the new pack
/// is an orphan (deleted by a later run after `min_age` if the caller never gets there).
/// Memory: the old pack and the new one (at most `pack_size` each).
pub(super) fn rewrite_pack(
    store: &PackStore,
    id: &PackId,
    keep: &mut dyn FnMut(&format::Entry) -> Result<bool, StoreError>,
) -> Result<Option<Rewrite>, StoreError> {
    let bytes = store.medium().read_all(id)?;
    let entries = format::verify_pack(&bytes, id)
        .map_err(|e| StoreError::Corrupt(format!("pack {id}: {e}")))?;
    let mut live = Vec::new();
    for entry in &entries {
        if keep(entry)? {
            let start = entry.offset as usize;
            live.push((entry.key, &bytes[start..start + entry.len as usize]));
        }
    }
    if live.is_empty() {
        return Ok(None);
    }
    let (encoded, new_entries, new_id) = format::encode(&live);
    let spool = store
        .spool_dir()
        .join(format!("{}.spool", uuid::Uuid::new_v4().simple()));
    std::fs::write(&spool, &encoded).map_err(|e| StoreError::io("write spool file", e))?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&spool)
        .map_err(|e| StoreError::io("open spool file", e))?;
    store.medium().publish(file, &spool, &new_id)?;
    pause::after("gc compact published");
    let record = PackRecord {
        id: new_id,
        size: encoded.len() as u64,
        blocks: new_entries.len() as u32,
        sealed_ms: now_ms(),
        retired: false,
    };
    let moved = new_entries
        .iter()
        .map(|e| {
            (
                e.key,
                Location {
                    pack: new_id,
                    offset: e.offset,
                    len: e.len,
                    last_ref_ms: 0,
                },
            )
        })
        .collect();
    Ok(Some((record, moved)))
}

/// Damage found by [`verify`].
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct VerifyReport {
    pub packs_checked: u64,
    pub blocks_checked: u64,
    /// `pack: problem` lines.
    pub damaged: Vec<String>,
    /// Index entries pointing at a missing or damaged pack.
    pub entries_affected: u64,
}

/// Packs whose directories [`verify`] holds at once (on one node, one index scan per
/// group): about 512 entries of 40 bytes per 32 MiB pack, so a few MiB per group.
const VERIFY_GROUP: usize = 256;

/// Read every live pack, check its name, directory and every block hash, and check that
/// each live index entry points at a block its pack really holds, on either index.
///
/// Memory does not grow with the store: packs are checked [`VERIFY_GROUP`] at a time,
/// and only that group's directories are held while the index entries naming them are
/// compared (one scan of the local index per group; in a cluster, one query per pack).
/// What grows is one pack id per live pack, and one pack read whole (`pack_size`).
pub async fn verify(
    store: &PackStore,
    progress: &mut dyn Progress,
) -> Result<VerifyReport, StoreError> {
    let shared = store.shared().cloned();
    let mut report = VerifyReport::default();
    let live: Vec<PackId> = match &shared {
        Some(index) => {
            report.entries_affected += super::cluster_gc::rows_off_live_packs(index).await?;
            super::cluster_gc::live_packs(index).await?
        }
        None => {
            let store = store.clone();
            blocking(move || {
                Ok(store
                    .index()?
                    .packs()?
                    .into_iter()
                    .filter(|p| !p.retired)
                    .map(|p| p.id)
                    .collect())
            })
            .await?
        }
    };
    progress.phase("verify", live.len() as u64);
    if shared.is_none() {
        // Entries naming a pack that is not live (retired or unknown).
        let live_set: HashSet<PackId> = live.iter().copied().collect();
        let store = store.clone();
        report.entries_affected += blocking(move || {
            let mut affected = 0;
            store.index()?.for_each_block(&mut |_, at| {
                affected += u64::from(!live_set.contains(&at.pack));
                Ok(())
            })?;
            Ok(affected)
        })
        .await?;
    }
    for group in live.chunks(VERIFY_GROUP) {
        let mut good: HashMap<PackId, HashSet<(BlockKey, u64)>> = HashMap::new();
        for id in group {
            let (store2, id) = (store.clone(), *id);
            let checked = blocking(move || {
                Ok(store2
                    .medium()
                    .read_all(&id)
                    .map(|bytes| format::verify_pack(&bytes, &id)))
            })
            .await?;
            report.packs_checked += 1;
            let directory = match checked {
                Ok(Ok(entries)) => {
                    report.blocks_checked += entries.len() as u64;
                    entries.iter().map(|e| (e.key, e.offset)).collect()
                }
                Ok(Err(problem)) => {
                    report.damaged.push(format!("{id}: {problem}"));
                    HashSet::new()
                }
                Err(err) => {
                    report.damaged.push(format!("{id}: {err}"));
                    HashSet::new()
                }
            };
            good.insert(id, directory);
            progress.advance(1);
        }
        report.entries_affected += match &shared {
            Some(index) => {
                let mut affected = 0;
                for (id, directory) in &good {
                    let rows = super::cluster_gc::live_rows(index, id).await?;
                    affected += rows.iter().filter(|r| !directory.contains(r)).count() as u64;
                }
                affected
            }
            None => {
                let store = store.clone();
                blocking(move || {
                    let mut affected = 0;
                    store.index()?.for_each_block(&mut |key, at| {
                        if let Some(directory) = good.get(&at.pack) {
                            affected += u64::from(!directory.contains(&(key, at.offset)));
                        }
                        Ok(())
                    })?;
                    Ok(affected)
                })
                .await?
            }
        };
    }
    Ok(report)
}

/// Move every block of the legacy `blocks/` directory into packs, then remove the files.
/// Safe to rerun; a block already in the index is only removed from `blocks/`.
pub async fn migrate_blocks(
    store: &PackStore,
    progress: &mut dyn Progress,
) -> Result<u64, StoreError> {
    let Some(legacy) = store.legacy().cloned() else {
        return Ok(0);
    };
    let files = {
        let legacy = legacy.clone();
        blocking(move || legacy.list()).await?
    };
    progress.phase("migrate", files.len() as u64);
    let mut moved = 0;
    for batch in files.chunks(4096) {
        let mut session = store.begin()?;
        for (key, path) in batch {
            let path2 = path.clone();
            let data = blocking(move || {
                std::fs::read(&path2).map_err(|e| StoreError::io("read block file", e))
            })
            .await?;
            if BlockKey::of(&data) != *key {
                return Err(StoreError::Corrupt(format!(
                    "legacy block file {} does not match its name",
                    path.display()
                )));
            }
            session.append(*key, bytes::Bytes::from(data)).await?;
        }
        session.commit().await?;
        // Only after the commit made the packs and index durable.
        for (_, path) in batch {
            let _ = std::fs::remove_file(path);
            moved += 1;
        }
        progress.advance(batch.len() as u64);
    }
    Ok(moved)
}

#[cfg(test)]
mod mark_set_tests {
    use super::*;

    /// A key whose first 8 bytes are `head` and the rest `tail`.
    fn key(head: u8, tail: u8) -> BlockKey {
        let mut key = [tail; 32];
        key[..8].fill(head);
        BlockKey(key)
    }

    proptest::proptest! {
        // Checks STO-15: every marked key is contained (a prefix never collects a live
        // block); an unmarked key is contained only when it shares its first 8 bytes
        // with a marked one (it is kept, never the other way round).
        #[test]
        fn the_mark_set_contains_every_marked_key_and_only_prefix_twins_besides(
            marked in proptest::collection::vec((0u8..20, 0u8..4), 0..200),
            probes in proptest::collection::vec((0u8..20, 0u8..4), 0..50),
        ) {
            let set = MarkSet::from_keys(marked.iter().map(|(h, t)| key(*h, *t)));
            let heads: HashSet<u8> = marked.iter().map(|(h, _)| *h).collect();
            proptest::prop_assert_eq!(set.len(), heads.len());
            for (h, t) in &marked {
                proptest::prop_assert!(set.contains(&key(*h, *t)));
            }
            for (h, t) in probes {
                proptest::prop_assert_eq!(set.contains(&key(h, t)), heads.contains(&h));
            }
        }
    }

    // The candidate file gives back exactly what was pushed, in order, in batches.
    #[test]
    fn candidates_read_back_in_batches_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut candidates = Candidates::new(dir.path()).unwrap();
        for i in 0..10u8 {
            candidates.push(&key(i, i), u32::from(i) * 1000).unwrap();
        }
        assert_eq!(candidates.len(), 10);
        let mut reader = candidates.into_reader().unwrap();
        let mut got = Vec::new();
        loop {
            let batch = reader.next_batch(3).unwrap();
            if batch.is_empty() {
                break;
            }
            assert!(batch.len() <= 3);
            got.extend(batch);
        }
        let want: Vec<(BlockKey, u32)> = (0..10u8)
            .map(|i| (key(i, i), u32::from(i) * 1000))
            .collect();
        assert_eq!(got, want);
        // the file has no name in the directory
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
