//! The block index: `block hash -> (pack, offset, length, last reference time)`, plus the
//! pack table and the quarantine, in one redb database (`<data_dir>/index.redb`).
//!
//! redb gives ACID write transactions (one writer at a time, MVCC readers beside it) with
//! one fsync per durable commit. The pack store runs one write transaction per upload:
//! new entries, the pack rows, and the confirmation that every deduplicated block still
//! has a live entry (its `last_ref` is refreshed in the same transaction, which is what the
//! collector's minimum age protects). The collector's changes run in their own write
//! transactions and re-check `last_ref` there, so a commit and a collection never
//! interleave. All calls block; callers run them on the blocking pool.

use std::collections::HashSet;
use std::path::Path;

use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
};

use super::format::PackId;
use crate::cas::BlockKey;
use crate::storage::StoreError;

/// block hash (32) -> pack (32) | offset u64 | len u32 | last_ref_ms u64
const BLOCKS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("blocks");
/// quarantined block hash -> the same value as BLOCKS | quarantined_ms u64
const QUARANTINE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("quarantine");
/// pack id -> size u64 | blocks u32 | sealed_ms u64 | state u8 (0 live, 1 retired)
const PACKS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("packs");

/// Where a block is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub pack: PackId,
    pub offset: u64,
    pub len: u32,
    /// When an upload last wrote or deduplicated this block (unix ms).
    pub last_ref_ms: u64,
}

impl Location {
    fn encode(&self) -> [u8; 52] {
        let mut out = [0u8; 52];
        out[..32].copy_from_slice(&self.pack.0);
        out[32..40].copy_from_slice(&self.offset.to_le_bytes());
        out[40..44].copy_from_slice(&self.len.to_le_bytes());
        out[44..52].copy_from_slice(&self.last_ref_ms.to_le_bytes());
        out
    }

    fn decode(raw: &[u8]) -> Result<Self, StoreError> {
        if raw.len() < 52 {
            return Err(StoreError::Corrupt("index entry too short".into()));
        }
        Ok(Self {
            pack: PackId(raw[..32].try_into().expect("32")),
            offset: u64::from_le_bytes(raw[32..40].try_into().expect("8")),
            len: u32::from_le_bytes(raw[40..44].try_into().expect("4")),
            last_ref_ms: u64::from_le_bytes(raw[44..52].try_into().expect("8")),
        })
    }
}

/// A sealed pack as the index knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackRecord {
    pub id: PackId,
    pub size: u64,
    pub blocks: u32,
    /// When sealed; for a retired pack, when it was retired.
    pub sealed_ms: u64,
    /// Retired packs hold no live block; they are deleted after the retention window.
    pub retired: bool,
}

impl PackRecord {
    fn encode(&self) -> [u8; 21] {
        let mut out = [0u8; 21];
        out[..8].copy_from_slice(&self.size.to_le_bytes());
        out[8..12].copy_from_slice(&self.blocks.to_le_bytes());
        out[12..20].copy_from_slice(&self.sealed_ms.to_le_bytes());
        out[20] = u8::from(self.retired);
        out
    }

    fn decode(id: &[u8], raw: &[u8]) -> Result<Self, StoreError> {
        if id.len() != 32 || raw.len() < 21 {
            return Err(StoreError::Corrupt("pack record damaged".into()));
        }
        Ok(Self {
            id: PackId(id.try_into().expect("32")),
            size: u64::from_le_bytes(raw[..8].try_into().expect("8")),
            blocks: u32::from_le_bytes(raw[8..12].try_into().expect("4")),
            sealed_ms: u64::from_le_bytes(raw[12..20].try_into().expect("8")),
            retired: raw[20] != 0,
        })
    }
}

/// What one upload's commit adds and confirms.
#[derive(Debug, Default)]
pub struct CommitBatch {
    pub packs: Vec<PackRecord>,
    pub new: Vec<(BlockKey, Location)>,
    /// Blocks the upload found stored already and did not write.
    pub reused: Vec<BlockKey>,
    pub now_ms: u64,
}

