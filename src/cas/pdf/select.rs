//! The one selection of the chunker for an upload (CAS-12), used by every path that
//! ingests a body: one-shot HTTP uploads, uploads forwarded to their owner (the owner
//! chunks, with the Content-Type the relay forwarded), gRPC and the CLI's `put` (which
//! sends its file's type).
//!
//! | declared `Content-Type` | body starts with `%PDF-` | result |
//! |---|---|---|
//! | `application/pdf` | yes | PDF-aware chunker |
//! | `application/pdf` | no | refused: `pdf_signature_missing` (415) |
//! | none, `application/octet-stream` | yes | PDF-aware chunker (upgraded) |
//! | none, `application/octet-stream` | no | FastCDC |
//! | any other type | yes | refused: `pdf_type_mismatch` (415) |
//! | any other type | no | FastCDC |
//!
//! The type is read from the header before the body; the signature is the first five
//! bytes of the body, checked before any block is cut (so a refusal stores nothing).
//! With `[ingest.pdf] enabled = false` none of this applies: every body is FastCDC.

use super::chunk::PdfSizes;
use super::scan::Unsupported;
use crate::cas::chunker::{AVG_CHUNK, MAX_CHUNK, MIN_CHUNK};
use crate::cas::manifest::ChunkingInfo;

/// The first bytes of every PDF file (ISO 32000: `%PDF-1.x`, `%PDF-2.0`).
pub const SIGNATURE: &[u8; 5] = b"%PDF-";

/// What to do with a PDF the scanner does not fully understand (`[ingest.pdf]
/// unsupported`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnsupportedPolicy {
    /// Store it; cuts fall back to FastCDC where no object boundary is known.
    #[default]
    Fallback,
    /// Refuse the upload (422 `pdf_unsupported`), storing nothing.
    Reject,
}

/// The `[ingest.pdf]` settings in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PdfPolicy {
    pub enabled: bool,
    pub sizes: PdfSizes,
    pub unsupported: UnsupportedPolicy,
}

impl Default for PdfPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            sizes: PdfSizes::default(),
            unsupported: UnsupportedPolicy::Fallback,
        }
    }
}

/// What the declared type says, before the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MediaType {
    /// `application/pdf`.
    Pdf,
    /// No type, or `application/octet-stream`.
    #[default]
    Generic,
    /// Any other concrete type.
    Other,
}

impl MediaType {
    /// Classify a `Content-Type` value (parameters, case and spaces ignored).
    pub fn of(content_type: Option<&str>) -> Self {
        let Some(value) = content_type else {
            return MediaType::Generic;
        };
        let essence = value.split(';').next().unwrap_or("").trim();
        if essence.eq_ignore_ascii_case("application/pdf") {
            MediaType::Pdf
        } else if essence.is_empty() || essence.eq_ignore_ascii_case("application/octet-stream") {
            MediaType::Generic
        } else {
            MediaType::Other
        }
    }
}

/// The chunker an upload is selected for, before its first bytes are seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Selection {
    pub declared: MediaType,
    pub policy: PdfPolicy,
}

/// The chunker that cuts a blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunking {
    FastCdc,
    Pdf(PdfSizes),
}

/// The `algorithm` a manifest records for the PDF-aware chunker.
pub const PDF_ALGORITHM: &str = "pdf-objects-v1+fastcdc-2020-v5.0.0";

impl Chunking {
    /// The short name in upload answers and metrics: `fastcdc` or `pdf`.
    pub fn name(&self) -> &'static str {
        match self {
            Chunking::FastCdc => "fastcdc",
            Chunking::Pdf(_) => "pdf",
        }
    }

    /// What the manifest records.
    pub fn info(&self) -> ChunkingInfo {
        match self {
            Chunking::FastCdc => ChunkingInfo::current(),
            Chunking::Pdf(sizes) => ChunkingInfo {
                algorithm: PDF_ALGORITHM.to_string(),
                min: sizes.min as u32,
                avg: sizes.target as u32,
                max: sizes.max as u32,
            },
        }
    }
}

const _: () = assert!(MIN_CHUNK <= AVG_CHUNK && AVG_CHUNK <= MAX_CHUNK);

/// Why an upload was refused by the selection or the PDF scanner. Nothing is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SelectionError {
    #[error("the body is declared as application/pdf but does not start with %PDF-")]
    SignatureMissing,
    #[error("the body starts with %PDF- but is declared as another media type")]
    TypeMismatch,
    #[error("the PDF has a structure this server does not chunk ({})", .0.as_str())]
    Unsupported(Unsupported),
}

