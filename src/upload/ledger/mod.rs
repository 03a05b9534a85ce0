//! The ledger of resumable (tus) uploads: one row per upload with its declared length,
//! the offset durably accepted, the expiry, the staged tail (the bytes after the last cut
//! point: less than one maximum chunk for FastCDC, less than `max + LOOKAHEAD` for the
//! PDF-aware chunker) with the chunker state saved beside it, and the ordered blocks so
//! far; the blob key once complete. See docs/resumable.md.
//!
//! [`UploadLedger`] is the port; [`RedbLedger`] keeps it in `<data_dir>/uploads.redb` on
//! one node, [`PgLedger`] in the cluster's PostgreSQL (`sql/0009_uploads.sql`), so any
//! node that becomes the session's owner finds the upload. [`LiveUploads`] makes the
//! collector treat every block of a live upload as referenced.
//!
//! Every row carries a *generation*, a random number chosen when the upload is created, so
//! an upload terminated (or swept) and created again under the same id is told apart from
//! the one before it. A PATCH names the [`RowVersion`] (generation and offset) it read:
//! [`UploadLedger::blocks`] answers only for that version, read in one snapshot, and
//! [`UploadLedger::advance`] moves the row only from it. Everything a PATCH derives from
//! the row (the block list of its manifest, the whole-content hasher it resumes) is thus
//! bound to one version of one upload (CAS-7).

mod pg;
mod redb;

use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

pub use self::pg::PgLedger;
pub use self::redb::RedbLedger;
use crate::cas::{BlobKey, BlockKey, BlockRef, Manifest};
use crate::storage::manifest::CommitFence;
use crate::storage::{CreateOutcome, ManifestStore, StoreError, StoreFuture};
use crate::tus::UploadId;

/// One upload's row (without its tail and blocks).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadRow {
    /// `Upload-Length`.
    pub length: u64,
    /// Bytes durably accepted: the committed blocks plus the staged tail.
    pub offset: u64,
    /// Unix ms after which the upload is gone.
    pub expires_ms: u64,
    pub created_ms: u64,
    /// `Upload-Metadata` as sent (validated).
    pub metadata: Option<String>,
    /// Blocks recorded so far (the next block's sequence number).
    pub block_count: u64,
    /// The blob's key once the upload is complete.
    pub blob_key: Option<String>,
    /// Chosen at random when the upload is created (see the module docs); rows written
    /// before generations existed read as 0.
    #[serde(default)]
    pub generation: u64,
    /// The chunker state saved with the staged tail (`cas::pdf::resume`; empty in rows
    /// written before it existed). Stored beside the row, not in its encoding.
    #[serde(skip)]
    pub chunker: Bytes,
}

/// The version of an upload a PATCH read: which creation of the id, at which offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowVersion {
    pub generation: u64,
    pub offset: u64,
}

/// A new generation: random, non-zero, and representable as a PostgreSQL `bigint`.
pub fn new_generation() -> u64 {
    let random = uuid::Uuid::new_v4().as_u128() as u64;
    (random & i64::MAX as u64).max(1)
}

impl UploadRow {
    pub fn version(&self) -> RowVersion {
        RowVersion {
            generation: self.generation,
            offset: self.offset,
        }
    }

    pub fn is_expired(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_ms
    }

    pub fn is_complete(&self) -> bool {
        self.blob_key.is_some()
    }
}

/// What one PATCH durably accepted.
#[derive(Debug, Clone)]
pub struct Advance {
    pub offset: u64,
    /// The new staged tail (replaces the old one).
    pub tail: Bytes,
    /// The chunker state to resume from with that tail (replaces the old one; at most
    /// `cas::pdf::resume::MAX_SAVED_LEN` bytes).
    pub chunker: Bytes,
    /// Blocks cut by this PATCH, appended after the recorded ones.
    pub blocks: Vec<BlockRef>,
    pub expires_ms: u64,
    /// Set on the final PATCH: the blocks and tail are dropped (the manifest holds them).
    pub blob_key: Option<BlobKey>,
}

