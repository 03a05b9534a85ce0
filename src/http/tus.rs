//! `/v1/uploads`: the tus 1.0 handlers (docs/api.md, "Resumable uploads (tus 1.0)").
//!
//! Thin: the headers are parsed by `crate::tus` (pure), the work is the upload service's
//! (`upload::resumable`). Order of work for every request: `Tus-Resumable` → the
//! request's own headers → bearer token and tenant binding (`edge::auth`, the upload id's
//! tenant plays the tenant header's part) → request quota → route by the upload's session
//! key → the service here, or the forwarder to the owner. Nothing before the service's
//! claim (or the forwarder's pre-flight) touches a body.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, header};
use axum::response::{IntoResponse, Response};

use super::Relay;
use crate::admission::Outcome;
use crate::edge::AppState;
use crate::edge::headers::{SESSION_HEADER, content_length, single_value};
use crate::edge::{Answer, ApiError, ErrorCode};
use crate::ids::{SessionId, SessionKey};
use crate::pipeline::ingest::IngestError;
use crate::placement::{LocalRoute, OwnerTarget, Route};
use crate::tus::{self, TusError, UploadId};
use crate::upload::resumable::{PartDeclared, PartReceipt};
use crate::upload::{UploadError, UploadService};

fn tus_error(err: TusError) -> ApiError {
    match err {
        TusError::UnsupportedVersion => {
            ApiError::new(ErrorCode::UnsupportedTusVersion, err.to_string())
        }
        TusError::InvalidLength | TusError::DeferLength => {
            ApiError::new(ErrorCode::InvalidUploadLength, err.to_string())
        }
        TusError::InvalidOffset => ApiError::new(ErrorCode::InvalidUploadOffset, err.to_string()),
        TusError::InvalidMetadata => {
            ApiError::new(ErrorCode::InvalidUploadMetadata, err.to_string())
        }
        TusError::InvalidChecksum => ApiError::new(ErrorCode::InvalidChecksum, err.to_string()),
    }
}

fn text<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

pub(crate) fn set(response: &mut Response, name: &'static str, value: impl ToString) {
    if let Ok(value) = HeaderValue::from_str(&value.to_string()) {
        response
            .headers_mut()
            .insert(HeaderName::from_static(name), value);
    }
}

/// Every tus answer carries `Tus-Resumable`; a 412 also `Tus-Version`.
pub(crate) fn tus_answer(mut response: Response) -> Response {
    set(&mut response, tus::TUS_RESUMABLE, tus::VERSION);
    if response.status() == ErrorCode::UnsupportedTusVersion.status() {
        set(&mut response, tus::TUS_VERSION, tus::VERSION);
    }
    response
}

pub(crate) fn refused(err: ApiError) -> Response {
    tus_answer(err.into_response())
}

/// An upload service error as a tus error: a checksum mismatch is 460 (the tus checksum
/// extension) with code `digest_mismatch`; an offset conflict names the current offset.
pub(crate) fn upload_api_error(err: UploadError) -> (ApiError, Option<u64>) {
    let current = match &err {
        UploadError::OffsetMismatch { current } => Some(*current),
        _ => None,
    };
    let api = match err {
        UploadError::Ingest(IngestError::DigestMismatch) => ApiError::tus_checksum_mismatch(),
        err => err.into(),
    };
    (api, current)
}

/// [`upload_api_error`] as the answer.
pub(crate) fn upload_refused(err: UploadError) -> Response {
    let (api, current) = upload_api_error(err);
    let mut response = refused(api);
    if let Some(current) = current {
        set(&mut response, tus::UPLOAD_OFFSET, current);
    }
    response
}

fn state_headers(response: &mut Response, receipt: &PartReceipt) {
    set(response, tus::UPLOAD_OFFSET, receipt.offset);
    set(
        response,
        tus::UPLOAD_EXPIRES,
        tus::http_date(receipt.expires_ms),
    );
    if let Some(key) = &receipt.blob_key {
        set(response, tus::BLOB_KEY, key);
    }
}

/// `Tus-Resumable` must name 1.0.0.
fn resumable(headers: &HeaderMap) -> Result<(), ApiError> {
    tus::check_resumable(text(headers, tus::TUS_RESUMABLE)).map_err(tus_error)
}