impl SelectionError {
    /// The machine-readable error code of the answer.
    pub fn code(&self) -> &'static str {
        match self {
            SelectionError::SignatureMissing => "pdf_signature_missing",
            SelectionError::TypeMismatch => "pdf_type_mismatch",
            SelectionError::Unsupported(_) => "pdf_unsupported",
        }
    }
}

impl Selection {
    /// Every body cut by FastCDC, with no checks (tus parts, internal copies).
    pub fn generic() -> Self {
        Self {
            declared: MediaType::Generic,
            policy: PdfPolicy {
                enabled: false,
                ..PdfPolicy::default()
            },
        }
    }

    /// Decide from the first bytes of the body (`head`; `eof`: the body has no more).
    /// `None`: more bytes are needed (at most [`SIGNATURE`]'s length are ever needed).
    pub fn decide(&self, head: &[u8], eof: bool) -> Option<Result<Chunking, SelectionError>> {
        if !self.policy.enabled {
            return Some(Ok(Chunking::FastCdc));
        }
        let n = head.len().min(SIGNATURE.len());
        let could_be = head[..n] == SIGNATURE[..n];
        if could_be && n < SIGNATURE.len() && !eof {
            return None;
        }
        let is_pdf = could_be && n == SIGNATURE.len();
        Some(match (self.declared, is_pdf) {
            (MediaType::Pdf, false) => Err(SelectionError::SignatureMissing),
            (MediaType::Other, true) => Err(SelectionError::TypeMismatch),
            (MediaType::Pdf | MediaType::Generic, true) => Ok(Chunking::Pdf(self.policy.sizes)),
            (MediaType::Generic | MediaType::Other, false) => Ok(Chunking::FastCdc),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(declared: MediaType) -> Selection {
        Selection {
            declared,
            policy: PdfPolicy::default(),
        }
    }

    #[test]
    fn content_types_are_classified_by_their_essence() {
        assert_eq!(MediaType::of(None), MediaType::Generic);
        assert_eq!(MediaType::of(Some("application/PDF ; x=y")), MediaType::Pdf);
        assert_eq!(
            MediaType::of(Some(" application/octet-stream")),
            MediaType::Generic
        );
        assert_eq!(MediaType::of(Some("image/png")), MediaType::Other);
        assert_eq!(MediaType::of(Some("application/pdfx")), MediaType::Other);
    }

    #[test]
    fn the_selection_table_holds() {
        // Checks CAS-12.
        let pdf = b"%PDF-1.7\n";
        let png = b"\x89PNG\r\n";
        let chunk = Ok(Chunking::Pdf(PdfSizes::default()));
        assert_eq!(on(MediaType::Pdf).decide(pdf, false), Some(chunk));
        assert_eq!(
            on(MediaType::Pdf).decide(png, false),
            Some(Err(SelectionError::SignatureMissing))
        );
        assert_eq!(on(MediaType::Generic).decide(pdf, false), Some(chunk));
        assert_eq!(
            on(MediaType::Generic).decide(png, false),
            Some(Ok(Chunking::FastCdc))
        );
        assert_eq!(
            on(MediaType::Other).decide(pdf, false),
            Some(Err(SelectionError::TypeMismatch))
        );
        assert_eq!(
            on(MediaType::Other).decide(png, false),
            Some(Ok(Chunking::FastCdc))
        );
        let off = Selection {
            policy: PdfPolicy {
                enabled: false,
                ..PdfPolicy::default()
            },
            ..on(MediaType::Pdf)
        };
        assert_eq!(off.decide(png, false), Some(Ok(Chunking::FastCdc)));
    }

    #[test]
    fn at_most_five_bytes_decide_and_short_bodies_are_decided_at_their_end() {
        // Checks CAS-12: decided within the first bytes.
        let s = on(MediaType::Pdf);
        assert_eq!(s.decide(b"", false), None);
        assert_eq!(s.decide(b"%PD", false), None);
        assert_eq!(
            s.decide(b"%PD", true),
            Some(Err(SelectionError::SignatureMissing))
        );
        assert_eq!(
            s.decide(b"", true),
            Some(Err(SelectionError::SignatureMissing))
        );
        // A first byte that cannot start the signature decides at once.
        assert_eq!(
            on(MediaType::Generic).decide(b"x", false),
            Some(Ok(Chunking::FastCdc))
        );
        assert_eq!(
            s.decide(b"%PDF-", false),
            Some(Ok(Chunking::Pdf(PdfSizes::default())))
        );
    }
}
