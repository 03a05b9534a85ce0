//! Client-declared content digests: what a client says the SHA-256 of its upload is, so
//! the server can refuse to commit anything else (end-to-end integrity).
//!
//! Two spellings are accepted, both parsed here (pure):
//! - `Content-Digest: sha-256=:<base64>:` (RFC 9530; a dictionary, other algorithms
//!   are ignored, at least one `sha-256` member is required);
//! - `X-Content-Hash: <64 hex digits>` or `sha256:<64 hex digits>` (compatibility).
//!
//! When both are sent they must agree. The ingest pipeline hashes the body with SHA-256
//! only when a digest was declared, and compares before the manifest commits.

use base64::Engine;

/// A declared SHA-256 of a whole upload body.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ContentDigest(pub [u8; 32]);

impl std::fmt::Debug for ContentDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sha-256:{}", hex(&self.0))
    }
}

/// A digest a client declared for a body: a whole upload's SHA-256 (`Content-Digest`), or
/// one tus PATCH's `Upload-Checksum` (SHA-1 or SHA-256). The pipeline computes only the
/// declared one and compares before anything commits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BodyDigest {
    Sha256([u8; 32]),
    Sha1([u8; 20]),
}

impl From<ContentDigest> for BodyDigest {
    fn from(digest: ContentDigest) -> Self {
        BodyDigest::Sha256(digest.0)
    }
}

/// A running hash of the declared algorithm.
pub(crate) enum BodyHasher {
    Sha256(sha2::Sha256),
    Sha1(sha1::Sha1),
}

impl BodyHasher {
    pub(crate) fn for_digest(digest: &BodyDigest) -> Self {
        use sha2::Digest;
        match digest {
            BodyDigest::Sha256(_) => BodyHasher::Sha256(sha2::Sha256::new()),
            BodyDigest::Sha1(_) => BodyHasher::Sha1(sha1::Sha1::new()),
        }
    }

    pub(crate) fn update(&mut self, data: &[u8]) {
        use sha2::Digest;
        match self {
            BodyHasher::Sha256(h) => h.update(data),
            BodyHasher::Sha1(h) => h.update(data),
        }
    }

    /// Does the hash of everything fed equal `expected`?
    pub(crate) fn matches(self, expected: &BodyDigest) -> bool {
        use sha2::Digest;
        match (self, expected) {
            (BodyHasher::Sha256(h), BodyDigest::Sha256(e)) => <[u8; 32]>::from(h.finalize()) == *e,
            (BodyHasher::Sha1(h), BodyDigest::Sha1(e)) => <[u8; 20]>::from(h.finalize()) == *e,
            _ => false,
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Why a declared digest was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DigestError {
    #[error("Content-Digest is malformed (expected sha-256=:<base64 of 32 bytes>:)")]
    MalformedContentDigest,
    #[error("Content-Digest names no sha-256 digest; only sha-256 is supported")]
    UnsupportedAlgorithm,
    #[error("X-Content-Hash is malformed (expected 64 hex digits, optionally prefixed sha256:)")]
    MalformedContentHash,
    #[error("Content-Digest and X-Content-Hash disagree")]
    Conflicting,
}

/// Parse an RFC 9530 `Content-Digest` value and return its `sha-256` member.
pub fn parse_content_digest(value: &str) -> Result<ContentDigest, DigestError> {
    let mut found = None;
    for member in value.split(',') {
        let (name, rest) = member
            .trim()
            .split_once('=')
            .ok_or(DigestError::MalformedContentDigest)?;
        if !name.trim().eq_ignore_ascii_case("sha-256") {
            continue;
        }
        let encoded = rest
            .trim()
            .strip_prefix(':')
            .and_then(|r| r.strip_suffix(':'))
            .ok_or(DigestError::MalformedContentDigest)?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map_err(|_| DigestError::MalformedContentDigest)?;
        let digest: [u8; 32] = bytes
            .try_into()
            .map_err(|_| DigestError::MalformedContentDigest)?;
        if found.is_some_and(|f| f != digest) {
            return Err(DigestError::MalformedContentDigest);
        }
        found = Some(digest);
    }
    found
        .map(ContentDigest)
        .ok_or(DigestError::UnsupportedAlgorithm)
}

/// Parse an `X-Content-Hash` value: 64 hex digits, optionally prefixed `sha256:`.
pub fn parse_content_hash(value: &str) -> Result<ContentDigest, DigestError> {
    let text = value.trim();
    let text = text.strip_prefix("sha256:").unwrap_or(text);
    if text.len() != 64 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(DigestError::MalformedContentHash);
    }
    let mut out = [0u8; 32];
    for (i, pair) in text.as_bytes().chunks(2).enumerate() {
        let pair = std::str::from_utf8(pair).map_err(|_| DigestError::MalformedContentHash)?;
        out[i] = u8::from_str_radix(pair, 16).map_err(|_| DigestError::MalformedContentHash)?;
    }
    Ok(ContentDigest(out))
}

/// The declared digest from both spellings (either may be absent; both must agree).
pub fn declared(
    content_digest: Option<&str>,
    content_hash: Option<&str>,
) -> Result<Option<ContentDigest>, DigestError> {
    let a = content_digest.map(parse_content_digest).transpose()?;
    let b = content_hash.map(parse_content_hash).transpose()?;
    match (a, b) {
        (Some(a), Some(b)) if a != b => Err(DigestError::Conflicting),
        (a, b) => Ok(a.or(b)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn sha(data: &[u8]) -> [u8; 32] {
        Sha256::digest(data).into()
    }

    #[test]
    fn both_spellings_parse_to_the_same_digest() {
        let digest = sha(b"hello");
        let b64 = base64::engine::general_purpose::STANDARD.encode(digest);
        let from_rfc = parse_content_digest(&format!("sha-512=:AAAA:, sha-256=:{b64}:")).unwrap();
        let from_hex = parse_content_hash(&format!("sha256:{}", hex(&digest))).unwrap();
        assert_eq!(from_rfc, ContentDigest(digest));
        assert_eq!(from_hex, ContentDigest(digest));
        assert_eq!(
            declared(Some(&format!("sha-256=:{b64}:")), Some(&hex(&digest))).unwrap(),
            Some(ContentDigest(digest))
        );
    }

    #[test]
    fn malformed_unsupported_and_conflicting_digests_are_refused() {
        assert_eq!(
            parse_content_digest("sha-512=:AAAA:"),
            Err(DigestError::UnsupportedAlgorithm)
        );
        for bad in [
            "sha-256=AAAA",
            "sha-256=:not base64:",
            "sha-256=:AAAA:",
            "garbage",
        ] {
            assert!(parse_content_digest(bad).is_err(), "{bad}");
        }
        for bad in ["abc", &"g".repeat(64), &"a".repeat(63)] {
            assert_eq!(
                parse_content_hash(bad),
                Err(DigestError::MalformedContentHash)
            );
        }
        let one = hex(&sha(b"a"));
        let b64 = base64::engine::general_purpose::STANDARD.encode(sha(b"b"));
        assert_eq!(
            declared(Some(&format!("sha-256=:{b64}:")), Some(&one)),
            Err(DigestError::Conflicting)
        );
    }
}
