//! The block store contract.

use bytes::Bytes;

use super::StoreFuture;
use crate::cas::BlockKey;

/// Whether a `put` wrote new bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// The block was not stored before and now is.
    Fresh,
    /// The block already existed; nothing was written.
    Duplicate,
}

/// Stores blocks by content key. Implementations must make a block visible only when it
/// is complete (no reader ever sees a partial block) and must never rewrite an existing one.
pub trait BlockStore: Send + Sync + 'static {
    /// Store `data` under `key` (the caller guarantees `key == BLAKE3(data)`).
    fn put(&self, key: BlockKey, data: Bytes) -> StoreFuture<'_, PutOutcome>;

    /// The block's bytes, or `None` if absent. Callers verify the hash.
    fn get(&self, key: BlockKey) -> StoreFuture<'_, Option<Bytes>>;

    /// Whether the block exists.
    fn contains(&self, key: BlockKey) -> StoreFuture<'_, bool>;
}
