//! `POST /v1/blobs`: streamed upload into content-addressed storage.
//!
//! Order of work: header checks (length syntax, size limit, media type, locality
//! headers) -> bearer token and tenant binding (`http::auth`, when auth is on) -> request quota -> owner resolution -> transfer admission (an `upload` where
//! the bytes are ingested, a `forwarded_upload` on a relaying node; see `http::admission`)
//! -> session owner (when the locality headers are present) -> stream the body through
//! the ingest pipeline -> 201. Nothing before the ingest touches the body, so every
//! refusal before it leaves the body unread.

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
use crate::admission::{AdmissionPermit, Operation, Outcome};
use crate::cas::ingest::{IngestError, IngestLimits, IngestReport, ingest_fenced};
use crate::metrics::{BlockLabels, OutcomeLabels};
use crate::placement::{Epoch, ShardId};
use crate::session::SessionError;
use crate::storage::StoreError;
use crate::storage::manifest::CommitFence;
use std::time::Duration;

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
            IngestError::Store(StoreError::Fenced { .. }) => ApiError::unavailable(
                "shard_moved",
                "this session's shard moved before the upload could commit; retry with the same session",
            )
            .with_retry_after(std::time::Duration::from_secs(1)),
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
    // With auth on, the bearer token is verified here and the tenant is its organization
    // (a differing tenant header is refused); all before the body (`http::auth`).
    let tenant =
        super::auth::caller_tenant(&app, &headers, parsed.session.as_ref().map(|k| k.tenant))
            .await?;
    // The request quota is charged here, on the node the client called, before the body
    // is read; admission happens where the bytes are held (below and in `ingest_owned`).
    super::admission::charge_request(&app, tenant.as_ref()).await?;
    let Some(key) = parsed.session else {
        // No session: content-addressed data can be ingested by any node.
        let report =
            ingest_owned_for(&app, None, None, tenant, parsed.content_length, body).await?;
        return Ok(created(&app, &report));
    };
    let kind = |kind| crate::metrics::KindLabels { kind };
    let owner = app.cluster.resolve(&key).map_err(|err| {
        app.metrics
            .routing_failures
            .get_or_create(&kind("resolve"))
            .inc();
        crate::node::cluster::unresolved(err)
    })?;
    let decision = if owner.is_local { "local" } else { "remote" };
    app.metrics.routing.get_or_create(&kind(decision)).inc();
    if owner.is_local {
        let route = LocalRoute {
            key,
            shard: owner.shard,
            epoch: owner.epoch,
        };
        let report = ingest_owned(&app, Some(route), None, parsed.content_length, body).await?;
        return Ok(created(&app, &report));
    }
    let Some(forwarder) = &app.forwarder else {
        app.metrics
            .routing_failures
            .get_or_create(&kind("forward_config"))
            .inc();
        return Err(ApiError::unavailable(
            "owner_unavailable",
            "this session is owned by another node and forwarding is not configured",
        ));
    };
    let target = crate::node::cluster::target_of(&owner)?;
    let resolver = crate::node::cluster::PlacementResolver(app.cluster.clone());
    // The relay holds local permits for its (small) footprint; the owner admits the
    // transfer's one cluster lease in the pre-flight, before the body is read.
    let admission = super::admission::admit_relay(&app, key.tenant).await?;
    app.metrics.forwarded_uploads.inc();
    let response = forwarder
        .forward_upload(target, key, &headers, body, &resolver)
        .await;
    admission.set_outcome(if response.status().is_success() {
        Outcome::Completed
    } else {
        Outcome::Failed
    });
    Ok(response)
}

/// A session upload that this node owns: the session and the shard epoch it was routed by.
#[derive(Debug, Clone, Copy)]
pub struct LocalRoute {
    pub key: crate::ids::SessionKey,
    pub shard: ShardId,
    pub epoch: Epoch,
}

/// Ingest an upload on this node. With a route, the upload holds an ingest permit for
/// the shard (refused if the shard is moving or this node is fenced) and runs through the
/// session's owner; a revoked permit aborts the upload. Used by direct and forwarded
/// uploads alike; a forwarded upload passes the admission its pre-flight made.
pub async fn ingest_owned(
    app: &AppState,
    route: Option<LocalRoute>,
    admitted: Option<AdmissionPermit>,
    declared: Option<u64>,
    body: Body,
) -> Result<IngestReport, ApiError> {
    ingest_owned_for(
        app,
        route,
        admitted,
        route.map(|r| r.key.tenant),
        declared,
        body,
    )
    .await
}

