//! The tus 1.0.0 protocol, as pure functions: header names and values, parsing of the
//! request headers (`Tus-Resumable`, `Upload-Length`, `Upload-Offset`, `Upload-Metadata`,
//! `Upload-Checksum`), the upload id, the part footprint and the `Upload-Expires` date.
//! No I/O; `http::tus` calls these before it touches a body, and a malformed header is an
//! error value, never a panic. See docs/api.md ("Resumable uploads (tus 1.0)") and
//! docs/resumable.md.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;

use crate::cas::digest::BodyDigest;
use crate::ids::{SessionId, SessionKey, TenantId};

/// The protocol version this server speaks (the only one).
pub const VERSION: &str = "1.0.0";
/// `Tus-Extension`.
pub const EXTENSIONS: &str = "creation,creation-with-upload,termination,expiration,checksum";
/// `Tus-Checksum-Algorithm`.
pub const CHECKSUM_ALGORITHMS: &str = "sha1,sha256";
/// The content type of a PATCH body.
pub const OFFSET_OCTET_STREAM: &str = "application/offset+octet-stream";

pub const TUS_RESUMABLE: &str = "tus-resumable";
pub const TUS_VERSION: &str = "tus-version";
pub const TUS_EXTENSION: &str = "tus-extension";
pub const TUS_MAX_SIZE: &str = "tus-max-size";
pub const TUS_CHECKSUM_ALGORITHM: &str = "tus-checksum-algorithm";
pub const UPLOAD_LENGTH: &str = "upload-length";
pub const UPLOAD_OFFSET: &str = "upload-offset";
pub const UPLOAD_METADATA: &str = "upload-metadata";
pub const UPLOAD_EXPIRES: &str = "upload-expires";
pub const UPLOAD_CHECKSUM: &str = "upload-checksum";
pub const UPLOAD_DEFER_LENGTH: &str = "upload-defer-length";
/// The blob key of a completed upload (our header).
pub const BLOB_KEY: &str = "graviton-blob-key";

/// Longest `Upload-Metadata` accepted (it is stored in the ledger and echoed by HEAD).
pub const MAX_METADATA: usize = 4096;

/// Why a tus header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TusError {
    #[error("Tus-Resumable is missing or names a version this server does not speak (1.0.0)")]
    UnsupportedVersion,
    #[error("Upload-Length is missing or not a decimal byte count")]
    InvalidLength,
    #[error("Upload-Defer-Length is not supported; send Upload-Length")]
    DeferLength,
    #[error("Upload-Offset is missing or not a decimal byte count")]
    InvalidOffset,
    #[error("Upload-Metadata is malformed (comma-separated `key base64-value` pairs)")]
    InvalidMetadata,
    #[error("Upload-Checksum is malformed or names an unsupported algorithm (sha1, sha256)")]
    InvalidChecksum,
}

/// `Tus-Resumable` must be exactly `1.0.0`.
pub fn check_resumable(value: Option<&str>) -> Result<(), TusError> {
    match value.map(str::trim) {
        Some(VERSION) => Ok(()),
        _ => Err(TusError::UnsupportedVersion),
    }
}

/// A non-negative decimal without sign, spaces or leading `+` (ASCII digits only).
fn decimal(value: &str) -> Option<u64> {
    let value = value.trim();
    if value.is_empty() || value.len() > 20 || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    value.parse().ok()
}

/// `Upload-Length` of a creation request (`Upload-Defer-Length` is refused).
pub fn parse_length(length: Option<&str>, defer: Option<&str>) -> Result<u64, TusError> {
    match (length, defer) {
        (Some(value), _) => decimal(value).ok_or(TusError::InvalidLength),
        (None, Some(_)) => Err(TusError::DeferLength),
        (None, None) => Err(TusError::InvalidLength),
    }
}

/// `Upload-Offset` of a PATCH.
pub fn parse_offset(value: Option<&str>) -> Result<u64, TusError> {
    value.and_then(decimal).ok_or(TusError::InvalidOffset)
}

/// Validate `Upload-Metadata` (returned trimmed, to be stored and echoed): pairs
/// separated by `,`, each a key without spaces or commas and an optional base64 value;
/// keys unique.
pub fn parse_metadata(value: Option<&str>) -> Result<Option<String>, TusError> {
    let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    if value.len() > MAX_METADATA {
        return Err(TusError::InvalidMetadata);
    }
    let mut keys = std::collections::HashSet::new();
    for pair in value.split(',') {
        let mut parts = pair.trim().split(' ');
        let key = parts.next().unwrap_or_default();
        if key.is_empty() || !keys.insert(key) {
            return Err(TusError::InvalidMetadata);
        }
        if let Some(encoded) = parts.next() {
            base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .map_err(|_| TusError::InvalidMetadata)?;
        }
        if parts.next().is_some() {
            return Err(TusError::InvalidMetadata);
        }
    }
    Ok(Some(value.to_string()))
}

/// `Upload-Checksum: <algorithm> <base64 digest>` of one PATCH.
pub fn parse_checksum(value: Option<&str>) -> Result<Option<BodyDigest>, TusError> {
    let Some(value) = value else { return Ok(None) };
    let (algorithm, encoded) = value
        .trim()
        .split_once(' ')
        .ok_or(TusError::InvalidChecksum)?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .map_err(|_| TusError::InvalidChecksum)?;
    match algorithm.to_ascii_lowercase().as_str() {
        "sha1" => bytes
            .try_into()
            .map(|d| Some(BodyDigest::Sha1(d)))
            .map_err(|_| TusError::InvalidChecksum),
        "sha256" => bytes
            .try_into()
            .map(|d| Some(BodyDigest::Sha256(d)))
            .map_err(|_| TusError::InvalidChecksum),
        _ => Err(TusError::InvalidChecksum),
    }
}