/// The commit found a deduplicated block gone (collected since it was looked up).
pub fn vanished(key: &BlockKey) -> StoreError {
    StoreError::Unavailable(format!(
        "block {} was collected while the upload ran; retry the upload",
        key.to_hex()
    ))
}

fn db_err(op: &'static str) -> impl Fn(redb::Error) -> StoreError {
    move |e| StoreError::Corrupt(format!("block index {op}: {e}"))
}

macro_rules! r {
    ($op:expr, $e:expr) => {
        $e.map_err(|e| db_err($op)(e.into()))
    };
}

/// redb's page cache for the index (its default is 1 GiB).
pub const INDEX_CACHE_BYTES: usize = 32 << 20;

/// The embedded (redb) index of one node.
pub struct RedbIndex {
    db: Database,
}

impl std::fmt::Debug for RedbIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RedbIndex")
    }
}

impl RedbIndex {
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        // redb's page cache defaults to 1 GiB, so a full scan (the collector's select)
        // made the process as large as the index; bounded here (docs/performance.md,
        // "Collector").
        let db = match redb::Builder::new()
            .set_cache_size(INDEX_CACHE_BYTES)
            .create(path)
        {
            Ok(db) => db,
            // Another process (a running node) has the index open: say what to do.
            Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
                return Err(StoreError::Busy(format!(
                    "the block index {} is open in another process: a node (graviton serve) \
                     is running on this storage.data_dir. Stop it first, or use the running \
                     node's admin endpoint (POST /v1/admin/gc runs the collector)",
                    path.display()
                )));
            }
            Err(err) => return Err(db_err("open")(err.into())),
        };
        let txn = r!("begin", db.begin_write())?;
        {
            r!("create table", txn.open_table(BLOCKS))?;
            r!("create table", txn.open_table(QUARANTINE))?;
            r!("create table", txn.open_table(PACKS))?;
        }
        r!("commit", txn.commit())?;
        Ok(Self { db })
    }

    pub fn lookup(&self, key: &BlockKey) -> Result<Option<Location>, StoreError> {
        let txn = r!("read", self.db.begin_read())?;
        let table = r!("read", txn.open_table(BLOCKS))?;
        match r!("read", table.get(key.0.as_slice()))? {
            Some(value) => Ok(Some(Location::decode(value.value())?)),
            None => Ok(None),
        }
    }

    /// Where each of `keys` is stored (`None`: absent), in order, in one read transaction
    /// (a download's read plan, `runs`).
    pub fn locate_many(&self, keys: &[BlockKey]) -> Result<Vec<Option<Location>>, StoreError> {
        let txn = r!("read", self.db.begin_read())?;
        let table = r!("read", txn.open_table(BLOCKS))?;
        keys.iter()
            .map(|key| match r!("read", table.get(key.0.as_slice()))? {
                Some(value) => Ok(Some(Location::decode(value.value())?)),
                None => Ok(None),
            })
            .collect()
    }

    /// Which of `keys` are indexed, in one read transaction (an upload's batch of blocks;
    /// a hint, confirmed inside the commit, STO-3).
    pub fn lookup_many(&self, keys: &[BlockKey]) -> Result<HashSet<BlockKey>, StoreError> {
        let mut found = HashSet::new();
        if keys.is_empty() {
            return Ok(found);
        }
        let txn = r!("read", self.db.begin_read())?;
        let table = r!("read", txn.open_table(BLOCKS))?;
        for key in keys {
            if r!("read", table.get(key.0.as_slice()))?.is_some() {
                found.insert(*key);
            }
        }
        Ok(found)
    }

    /// One durable transaction per upload (see the module docs). `present` says whether a
    /// pack is on the medium: every pack of the batch is checked inside the transaction,
    /// because the collector deletes an object only while it holds the write transaction
    /// (STO-11), so a pack that is present now stays present until this commit names it.
    /// A missing one (a same-named twin purged, or an orphan swept, after this upload
    /// published it) fails the commit with a retry answer.
    pub fn commit(
        &self,
        batch: &CommitBatch,
        present: &dyn Fn(&PackId) -> Result<bool, StoreError>,
    ) -> Result<(), StoreError> {
        let mut txn = r!("begin", self.db.begin_write())?;
        r!("durability", txn.set_durability(Durability::Immediate))?;
        for pack in &batch.packs {
            if !present(&pack.id)? {
                return Err(StoreError::Unavailable(format!(
                    "pack {} was deleted by the collector before the upload committed; \
                     retry the upload",
                    pack.id
                )));
            }
        }
        {
            let mut blocks = r!("open", txn.open_table(BLOCKS))?;
            let mut quarantine = r!("open", txn.open_table(QUARANTINE))?;
            let mut packs = r!("open", txn.open_table(PACKS))?;
            for pack in &batch.packs {
                r!(
                    "insert",
                    packs.insert(pack.id.0.as_slice(), pack.encode().as_slice())
                )?;
            }
            for key in &batch.reused {
                let current = r!("read", blocks.get(key.0.as_slice()))?
                    .map(|v| Location::decode(v.value()))
                    .transpose()?;
                let mut location = match current {
                    Some(location) => location,
                    None => {
                        // Restore from quarantine while its pack still exists (a retired
                        // pack is revived: it is only deleted once its row is claimed).
                        let held = r!("read", quarantine.remove(key.0.as_slice()))?
                            .map(|v| Location::decode(v.value()))
                            .transpose()?;
                        match held {
                            Some(location) if revive_pack(&mut packs, &location.pack)? => location,
                            _ => return Err(vanished(key)),
                        }
                    }
                };
                location.last_ref_ms = batch.now_ms;
                r!(
                    "insert",
                    blocks.insert(key.0.as_slice(), location.encode().as_slice())
                )?;
            }
            for (key, location) in &batch.new {
                let existing = r!("read", blocks.get(key.0.as_slice()))?
                    .map(|v| Location::decode(v.value()))
                    .transpose()?;
                // A racing upload committed the same block first: keep its location (our
                // copy becomes dead bytes that compaction reclaims) and refresh last_ref.
                let mut chosen = existing.unwrap_or(*location);
                chosen.last_ref_ms = batch.now_ms;
                r!(
                    "insert",
                    blocks.insert(key.0.as_slice(), chosen.encode().as_slice())
                )?;
                r!("remove", quarantine.remove(key.0.as_slice()))?;
            }
        }
        r!("commit", txn.commit())?;
        Ok(())
    }

    /// Visit every live entry (a read snapshot).
    pub fn for_each_block(
        &self,
        f: &mut dyn FnMut(BlockKey, Location) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let txn = r!("read", self.db.begin_read())?;
        let table = r!("read", txn.open_table(BLOCKS))?;
        for item in r!("scan", table.iter())? {
            let (k, v) = r!("scan", item)?;
            let key = BlockKey(
                k.value()
                    .try_into()
                    .map_err(|_| StoreError::Corrupt("index key damaged".into()))?,
            );
            f(key, Location::decode(v.value())?)?;
        }
        Ok(())
    }

    pub fn block_count(&self) -> Result<u64, StoreError> {
        let txn = r!("read", self.db.begin_read())?;
        let table = r!("read", txn.open_table(BLOCKS))?;
        r!("count", table.len())
    }

    pub fn packs(&self) -> Result<Vec<PackRecord>, StoreError> {
        let txn = r!("read", self.db.begin_read())?;
        let table = r!("read", txn.open_table(PACKS))?;
        let mut out = Vec::new();
        for item in r!("scan", table.iter())? {
            let (k, v) = r!("scan", item)?;
            out.push(PackRecord::decode(k.value(), v.value())?);
        }
        Ok(out)
    }

    /// Move `candidates` to the quarantine, but only those still unreferenced since
    /// `cutoff_ms` (re-checked inside this transaction). Returns how many moved.
    pub fn quarantine(
        &self,
        candidates: &[BlockKey],
        cutoff_ms: u64,
        now_ms: u64,
    ) -> Result<u64, StoreError> {
        let txn = r!("begin", self.db.begin_write())?;
        let mut moved = 0;
        {
            let mut blocks = r!("open", txn.open_table(BLOCKS))?;
            let mut quarantine = r!("open", txn.open_table(QUARANTINE))?;
            for key in candidates {
                let Some(location) = r!("read", blocks.get(key.0.as_slice()))?
                    .map(|v| Location::decode(v.value()))
                    .transpose()?
                else {
                    continue;
                };
                if location.last_ref_ms >= cutoff_ms {
                    continue;
                }
                r!("remove", blocks.remove(key.0.as_slice()))?;
                let mut held = location.encode().to_vec();
                held.extend_from_slice(&now_ms.to_le_bytes());
                r!(
                    "insert",
                    quarantine.insert(key.0.as_slice(), held.as_slice())
                )?;
                moved += 1;
            }
        }
        r!("commit", txn.commit())?;
        Ok(moved)
    }

    /// Quarantined entries and when they were quarantined (tests and small stores: it
    /// holds every entry; the collector uses the batched calls below).
    pub fn quarantined(&self) -> Result<Vec<(BlockKey, Location, u64)>, StoreError> {
        let txn = r!("read", self.db.begin_read())?;
        let table = r!("read", txn.open_table(QUARANTINE))?;
        let mut out = Vec::new();
        for item in r!("scan", table.iter())? {
            let (k, v) = r!("scan", item)?;
            out.push(decode_held(k.value(), v.value())?);
        }
        Ok(out)
    }

    /// Put every quarantined block whose pack still exists back (the operator's undo
    /// within the retention window), in write transactions of [`RESTORE_BATCH`] entries.
    /// Returns how many were restored.
    pub fn restore_quarantine(&self) -> Result<u64, StoreError> {
        let mut restored = 0;
        let mut cursor: Option<BlockKey> = None;
        loop {
            let txn = r!("begin", self.db.begin_write())?;
            let next;
            {
                let mut blocks = r!("open", txn.open_table(BLOCKS))?;
                let mut quarantine = r!("open", txn.open_table(QUARANTINE))?;
                let mut packs = r!("open", txn.open_table(PACKS))?;
                let (held, more) = held_from(&quarantine, cursor.as_ref(), RESTORE_BATCH)?;
                next = more;
                for (key, location, _) in &held {
                    if revive_pack(&mut packs, &location.pack)? {
                        r!("remove", quarantine.remove(key.0.as_slice()))?;
                        r!(
                            "insert",
                            blocks.insert(key.0.as_slice(), location.encode().as_slice())
                        )?;
                        restored += 1;
                    }
                }
            }
            r!("commit", txn.commit())?;
            match next {
                Some(key) => cursor = Some(key),
                None => return Ok(restored),
            }
        }
    }

    /// Purge a pack retired before `before_ms`: inside one write transaction, check that
    /// it is still retired, call `delete` (which deletes its object), then remove its row.
    /// No upload can commit in between (one writer), and an upload that re-published the
    /// same name meanwhile finds the object gone when its commit checks it (STO-11).
    /// Returns whether the pack was purged; an error from `delete` changes nothing.
    pub fn purge_retired_pack(
        &self,
        id: &PackId,
        before_ms: u64,
        delete: &dyn Fn(&PackId) -> Result<(), StoreError>,
    ) -> Result<bool, StoreError> {
        let txn = r!("begin", self.db.begin_write())?;
        {
            let mut packs = r!("open", txn.open_table(PACKS))?;
            let record = r!("read", packs.get(id.0.as_slice()))?
                .map(|v| PackRecord::decode(&id.0, v.value()))
                .transpose()?;
            match record {
                Some(record) if record.retired && record.sealed_ms < before_ms => {}
                _ => return Ok(false),
            }
            delete(id)?;
            r!("remove", packs.remove(id.0.as_slice()))?;
        }
        r!("commit", txn.commit())?;
        Ok(true)
    }

    /// Delete an orphan object (one no pack row names) inside a write transaction, after
    /// checking there that still no row names it (STO-11). Returns whether it deleted.
    pub fn delete_orphan(
        &self,
        id: &PackId,
        delete: &dyn Fn(&PackId) -> Result<(), StoreError>,
    ) -> Result<bool, StoreError> {
        let txn = r!("begin", self.db.begin_write())?;
        {
            let packs = r!("open", txn.open_table(PACKS))?;
            if r!("read", packs.get(id.0.as_slice()))?.is_some() {
                return Ok(false);
            }
            delete(id)?;
        }
        // Nothing changed; the transaction only excluded commits while the object went.
        r!("abort", txn.abort())?;
        Ok(true)
    }

    /// Drop quarantined entries older than `before_ms` for good (every batch, in turn).
    pub fn purge_quarantine(&self, before_ms: u64) -> Result<u64, StoreError> {
        let mut purged = 0;
        let mut cursor = None;
        loop {
            let (n, next) = self.purge_quarantine_batch(before_ms, cursor.as_ref(), 4096)?;
            purged += n;
            match next {
                Some(key) => cursor = Some(key),
                None => return Ok(purged),
            }
        }
    }

    /// One write transaction of the purge: visit up to `limit` quarantined entries after
    /// `after` (from the first when `None`), in key order, and drop those quarantined
    /// before `before_ms`. Returns how many were dropped, and the cursor to pass next
    /// (`None` once the table's end was reached).
    pub fn purge_quarantine_batch(
        &self,
        before_ms: u64,
        after: Option<&BlockKey>,
        limit: usize,
    ) -> Result<(u64, Option<BlockKey>), StoreError> {
        let txn = r!("begin", self.db.begin_write())?;
        let mut purged = 0;
        let next;
        {
            let mut quarantine = r!("open", txn.open_table(QUARANTINE))?;
            let (held, more) = held_from(&quarantine, after, limit)?;
            next = more;
            for (key, _, at) in held {
                if at < before_ms {
                    r!("remove", quarantine.remove(key.0.as_slice()))?;
                    purged += 1;
                }
            }
        }
        r!("commit", txn.commit())?;
        Ok((purged, next))
    }

    /// Point blocks that still live in `from` at their copies in a new pack (compaction);
    /// blocks that moved or vanished meanwhile are left alone. Records the new pack.
    pub fn relocate(
        &self,
        from: &PackId,
        new_pack: &PackRecord,
        moved: &[(BlockKey, Location)],
    ) -> Result<u64, StoreError> {
        let txn = r!("begin", self.db.begin_write())?;
        let mut count = 0;
        {
            let mut blocks = r!("open", txn.open_table(BLOCKS))?;
            let mut packs = r!("open", txn.open_table(PACKS))?;
            r!(
                "insert",
                packs.insert(new_pack.id.0.as_slice(), new_pack.encode().as_slice())
            )?;
            for (key, location) in moved {
                let Some(current) = r!("read", blocks.get(key.0.as_slice()))?
                    .map(|v| Location::decode(v.value()))
                    .transpose()?
                else {
                    continue;
                };
                if current.pack != *from {
                    continue;
                }
                let mut next = *location;
                next.last_ref_ms = current.last_ref_ms;
                r!(
                    "insert",
                    blocks.insert(key.0.as_slice(), next.encode().as_slice())
                )?;
                count += 1;
            }
        }
        r!("commit", txn.commit())?;
        Ok(count)
    }

    /// Mark packs retired, except those a live entry still points at (checked inside the
    /// same write transaction, so no commit or restore can slip in between). Returns the
    /// packs retired.
    pub fn retire_packs(&self, ids: &[PackId]) -> Result<Vec<PackId>, StoreError> {
        let txn = r!("begin", self.db.begin_write())?;
        let mut retired = Vec::new();
        {
            let blocks = r!("open", txn.open_table(BLOCKS))?;
            let mut wanted: std::collections::HashSet<PackId> = ids.iter().copied().collect();
            for item in r!("scan", blocks.iter())? {
                let (_, v) = r!("scan", item)?;
                wanted.remove(&Location::decode(v.value())?.pack);
            }
            let mut packs = r!("open", txn.open_table(PACKS))?;
            for id in ids.iter().filter(|id| wanted.contains(id)) {
                let record = r!("read", packs.get(id.0.as_slice()))?
                    .map(|v| PackRecord::decode(&id.0, v.value()))
                    .transpose()?;
                if let Some(mut record) = record {
                    record.retired = true;
                    // From now on `sealed_ms` counts the retention window.
                    record.sealed_ms = super::now_ms();
                    r!(
                        "insert",
                        packs.insert(id.0.as_slice(), record.encode().as_slice())
                    )?;
                    retired.push(*id);
                }
            }
        }
        r!("commit", txn.commit())?;
        Ok(retired)
    }

    /// Forget a pack record (after its object is deleted).
    pub fn forget_pack(&self, id: &PackId) -> Result<(), StoreError> {
        let txn = r!("begin", self.db.begin_write())?;
        {
            let mut packs = r!("open", txn.open_table(PACKS))?;
            r!("remove", packs.remove(id.0.as_slice()))?;
        }
        r!("commit", txn.commit())?;
        Ok(())
    }
}

