//! The single place where errors become HTTP responses.
//!
//! Every error body is JSON `{"error": "<stable code>", "message": "..."}`. Codes are part
//! of the API contract (docs/api.md); messages are for humans and never carry limits,
//! secrets or tenant ids.

use std::time::Duration;

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::admission;

/// An error answered to an HTTP client.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub retry_after: Option<Duration>,
    /// `WWW-Authenticate` value of a 401.
    pub challenge: Option<String>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
    message: &'a str,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
            challenge: None,
        }
    }

    /// Answer with this `WWW-Authenticate` challenge.
    pub fn with_challenge(mut self, challenge: impl Into<String>) -> Self {
        self.challenge = Some(challenge.into());
        self
    }

    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }

    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: self.code,
            message: &self.message,
        };
        let mut response = (self.status, Json(body)).into_response();
        if let Some(after) = self.retry_after {
            // Whole seconds, rounded up, at least 1.
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            if let Ok(value) = HeaderValue::from_str(&secs.max(1).to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, value);
            }
        }
        if let Some(value) = self
            .challenge
            .as_deref()
            .and_then(|c| HeaderValue::from_str(c).ok())
        {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, value);
        }
        response
    }
}

/// Admission refusals and failures (`docs/admission.md`, failure semantics).
impl From<admission::Error> for ApiError {
    fn from(err: admission::Error) -> Self {
        match err {
            admission::Error::NeverFits(_) => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "transfer_admission_limited",
                "the transfer exceeds an admission ceiling",
            ),
            admission::Error::QuotaExceeded { kind, retry_after } => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "quota_exceeded",
                format!("tenant {} quota exceeded", kind.as_str()),
            )
            .with_retry_after(retry_after),
            admission::Error::TimedOut(_) | admission::Error::Saturated(_) => {
                ApiError::unavailable(
                    "transfer_admission_busy",
                    "transfer capacity is busy; retry later",
                )
                .with_retry_after(admission::error::RETRY_HINT)
            }
            admission::Error::Unavailable(_) | admission::Error::Protocol(_) => {
                ApiError::unavailable(
                    "admission_unavailable",
                    "transfer admission is temporarily unavailable",
                )
                .with_retry_after(admission::error::RETRY_HINT)
            }
            admission::Error::NotDistributed => ApiError::new(
                StatusCode::CONFLICT,
                "admission_not_distributed",
                "cluster admission is not configured on this node",
            ),
            admission::Error::InvalidOverride(what) => {
                ApiError::bad_request("invalid_admission_override", what)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{Dimension, Error, QuotaKind};
    use crate::storage::redis::reply::ReplyError;

    #[test]
    fn admission_errors_map_to_statuses_and_retry_after() {
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

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let response = ApiError::unavailable("busy", "try later")
            .with_retry_after(Duration::from_millis(1200))
            .into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
    }
}
