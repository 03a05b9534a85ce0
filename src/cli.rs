//! Command-line operations that need no running node: on a cluster's PostgreSQL
//! database (`graviton migrate`, `graviton cluster status`, `graviton drain`), and on a
//! node's stores (`graviton gc`, `graviton verify`, `graviton migrate-blocks`: the stores
//! from [`Stores::open`], the work in `storage::pack::cli`).

use std::time::Duration;

use serde::Serialize;

use crate::actors::ClusterError;
use crate::config::Config;
use crate::ids::NodeId;
use crate::node::NodeOptions;
use crate::node::assemble::{Mode, Stores};
use crate::placement::{NodeSummary, ShardEntry};
use crate::storage::pack::PackStore;
use crate::storage::pack::cli as pack_cli;
use crate::storage::pack::gc::{GcOptions, GcReport, VerifyReport};
use crate::storage::pg::placement::{ClusterMeta, PlacementStore};
use crate::storage::pg::{self as pg};

/// What `graviton cluster status` prints.
#[derive(Clone, Debug, Serialize)]
pub struct ClusterStatus {
    pub shard_count: u32,
    pub manager_term: crate::placement::Term,
    pub manager_node: Option<String>,
    pub nodes: Vec<NodeSummary>,
    pub unassigned_shards: usize,
    pub moving_shards: usize,
    pub shards: Vec<ShardEntry>,
}

/// `graviton migrate`: apply the placement migrations.
pub async fn migrate(url: &str) -> Result<(), ClusterError> {
    let pool = pg::connect_pool(url, 2, Duration::from_secs(30), "graviton-cli").await?;
    pg::migrate(&pool).await?;
    pool.close().await;
    Ok(())
}

/// How often `graviton drain --wait` reads the shard table.
pub const DRAIN_POLL: Duration = Duration::from_millis(50);

/// What `graviton drain` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainOutcome {
    /// No such node, or it is dead: nothing was requested.
    UnknownNode,
    /// The drain was requested; the caller did not wait.
    Requested,
    /// `--wait`: the node owns no shard and none is moving to it.
    Drained,
    /// `--wait`: the timeout passed with `held` shards still owned by or moving to the node.
    TimedOut { held: usize },
}

/// `graviton drain NODE [--wait]`: ask the manager to move every shard off `node`; with
/// `wait`, read the shard table every [`DRAIN_POLL`] until the node holds none (owned
/// or moving to it) or the timeout passes. `progress` gets the number still held each
/// time it changes (the CLI prints it on a terminal).
pub async fn drain(
    url: &str,
    node: &NodeId,
    wait: Option<Duration>,
    mut progress: impl FnMut(usize),
) -> Result<DrainOutcome, ClusterError> {
    let pool = pg::connect_pool(url, 1, Duration::from_secs(10), "graviton-cli").await?;
    let store = PlacementStore::new(pool.clone());
    let outcome = if !store.request_drain(node).await? {
        DrainOutcome::UnknownNode
    } else if let Some(timeout) = wait {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = None;
        loop {
            let held = store.read_table().await?.held_by(node);
            if last != Some(held) {
                progress(held);
                last = Some(held);
            }
            if held == 0 {
                break DrainOutcome::Drained;
            }
            if tokio::time::Instant::now() + DRAIN_POLL > deadline {
                break DrainOutcome::TimedOut { held };
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
    } else {
        DrainOutcome::Requested
    };
    pool.close().await;
    Ok(outcome)
}

/// `graviton cluster status`: meta, nodes and shard rows, straight from PostgreSQL.
pub async fn cluster_status(url: &str) -> Result<ClusterStatus, ClusterError> {
    let pool = pg::connect_pool(url, 2, Duration::from_secs(10), "graviton-cli").await?;
    let store = PlacementStore::new(pool.clone());
    let meta: ClusterMeta = store.meta().await?;
    let table = store.read_table().await?;
    pool.close().await;
    Ok(ClusterStatus {
        shard_count: meta.shard_count,
        manager_term: meta.manager_term,
        manager_node: meta.manager_node,
        nodes: crate::placement::snapshot::summarize(&table),
        unassigned_shards: table.shards.len() - table.assigned(),
        moving_shards: table.moving(),
        shards: table.shards,
    })
}

/// The stores of the node `config` describes, for an offline `command`: in cluster mode
/// only the shared pack store on S3 has packs to work on.
async fn offline_stores(config: &Config, command: &str) -> anyhow::Result<(Stores, PackStore)> {
    if Mode::of(config) == Mode::Cluster
        && config.storage.backend_in(true) != crate::storage::config::Backend::S3
    {
        anyhow::bail!(
            "{command} in cluster mode needs storage.backend = \"s3\" (the shared-mount \
             file-per-block layout has no packs)"
        );
    }
    let node = NodeId::parse(config.node.id.as_str())
        .map_err(|e| anyhow::anyhow!("node.id in the config: {e}"))?;
    let stores = Stores::open(config, &node, NodeOptions::default()).await?;
    let packs = stores
        .packs
        .clone()
        .ok_or_else(|| anyhow::anyhow!("{command}: the block store has no packs"))?;
    Ok((stores, packs))
}

/// `graviton gc [--dry-run] [--purge] [--restore]`. In cluster mode on S3: the shared
/// index and the PostgreSQL manifests; the cluster's advisory lock keeps it to one run
/// (running nodes may keep serving).
pub async fn run_gc(
    config: &Config,
    dry_run: bool,
    purge: bool,
    restore: bool,
) -> anyhow::Result<GcReport> {
    if restore && Mode::of(config) == Mode::Cluster {
        anyhow::bail!(
            "`graviton gc --restore` works on a single node's data directory; in a \
             cluster on S3 a quarantined block is stored again by the next upload of its \
             bytes"
        );
    }
    let (stores, packs) = offline_stores(config, "gc").await?;
    if restore {
        return pack_cli::run_restore(&packs);
    }
    let options = GcOptions::from_config(&config.storage.gc, dry_run, purge);
    pack_cli::run_gc(&packs, &stores.gc_manifests(), options).await
}

/// `graviton verify`: a node's own data directory, or in cluster mode on S3 the shared
/// index and bucket.
pub async fn run_verify(config: &Config) -> anyhow::Result<VerifyReport> {
    let (_stores, packs) = offline_stores(config, "verify").await?;
    pack_cli::run_verify(&packs).await
}

/// `graviton migrate-blocks`: the old file-per-block layout into packs.
pub async fn run_migrate_blocks(config: &Config) -> anyhow::Result<u64> {
    let (_stores, packs) = offline_stores(config, "migrate-blocks").await?;
    pack_cli::run_migrate(&packs).await
}