/// The id of an upload: `<tenant>.<session>`, the session key it routes by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UploadId(pub SessionKey);

impl UploadId {
    pub fn key(&self) -> SessionKey {
        self.0
    }
}

impl fmt::Display for UploadId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.0.tenant, self.0.session)
    }
}

/// A malformed upload id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an upload id")]
pub struct BadUploadId;

impl FromStr for UploadId {
    type Err = BadUploadId;
    fn from_str(text: &str) -> Result<Self, BadUploadId> {
        let (tenant, session) = text.split_once('.').ok_or(BadUploadId)?;
        let tenant: TenantId = tenant.parse().map_err(|_| BadUploadId)?;
        let session: SessionId = session.parse().map_err(|_| BadUploadId)?;
        Ok(Self(SessionKey { tenant, session }))
    }
}

/// `Upload-Expires` (an RFC 9110 HTTP date) of a unix-ms instant.
pub fn http_date(unix_ms: u64) -> String {
    httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_millis(unix_ms))
}

/// Now, in unix ms.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_version_1_0_0_is_resumable() {
        assert_eq!(check_resumable(Some("1.0.0")), Ok(()));
        assert_eq!(check_resumable(Some(" 1.0.0 ")), Ok(()));
        for bad in [
            None,
            Some(""),
            Some("0.2.2"),
            Some("1.0"),
            Some("1.0.0,0.2.2"),
        ] {
            assert_eq!(check_resumable(bad), Err(TusError::UnsupportedVersion));
        }
    }

    #[test]
    fn lengths_and_offsets_are_plain_decimals() {
        assert_eq!(parse_length(Some("0"), None), Ok(0));
        assert_eq!(parse_length(Some("12345"), None), Ok(12345));
        assert_eq!(parse_length(None, Some("1")), Err(TusError::DeferLength));
        for bad in [
            "",
            "-1",
            "+1",
            "1.5",
            "0x10",
            "99999999999999999999999",
            "1 2",
        ] {
            assert_eq!(parse_length(Some(bad), None), Err(TusError::InvalidLength));
            assert_eq!(parse_offset(Some(bad)), Err(TusError::InvalidOffset));
        }
        assert_eq!(parse_offset(None), Err(TusError::InvalidOffset));
        assert_eq!(parse_offset(Some("7")), Ok(7));
    }

    #[test]
    fn metadata_is_validated_not_decoded() {
        assert_eq!(parse_metadata(None), Ok(None));
        assert_eq!(
            parse_metadata(Some("filename d29ybGQ=,is_confidential")),
            Ok(Some("filename d29ybGQ=,is_confidential".into()))
        );
        for bad in [
            "a !!!",
            "a YQ==,a YQ==",
            ",",
            "a YQ== x",
            &"k ".repeat(3000),
        ] {
            assert_eq!(
                parse_metadata(Some(bad)),
                Err(TusError::InvalidMetadata),
                "{bad}"
            );
        }
    }

    #[test]
    fn checksums_name_sha1_or_sha256() {
        use sha2::Digest;
        let b64 = |d: &[u8]| base64::engine::general_purpose::STANDARD.encode(d);
        let s1: [u8; 20] = sha1::Sha1::digest(b"x").into();
        let s256: [u8; 32] = sha2::Sha256::digest(b"x").into();
        assert_eq!(
            parse_checksum(Some(&format!("sha1 {}", b64(&s1)))),
            Ok(Some(BodyDigest::Sha1(s1)))
        );
        assert_eq!(
            parse_checksum(Some(&format!("SHA256 {}", b64(&s256)))),
            Ok(Some(BodyDigest::Sha256(s256)))
        );
        assert_eq!(parse_checksum(None), Ok(None));
        for bad in [
            "md5 AAAA".to_string(),
            "sha1".into(),
            format!("sha1 {}", b64(&s256)),
            "sha256 not-base64!".into(),
        ] {
            assert_eq!(parse_checksum(Some(&bad)), Err(TusError::InvalidChecksum));
        }
    }

    #[test]
    fn upload_ids_round_trip_and_refuse_garbage() {
        let key = SessionKey {
            tenant: "6f1c1a8e-5d0b-4c8e-9f55-3f2a8f0e7a11".parse().unwrap(),
            session: "0b8e2f3a-1c4d-4e5f-8a9b-0c1d2e3f4a5b".parse().unwrap(),
        };
        let id = UploadId(key);
        assert_eq!(id.to_string().parse::<UploadId>(), Ok(id));
        for bad in [
            "",
            "x.y",
            "6f1c1a8e-5d0b-4c8e-9f55-3f2a8f0e7a11",
            "a.b.c",
            "../etc",
        ] {
            assert_eq!(bad.parse::<UploadId>(), Err(BadUploadId));
        }
    }

    #[test]
    fn expiry_dates_are_http_dates() {
        assert_eq!(http_date(0), "Thu, 01 Jan 1970 00:00:00 GMT");
    }
}
