//! The one error vocabulary of the edge: every status a client sees and every
//! `Retry-After` it is told, decided here and nowhere else.
//!
//! - [`ErrorCode`]: each stable code of the API (docs/api.md) with its wire string, its
//!   HTTP status, whether waiting helps ([`ErrorCode::retry`]: the named `RETRY_*`
//!   constants below) and its gRPC code. HTTP answers, the relay (which reads a code back
//!   from an owner's `X-Graviton-Error` with [`ErrorCode::from_wire`]) and gRPC all map
//!   from it.
//! - [`ApiError`]: one error answer: a code, its status, a message for humans and the
//!   `Retry-After`. Its JSON body is `{"error": "<code>", "message": "..."}`; messages
//!   never carry limits, secrets or tenant ids. The few answers whose status or
//!   `Retry-After` differs from their code's usual one are named constructors here
//!   (a relay's 502, tus's 460, a failed collector run, a drain request).
//! - Every `From<domain error> for ApiError`: uploads ([`UploadError`], with the
//!   ingest, session and store errors it wraps), routing ([`RouteError`]), admission
//!   ([`admission::Error`]) and the stores.
//! - [`Answer`]: the statuses that are not errors (200, 201, 204, ...), by name.
//! - [`retry_after_secs`]: the one rounding of a `Retry-After` to whole seconds, for the
//!   HTTP header and the gRPC `retry-after` metadata alike.

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
/// session table, an owner that cannot be reached. A new table arrives within about one
/// heartbeat.
pub const RETRY_OWNERSHIP: Duration = Duration::from_secs(1);
/// `Retry-After` when a store (blocks, manifests) is unavailable.
pub const RETRY_STORAGE: Duration = Duration::from_secs(5);
/// `Retry-After` when a collector run failed, or another run holds the collector.
pub const RETRY_GC: Duration = Duration::from_secs(30);
/// `Retry-After` while a drain cannot be requested (the placement store is unreachable).
pub const RETRY_DRAIN: Duration = Duration::from_secs(2);
/// `Retry-After` while a token issuer's keys cannot be fetched.
pub const RETRY_AUTH: Duration = Duration::from_secs(5);
/// `Retry-After` when transfer admission is busy or its coordinator unavailable.
pub const RETRY_ADMISSION: Duration = Duration::from_secs(1);
/// `Retry-After` of a connection refused at a listener's connection bound.
pub const RETRY_CONNECTIONS: Duration = Duration::from_secs(1);
/// Longest `Retry-After` taken from another node's answer.
pub const RETRY_RELAYED_MAX: Duration = Duration::from_secs(3600);

/// Whether, and after how long, a client should retry a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Waiting does not help: no `Retry-After`.
    Never,
    /// Retry after this long.
    After(Duration),
    /// Retry when the tenant's quota window ends: the refusal carries the time.
    Window,
}

macro_rules! codes {
    ($($(#[$doc:meta])* $variant:ident = $wire:literal, $status:ident, $retry:expr;)*) => {
        /// A stable error code of the API (module doc). The wire strings are part of the
        /// contract (docs/api.md) and never change.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $($(#[$doc])* $variant,)*
        }

        impl ErrorCode {
            /// Every code, in the order of the table.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The code as it is written in answers (`"error"`, `X-Graviton-Error`).
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $wire,)*
                }
            }

            /// The code of a wire string, when it is one of ours.
            pub fn from_wire(wire: &str) -> Option<Self> {
                match wire {
                    $($wire => Some(ErrorCode::$variant),)*
                    _ => None,
                }
            }

            /// The HTTP status this code is answered with.
            pub const fn status(self) -> StatusCode {
                match self {
                    $(ErrorCode::$variant => StatusCode::$status,)*
                }
            }

            /// Whether waiting helps, and how long (the `Retry-After`).
            pub const fn retry(self) -> Retry {
                match self {
                    $(ErrorCode::$variant => $retry,)*
                }
            }
        }
    };
}

use Retry::{After, Never, Window};

