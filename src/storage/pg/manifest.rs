//! The PostgreSQL manifest store: blob manifests in the `manifests` table
//! (`sql/0002_manifests.sql`), so that every node of a cluster can serve every blob, whichever
//! node ingested it. Blocks are not stored here (see [`BlockStore`](crate::storage::BlockStore)).
//!
//! One row per blob key `(blob_hash, blob_size)` holds the format version, the chunking
//! info, the manifest's `created_at_ms`, the block keys concatenated into one `bytea` and the
//! block sizes as an `integer[]`; `created_at` records the insert time by the database clock.
//!
//! Guarantees:
//! - `create` is one `INSERT ... ON CONFLICT DO NOTHING`: atomic, the first writer wins, an
//!   existing row is never rewritten, and the outcome comes from the rows affected.
//! - `create` refuses a manifest that does not [`validate`](Manifest::validate) (it could
//!   never be read back, and first-writer-wins would make it permanent) or whose numbers do
//!   not fit the columns (block sizes and chunking parameters up to `i32::MAX`, blob size
//!   and `created_at_ms` up to `i64::MAX`); the chunker produces far smaller values.
//! - `get` decodes the row, checks it names the requested key and validates it; a row that
//!   fails any of this is [`StoreError::Corrupt`], never served and never a panic.
//! - Connection failures, pool timeouts and statement timeouts are
//!   [`StoreError::Unavailable`]. Messages name the operation and PostgreSQL's error, never
//!   the connection URL or password.

use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

use crate::cas::manifest::ChunkingInfo;
use crate::cas::{BlobKey, BlockKey, BlockRef, Manifest};
use crate::storage::manifest::CommitFence;
use crate::storage::{CreateOutcome, ManifestStore, StoreError, StoreFuture};

const INSERT: &str = "INSERT INTO manifests
    (blob_hash, blob_size, format, created_at_ms, chunk_algorithm, chunk_min, chunk_avg,
     chunk_max, block_count, block_keys, block_sizes)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
    ON CONFLICT (blob_hash, blob_size) DO NOTHING";

const SELECT: &str = "SELECT blob_hash, blob_size, format, created_at_ms, chunk_algorithm,
    chunk_min, chunk_avg, chunk_max, block_count, block_keys, block_sizes
    FROM manifests WHERE blob_hash = $1 AND blob_size = $2";

/// Manifests in PostgreSQL. Cheap to clone (the pool is shared).
#[derive(Clone, Debug)]
pub struct PgManifestStore {
    pool: PgPool,
}

impl PgManifestStore {
    /// A store over `pool`; the `manifests` table must exist ([`super::migrate`]).
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// A manifest's columns, ready to bind.
struct Encoded {
    blob_hash: Vec<u8>,
    blob_size: i64,
    format: i32,
    created_at_ms: i64,
    chunk_algorithm: String,
    chunk_min: i32,
    chunk_avg: i32,
    chunk_max: i32,
    block_count: i32,
    block_keys: Vec<u8>,
    block_sizes: Vec<i32>,
}

fn refuse(key: &BlobKey, what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("refusing to store manifest of {key}: {what}"))
}

fn encode(manifest: &Manifest) -> Result<Encoded, StoreError> {
    let key = &manifest.key;
    manifest.validate().map_err(|e| refuse(key, e))?;
    let column = |name: &str, value: u64| refuse(key, format!("{name} {value} is out of range"));
    let int = |name: &str, value: u32| i32::try_from(value).map_err(|_| column(name, value.into()));
    let bigint = |name: &str, value: u64| i64::try_from(value).map_err(|_| column(name, value));
    let mut block_keys = Vec::with_capacity(manifest.blocks.len() * 32);
    let mut block_sizes = Vec::with_capacity(manifest.blocks.len());
    for block in &manifest.blocks {
        block_keys.extend_from_slice(&block.key.0);
        block_sizes.push(int("block size", block.size)?);
    }
    let block_count = i32::try_from(manifest.blocks.len())
        .map_err(|_| column("block count", manifest.blocks.len() as u64))?;
    Ok(Encoded {
        blob_hash: key.hash.to_vec(),
        blob_size: bigint("blob size", key.size)?,
        format: int("format", manifest.format)?,
        created_at_ms: bigint("created_at_ms", manifest.created_at_ms)?,
        chunk_algorithm: manifest.chunking.algorithm.clone(),
        chunk_min: int("chunk min", manifest.chunking.min)?,
        chunk_avg: int("chunk avg", manifest.chunking.avg)?,
        chunk_max: int("chunk max", manifest.chunking.max)?,
        block_count,
        block_keys,
        block_sizes,
    })
}

