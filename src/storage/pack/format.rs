//! The pack file format (pure encoding and decoding, no I/O).
//!
//! ```text
//! pack      = record* directory trailer
//! record    = "GVB1" len:u32le hash:[u8;32] data:[u8;len]        (RECORD_HEADER = 40 bytes)
//! directory = entry*                      entry = hash:[u8;32] offset:u64le len:u32le
//! trailer   = count:u32le "GVPK"                                  (TRAILER = 8 bytes)
//! ```
//! `offset` is where a block's data starts (after its record header). Every block carries
//! its own header, so a forward scan rebuilds a pack's contents even without its
//! directory; the directory at the end lets one tail read list a pack.
//!
//! A pack is named by the BLAKE3 of its directory and trailer. The directory holds every
//! block's BLAKE3 hash, offset and length, and the record headers and the layout are a
//! function of the directory, so two packs with one name hold identical bytes (this
//! avoids hashing every byte a third time; see docs/storage.md).

use crate::cas::BlockKey;

pub const BLOCK_MAGIC: &[u8; 4] = b"GVB1";
pub const PACK_MAGIC: &[u8; 4] = b"GVPK";
pub const RECORD_HEADER: u64 = 40;
pub const ENTRY: usize = 44;
pub const TRAILER: usize = 8;

/// Where one block lives inside its pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub key: BlockKey,
    /// Offset of the block's data (its record header is just before it).
    pub offset: u64,
    pub len: u32,
}

/// A pack's name: BLAKE3 of its directory and trailer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PackId(pub [u8; 32]);

impl PackId {
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    pub fn from_hex(text: &str) -> Option<Self> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(text, &mut out).ok()?;
        Some(Self(out))
    }

    /// A pack id from its 32 raw bytes (`None` for any other length).
    pub fn try_from_slice(raw: &[u8]) -> Option<Self> {
        raw.try_into().ok().map(Self)
    }
}

impl std::fmt::Display for PackId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// The record header written before a block's data.
pub fn record_header(key: &BlockKey, len: u32) -> [u8; RECORD_HEADER as usize] {
    let mut out = [0u8; RECORD_HEADER as usize];
    out[..4].copy_from_slice(BLOCK_MAGIC);
    out[4..8].copy_from_slice(&len.to_le_bytes());
    out[8..].copy_from_slice(&key.0);
    out
}

/// The directory and trailer that end a pack, and the pack's name.
pub fn footer(entries: &[Entry]) -> (Vec<u8>, PackId) {
    let mut out = Vec::with_capacity(entries.len() * ENTRY + TRAILER);
    for entry in entries {
        out.extend_from_slice(&entry.key.0);
        out.extend_from_slice(&entry.offset.to_le_bytes());
        out.extend_from_slice(&entry.len.to_le_bytes());
    }
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(PACK_MAGIC);
    let id = PackId(*blake3::hash(&out).as_bytes());
    (out, id)
}

/// Why pack bytes do not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("pack is shorter than its trailer")]
    TooShort,
    #[error("pack trailer has no magic")]
    BadMagic,
    #[error("pack directory does not fit in the pack")]
    BadDirectory,
    #[error("pack directory names another pack")]
    WrongName,
    #[error("block record {0} is damaged")]
    BadRecord(usize),
}

/// Length of the footer (directory + trailer) given the pack's last `TRAILER` bytes.
pub fn footer_len(trailer: &[u8]) -> Result<u64, FormatError> {
    if trailer.len() < TRAILER {
        return Err(FormatError::TooShort);
    }
    let tail = &trailer[trailer.len() - TRAILER..];
    if &tail[4..] != PACK_MAGIC {
        return Err(FormatError::BadMagic);
    }
    let count = u32::from_le_bytes(tail[..4].try_into().expect("4 bytes")) as u64;
    Ok(count * ENTRY as u64 + TRAILER as u64)
}