/// Entries per write transaction of [`RedbIndex::restore_quarantine`].
const RESTORE_BATCH: usize = 4096;

/// A quarantine row: key, location, and when it was quarantined (unix ms).
type Held = (BlockKey, Location, u64);

fn decode_held(key: &[u8], raw: &[u8]) -> Result<Held, StoreError> {
    let key = BlockKey(
        key.try_into()
            .map_err(|_| StoreError::Corrupt("quarantine key damaged".into()))?,
    );
    let at = raw
        .get(52..60)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8")))
        .unwrap_or(0);
    Ok((key, Location::decode(raw)?, at))
}

/// Up to `limit` quarantine rows after `after` (from the first when `None`), in key
/// order, and the last one's key when more may follow (`None` at the table's end).
fn held_from(
    table: &impl ReadableTable<&'static [u8], &'static [u8]>,
    after: Option<&BlockKey>,
    limit: usize,
) -> Result<(Vec<Held>, Option<BlockKey>), StoreError> {
    use std::ops::Bound;
    let lower = match after {
        Some(key) => Bound::Excluded(key.0.as_slice()),
        None => Bound::Unbounded,
    };
    let mut out = Vec::with_capacity(limit.min(1 << 16));
    for item in r!(
        "scan",
        table.range::<&[u8]>((lower, Bound::<&[u8]>::Unbounded))
    )? {
        let (k, v) = r!("scan", item)?;
        out.push(decode_held(k.value(), v.value())?);
        if out.len() >= limit.max(1) {
            let last = out.last().map(|(key, _, _)| *key);
            return Ok((out, last));
        }
    }
    Ok((out, None))
}

