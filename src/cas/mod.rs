//! Content addressing: what a block and a blob are called, and how bytes become blocks.
//!
//! - [`keys`]: [`BlockKey`] (BLAKE3 of a block) and [`BlobKey`] (`blake3:<hex>:<size>`,
//!   BLAKE3 of the whole content plus its length).
//! - [`chunker`]: the pinned FastCDC parameters that decide block boundaries.
//! - [`manifest`]: the ordered block list that makes a blob, and its validation.
//! - [`range`]: HTTP single-range parsing and the block slices a range needs.
//! - [`digest`]: client-declared SHA-256 digests (`Content-Digest`, `X-Content-Hash`).
//! - [`pdf`]: the PDF-aware chunker and the choice between the two chunkers.
//!
//! Everything here is pure and unit-tested, and imports no store: the streams that drive
//! the store traits (ingest, read) are in `crate::pipeline`.

pub mod chunker;
pub mod digest;
pub mod keys;
pub mod manifest;
pub mod pdf;
pub mod range;

pub use chunker::{AVG_CHUNK, MAX_CHUNK, MIN_CHUNK};
pub use keys::{BlobKey, BlockKey, KeyError};
pub use manifest::{BlockRef, Manifest, ManifestError};
