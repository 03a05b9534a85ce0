//! The owner side of forwarded tus requests, on the internal listener (merged into
//! `http::internal`'s router): `POST` (creation), `HEAD` (offset), `PATCH` (a part),
//! `DELETE` (termination) on `/internal/v1/uploads/{id}`, and `HEAD
//! /internal/v1/uploads/{id}/part`, the pre-flight of a PATCH: the upload, offset and
//! length checks and the part's admission, parked for the PATCH
//! (`X-Graviton-Admission-Reservation`), all before the relay reads the client's body.
//!
//! Every request is checked first exactly like a forwarded plain upload
//! (`internal::check`: internal token → 401, ids, shard and epoch headers → 400, the
//! epoch → 409 `stale_epoch` with the current owner). The work is the same as for a
//! direct request (`http::tus`'s `*_here` functions over the `UploadService`).

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::{head, post};

use super::internal::{InternalState, Refusal, check, refused_preflight, reservation_header};
use super::tus::{
    create_here, creation_headers, patch_headers, patch_here, refused, status_here, terminate_here,
    upload_api_error, upload_id,
};
use crate::placement::LocalRoute;
use crate::relay::protocol::RESERVATION_HEADER;
use crate::tus::UploadId;
use crate::upload::UploadService;

/// What the owner side needs.
#[derive(Clone)]
pub struct TusInternalState {
    pub internal: InternalState,
    pub uploads: Arc<UploadService>,
    pub max_blob_size: u64,
}

/// The tus routes of the internal listener.
pub fn router(state: TusInternalState) -> Router {
    Router::new()
        .route(
            "/internal/v1/uploads/{id}",
            post(create).head(status).patch(part).delete(terminate),
        )
        .route("/internal/v1/uploads/{id}/part", head(preflight))
        .with_state(state)
}

/// The internal checks, then the upload id and its route on this node.
// The refusal is the finished answer, returned once per request: boxing buys nothing.
#[allow(clippy::result_large_err)]
fn checked(
    state: &TusInternalState,
    raw: &str,
    headers: &HeaderMap,
) -> Result<(UploadId, LocalRoute), Response> {
    let id = upload_id(raw).map_err(refused)?;
    let key = id.key();
    let checked = check(
        &state.internal,
        &key.tenant.to_string(),
        &key.session.to_string(),
        headers,
    )
    .map_err(|refusal| match refusal {
        Refusal::Api(error) => refused(error),
        stale => stale.into_response(),
    })?;
    Ok((
        id,
        LocalRoute {
            key: checked.key,
            shard: checked.shard,
            epoch: checked.epoch,
        },
    ))
}

async fn create(
    State(state): State<TusInternalState>,
    Path(raw): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        let (id, local) = checked(&state, &raw, &headers)?;
        let (length, metadata, with_upload, declared) =
            creation_headers(&headers, state.max_blob_size).map_err(refused)?;
        create_here(
            &state.uploads,
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
    .await;
    result.unwrap_or_else(|e| e)
}

async fn status(
    State(state): State<TusInternalState>,
    Path(raw): Path<String>,
    headers: HeaderMap,
) -> Response {
    let result = async {
        let (id, _) = checked(&state, &raw, &headers)?;
        status_here(&state.uploads, id).await
    }
    .await;
    result.unwrap_or_else(|e| e)
}

async fn terminate(
    State(state): State<TusInternalState>,
    Path(raw): Path<String>,
    headers: HeaderMap,
) -> Response {
    let result = async {
        let (id, local) = checked(&state, &raw, &headers)?;
        terminate_here(&state.uploads, local, id).await
    }
    .await;
    result.unwrap_or_else(|e| e)
}

/// The pre-flight of a forwarded PATCH: every check of the PATCH, then the part's
/// admission, parked. A refusal carries its code in `X-Graviton-Error` and the current
/// `Upload-Offset` on a conflict.
async fn preflight(
    State(state): State<TusInternalState>,
    Path(raw): Path<String>,
    headers: HeaderMap,
) -> Response {
    let result = async {
        checked(&state, &raw, &headers)?;
        let (id, offset, declared) = patch_headers(&headers, &raw).map_err(refused_preflight)?;
        match state
            .uploads
            .reserve_forwarded_part(id, offset, &declared)
            .await
        {
            Ok(reservation) => {
                let mut response = crate::edge::Answer::NoContent.into_response();
                if let Ok(value) = HeaderValue::from_str(&reservation) {
                    response.headers_mut().insert(RESERVATION_HEADER, value);
                }
                Ok(response)
            }
            Err(err) => {
                let (api, current) = upload_api_error(err);
                let mut response = refused_preflight(api);
                if let Some(current) = current {
                    super::tus::set(&mut response, crate::tus::UPLOAD_OFFSET, current);
                }
                Err(response)
            }
        }
    }
    .await;
    result.unwrap_or_else(|e| e)
}

async fn part(
    State(state): State<TusInternalState>,
    Path(raw): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        let reservation = reservation_header(&headers).map_err(refused)?;
        let (id, local) = checked(&state, &raw, &headers)?;
        let (_, offset, declared) = patch_headers(&headers, &raw).map_err(refused)?;
        // The pre-flight's admission, when it is still parked; else the service admits.
        let admitted = reservation
            .as_deref()
            .and_then(|r| state.uploads.adopt_reservation(&id.key(), r));
        patch_here(&state.uploads, local, admitted, id, offset, declared, body).await
    }
    .await;
    result.unwrap_or_else(|e| e)
}