/// Decode a row read for `key`; any inconsistency is `Corrupt`.
fn decode(key: &BlobKey, row: &PgRow) -> Result<Manifest, StoreError> {
    let corrupt = |what: String| StoreError::Corrupt(format!("manifest row of {key}: {what}"));
    let get_err = |e: sqlx::Error| corrupt(e.to_string());
    let unsigned = |name: &str, value: i64| {
        u64::try_from(value).map_err(|_| corrupt(format!("{name} {value} is negative")))
    };
    let unsigned32 = |name: &str, value: i32| {
        u32::try_from(value).map_err(|_| corrupt(format!("{name} {value} is negative")))
    };

    let blob_hash: Vec<u8> = row.try_get("blob_hash").map_err(get_err)?;
    let blob_size = unsigned("blob_size", row.try_get("blob_size").map_err(get_err)?)?;
    let hash: [u8; 32] = blob_hash
        .as_slice()
        .try_into()
        .map_err(|_| corrupt(format!("blob_hash is {} bytes", blob_hash.len())))?;
    let stored_key = BlobKey {
        hash,
        size: blob_size,
    };
    if stored_key != *key {
        return Err(corrupt(format!("the row names another blob, {stored_key}")));
    }

    let block_count: i32 = row.try_get("block_count").map_err(get_err)?;
    let block_keys: Vec<u8> = row.try_get("block_keys").map_err(get_err)?;
    let block_sizes: Vec<i32> = row.try_get("block_sizes").map_err(get_err)?;
    let count = usize::try_from(block_count)
        .map_err(|_| corrupt(format!("block_count {block_count} is negative")))?;
    if block_keys.len() != count * 32 || block_sizes.len() != count {
        return Err(corrupt(format!(
            "block_count {count} but {} bytes of block keys and {} block sizes",
            block_keys.len(),
            block_sizes.len()
        )));
    }
    let blocks = block_keys
        .chunks_exact(32)
        .zip(&block_sizes)
        .map(|(key_bytes, &size)| {
            Ok(BlockRef {
                key: BlockKey(key_bytes.try_into().expect("chunks_exact(32)")),
                size: unsigned32("block size", size)?,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;

    let manifest = Manifest {
        format: unsigned32("format", row.try_get("format").map_err(get_err)?)?,
        key: stored_key,
        chunking: ChunkingInfo {
            algorithm: row.try_get("chunk_algorithm").map_err(get_err)?,
            min: unsigned32("chunk_min", row.try_get("chunk_min").map_err(get_err)?)?,
            avg: unsigned32("chunk_avg", row.try_get("chunk_avg").map_err(get_err)?)?,
            max: unsigned32("chunk_max", row.try_get("chunk_max").map_err(get_err)?)?,
        },
        blocks,
        created_at_ms: unsigned(
            "created_at_ms",
            row.try_get("created_at_ms").map_err(get_err)?,
        )?,
    };
    manifest
        .validate()
        .map_err(|e| corrupt(format!("invalid manifest: {e}")))?;
    Ok(manifest)
}

/// Map a query failure. Data-integrity errors (SQLSTATE class 23, a value that does not
/// decode) are `Corrupt`; everything else (connection refused or lost, pool or statement
/// timeout, missing table, server shutting down) is `Unavailable`. The message is built
/// from the error kind and PostgreSQL's own text, which never contain the password.
pub(crate) fn db_error(op: &'static str, err: sqlx::Error) -> StoreError {
    match err {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            let text = format!("{op}: PostgreSQL error {code}: {}", db.message());
            if code.starts_with("23") {
                StoreError::Corrupt(text)
            } else {
                StoreError::Unavailable(text)
            }
        }
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::TypeNotFound { .. } => StoreError::Corrupt(format!("{op}: {err}")),
        sqlx::Error::Io(e) => StoreError::Unavailable(format!("{op}: connection failed: {e}")),
        sqlx::Error::PoolTimedOut => {
            StoreError::Unavailable(format!("{op}: no PostgreSQL connection within the timeout"))
        }
        // Configuration errors can quote the connection options: name the kind only.
        sqlx::Error::Configuration(_) => {
            StoreError::Unavailable(format!("{op}: invalid PostgreSQL configuration"))
        }
        other => StoreError::Unavailable(format!("{op}: {other}")),
    }
}

/// Insert an encoded manifest (first writer wins).
async fn insert<'e>(
    e: Encoded,
    executor: impl sqlx::PgExecutor<'e>,
) -> Result<CreateOutcome, StoreError> {
    let inserted = sqlx::query(INSERT)
        .bind(e.blob_hash)
        .bind(e.blob_size)
        .bind(e.format)
        .bind(e.created_at_ms)
        .bind(e.chunk_algorithm)
        .bind(e.chunk_min)
        .bind(e.chunk_avg)
        .bind(e.chunk_max)
        .bind(e.block_count)
        .bind(e.block_keys)
        .bind(e.block_sizes)
        .execute(executor)
        .await
        .map_err(|err| db_error("create manifest", err))?
        .rows_affected();
    Ok(match inserted {
        1 => CreateOutcome::Created,
        _ => CreateOutcome::AlreadyExists,
    })
}

/// Check `fence` (when given) and insert `manifest` inside the caller's transaction `tx`.
/// The shard row is read `FOR SHARE`, so a manager's move of that shard (an `UPDATE` of
/// the row) either committed before (and the fence fails with [`StoreError::Fenced`]) or
/// waits until this transaction ends. The shared block index
/// ([`crate::storage::pack::shared`]) calls this in its commit transaction.
pub async fn create_in(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    manifest: &Manifest,
    fence: Option<&CommitFence>,
) -> Result<CreateOutcome, StoreError> {
    let e = encode(manifest)?;
    if let Some(fence) = fence {
        check_fence(tx, fence).await?;
        // Fault tests stop an owner here: its commit transaction holds the fence's
        // `FOR SHARE` on the shard row and, in the shared block index's commit, the row
        // locks of the deduplicated blocks it confirmed (PG-1).
        crate::storage::pack::pause::after("commit fenced");
    }
    insert(e, &mut **tx).await
}

/// Inside the caller's transaction `tx`: [`StoreError::Fenced`] unless `fence` holds.
/// The shard row is read `FOR SHARE`, so a manager's move of that shard either committed
/// before (and the fence fails) or waits until `tx` ends. Manifest commits and the writes
/// of the resumable-upload ledger (`upload::ledger::PgLedger`) use it.
pub async fn check_fence(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    fence: &CommitFence,
) -> Result<(), StoreError> {
    let holds: Option<i32> = sqlx::query_scalar(
        "SELECT 1 FROM placement_shards
         WHERE shard = $1 AND node_id = $2 AND epoch = $3 AND NOT revoke_acked
         FOR SHARE",
    )
    .bind(fence.shard.0 as i32)
    .bind(fence.node.as_str())
    .bind(fence.epoch.0)
    .fetch_optional(&mut **tx)
    .await
    .map_err(|err| db_error("check the commit fence", err))?;
    if holds.is_none() {
        return Err(StoreError::Fenced {
            shard: fence.shard.0,
            epoch: fence.epoch.0,
        });
    }
    Ok(())
}

impl ManifestStore for PgManifestStore {
    fn create(&self, manifest: &Manifest) -> StoreFuture<'_, CreateOutcome> {
        let encoded = encode(manifest);
        Box::pin(async move { insert(encoded?, &self.pool).await })
    }

    /// The fence and the insert run in one transaction. The shard row is read `FOR SHARE`,
    /// so a manager's move of that shard (an `UPDATE` of the row) either committed before
    /// (and the fence fails) or waits until this commit is done.
    fn create_fenced<'a>(
        &'a self,
        manifest: &'a Manifest,
        fence: Option<&'a CommitFence>,
    ) -> StoreFuture<'a, CreateOutcome> {
        let Some(fence) = fence else {
            return self.create(manifest);
        };
        Box::pin(async move {
            let mut tx = self
                .pool
                .begin()
                .await
                .map_err(|err| db_error("begin fenced commit", err))?;
            let outcome = create_in(&mut tx, manifest, Some(fence)).await?;
            tx.commit()
                .await
                .map_err(|err| db_error("commit manifest", err))?;
            Ok(outcome)
        })
    }

    fn database(&self) -> Option<&PgPool> {
        Some(&self.pool)
    }

    fn get(&self, key: BlobKey) -> StoreFuture<'_, Option<Manifest>> {
        Box::pin(async move {
            let Ok(size) = i64::try_from(key.size) else {
                // No row can have this size (the column is a bigint).
                return Ok(None);
            };
            let row = sqlx::query(SELECT)
                .bind(key.hash.as_slice())
                .bind(size)
                .fetch_optional(&self.pool)
                .await
                .map_err(|err| db_error("read manifest", err))?;
            row.map(|row| decode(&key, &row)).transpose()
        })
    }

    fn delete(&self, key: BlobKey) -> StoreFuture<'_, bool> {
        Box::pin(async move {
            let Ok(size) = i64::try_from(key.size) else {
                return Ok(false);
            };
            let deleted =
                sqlx::query("DELETE FROM manifests WHERE blob_hash = $1 AND blob_size = $2")
                    .bind(key.hash.as_slice())
                    .bind(size)
                    .execute(&self.pool)
                    .await
                    .map_err(|err| db_error("delete manifest", err))?
                    .rows_affected();
            Ok(deleted > 0)
        })
    }

    fn for_each_block<'a>(
        &'a self,
        visit: &'a mut (dyn FnMut(BlockKey) + Send),
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            use futures_util::TryStreamExt;
            let mut rows = sqlx::query("SELECT block_keys FROM manifests").fetch(&self.pool);
            while let Some(row) = rows
                .try_next()
                .await
                .map_err(|err| db_error("scan manifests", err))?
            {
                let keys: Vec<u8> = row
                    .try_get("block_keys")
                    .map_err(|e| StoreError::Corrupt(format!("manifest row: {e}")))?;
                for raw in keys.chunks_exact(32) {
                    visit(BlockKey(raw.try_into().expect("32 bytes")));
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(sizes: &[u32]) -> Manifest {
        let blocks = sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| BlockRef {
                key: BlockKey::of(&i.to_le_bytes()),
                size,
            })
            .collect();
        let total = sizes.iter().map(|&s| u64::from(s)).sum();
        Manifest::new(
            BlobKey {
                hash: [9; 32],
                size: total,
            },
            blocks,
            7,
        )
    }

    #[test]
    fn encode_lays_out_keys_and_sizes_in_order() {
        let m = manifest(&[3, 5]);
        let e = encode(&m).unwrap();
        assert_eq!(e.block_count, 2);
        assert_eq!(e.block_sizes, vec![3, 5]);
        assert_eq!(&e.block_keys[..32], &m.blocks[0].key.0);
        assert_eq!(&e.block_keys[32..], &m.blocks[1].key.0);
        assert_eq!(e.blob_size, 8);
    }

    #[test]
    fn encode_refuses_invalid_or_unrepresentable_manifests() {
        let mut m = manifest(&[3]);
        m.key.size = 4;
        assert!(matches!(encode(&m), Err(StoreError::Corrupt(_))));
        let m = manifest(&[u32::MAX]);
        let err = encode(&m).err().expect("block size beyond i32");
        assert!(err.to_string().contains("block size"), "{err}");
    }
}
