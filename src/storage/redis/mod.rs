//! Redis adapters for cluster admission: typed calls of one script, no policy.
//!
//! [`connection`] connects to one server or a Redis Cluster, plain or TLS;
//! [`script`] runs `lua/admission.lua` as a Redis Function (`FCALL`), loading it on demand;
//! [`coordinator`] runs the admission script for cluster leases,
//! quotas and decision events; [`batcher`] coalesces one node's concurrent acquires and
//! releases into one script call; [`keys`] names the keys of a cell; [`hashing`] turns
//! tenant and backend ids into the keyed hashes that appear in keys and events;
//! [`reply`] parses script replies into types (lease id, fencing token, occupancy);
//! [`error`] is the storage-level error. Waiting, back-off and the meaning of a reply for
//! a transfer belong to `admission`; this module imports neither `admission` nor `actors`.

pub mod batcher;
pub mod connection;
pub mod coordinator;
pub mod error;
pub mod hashing;
pub mod keys;
pub mod reply;
pub mod script;

pub use coordinator::{CoordinatorConfig, LeaseRequest, Limits, RedisCoordinator};
pub use error::CoordinatorError;
pub use keys::{CellKeys, QuotaKind};
pub use reply::{FencingToken, LeaseId};
