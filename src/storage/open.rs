//! Build the block store a configuration asks for.

use std::sync::Arc;

use super::config::Backend;
use super::fs::FsBlockStore;
use super::pack::medium::Medium;
use super::pack::s3::S3Medium;
use super::pack::{PackOptions, PackStore};
use super::{BlockStore, StoreError};
use crate::config::StorageConfig;

/// The pack store of a single node (`fs` or `s3` backend).
pub async fn open_pack_store(storage: &StorageConfig) -> Result<PackStore, StoreError> {
    let options = PackOptions {
        pack_size: storage.pack_size.bytes(),
        fsync: storage.fsync,
        trace: None,
    };
    match storage.backend_in(false) {
        Backend::Fs => PackStore::open_local(&storage.data_dir, options),
        Backend::S3 => {
            let medium = S3Medium::new(&storage.s3, None)?;
            let conditional = medium.probe().await?;
            tracing::info!(
                medium = %medium.describe(),
                conditional_create = conditional,
                "S3 pack medium ready"
            );
            PackStore::open(&storage.data_dir, Arc::new(medium), options)
        }
    }
}

/// The block store of a node.
///
/// One node: the pack store. Cluster mode: every node must see every block, and the pack
/// index is still per node (redb), so a cluster keeps the file-per-block layout on the
/// operator-declared shared mount (`storage.shared_mount = true`); a cluster on S3 needs
/// the shared (PostgreSQL) pack index, which is not built yet, and is refused.
pub async fn open_blocks(
    storage: &StorageConfig,
    cluster: bool,
) -> Result<(Arc<dyn BlockStore>, Option<PackStore>), StoreError> {
    if !cluster {
        let packs = open_pack_store(storage).await?;
        return Ok((Arc::new(packs.clone()), Some(packs)));
    }
    match storage.backend_in(true) {
        Backend::Fs if storage.shared_mount => Ok((
            Arc::new(FsBlockStore::open(&storage.data_dir, storage.fsync)?),
            None,
        )),
        Backend::Fs => Err(StoreError::Unavailable(
            "cluster mode refuses a node-local block store; set storage.shared_mount = true \
             if data_dir is one mount shared by every node"
                .into(),
        )),
        Backend::S3 => Err(StoreError::Unavailable(
            "cluster mode on S3 needs the shared pack index, which this version does not \
             have yet; use backend = \"fs\" with storage.shared_mount = true"
                .into(),
        )),
    }
}
