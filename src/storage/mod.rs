//! Storage adapters. They translate between domain types and a medium and hold no policy.
//!
//! - [`block`]: the [`BlockStore`] trait (write sessions: append, commit, abort; get).
//! - [`manifest`]: the [`ManifestStore`] trait (create once, get, delete, scan).
//! - [`pack`]: the pack-based block store (default), its redb index, local and S3
//!   media, the collector, `verify` and the migration from the legacy layout.
//! - [`fs`]: the filesystem manifest store and the legacy file-per-block store.
//! - [`pg`]: PostgreSQL: the placement store (nodes, shard assignments, manager term) and
//!   the manifest store shared by every node of a cluster.
//! - [`redis`]: the admission coordinator (cluster leases, quotas, decision events).
//!
//! The traits return boxed futures so they can be used as `Arc<dyn ...>` and implemented
//! by network stores (PostgreSQL manifests, S3 blocks) without touching the callers.

pub mod block;
pub mod config;
pub mod fs;
pub mod manifest;
pub mod pack;
pub mod pg;
pub mod redis;

pub use block::{BlockStore, CommitReport, PutOutcome, WriteSession};
pub use manifest::{CreateOutcome, ManifestStore};

/// A storage failure. Messages name the operation, never secrets.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Corrupt(String),
    #[error("storage unavailable: {0}")]
    Unavailable(String),
    /// Another process holds a lock this operation needs (the cluster collector's).
    #[error("busy: {0}")]
    Busy(String),
    /// A fenced commit was refused: the shard moved away from this node.
    #[error("commit fenced: shard {shard} is no longer owned by this node at epoch {epoch}")]
    Fenced { shard: u32, epoch: i64 },
}

impl StoreError {
    pub fn io(op: &'static str, source: std::io::Error) -> Self {
        Self::Io { op, source }
    }
}

/// The future type returned by store methods.
pub type StoreFuture<'a, T> = futures_util::future::BoxFuture<'a, Result<T, StoreError>>;
