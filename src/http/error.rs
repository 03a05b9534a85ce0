//! The single place where errors become HTTP responses.
//!
//! Every error body is JSON `{"error": "<stable code>", "message": "..."}`. Codes are part
//! of the API contract (docs/api.md); messages are for humans and never carry limits,
//! secrets or tenant ids.
//!
//! Every `From<domain error> for ApiError` lives here: uploads ([`UploadError`], with
//! the ingest, session and store errors it wraps), routing ([`RouteError`]), admission
//! ([`admission::Error`]) and the stores. The `Retry-After` of each kind of temporary refusal is a named constant below.

use std::time::Duration;

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::admission;
use crate::pipeline::ingest::IngestError;
use crate::pipeline::read::ReadError;
use crate::placement::RouteError;
use crate::session::SessionError;
use crate::storage::StoreError;
use crate::upload::UploadError;

/// `Retry-After` when ownership is in motion: a shard moving, a stale owner, a full
/// session table. A new table arrives within about one heartbeat.
pub const RETRY_OWNERSHIP: Duration = Duration::from_secs(1);
/// `Retry-After` when a store (blocks, manifests) is unavailable.
pub const RETRY_STORAGE: Duration = Duration::from_secs(5);
/// `Retry-After` when a collector run failed.
pub const RETRY_GC: Duration = Duration::from_secs(30);
/// `Retry-After` while a drain cannot be requested (the placement store is unreachable).
pub const RETRY_DRAIN: Duration = Duration::from_secs(2);
/// `Retry-After` while a token issuer's keys cannot be fetched.
pub const RETRY_AUTH: Duration = Duration::from_secs(5);

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

    /// 413: the blob is larger than `upload.max_blob_size` (declared or streamed).
    pub fn blob_too_large() -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "blob_too_large",
            "the blob is larger than this server accepts",
        )
    }

    /// 503 `storage_unavailable`, logged with its cause.
    fn storage_unavailable(err: &StoreError) -> Self {
        tracing::error!(error = %err, "block or manifest store failed");
        ApiError::unavailable("storage_unavailable", "storage is temporarily unavailable")
            .with_retry_after(RETRY_STORAGE)
    }

    /// 503 `shard_moved`: retry with the same session; it reaches the new owner.
    fn shard_moved() -> Self {
        ApiError::unavailable(
            "shard_moved",
            "this session's shard moved during the upload; retry with the same session",
        )
        .with_retry_after(RETRY_OWNERSHIP)
    }
}

impl From<StoreError> for ApiError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::Fenced { .. } => ApiError::shard_moved(),
            StoreError::Corrupt(detail) => {
                tracing::error!(%detail, "corrupt stored data");
                ApiError::internal("stored data is corrupt")
            }
            err => ApiError::storage_unavailable(&err),
        }
    }
}

impl From<ReadError> for ApiError {
    /// A download that failed before its head: the store's failure as for any other
    /// store call (503 `storage_unavailable` + `Retry-After`); a missing or corrupt block
    /// is damage, not an outage (500, logged).
    fn from(err: ReadError) -> Self {
        match err {
            ReadError::Store(err) => err.into(),
            err @ (ReadError::MissingBlock(_) | ReadError::CorruptBlock(_)) => {
                tracing::error!(error = %err, "download refused");
                ApiError::internal("a block of this blob is missing or corrupt")
            }
        }
    }
}

impl From<IngestError> for ApiError {
    fn from(err: IngestError) -> Self {
        match err {
            IngestError::TooLarge { .. } => ApiError::blob_too_large(),
            IngestError::LengthMismatch { declared, received } => ApiError::bad_request(
                "length_mismatch",
                format!("the body carried {received} bytes but Content-Length declared {declared}"),
            ),
            IngestError::BodyIdle(after) => ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                format!("no body data arrived for {}s", after.as_secs()),
            ),
            IngestError::DigestMismatch => ApiError::bad_request(
                "digest_mismatch",
                "the body's SHA-256 differs from its Content-Digest / X-Content-Hash; nothing was stored",
            ),
            IngestError::Body(_) => {
                ApiError::bad_request("body_incomplete", "the request body ended early or failed")
            }
            // During an upload a corrupt store is an unavailable store, not a bad blob.
            IngestError::Store(err @ StoreError::Corrupt(_)) => ApiError::storage_unavailable(&err),
            IngestError::Store(err) => err.into(),
            IngestError::PastUploadLength { .. } => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "upload_length_exceeded",
                "the PATCH body runs past the upload's Upload-Length; nothing of it was kept",
            ),
            IngestError::Pipeline(detail) => {
                tracing::error!(%detail, "ingest pipeline failure");
                ApiError::internal("the upload failed inside the server")
            }
            IngestError::Pdf(refusal) => {
                let status = match refusal {
                    crate::cas::pdf::SelectionError::Unsupported(_) => {
                        StatusCode::UNPROCESSABLE_ENTITY
                    }
                    _ => StatusCode::UNSUPPORTED_MEDIA_TYPE,
                };
                ApiError::new(
                    status,
                    refusal.code(),
                    format!("{refusal}; nothing was stored"),
                )
            }
        }
    }
}

