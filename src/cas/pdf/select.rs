//! The one selection of the chunker for an upload (CAS-12), used by every path that
//! ingests a body: one-shot HTTP uploads, uploads forwarded to their owner (the owner
//! chunks, with the Content-Type the relay forwarded), resumable (tus) uploads (the type
//! is `Upload-Metadata`'s `filetype`, the first bytes those of the first PATCHes; see
//! [`MediaType::of_tus_metadata`]), gRPC and the CLI's `put` (which sends
//! `application/octet-stream`, so the file's first bytes decide, and prints the chunker).
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

impl MediaType {
    /// The type a resumable (tus) upload declares in its `Upload-Metadata`: the value of
    /// `filetype` (the key tus clients such as Uppy send), else of `content-type`, base64
    /// decoded. No such key, or a value that is not base64 of UTF-8: [`MediaType::Generic`]
    /// (the first bytes decide).
    pub fn of_tus_metadata(metadata: Option<&str>) -> Self {
        use base64::Engine;
        let Some(metadata) = metadata else {
            return MediaType::Generic;
        };
        let value_of = |wanted: &str| {
            metadata.split(',').find_map(|pair| {
                let mut parts = pair.trim().split(' ');
                let key = parts.next()?;
                key.eq_ignore_ascii_case(wanted)
                    .then(|| parts.next().unwrap_or(""))
            })
        };
        let Some(encoded) = value_of("filetype").or_else(|| value_of("content-type")) else {
            return MediaType::Generic;
        };
        match base64::engine::general_purpose::STANDARD.decode(encoded) {
            Ok(raw) => match std::str::from_utf8(&raw) {
                Ok(text) => MediaType::of(Some(text)),
                Err(_) => MediaType::Generic,
            },
            Err(_) => MediaType::Generic,
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
    fn tus_metadata_declares_the_type_by_filetype_or_content_type() {
        // "application/pdf" and "image/png" in base64.
        let pdf = "YXBwbGljYXRpb24vcGRm";
        let png = "aW1hZ2UvcG5n";
        assert_eq!(MediaType::of_tus_metadata(None), MediaType::Generic);
        assert_eq!(
            MediaType::of_tus_metadata(Some(&format!("filename eC5wZGY=,filetype {pdf}"))),
            MediaType::Pdf
        );
        assert_eq!(
            MediaType::of_tus_metadata(Some(&format!("content-type {png}"))),
            MediaType::Other
        );
        assert_eq!(
            MediaType::of_tus_metadata(Some(&format!("filetype {png},content-type {pdf}"))),
            MediaType::Other
        );
        assert_eq!(
            MediaType::of_tus_metadata(Some("filename eC5wZGY=")),
            MediaType::Generic
        );
        assert_eq!(
            MediaType::of_tus_metadata(Some("filetype")),
            MediaType::Generic
        );
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
