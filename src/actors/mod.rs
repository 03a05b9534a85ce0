//! ractor actors: thin shells that own state and I/O and call into pure modules.
//!
//! - [`supervisor`]: `NodeSupervisor`, the root of a node's tree; restarts children with
//!   backoff and never stops because a child exited.
//! - [`session_region`]: `SessionRegion`, which spawns one `SessionOwner` per active
//!   session of the locally owned shards, bounded by `sessions.max_hot`.
//! - [`session_owner`]: `SessionOwner`, the bounded hot state of one session.
//! - [`placement`], [`health`], [`manager_election`], [`shard_manager`]: cluster
//!   placement (local shard table, readiness, the advisory-lock election and the
//!   term-fenced shard manager); see docs/locality.md.
//! - [`cluster`]: the placement runtime (`Cluster`, `ClusterHandle`, the standalone
//!   manager), which starts the placement actors and opens their PostgreSQL store.
//! - [`restart`]: the one restart routine both supervisors use (which events mean a
//!   child is gone, and the backoff before it starts again).
//! - [`handle`]: typed handles (`SessionRegionHandle`, `IngestTicket`) that callers use
//!   instead of message enums.
//!
//! Upload bytes never travel through these mailboxes (they are unbounded): only
//! control messages and counters do.

pub mod cluster;
pub mod handle;
pub mod health;
pub mod manager_election;
pub mod placement;
pub mod placement_supervisor;
pub mod restart;
pub mod session_owner;
pub mod session_region;
pub mod shard_manager;
pub mod supervisor;

pub use cluster::{
    Cluster, ClusterError, ClusterHandle, PlacementChild, StandaloneManager, connect,
    run_standalone_manager,
};
pub use handle::{IngestTicket, SessionRegionHandle};
pub use supervisor::{NodeSupervisor, SupervisorHandle};

#[cfg(test)]
mod tests;
