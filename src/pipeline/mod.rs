//! The two streams of one blob over the store traits, with memory bounded whatever the
//! blob's size:
//!
//! - [`ingest`]: body -> chunks (`cas::chunker`, `cas::pdf`) -> blocks (`BlockStore`) ->
//!   manifest (`ManifestStore`, committed under the `CommitFence`).
//! - [`read`]: the streaming, verifying download of a blob or a range of it.
//!
//! Above both `cas` (the pure rules: keys, chunking, manifests, ranges) and `storage` (the
//! adapters): `cas` imports no store, and `storage` imports no pipeline. The callers are
//! `upload` (uploads), `http` and `grpc` (downloads); `admission::footprint` sizes a
//! transfer's reservation from [`ingest::memory_bound`] and [`read::memory_bound`].

pub mod ingest;
pub mod read;
