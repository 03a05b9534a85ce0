//! Streaming, verifying reads of a blob (or a byte range of it).
//!
//! Blocks are fetched a few ahead of the client, each is checked against its BLAKE3 key
//! before any of its bytes leave, and the stream ends with an error (never silently short)
//! if a block is missing or corrupt. The HTTP layer turns such an error into an aborted
//! response, so a download is byte-exact or fails loudly.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use tokio_util::task::AbortOnDropHandle;

use crate::cas::keys::BlockKey;
use crate::cas::manifest::Manifest;
use crate::cas::range::{ByteRange, plan_slices};
use crate::storage::block::{READ_AHEAD, READ_RESPONSES};
use crate::storage::{BlockStore, StoreError};

/// Blocks whose hash is being checked at once, each on a task of its own, so the checks
/// run on every core (on one core the hash, not the read, bounded downloads from packs;
/// docs/performance.md).
const VERIFY_AHEAD: usize = 2;

/// Upper bound of the block bytes one read holds at once (admission reserves this, see
/// `admission::footprint`): what the store's read stream holds ([`READ_AHEAD`] blocks and
/// [`READ_RESPONSES`] HTTP read buffers, see `storage::block`), `VERIFY_AHEAD` blocks being
/// checked, the block being sent, and one more held by the response body writer.
pub const fn memory_bound(max_chunk: usize) -> usize {
    (READ_AHEAD + VERIFY_AHEAD + 2) * max_chunk + READ_RESPONSES * super::ingest::MAX_BODY_FRAME
}

/// Why a blob read stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("block {0} is missing")]
    MissingBlock(String),
    #[error("block {0} failed its integrity check")]
    CorruptBlock(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Stream the bytes of `range` (or the whole blob) in order.
pub fn read_blob(
    blocks: Arc<dyn BlockStore>,
    manifest: Arc<Manifest>,
    range: Option<ByteRange>,
) -> impl Stream<Item = Result<Bytes, ReadError>> + Send + 'static {
    let size = manifest.size();
    let range = match range {
        Some(range) => Some(range),
        None if size > 0 => Some(ByteRange {
            first: 0,
            last: size - 1,
        }),
        None => None,
    };
    let slices = range.map(|r| plan_slices(&manifest, r)).unwrap_or_default();
    let keys: Vec<BlockKey> = slices
        .iter()
        .map(|slice| manifest.blocks[slice.block].key)
        .collect();
    // The store reads the blocks in order (one request per run of adjacent blocks on a
    // remote medium); each block is then checked on a task of its own. Dropping the stream
    // stops the reads and aborts the checks.
    // A store stream that ends early is an error, never a short download.
    let fetched = blocks
        .read_blocks(keys)
        .map(Some)
        .chain(futures_util::stream::repeat_with(|| None));
    futures_util::stream::iter(slices)
        .zip(fetched)
        .map(move |(slice, fetched)| {
            let key: BlockKey = manifest.blocks[slice.block].key;
            let expected_len = manifest.blocks[slice.block].size as usize;
            let task = AbortOnDropHandle::new(tokio::spawn(async move {
                let fetched = fetched.unwrap_or_else(|| {
                    Err(StoreError::Unavailable(
                        "the block store's read ended before the last block".into(),
                    ))
                });
                let data = fetched?.ok_or_else(|| ReadError::MissingBlock(key.to_hex()))?;
                if data.len() != expected_len || BlockKey::of(&data) != key {
                    return Err(ReadError::CorruptBlock(key.to_hex()));
                }
                Ok(data.slice(slice.start..slice.end))
            }));
            async move {
                task.await.map_err(|e| {
                    ReadError::Store(StoreError::Unavailable(format!("block check task: {e}")))
                })?
            }
        })
        .buffered(VERIFY_AHEAD)
}