impl From<SessionError> for ApiError {
    fn from(err: SessionError) -> Self {
        match err {
            SessionError::Busy => ApiError::new(
                StatusCode::CONFLICT,
                "session_busy",
                "another upload of this session is in progress",
            ),
            SessionError::AtCapacity => ApiError::unavailable(
                "session_capacity",
                "too many active upload sessions on this node",
            )
            .with_retry_after(RETRY_OWNERSHIP),
            SessionError::Unavailable(detail) => {
                tracing::warn!(%detail, "session owner unavailable");
                ApiError::unavailable("session_unavailable", "the session owner is unavailable")
                    .with_retry_after(RETRY_OWNERSHIP)
            }
        }
    }
}

impl From<UploadError> for ApiError {
    fn from(err: UploadError) -> Self {
        match err {
            UploadError::Admission(err) => err.into(),
            UploadError::Session(err) => err.into(),
            UploadError::Ingest(err) => err.into(),
            UploadError::ShardUnavailable => ApiError::unavailable(
                "shard_unavailable",
                "this session's shard is moving or its owner is fenced; retry shortly",
            )
            .with_retry_after(RETRY_OWNERSHIP),
            UploadError::ShardMoved => ApiError::shard_moved(),
            UploadError::LeaseLost => {
                crate::admission::Error::Unavailable("lease_lost".into()).into()
            }
            UploadError::UploadNotFound => {
                ApiError::not_found("upload_not_found", "no such upload")
            }
            UploadError::UploadExpired => {
                ApiError::new(StatusCode::GONE, "upload_expired", "the upload expired")
            }
            UploadError::OffsetMismatch { .. } => ApiError::new(
                StatusCode::CONFLICT,
                "offset_mismatch",
                "Upload-Offset differs from the upload's offset (see Upload-Offset); HEAD the upload and resume from there",
            ),
            UploadError::UploadExists => ApiError::new(
                StatusCode::CONFLICT,
                "upload_exists",
                "this session already has an upload; resume it or choose another session",
            ),
        }
    }
}

impl From<RouteError> for ApiError {
    fn from(err: RouteError) -> Self {
        match err {
            RouteError::Unresolved(err) => ApiError::unavailable(
                "placement_unavailable",
                format!("no owner for this session right now: {err}"),
            ),
            RouteError::NoInternalAddr(_) => ApiError::unavailable(
                "owner_unavailable",
                "the session's owner has no reachable internal address",
            ),
        }
        .with_retry_after(RETRY_OWNERSHIP)
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

    /// Every upload error the service counts as server-side is answered with a 5xx, and
    /// every other one with a 4xx (the upload metrics and the answers agree).
    #[test]
    fn upload_errors_are_5xx_exactly_when_server_side() {
        use crate::admission::Error as Adm;
        let errors = vec![
            UploadError::Admission(Adm::NeverFits(crate::admission::Dimension::TenantBytes)),
            UploadError::Admission(Adm::QuotaExceeded {
                kind: crate::admission::QuotaKind::Requests,
                retry_after: Duration::from_secs(1),
            }),
            UploadError::Admission(Adm::TimedOut("tenant")),
            UploadError::Admission(Adm::Saturated("tenant")),
            UploadError::Admission(Adm::Unavailable("io".into())),
            UploadError::Admission(Adm::NotDistributed),
            UploadError::Admission(Adm::InvalidOverride("x")),
            UploadError::Session(SessionError::Busy),
            UploadError::Session(SessionError::AtCapacity),
            UploadError::Session(SessionError::Unavailable("x".into())),
            UploadError::Ingest(IngestError::TooLarge { limit: 1 }),
            UploadError::Ingest(IngestError::LengthMismatch {
                declared: 2,
                received: 1,
            }),
            UploadError::Ingest(IngestError::BodyIdle(Duration::from_secs(1))),
            UploadError::Ingest(IngestError::Body("x".into())),
            UploadError::Ingest(IngestError::DigestMismatch),
            UploadError::Ingest(IngestError::PastUploadLength { remaining: 1 }),
            UploadError::UploadNotFound,
            UploadError::UploadExpired,
            UploadError::OffsetMismatch { current: 1 },
            UploadError::UploadExists,
            UploadError::Ingest(IngestError::Store(StoreError::Corrupt("x".into()))),
            UploadError::Ingest(IngestError::Store(StoreError::Unavailable("x".into()))),
            UploadError::Ingest(IngestError::Pipeline("x".into())),
            UploadError::Ingest(IngestError::Pdf(
                crate::cas::pdf::SelectionError::TypeMismatch,
            )),
            UploadError::ShardUnavailable,
            UploadError::ShardMoved,
            UploadError::LeaseLost,
        ];
        for err in errors {
            let server_side = err.is_server_side();
            let label = format!("{err:?}");
            let api: ApiError = err.into();
            assert_eq!(api.status.is_server_error(), server_side, "{label}");
        }
    }

    #[test]
    fn a_fenced_commit_and_a_revocation_both_answer_shard_moved_with_retry_after() {
        let fenced: ApiError = UploadError::Ingest(IngestError::Store(StoreError::Fenced {
            shard: 3,
            epoch: 7,
        }))
        .into();
        let revoked: ApiError = UploadError::ShardMoved.into();
        for api in [fenced, revoked] {
            assert_eq!((api.status.as_u16(), api.code), (503, "shard_moved"));
            assert_eq!(api.retry_after, Some(RETRY_OWNERSHIP));
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