/// Parse a footer (directory + trailer) of a pack `pack_len` bytes long.
pub fn parse_footer(footer: &[u8], pack_len: u64) -> Result<Vec<Entry>, FormatError> {
    let expected = footer_len(footer)?;
    if footer.len() as u64 != expected || expected > pack_len {
        return Err(FormatError::BadDirectory);
    }
    let data_end = pack_len - expected;
    let mut entries = Vec::with_capacity(footer.len() / ENTRY);
    for raw in footer[..footer.len() - TRAILER].chunks_exact(ENTRY) {
        let entry = Entry {
            key: BlockKey(raw[..32].try_into().expect("32 bytes")),
            offset: u64::from_le_bytes(raw[32..40].try_into().expect("8 bytes")),
            len: u32::from_le_bytes(raw[40..44].try_into().expect("4 bytes")),
        };
        if entry.offset < RECORD_HEADER || entry.offset + u64::from(entry.len) > data_end {
            return Err(FormatError::BadDirectory);
        }
        entries.push(entry);
    }
    Ok(entries)
}

/// Check a whole pack: name, directory, every record header and every block hash.
pub fn verify_pack(bytes: &[u8], id: &PackId) -> Result<Vec<Entry>, FormatError> {
    let footer_len = footer_len(bytes)? as usize;
    if footer_len > bytes.len() {
        return Err(FormatError::BadDirectory);
    }
    let footer = &bytes[bytes.len() - footer_len..];
    if blake3::hash(footer).as_bytes() != &id.0 {
        return Err(FormatError::WrongName);
    }
    let entries = parse_footer(footer, bytes.len() as u64)?;
    for (n, entry) in entries.iter().enumerate() {
        let start = (entry.offset - RECORD_HEADER) as usize;
        let end = entry.offset as usize + entry.len as usize;
        let header = &bytes[start..entry.offset as usize];
        if header != record_header(&entry.key, entry.len)
            || BlockKey::of(&bytes[entry.offset as usize..end]) != entry.key
        {
            return Err(FormatError::BadRecord(n));
        }
    }
    Ok(entries)
}

/// Encode a whole pack in memory (compaction, tests).
pub fn encode(blocks: &[(BlockKey, &[u8])]) -> (Vec<u8>, Vec<Entry>, PackId) {
    let mut out = Vec::new();
    let mut entries = Vec::with_capacity(blocks.len());
    for (key, data) in blocks {
        out.extend_from_slice(&record_header(key, data.len() as u32));
        entries.push(Entry {
            key: *key,
            offset: out.len() as u64,
            len: data.len() as u32,
        });
        out.extend_from_slice(data);
    }
    let (footer, id) = footer(&entries);
    out.extend_from_slice(&footer);
    (out, entries, id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn blocks(sizes: &[usize]) -> Vec<Vec<u8>> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|b| (b * 31 + i * 7) as u8).collect())
            .collect()
    }

    proptest! {
        #[test]
        fn encoded_packs_verify_and_list_their_blocks(sizes in proptest::collection::vec(0usize..5000, 0..20)) {
            let data = blocks(&sizes);
            let input: Vec<(BlockKey, &[u8])> = data.iter().map(|d| (BlockKey::of(d), d.as_slice())).collect();
            let (bytes, entries, id) = encode(&input);
            prop_assert_eq!(verify_pack(&bytes, &id).unwrap(), entries.clone());
            for (entry, block) in entries.iter().zip(&data) {
                prop_assert_eq!(&bytes[entry.offset as usize..entry.offset as usize + entry.len as usize], block.as_slice());
            }
            let flen = footer_len(&bytes).unwrap() as usize;
            prop_assert_eq!(parse_footer(&bytes[bytes.len() - flen..], bytes.len() as u64).unwrap(), entries);
        }
    }

    #[test]
    fn damage_is_detected() {
        let data = blocks(&[1000, 2000, 3000]);
        let input: Vec<(BlockKey, &[u8])> = data
            .iter()
            .map(|d| (BlockKey::of(d), d.as_slice()))
            .collect();
        let (bytes, _, id) = encode(&input);
        let mut flipped = bytes.clone();
        flipped[1500] ^= 1;
        assert_eq!(verify_pack(&flipped, &id), Err(FormatError::BadRecord(1)));
        let truncated = &bytes[..bytes.len() - 3];
        assert!(verify_pack(truncated, &id).is_err());
        assert_eq!(
            verify_pack(&bytes, &PackId([0; 32])),
            Err(FormatError::WrongName)
        );
        // the same blocks give the same name; other blocks another
        assert_eq!(encode(&input).2, id);
        assert_ne!(encode(&input[..2]).2, id);
    }
}
