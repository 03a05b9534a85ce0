//! Where sealed packs live: a local directory or an S3-compatible bucket.
//!
//! A pack is always built in a local spool file first (`<data_dir>/packs/tmp/`); the
//! medium then publishes it. Local: `fdatasync` the file, rename it to
//! `packs/<2 hex>/<64 hex>.pack`, `fsync` the directory. S3: one PUT of the whole pack
//! (conditional `If-None-Match: *` when the server honours it, probed at start), then the
//! spool file is removed. Reads are ranged: `pread` on a local pack, a ranged GET on S3.
//! Every call blocks; callers run them on the blocking pool, except [`Medium::open_range`],
//! a streamed ranged read for media that coalesce reads (S3, see `runs`).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;

use super::format::PackId;
use crate::storage::StoreError;

/// The body of a streamed ranged read, as it arrives.
pub type RangeBody = BoxStream<'static, Result<Bytes, StoreError>>;

/// A streamed ranged read that has begun: `None` if the pack is not on the medium.
pub type OpenRange = BoxFuture<'static, Result<Option<RangeBody>, StoreError>>;

/// Records the durability steps of an upload in order (tests prove sync-before-commit).
pub type SyncTrace = Arc<dyn Fn(&'static str) + Send + Sync>;

pub trait Medium: Send + Sync + std::fmt::Debug + 'static {
    /// Make the complete spool file `spool` durable as pack `id`.
    fn publish(&self, spool: File, spool_path: &Path, id: &PackId) -> Result<(), StoreError>;
    /// `len` bytes at `offset` of pack `id`.
    fn read(&self, id: &PackId, offset: u64, len: u64) -> Result<Bytes, StoreError>;
    /// The whole pack (verification, compaction).
    fn read_all(&self, id: &PackId) -> Result<Bytes, StoreError>;
    fn delete(&self, id: &PackId) -> Result<(), StoreError>;
    /// Whether pack `id` is on the medium (one HEAD on S3).
    fn exists(&self, id: &PackId) -> Result<bool, StoreError>;
    /// Every pack the medium holds, with its last-modified time (unix ms).
    fn list(&self) -> Result<Vec<(PackId, u64)>, StoreError>;
    /// Short description for logs (never credentials).
    fn describe(&self) -> String;
    /// One cheap round trip to the medium (the node's dependency probe). Default: a
    /// listing of every pack.
    fn probe(&self) -> Result<(), StoreError> {
        self.list().map(drop)
    }
    /// Whether the pack writer may write the next pack while this medium publishes the
    /// last one (at most one publish at a time, in pack order). Local: yes (the publish is
    /// the file's sync). S3: yes (the PUT of one pack overlaps the spooling of the next);
    /// a stopped server then stops the upload within two packs of spool on disk (one
    /// being PUT, one written), so back-pressure still reaches the client, and memory is
    /// unchanged: one pack mapped per upload for its PUT (ADM-13). Default no.
    fn publish_behind(&self) -> bool {
        false
    }
    /// Whether spool files should be written past the page cache ([`super::spool`]): the
    /// spool file becomes the pack in place and must reach the disk anyway (local, fsync
    /// on). Default no (S3 reads the spool back for its PUT and deletes it).
    fn direct_spool(&self) -> bool {
        false
    }
    /// Whether every pack published is a request priced on its own (S3), so the small
    /// last packs of concurrent uploads are published together ([`super::group`]).
    /// Local: no (a small pack costs one file sync, and grouping would add a copy).
    fn groups_small_packs(&self) -> bool {
        false
    }
    /// Whether every read is a request with a round trip of its own (S3), so the store
    /// reads a run of adjacent blocks with one streamed [`Medium::open_range`] instead of
    /// one `read` per block. Local: no (a `pread` of cached pages takes microseconds).
    fn coalesces_reads(&self) -> bool {
        false
    }
    /// Begin a streamed read of `len` bytes at `offset` of pack `id`. The default reads
    /// the range with [`Medium::read`] on the blocking pool and yields it whole.
    fn open_range(self: Arc<Self>, id: PackId, offset: u64, len: u64) -> OpenRange {
        Box::pin(async move {
            let data = tokio::task::spawn_blocking(move || {
                if !self.exists(&id)? {
                    return Ok(None);
                }
                self.read(&id, offset, len).map(Some)
            })
            .await
            .map_err(|e| StoreError::Unavailable(format!("storage task failed: {e}")))??;
            Ok(data.map(|data| futures_util::stream::once(async move { Ok(data) }).boxed()))
        })
    }
}

/// Packs as files under `<data_dir>/packs`.
#[derive(Debug)]
pub struct LocalMedium {
    root: PathBuf,
    fsync: bool,
    trace: Option<TraceHook>,
    open: Mutex<HashMap<PackId, Arc<File>>>,
}

/// Open file handles kept for reads.
const OPEN_PACKS: usize = 256;

#[derive(Clone)]
pub struct TraceHook(pub SyncTrace);

impl std::fmt::Debug for TraceHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TraceHook")
    }
}

