//! PDF-aware ingest: a streaming scanner of PDF syntax ([`scan`]), a chunker that cuts
//! at object boundaries and keeps stream data in blocks of its own ([`chunk`]), and the
//! one function every upload path uses to choose the chunker ([`select`]), and the state a
//! resumable upload carries between its parts ([`resume`]).
//!
//! See `docs/storage.md` (how blocks are cut and why) and `docs/api.md` (Content-Type
//! rules). Invariants: CAS-10 .. CAS-14 in `docs/invariants.md`.

pub mod chunk;
pub mod resume;
pub mod scan;
pub mod select;

pub use chunk::{CutCounts, PdfChunker, PdfSizes};
pub use resume::SavedChunker;
pub use select::{Chunking, PdfPolicy, Selection, SelectionError, UnsupportedPolicy};

#[cfg(test)]
mod tests;
