//! Command-line operations that act on a cluster's PostgreSQL database directly (no
//! running node needed): `graviton migrate`, `graviton cluster status`, `graviton drain`.

use std::time::Duration;

use serde::Serialize;

use crate::ids::NodeId;
use crate::placement::{ClusterError, NodeSummary, ShardEntry};
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
        nodes: crate::placement::runtime::summarize(&table),
        unassigned_shards: table.shards.len() - table.assigned(),
        moving_shards: table.moving(),
        shards: table.shards,
    })
}