/// Whether the pack still exists; a retired one is made live again.
fn revive_pack(
    packs: &mut redb::Table<&'static [u8], &'static [u8]>,
    id: &PackId,
) -> Result<bool, StoreError> {
    let record = r!("read", packs.get(id.0.as_slice()))?
        .map(|v| PackRecord::decode(&id.0, v.value()))
        .transpose()?;
    match record {
        Some(mut record) => {
            if record.retired {
                record.retired = false;
                r!(
                    "insert",
                    packs.insert(id.0.as_slice(), record.encode().as_slice())
                )?;
            }
            Ok(true)
        }
        None => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(pack: u8, offset: u64) -> Location {
        Location {
            pack: PackId([pack; 32]),
            offset,
            len: 10,
            last_ref_ms: 0,
        }
    }

    fn pack(id: u8) -> PackRecord {
        PackRecord {
            id: PackId([id; 32]),
            size: 100,
            blocks: 1,
            sealed_ms: 1,
            retired: false,
        }
    }

    // Checks STO-3.
    #[test]
    fn a_dedup_hit_on_a_collected_block_fails_the_commit() {
        let dir = tempfile::tempdir().unwrap();
        let index = RedbIndex::open(&dir.path().join("i.redb")).unwrap();
        let a = BlockKey([1; 32]);
        index
            .commit(
                &CommitBatch {
                    packs: vec![pack(9)],
                    new: vec![(a, loc(9, 40))],
                    reused: vec![],
                    now_ms: 1000,
                },
                &|_| Ok(true),
            )
            .unwrap();
        assert_eq!(index.lookup(&a).unwrap().unwrap().last_ref_ms, 1000);
        // a reference newer than the cutoff is not collected
        assert_eq!(index.quarantine(&[a], 1000, 5000).unwrap(), 0);
        assert_eq!(index.quarantine(&[a], 1001, 5000).unwrap(), 1);
        assert!(index.lookup(&a).unwrap().is_none());
        // a dedup commit restores it from the quarantine while the pack lives
        index
            .commit(
                &CommitBatch {
                    reused: vec![a],
                    now_ms: 6000,
                    ..Default::default()
                },
                &|_| Ok(true),
            )
            .unwrap();
        assert_eq!(index.lookup(&a).unwrap().unwrap().last_ref_ms, 6000);
        // once purged, the dedup commit fails instead of trusting a stale answer
        assert_eq!(index.quarantine(&[a], 7000, 7000).unwrap(), 1);
        assert_eq!(index.purge_quarantine(8000).unwrap(), 1);
        let err = index
            .commit(
                &CommitBatch {
                    reused: vec![a],
                    now_ms: 9000,
                    ..Default::default()
                },
                &|_| Ok(true),
            )
            .unwrap_err();
        assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    }

    #[test]
    fn relocation_only_moves_blocks_still_in_the_old_pack() {
        let dir = tempfile::tempdir().unwrap();
        let index = RedbIndex::open(&dir.path().join("i.redb")).unwrap();
        let (a, b) = (BlockKey([1; 32]), BlockKey([2; 32]));
        index
            .commit(
                &CommitBatch {
                    packs: vec![pack(1), pack(2)],
                    new: vec![(a, loc(1, 40)), (b, loc(2, 40))],
                    reused: vec![],
                    now_ms: 5,
                },
                &|_| Ok(true),
            )
            .unwrap();
        let moved = index
            .relocate(
                &PackId([1; 32]),
                &pack(3),
                &[(a, loc(3, 40)), (b, loc(3, 90))],
            )
            .unwrap();
        assert_eq!(moved, 1);
        assert_eq!(index.lookup(&a).unwrap().unwrap().pack, PackId([3; 32]));
        assert_eq!(index.lookup(&b).unwrap().unwrap().pack, PackId([2; 32]));
        assert_eq!(
            index
                .retire_packs(&[PackId([1; 32]), PackId([2; 32])])
                .unwrap(),
            vec![PackId([1; 32])]
        );
        assert_eq!(
            index.packs().unwrap().iter().filter(|p| p.retired).count(),
            1
        );
    }
}
