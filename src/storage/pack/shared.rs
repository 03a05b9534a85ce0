//! The cluster's shared block index: tables `pack_packs` and `pack_blocks` in the
//! cluster's PostgreSQL (`sql/0008_pack_index.sql`), beside the manifests. Every node of a
//! cluster on S3 writes packs to the one bucket and records here where each block lives,
//! so any node reads and deduplicates against blocks that another node wrote.
//!
//! This module owns the index's queries: lookup, and the commit of one upload. The
//! collector's queries are in [`super::cluster_gc`].
//!
//! One upload's commit is one transaction (STO-1, STO-3, STO-10):
//! 1. its pack rows are inserted (a same-named retired pack is revived: same bytes);
//! 2. every one of its packs is checked on the medium (one HEAD each) while the
//!    transaction holds the rows. A collector deletes an object only while it holds that
//!    pack id's row (see `cluster_gc`), so a pack that is present now stays present;
//! 3. every deduplicated block is confirmed: `UPDATE ... RETURNING` must find its row
//!    (quarantined rows are restored), which also refreshes `last_ref`. A row exists only
//!    while its pack row does (foreign key), so a confirmed block has its bytes;
//! 4. the new block rows are inserted (a block another upload committed first keeps that
//!    location);
//! 5. with a manifest: the commit fence is checked (`FOR SHARE` of the shard row) and the
//!    manifest inserted ([`crate::storage::pg::manifest::create_in`]).
//!
//! Nothing is trusted from before the transaction: a dedup answer of `lookup` is only a
//! hint that lets the upload skip writing bytes.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use sqlx::PgPool;

use super::format::PackId;
use super::index::{CommitBatch, Location, vanished};
use super::medium::Medium;
use crate::cas::{BlockKey, Manifest};
use crate::storage::manifest::CommitFence;
use crate::storage::pg::manifest::{create_in, db_error};
use crate::storage::{CreateOutcome, StoreError};

/// The shared index over a pool of the cluster's database. Cheap to clone.
#[derive(Clone, Debug)]
pub struct PgIndex {
    pool: PgPool,
}

/// A location from an index row.
fn location(pack: &[u8], offset: i64, len: i32) -> Result<Location, StoreError> {
    Ok(Location {
        pack: pack_id(pack)?,
        offset: u64::try_from(offset)
            .map_err(|_| StoreError::Corrupt("negative block offset".into()))?,
        len: u32::try_from(len).map_err(|_| StoreError::Corrupt("negative block length".into()))?,
        last_ref_ms: 0,
    })
}

fn pack_id(raw: &[u8]) -> Result<PackId, StoreError> {
    raw.try_into()
        .map(PackId)
        .map_err(|_| StoreError::Corrupt(format!("pack id of {} bytes in the index", raw.len())))
}

impl PgIndex {
    /// An index over `pool`; the tables must exist ([`crate::storage::pg::migrate`]).
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Where `key` is stored; a quarantined block counts as absent (an upload writes it
    /// again rather than reviving it).
    pub async fn lookup(&self, key: &BlockKey) -> Result<Option<Location>, StoreError> {
        let row: Option<(Vec<u8>, i64, i32)> = sqlx::query_as(
            "SELECT pack_id, pack_offset, len FROM pack_blocks
             WHERE block_hash = $1 AND quarantined_at IS NULL",
        )
        .bind(key.0.as_slice())
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| db_error("look up a block", e))?;
        row.map(|(pack, offset, len)| location(&pack, offset, len))
            .transpose()
    }

