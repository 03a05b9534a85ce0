//! Build the block store a configuration asks for (one node: packs with a redb index;
//! a cluster: packs in S3 with the PostgreSQL index, or the declared shared mount).

use std::sync::Arc;

use super::config::Backend;
use super::fs::FsBlockStore;
use super::pack::medium::Medium;
use super::pack::s3::S3Medium;
use super::pack::shared::PgIndex;
use super::pack::{PackOptions, PackStore};
use super::{BlockStore, StoreError};
use crate::config::{Config, StorageConfig};

/// The pack store of a single node (`fs` or `s3` backend).
pub async fn open_pack_store(storage: &StorageConfig) -> Result<PackStore, StoreError> {
    let options = pack_options(storage);
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
/// One node: the pack store with its redb index. Cluster mode:
/// - `backend = "s3"` (the default): packs in the cluster's bucket, indexed in the
///   cluster's PostgreSQL (`cluster.database_url`, `sql/0008_pack_index.sql`), so every
///   node reads and deduplicates every block and one collector runs under an advisory
///   lock (see `pack::shared`, `pack::cluster_gc`);
/// - `backend = "fs"` only with `storage.shared_mount = true`, which declares `data_dir`
///   one mount shared by every node: the file-per-block layout, as before (no collector);
///   without it a node-local directory is refused.
pub async fn open_blocks(
    config: &Config,
) -> Result<(Arc<dyn BlockStore>, Option<PackStore>), StoreError> {
    let storage = &config.storage;
    if !config.cluster.enabled {
        let packs = open_pack_store(storage).await?;
        return Ok((Arc::new(packs.clone()), Some(packs)));
    }
    match storage.backend_in(true) {
        Backend::Fs if storage.shared_mount => {
            tracing::warn!(
                "cluster blocks on a shared mount (storage.shared_mount = true): every node \
                 must mount the same data_dir; backend = \"s3\" needs no shared mount"
            );
            Ok((
                Arc::new(FsBlockStore::open(&storage.data_dir, storage.fsync)?),
                None,
            ))
        }
        Backend::Fs => Err(StoreError::Unavailable(
            "cluster mode refuses a node-local block store; use backend = \"s3\" (packs in \
             a shared bucket, index in PostgreSQL), or set storage.shared_mount = true if \
             data_dir is one mount shared by every node"
                .into(),
        )),
        Backend::S3 => {
            let packs = open_shared_pack_store(config).await?;
            Ok((Arc::new(packs.clone()), Some(packs)))
        }
    }
}

/// The pack store of a cluster node: the S3 medium and the shared PostgreSQL index.
pub async fn open_shared_pack_store(config: &Config) -> Result<PackStore, StoreError> {
    let storage = &config.storage;
    let url = config.cluster.database_url.as_ref().ok_or_else(|| {
        StoreError::Unavailable(
            "the shared block index needs cluster.database_url (PostgreSQL)".into(),
        )
    })?;
    // A pool of its own: data-path queries never wait behind placement or heartbeats.
    let pool = crate::storage::pg::connect_pool(
        url.expose(),
        config.cluster.pool_max_connections,
        config.cluster.statement_timeout.get(),
        &format!("graviton-blocks:{}", config.node.id.as_str()),
    )
    .await
    .map_err(|e| StoreError::Unavailable(format!("connect the shared block index: {e}")))?;
    crate::storage::pg::migrate(&pool)
        .await
        .map_err(|e| StoreError::Unavailable(format!("migrate the shared block index: {e}")))?;
    let medium = S3Medium::new(&storage.s3, None)?;
    let conditional = medium.probe().await?;
    tracing::info!(
        medium = %medium.describe(),
        conditional_create = conditional,
        "S3 pack medium ready; block index shared in PostgreSQL"
    );
    PackStore::open_shared(
        &storage.data_dir,
        Arc::new(medium),
        pack_options(storage),
        PgIndex::new(pool),
    )
}

fn pack_options(storage: &StorageConfig) -> PackOptions {
    PackOptions {
        pack_size: storage.pack_size.bytes(),
        fsync: storage.fsync,
        trace: None,
    }
}
