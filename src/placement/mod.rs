//! Placement: which node owns an upload session, and the machinery that keeps that answer
//! single-valued across a cluster.
//!
//! # Pure parts (no I/O)
//! - [`hash`]: the shard of a `(tenant, session)` (BLAKE3, documented, golden vectors).
//! - [`model`]: shards, epochs, node states, the shard table.
//! - [`rebalance`]: the deterministic least-loaded planner with a global move budget.
//! - [`handoff`]: who may ingest, when to acknowledge a revocation, when a move completes.
//! - [`health`]: the readiness state machine.
//! - [`view`]: the node-local table snapshot, owner resolution and ingest permits.
//! - [`routing`]: the routing port: where an upload goes ([`Route`]), the owner-side epoch
//!   verdict of a forwarded upload, and which of the ownership checks binds (the commit).
//! - [`snapshot`]: the operator snapshot and the node summaries.
//! - [`config`]: the `[cluster]` section.
//!
//! This module imports no actor and no store. The runtime is in `crate::actors`:
//! `actors::cluster` (`Cluster::start_under`, the `ClusterHandle` request handlers read,
//! re-resolution after a stale epoch, the standalone manager) and the actors
//! `actors::{placement, health, manager_election, shard_manager}`; PostgreSQL I/O in
//! `crate::storage::pg::placement`; the CLI's database commands in `crate::cli`.
//!
//! # API for the HTTP layer
//! ```text
//! // serve (cluster mode):
//! let cluster = Cluster::connect_and_start(node_id, &config.cluster, version).await?;
//! // serve (embedded single node): every shard local, no PostgreSQL, same API.
//! let cluster = Cluster::single_node(node_id, shard_count);
//! match cluster.route(&key)? {
//!     Route::Local(route) => {
//!         let permit = cluster.begin_ingest(route.shard, route.epoch).ok_or(NotOwner)?;
//!         // ingest; abort when permit.revoked() resolves; commit with the CommitFence.
//!     }
//!     Route::Remote(target) => { /* forward to target.internal_addr with its epoch */ }
//! }
//! cluster.check_forwarded(&key, shard, epoch);  // owner side of a forwarded upload
//! cluster.health();                             // /readyz
//! cluster.snapshot();                           // /v1/ops/cluster
//! cluster.drain(&node).await?;                  // admin drain / SIGTERM
//! cluster.shutdown().await;
//! actors::run_standalone_manager(node, &cfg).await?;  // graviton manager (fails closed)
//! ```
//!
//! # Failure model
//! PostgreSQL is the source of truth. A node that cannot read it keeps routing with its last
//! table (readiness turns `unavailable`); a node that cannot heartbeat fences itself; the
//! manager acts only while it holds the advisory lock and every write is term-fenced.

pub mod config;
pub mod handoff;
pub mod hash;
pub mod health;
pub mod model;
pub mod rebalance;
pub mod view;

pub mod routing;
pub mod snapshot;

pub use config::ClusterConfig;
pub use health::{HealthSnapshot, HealthStatus};
pub use model::{Epoch, NodeInfo, NodeState, ShardEntry, ShardId, ShardTable, Term};
pub use routing::{EpochVerdict, LocalRoute, OwnerTarget, Route, RouteError, StaleEpoch};
pub use snapshot::{DrainEnd, NodeSummary, PlacementSnapshot};
pub use view::{CounterSnapshot, IngestPermit, LocalView, Owner, ResolveError};
