//! The manifest store contract.

use super::StoreFuture;
use crate::cas::{BlobKey, Manifest};

/// Whether `create` stored a new manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreateOutcome {
    Created,
    /// A manifest for this key existed already (same content uploaded before).
    AlreadyExists,
}

/// Stores manifests by blob key. A manifest becomes visible atomically and is never
/// rewritten: the first writer wins and later writers get `AlreadyExists`.
pub trait ManifestStore: Send + Sync + 'static {
    fn create(&self, manifest: &Manifest) -> StoreFuture<'_, CreateOutcome>;

    /// The manifest, validated, or `None` if the blob does not exist.
    fn get(&self, key: BlobKey) -> StoreFuture<'_, Option<Manifest>>;
}
