//! The collector of a cluster on S3: the steps of [`super::gc`] over the shared
//! PostgreSQL index ([`super::shared`]), run by one node at a time.
//!
//! **One collector at a time.** A run first takes the session-level advisory lock
//! [`GC_LOCK_KEY`] (`pg_try_advisory_lock`) on a connection of its own, and holds it to
//! the end; a second run anywhere in the cluster gets [`StoreError::Busy`] at once
//! (`POST /v1/admin/gc` answers 409 `gc_running`). If the collector's process dies, its
//! connection closes and PostgreSQL releases the lock.
//!
//! **Grace period.** Candidates are only blocks whose `last_ref` (the database clock at
//! the last commit that wrote or deduplicated them) is older than `min_age` before the
//! run started, and orphans only objects older than `min_age` by the S3 server's clock.
//! An upload in flight therefore neither loses a dedup hit nor has its fresh packs taken
//! as orphans while it is shorter than `min_age`.
//!
//! **Deleting an object (STO-10).** The grace period alone would leave a race: an upload
//! that PUT a pack, then commits after the collector checked that no row names it, but
//! before the collector's DELETE reaches S3 (a paused collector, a slow upload, clock
//! skew between S3 and PostgreSQL). So every object delete happens while the collector
//! holds that pack id's row in an open transaction: an orphan is claimed by inserting a
//! placeholder row (which waits for, or conflicts with, an upload's own insert of the
//! same id), a retired pack by `SELECT ... FOR UPDATE` and a fresh check that no block
//! row names it. The upload's commit inserts its pack rows and then checks with a HEAD
//! that each object is present, so it either sees the object gone and fails (503,
//! retry) or the collector sees its row and keeps the object.
//!
//! **Compaction** (step 5, as on one node): a pack older than the grace period whose
//! live bytes fall below `compact_below` of its size is rewritten; its live rows are
//! pointed at the new pack in one transaction and the old pack is retired, then purged
//! after `retention` like any retired pack (see [`compact_pack`]).

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use futures_util::TryStreamExt;
use sqlx::{Connection, PgConnection, Row};

use super::format::{self, PackId};
use super::gc::{Candidates, GcOptions, GcReport, Progress, blocking, mark, rewrite_pack};
use super::pause;
use super::shared::PgIndex;
use super::{PackStore, now_ms};
use crate::cas::BlockKey;
use crate::storage::pg::manifest::db_error;
use crate::storage::{ManifestStore, StoreError};

/// Key of the advisory lock that keeps a cluster to one collector ("GRAVGCL1").
pub const GC_LOCK_KEY: i64 = 0x4752_4156_4743_4c31;

/// The lock connection: closed (and the lock released) when dropped.
struct GcLock(PgConnection);

impl GcLock {
    async fn take(index: &PgIndex) -> Result<Self, StoreError> {
        let options = (*index.pool().connect_options())
            .clone()
            .application_name("graviton-gc-lock");
        // The lock connection never opens a transaction; its bounds come from the pool.
        let mut conn = PgConnection::connect_with(&options)
            .await
            .map_err(|e| db_error("connect for the collector lock", e))?;
        let held: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(GC_LOCK_KEY)
            .fetch_one(&mut conn)
            .await
            .map_err(|e| db_error("take the collector lock", e))?;
        if !held {
            let _ = conn.close().await;
            return Err(StoreError::Busy(
                "another collector of this cluster holds the advisory lock".into(),
            ));
        }
        Ok(Self(conn))
    }

    async fn release(mut self) {
        let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(GC_LOCK_KEY)
            .execute(&mut self.0)
            .await;
        let _ = self.0.close().await;
    }
}

/// One cluster collector run (see the module docs).
pub async fn collect(
    store: &PackStore,
    index: &PgIndex,
    manifests: &dyn ManifestStore,
    options: GcOptions,
    progress: &mut dyn Progress,
) -> Result<GcReport, StoreError> {
    let lock = GcLock::take(index).await?;
    let result = run(store, index, manifests, options, progress).await;
    lock.release().await;
    result
}

