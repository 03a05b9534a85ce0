//! Content addressing: what a block and a blob are called, and how bytes become blocks.
//!
//! - [`keys`]: [`BlockKey`] (BLAKE3 of a block) and [`BlobKey`] (`blake3:<hex>:<size>`,
//!   BLAKE3 of the whole content plus its length).
//! - [`chunker`]: the pinned FastCDC parameters that decide block boundaries.
//! - [`manifest`]: the ordered block list that makes a blob, and its validation.
//! - [`range`]: HTTP single-range parsing and the block slices a range needs.
//! - [`digest`]: client-declared SHA-256 digests (`Content-Digest`, `X-Content-Hash`).
//! - [`ingest`]: the streaming pipeline body -> chunks -> blocks -> manifest.
//! - [`read`]: the streaming, verifying download of a blob or a range of it.
//!
//! Everything here except `ingest` and `read` is pure and unit-tested; those two drive
//! the [`crate::storage`] traits and keep memory bounded whatever the blob size.

pub mod chunker;
pub mod digest;
pub mod ingest;
pub mod keys;
pub mod manifest;
pub mod pdf;
pub mod range;
pub mod read;

pub use chunker::{AVG_CHUNK, MAX_CHUNK, MIN_CHUNK};
pub use keys::{BlobKey, BlockKey, KeyError};
pub use manifest::{BlockRef, Manifest, ManifestError};