    /// Where each of `keys` is stored (`None`: absent or quarantined), in order: one query
    /// for the whole batch (a download's read plan, `runs`).
    pub async fn locate_many(
        &self,
        keys: &[BlockKey],
    ) -> Result<Vec<Option<Location>>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let raw: Vec<&[u8]> = keys.iter().map(|k| k.0.as_slice()).collect();
        let rows: Vec<(Vec<u8>, Vec<u8>, i64, i32)> = sqlx::query_as(
            "SELECT block_hash, pack_id, pack_offset, len FROM pack_blocks
             WHERE block_hash = ANY($1) AND quarantined_at IS NULL",
        )
        .bind(&raw)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| db_error("look up blocks", e))?;
        let mut found = HashMap::with_capacity(rows.len());
        for (hash, pack, offset, len) in rows {
            let key = hash
                .as_slice()
                .try_into()
                .map(BlockKey)
                .map_err(|_| StoreError::Corrupt("block hash damaged in the index".into()))?;
            found.insert(key, location(&pack, offset, len)?);
        }
        Ok(keys.iter().map(|key| found.get(key).copied()).collect())
    }

    /// The dedup lookup of an upload: which of `keys` are stored, with `last_ref` of each
    /// hit refreshed in the same statement (STO-23). A collector selects only blocks whose
    /// last reference is older than `gc.min_age`, and its quarantine re-checks that, so a
    /// block an upload found stands for `min_age` from the hit, not from the last commit
    /// that named it (the commit refreshes it again, and fails cleanly if it is gone).
    pub async fn hit_many(&self, keys: &[BlockKey]) -> Result<HashSet<BlockKey>, StoreError> {
        if keys.is_empty() {
            return Ok(HashSet::new());
        }
        let raw: Vec<&[u8]> = keys.iter().map(|k| k.0.as_slice()).collect();
        let rows: Vec<(Vec<u8>,)> = sqlx::query_as(
            "UPDATE pack_blocks SET last_ref = now()
             WHERE block_hash = ANY($1) AND quarantined_at IS NULL
             RETURNING block_hash",
        )
        .bind(&raw)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| db_error("look up blocks", e))?;
        rows.into_iter()
            .map(|(hash,)| {
                hash.as_slice()
                    .try_into()
                    .map(BlockKey)
                    .map_err(|_| StoreError::Corrupt("block hash damaged in the index".into()))
            })
            .collect()
    }

    /// One upload's commit (see the module docs); with `manifest`, the manifest is
    /// created in the same transaction and its outcome returned.
    pub async fn commit(
        &self,
        batch: &CommitBatch,
        medium: &Arc<dyn Medium>,
        manifest: Option<(&Manifest, Option<&CommitFence>)>,
    ) -> Result<Option<CreateOutcome>, StoreError> {
        if batch.packs.is_empty()
            && batch.new.is_empty()
            && batch.reused.is_empty()
            && manifest.is_none()
        {
            return Ok(None);
        }
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(|e| db_error("begin the index commit", e))?;

        if !batch.packs.is_empty() {
            let ids: Vec<Vec<u8>> = batch.packs.iter().map(|p| p.id.0.to_vec()).collect();
            let sizes: Vec<i64> = batch.packs.iter().map(|p| p.size as i64).collect();
            let blocks: Vec<i32> = batch.packs.iter().map(|p| p.blocks as i32).collect();
            sqlx::query(
                "INSERT INTO pack_packs (pack_id, size, blocks)
                 SELECT * FROM UNNEST($1::bytea[], $2::bigint[], $3::integer[])
                 ON CONFLICT (pack_id) DO UPDATE SET retired_at = NULL",
            )
            .bind(&ids)
            .bind(&sizes)
            .bind(&blocks)
            .execute(&mut *tx)
            .await
            .map_err(|e| db_error("record packs", e))?;
            // The rows are ours until the commit: a collector can no longer delete these
            // objects, so what is present now stays present (STO-10). The checks wait on
            // the object store with the rows held: the idle bound widens for them only.
            crate::storage::pg::allow_idle_for_medium(&mut tx)
                .await
                .map_err(|e| db_error("widen the idle bound", e))?;
            let medium = medium.clone();
            let packs: Vec<PackId> = batch.packs.iter().map(|p| p.id).collect();
            let missing = tokio::task::spawn_blocking(move || {
                for id in packs {
                    if !medium.exists(&id)? {
                        return Ok(Some(id));
                    }
                }
                Ok::<_, StoreError>(None)
            })
            .await
            .map_err(|e| StoreError::Unavailable(format!("pack check task: {e}")))??;
            if let Some(id) = missing {
                return Err(StoreError::Unavailable(format!(
                    "pack {id} was deleted by the collector before the upload committed; \
                     retry the upload"
                )));
            }
            crate::storage::pg::restore_idle(&mut tx)
                .await
                .map_err(|e| db_error("restore the idle bound", e))?;
        }

        if !batch.reused.is_empty() {
            let keys: Vec<Vec<u8>> = batch.reused.iter().map(|k| k.0.to_vec()).collect();
            let confirmed: Vec<(Vec<u8>, Vec<u8>)> = sqlx::query_as(
                "UPDATE pack_blocks SET last_ref = now(), quarantined_at = NULL
                 WHERE block_hash = ANY($1) RETURNING block_hash, pack_id",
            )
            .bind(&keys)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| db_error("confirm deduplicated blocks", e))?;
            if confirmed.len() != keys.len() {
                let found: HashSet<&[u8]> = confirmed.iter().map(|(k, _)| k.as_slice()).collect();
                let gone = batch
                    .reused
                    .iter()
                    .find(|k| !found.contains(k.0.as_slice()))
                    .copied()
                    .unwrap_or(batch.reused[0]);
                return Err(vanished(&gone));
            }
            // A restored block's pack may have been retired meanwhile: live again.
            let packs: Vec<Vec<u8>> = confirmed
                .into_iter()
                .map(|(_, p)| p)
                .collect::<HashSet<_>>()
                .into_iter()
                .collect();
            sqlx::query(
                "UPDATE pack_packs SET retired_at = NULL
                 WHERE pack_id = ANY($1) AND retired_at IS NOT NULL",
            )
            .bind(&packs)
            .execute(&mut *tx)
            .await
            .map_err(|e| db_error("revive packs", e))?;
        }

        if !batch.new.is_empty() {
            let keys: Vec<Vec<u8>> = batch.new.iter().map(|(k, _)| k.0.to_vec()).collect();
            let packs: Vec<Vec<u8>> = batch.new.iter().map(|(_, l)| l.pack.0.to_vec()).collect();
            let offsets: Vec<i64> = batch.new.iter().map(|(_, l)| l.offset as i64).collect();
            let lens: Vec<i32> = batch.new.iter().map(|(_, l)| l.len as i32).collect();
            // A racing upload that committed the same block first keeps its location
            // (ours becomes dead bytes); a quarantined one is replaced by ours.
            sqlx::query(
                "INSERT INTO pack_blocks (block_hash, pack_id, pack_offset, len)
                 SELECT * FROM UNNEST($1::bytea[], $2::bytea[], $3::bigint[], $4::integer[])
                 ON CONFLICT (block_hash) DO UPDATE SET
                   pack_id = CASE WHEN pack_blocks.quarantined_at IS NULL
                             THEN pack_blocks.pack_id ELSE EXCLUDED.pack_id END,
                   pack_offset = CASE WHEN pack_blocks.quarantined_at IS NULL
                             THEN pack_blocks.pack_offset ELSE EXCLUDED.pack_offset END,
                   len = CASE WHEN pack_blocks.quarantined_at IS NULL
                             THEN pack_blocks.len ELSE EXCLUDED.len END,
                   last_ref = now(),
                   quarantined_at = NULL",
            )
            .bind(&keys)
            .bind(&packs)
            .bind(&offsets)
            .bind(&lens)
            .execute(&mut *tx)
            .await
            .map_err(|e| db_error("record blocks", e))?;
        }

        let outcome = match manifest {
            Some((manifest, fence)) => Some(create_in(&mut tx, manifest, fence).await?),
            None => None,
        };
        tx.commit()
            .await
            .map_err(|e| db_error("commit the index", e))?;
        Ok(outcome)
    }
}
