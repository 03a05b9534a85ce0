//! Redis adapters. [`coordinator`] runs the admission script (`lua/admission.lua`) for
//! cluster leases, quotas and decision events; [`batcher`] coalesces one node's
//! concurrent acquires and releases into one script call; [`keys`] names the keys of a cell.

pub mod batcher;
pub mod coordinator;
pub mod keys;

pub use coordinator::{ClusterLease, LeaseRequest, RedisCoordinator};
pub use keys::CellKeys;
