//! The ledger of a cluster: `tus_uploads` and `tus_upload_blocks` in the cluster's
//! PostgreSQL (`sql/0009_uploads.sql`), beside the manifests, so a new owner of the
//! session finds the upload after the shard moved. Each write is one transaction whose
//! `UPDATE ... WHERE upload_offset = $from` is the compare-and-set, and whose first
//! statement checks the writer's fence (`storage::pg::manifest::check_fence`: the shard
//! row `FOR SHARE`, as a manifest commit does), so a node that lost the shard writes
//! nothing (TUS-5).

use bytes::Bytes;
use sqlx::{PgPool, Row};

use super::{Advance, RowVersion, UploadLedger, UploadRow};
use crate::cas::{BlockKey, BlockRef};
use crate::storage::manifest::CommitFence;
use crate::storage::pg::manifest::check_fence;
use crate::storage::{StoreError, StoreFuture};
use crate::tus::UploadId;

/// The PostgreSQL ledger (see the module docs). Cheap to clone.
#[derive(Clone, Debug)]
pub struct PgLedger {
    pool: PgPool,
}

impl PgLedger {
    /// A ledger over `pool`; the tables must exist (`storage::pg::migrate`).
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }
}

/// Run a write on a task of its own and wait for it. A caller that is cancelled (its
/// request dropped by a client that went away) must not cancel `pool.begin()` while its
/// `BEGIN` is on the wire: sqlx-postgres 0.9.0 then returns the connection to the pool
/// inside a transaction nothing ends (transact-rs/sqlx#4393), and the next borrower's
/// statements (another upload's manifest insert, say) run in it and are discarded when
/// the server ends the session. The write completes or fails on its own; the caller only
/// stops waiting.
async fn detached<T: Send + 'static>(
    write: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::spawn(write)
        .await
        .map_err(|e| StoreError::Unavailable(format!("upload ledger write task: {e}")))?
}

fn err(op: &'static str) -> impl Fn(sqlx::Error) -> StoreError {
    move |e| StoreError::Unavailable(format!("upload ledger {op}: {e}"))
}

fn to_i64(value: u64) -> Result<i64, StoreError> {
    i64::try_from(value).map_err(|_| StoreError::Corrupt("upload ledger value too large".into()))
}

fn to_u64(value: i64) -> Result<u64, StoreError> {
    u64::try_from(value).map_err(|_| StoreError::Corrupt("upload ledger value negative".into()))
}

fn block_of(hash: Vec<u8>, len: i32) -> Result<BlockRef, StoreError> {
    let key: [u8; 32] = hash
        .try_into()
        .map_err(|_| StoreError::Corrupt("upload ledger block damaged".into()))?;
    Ok(BlockRef {
        key: BlockKey(key),
        size: u32::try_from(len)
            .map_err(|_| StoreError::Corrupt("upload ledger block size negative".into()))?,
    })
}

