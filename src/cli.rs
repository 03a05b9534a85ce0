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
    let pool = pg::connect_pool(url, 2, Duration::from_secs(30)).await?;
    pg::migrate(&pool).await?;
    pool.close().await;
    Ok(())
}

/// `graviton drain NODE`: ask the manager to move every shard off `node`. Returns false
/// for an unknown or dead node.
pub async fn request_drain(url: &str, node: &NodeId) -> Result<bool, ClusterError> {
    let pool = pg::connect_pool(url, 1, Duration::from_secs(10)).await?;
    let drained = PlacementStore::new(pool.clone())
        .request_drain(node)
        .await?;
    pool.close().await;
    Ok(drained)
}

/// `graviton cluster status`: meta, nodes and shard rows, straight from PostgreSQL.
pub async fn cluster_status(url: &str) -> Result<ClusterStatus, ClusterError> {
    let pool = pg::connect_pool(url, 2, Duration::from_secs(10)).await?;
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