pub(crate) fn upload_id(raw: &str) -> Result<UploadId, ApiError> {
    raw.parse()
        .map_err(|_| ApiError::new(ErrorCode::UploadNotFound, "no such upload"))
}

/// The bearer token (with auth on) must belong to the upload's tenant; the request quota
/// is charged to it.
async fn authorize(app: &AppState, headers: &HeaderMap, id: &UploadId) -> Result<(), ApiError> {
    let tenant = crate::edge::auth::caller_tenant(app, headers, Some(id.key().tenant)).await?;
    super::admission::charge_request(app, tenant.as_ref()).await
}

/// The route of an upload's session.
fn route(app: &AppState, id: &UploadId) -> Result<Route, ApiError> {
    Ok(app.cluster.route(&id.key())?)
}

/// `OPTIONS /v1/uploads` (and on an upload): discovery.
pub async fn options(State(app): State<Arc<AppState>>) -> Response {
    let mut response = Answer::NoContent.into_response();
    set(&mut response, tus::TUS_VERSION, tus::VERSION);
    set(&mut response, tus::TUS_EXTENSION, tus::EXTENSIONS);
    set(
        &mut response,
        tus::TUS_MAX_SIZE,
        app.config.upload.max_blob_size.bytes(),
    );
    set(
        &mut response,
        tus::TUS_CHECKSUM_ALGORITHM,
        tus::CHECKSUM_ALGORITHMS,
    );
    tus_answer(response)
}

/// The headers of a PATCH (or of a creation-with-upload body) that need no body.
fn part_headers(headers: &HeaderMap) -> Result<PartDeclared, ApiError> {
    let checksum = tus::parse_checksum(text(headers, tus::UPLOAD_CHECKSUM)).map_err(tus_error)?;
    Ok(PartDeclared {
        length: content_length(headers)?,
        checksum,
    })
}

fn is_part_body(headers: &HeaderMap) -> bool {
    text(headers, header::CONTENT_TYPE.as_str())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case(tus::OFFSET_OCTET_STREAM))
}

/// `POST /v1/uploads`: creation (and creation-with-upload).
pub async fn create(
    State(app): State<Arc<AppState>>,
    State(relay): State<Relay>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match create_inner(&app, &relay, &headers, body).await {
        Ok(response) | Err(response) => response,
    }
}

async fn create_inner(
    app: &Arc<AppState>,
    relay: &Relay,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, Response> {
    let (length, metadata, with_upload, declared) =
        creation_headers(headers, app.config.upload.max_blob_size.bytes()).map_err(refused)?;
    let header_tenant = crate::edge::auth::tenant_header(headers).map_err(refused)?;
    let session = match single_value(headers, SESSION_HEADER, ErrorCode::InvalidSessionId)
        .map_err(refused)?
    {
        Some(text) => text.parse::<SessionId>().map_err(|e| {
            refused(ApiError::new(
                ErrorCode::InvalidSessionId,
                format!("X-Graviton-Upload-Session-Id {e}"),
            ))
        })?,
        None => SessionId::new_random(),
    };
    let tenant = crate::edge::auth::caller_tenant(app, headers, header_tenant)
        .await
        .map_err(refused)?
        .ok_or_else(|| {
            refused(ApiError::new(
                ErrorCode::TenantRequired,
                "a resumable upload needs a tenant: a bearer token, or X-Graviton-Tenant-Id",
            ))
        })?;
    super::admission::charge_request(app, Some(&tenant))
        .await
        .map_err(refused)?;
    let id = UploadId(SessionKey { tenant, session });
    let local = match route(app, &id).map_err(refused)? {
        Route::Local(local) => local,
        Route::Remote(target) => {
            return Ok(forward(app, relay, target, id, reqwest::Method::POST, headers, body).await);
        }
    };
    create_here(
        &app.uploads,
        local,
        id,
        length,
        metadata,
        declared,
        with_upload,
        body,
    )
    .await
}

/// Create an upload on this node (its owner), and run its first part when the request
/// carries one (creation-with-upload) or the upload is empty.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn create_here(
    uploads: &UploadService,
    local: LocalRoute,
    id: UploadId,
    length: u64,
    metadata: Option<String>,
    declared: PartDeclared,
    with_upload: bool,
    body: Body,
) -> Result<Response, Response> {
    let location = format!("/v1/uploads/{id}");
    let mut receipt = uploads
        .create_upload(Some(local), id, length, metadata)
        .await
        .map_err(upload_refused)?;
    if with_upload || length == 0 {
        let body = if with_upload { body } else { Body::empty() };
        match uploads
            .patch(Some(local), None, id, 0, declared, body.into_data_stream())
            .await
        {
            Ok(after) => receipt = after,
            Err(err) => {
                // The upload exists; the client learns where, and resumes with a HEAD.
                let mut response = upload_refused(err);
                set(&mut response, "location", &location);
                return Err(response);
            }
        }
    }
    let mut response = Answer::Created.into_response();
    set(&mut response, "location", &location);
    state_headers(&mut response, &receipt);
    Ok(tus_answer(response))
}

