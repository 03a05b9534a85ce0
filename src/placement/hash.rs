//! The shard of an upload session: a stable, documented hash.
//!
//! `shard = u64_le(BLAKE3(DOMAIN || tenant[16] || session[16])[0..8]) mod shard_count`
//! where `DOMAIN` is the 24 ASCII bytes `graviton/session-shard/1` and the UUIDs are their
//! 16 raw bytes in RFC 9562 order. The encoding is fixed length, so no separator is needed.
//! Changing any of this moves every session: the golden vectors in the tests pin it.

use crate::ids::SessionKey;
use crate::placement::model::ShardId;

/// Domain separation prefix of the shard hash (version 1).
pub const SHARD_HASH_DOMAIN: &[u8] = b"graviton/session-shard/1";

/// The 64-bit hash of a session key, before the modulo.
pub fn session_hash(key: &SessionKey) -> u64 {
    let mut hasher = blake3::Hasher::new();
    hasher.update(SHARD_HASH_DOMAIN);
    hasher.update(key.tenant.as_bytes());
    hasher.update(key.session.as_bytes());
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// The shard owning `key` in a cluster of `shard_count` shards (`shard_count >= 1`).
pub fn shard_of(key: &SessionKey, shard_count: u32) -> ShardId {
    assert!(shard_count > 0, "shard_count must be positive");
    ShardId((session_hash(key) % u64::from(shard_count)) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tenant: &str, session: &str) -> SessionKey {
        SessionKey {
            tenant: tenant.parse().unwrap(),
            session: session.parse().unwrap(),
        }
    }

    /// Golden vectors: these values must never change (they decide every session's owner).
    #[test]
    fn golden_vectors() {
        let cases = [
            (
                "0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f",
                "6ba7b810-9dad-11d1-80b4-00c04fd430c8",
                GOLDEN[0],
            ),
            (
                "00000000-0000-0000-0000-000000000001",
                "00000000-0000-0000-0000-000000000002",
                GOLDEN[1],
            ),
            (
                "ffffffff-ffff-4fff-bfff-ffffffffffff",
                "01890a5d-ac96-774b-bcce-b302099a8057",
                GOLDEN[2],
            ),
        ];
        for (tenant, session, (hash, s1024, s64)) in cases {
            let k = key(tenant, session);
            assert_eq!(session_hash(&k), hash, "{tenant} {session}");
            assert_eq!(shard_of(&k, 1024), ShardId(s1024));
            assert_eq!(shard_of(&k, 64), ShardId(s64));
        }
    }

    const GOLDEN: [(u64, u32, u32); 3] = [
        (9416458093517794350, 46, 46),
        (6701843893654877212, 28, 28),
        (1468001776951260589, 429, 45),
    ];

    /// The encoding spelled out byte by byte, so the documentation and code cannot drift.
    #[test]
    fn encoding_is_domain_then_raw_uuid_bytes() {
        let k = key(
            "00000000-0000-0000-0000-000000000001",
            "00000000-0000-0000-0000-000000000002",
        );
        let mut input = b"graviton/session-shard/1".to_vec();
        input.extend_from_slice(&[0; 15]);
        input.push(1);
        input.extend_from_slice(&[0; 15]);
        input.push(2);
        let digest = blake3::hash(&input);
        let expected = u64::from_le_bytes(digest.as_bytes()[..8].try_into().unwrap());
        assert_eq!(session_hash(&k), expected);
    }

    #[test]
    fn tenant_and_session_are_not_interchangeable() {
        let a = key(
            "00000000-0000-0000-0000-000000000001",
            "00000000-0000-0000-0000-000000000002",
        );
        let b = key(
            "00000000-0000-0000-0000-000000000002",
            "00000000-0000-0000-0000-000000000001",
        );
        assert_ne!(session_hash(&a), session_hash(&b));
    }

    #[test]
    fn sessions_spread_over_shards() {
        let mut counts = vec![0u32; 16];
        for _ in 0..16_000 {
            let k = SessionKey {
                tenant: crate::ids::TenantId::new_random(),
                session: crate::ids::SessionId::new_random(),
            };
            counts[shard_of(&k, 16).0 as usize] += 1;
        }
        // Expected 1000 each; a fair hash stays well within +-25%.
        assert!(
            counts.iter().all(|&c| (750..1250).contains(&c)),
            "{counts:?}"
        );
    }
}
