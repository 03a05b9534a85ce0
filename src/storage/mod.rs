//! I/O adapters that hold no policy.
//!
//! - [`pg`]: PostgreSQL: the placement store (nodes, shard assignments, manager term).

pub mod pg;
