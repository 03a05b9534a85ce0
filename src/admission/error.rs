//! Admission errors and their HTTP mapping.
//!
//! | error | status | code | Retry-After |
//! |---|---|---|---|
//! | [`Error::NeverFits`] | 429 | `transfer_admission_limited` | no (waiting cannot help) |
//! | [`Error::QuotaExceeded`] | 429 | `quota_exceeded` | until the Redis-time window ends |
//! | [`Error::TimedOut`] | 503 | `transfer_admission_busy` | the retry hint |
//! | [`Error::Saturated`] | 503 | `transfer_admission_busy` | the retry hint |
//! | [`Error::Unavailable`], [`Error::Protocol`] | 503 | `admission_unavailable` | the retry hint |
//! | [`Error::NotDistributed`] | 409 | `admission_not_distributed` | no |
//! | [`Error::InvalidOverride`] | 400 | `invalid_admission_override` | no |
//!
//! Messages never carry limits, tenant ids or connection details.

use std::time::Duration;

use axum::http::StatusCode;

use super::reply::{Dimension, ReplyError};
use crate::http::ApiError;

/// Retry hint for busy and unavailable answers.
pub const RETRY_HINT: Duration = Duration::from_secs(1);

/// Which kind of traffic quota refused a charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuotaKind {
    Requests,
    Egress,
}

impl QuotaKind {
    pub fn as_str(self) -> &'static str {
        match self {
            QuotaKind::Requests => "request",
            QuotaKind::Egress => "egress",
        }
    }
}

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

impl From<Error> for ApiError {
    fn from(err: Error) -> Self {
        match err {
            Error::NeverFits(_) => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "transfer_admission_limited",
                "the transfer exceeds an admission ceiling",
            ),
            Error::QuotaExceeded { kind, retry_after } => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "quota_exceeded",
                format!("tenant {} quota exceeded", kind.as_str()),
            )
            .with_retry_after(retry_after),
            Error::TimedOut(_) | Error::Saturated(_) => ApiError::unavailable(
                "transfer_admission_busy",
                "transfer capacity is busy; retry later",
            )
            .with_retry_after(RETRY_HINT),
            Error::Unavailable(_) | Error::Protocol(_) => ApiError::unavailable(
                "admission_unavailable",
                "transfer admission is temporarily unavailable",
            )
            .with_retry_after(RETRY_HINT),
            Error::NotDistributed => ApiError::new(
                StatusCode::CONFLICT,
                "admission_not_distributed",
                "cluster admission is not configured on this node",
            ),
            Error::InvalidOverride(what) => {
                ApiError::bad_request("invalid_admission_override", what)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_retry_after() {
        let limited: ApiError = Error::NeverFits(Dimension::TenantBytes).into();
        assert_eq!(
            (limited.status.as_u16(), limited.code, limited.retry_after),
            (429, "transfer_admission_limited", None)
        );
        let quota: ApiError = Error::QuotaExceeded {
            kind: QuotaKind::Egress,
            retry_after: Duration::from_millis(1500),
        }
        .into();
        assert_eq!((quota.status.as_u16(), quota.code), (429, "quota_exceeded"));
        assert_eq!(quota.retry_after, Some(Duration::from_millis(1500)));
        for err in [Error::TimedOut("cluster lease"), Error::Saturated("tenant")] {
            let api: ApiError = err.into();
            assert_eq!(
                (api.status.as_u16(), api.code),
                (503, "transfer_admission_busy")
            );
            assert!(api.retry_after.is_some());
        }
        for err in [
            Error::Unavailable("io".into()),
            Error::Protocol(ReplyError::new("x")),
        ] {
            let api: ApiError = err.into();
            assert_eq!(
                (api.status.as_u16(), api.code),
                (503, "admission_unavailable")
            );
            assert!(api.retry_after.is_some());
        }
    }
}
