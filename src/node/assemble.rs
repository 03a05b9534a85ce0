//! Assemble once: the one place that reads the mode (embedded or cluster) and the store
//! paths out of the configuration, and opens the stores every command works on.
//!
//! [`Stores::open`] is used by `graviton serve` ([`super::start_with`]) and by the offline
//! commands `gc`, `verify` and `migrate-blocks` (`crate::cli`), so a command never
//! decides again where blocks, manifests or the resumable-upload ledger live:
//!
//! | store | embedded | cluster |
//! |---|---|---|
//! | blocks | packs under `storage.data_dir` (redb index), or in S3 | packs in S3 with the PostgreSQL index; or the file-per-block layout on a declared shared mount |
//! | manifests | `storage.data_dir/manifests` | PostgreSQL |
//! | upload ledger | `storage.data_dir/uploads.redb` ([`LEDGER_FILE`]) | PostgreSQL |
//!
//! Order of work: the block store first (a second process on a data directory is refused
//! there, with the message that says to stop the node), then the cluster's database, then
//! the manifests and the ledger, then one sync of the data directory's names (STO-24).

use std::path::PathBuf;
use std::sync::Arc;

use sqlx::PgPool;

use super::{NodeOptions, StartError};
use crate::config::{Config, StorageConfig};
use crate::ids::NodeId;
use crate::storage::config::Backend;
use crate::storage::fs::{FsBlockStore, FsManifestStore};
use crate::storage::pack::medium::Medium;
use crate::storage::pack::s3::S3Medium;
use crate::storage::pack::shared::PgIndex;
use crate::storage::pack::{PackOptions, PackStore};
use crate::storage::pg::PgManifestStore;
use crate::storage::{BlockStore, ManifestStore, StoreError};
use crate::upload::ledger::{LiveUploads, PgLedger, RedbLedger, UploadLedger};

/// The embedded resumable-upload ledger, under `storage.data_dir`.
pub const LEDGER_FILE: &str = "uploads.redb";

/// Where a node keeps its state: the one decision between the two modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `cluster.enabled = false`: every store under `storage.data_dir` (blocks may be in S3).
    Embedded,
    /// `cluster.enabled = true`: placement, manifests and the ledger in PostgreSQL.
    Cluster,
}

impl Mode {
    pub fn of(config: &Config) -> Self {
        if config.cluster.enabled {
            Mode::Cluster
        } else {
            Mode::Embedded
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::Embedded => "embedded",
            Mode::Cluster => "cluster",
        }
    }
}

/// The stores of one node (or of one offline command on its data).
pub struct Stores {
    pub mode: Mode,
    pub blocks: Arc<dyn BlockStore>,
    /// The pack store behind `blocks`: none for the shared mount's file-per-block layout
    /// or a store a test injected.
    pub packs: Option<PackStore>,
    pub manifests: Arc<dyn ManifestStore>,
    pub ledger: Arc<dyn UploadLedger>,
    /// Cluster mode: the node's PostgreSQL pool (placement, manifests, ledger, probe).
    pub database: Option<PgPool>,
}

impl Stores {
    /// Open every store `config` names; `options` replaces some (tests inject stores).
    pub async fn open(
        config: &Config,
        node: &NodeId,
        options: NodeOptions,
    ) -> Result<Stores, StartError> {
        let mode = Mode::of(config);
        let data_dir = &config.storage.data_dir;
        let storage_err = |source| StartError::Storage {
            path: data_dir.display().to_string(),
            source,
        };
        let (blocks, packs): (Arc<dyn BlockStore>, _) = match options.blocks {
            Some(blocks) => (blocks, None),
            None => open_blocks(config, mode).await.map_err(storage_err)?,
        };
        let database = match mode {
            Mode::Embedded => None,
            Mode::Cluster => Some(connect_database(config, node).await?),
        };
        let manifests: Arc<dyn ManifestStore> = match (options.manifests, &database) {
            (Some(manifests), _) => manifests,
            // Cluster nodes share manifests through PostgreSQL so any node serves any blob.
            (None, Some(pool)) => Arc::new(PgManifestStore::new(pool.clone())),
            (None, None) => Arc::new(
                FsManifestStore::open(data_dir, config.storage.fsync).map_err(storage_err)?,
            ),
        };
        // The resumable-upload ledger lives beside the manifests, so a new owner finds it.
        let ledger: Arc<dyn UploadLedger> = match (options.ledger, &database) {
            (Some(ledger), _) => ledger,
            (None, Some(pool)) => Arc::new(PgLedger::new(pool.clone())),
            (None, None) => {
                Arc::new(RedbLedger::open(&ledger_path(&config.storage)).map_err(storage_err)?)
            }
        };
        // Every store has created its directories and files: make their names durable
        // before the first upload can be acknowledged (STO-24).
        if config.storage.fsync && data_dir.is_dir() {
            crate::storage::pack::medium::sync_data_dir(data_dir).map_err(storage_err)?;
        }
        Ok(Stores {
            mode,
            blocks,
            packs,
            manifests,
            ledger,
            database,
        })
    }

    /// The manifests as the collector sees them: the blocks of live resumable uploads
    /// count as referenced (docs/resumable.md).
    pub fn gc_manifests(&self) -> LiveUploads {
        LiveUploads {
            manifests: self.manifests.clone(),
            ledger: self.ledger.clone(),
        }
    }
}

/// The embedded ledger's file.
fn ledger_path(storage: &StorageConfig) -> PathBuf {
    storage.data_dir.join(LEDGER_FILE)
}

/// The cluster's database (placement, manifests, ledger), migrated.
async fn connect_database(config: &Config, node: &NodeId) -> Result<PgPool, StartError> {
    let pool = crate::actors::connect(&config.cluster, node)
        .await
        .map_err(|e| StartError::Cluster(e.to_string()))?;
    crate::storage::pg::migrate(&pool)
        .await
        .map_err(|e| StartError::Cluster(e.to_string()))?;
    Ok(pool)
}

/// The pack store of a single node (`fs` or `s3` backend).
async fn open_pack_store(storage: &StorageConfig) -> Result<PackStore, StoreError> {
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
async fn open_blocks(
    config: &Config,
    mode: Mode,
) -> Result<(Arc<dyn BlockStore>, Option<PackStore>), StoreError> {
    let storage = &config.storage;
    if mode == Mode::Embedded {
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
async fn open_shared_pack_store(config: &Config) -> Result<PackStore, StoreError> {
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
