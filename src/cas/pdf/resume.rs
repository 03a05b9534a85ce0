//! The chunker state a resumable (tus) upload carries from one PATCH to the next, saved
//! in the ledger row beside the staged tail (docs/resumable.md, CAS-14).
//!
//! | saved bytes | meaning |
//! |---|---|
//! | empty | a row written before chunker states existed: FastCDC, or not decided yet when nothing was accepted (offset 0) |
//! | `0` | not decided: fewer bytes than the PDF signature have arrived, and they could start it |
//! | `1` | FastCDC (its staged tail is all its state) |
//! | `2` + `PdfChunker::save` | the PDF-aware chunker, resumed by `PdfChunker::restore` |
//!
//! At most [`MAX_SAVED_LEN`] bytes.

use bytes::Bytes;

use super::chunk::MAX_STATE_LEN;
use super::scan::StateError;

/// The largest saved chunker state.
pub const MAX_SAVED_LEN: usize = 1 + MAX_STATE_LEN;

/// A resumable upload's chunker between two PATCHes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SavedChunker {
    Undecided,
    FastCdc,
    /// `PdfChunker::save`'s bytes.
    Pdf(Vec<u8>),
}

impl SavedChunker {
    /// The bytes to store in the ledger row.
    pub fn encode(&self) -> Bytes {
        match self {
            SavedChunker::Undecided => Bytes::from_static(&[0]),
            SavedChunker::FastCdc => Bytes::from_static(&[1]),
            SavedChunker::Pdf(state) => {
                let mut out = Vec::with_capacity(1 + state.len());
                out.push(2);
                out.extend_from_slice(state);
                Bytes::from(out)
            }
        }
    }

    /// Read the saved bytes of a row at `offset` (see the module docs).
    pub fn decode(saved: &[u8], offset: u64) -> Result<Self, StateError> {
        match saved.split_first() {
            None if offset == 0 => Ok(SavedChunker::Undecided),
            None => Ok(SavedChunker::FastCdc),
            Some((0, [])) => Ok(SavedChunker::Undecided),
            Some((1, [])) => Ok(SavedChunker::FastCdc),
            Some((2, state)) if state.len() <= MAX_STATE_LEN => {
                Ok(SavedChunker::Pdf(state.to_vec()))
            }
            _ => Err(StateError("unknown chunker")),
        }
    }
}

/// The database bound of the saved state (`sql/0027_upload_chunker_state.sql`).
const _: () = assert!(MAX_SAVED_LEN <= 81920);