/// [`ingest_owned`] with the tenant admission charges (the authenticated organization,
/// which a session-less upload has only through its token).
pub async fn ingest_owned_for(
    app: &AppState,
    route: Option<LocalRoute>,
    admitted: Option<AdmissionPermit>,
    tenant: Option<crate::ids::TenantId>,
    declared: Option<u64>,
    body: Body,
) -> Result<IngestReport, ApiError> {
    // Admission before anything else: local permits and the cluster lease for the bytes
    // this node will hold. A refusal leaves the body unread.
    let admission = match admitted {
        Some(permit) => permit,
        None => super::admission::admit(app, Operation::Upload, tenant).await?,
    };
    let lease_lost = admission.cancellation();
    let (permit, ticket) = match route {
        Some(route) => {
            let permit = app
                .cluster
                .begin_ingest(route.shard, route.epoch)
                .ok_or_else(|| {
                    ApiError::unavailable(
                        "shard_unavailable",
                        "this session's shard is moving or its owner is fenced; retry shortly",
                    )
                    .with_retry_after(Duration::from_secs(1))
                })?;
            let ticket = app.sessions.begin(route.key).await?;
            (Some(permit), Some(ticket))
        }
        None => (None, None),
    };
    // The commit binds: the manifest is written only if this node still owns the shard at
    // the permit's epoch, checked in the store's commit (LOC-1). The permit checks above
    // only keep doomed uploads from starting.
    let fence = permit.as_ref().map(|p| CommitFence {
        shard: p.shard(),
        epoch: p.epoch(),
        node: app.cluster.node_id().clone(),
    });
    let ingest = async {
        tokio::select! {
            // A finished ingest wins over a cancellation that fires at the same moment.
            biased;
            result = ingest_body(app, declared, body, ticket.as_ref(), fence) => result.map_err(ApiError::from),
            // The cluster lease was lost: stop ingesting (no manifest is written).
            () = lease_lost.cancelled() => Err(super::admission::lease_lost()),
        }
    };
    let result = match &permit {
        Some(permit) => tokio::select! {
            biased;
            result = ingest => result,
            _ = permit.revoked() => Err(ApiError::unavailable(
                "shard_moved",
                "this session's shard moved during the upload; retry with the same session",
            )
            .with_retry_after(Duration::from_secs(1))),
        },
        None => ingest.await,
    };
    admission.set_outcome(if result.is_ok() {
        Outcome::Completed
    } else {
        Outcome::Failed
    });
    drop(admission);
    if let Some(ticket) = ticket {
        ticket.finish(result.is_ok());
    }
    drop(permit);
    let outcome = match &result {
        Ok(_) => "ok",
        Err(err) if err.status.is_server_error() => "server_error",
        Err(_) => "client_error",
    };
    app.metrics
        .uploads
        .get_or_create(&OutcomeLabels { outcome })
        .inc();
    result
}

/// Run the ingest pipeline over a request body (also used for forwarded uploads).
pub async fn ingest_body(
    app: &AppState,
    declared: Option<u64>,
    body: Body,
    ticket: Option<&crate::actors::IngestTicket>,
    fence: Option<CommitFence>,
) -> Result<IngestReport, IngestError> {
    let started = Instant::now();
    let limits = IngestLimits {
        max_size: app.config.upload.max_blob_size.bytes(),
        declared_size: declared,
        idle_timeout: app.config.upload.body_idle_timeout.get(),
    };
    let (mut pending_bytes, mut pending_frames) = (0u64, 0u64);
    let metrics = app.metrics.clone();
    let result = ingest_fenced(
        body.into_data_stream(),
        limits,
        app.blocks.clone(),
        app.manifests.clone(),
        fence,
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

/// The 201 body for an ingested blob.
pub fn response_body(app: &AppState, report: &IngestReport) -> UploadResponse {
    UploadResponse {
        key: report.key.to_string(),
        size: report.key.size,
        blocks: report.blocks,
        fresh_blocks: report.fresh_blocks,
        duplicate_blocks: report.duplicate_blocks,
        owner: app.node_id.to_string(),
    }
}

/// The 201 response for an ingested blob.
pub fn created(app: &AppState, report: &IngestReport) -> Response {
    let body = response_body(app, report);
    let key = body.key.clone();
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
