//! PDF-aware ingest: a streaming scanner of PDF syntax ([`scan`]), a chunker that cuts
//! at object boundaries and keeps stream data in blocks of its own ([`chunk`]), and the
//! one function every upload path uses to choose the chunker ([`select`]).
//!
//! See `docs/storage.md` (how blocks are cut and why) and `docs/api.md` (Content-Type
//! rules). Invariants: CAS-10 .. CAS-13 in `docs/invariants.md`.

pub mod chunk;
pub mod scan;
pub mod select;

pub use chunk::{CutCounts, PdfChunker, PdfSizes};
pub use select::{Chunking, PdfPolicy, Selection, SelectionError, UnsupportedPolicy};

#[cfg(test)]
mod tests;
