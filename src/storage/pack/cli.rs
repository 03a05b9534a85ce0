//! `graviton gc`, `graviton verify` and `graviton migrate-blocks`: offline commands on a
//! node's data directory (the node must be stopped: the index is opened by one process;
//! a running node collects on its own schedule, `storage.gc.interval`). In cluster mode
//! on S3, `graviton gc` runs the cluster collector and `graviton verify` checks the
//! shared index and bucket, both beside the running nodes, and `graviton migrate-blocks`
//! moves a shared mount's `blocks/` into the bucket.

use std::io::IsTerminal;
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::gc::{self, GcOptions, GcReport, Progress, VerifyReport};
use crate::config::Config;
use crate::storage::ManifestStore;
use crate::storage::fs::FsManifestStore;
use crate::storage::open::open_pack_store;
use crate::storage::pack::PackStore;

/// A progress bar on a terminal, nothing otherwise.
pub struct Bar(Option<ProgressBar>);

impl Bar {
    pub fn new() -> Self {
        Self(std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} {elapsed}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        }))
    }
}

impl Default for Bar {
    fn default() -> Self {
        Self::new()
    }
}

impl Progress for Bar {
    fn phase(&mut self, name: &'static str, total: u64) {
        if let Some(bar) = &self.0 {
            bar.set_message(name);
            bar.set_length(total);
            bar.set_position(0);
        }
    }
    fn advance(&mut self, n: u64) {
        if let Some(bar) = &self.0 {
            bar.inc(n);
        }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}

fn refuse_cluster(config: &Config) -> anyhow::Result<()> {
    if config.cluster.enabled {
        anyhow::bail!(
            "`graviton gc --restore` works on a single node's data directory; in a \
             cluster on S3 a quarantined block is stored again by the next upload of its \
             bytes"
        );
    }
    Ok(())
}

/// The cluster's shared store (S3 packs, PostgreSQL index) for `command`.
async fn cluster_store(config: &Config, command: &str) -> anyhow::Result<PackStore> {
    if config.storage.backend_in(true) != crate::storage::config::Backend::S3 {
        anyhow::bail!(
            "{command} in cluster mode needs storage.backend = \"s3\" (the shared-mount \
             file-per-block layout has no packs)"
        );
    }
    Ok(crate::storage::open::open_shared_pack_store(config).await?)
}

/// `graviton gc` against a cluster on S3: the shared index and the PostgreSQL manifests;
/// the cluster's advisory lock keeps it to one run (running nodes may keep serving).
async fn run_cluster_gc(config: &Config, dry_run: bool, purge: bool) -> anyhow::Result<GcReport> {
    let store = cluster_store(config, "gc").await?;
    let pool = store
        .shared()
        .map(|index| index.pool().clone())
        .ok_or_else(|| anyhow::anyhow!("the cluster store has no shared index"))?;
    // Blocks of live resumable uploads count as referenced (docs/resumable.md).
    let manifests = crate::upload::ledger::LiveUploads {
        manifests: Arc::new(crate::storage::pg::PgManifestStore::new(pool.clone())),
        ledger: Arc::new(crate::upload::ledger::PgLedger::new(pool)),
    };
    let mut bar = Bar::new();
    Ok(gc::collect(
        &store,
        &manifests,
        GcOptions::from_config(&config.storage.gc, dry_run, purge),
        &mut bar,
    )
    .await?)
}

/// The node's manifests with the blocks of its live resumable uploads marked too.
async fn manifests(config: &Config) -> anyhow::Result<Arc<dyn ManifestStore>> {
    let manifests: Arc<dyn ManifestStore> = Arc::new(FsManifestStore::open(
        &config.storage.data_dir,
        config.storage.fsync,
    )?);
    let ledger =
        crate::upload::ledger::RedbLedger::open(&config.storage.data_dir.join("uploads.redb"))?;
    Ok(Arc::new(crate::upload::ledger::LiveUploads {
        manifests,
        ledger: Arc::new(ledger),
    }))
}

/// `graviton gc [--dry-run] [--purge] [--restore]`.
pub async fn run_gc(
    config: &Config,
    dry_run: bool,
    purge: bool,
    restore: bool,
) -> anyhow::Result<GcReport> {
    if config.cluster.enabled && !restore {
        return run_cluster_gc(config, dry_run, purge).await;
    }
    refuse_cluster(config)?;
    let store = open_pack_store(&config.storage).await?;
    if restore {
        let restored = store.index()?.restore_quarantine()?;
        eprintln!("restored {restored} quarantined blocks");
        return Ok(GcReport::default());
    }
    let manifests = manifests(config).await?;
    let mut bar = Bar::new();
    Ok(gc::collect(
        &store,
        manifests.as_ref(),
        GcOptions::from_config(&config.storage.gc, dry_run, purge),
        &mut bar,
    )
    .await?)
}

/// `graviton verify`: a node's own data directory, or in cluster mode on S3 the shared
/// index and bucket (it changes no pack and no row, so it may run beside the nodes).
pub async fn run_verify(config: &Config) -> anyhow::Result<VerifyReport> {
    let store = if config.cluster.enabled {
        cluster_store(config, "verify").await?
    } else {
        open_pack_store(&config.storage).await?
    };
    let mut bar = Bar::new();
    Ok(gc::verify(&store, &mut bar).await?)
}

/// `graviton migrate-blocks`: the `blocks/` directory under `storage.data_dir` into packs
/// of the node's store, or in cluster mode on S3 into the shared bucket and index (point
/// `data_dir` at the old shared mount for the run, with the cluster stopped).
pub async fn run_migrate(config: &Config) -> anyhow::Result<u64> {
    let store = if config.cluster.enabled {
        cluster_store(config, "migrate-blocks").await?
    } else {
        open_pack_store(&config.storage).await?
    };
    let mut bar = Bar::new();
    Ok(gc::migrate_blocks(&store, &mut bar).await?)
}
