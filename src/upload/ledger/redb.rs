//! The ledger of one node: `<data_dir>/uploads.redb` (a file of its own, so the offline
//! `graviton gc` and the block index keep their single-opener rule unchanged). Every
//! write is one durable transaction (`Durability::Immediate`); redb calls run on the
//! blocking pool. One node owns every shard forever, so the writers' fences are not
//! checked here (as the file manifest store ignores them).

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};

use super::{Advance, RowVersion, UploadLedger, UploadRow, decode_block, encode_block};
use crate::cas::{BlockKey, BlockRef};
use crate::storage::manifest::CommitFence;
use crate::storage::{StoreError, StoreFuture};
use crate::tus::UploadId;

const UPLOADS: TableDefinition<&str, &[u8]> = TableDefinition::new("uploads");
const TAILS: TableDefinition<&str, &[u8]> = TableDefinition::new("tails");
/// The saved chunker state of each upload (`cas::pdf::resume`), written with its tail.
const CHUNKERS: TableDefinition<&str, &[u8]> = TableDefinition::new("chunkers");
const BLOCKS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("blocks");

fn err(op: &'static str) -> impl Fn(redb::Error) -> StoreError {
    move |e| StoreError::Unavailable(format!("upload ledger {op}: {e}"))
}

macro_rules! r {
    ($op:expr, $e:expr) => {
        $e.map_err(|e| err($op)(e.into()))
    };
}

/// The redb ledger (see the module docs). Cheap to clone.
#[derive(Clone)]
pub struct RedbLedger {
    db: Arc<Database>,
}

impl std::fmt::Debug for RedbLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RedbLedger")
    }
}

fn encode_row(row: &UploadRow) -> Result<Vec<u8>, StoreError> {
    rmp_serde::to_vec_named(row)
        .map_err(|e| StoreError::Corrupt(format!("upload ledger row encode: {e}")))
}

fn decode_row(raw: &[u8]) -> Result<UploadRow, StoreError> {
    rmp_serde::from_slice(raw)
        .map_err(|e| StoreError::Corrupt(format!("upload ledger row damaged: {e}")))
}

impl RedbLedger {
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let db = r!("open", Database::create(path))?;
        let txn = r!("begin", db.begin_write())?;
        {
            r!("create table", txn.open_table(UPLOADS))?;
            r!("create table", txn.open_table(TAILS))?;
            r!("create table", txn.open_table(CHUNKERS))?;
            r!("create table", txn.open_table(BLOCKS))?;
        }
        r!("commit", txn.commit())?;
        Ok(Self { db: Arc::new(db) })
    }

    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Database) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let db = self.db.clone();
        tokio::task::spawn_blocking(move || work(&db))
            .await
            .map_err(|e| StoreError::Unavailable(format!("upload ledger task failed: {e}")))?
    }

    fn remove_all(txn: &redb::WriteTransaction, id: &str) -> Result<bool, StoreError> {
        let mut uploads = r!("open", txn.open_table(UPLOADS))?;
        let mut tails = r!("open", txn.open_table(TAILS))?;
        let mut blocks = r!("open", txn.open_table(BLOCKS))?;
        let existed = r!("remove", uploads.remove(id))?.is_some();
        r!("remove", tails.remove(id))?;
        r!("remove", r!("open", txn.open_table(CHUNKERS))?.remove(id))?;
        r!(
            "remove",
            blocks.retain_in((id, 0)..=(id, u64::MAX), |_, _| false)
        )?;
        Ok(existed)
    }

    fn write<T>(
        db: &Database,
        work: impl FnOnce(&redb::WriteTransaction) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut txn = r!("begin", db.begin_write())?;
        r!("durability", txn.set_durability(Durability::Immediate))?;
        let out = work(&txn)?;
        r!("commit", txn.commit())?;
        Ok(out)
    }
}