/// The parsed creation headers: length, metadata, whether a first part is attached, and
/// its declared length and checksum.
pub(crate) fn creation_headers(
    headers: &HeaderMap,
    max_blob_size: u64,
) -> Result<(u64, Option<String>, bool, PartDeclared), ApiError> {
    resumable(headers)?;
    let length = tus::parse_length(
        text(headers, tus::UPLOAD_LENGTH),
        text(headers, tus::UPLOAD_DEFER_LENGTH),
    )
    .map_err(tus_error)?;
    if length > max_blob_size {
        return Err(ApiError::blob_too_large());
    }
    let metadata = tus::parse_metadata(text(headers, tus::UPLOAD_METADATA)).map_err(tus_error)?;
    let with_upload = is_part_body(headers);
    let declared = if with_upload {
        part_headers(headers)?
    } else {
        PartDeclared::default()
    };
    Ok((length, metadata, with_upload, declared))
}

/// `HEAD /v1/uploads/{id}`: the offset.
pub async fn head(
    State(app): State<Arc<AppState>>,
    State(relay): State<Relay>,
    Path(raw): Path<String>,
    headers: HeaderMap,
) -> Response {
    bodyless(&app, &relay, &raw, &headers, reqwest::Method::HEAD).await
}

/// `HEAD` and `DELETE`, which carry no body: the tus checks, then the answer of the
/// upload's owner, here or forwarded.
async fn bodyless(
    app: &Arc<AppState>,
    relay: &Relay,
    raw: &str,
    headers: &HeaderMap,
    method: reqwest::Method,
) -> Response {
    let result = async {
        resumable(headers).map_err(refused)?;
        let id = upload_id(raw).map_err(refused)?;
        authorize(app, headers, &id).await.map_err(refused)?;
        let local = match route(app, &id).map_err(refused)? {
            Route::Local(local) => local,
            Route::Remote(target) => {
                return Ok(forward(app, relay, target, id, method, headers, Body::empty()).await);
            }
        };
        if method == reqwest::Method::DELETE {
            terminate_here(&app.uploads, local, id).await
        } else {
            status_here(&app.uploads, id).await
        }
    }
    .await;
    result.unwrap_or_else(|e| e)
}

/// The state of an upload owned here.
pub(crate) async fn status_here(
    uploads: &UploadService,
    id: UploadId,
) -> Result<Response, Response> {
    let (receipt, metadata) = uploads.upload_status(id).await.map_err(upload_refused)?;
    Ok(status_response(&receipt, metadata.as_deref()))
}

/// The answer of a HEAD.
pub fn status_response(receipt: &PartReceipt, metadata: Option<&str>) -> Response {
    let mut response = Answer::Ok.into_response();
    state_headers(&mut response, receipt);
    set(&mut response, tus::UPLOAD_LENGTH, receipt.length);
    if let Some(metadata) = metadata {
        set(&mut response, tus::UPLOAD_METADATA, metadata);
    }
    set(&mut response, "cache-control", "no-store");
    tus_answer(response)
}

