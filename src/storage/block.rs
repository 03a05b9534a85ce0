//! The block store contract: blocks are written through a write session per upload.
//!
//! An upload `begin`s a session, `append`s its blocks in order, and `commit`s. Nothing
//! appended is promised to be readable before `commit` returns `Ok`; after it, every
//! appended block (new or deduplicated) is durable and readable, and a deduplicated block
//! was confirmed inside the commit (never trusted from an earlier lookup). Dropping a
//! session, or `abort`, discards what it wrote.
//!
//! `commit_manifest` commits and creates the manifest that names the blocks. By default
//! that is `commit` then `ManifestStore::create_fenced`; a store whose index lives in the
//! manifest store's database (the cluster's PostgreSQL) does both, with the fence, in one
//! transaction, so a manifest is never visible without its index entries.
//!
//! Reads go through `read_blocks`: the blocks a download needs, in order, as one stream,
//! so that a store on a remote medium can read adjacent blocks with one request (the pack
//! store on S3) while a local store reads them one by one with `get`.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;

use super::manifest::CommitFence;
use super::{CreateOutcome, ManifestStore, StoreFuture};
use crate::cas::{BlockKey, Manifest};

/// Whether an `append` will store new bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// The block was not stored before; this session stores it.
    Fresh,
    /// The block is stored already (confirmed again at commit); nothing is written.
    Duplicate,
}

/// What a commit made durable.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitReport {
    /// Packs (or files) sealed by this session.
    pub packs: usize,
    pub fresh_bytes: u64,
}

/// Blocks a [`BlockStore::read_blocks`] stream holds at once, fetched or being fetched, in
/// blocks of the chunker's largest size. The default reads this many blocks ahead with
/// `get`; the pack store on a remote medium holds at most two (the block it is assembling
/// and one read ahead), plus [`READ_RESPONSES`] open responses.
pub const READ_AHEAD: usize = 4;

/// HTTP responses a [`BlockStore::read_blocks`] stream keeps open at once: the run of
/// blocks being read and the next two, whose requests are sent early so their latency is
/// hidden and the server streams them while the current run is read (a third response
/// took S3 downloads from 0.62–0.80 to 0.89–1.02 of four parallel whole-pack GETs,
/// docs/performance.md, "S3"). Each holds at most one HTTP/1 read buffer
/// (`pipeline::ingest::MAX_BODY_FRAME`).
pub const READ_RESPONSES: usize = 3;

/// The blocks of a read, in the order asked: one item per key, `None` for a block the
/// store does not hold. Callers verify each block's hash.
pub type BlockStream = BoxStream<'static, Result<Option<Bytes>, super::StoreError>>;

/// Read `keys` one by one with [`BlockStore::get`], [`READ_AHEAD`] at once: the default of
/// [`BlockStore::read_blocks`], for stores where a block read is cheap on its own.
pub fn read_each<S: BlockStore + ?Sized>(store: Arc<S>, keys: Vec<BlockKey>) -> BlockStream {
    futures_util::stream::iter(keys)
        .map(move |key| {
            let store = store.clone();
            async move { store.get(key).await }
        })
        .buffered(READ_AHEAD)
        .boxed()
}

/// Stores blocks by content key.
pub trait BlockStore: Send + Sync + 'static {
    /// Start writing the blocks of one upload.
    fn begin(&self) -> Result<Box<dyn WriteSession>, super::StoreError>;

    /// The block's bytes, or `None` if absent. Callers verify the hash.
    fn get(&self, key: BlockKey) -> StoreFuture<'_, Option<Bytes>>;

    /// Whether the block exists.
    fn contains(&self, key: BlockKey) -> StoreFuture<'_, bool>;

    /// The blocks `keys`, in order (see [`BlockStream`]), holding at most [`READ_AHEAD`]
    /// blocks and [`READ_RESPONSES`] responses at once. Dropping the stream stops the
    /// reads.
    fn read_blocks(self: Arc<Self>, keys: Vec<BlockKey>) -> BlockStream {
        read_each(self, keys)
    }

    /// One cheap round trip to where the blocks are (the node's dependency probe,
    /// `health`). By default: whether the store holds a block no upload made
    /// ([`PROBE_KEY`]), which reads the store's index.
    fn probe(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move { self.contains(BlockKey::of(PROBE_KEY)).await.map(drop) })
    }

    /// Where the blocks are, for logs and `/readyz` (never credentials).
    fn describe(&self) -> String {
        "block store".to_string()
    }
}

/// The content of the block the default [`BlockStore::probe`] looks up.
pub const PROBE_KEY: &[u8] = b"graviton dependency probe";

/// The blocks of one upload, made durable together.
pub trait WriteSession: Send + 'static {
    /// Add a block (the caller guarantees `key == BLAKE3(data)`).
    fn append(&mut self, key: BlockKey, data: Bytes) -> StoreFuture<'_, PutOutcome>;

    /// Append `blocks` in order; the outcomes are those `append` would give, in order. A
    /// store whose dedup lookup is a network round trip (the cluster's PostgreSQL index)
    /// answers the whole batch with one query.
    fn append_many(&mut self, blocks: Vec<(BlockKey, Bytes)>) -> StoreFuture<'_, Vec<PutOutcome>> {
        Box::pin(async move {
            let mut outcomes = Vec::with_capacity(blocks.len());
            for (key, data) in blocks {
                outcomes.push(self.append(key, data).await?);
            }
            Ok(outcomes)
        })
    }

    /// Blocks that an earlier session stored and the caller's manifest names (the
    /// earlier parts of a resumable upload): the commit confirms them still stored,
    /// against the collector, exactly as it confirms this session's dedup hits (STO-3),
    /// and fails if one is gone.
    fn confirm(&mut self, keys: Vec<BlockKey>);

    /// Make every appended block durable and visible (see the module docs).
    fn commit(self: Box<Self>) -> StoreFuture<'static, CommitReport>;

    /// Commit, then create `manifest` in `manifests` under `fence` (see the module docs).
    /// The caller builds the manifest from the blocks it appended.
    fn commit_manifest(
        self: Box<Self>,
        manifest: Manifest,
        manifests: Arc<dyn ManifestStore>,
        fence: Option<CommitFence>,
    ) -> StoreFuture<'static, (CommitReport, CreateOutcome)> {
        Box::pin(async move {
            let report = self.commit().await?;
            let outcome = manifests.create_fenced(&manifest, fence.as_ref()).await?;
            Ok((report, outcome))
        })
    }

    /// Discard what this session wrote.
    fn abort(self: Box<Self>) -> StoreFuture<'static, ()>;
}
