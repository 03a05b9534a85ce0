//! Block and blob keys.
//!
//! A block key is the BLAKE3 hash of the block's bytes, written as 64 lowercase hex
//! digits. A blob key is `blake3:<64 hex>:<size>`: the BLAKE3 hash of the entire content
//! and its length in bytes (decimal, no leading zeros). The blob key does not depend on
//! the chunking parameters, so any BLAKE3 tool (`b3sum`) can compute it independently.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Why a key did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("a block key is 64 lowercase hexadecimal digits")]
    BadBlockKey,
    #[error("a blob key looks like blake3:<64 lowercase hex digits>:<size in bytes>")]
    BadBlobKey,
}

/// BLAKE3 hash of one stored block.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub [u8; 32]);

impl BlockKey {
    pub fn of(data: &[u8]) -> Self {
        Self(*blake3::hash(data).as_bytes())
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

fn parse_lower_hex32(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(text, &mut out).ok()?;
    Some(out)
}

impl FromStr for BlockKey {
    type Err = KeyError;
    fn from_str(text: &str) -> Result<Self, KeyError> {
        parse_lower_hex32(text)
            .map(Self)
            .ok_or(KeyError::BadBlockKey)
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({})", &self.to_hex()[..16])
    }
}

impl Serialize for BlockKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for BlockKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The name of a blob: BLAKE3 of the whole content and its size.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlobKey {
    pub hash: [u8; 32],
    pub size: u64,
}

impl BlobKey {
    pub const PREFIX: &'static str = "blake3:";

    /// Key of an in-memory byte string (tests and tools).
    pub fn of(data: &[u8]) -> Self {
        Self {
            hash: *blake3::hash(data).as_bytes(),
            size: data.len() as u64,
        }
    }

    pub fn hash_hex(&self) -> String {
        hex::encode(self.hash)
    }

    /// Strong HTTP entity tag: the quoted content hash.
    pub fn etag(&self) -> String {
        format!("\"{}\"", self.hash_hex())
    }
}

impl FromStr for BlobKey {
    type Err = KeyError;
    fn from_str(text: &str) -> Result<Self, KeyError> {
        let rest = text
            .strip_prefix(Self::PREFIX)
            .ok_or(KeyError::BadBlobKey)?;
        let (hash_hex, size_text) = rest.split_once(':').ok_or(KeyError::BadBlobKey)?;
        let hash = parse_lower_hex32(hash_hex).ok_or(KeyError::BadBlobKey)?;
        let canonical_number = !size_text.is_empty()
            && size_text.bytes().all(|b| b.is_ascii_digit())
            && (size_text == "0" || !size_text.starts_with('0'));
        if !canonical_number {
            return Err(KeyError::BadBlobKey);
        }
        let size = size_text.parse().map_err(|_| KeyError::BadBlobKey)?;
        Ok(Self { hash, size })
    }
}

impl fmt::Display for BlobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}:{}", Self::PREFIX, self.hash_hex(), self.size)
    }
}

impl fmt::Debug for BlobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlobKey({self})")
    }
}

impl Serialize for BlobKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for BlobKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn blob_key_golden_vector() {
        // BLAKE3("abc") from the BLAKE3 reference test vectors.
        let key = BlobKey::of(b"abc");
        assert_eq!(
            key.to_string(),
            "blake3:6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85:3"
        );
        assert_eq!(key.to_string().parse::<BlobKey>().unwrap(), key);
    }

    #[test]
    fn malformed_blob_keys_are_rejected() {
        let hex = "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85";
        for text in [
            String::new(),
            format!("sha256:{hex}:3"),
            format!("blake3:{hex}"),
            format!("blake3:{hex}:"),
            format!("blake3:{hex}:03"),
            format!("blake3:{hex}:-3"),
            format!("blake3:{hex}:3x"),
            format!("blake3:{}:3", hex.to_uppercase()),
            format!("blake3:{}:3", &hex[1..]),
            format!("blake3:{hex}:99999999999999999999999"),
        ] {
            assert_eq!(
                text.parse::<BlobKey>(),
                Err(KeyError::BadBlobKey),
                "{text:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn blob_keys_round_trip(hash in any::<[u8; 32]>(), size in any::<u64>()) {
            let key = BlobKey { hash, size };
            prop_assert_eq!(key.to_string().parse::<BlobKey>().unwrap(), key);
        }

        #[test]
        fn block_keys_round_trip(hash in any::<[u8; 32]>()) {
            let key = BlockKey(hash);
            prop_assert_eq!(key.to_string().parse::<BlockKey>().unwrap(), key);
        }
    }
}
