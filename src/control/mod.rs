//! Node-to-node control plane.
//!
//! - [`config`]: the `[control]` section.
//! - [`envelope`]: pure, versioned MessagePack messages with a 64 KiB cap.
//! - re-dials back off with `crate::backoff::Backoff` (jittered exponential).
//! - [`transport`]: the [`ControlTransport`] / [`ControlHandler`] ports and the
//!   in-memory implementation used by actor unit tests.
//! - [`cluster`]: the real transport over `ractor_cluster` (NodeServer, ControlActor,
//!   dialer with re-dial).
//! - [`supervisor`]: `ControlSupervisor`, which owns those three actors, restarts them as
//!   one unit with backoff, and gives up (the node then stops) after a bounded number
//!   of restarts.
//!
//! PostgreSQL stays the source of truth for placement; messages here are RPCs with
//! short deadlines and hints. A lost message is converged by NOTIFY/polling elsewhere.

pub mod cluster;
pub mod config;
pub mod envelope;
pub mod supervisor;
pub mod transport;

pub use cluster::{ClusterOptions, ClusterTransport, StartError};
pub use config::ControlConfig;
pub use envelope::{Envelope, Reply};
pub use transport::{
    ControlError, ControlHandler, ControlTransport, FnHandler, InMemoryNetwork, InMemoryTransport,
};