codes! {
    // Requests the API cannot parse (extractor rejections, `http::rejections`).
    InvalidRequest = "invalid_request", BAD_REQUEST, Never;
    InvalidBody = "invalid_body", UNPROCESSABLE_ENTITY, Never;
    BodyTooLarge = "body_too_large", PAYLOAD_TOO_LARGE, Never;
    UnsupportedMediaType = "unsupported_media_type", UNSUPPORTED_MEDIA_TYPE, Never;
    // Header checks before the body.
    InvalidContentLength = "invalid_content_length", BAD_REQUEST, Never;
    InvalidContentType = "invalid_content_type", BAD_REQUEST, Never;
    InvalidDigest = "invalid_digest", BAD_REQUEST, Never;
    InvalidTenantId = "invalid_tenant_id", BAD_REQUEST, Never;
    InvalidSessionId = "invalid_session_id", BAD_REQUEST, Never;
    IncompleteSessionHeaders = "incomplete_session_headers", BAD_REQUEST, Never;
    TenantRequired = "tenant_required", BAD_REQUEST, Never;
    InvalidBlobKey = "invalid_blob_key", BAD_REQUEST, Never;
    InvalidNodeId = "invalid_node_id", BAD_REQUEST, Never;
    InvalidBackend = "invalid_backend", BAD_REQUEST, Never;
    InvalidAdmissionOverride = "invalid_admission_override", BAD_REQUEST, Never;
    // tus (docs/resumable.md).
    UnsupportedTusVersion = "unsupported_tus_version", PRECONDITION_FAILED, Never;
    InvalidUploadLength = "invalid_upload_length", BAD_REQUEST, Never;
    InvalidUploadOffset = "invalid_upload_offset", BAD_REQUEST, Never;
    InvalidUploadMetadata = "invalid_upload_metadata", BAD_REQUEST, Never;
    InvalidChecksum = "invalid_checksum", BAD_REQUEST, Never;
    UploadNotFound = "upload_not_found", NOT_FOUND, Never;
    UploadExpired = "upload_expired", GONE, Never;
    OffsetMismatch = "offset_mismatch", CONFLICT, Never;
    UploadExists = "upload_exists", CONFLICT, Never;
    UploadLengthExceeded = "upload_length_exceeded", PAYLOAD_TOO_LARGE, Never;
    // Authentication and the admin token.
    Unauthenticated = "unauthenticated", UNAUTHORIZED, Never;
    InvalidToken = "invalid_token", UNAUTHORIZED, Never;
    TenantMismatch = "tenant_mismatch", FORBIDDEN, Never;
    AuthUnavailable = "auth_unavailable", SERVICE_UNAVAILABLE, After(RETRY_AUTH);
    AdminDisabled = "admin_disabled", FORBIDDEN, Never;
    /// A missing or wrong admin or internal token.
    Unauthorized = "unauthorized", UNAUTHORIZED, Never;
    // The body of an upload.
    BlobTooLarge = "blob_too_large", PAYLOAD_TOO_LARGE, Never;
    LengthMismatch = "length_mismatch", BAD_REQUEST, Never;
    BodyTimeout = "body_timeout", REQUEST_TIMEOUT, Never;
    DigestMismatch = "digest_mismatch", BAD_REQUEST, Never;
    BodyIncomplete = "body_incomplete", BAD_REQUEST, Never;
    PdfSignatureMissing = "pdf_signature_missing", UNSUPPORTED_MEDIA_TYPE, Never;
    PdfTypeMismatch = "pdf_type_mismatch", UNSUPPORTED_MEDIA_TYPE, Never;
    PdfUnsupported = "pdf_unsupported", UNPROCESSABLE_ENTITY, Never;
    // Blobs, nodes and the collector.
    BlobNotFound = "blob_not_found", NOT_FOUND, Never;
    RangeNotSatisfiable = "range_not_satisfiable", RANGE_NOT_SATISFIABLE, Never;
    NodeNotFound = "node_not_found", NOT_FOUND, Never;
    NotClustered = "not_clustered", CONFLICT, Never;
    GcUnsupported = "gc_unsupported", CONFLICT, Never;
    GcRunning = "gc_running", CONFLICT, After(RETRY_GC);
    // Sessions and placement.
    SessionBusy = "session_busy", CONFLICT, Never;
    SessionCapacity = "session_capacity", SERVICE_UNAVAILABLE, After(RETRY_OWNERSHIP);
    SessionUnavailable = "session_unavailable", SERVICE_UNAVAILABLE, After(RETRY_OWNERSHIP);
    ShardUnavailable = "shard_unavailable", SERVICE_UNAVAILABLE, After(RETRY_OWNERSHIP);
    ShardMoved = "shard_moved", SERVICE_UNAVAILABLE, After(RETRY_OWNERSHIP);
    PlacementUnavailable = "placement_unavailable", SERVICE_UNAVAILABLE, After(RETRY_OWNERSHIP);
    // Admission (docs/admission.md, failure semantics).
    TransferAdmissionLimited = "transfer_admission_limited", TOO_MANY_REQUESTS, Never;
    QuotaExceeded = "quota_exceeded", TOO_MANY_REQUESTS, Window;
    TransferAdmissionBusy = "transfer_admission_busy", SERVICE_UNAVAILABLE, After(RETRY_ADMISSION);
    AdmissionUnavailable = "admission_unavailable", SERVICE_UNAVAILABLE, After(RETRY_ADMISSION);
    AdmissionNotDistributed = "admission_not_distributed", CONFLICT, Never;
    // The stores.
    StorageUnavailable = "storage_unavailable", SERVICE_UNAVAILABLE, After(RETRY_STORAGE);
    Internal = "internal", INTERNAL_SERVER_ERROR, Never;
    // The relay to a session's owner (`relay`), as the client sees it.
    OwnerUnavailable = "owner_unavailable", SERVICE_UNAVAILABLE, After(RETRY_OWNERSHIP);
    OwnerMoved = "owner_moved", SERVICE_UNAVAILABLE, After(RETRY_OWNERSHIP);
    UploadInterrupted = "upload_interrupted", BAD_REQUEST, Never;
    // Node-to-node only: the owner's checks of a relayed request (`http::internal`).
    StaleEpoch = "stale_epoch", CONFLICT, Never;
    InvalidSession = "invalid_session", BAD_REQUEST, Never;
    InvalidShard = "invalid_shard", BAD_REQUEST, Never;
    InvalidEpoch = "invalid_epoch", BAD_REQUEST, Never;
    InvalidReservation = "invalid_reservation", BAD_REQUEST, Never;
    // A listener at its connection bound (`edge::listener`).
    TooManyConnections = "too_many_connections", SERVICE_UNAVAILABLE, After(RETRY_CONNECTIONS);
}

