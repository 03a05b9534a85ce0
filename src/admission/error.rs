//! Admission errors. Their answers are mapped in `edge::error` (this module does not
//! import the edge):
//!
//! | error | status | code | Retry-After |
//! |---|---|---|---|
//! | [`Error::NeverFits`] | 429 | `transfer_admission_limited` | no (waiting cannot help) |
//! | [`Error::QuotaExceeded`] | 429 | `quota_exceeded` | until the Redis-time window ends |
//! | [`Error::TimedOut`] | 503 | `transfer_admission_busy` | `RETRY_ADMISSION` |
//! | [`Error::Saturated`] | 503 | `transfer_admission_busy` | `RETRY_ADMISSION` |
//! | [`Error::Unavailable`], [`Error::Protocol`] | 503 | `admission_unavailable` | `RETRY_ADMISSION` |
//! | [`Error::NotDistributed`] | 409 | `admission_not_distributed` | no |
//! | [`Error::InvalidOverride`] | 400 | `invalid_admission_override` | no |
//!
//! Messages never carry limits, tenant ids or connection details.

use std::time::Duration;

use crate::storage::redis::CoordinatorError;
pub use crate::storage::redis::QuotaKind;
use crate::storage::redis::reply::{Dimension, ReplyError};

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The footprint exceeds a ceiling outright.
    #[error("transfer footprint exceeds the {0} ceiling")]
    NeverFits(Dimension),
    /// Capacity did not free up within the acquisition timeout.
    #[error("transfer admission timed out waiting for {0}")]
    TimedOut(&'static str),
    /// A bounded local registry is full of active entries.
    #[error("admission {0} registry is saturated")]
    Saturated(&'static str),
    /// A traffic quota is exhausted for the current window.
    #[error("{} quota exceeded", .kind.as_str())]
    QuotaExceeded {
        kind: QuotaKind,
        retry_after: Duration,
    },
    /// The coordinator could not be reached or failed; carries an error category only.
    #[error("admission coordinator unavailable ({0})")]
    Unavailable(String),
    /// The coordinator answered something unexpected.
    #[error(transparent)]
    Protocol(#[from] ReplyError),
    /// The operation needs `[admission.redis]`.
    #[error("cluster admission is not configured")]
    NotDistributed,
    #[error("invalid admission override: {0}")]
    InvalidOverride(&'static str),
}

impl Error {
    /// Stable metric label of the outcome.
    pub fn outcome(&self) -> &'static str {
        match self {
            Error::NeverFits(_) => "never_fits",
            Error::TimedOut(_) => "timed_out",
            Error::Saturated(_) => "saturated",
            Error::QuotaExceeded { .. } => "quota_exceeded",
            Error::Unavailable(_) => "unavailable",
            Error::Protocol(_) => "protocol_error",
            Error::NotDistributed => "not_distributed",
            Error::InvalidOverride(_) => "invalid",
        }
    }
}

impl From<CoordinatorError> for Error {
    fn from(err: CoordinatorError) -> Self {
        match err {
            CoordinatorError::Unavailable(category) => Error::Unavailable(category),
            CoordinatorError::Protocol(reply) => Error::Protocol(reply),
        }
    }
}
