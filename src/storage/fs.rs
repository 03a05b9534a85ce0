//! Filesystem manifest store (the embedded default) and the file-per-block store of
//! earlier versions (still read as a fallback by the pack store, and the source of
//! `graviton migrate-blocks`).
//!
//! Layout under the data directory:
//! ```text
//! blocks/<first 2 hex>/<64 hex>                 one file per block (legacy)
//! manifests/<first 2 hex>/<64 hex>-<size>.json  one file per blob
//! tmp/                                          in-flight writes
//! ```
//! Every write goes to a temporary file in the same filesystem, is optionally fsynced,
//! and is published atomically, so readers see complete files or nothing. Manifests are
//! published with a no-clobber link (the first writer wins). Blocks are published with a
//! rename after an existence check: only two concurrent writers of the same block can
//! both publish, and their bytes are identical because the name is their hash. With `fsync` on, the parent directory is synced
//! after publishing. Blocks of a failed upload may remain (they are content-addressed and
//! harmless); no manifest is written for a failed upload, so no partial blob is visible.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use super::{
    BlockStore, CommitReport, CreateOutcome, ManifestStore, PutOutcome, StoreError, StoreFuture,
    WriteSession,
};
use crate::cas::{BlobKey, BlockKey, Manifest};

/// Shared directory handling of both stores.
#[derive(Debug)]
struct Dirs {
    root: PathBuf,
    tmp: PathBuf,
    fsync: bool,
}

impl Dirs {
    fn open(root: &Path, sub: &str, fsync: bool) -> Result<Self, StoreError> {
        let root = root.join(sub);
        let tmp = root.parent().unwrap_or(&root).join("tmp");
        std::fs::create_dir_all(&root).map_err(|e| StoreError::io("create store directory", e))?;
        std::fs::create_dir_all(&tmp).map_err(|e| StoreError::io("create tmp directory", e))?;
        Ok(Self { root, tmp, fsync })
    }

    /// Atomically publish `data` at `path`; `Ok(false)` if the file already exists.
    ///
    /// With `identical_if_raced` (blocks: the name is the content's hash), a file that
    /// appears between the existence check and the publish is known to hold the same
    /// bytes, so the cheaper `rename` is used. Otherwise (manifests) a no-clobber link
    /// guarantees the first writer wins.
    fn publish(
        &self,
        path: &Path,
        data: &[u8],
        identical_if_raced: bool,
    ) -> Result<bool, StoreError> {
        if path.exists() {
            return Ok(false);
        }
        let parent = path.parent().expect("store paths have a parent");
        if !parent.is_dir() {
            std::fs::create_dir_all(parent).map_err(|e| StoreError::io("create directory", e))?;
            // The new directory's entry must be durable before the file's name in it is.
            if self.fsync
                && let Some(grandparent) = parent.parent()
            {
                sync_dir(grandparent)?;
            }
        }
        let mut tmp = tempfile::NamedTempFile::new_in(&self.tmp)
            .map_err(|e| StoreError::io("create temporary file", e))?;
        tmp.write_all(data)
            .map_err(|e| StoreError::io("write temporary file", e))?;
        if self.fsync {
            tmp.as_file()
                .sync_data()
                .map_err(|e| StoreError::io("fsync file", e))?;
        }
        let published = if identical_if_raced {
            tmp.persist(path).map(|_| ()).map_err(|e| e.error)
        } else {
            tmp.persist_noclobber(path).map(|_| ()).map_err(|e| e.error)
        };
        match published {
            Ok(()) => {
                if self.fsync {
                    sync_dir(parent)?;
                }
                Ok(true)
            }
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(err) => Err(StoreError::io("publish file", err)),
        }
    }
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io("fsync directory", e))
}

fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, StoreError> {
    match std::fs::read(path) {
        Ok(data) => Ok(Some(data)),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(StoreError::io("read file", err)),
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

/// Blocks as files under `<data_dir>/blocks`.
#[derive(Debug, Clone)]
pub struct FsBlockStore {
    dirs: Arc<Dirs>,
}

impl FsBlockStore {
    pub fn open(data_dir: &Path, fsync: bool) -> Result<Self, StoreError> {
        Ok(Self {
            dirs: Arc::new(Dirs::open(data_dir, "blocks", fsync)?),
        })
    }

    /// Path of a block's file.
    pub fn path_of(&self, key: &BlockKey) -> PathBuf {
        let hex = key.to_hex();
        self.dirs.root.join(&hex[..2]).join(hex)
    }
}

impl FsBlockStore {
    /// Store one block as its own file (each put is durable on its own with fsync on).
    pub fn put(&self, key: BlockKey, data: Bytes) -> StoreFuture<'_, PutOutcome> {
        let path = self.path_of(&key);
        let dirs = self.dirs.clone();
        Box::pin(blocking(move || {
            Ok(if dirs.publish(&path, &data, true)? {
                PutOutcome::Fresh
            } else {
                PutOutcome::Duplicate
            })
        }))
    }

    /// Every block file (key and path), for migration.
    pub fn list(&self) -> Result<Vec<(BlockKey, PathBuf)>, StoreError> {
        let mut out = Vec::new();
        let dirs =
            std::fs::read_dir(&self.dirs.root).map_err(|e| StoreError::io("list blocks", e))?;
        for dir in dirs.flatten() {
            for file in std::fs::read_dir(dir.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let mut key = [0u8; 32];
                if hex::decode_to_slice(file.file_name().to_string_lossy().as_bytes(), &mut key)
                    .is_ok()
                {
                    out.push((BlockKey(key), file.path()));
                }
            }
        }
        Ok(out)
    }
}

/// A session that stores each block as it arrives (the file-per-block store).
struct FsSession {
    store: FsBlockStore,
    fresh_bytes: u64,
    /// Blocks of earlier sessions the caller's manifest names, checked at commit.
    confirm: Vec<BlockKey>,
}

impl WriteSession for FsSession {
    fn append(&mut self, key: BlockKey, data: Bytes) -> StoreFuture<'_, PutOutcome> {
        Box::pin(async move {
            let len = data.len() as u64;
            let outcome = self.store.put(key, data).await?;
            if outcome == PutOutcome::Fresh {
                self.fresh_bytes += len;
            }
            Ok(outcome)
        })
    }

    fn confirm(&mut self, keys: Vec<BlockKey>) {
        self.confirm.extend(keys);
    }

    fn commit(self: Box<Self>) -> StoreFuture<'static, CommitReport> {
        Box::pin(async move {
            for key in &self.confirm {
                if !self.store.contains(*key).await? {
                    return Err(StoreError::Unavailable(format!(
                        "block {} was collected while the upload ran",
                        key.to_hex()
                    )));
                }
            }
            Ok(CommitReport {
                packs: 0,
                fresh_bytes: self.fresh_bytes,
            })
        })
    }

    fn abort(self: Box<Self>) -> StoreFuture<'static, ()> {
        Box::pin(async { Ok(()) })
    }
}

impl BlockStore for FsBlockStore {
    fn begin(&self) -> Result<Box<dyn WriteSession>, StoreError> {
        Ok(Box::new(FsSession {
            confirm: Vec::new(),
            store: self.clone(),
            fresh_bytes: 0,
        }))
    }

    fn get(&self, key: BlockKey) -> StoreFuture<'_, Option<Bytes>> {
        let path = self.path_of(&key);
        Box::pin(blocking(move || Ok(read_optional(&path)?.map(Bytes::from))))
    }

    fn contains(&self, key: BlockKey) -> StoreFuture<'_, bool> {
        let path = self.path_of(&key);
        Box::pin(blocking(move || Ok(path.is_file())))
    }
}

/// Manifests as JSON files under `<data_dir>/manifests`.
#[derive(Debug, Clone)]
pub struct FsManifestStore {
    dirs: Arc<Dirs>,
}

impl FsManifestStore {
    pub fn open(data_dir: &Path, fsync: bool) -> Result<Self, StoreError> {
        Ok(Self {
            dirs: Arc::new(Dirs::open(data_dir, "manifests", fsync)?),
        })
    }

    pub fn path_of(&self, key: &BlobKey) -> PathBuf {
        let hex = key.hash_hex();
        self.dirs
            .root
            .join(&hex[..2])
            .join(format!("{hex}-{}.json", key.size))
    }
}

