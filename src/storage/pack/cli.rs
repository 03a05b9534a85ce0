//! `graviton gc`, `graviton verify` and `graviton migrate-blocks`: offline commands on a
//! node's data directory (the node must be stopped: the index is opened by one process;
//! a running node collects on its own schedule, `storage.gc.interval`).

use std::io::IsTerminal;
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::gc::{self, GcOptions, GcReport, Progress, VerifyReport};
use crate::config::Config;
use crate::storage::ManifestStore;
use crate::storage::fs::FsManifestStore;
use crate::storage::open::open_pack_store;

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
            "cluster nodes keep blocks in the shared file-per-block layout; the pack \
             collector runs on single nodes only in this version"
        );
    }
    Ok(())
}

async fn manifests(config: &Config) -> anyhow::Result<Arc<dyn ManifestStore>> {
    Ok(Arc::new(FsManifestStore::open(
        &config.storage.data_dir,
        config.storage.fsync,
    )?))
}

/// `graviton gc [--dry-run] [--purge] [--restore]`.
pub async fn run_gc(
    config: &Config,
    dry_run: bool,
    purge: bool,
    restore: bool,
) -> anyhow::Result<GcReport> {
    refuse_cluster(config)?;
    let store = open_pack_store(&config.storage).await?;
    if restore {
        let restored = store.index().restore_quarantine()?;
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

/// `graviton verify`.
pub async fn run_verify(config: &Config) -> anyhow::Result<VerifyReport> {
    refuse_cluster(config)?;
    let store = open_pack_store(&config.storage).await?;
    let mut bar = Bar::new();
    Ok(gc::verify(&store, &mut bar).await?)
}

/// `graviton migrate-blocks`.
pub async fn run_migrate(config: &Config) -> anyhow::Result<u64> {
    refuse_cluster(config)?;
    let store = open_pack_store(&config.storage).await?;
    let mut bar = Bar::new();
    Ok(gc::migrate_blocks(&store, &mut bar).await?)
}
