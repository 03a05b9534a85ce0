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

use super::keys::BlockKey;
use super::manifest::Manifest;
use super::range::{ByteRange, plan_slices};
use crate::storage::{BlockStore, StoreError};

/// Blocks fetched ahead of the one being sent.
const READ_AHEAD: usize = 4;

/// Upper bound of the block bytes one read holds at once (admission reserves this, see
/// `admission::footprint`): `READ_AHEAD` blocks fetched or buffered by `buffered`, the
/// block being sent, and one more held by the response body writer.
pub const fn memory_bound(max_chunk: usize) -> usize {
    (READ_AHEAD + 2) * max_chunk
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
    futures_util::stream::iter(slices)
        .map(move |slice| {
            let blocks = blocks.clone();
            let key: BlockKey = manifest.blocks[slice.block].key;
            let expected_len = manifest.blocks[slice.block].size as usize;
            // Each block is fetched and checked on a task of its own, so the READ_AHEAD
            // blocks in flight are hashed on every core instead of one after another on
            // the stream's task (the hash, not the read, bounded downloads from packs;
            // docs/performance.md). Dropping the stream aborts the tasks.
            let task = AbortOnDropHandle::new(tokio::spawn(async move {
                let data = blocks
                    .get(key)
                    .await?
                    .ok_or_else(|| ReadError::MissingBlock(key.to_hex()))?;
                if data.len() != expected_len || BlockKey::of(&data) != key {
                    return Err(ReadError::CorruptBlock(key.to_hex()));
                }
                Ok(data.slice(slice.start..slice.end))
            }));
            async move {
                task.await.map_err(|e| {
                    ReadError::Store(StoreError::Unavailable(format!("block read task: {e}")))
                })?
            }
        })
        .buffered(READ_AHEAD)
}