impl UploadLedger for RedbLedger {
    fn create(
        &self,
        id: UploadId,
        row: &UploadRow,
        now_ms: u64,
        _fence: Option<CommitFence>,
    ) -> StoreFuture<'_, bool> {
        let row = row.clone();
        Box::pin(self.blocking(move |db| {
            let id = id.to_string();
            let encoded = encode_row(&row)?;
            Self::write(db, |txn| {
                let existing = {
                    let uploads = r!("open", txn.open_table(UPLOADS))?;
                    r!("read", uploads.get(id.as_str()))?
                        .map(|v| decode_row(v.value()))
                        .transpose()?
                };
                if let Some(existing) = existing {
                    if !existing.is_expired(now_ms) {
                        return Ok(false);
                    }
                    Self::remove_all(txn, &id)?;
                }
                let mut uploads = r!("open", txn.open_table(UPLOADS))?;
                r!("insert", uploads.insert(id.as_str(), encoded.as_slice()))?;
                Ok(true)
            })
        }))
    }

    fn get(&self, id: UploadId) -> StoreFuture<'_, Option<(UploadRow, Bytes)>> {
        Box::pin(self.blocking(move |db| {
            let id = id.to_string();
            let txn = r!("read", db.begin_read())?;
            let uploads = r!("read", txn.open_table(UPLOADS))?;
            let Some(row) = r!("read", uploads.get(id.as_str()))? else {
                return Ok(None);
            };
            let mut row = decode_row(row.value())?;
            let chunkers = r!("read", txn.open_table(CHUNKERS))?;
            row.chunker = r!("read", chunkers.get(id.as_str()))?
                .map(|v| Bytes::copy_from_slice(v.value()))
                .unwrap_or_default();
            let tails = r!("read", txn.open_table(TAILS))?;
            let tail = r!("read", tails.get(id.as_str()))?
                .map(|v| Bytes::copy_from_slice(v.value()))
                .unwrap_or_default();
            Ok(Some((row, tail)))
        }))
    }

    fn blocks(&self, id: UploadId, at: RowVersion) -> StoreFuture<'_, Option<Vec<BlockRef>>> {
        Box::pin(self.blocking(move |db| {
            let id = id.to_string();
            // One read transaction: the row and its blocks from one snapshot.
            let txn = r!("read", db.begin_read())?;
            let uploads = r!("read", txn.open_table(UPLOADS))?;
            let Some(row) = r!("read", uploads.get(id.as_str()))? else {
                return Ok(None);
            };
            let row = decode_row(row.value())?;
            if row.version() != at || row.is_complete() {
                return Ok(None);
            }
            let table = r!("read", txn.open_table(BLOCKS))?;
            let mut out = Vec::new();
            for item in r!(
                "scan",
                table.range((id.as_str(), 0)..=(id.as_str(), u64::MAX))
            )? {
                let (_, v) = r!("scan", item)?;
                out.push(decode_block(v.value())?);
            }
            Ok(Some(out))
        }))
    }

    fn advance(
        &self,
        id: UploadId,
        from: RowVersion,
        step: Advance,
        _fence: Option<CommitFence>,
    ) -> StoreFuture<'_, bool> {
        Box::pin(self.blocking(move |db| {
            let id = id.to_string();
            Self::write(db, |txn| {
                let mut uploads = r!("open", txn.open_table(UPLOADS))?;
                let row = r!("read", uploads.get(id.as_str()))?
                    .map(|v| decode_row(v.value()))
                    .transpose()?;
                let Some(mut row) = row else { return Ok(false) };
                if row.version() != from || row.is_complete() {
                    return Ok(false);
                }
                let mut tails = r!("open", txn.open_table(TAILS))?;
                let mut chunkers = r!("open", txn.open_table(CHUNKERS))?;
                let mut blocks = r!("open", txn.open_table(BLOCKS))?;
                if let Some(key) = step.blob_key {
                    // Complete: the manifest now references the blocks.
                    r!(
                        "remove",
                        blocks.retain_in((id.as_str(), 0)..=(id.as_str(), u64::MAX), |_, _| {
                            false
                        })
                    )?;
                    r!("remove", tails.remove(id.as_str()))?;
                    r!("remove", chunkers.remove(id.as_str()))?;
                    row.blob_key = Some(key.to_string());
                    row.block_count = 0;
                } else {
                    for block in &step.blocks {
                        let encoded = encode_block(block);
                        r!(
                            "insert",
                            blocks.insert((id.as_str(), row.block_count), encoded.as_slice())
                        )?;
                        row.block_count += 1;
                    }
                    r!("insert", tails.insert(id.as_str(), step.tail.as_ref()))?;
                    r!(
                        "insert",
                        chunkers.insert(id.as_str(), step.chunker.as_ref())
                    )?;
                }
                row.offset = step.offset;
                row.expires_ms = step.expires_ms;
                let encoded = encode_row(&row)?;
                r!("insert", uploads.insert(id.as_str(), encoded.as_slice()))?;
                Ok(true)
            })
        }))
    }

    fn delete(&self, id: UploadId, _fence: Option<CommitFence>) -> StoreFuture<'_, bool> {
        Box::pin(self.blocking(move |db| {
            let id = id.to_string();
            Self::write(db, |txn| Self::remove_all(txn, &id))
        }))
    }

    fn expired(&self, now_ms: u64) -> StoreFuture<'_, Vec<UploadId>> {
        Box::pin(self.blocking(move |db| {
            let txn = r!("read", db.begin_read())?;
            let uploads = r!("read", txn.open_table(UPLOADS))?;
            let mut expired = Vec::new();
            for item in r!("scan", uploads.iter())? {
                let (k, v) = r!("scan", item)?;
                if decode_row(v.value())?.is_expired(now_ms) {
                    let id = k
                        .value()
                        .parse()
                        .map_err(|_| StoreError::Corrupt("upload ledger id damaged".into()))?;
                    expired.push(id);
                }
            }
            Ok(expired)
        }))
    }

    fn delete_expired(
        &self,
        ids: Vec<UploadId>,
        now_ms: u64,
        _fence: Option<CommitFence>,
    ) -> StoreFuture<'_, u64> {
        Box::pin(self.blocking(move |db| {
            if ids.is_empty() {
                return Ok(0);
            }
            Self::write(db, |txn| {
                let mut removed = 0;
                for id in ids.iter().map(|id| id.to_string()) {
                    // Re-checked inside the write: a PATCH may have refreshed it.
                    let still = {
                        let uploads = r!("open", txn.open_table(UPLOADS))?;
                        r!("read", uploads.get(id.as_str()))?
                            .map(|v| decode_row(v.value()))
                            .transpose()?
                            .is_some_and(|row| row.is_expired(now_ms))
                    };
                    if still && Self::remove_all(txn, &id)? {
                        removed += 1;
                    }
                }
                Ok(removed)
            })
        }))
    }

    fn for_each_block<'a>(
        &'a self,
        visit: &'a mut (dyn FnMut(BlockKey) + Send),
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let keys = self
                .blocking(|db| {
                    let txn = r!("read", db.begin_read())?;
                    let table = r!("read", txn.open_table(BLOCKS))?;
                    let mut keys = Vec::new();
                    for item in r!("scan", table.iter())? {
                        let (_, v) = r!("scan", item)?;
                        keys.push(decode_block(v.value())?.key);
                    }
                    Ok(keys)
                })
                .await?;
            keys.into_iter().for_each(visit);
            Ok(())
        })
    }
}
