//! ractor actors: thin message handlers over pure logic. Bytes never travel through
//! actor mailboxes.
//!
//! Placement actors (this branch): [`placement`], [`health`], [`manager_election`],
//! [`shard_manager`].

pub mod health;
pub mod manager_election;
pub mod placement;
pub mod shard_manager;