/// The checks of a PATCH before its body: version, id, media type, offset, length and
/// checksum syntax.
pub fn patch_headers(
    headers: &HeaderMap,
    raw: &str,
) -> Result<(UploadId, u64, PartDeclared), ApiError> {
    resumable(headers)?;
    let id = upload_id(raw)?;
    if !is_part_body(headers) {
        return Err(ApiError::new(
            ErrorCode::UnsupportedMediaType,
            "a PATCH body must be Content-Type: application/offset+octet-stream",
        ));
    }
    let offset = tus::parse_offset(text(headers, tus::UPLOAD_OFFSET)).map_err(tus_error)?;
    Ok((id, offset, part_headers(headers)?))
}

/// `PATCH /v1/uploads/{id}`: one part.
pub async fn patch(
    State(app): State<Arc<AppState>>,
    State(relay): State<Relay>,
    Path(raw): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        let (id, offset, declared) = patch_headers(&headers, &raw).map_err(refused)?;
        authorize(&app, &headers, &id).await.map_err(refused)?;
        let local = match route(&app, &id).map_err(refused)? {
            Route::Local(local) => local,
            Route::Remote(target) => {
                let method = reqwest::Method::PATCH;
                return Ok(forward(&app, &relay, target, id, method, &headers, body).await);
            }
        };
        patch_here(&app.uploads, local, None, id, offset, declared, body).await
    }
    .await;
    result.unwrap_or_else(|e| e)
}

/// A PATCH ingested on this node (directly, or forwarded by another node with the
/// admission its pre-flight made).
pub(crate) async fn patch_here(
    uploads: &UploadService,
    local: LocalRoute,
    admitted: Option<crate::admission::AdmissionPermit>,
    id: UploadId,
    offset: u64,
    declared: PartDeclared,
    body: Body,
) -> Result<Response, Response> {
    let receipt = uploads
        .patch(
            Some(local),
            admitted,
            id,
            offset,
            declared,
            body.into_data_stream(),
        )
        .await
        .map_err(upload_refused)?;
    let mut response = Answer::NoContent.into_response();
    state_headers(&mut response, &receipt);
    Ok(tus_answer(response))
}

/// `DELETE /v1/uploads/{id}`: termination.
pub async fn delete(
    State(app): State<Arc<AppState>>,
    State(relay): State<Relay>,
    Path(raw): Path<String>,
    headers: HeaderMap,
) -> Response {
    bodyless(&app, &relay, &raw, &headers, reqwest::Method::DELETE).await
}

/// Terminate an upload owned here (under the shard's ingest permit and fence).
pub(crate) async fn terminate_here(
    uploads: &UploadService,
    local: LocalRoute,
    id: UploadId,
) -> Result<Response, Response> {
    uploads
        .terminate(Some(local), id)
        .await
        .map_err(upload_refused)?;
    Ok(tus_answer(Answer::NoContent.into_response()))
}

/// Hand a request for an upload owned by another node to the owner (`relay`).
async fn forward(
    app: &AppState,
    relay: &Relay,
    target: OwnerTarget,
    id: UploadId,
    method: reqwest::Method,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    let Some(forwarder) = &relay.0 else {
        return refused(ApiError::new(
            ErrorCode::OwnerUnavailable,
            "this upload is owned by another node and forwarding is not configured",
        ));
    };
    let with_body = method == reqwest::Method::PATCH
        || (method == reqwest::Method::POST && is_part_body(headers));
    // A body is relayed under the relay's local permits; the owner admits the part (one
    // cluster lease) in the pre-flight, before the body moves.
    let admission = if with_body {
        match app.admission.admit_relay(id.key().tenant).await {
            Ok(permit) => Some(permit),
            Err(err) => return refused(err.into()),
        }
    } else {
        None
    };
    app.metrics.forwarded_uploads.inc();
    let response = forwarder
        .relay(
            target,
            crate::relay::Relayed::Tus { id, method },
            headers,
            body,
            app.cluster.as_ref(),
        )
        .await;
    if let Some(admission) = admission {
        admission.set_outcome(if response.status().is_success() {
            Outcome::Completed
        } else {
            Outcome::Failed
        });
    }
    tus_answer(response)
}