impl ErrorCode {
    /// Whether a client may retry the same request after waiting.
    pub fn is_retryable(self) -> bool {
        self.retry() != Retry::Never
    }

    /// The `Retry-After` this code always carries (`None` for [`Retry::Never`] and for
    /// [`Retry::Window`], whose time comes with the refusal).
    pub fn retry_after(self) -> Option<Duration> {
        match self.retry() {
            Retry::After(after) => Some(after),
            Retry::Never | Retry::Window => None,
        }
    }

    /// Whether an owner's refusal of a relayed request's pre-flight with this code
    /// reaches the client as the owner gave it (`relay`). The node-to-node checks, the
    /// owner's internal failures and the relay's own codes do not: they say the relay
    /// failed, and the client is answered `503 owner_unavailable`.
    pub fn is_relayed(self) -> bool {
        use ErrorCode::*;
        !matches!(
            self,
            StaleEpoch
                | InvalidSession
                | InvalidShard
                | InvalidEpoch
                | InvalidReservation
                | Unauthorized
                | Internal
                | OwnerUnavailable
                | OwnerMoved
                | UploadInterrupted
                | TooManyConnections
        )
    }

    /// The gRPC code of this refusal (docs/api.md, "gRPC"): from the HTTP status, except
    /// that a busy transfer admission is `RESOURCE_EXHAUSTED`, like a 429.
    pub fn grpc(self) -> tonic::Code {
        use tonic::Code;
        if self == ErrorCode::TransferAdmissionBusy {
            return Code::ResourceExhausted;
        }
        match self.status() {
            StatusCode::UNAUTHORIZED => Code::Unauthenticated,
            StatusCode::FORBIDDEN => Code::PermissionDenied,
            StatusCode::NOT_FOUND | StatusCode::GONE => Code::NotFound,
            StatusCode::RANGE_NOT_SATISFIABLE => Code::OutOfRange,
            StatusCode::TOO_MANY_REQUESTS => Code::ResourceExhausted,
            StatusCode::REQUEST_TIMEOUT => Code::DeadlineExceeded,
            StatusCode::CONFLICT | StatusCode::PRECONDITION_FAILED => Code::FailedPrecondition,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::BAD_GATEWAY => Code::Unavailable,
            status if status.is_client_error() => Code::InvalidArgument,
            _ => Code::Internal,
        }
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&crate::cas::pdf::SelectionError> for ErrorCode {
    fn from(refusal: &crate::cas::pdf::SelectionError) -> Self {
        use crate::cas::pdf::SelectionError;
        match refusal {
            SelectionError::SignatureMissing => ErrorCode::PdfSignatureMissing,
            SelectionError::TypeMismatch => ErrorCode::PdfTypeMismatch,
            SelectionError::Unsupported(_) => ErrorCode::PdfUnsupported,
        }
    }
}

/// `after` in whole seconds, rounded up, at least 1: the `Retry-After` header's and the
/// gRPC `retry-after` metadata's value.
pub fn retry_after_secs(after: Duration) -> u64 {
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    secs.max(1)
}

/// An answer that is not an error, by name: its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Ok,
    Created,
    /// A request taken, acted on later (a drain).
    Accepted,
    NoContent,
    PartialContent,
    NotModified,
    /// `/readyz` while the node is not ready (a JSON status, not an error).
    NotReady,
}

impl Answer {
    pub const fn status(self) -> StatusCode {
        match self {
            Answer::Ok => StatusCode::OK,
            Answer::Created => StatusCode::CREATED,
            Answer::Accepted => StatusCode::ACCEPTED,
            Answer::NoContent => StatusCode::NO_CONTENT,
            Answer::PartialContent => StatusCode::PARTIAL_CONTENT,
            Answer::NotModified => StatusCode::NOT_MODIFIED,
            Answer::NotReady => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

impl IntoResponse for Answer {
    /// The status alone, with an empty body.
    fn into_response(self) -> Response {
        self.status().into_response()
    }
}

/// tus's checksum extension: a part whose `Upload-Checksum` does not match.
const TUS_CHECKSUM_MISMATCH: u16 = 460;

/// Whether an owner's `status` refuses the relay's credentials (the internal token)
/// rather than the request.
pub fn refuses_credentials(status: StatusCode) -> bool {
    status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN
}

/// An error answered to a client (module doc).
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: ErrorCode,
    /// `code.status()`, except for the named answers of this module.
    pub status: StatusCode,
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
    /// `code` with its status and `Retry-After`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            status: code.status(),
            message: message.into(),
            retry_after: code.retry_after(),
            challenge: None,
        }
    }

