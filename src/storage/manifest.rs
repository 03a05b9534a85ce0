//! The manifest store contract.

use super::{StoreError, StoreFuture};
use crate::cas::{BlobKey, BlockKey, Manifest};

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

    /// Remove a manifest (its blocks stay until the collector finds them unreferenced).
    /// `Ok(false)` if there was none.
    fn delete(&self, key: BlobKey) -> StoreFuture<'_, bool> {
        let _ = key;
        Box::pin(async {
            Err(StoreError::Unavailable(
                "this manifest store cannot delete".into(),
            ))
        })
    }

    /// Call `visit` with every block key of every manifest (the collector's mark phase).
    fn for_each_block<'a>(
        &'a self,
        visit: &'a mut (dyn FnMut(BlockKey) + Send),
    ) -> StoreFuture<'a, ()> {
        let _ = visit;
        Box::pin(async {
            Err(StoreError::Unavailable(
                "this manifest store cannot be scanned".into(),
            ))
        })
    }
}
