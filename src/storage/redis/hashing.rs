//! Keyed hashing of tenant and backend ids for Redis keys and events.
//!
//! With a cell secret (the Redis password of the cell) ids are hashed with HMAC-SHA-256, so
//! somebody holding a list of tenant UUIDs cannot confirm which appear in Redis. Without a
//! secret plain SHA-256 is used. Either way the output is 64 lowercase hex digits, and a
//! domain prefix (`tenant\0`, `backend\0`) keeps the two id spaces apart.
//!
//! Derivation (so an external controller can compute it), with `uuid` the canonical
//! lowercase hyphenated text of the tenant id and `secret` the UTF-8 bytes of
//! `admission.redis.id_secret`:
//!
//! - keyed: `hex(HMAC-SHA-256(key = secret, message = "tenant" 0x00 uuid))`;
//! - without a secret: `hex(SHA-256("tenant" 0x00 uuid))`;
//! - backends: the same with `"backend" 0x00 label`.
//!
//! The golden vectors in the tests were computed with Python's `hashlib`/`hmac`.

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

use crate::ids::TenantId;

/// Hashes ids for one cell. `Debug` never shows the key.
#[derive(Clone)]
pub struct IdHasher {
    key: Option<Vec<u8>>,
}

impl std::fmt::Debug for IdHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdHasher")
            .field("keyed", &self.key.is_some())
            .finish()
    }
}

impl IdHasher {
    /// `secret`: the cell secret, or `None` for plain SHA-256.
    pub fn new(secret: Option<&str>) -> Self {
        Self {
            key: secret
                .filter(|s| !s.is_empty())
                .map(|s| s.as_bytes().to_vec()),
        }
    }

    pub fn is_keyed(&self) -> bool {
        self.key.is_some()
    }

    pub fn tenant(&self, tenant: &TenantId) -> String {
        self.digest(b"tenant\0", tenant.to_string().as_bytes())
    }

    pub fn backend(&self, backend: &str) -> String {
        self.digest(b"backend\0", backend.as_bytes())
    }

    fn digest(&self, domain: &[u8], value: &[u8]) -> String {
        match &self.key {
            Some(key) => {
                let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(key)
                    .expect("HMAC accepts any key length");
                mac.update(domain);
                mac.update(value);
                hex::encode(mac.finalize().into_bytes())
            }
            None => {
                let mut hasher = Sha256::new();
                hasher.update(domain);
                hasher.update(value);
                hex::encode(hasher.finalize())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TENANT: &str = "0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f";

    #[test]
    fn hashes_are_hex_stable_and_keyed() {
        let tenant: TenantId = TENANT.parse().unwrap();
        let plain = IdHasher::new(None);
        let keyed = IdHasher::new(Some("cell-secret"));
        let other = IdHasher::new(Some("other-secret"));
        let h = plain.tenant(&tenant);
        assert_eq!(h.len(), 64);
        assert!(
            h.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_eq!(h, plain.tenant(&tenant));
        assert_ne!(keyed.tenant(&tenant), h);
        assert_ne!(keyed.tenant(&tenant), other.tenant(&tenant));
        assert!(!h.contains("0b4e7a1c"));
        // Domain separation: the same text as tenant and backend hashes differently.
        assert_ne!(plain.backend(TENANT), h);
        // Golden vector: SHA-256("backend\0fs").
        let mut sha = Sha256::new();
        sha.update(b"backend\0fs");
        assert_eq!(plain.backend("fs"), hex::encode(sha.finalize()));
        assert!(!format!("{keyed:?}").contains("cell-secret"));
    }

    #[test]
    fn documented_derivation_golden_vectors() {
        // Python: hashlib.sha256(b"tenant\0" + uuid).hexdigest() and
        // hmac.new(secret, b"tenant\0" + uuid, hashlib.sha256).hexdigest().
        let tenant: TenantId = TENANT.parse().unwrap();
        assert_eq!(
            IdHasher::new(None).tenant(&tenant),
            "20a17671496373f8eda7cc81482b19254d19618c8919596eec427ed1209d9f30"
        );
        assert_eq!(
            IdHasher::new(Some("cell-secret-0123456789")).tenant(&tenant),
            "aa900862f366d46b770ba89ead66d33317d2dfd541b6015d7a775791cf996d5f"
        );
        assert_eq!(
            IdHasher::new(None).backend("fs"),
            "ae9065e1585f5aaabffe1300c63506364e5f1e4421c4cc8218629276bdb3d251"
        );
    }
}
