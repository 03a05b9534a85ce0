//! Graviton: the upload path of a content-addressed blob store, on one node or a cluster.
//!
//! # Layout
//! - [`values`]: the value types of configuration (human units, [`values::Secret`],
//!   [`values::Problem`]); a leaf that imports nothing from the crate.
//! - [`config`]: the TOML + environment configuration, defaults and validation; it
//!   assembles the sections' settings (each section defines its own, in `values` types).
//! - [`ids`]: tenant, session and node identifiers.
//! - [`cas`]: pure content addressing: chunking parameters (FastCDC, PDF-aware), block and
//!   blob keys, manifests, range planning. It imports no store.
//! - [`storage`]: I/O adapters that hold no policy: the block and manifest store traits and
//!   their filesystem, pack (`storage::pack`: local or S3) and PostgreSQL (`storage::pg`)
//!   implementations, the Redis admission coordinator.
//! - [`pipeline`]: the streaming ingest of one blob (chunks, blocks, the manifest under the
//!   commit fence) and its verifying read, over the store traits.
//! - [`backoff`]: the one jittered exponential back-off, and the supervisors' restart helper.
//! - [`admission`]: transfer admission: local budget, cluster leases (held by its own
//!   `LeaseHolder` actor), quotas (docs/admission.md).
//! - [`session`]: pure hot-state logic of upload sessions (phases, counters, the bounded table).
//! - [`actors`]: ractor actors (node supervisor, session region and owners, placement) as
//!   thin shells over the pure modules, and the placement runtime ([`actors::ClusterHandle`]).
//!   Bytes never travel through actor mailboxes.
//! - [`control`]: node-to-node control plane (envelopes, transport over ractor_cluster).
//! - [`auth`]: JWT bearer verification (issuers, JWKS, the caller's organization).
//! - [`placement`]: which node owns a session: pure rules and the routing port (no actor,
//!   no store; the runtime is in `actors::cluster`).
//! - [`upload`]: owner-local ingest: the [`upload::UploadService`] both the public and the
//!   internal listener call, and the [`upload::UploadClaim`] that holds an upload's guards.
//! - [`edge`]: what the HTTP and gRPC listeners share, below both: the handlers' state
//!   ([`edge::AppState`]), the one error vocabulary ([`edge::ErrorCode`]: every status and
//!   `Retry-After` a client sees), readiness, TLS, the accept loop, the tenant binding.
//! - [`relay`]: the node-to-node client: one relay of plain and tus requests to a
//!   session's owner, and the protocol it shares with the owner's internal listener.
//! - [`http`]: the axum server: public API, ops and admin endpoints, the internal listener.
//! - [`metrics`]: the Prometheus registry and the metric handles.
//! - [`health`]: the probes of the node's dependencies (block store, PostgreSQL, Redis).
//! - [`node`]: starts one running node and shuts it down; [`node::assemble`] is the one place
//!   that decides the mode (embedded or cluster) and opens the stores, for every command.
//! - [`client`]: the HTTP client used by `graviton put` and `graviton get`.
//! - [`cli`]: CLI commands that need no running node (a cluster's database, a node's stores).
//! - `lua/` and `sql/` at the crate root hold the Redis script and PostgreSQL migrations.
//!
//! Imports between these folders run one way (`python3 scripts/layers.py src` lists any
//! cycle; the one left is `config` <-> `edge`: the edge's state holds the `Config`, while
//! `config` holds the `[http]`/`[grpc]` sections, which use the edge's TLS types):
//! `values` and `ids` at the bottom, `cas` below `storage` below `pipeline`, `placement`
//! below `actors`, `config` above the sections it assembles, `node` and `cli` at the top.

pub mod actors;
pub mod admission;
pub mod auth;
pub mod backoff;
pub mod cas;
pub mod cli;
pub mod client;
pub mod config;
pub mod control;
pub mod edge;
pub mod grpc;
pub mod health;
pub mod http;
pub mod ids;
pub mod metrics;
pub mod node;
pub mod pipeline;
pub mod placement;
pub mod relay;
pub mod session;
pub mod storage;
pub mod telemetry;
pub mod tus;
pub mod upload;
pub mod values;