/// The ledger port (see the module docs).
///
/// Every write takes the writer's `fence` (the [`CommitFence`] of its ingest permit: this
/// node owns the upload's shard at that epoch). A ledger shared by the nodes of a cluster
/// checks it atomically with the write and answers [`StoreError::Fenced`] when it does
/// not hold, so a node that lost the shard cannot create, advance or delete a row
/// (TUS-5). The ledger of one embedded node, which owns every shard forever, ignores it,
/// as its manifest store does. `None` writes unfenced.
pub trait UploadLedger: Send + Sync + 'static {
    /// Record a new upload. `Ok(false)` if a live (unexpired) upload with this id exists;
    /// an expired one is replaced.
    fn create(
        &self,
        id: UploadId,
        row: &UploadRow,
        now_ms: u64,
        fence: Option<CommitFence>,
    ) -> StoreFuture<'_, bool>;

    /// The row and the staged tail.
    fn get(&self, id: UploadId) -> StoreFuture<'_, Option<(UploadRow, Bytes)>>;

    /// The recorded blocks, in order, read in one snapshot with the row: `None` unless the
    /// row is still at version `at` and not complete.
    fn blocks(&self, id: UploadId, at: RowVersion) -> StoreFuture<'_, Option<Vec<BlockRef>>>;

    /// Apply `step` if the row is still at version `from` (and it is not complete).
    /// `Ok(false)` when the row is gone, was created again or moved on.
    fn advance(
        &self,
        id: UploadId,
        from: RowVersion,
        step: Advance,
        fence: Option<CommitFence>,
    ) -> StoreFuture<'_, bool>;

    /// Remove an upload (termination). `Ok(false)` if there was none.
    fn delete(&self, id: UploadId, fence: Option<CommitFence>) -> StoreFuture<'_, bool>;

    /// The ids of every upload expired at `now_ms` (the sweep's candidates; the sweeping
    /// node keeps those of shards it owns, see `UploadService::sweep_expired`).
    fn expired(&self, now_ms: u64) -> StoreFuture<'_, Vec<UploadId>>;

    /// Remove those of `ids` that are still expired at `now_ms`, under `fence` (all of
    /// `ids` are of its shard); returns how many.
    fn delete_expired(
        &self,
        ids: Vec<UploadId>,
        now_ms: u64,
        fence: Option<CommitFence>,
    ) -> StoreFuture<'_, u64>;

    /// Visit every block of every upload in the ledger (the collector's mark phase).
    fn for_each_block<'a>(
        &'a self,
        visit: &'a mut (dyn FnMut(BlockKey) + Send),
    ) -> StoreFuture<'a, ()>;
}

/// The manifests, seen by the collector with the blocks of live uploads added to every
/// mark: an incomplete upload's blocks are referenced by the ledger however old they are.
pub struct LiveUploads {
    pub manifests: Arc<dyn ManifestStore>,
    pub ledger: Arc<dyn UploadLedger>,
}

impl ManifestStore for LiveUploads {
    fn create(&self, manifest: &Manifest) -> StoreFuture<'_, CreateOutcome> {
        self.manifests.create(manifest)
    }

    fn create_fenced<'a>(
        &'a self,
        manifest: &'a Manifest,
        fence: Option<&'a CommitFence>,
    ) -> StoreFuture<'a, CreateOutcome> {
        self.manifests.create_fenced(manifest, fence)
    }

    fn database(&self) -> Option<&sqlx::PgPool> {
        self.manifests.database()
    }

    fn get(&self, key: BlobKey) -> StoreFuture<'_, Option<Manifest>> {
        self.manifests.get(key)
    }

    fn delete(&self, key: BlobKey) -> StoreFuture<'_, bool> {
        self.manifests.delete(key)
    }

    fn for_each_block<'a>(
        &'a self,
        visit: &'a mut (dyn FnMut(BlockKey) + Send),
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.manifests.for_each_block(visit).await?;
            self.ledger.for_each_block(visit).await
        })
    }
}

/// A block as the ledgers store it: 32-byte key then the size, little-endian.
pub(super) fn encode_block(block: &BlockRef) -> [u8; 36] {
    let mut out = [0u8; 36];
    out[..32].copy_from_slice(&block.key.0);
    out[32..].copy_from_slice(&block.size.to_le_bytes());
    out
}

pub(super) fn decode_block(raw: &[u8]) -> Result<BlockRef, StoreError> {
    if raw.len() != 36 {
        return Err(StoreError::Corrupt("upload ledger block damaged".into()));
    }
    let mut key = [0u8; 32];
    key.copy_from_slice(&raw[..32]);
    let mut size = [0u8; 4];
    size.copy_from_slice(&raw[32..]);
    Ok(BlockRef {
        key: BlockKey(key),
        size: u32::from_le_bytes(size),
    })
}

#[cfg(test)]
mod tests;