impl ManifestStore for FsManifestStore {
    fn create(&self, manifest: &Manifest) -> StoreFuture<'_, CreateOutcome> {
        let path = self.path_of(&manifest.key);
        let dirs = self.dirs.clone();
        // CAS-6: a manifest whose blocks do not add up to its key is never written (it
        // would make the key unreadable, and first-writer-wins would keep it so).
        let valid = manifest.validate().map_err(|e| {
            StoreError::Corrupt(format!("refusing the manifest of {}: {e}", manifest.key))
        });
        let encoded = serde_json::to_vec(manifest);
        Box::pin(blocking(move || {
            valid?;
            let data = encoded.map_err(|e| StoreError::Corrupt(format!("encode manifest: {e}")))?;
            Ok(if dirs.publish(&path, &data, false)? {
                CreateOutcome::Created
            } else {
                CreateOutcome::AlreadyExists
            })
        }))
    }

    fn get(&self, key: BlobKey) -> StoreFuture<'_, Option<Manifest>> {
        let path = self.path_of(&key);
        Box::pin(blocking(move || {
            let Some(data) = read_optional(&path)? else {
                return Ok(None);
            };
            let manifest: Manifest = serde_json::from_slice(&data).map_err(|e| {
                StoreError::Corrupt(format!("manifest of {key} does not parse: {e}"))
            })?;
            if manifest.key != key {
                return Err(StoreError::Corrupt(format!(
                    "manifest file of {key} names another blob"
                )));
            }
            manifest
                .validate()
                .map_err(|e| StoreError::Corrupt(format!("manifest of {key}: {e}")))?;
            Ok(Some(manifest))
        }))
    }

    fn delete(&self, key: BlobKey) -> StoreFuture<'_, bool> {
        let path = self.path_of(&key);
        let fsync = self.dirs.fsync;
        Box::pin(blocking(move || match std::fs::remove_file(&path) {
            Ok(()) => {
                if fsync && let Some(parent) = path.parent() {
                    sync_dir(parent)?;
                }
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(StoreError::io("delete manifest", e)),
        }))
    }

    fn for_each_block<'a>(
        &'a self,
        visit: &'a mut (dyn FnMut(BlockKey) + Send),
    ) -> StoreFuture<'a, ()> {
        let root = self.dirs.root.clone();
        Box::pin(async move {
            let files = blocking(move || {
                let mut files = Vec::new();
                let dirs =
                    std::fs::read_dir(&root).map_err(|e| StoreError::io("list manifests", e))?;
                for dir in dirs.flatten() {
                    for file in std::fs::read_dir(dir.path())
                        .into_iter()
                        .flatten()
                        .flatten()
                    {
                        if file.path().extension().is_some_and(|e| e == "json") {
                            files.push(file.path());
                        }
                    }
                }
                Ok(files)
            })
            .await?;
            // One manifest in memory at a time.
            for path in files {
                let Some(data) = blocking(move || read_optional(&path)).await? else {
                    continue; // deleted meanwhile
                };
                let manifest: Manifest = serde_json::from_slice(&data)
                    .map_err(|e| StoreError::Corrupt(format!("a manifest does not parse: {e}")))?;
                for block in &manifest.blocks {
                    visit(block.key);
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cas::BlockRef;

    #[tokio::test]
    async fn blocks_are_written_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsBlockStore::open(dir.path(), true).unwrap();
        let data = Bytes::from_static(b"block bytes");
        let key = BlockKey::of(&data);
        assert_eq!(
            store.put(key, data.clone()).await.unwrap(),
            PutOutcome::Fresh
        );
        assert_eq!(
            store.put(key, data.clone()).await.unwrap(),
            PutOutcome::Duplicate
        );
        assert_eq!(store.get(key).await.unwrap(), Some(data));
        assert!(store.contains(key).await.unwrap());
        assert_eq!(store.get(BlockKey([7; 32])).await.unwrap(), None);
        // nothing left behind in tmp/
        assert_eq!(
            std::fs::read_dir(dir.path().join("tmp")).unwrap().count(),
            0
        );
    }

    #[tokio::test]
    async fn manifests_are_created_once_and_validated_on_read() {
        let dir = tempfile::tempdir().unwrap();
        // fsync on: the durable publish path (file, link, directory syncs) as in production.
        let store = FsManifestStore::open(dir.path(), true).unwrap();
        let content = b"hello manifest";
        let manifest = Manifest::new(
            BlobKey::of(content),
            vec![BlockRef {
                key: BlockKey::of(content),
                size: content.len() as u32,
            }],
            1,
        );
        assert_eq!(
            store.create(&manifest).await.unwrap(),
            CreateOutcome::Created
        );
        assert_eq!(
            store.create(&manifest).await.unwrap(),
            CreateOutcome::AlreadyExists
        );
        assert_eq!(
            store.get(manifest.key).await.unwrap(),
            Some(manifest.clone())
        );
        // a tampered file is reported as corrupt, not served
        std::fs::write(store.path_of(&manifest.key), b"{not json").unwrap();
        assert!(matches!(
            store.get(manifest.key).await,
            Err(StoreError::Corrupt(_))
        ));
    }
}
