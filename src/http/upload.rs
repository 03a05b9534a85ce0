//! `POST /v1/blobs`: streamed upload into content-addressed storage.
//!
//! Order of work: header checks (length syntax, size limit, media type, locality
//! headers) -> request quota and transfer admission (`http::admission`) -> session owner
//! (when the locality headers are present) -> stream the body through the ingest pipeline
//! -> 201. Nothing before the ingest touches the body, so every refusal before it leaves
//! the body unread.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::headers::upload_headers;
use super::{ApiError, AppState};
use crate::admission::{Operation, Outcome};
use crate::cas::ingest::{IngestError, IngestLimits, IngestReport, ingest};
use crate::metrics::{BlockLabels, OutcomeLabels};
use crate::session::SessionError;

/// Send a progress update to the session owner every this many bytes.
const PROGRESS_EVERY: u64 = 8 * 1024 * 1024;

/// The 201 body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct UploadResponse {
    pub key: String,
    pub size: u64,
    pub blocks: usize,
    pub fresh_blocks: usize,
    pub duplicate_blocks: usize,
    /// Node that ingested the upload.
    pub owner: String,
}

impl From<IngestError> for ApiError {
    fn from(err: IngestError) -> Self {
        match err {
            IngestError::TooLarge { .. } => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "blob_too_large",
                "the blob is larger than this server accepts",
            ),
            IngestError::LengthMismatch { declared, received } => ApiError::bad_request(
                "length_mismatch",
                format!("the body carried {received} bytes but Content-Length declared {declared}"),
            ),
            IngestError::BodyIdle(after) => ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                format!("no body data arrived for {}s", after.as_secs()),
            ),
            IngestError::Body(_) => {
                ApiError::bad_request("body_incomplete", "the request body ended early or failed")
            }
            IngestError::Store(err) => {
                tracing::error!(error = %err, "block or manifest store failed during upload");
                ApiError::unavailable("storage_unavailable", "storage is temporarily unavailable")
                    .with_retry_after(std::time::Duration::from_secs(5))
            }
            IngestError::Pipeline(detail) => {
                tracing::error!(%detail, "ingest pipeline failure");
                ApiError::internal("the upload failed inside the server")
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
            .with_retry_after(std::time::Duration::from_secs(1)),
            SessionError::Unavailable(detail) => {
                tracing::warn!(%detail, "session owner unavailable");
                ApiError::unavailable("session_unavailable", "the session owner is unavailable")
                    .with_retry_after(std::time::Duration::from_secs(1))
            }
        }
    }
}

pub async fn post_blob(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let parsed = upload_headers(&headers, app.config.upload.max_blob_size.bytes())?;
    // Quota and admission before the body is read: a refusal leaves it unread.
    let tenant = parsed.session.map(|key| key.tenant);
    let permit = super::admission::admit(&app, Operation::Upload, tenant).await?;
    let ticket = match parsed.session {
        Some(key) => Some(app.sessions.begin(key).await?),
        None => None,
    };
    let cancel = permit.cancellation();
    let report = tokio::select! {
        report = ingest_body(&app, parsed.content_length, body, ticket.as_ref()) => report,
        () = cancel.cancelled() => {
            // The cluster lease was lost: stop ingesting (no manifest is written).
            if let Some(ticket) = ticket {
                ticket.finish(false);
            }
            permit.set_outcome(Outcome::Interrupted);
            return Err(super::admission::lease_lost());
        }
    };
    permit.set_outcome(if report.is_ok() {
        Outcome::Completed
    } else {
        Outcome::Failed
    });
    drop(permit);
    let outcome = if report.is_ok() { "ok" } else { "client_error" };
    if let Some(ticket) = ticket {
        ticket.finish(report.is_ok());
    }
    let report = match report {
        Ok(report) => report,
        Err(err) => {
            let api: ApiError = err.into();
            let outcome = if api.status.is_server_error() {
                "server_error"
            } else {
                outcome
            };
            app.metrics
                .uploads
                .get_or_create(&OutcomeLabels { outcome })
                .inc();
            return Err(api);
        }
    };
    app.metrics
        .uploads
        .get_or_create(&OutcomeLabels { outcome })
        .inc();
    Ok(created(&app, &report))
}

/// Run the ingest pipeline over a request body (also used for forwarded uploads).
pub async fn ingest_body(
    app: &AppState,
    declared: Option<u64>,
    body: Body,
    ticket: Option<&crate::actors::IngestTicket>,
) -> Result<IngestReport, IngestError> {
    let started = Instant::now();
    let limits = IngestLimits {
        max_size: app.config.upload.max_blob_size.bytes(),
        declared_size: declared,
        idle_timeout: app.config.upload.body_idle_timeout.get(),
    };
    let (mut pending_bytes, mut pending_frames) = (0u64, 0u64);
    let metrics = app.metrics.clone();
    let result = ingest(
        body.into_data_stream(),
        limits,
        app.blocks.clone(),
        app.manifests.clone(),
        |bytes| {
            metrics.upload_bytes.inc_by(bytes);
            pending_bytes += bytes;
            pending_frames += 1;
            if pending_bytes >= PROGRESS_EVERY {
                if let Some(ticket) = ticket {
                    ticket.progress(pending_bytes, pending_frames);
                }
                (pending_bytes, pending_frames) = (0, 0);
            }
        },
    )
    .await;
    if let (Some(ticket), true) = (ticket, pending_bytes > 0) {
        ticket.progress(pending_bytes, pending_frames);
    }
    if let Ok(report) = &result {
        app.metrics
            .upload_duration
            .observe(started.elapsed().as_secs_f64());
        app.metrics
            .blocks
            .get_or_create(&BlockLabels { kind: "fresh" })
            .inc_by(report.fresh_blocks as u64);
        app.metrics
            .blocks
            .get_or_create(&BlockLabels { kind: "duplicate" })
            .inc_by(report.duplicate_blocks as u64);
    }
    result
}

/// The 201 response for an ingested blob.
pub fn created(app: &AppState, report: &IngestReport) -> Response {
    let key = report.key.to_string();
    let body = UploadResponse {
        key: key.clone(),
        size: report.key.size,
        blocks: report.blocks,
        fresh_blocks: report.fresh_blocks,
        duplicate_blocks: report.duplicate_blocks,
        owner: app.node_id.to_string(),
    };
    let mut response = (StatusCode::CREATED, Json(body)).into_response();
    let headers = response.headers_mut();
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/blobs/{key}")) {
        headers.insert(header::LOCATION, location);
    }
    if let Ok(etag) = HeaderValue::from_str(&report.key.etag()) {
        headers.insert(header::ETAG, etag);
    }
    response
}
