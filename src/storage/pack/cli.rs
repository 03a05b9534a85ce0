//! `graviton gc`, `graviton verify` and `graviton migrate-blocks` on an opened pack store,
//! with a progress bar on a terminal. Which store and which manifests a command works on
//! is decided once, by `node::assemble` (the commands themselves are in `crate::cli`).
//! In embedded mode the node must be stopped (the index is opened by one process; a
//! running node collects on its own schedule, `storage.gc.interval`). In cluster mode on
//! S3, `graviton gc` runs the cluster collector and `graviton verify` checks the shared
//! index and bucket, both beside the running nodes, and `graviton migrate-blocks` moves a
//! shared mount's `blocks/` into the bucket.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::gc::{self, GcOptions, GcReport, Progress, VerifyReport};
use crate::storage::ManifestStore;
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

/// `graviton gc [--dry-run] [--purge]`: collect against `manifests` (which must count the
/// blocks of live resumable uploads: `LiveUploads`).
pub async fn run_gc(
    store: &PackStore,
    manifests: &dyn ManifestStore,
    options: GcOptions,
) -> anyhow::Result<GcReport> {
    let mut bar = Bar::new();
    Ok(gc::collect(store, manifests, options, &mut bar).await?)
}

/// `graviton gc --restore`: every quarantined block of a single node back in the index.
pub fn run_restore(store: &PackStore) -> anyhow::Result<GcReport> {
    let restored = store.index()?.restore_quarantine()?;
    eprintln!("restored {restored} quarantined blocks");
    Ok(GcReport::default())
}

/// `graviton verify`: a node's own data directory, or in cluster mode on S3 the shared
/// index and bucket (it changes no pack and no row, so it may run beside the nodes).
pub async fn run_verify(store: &PackStore) -> anyhow::Result<VerifyReport> {
    let mut bar = Bar::new();
    Ok(gc::verify(store, &mut bar).await?)
}

/// `graviton migrate-blocks`: the `blocks/` directory under `storage.data_dir` into packs
/// of the node's store, or in cluster mode on S3 into the shared bucket and index (point
/// `data_dir` at the old shared mount for the run, with the cluster stopped).
pub async fn run_migrate(store: &PackStore) -> anyhow::Result<u64> {
    let mut bar = Bar::new();
    Ok(gc::migrate_blocks(store, &mut bar).await?)
}