    /// Answer with this `WWW-Authenticate` challenge.
    pub fn with_challenge(mut self, challenge: impl Into<String>) -> Self {
        self.challenge = Some(challenge.into());
        self
    }

    /// A `Retry-After` the refusal itself knows (a quota window, another node's answer).
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }

    /// 413: the blob is larger than `upload.max_blob_size` (declared or streamed).
    pub fn blob_too_large() -> Self {
        Self::new(
            ErrorCode::BlobTooLarge,
            "the blob is larger than this server accepts",
        )
    }

    /// An owner's refusal of a relayed pre-flight, rebuilt from its code: the owner's
    /// message (or a generic one) and its `Retry-After` (at most [`RETRY_RELAYED_MAX`]),
    /// else the code's own.
    pub fn relayed(code: ErrorCode, message: Option<String>, retry_after: Option<u64>) -> Self {
        let mut error = Self::new(
            code,
            message.unwrap_or_else(|| "the owner node refused the upload".to_string()),
        );
        if let Some(secs) = retry_after {
            error.retry_after = Some(Duration::from_secs(secs).min(RETRY_RELAYED_MAX));
        }
        error
    }

    /// 502 `owner_unavailable`: the owner failed after the relay had started sending it
    /// the body (or sent an invalid answer); the client retries the whole upload.
    pub fn owner_failed(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_GATEWAY,
            ..Self::new(ErrorCode::OwnerUnavailable, message)
        }
    }

    /// tus 460 `digest_mismatch`: a PATCH body that differs from its `Upload-Checksum`.
    pub fn tus_checksum_mismatch() -> Self {
        Self {
            status: StatusCode::from_u16(TUS_CHECKSUM_MISMATCH).unwrap_or(StatusCode::BAD_REQUEST),
            ..Self::new(
                ErrorCode::DigestMismatch,
                "the PATCH body differs from its Upload-Checksum; the offset did not advance",
            )
        }
    }

    /// 503 `storage_unavailable` for a collector run that failed.
    pub fn gc_failed() -> Self {
        Self::new(ErrorCode::StorageUnavailable, "the collector run failed")
            .with_retry_after(RETRY_GC)
    }

    /// 503 `placement_unavailable` for a drain the placement store did not take.
    pub fn drain_unavailable() -> Self {
        Self::new(
            ErrorCode::PlacementUnavailable,
            "the placement store is unavailable; retry",
        )
        .with_retry_after(RETRY_DRAIN)
    }

    /// This refusal as a gRPC status: the code's gRPC code, the message, and the
    /// `Retry-After` as `retry-after` metadata (whole seconds, as over HTTP).
    pub fn into_grpc(self) -> tonic::Status {
        let mut status = tonic::Status::new(self.code.grpc(), self.message);
        if let Some(after) = self.retry_after
            && let Ok(value) = retry_after_secs(after).to_string().parse()
        {
            status.metadata_mut().insert("retry-after", value);
        }
        status
    }

    /// This refusal as a whole HTTP/1.1 answer closing the connection, for a socket no
    /// HTTP server serves (`edge::listener`'s refused connections).
    pub fn to_http1_bytes(&self) -> Vec<u8> {
        let body = serde_json::to_string(&ErrorBody {
            error: self.code.as_str(),
            message: &self.message,
        })
        .unwrap_or_default();
        let mut head = format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\n",
            self.status.as_u16(),
            self.status.canonical_reason().unwrap_or(""),
        );
        if let Some(after) = self.retry_after {
            head.push_str(&format!("retry-after: {}\r\n", retry_after_secs(after)));
        }
        head.push_str(&format!(
            "connection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        ));
        head.into_bytes()
    }

    /// 503 `storage_unavailable`, logged with its cause.
    fn storage_unavailable(err: &StoreError) -> Self {
        tracing::error!(error = %err, "block or manifest store failed");
        ApiError::new(
            ErrorCode::StorageUnavailable,
            "storage is temporarily unavailable",
        )
    }

    /// 503 `shard_moved`: retry with the same session; it reaches the new owner.
    fn shard_moved() -> Self {
        ApiError::new(
            ErrorCode::ShardMoved,
            "this session's shard moved during the upload; retry with the same session",
        )
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
            IngestError::LengthMismatch { declared, received } => ApiError::new(
                ErrorCode::LengthMismatch,
                format!("the body carried {received} bytes but Content-Length declared {declared}"),
            ),
            IngestError::BodyIdle(after) => ApiError::new(
                ErrorCode::BodyTimeout,
                format!("no body data arrived for {}s", after.as_secs()),
            ),
            IngestError::DigestMismatch => ApiError::new(
                ErrorCode::DigestMismatch,
                "the body's SHA-256 differs from its Content-Digest / X-Content-Hash; nothing was stored",
            ),
            IngestError::Body(_) => ApiError::new(
                ErrorCode::BodyIncomplete,
                "the request body ended early or failed",
            ),
            // During an upload a corrupt store is an unavailable store, not a bad blob.
            IngestError::Store(err @ StoreError::Corrupt(_)) => ApiError::storage_unavailable(&err),
            IngestError::Store(err) => err.into(),
            IngestError::PastUploadLength { .. } => ApiError::new(
                ErrorCode::UploadLengthExceeded,
                "the PATCH body runs past the upload's Upload-Length; nothing of it was kept",
            ),
            IngestError::Pipeline(detail) => {
                tracing::error!(%detail, "ingest pipeline failure");
                ApiError::internal("the upload failed inside the server")
            }
            IngestError::Pdf(refusal) => ApiError::new(
                ErrorCode::from(&refusal),
                format!("{refusal}; nothing was stored"),
            ),
        }
    }
}

