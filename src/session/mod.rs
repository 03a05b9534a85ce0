//! Pure logic of upload-session hot state (no actors, no I/O).
//!
//! - [`hot_state`]: what a session owner remembers about its session: phase and counters,
//!   never bytes. Everything in it can be rebuilt (a fresh owner starts from `Idle`).
//! - [`index`]: the bounded table of live owners a session region keeps: which sessions
//!   are active, which are idle, which one to evict when the bound is reached.

pub mod hot_state;
pub mod index;

pub use hot_state::{HotSnapshot, HotState, Phase};
pub use index::{Admission as IndexAdmission, SessionIndex};

/// Why a session could not start an ingest here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    #[error("another upload of this session is in progress")]
    Busy,
    #[error("this node holds its maximum number of active upload sessions")]
    AtCapacity,
    #[error("session owner unavailable: {0}")]
    Unavailable(String),
}