async fn run(
    store: &PackStore,
    index: &PgIndex,
    manifests: &dyn ManifestStore,
    options: GcOptions,
    progress: &mut dyn Progress,
) -> Result<GcReport, StoreError> {
    let started = Instant::now();
    let pool = index.pool();
    let mut report = GcReport {
        dry_run: options.dry_run,
        ..Default::default()
    };
    // Every age is judged by the database clock, the one that set `last_ref`.
    let start_ms: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .fetch_one(pool)
        .await
        .map_err(|e| db_error("read the database clock", e))?;
    let cutoff_ms = start_ms - options.min_age.as_millis() as i64;

    // 1. mark
    progress.phase("mark", 0);
    let live = mark(manifests).await?;
    report.live_blocks = live.len() as u64;
    pause::after("gc mark");

    // 2. select unmarked entries older than the grace period, spilled to the candidate
    //    file (the rows are streamed, so nothing here grows with the garbage)
    progress.phase("select", 0);
    let mut candidates = Candidates::new(store.spool_dir())?;
    let mut per_pack: HashMap<PackId, u64> = HashMap::new();
    {
        let mut rows = sqlx::query(
            "SELECT block_hash, pack_id, len,
                    last_ref < to_timestamp($1::double precision / 1000) AS old
             FROM pack_blocks WHERE quarantined_at IS NULL",
        )
        .bind(cutoff_ms as f64)
        .fetch(pool);
        while let Some(row) = rows
            .try_next()
            .await
            .map_err(|e| db_error("scan the block index", e))?
        {
            let corrupt = |e: sqlx::Error| StoreError::Corrupt(format!("block index row: {e}"));
            let hash: Vec<u8> = row.try_get("block_hash").map_err(corrupt)?;
            let pack: Vec<u8> = row.try_get("pack_id").map_err(corrupt)?;
            let len: i32 = row.try_get("len").map_err(corrupt)?;
            let old: bool = row.try_get("old").map_err(corrupt)?;
            let key = BlockKey(
                hash.as_slice()
                    .try_into()
                    .map_err(|_| StoreError::Corrupt("block hash length".into()))?,
            );
            let len = len.max(0) as u32;
            if old && !live.contains(&key) {
                candidates.push(&key, len)?;
            } else {
                let pack = PackId(
                    pack.as_slice()
                        .try_into()
                        .map_err(|_| StoreError::Corrupt("pack id length".into()))?,
                );
                *per_pack.entry(pack).or_default() += u64::from(len) + format::RECORD_HEADER;
            }
        }
    }
    drop(live);
    pause::after("gc select");

    // 3. mark again, just before changing anything
    progress.phase("mark again", 0);
    let live_again = mark(manifests).await?;
    pause::after("gc mark again");

    // 4. quarantine, `batch` candidates per statement, re-checking the age in the
    //    statement (a racing dedup commit wins); the candidates marked again are dropped
    progress.phase("quarantine", candidates.len());
    let mut reader = candidates.into_reader()?;
    loop {
        let batch = reader.next_batch(options.batch)?;
        if batch.is_empty() {
            break;
        }
        progress.advance(batch.len() as u64);
        let keys: Vec<Vec<u8>> = batch
            .into_iter()
            .filter(|(key, _)| !live_again.contains(key))
            .map(|(key, len)| {
                report.quarantined_bytes += u64::from(len);
                key.0.to_vec()
            })
            .collect();
        report.candidates += keys.len() as u64;
        if options.dry_run || keys.is_empty() {
            continue;
        }
        report.quarantined += sqlx::query(
            "UPDATE pack_blocks SET quarantined_at = now()
             WHERE block_hash = ANY($1) AND quarantined_at IS NULL
               AND last_ref < to_timestamp($2::double precision / 1000)",
        )
        .bind(&keys)
        .bind(cutoff_ms as f64)
        .execute(pool)
        .await
        .map_err(|e| db_error("quarantine blocks", e))?
        .rows_affected();
        pause::after("gc quarantine batch");
    }
    drop((reader, live_again));
    if !options.dry_run && report.candidates > 0 {
        pause::after("gc quarantine");
    }

    // 5. compact packs older than the grace period whose live bytes fall below
    //    `compact_below` of their size, then retire those with no live entry left
    let compacted = compact_sparse(
        store,
        index,
        &per_pack,
        cutoff_ms,
        &options,
        &mut report,
        progress,
    )
    .await?;
    let packs: Vec<(Vec<u8>, i64, bool, bool)> = sqlx::query_as(
        "SELECT pack_id, size, retired_at IS NOT NULL,
                sealed_at < to_timestamp($1::double precision / 1000)
         FROM pack_packs",
    )
    .bind(cutoff_ms as f64)
    .fetch_all(pool)
    .await
    .map_err(|e| db_error("list packs", e))?;
    let known: HashSet<Vec<u8>> = packs.iter().map(|p| p.0.clone()).collect();
    let to_retire: Vec<Vec<u8>> = packs
        .iter()
        .filter(|(id, _, retired, old)| {
            !retired
                && *old
                && PackId::try_from_slice(id).is_some_and(|id| !per_pack.contains_key(&id))
        })
        .map(|p| p.0.clone())
        .chain(compacted)
        .collect();
    if options.dry_run {
        report.packs_retired = to_retire.len() as u64;
    } else if !to_retire.is_empty() {
        // Re-checked in the statement: a commit or restore since the scan keeps the pack.
        report.packs_retired = sqlx::query(
            "UPDATE pack_packs p SET retired_at = now()
             WHERE p.pack_id = ANY($1) AND p.retired_at IS NULL
               AND NOT EXISTS (SELECT 1 FROM pack_blocks b
                               WHERE b.pack_id = p.pack_id AND b.quarantined_at IS NULL)",
        )
        .bind(&to_retire)
        .execute(pool)
        .await
        .map_err(|e| db_error("retire packs", e))?
        .rows_affected();
        pause::after("gc retire");
    }

    // 6. orphans: objects no row names, older than the grace period by the S3 clock
    progress.phase("orphans", 0);
    let listed = {
        let medium = store.medium().clone();
        blocking(move || medium.list()).await?
    };
    let cutoff_u = cutoff_ms.max(0) as u64;
    for (id, modified) in listed {
        if known.contains(id.0.as_slice()) || modified >= cutoff_u {
            continue;
        }
        if options.dry_run {
            report.orphan_packs_deleted += 1;
            continue;
        }
        if delete_orphan(store, index, id).await? {
            report.orphan_packs_deleted += 1;
            pause::after("gc orphan deleted");
        }
    }
    // This node's own spool leftovers (crashed uploads), by the local clock.
    let local_cutoff = now_ms().saturating_sub(options.min_age.as_millis() as u64);
    for entry in std::fs::read_dir(store.spool_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        if !store.spool_in_use(&entry.path())
            && super::medium::modified_ms(&entry.path()) < local_cutoff
        {
            report.spool_files_deleted += 1;
            if !options.dry_run {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    // 7. purge what the retention window allows
    if options.purge {
        progress.phase("purge", 0);
        let before_ms = start_ms - options.retention.as_millis() as i64;
        let expired: Vec<(Vec<u8>, i64)> = sqlx::query_as(
            "SELECT pack_id, size FROM pack_packs
             WHERE retired_at < to_timestamp($1::double precision / 1000)",
        )
        .bind(before_ms as f64)
        .fetch_all(pool)
        .await
        .map_err(|e| db_error("list retired packs", e))?;
        if options.dry_run {
            report.packs_deleted = expired.len() as u64;
            report.bytes_reclaimed = expired.iter().map(|(_, size)| *size as u64).sum();
        } else {
            report.purged_entries = purge_quarantine(pool, before_ms, options.batch).await?;
            pause::after("gc purge quarantine");
            for (raw, size) in expired {
                let Some(id) = PackId::try_from_slice(&raw) else {
                    continue;
                };
                if delete_retired(store, index, id, before_ms).await? {
                    report.packs_deleted += 1;
                    report.bytes_reclaimed += size.max(0) as u64;
                }
            }
        }
    }
    pause::after("gc done");
    report.duration_ms = started.elapsed().as_millis() as u64;
    Ok(report)
}

/// Step 5's compaction: every pack sealed before `cutoff_ms`, not retired, whose live
/// bytes (`per_pack`, from the select scan) are above zero and below `compact_below` of
/// its size is rewritten ([`compact_pack`]). Returns the ids of the rewritten packs, for
/// the retire statement (which re-checks that no live row names them).
async fn compact_sparse(
    store: &PackStore,
    index: &PgIndex,
    per_pack: &HashMap<PackId, u64>,
    cutoff_ms: i64,
    options: &GcOptions,
    report: &mut GcReport,
    progress: &mut dyn Progress,
) -> Result<Vec<Vec<u8>>, StoreError> {
    let packs: Vec<(Vec<u8>, i64)> = sqlx::query_as(
        "SELECT pack_id, size FROM pack_packs
         WHERE retired_at IS NULL AND sealed_at < to_timestamp($1::double precision / 1000)",
    )
    .bind(cutoff_ms as f64)
    .fetch_all(index.pool())
    .await
    .map_err(|e| db_error("list packs to compact", e))?;
    let sparse: Vec<PackId> = packs
        .into_iter()
        .filter_map(|(id, size)| {
            let id = PackId::try_from_slice(&id)?;
            let live = per_pack.get(&id).copied().unwrap_or(0);
            (live > 0 && (live as f64) < options.compact_below * size.max(0) as f64).then_some(id)
        })
        .collect();
    if options.dry_run {
        report.packs_rewritten = sparse.len() as u64;
        return Ok(Vec::new());
    }
    progress.phase("compact", sparse.len() as u64);
    let mut compacted = Vec::new();
    for id in sparse {
        if compact_pack(store, index, id).await? {
            report.packs_rewritten += 1;
            compacted.push(id.0.to_vec());
        }
        progress.advance(1);
    }
    if !compacted.is_empty() {
        pause::after("gc compact");
    }
    Ok(compacted)
}

/// Rewrite pack `id`: the blocks of its live rows are copied into a new pack, which is
/// published first ([`rewrite_pack`]); then, in one transaction, the new pack's row is
/// inserted, its object checked with a HEAD (STO-10's rule for every commit), and each
/// of those rows pointed at it. A row that no longer names `id` at that moment (the
/// statement's `pack_id = id`) is left alone. Readers that located a block in the old
/// pack keep reading it: the old pack is retired, and its object deleted only after
/// `retention`. A crash after the publish leaves the new pack an orphan (a later run
/// deletes it); after the commit, the old pack is retired by the next run.
async fn compact_pack(store: &PackStore, index: &PgIndex, id: PackId) -> Result<bool, StoreError> {
    let live = live_rows(index, &id).await?;
    if live.is_empty() {
        return Ok(false);
    }
    let rewritten = {
        let store = store.clone();
        blocking(move || {
            rewrite_pack(&store, &id, &mut |entry| {
                Ok(live.contains(&(entry.key, entry.offset)))
            })
        })
        .await?
    };
    let Some((record, moved)) = rewritten else {
        return Ok(false);
    };
    let mut tx = index
        .pool()
        .begin()
        .await
        .map_err(|e| db_error("begin a compaction", e))?;
    sqlx::query(
        "INSERT INTO pack_packs (pack_id, size, blocks) VALUES ($1, $2, $3)
         ON CONFLICT (pack_id) DO UPDATE SET retired_at = NULL",
    )
    .bind(record.id.0.as_slice())
    .bind(record.size as i64)
    .bind(record.blocks as i32)
    .execute(&mut *tx)
    .await
    .map_err(|e| db_error("record a compacted pack", e))?;
    crate::storage::pg::allow_idle_for_medium(&mut tx)
        .await
        .map_err(|e| db_error("widen the idle bound", e))?;
    let present = {
        let medium = store.medium().clone();
        let new_id = record.id;
        blocking(move || medium.exists(&new_id)).await?
    };
    crate::storage::pg::restore_idle(&mut tx)
        .await
        .map_err(|e| db_error("restore the idle bound", e))?;
    if !present {
        return Err(StoreError::Unavailable(format!(
            "compacted pack {} is not on the medium after its publish",
            record.id
        )));
    }
    let keys: Vec<Vec<u8>> = moved.iter().map(|(k, _)| k.0.to_vec()).collect();
    let offsets: Vec<i64> = moved.iter().map(|(_, at)| at.offset as i64).collect();
    sqlx::query(
        "UPDATE pack_blocks b SET pack_id = $1, pack_offset = u.off
         FROM UNNEST($2::bytea[], $3::bigint[]) AS u(hash, off)
         WHERE b.block_hash = u.hash AND b.pack_id = $4",
    )
    .bind(record.id.0.as_slice())
    .bind(&keys)
    .bind(&offsets)
    .bind(id.0.as_slice())
    .execute(&mut *tx)
    .await
    .map_err(|e| db_error("relocate compacted blocks", e))?;
    tx.commit()
        .await
        .map_err(|e| db_error("commit a compaction", e))?;
    Ok(true)
}

/// The live (not quarantined) rows naming pack `id`: `(block, offset)`.
pub(super) async fn live_rows(
    index: &PgIndex,
    id: &PackId,
) -> Result<HashSet<(BlockKey, u64)>, StoreError> {
    let rows: Vec<(Vec<u8>, i64)> = sqlx::query_as(
        "SELECT block_hash, pack_offset FROM pack_blocks
         WHERE pack_id = $1 AND quarantined_at IS NULL",
    )
    .bind(id.0.as_slice())
    .fetch_all(index.pool())
    .await
    .map_err(|e| db_error("list the live blocks of a pack", e))?;
    rows.into_iter()
        .map(|(hash, offset)| {
            let key = BlockKey(
                hash.as_slice()
                    .try_into()
                    .map_err(|_| StoreError::Corrupt("block hash length".into()))?,
            );
            Ok((key, offset.max(0) as u64))
        })
        .collect()
}

/// The packs that are not retired, for `verify`.
pub(super) async fn live_packs(index: &PgIndex) -> Result<Vec<PackId>, StoreError> {
    let ids: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT pack_id FROM pack_packs WHERE retired_at IS NULL")
            .fetch_all(index.pool())
            .await
            .map_err(|e| db_error("list packs", e))?;
    ids.iter()
        .map(|id| {
            PackId::try_from_slice(id)
                .ok_or_else(|| StoreError::Corrupt(format!("pack id of {} bytes", id.len())))
        })
        .collect()
}

/// Live rows naming a retired pack (damage: a retired pack may be deleted), for `verify`.
pub(super) async fn rows_off_live_packs(index: &PgIndex) -> Result<u64, StoreError> {
    let count: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pack_blocks b JOIN pack_packs p ON p.pack_id = b.pack_id
         WHERE b.quarantined_at IS NULL AND p.retired_at IS NOT NULL",
    )
    .fetch_one(index.pool())
    .await
    .map_err(|e| db_error("count rows on retired packs", e))?;
    Ok(count.max(0) as u64)
}

/// Delete the rows quarantined before `before_ms`, one statement (and transaction) of
/// at most `batch` rows at a time, walking the primary key from a cursor so the whole
/// purge reads the table once. A row restored meanwhile (a dedup commit clears
/// `quarantined_at`) is re-checked by the `DELETE` and kept.
async fn purge_quarantine(
    pool: &sqlx::PgPool,
    before_ms: i64,
    batch: usize,
) -> Result<u64, StoreError> {
    let mut purged = 0u64;
    let mut cursor: Vec<u8> = Vec::new();
    loop {
        let (last, gone): (Option<Vec<u8>>, i64) = sqlx::query_as(
            "WITH doomed AS (
                 SELECT block_hash FROM pack_blocks
                 WHERE block_hash > $1
                   AND quarantined_at < to_timestamp($2::double precision / 1000)
                 ORDER BY block_hash LIMIT $3),
             gone AS (
                 DELETE FROM pack_blocks b USING doomed d
                 WHERE b.block_hash = d.block_hash
                   AND b.quarantined_at < to_timestamp($2::double precision / 1000)
                 RETURNING 1)
             SELECT (SELECT block_hash FROM doomed ORDER BY block_hash DESC LIMIT 1),
                    (SELECT count(*) FROM gone)",
        )
        .bind(cursor.as_slice())
        .bind(before_ms as f64)
        .bind(batch.max(1) as i64)
        .fetch_one(pool)
        .await
        .map_err(|e| db_error("purge quarantined blocks", e))?;
        purged += gone.max(0) as u64;
        match last {
            Some(last) => {
                if gone > 0 {
                    pause::after("gc purge quarantine batch");
                }
                cursor = last;
            }
            None => return Ok(purged),
        }
    }
}

/// Delete `id`'s object while holding the pack id's row: the object goes only if no
/// upload has committed (or is committing) a row for it (STO-10).
async fn delete_orphan(store: &PackStore, index: &PgIndex, id: PackId) -> Result<bool, StoreError> {
    let mut tx = index
        .pool()
        .begin()
        .await
        .map_err(|e| db_error("begin an orphan claim", e))?;
    // Waits for an upload's uncommitted insert of the same id; conflicts once it commits.
    let claimed = sqlx::query(
        "INSERT INTO pack_packs (pack_id, size, blocks, retired_at) VALUES ($1, 1, 1, now())
         ON CONFLICT (pack_id) DO NOTHING",
    )
    .bind(id.0.as_slice())
    .execute(&mut *tx)
    .await
    .map_err(|e| db_error("claim an orphan pack", e))?
    .rows_affected()
        == 1;
    if !claimed {
        return Ok(false);
    }
    crate::storage::pg::allow_idle_for_medium(&mut tx)
        .await
        .map_err(|e| db_error("widen the idle bound", e))?;
    let medium = store.medium().clone();
    blocking(move || medium.delete(&id)).await?;
    sqlx::query("DELETE FROM pack_packs WHERE pack_id = $1")
        .bind(id.0.as_slice())
        .execute(&mut *tx)
        .await
        .map_err(|e| db_error("release an orphan claim", e))?;
    tx.commit()
        .await
        .map_err(|e| db_error("commit an orphan claim", e))?;
    Ok(true)
}

/// Delete a retired pack retired before `before_ms` that no block row names, holding its
/// row `FOR UPDATE` across the object delete (STO-10).
async fn delete_retired(
    store: &PackStore,
    index: &PgIndex,
    id: PackId,
    before_ms: i64,
) -> Result<bool, StoreError> {
    let mut tx = index
        .pool()
        .begin()
        .await
        .map_err(|e| db_error("begin a pack claim", e))?;
    let held: Option<i32> = sqlx::query_scalar(
        "SELECT 1 FROM pack_packs
         WHERE pack_id = $1 AND retired_at < to_timestamp($2::double precision / 1000)
         FOR UPDATE",
    )
    .bind(id.0.as_slice())
    .bind(before_ms as f64)
    .fetch_optional(&mut *tx)
    .await
    .map_err(|e| db_error("claim a retired pack", e))?;
    if held.is_none() {
        return Ok(false);
    }
    // A fresh statement after the lock: sees every committed row.
    let referenced: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pack_blocks WHERE pack_id = $1)")
            .bind(id.0.as_slice())
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| db_error("check a retired pack", e))?;
    if referenced {
        return Ok(false);
    }
    crate::storage::pg::allow_idle_for_medium(&mut tx)
        .await
        .map_err(|e| db_error("widen the idle bound", e))?;
    let medium = store.medium().clone();
    blocking(move || medium.delete(&id)).await?;
    sqlx::query("DELETE FROM pack_packs WHERE pack_id = $1")
        .bind(id.0.as_slice())
        .execute(&mut *tx)
        .await
        .map_err(|e| db_error("forget a deleted pack", e))?;
    tx.commit()
        .await
        .map_err(|e| db_error("commit a pack claim", e))?;
    Ok(true)
}
