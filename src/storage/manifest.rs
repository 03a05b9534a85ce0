//! The manifest store contract.

use super::{StoreError, StoreFuture};
use crate::cas::{BlobKey, BlockKey, Manifest};
use crate::ids::NodeId;
use crate::placement::model::{Epoch, ShardId};

/// The condition a session upload's commit is fenced by: `node` still owns `shard` at
/// `epoch` and has not acknowledged its revocation (LOC-1). A node that lost the shard
/// (paused past its TTL, a stale table, a commit stuck behind a lock) cannot commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitFence {
    pub shard: ShardId,
    pub node: NodeId,
    pub epoch: Epoch,
}

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

    /// [`Self::create`], but only while `fence` holds, checked atomically with the insert
    /// ([`StoreError::Fenced`] otherwise). Stores shared by the nodes of a cluster must
    /// implement it (PostgreSQL does, in the same transaction as the insert). A store of
    /// one embedded node, which owns every shard forever, ignores the fence.
    fn create_fenced<'a>(
        &'a self,
        manifest: &'a Manifest,
        fence: Option<&'a CommitFence>,
    ) -> StoreFuture<'a, CreateOutcome> {
        let _ = fence;
        self.create(manifest)
    }

    /// The PostgreSQL pool this store writes to, when it is one (a block index in the
    /// same database then commits index entries and the manifest in one transaction).
    fn database(&self) -> Option<&sqlx::PgPool> {
        None
    }

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