impl UploadLedger for PgLedger {
    fn create(
        &self,
        id: UploadId,
        row: &UploadRow,
        now_ms: u64,
        fence: Option<CommitFence>,
    ) -> StoreFuture<'_, bool> {
        let row = row.clone();
        let pool = self.pool.clone();
        Box::pin(detached(async move {
            let id = id.to_string();
            let mut txn = pool.begin().await.map_err(err("begin"))?;
            if let Some(fence) = &fence {
                check_fence(&mut txn, fence).await?;
            }
            // An expired row with this id is replaced (its blocks go with it).
            sqlx::query("DELETE FROM tus_uploads WHERE upload_id = $1 AND expires_ms <= $2")
                .bind(&id)
                .bind(to_i64(now_ms)?)
                .execute(&mut *txn)
                .await
                .map_err(err("create"))?;
            let inserted = sqlx::query(
                "INSERT INTO tus_uploads (upload_id, length, upload_offset, expires_ms,
                    created_ms, metadata, generation)
                 VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (upload_id) DO NOTHING",
            )
            .bind(&id)
            .bind(to_i64(row.length)?)
            .bind(to_i64(row.offset)?)
            .bind(to_i64(row.expires_ms)?)
            .bind(to_i64(row.created_ms)?)
            .bind(&row.metadata)
            .bind(to_i64(row.generation)?)
            .execute(&mut *txn)
            .await
            .map_err(err("create"))?
            .rows_affected()
                == 1;
            txn.commit().await.map_err(err("commit"))?;
            Ok(inserted)
        }))
    }

    fn get(&self, id: UploadId) -> StoreFuture<'_, Option<(UploadRow, Bytes)>> {
        Box::pin(async move {
            let row = sqlx::query(
                "SELECT length, upload_offset, expires_ms, created_ms, metadata, tail,
                    block_count, blob_key, generation, chunker
                 FROM tus_uploads WHERE upload_id = $1",
            )
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await
            .map_err(err("get"))?;
            let Some(row) = row else { return Ok(None) };
            let get = |e: sqlx::Error| StoreError::Corrupt(format!("upload ledger row: {e}"));
            let tail: Vec<u8> = row.try_get("tail").map_err(get)?;
            Ok(Some((
                UploadRow {
                    length: to_u64(row.try_get("length").map_err(get)?)?,
                    offset: to_u64(row.try_get("upload_offset").map_err(get)?)?,
                    expires_ms: to_u64(row.try_get("expires_ms").map_err(get)?)?,
                    created_ms: to_u64(row.try_get("created_ms").map_err(get)?)?,
                    metadata: row.try_get("metadata").map_err(get)?,
                    block_count: to_u64(row.try_get("block_count").map_err(get)?)?,
                    blob_key: row.try_get("blob_key").map_err(get)?,
                    generation: to_u64(row.try_get("generation").map_err(get)?)?,
                    chunker: Bytes::from(row.try_get::<Vec<u8>, _>("chunker").map_err(get)?),
                },
                Bytes::from(tail),
            )))
        })
    }

    fn blocks(&self, id: UploadId, at: RowVersion) -> StoreFuture<'_, Option<Vec<BlockRef>>> {
        Box::pin(async move {
            // One statement, so one snapshot: the row's version and its blocks together.
            let row = sqlx::query(
                "SELECT EXISTS (SELECT 1 FROM tus_uploads WHERE upload_id = $1
                        AND generation = $2 AND upload_offset = $3 AND blob_key IS NULL) AS live,
                    COALESCE((SELECT array_agg(block_hash ORDER BY seq) FROM tus_upload_blocks
                        WHERE upload_id = $1), '{}') AS hashes,
                    COALESCE((SELECT array_agg(len ORDER BY seq) FROM tus_upload_blocks
                        WHERE upload_id = $1), '{}') AS lens",
            )
            .bind(id.to_string())
            .bind(to_i64(at.generation)?)
            .bind(to_i64(at.offset)?)
            .fetch_one(&self.pool)
            .await
            .map_err(err("blocks"))?;
            let live: bool = row.try_get("live").map_err(err("blocks"))?;
            if !live {
                return Ok(None);
            }
            let hashes: Vec<Vec<u8>> = row.try_get("hashes").map_err(err("blocks"))?;
            let lens: Vec<i32> = row.try_get("lens").map_err(err("blocks"))?;
            if hashes.len() != lens.len() {
                return Err(StoreError::Corrupt(
                    "upload ledger block list damaged".into(),
                ));
            }
            hashes
                .into_iter()
                .zip(lens)
                .map(|(hash, len)| block_of(hash, len))
                .collect::<Result<Vec<_>, _>>()
                .map(Some)
        })
    }

    fn advance(
        &self,
        id: UploadId,
        from: RowVersion,
        step: Advance,
        fence: Option<CommitFence>,
    ) -> StoreFuture<'_, bool> {
        let pool = self.pool.clone();
        Box::pin(detached(async move {
            let id = id.to_string();
            let mut txn = pool.begin().await.map_err(err("begin"))?;
            if let Some(fence) = &fence {
                check_fence(&mut txn, fence).await?;
            }
            let added = if step.blob_key.is_some() {
                0
            } else {
                step.blocks.len() as i64
            };
            let updated = sqlx::query(
                "UPDATE tus_uploads SET upload_offset = $3, expires_ms = $4,
                    tail = $5, blob_key = $6, chunker = $9,
                    block_count = CASE WHEN $6::text IS NULL THEN block_count + $7 ELSE 0 END
                 WHERE upload_id = $1 AND upload_offset = $2 AND blob_key IS NULL
                    AND generation = $8
                 RETURNING block_count - $7 AS first_seq",
            )
            .bind(&id)
            .bind(to_i64(from.offset)?)
            .bind(to_i64(step.offset)?)
            .bind(to_i64(step.expires_ms)?)
            .bind(if step.blob_key.is_some() {
                Vec::new()
            } else {
                step.tail.to_vec()
            })
            .bind(step.blob_key.map(|k| k.to_string()))
            .bind(added)
            .bind(to_i64(from.generation)?)
            .bind(if step.blob_key.is_some() {
                Vec::new()
            } else {
                step.chunker.to_vec()
            })
            .fetch_optional(&mut *txn)
            .await
            .map_err(err("advance"))?;
            let Some(updated) = updated else {
                return Ok(false);
            };
            if step.blob_key.is_some() {
                sqlx::query("DELETE FROM tus_upload_blocks WHERE upload_id = $1")
                    .bind(&id)
                    .execute(&mut *txn)
                    .await
                    .map_err(err("advance"))?;
            } else if !step.blocks.is_empty() {
                let first: i64 = updated.try_get("first_seq").map_err(err("advance"))?;
                let seqs: Vec<i64> = (0..added).map(|i| first + i).collect();
                let hashes: Vec<Vec<u8>> = step.blocks.iter().map(|b| b.key.0.to_vec()).collect();
                let lens: Vec<i32> = step
                    .blocks
                    .iter()
                    .map(|b| i32::try_from(b.size).unwrap_or(i32::MAX))
                    .collect();
                sqlx::query(
                    "INSERT INTO tus_upload_blocks (upload_id, seq, block_hash, len)
                     SELECT $1, * FROM UNNEST($2::bigint[], $3::bytea[], $4::integer[])",
                )
                .bind(&id)
                .bind(&seqs)
                .bind(&hashes)
                .bind(&lens)
                .execute(&mut *txn)
                .await
                .map_err(err("advance"))?;
            }
            txn.commit().await.map_err(err("commit"))?;
            Ok(true)
        }))
    }

    fn delete(&self, id: UploadId, fence: Option<CommitFence>) -> StoreFuture<'_, bool> {
        let pool = self.pool.clone();
        Box::pin(detached(async move {
            let mut txn = pool.begin().await.map_err(err("begin"))?;
            if let Some(fence) = &fence {
                check_fence(&mut txn, fence).await?;
            }
            let deleted = sqlx::query("DELETE FROM tus_uploads WHERE upload_id = $1")
                .bind(id.to_string())
                .execute(&mut *txn)
                .await
                .map_err(err("delete"))?
                .rows_affected();
            txn.commit().await.map_err(err("commit"))?;
            Ok(deleted > 0)
        }))
    }

    fn expired(&self, now_ms: u64) -> StoreFuture<'_, Vec<UploadId>> {
        Box::pin(async move {
            let ids: Vec<String> =
                sqlx::query_scalar("SELECT upload_id FROM tus_uploads WHERE expires_ms <= $1")
                    .bind(to_i64(now_ms)?)
                    .fetch_all(&self.pool)
                    .await
                    .map_err(err("sweep"))?;
            ids.iter()
                .map(|id| {
                    id.parse()
                        .map_err(|_| StoreError::Corrupt("upload ledger id damaged".into()))
                })
                .collect()
        })
    }

    fn delete_expired(
        &self,
        ids: Vec<UploadId>,
        now_ms: u64,
        fence: Option<CommitFence>,
    ) -> StoreFuture<'_, u64> {
        let pool = self.pool.clone();
        Box::pin(detached(async move {
            if ids.is_empty() {
                return Ok(0);
            }
            let ids: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
            let mut txn = pool.begin().await.map_err(err("begin"))?;
            if let Some(fence) = &fence {
                check_fence(&mut txn, fence).await?;
            }
            // Re-checked here: a PATCH may have refreshed one since it was listed.
            let deleted = sqlx::query(
                "DELETE FROM tus_uploads WHERE upload_id = ANY($1) AND expires_ms <= $2",
            )
            .bind(&ids)
            .bind(to_i64(now_ms)?)
            .execute(&mut *txn)
            .await
            .map_err(err("sweep"))?
            .rows_affected();
            txn.commit().await.map_err(err("commit"))?;
            Ok(deleted)
        }))
    }

    fn for_each_block<'a>(
        &'a self,
        visit: &'a mut (dyn FnMut(BlockKey) + Send),
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            use futures_util::TryStreamExt;
            let mut rows =
                sqlx::query("SELECT block_hash FROM tus_upload_blocks").fetch(&self.pool);
            while let Some(row) = rows.try_next().await.map_err(err("scan"))? {
                let hash: Vec<u8> = row.try_get("block_hash").map_err(err("scan"))?;
                visit(block_of(hash, 0)?.key);
            }
            Ok(())
        })
    }
}
