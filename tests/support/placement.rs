//! Placement helpers of the `placement_*` integration tests: nodes on one real
//! PostgreSQL database with fast timings, and table predicates to poll for.

use std::time::Duration;

use graviton::actors::{Cluster, ClusterHandle};
use graviton::ids::{NodeId, SessionId, SessionKey, TenantId};
use graviton::placement::ClusterConfig;
use graviton::storage::pg::PlacementStore;

/// Fast test timings (heartbeat 100ms, self-fence 400ms, TTL 1s, poll 250ms, 64 shards).
pub fn config(url: &str, node: &str) -> ClusterConfig {
    let mut config = ClusterConfig::fast_for_tests(url);
    config.internal_addr = internal_addr(node);
    config.public_addr = format!("{node}.public:7070");
    config.control_addr = control_addr(node);
    config
}

/// The internal address a test node registers: loopback, a port derived from its name
/// (nothing listens there; placement tests only route).
pub fn internal_addr(node: &str) -> String {
    format!("127.0.0.1:{}", port_of(node))
}

/// The control address a test node registers (the port after its internal one).
pub fn control_addr(node: &str) -> String {
    format!("127.0.0.1:{}", port_of(node) + 1)
}

fn port_of(node: &str) -> u16 {
    20_000 + blake3::hash(node.as_bytes()).as_bytes()[0] as u16 * 64
}

/// Start a node named `name` with the default fast config adjusted by `tweak`.
pub async fn start_node(
    url: &str,
    name: &str,
    tweak: impl FnOnce(&mut ClusterConfig),
) -> ClusterHandle {
    let mut config = config(url, name);
    tweak(&mut config);
    Cluster::connect_and_start(NodeId::parse(name).unwrap(), &config, "test")
        .await
        .unwrap_or_else(|e| panic!("start {name}: {e}"))
}

/// A store on its own small pool (for assertions straight from PostgreSQL).
pub async fn store(url: &str) -> PlacementStore {
    let pool = graviton::storage::pg::connect_pool(url, 4, Duration::from_secs(5), "graviton-test")
        .await
        .expect("pool");
    graviton::storage::pg::migrate(&pool)
        .await
        .expect("migrate");
    PlacementStore::new(pool)
}

pub fn random_key() -> SessionKey {
    SessionKey {
        tenant: TenantId::new_random(),
        session: SessionId::new_random(),
    }
}

#[allow(unused_imports)]
pub use super::eventually;

/// Every handle sees every shard assigned, no move pending, and the same owners; each
/// of `owners` holds `shard_count / owners.len()` shards, within one.
pub fn settled(handles: &[&ClusterHandle], owners: &[&str]) -> bool {
    let tables: Vec<_> = handles.iter().map(|h| h.view().table()).collect();
    let first = &tables[0];
    if first.shards.is_empty() || first.assigned() != first.shards.len() || first.moving() > 0 {
        return false;
    }
    if tables.iter().any(|t| t.shards != first.shards) {
        return false;
    }
    let counts: Vec<usize> = owners
        .iter()
        .map(|o| first.owned_by(&NodeId::parse(*o).unwrap()))
        .collect();
    let total: usize = counts.iter().sum();
    let min = counts.iter().min().copied().unwrap_or(0);
    let max = counts.iter().max().copied().unwrap_or(0);
    total == first.shards.len() && max - min <= 1
}

pub fn owned(handle: &ClusterHandle, node: &str) -> usize {
    handle
        .view()
        .table()
        .owned_by(&NodeId::parse(node).unwrap())
}
