//! Manifests: the ordered list of blocks that make a blob.
//!
//! A manifest is stored once per blob key and never rewritten. Its JSON form
//! (`format = 1`) is the persisted format of the filesystem manifest store; see
//! `docs/architecture.md`.

use serde::{Deserialize, Serialize};

use super::chunker::{AVG_CHUNK, MAX_CHUNK, MIN_CHUNK};
use super::keys::{BlobKey, BlockKey};

/// Current manifest format version.
pub const MANIFEST_FORMAT: u32 = 1;

/// One block of a blob, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRef {
    pub key: BlockKey,
    pub size: u32,
}

/// The chunking that produced the blocks (informational; reads do not depend on it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkingInfo {
    pub algorithm: String,
    pub min: u32,
    pub avg: u32,
    pub max: u32,
}

impl ChunkingInfo {
    pub fn current() -> Self {
        Self {
            algorithm: "fastcdc-2020-v5.0.0".to_string(),
            min: MIN_CHUNK as u32,
            avg: AVG_CHUNK as u32,
            max: MAX_CHUNK as u32,
        }
    }
}

/// A blob's manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub key: BlobKey,
    pub chunking: ChunkingInfo,
    pub blocks: Vec<BlockRef>,
    /// Unix milliseconds when this manifest was first written.
    pub created_at_ms: u64,
}

/// A manifest that contradicts itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("unsupported manifest format {0}")]
    UnsupportedFormat(u32),
    #[error("block sizes add up to {sum} bytes but the blob key says {size}")]
    SizeMismatch { sum: u64, size: u64 },
    #[error("block {index} is empty")]
    EmptyBlock { index: usize },
}

impl Manifest {
    pub fn new(key: BlobKey, blocks: Vec<BlockRef>, created_at_ms: u64) -> Self {
        Self {
            format: MANIFEST_FORMAT,
            key,
            chunking: ChunkingInfo::current(),
            blocks,
            created_at_ms,
        }
    }

    pub fn size(&self) -> u64 {
        self.key.size
    }

    /// Check the invariants a reader relies on.
    pub fn validate(&self) -> Result<(), ManifestError> {
        if self.format != MANIFEST_FORMAT {
            return Err(ManifestError::UnsupportedFormat(self.format));
        }
        if let Some(index) = self.blocks.iter().position(|b| b.size == 0) {
            return Err(ManifestError::EmptyBlock { index });
        }
        let sum: u64 = self.blocks.iter().map(|b| u64::from(b.size)).sum();
        if sum != self.key.size {
            return Err(ManifestError::SizeMismatch {
                sum,
                size: self.key.size,
            });
        }
        Ok(())
    }

    /// Start offset of every block, plus the total size as the last element.
    pub fn offsets(&self) -> Vec<u64> {
        let mut offsets = Vec::with_capacity(self.blocks.len() + 1);
        let mut at = 0u64;
        offsets.push(0);
        for block in &self.blocks {
            at += u64::from(block.size);
            offsets.push(at);
        }
        offsets
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest_of(parts: &[&[u8]]) -> Manifest {
        let whole: Vec<u8> = parts.concat();
        let blocks = parts
            .iter()
            .map(|p| BlockRef {
                key: BlockKey::of(p),
                size: p.len() as u32,
            })
            .collect();
        Manifest::new(BlobKey::of(&whole), blocks, 0)
    }

    #[test]
    fn consistent_manifest_validates_and_round_trips_json() {
        let manifest = manifest_of(&[b"abc", b"defg"]);
        manifest.validate().unwrap();
        assert_eq!(manifest.offsets(), vec![0, 3, 7]);
        let json = serde_json::to_string(&manifest).unwrap();
        let back: Manifest = serde_json::from_str(&json).unwrap();
        assert_eq!(back, manifest);
    }

    #[test]
    fn inconsistent_manifests_are_rejected() {
        let mut manifest = manifest_of(&[b"abc"]);
        manifest.key.size = 4;
        assert_eq!(
            manifest.validate(),
            Err(ManifestError::SizeMismatch { sum: 3, size: 4 })
        );
        let mut manifest = manifest_of(&[b"abc"]);
        manifest.format = 9;
        assert_eq!(
            manifest.validate(),
            Err(ManifestError::UnsupportedFormat(9))
        );
    }
}