impl From<SessionError> for ApiError {
    fn from(err: SessionError) -> Self {
        match err {
            SessionError::Busy => ApiError::new(
                ErrorCode::SessionBusy,
                "another upload of this session is in progress",
            ),
            SessionError::AtCapacity => ApiError::new(
                ErrorCode::SessionCapacity,
                "too many active upload sessions on this node",
            ),
            SessionError::Unavailable(detail) => {
                tracing::warn!(%detail, "session owner unavailable");
                ApiError::new(
                    ErrorCode::SessionUnavailable,
                    "the session owner is unavailable",
                )
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
            UploadError::ShardUnavailable => ApiError::new(
                ErrorCode::ShardUnavailable,
                "this session's shard is moving or its owner is fenced; retry shortly",
            ),
            UploadError::ShardMoved => ApiError::shard_moved(),
            UploadError::LeaseLost => {
                crate::admission::Error::Unavailable("lease_lost".into()).into()
            }
            UploadError::UploadNotFound => {
                ApiError::new(ErrorCode::UploadNotFound, "no such upload")
            }
            UploadError::UploadExpired => {
                ApiError::new(ErrorCode::UploadExpired, "the upload expired")
            }
            UploadError::OffsetMismatch { .. } => ApiError::new(
                ErrorCode::OffsetMismatch,
                "Upload-Offset differs from the upload's offset (see Upload-Offset); HEAD the upload and resume from there",
            ),
            UploadError::UploadExists => ApiError::new(
                ErrorCode::UploadExists,
                "this session already has an upload; resume it or choose another session",
            ),
        }
    }
}

impl From<RouteError> for ApiError {
    fn from(err: RouteError) -> Self {
        match err {
            RouteError::Unresolved(err) => ApiError::new(
                ErrorCode::PlacementUnavailable,
                format!("no owner for this session right now: {err}"),
            ),
            RouteError::NoInternalAddr(_) => ApiError::new(
                ErrorCode::OwnerUnavailable,
                "the session's owner has no reachable internal address",
            ),
        }
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
            error: self.code.as_str(),
            message: &self.message,
        };
        let mut response = (self.status, Json(body)).into_response();
        if let Some(after) = self.retry_after
            && let Ok(value) = HeaderValue::from_str(&retry_after_secs(after).to_string())
        {
            response.headers_mut().insert(header::RETRY_AFTER, value);
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
                ErrorCode::TransferAdmissionLimited,
                "the transfer exceeds an admission ceiling",
            ),
            admission::Error::QuotaExceeded { kind, retry_after } => ApiError::new(
                ErrorCode::QuotaExceeded,
                format!("tenant {} quota exceeded", kind.as_str()),
            )
            .with_retry_after(retry_after),
            admission::Error::TimedOut(_) | admission::Error::Saturated(_) => ApiError::new(
                ErrorCode::TransferAdmissionBusy,
                "transfer capacity is busy; retry later",
            ),
            admission::Error::Unavailable(_) | admission::Error::Protocol(_) => ApiError::new(
                ErrorCode::AdmissionUnavailable,
                "transfer admission is temporarily unavailable",
            ),
            admission::Error::NotDistributed => ApiError::new(
                ErrorCode::AdmissionNotDistributed,
                "cluster admission is not configured on this node",
            ),
            admission::Error::InvalidOverride(what) => {
                ApiError::new(ErrorCode::InvalidAdmissionOverride, what)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{Dimension, Error, QuotaKind};
    use crate::storage::redis::reply::ReplyError;
    use std::collections::HashSet;

    /// Every code's wire string is unique, in the API's spelling, and reads back as the
    /// same code (the relay reads codes back from `X-Graviton-Error`); every retryable
    /// code carries a `Retry-After` on the wire (a quota refusal its window's).
    #[test]
    fn every_code_is_unique_round_trips_and_retryable_codes_carry_retry_after() {
        let mut seen = HashSet::new();
        for &code in ErrorCode::ALL {
            let wire = code.as_str();
            assert!(seen.insert(wire), "{wire} twice");
            assert!(
                !wire.is_empty() && wire.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{wire}"
            );
            assert_eq!(ErrorCode::from_wire(wire), Some(code));
            let header = HeaderValue::from_static(wire);
            assert_eq!(
                ErrorCode::from_wire(header.to_str().unwrap()),
                Some(code),
                "{wire} through a header"
            );
            assert!(code.status().is_client_error() || code.status().is_server_error());
            let error = match code.retry() {
                Retry::Window => {
                    ApiError::new(code, "x").with_retry_after(Duration::from_millis(1))
                }
                _ => ApiError::new(code, "x"),
            };
            let response = error.into_response();
            assert_eq!(response.status(), code.status(), "{wire}");
            assert_eq!(
                response.headers().contains_key(header::RETRY_AFTER),
                code.is_retryable(),
                "{wire}"
            );
            let grpc = ApiError::new(code, "x").into_grpc();
            assert_eq!(
                grpc.metadata().contains_key("retry-after"),
                code.retry_after().is_some(),
                "{wire}"
            );
            // A 5xx is either retryable or the server's own failure (LOC-4).
            if code.status().is_server_error() {
                assert!(code.is_retryable() || code == ErrorCode::Internal, "{wire}");
            }
        }
        assert_eq!(ErrorCode::from_wire("made_up"), None);
        assert_eq!(ErrorCode::from_wire("Internal"), None);
    }

    proptest::proptest! {
        /// Nothing but a code's own wire string parses as that code.
        #[test]
        fn only_wire_strings_parse(text in "[a-z_]{1,40}") {
            match ErrorCode::from_wire(&text) {
                Some(code) => proptest::prop_assert_eq!(code.as_str(), text.as_str()),
                None => proptest::prop_assert!(ErrorCode::ALL.iter().all(|c| c.as_str() != text)),
            }
        }
    }

    #[test]
    fn pdf_refusals_keep_their_cas_codes() {
        use crate::cas::pdf::SelectionError;
        for refusal in [
            SelectionError::SignatureMissing,
            SelectionError::TypeMismatch,
        ] {
            assert_eq!(ErrorCode::from(&refusal).as_str(), refusal.code());
        }
    }

    #[test]
    fn admission_errors_map_to_statuses_and_retry_after() {
        let limited: ApiError = Error::NeverFits(Dimension::TenantBytes).into();
        assert_eq!(
            (
                limited.status.as_u16(),
                limited.code.as_str(),
                limited.retry_after
            ),
            (429, "transfer_admission_limited", None)
        );
        let quota: ApiError = Error::QuotaExceeded {
            kind: QuotaKind::Egress,
            retry_after: Duration::from_millis(1500),
        }
        .into();
        assert_eq!(
            (quota.status.as_u16(), quota.code.as_str()),
            (429, "quota_exceeded")
        );
        assert_eq!(quota.retry_after, Some(Duration::from_millis(1500)));
        for err in [Error::TimedOut("cluster lease"), Error::Saturated("tenant")] {
            let api: ApiError = err.into();
            assert_eq!(
                (api.status.as_u16(), api.code.as_str()),
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
                (api.status.as_u16(), api.code.as_str()),
                (503, "admission_unavailable")
            );
            assert!(api.retry_after.is_some());
        }
    }

    #[test]
    fn admission_errors_map_to_grpc_codes_with_rounded_retry_after() {
        let quota = ApiError::from(Error::QuotaExceeded {
            kind: QuotaKind::Egress,
            retry_after: Duration::from_millis(1500),
        })
        .into_grpc();
        assert_eq!(quota.code(), tonic::Code::ResourceExhausted);
        assert_eq!(quota.metadata().get("retry-after").unwrap(), "2");
        let unavailable = ApiError::from(Error::Unavailable("io".into())).into_grpc();
        assert_eq!(unavailable.code(), tonic::Code::Unavailable);
        assert_eq!(unavailable.metadata().get("retry-after").unwrap(), "1");
        for err in [
            Error::TimedOut("bytes"),
            Error::NeverFits(Dimension::TenantBytes),
        ] {
            assert_eq!(
                ApiError::from(err).into_grpc().code(),
                tonic::Code::ResourceExhausted
            );
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
            assert_eq!(
                (api.status.as_u16(), api.code.as_str()),
                (503, "shard_moved")
            );
            assert_eq!(api.retry_after, Some(RETRY_OWNERSHIP));
        }
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let response = ApiError::new(ErrorCode::TransferAdmissionBusy, "try later")
            .with_retry_after(Duration::from_millis(1200))
            .into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(30)), 30);
    }

    #[test]
    fn a_refused_connection_is_a_whole_http1_answer() {
        let bytes = ApiError::new(
            ErrorCode::TooManyConnections,
            "the server is at its connection limit",
        )
        .to_http1_bytes();
        let text = String::from_utf8(bytes).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{head}"
        );
        assert!(head.contains("\r\nretry-after: 1\r\n"), "{head}");
        assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
        assert!(
            head.ends_with(&format!("content-length: {}", body.len())),
            "{head}"
        );
        assert_eq!(
            body,
            r#"{"error":"too_many_connections","message":"the server is at its connection limit"}"#
        );
    }
}