impl LocalMedium {
    pub fn open(root: &Path, fsync: bool, trace: Option<SyncTrace>) -> Result<Self, StoreError> {
        std::fs::create_dir_all(root).map_err(|e| StoreError::io("create packs directory", e))?;
        Ok(Self {
            root: root.to_path_buf(),
            fsync,
            trace: trace.map(TraceHook),
            open: Mutex::new(HashMap::new()),
        })
    }

    pub fn path_of(&self, id: &PackId) -> PathBuf {
        let hex = id.to_hex();
        self.root.join(&hex[..2]).join(format!("{hex}.pack"))
    }

    fn note(&self, step: &'static str) {
        if let Some(trace) = &self.trace {
            (trace.0)(step);
        }
        super::pause::after(step);
    }

    fn file(&self, id: &PackId) -> Result<Arc<File>, StoreError> {
        if let Some(file) = self.open.lock().expect("pack cache").get(id) {
            return Ok(file.clone());
        }
        let file = Arc::new(File::open(self.path_of(id)).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                StoreError::Corrupt(format!("pack {id} is missing"))
            } else {
                StoreError::io("open pack", e)
            }
        })?);
        let mut open = self.open.lock().expect("pack cache");
        if open.len() >= OPEN_PACKS {
            open.clear();
        }
        open.insert(*id, file.clone());
        Ok(file)
    }
}

/// A file's modification time in unix ms (0 if unknown).
pub fn modified_ms(path: &Path) -> u64 {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io("fsync directory", e))
}

/// Make the names a node's start created under `data_dir` durable (STO-24): the entries of
/// `packs/` (its spool directory), of `data_dir` itself (`packs/`, `manifests/`, `tmp/`,
/// the index and ledger files) and the data directory's own name in its parent. A
/// directory created without a sync of its parent can vanish in a power loss together
/// with everything acknowledged under it.
pub fn sync_data_dir(data_dir: &Path) -> Result<(), StoreError> {
    let packs = data_dir.join("packs");
    if packs.is_dir() {
        sync_dir(&packs)?;
    }
    sync_dir(data_dir)?;
    if let Some(parent) = data_dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent)?;
    }
    Ok(())
}

impl Medium for LocalMedium {
    fn publish(&self, spool: File, spool_path: &Path, id: &PackId) -> Result<(), StoreError> {
        if self.fsync {
            spool
                .sync_data()
                .map_err(|e| StoreError::io("fsync pack", e))?;
            self.note("pack data synced");
        }
        drop(spool);
        let path = self.path_of(id);
        let parent = path.parent().expect("pack paths have a parent");
        if !parent.is_dir() {
            // A new two-hex directory: its entry in the root must be durable before the
            // pack's name in it can be (STO-1).
            match std::fs::create_dir(parent) {
                Ok(()) => {
                    if self.fsync {
                        sync_dir(&self.root)?;
                        self.note("new pack directory: root synced");
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(StoreError::io("create pack directory", e)),
            }
        }
        // Same name, same bytes (see `format`): replacing a racing copy is harmless.
        std::fs::rename(spool_path, &path).map_err(|e| StoreError::io("publish pack", e))?;
        self.note("pack renamed");
        if self.fsync {
            sync_dir(parent)?;
            self.note("pack directory synced");
        }
        Ok(())
    }

    fn read(&self, id: &PackId, offset: u64, len: u64) -> Result<Bytes, StoreError> {
        let file = self.file(id)?;
        let mut buf = vec![0u8; len as usize];
        file.read_exact_at(&mut buf, offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                StoreError::Corrupt(format!("pack {id} is truncated"))
            } else {
                StoreError::io("read pack", e)
            }
        })?;
        Ok(Bytes::from(buf))
    }

    fn read_all(&self, id: &PackId) -> Result<Bytes, StoreError> {
        std::fs::read(self.path_of(id))
            .map(Bytes::from)
            .map_err(|e| StoreError::io("read pack", e))
    }

    fn delete(&self, id: &PackId) -> Result<(), StoreError> {
        self.open.lock().expect("pack cache").remove(id);
        match std::fs::remove_file(self.path_of(id)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io("delete pack", e)),
        }
    }

    fn exists(&self, id: &PackId) -> Result<bool, StoreError> {
        Ok(self.path_of(id).is_file())
    }

    fn list(&self) -> Result<Vec<(PackId, u64)>, StoreError> {
        let mut out = Vec::new();
        let dirs = std::fs::read_dir(&self.root).map_err(|e| StoreError::io("list packs", e))?;
        for dir in dirs.flatten() {
            if dir.file_name() == "tmp" || !dir.path().is_dir() {
                continue;
            }
            for file in std::fs::read_dir(dir.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = file.file_name();
                let name = name.to_string_lossy();
                if let Some(id) = name.strip_suffix(".pack").and_then(PackId::from_hex) {
                    out.push((id, modified_ms(&file.path())));
                }
            }
        }
        Ok(out)
    }

    fn describe(&self) -> String {
        format!("local packs under {}", self.root.display())
    }

    /// The pack directory is there and readable.
    fn probe(&self) -> Result<(), StoreError> {
        std::fs::read_dir(&self.root)
            .map(drop)
            .map_err(|e| StoreError::io("read the pack directory", e))
    }

    fn publish_behind(&self) -> bool {
        true
    }

    fn direct_spool(&self) -> bool {
        self.fsync
    }
}
