//! `GET` and `HEAD /v1/blobs/{key}`: streamed, verified downloads with single-range support.
//!
//! Admission (and the request quota) runs before the manifest is read; every chunk is
//! charged to the tenant's egress quota just before it is sent (`admission::egress`) and
//! metered by `metrics::MeteredDownload`.
//!
//! The first block (with the store's first read of its run) is fetched and checked before
//! the status line goes out, so a block store that fails at the start answers 503
//! `storage_unavailable` with `Retry-After` (a missing or corrupt first block: 500), never
//! a `200` that aborts with no bytes. A failure after the head aborts the connection
//! before `Content-Length` bytes were sent; the download counts as `server_error` and the
//! request as `5xx` (`http::observe`).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;

use crate::admission::egress::{EgressStop, charge_egress};
use crate::admission::{Operation, Outcome};
use crate::cas::BlobKey;
use crate::cas::range::{RangeRequest, parse_range};
use crate::edge::AppState;
use crate::edge::{Answer, ApiError, ErrorCode};
use crate::metrics::{MeteredDownload, OutcomeLabels};
use crate::pipeline::read::{ReadError, read_blob};

/// `DELETE /v1/blobs/{key}` (admin token): removes the manifest only. Blocks are shared
/// by every blob (and tenant) that contains them; the collector reclaims those no
/// manifest references any more, after `storage.gc.min_age`.
pub async fn delete_blob(
    State(app): State<Arc<AppState>>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    super::admission::require_admin(&app, &headers)?;
    let key: BlobKey = key.parse().map_err(|e: crate::cas::KeyError| {
        ApiError::new(ErrorCode::InvalidBlobKey, e.to_string())
    })?;
    match app.manifests.delete(key).await {
        Ok(true) => Ok(Answer::NoContent.into_response()),
        Ok(false) => Err(ApiError::new(
            ErrorCode::BlobNotFound,
            "no blob with this key",
        )),
        Err(err) => Err(err.into()),
    }
}

#[derive(Debug, serde::Deserialize)]
pub struct GcQuery {
    #[serde(default)]
    dry_run: bool,
    #[serde(default)]
    purge: bool,
}

/// `POST /v1/admin/gc?dry_run=&purge=` (admin token): one collector run on this node.
pub async fn run_gc(
    State(app): State<Arc<AppState>>,
    axum::extract::Query(query): axum::extract::Query<GcQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    super::admission::require_admin(&app, &headers)?;
    let Some((store, metrics)) = &app.packs else {
        return Err(ApiError::new(
            ErrorCode::GcUnsupported,
            "this node does not keep blocks in packs",
        ));
    };
    let options = crate::storage::pack::gc::GcOptions::from_config(
        &app.config.storage.gc,
        query.dry_run,
        query.purge,
    );
    match crate::storage::pack::gc::collect(
        store,
        &app.gc_manifests(),
        options,
        &mut crate::storage::pack::gc::Quiet,
    )
    .await
    {
        Ok(report) => {
            if !report.dry_run {
                metrics.record(&report);
            }
            Ok(axum::Json(report).into_response())
        }
        Err(crate::storage::StoreError::Busy(detail)) => Err(ApiError::new(
            ErrorCode::GcRunning,
            format!("{detail}; retry when that run has finished"),
        )),
        Err(err) => {
            metrics.failures.inc();
            tracing::error!(error = %err, "collector run failed");
            Err(ApiError::gc_failed())
        }
    }
}

pub async fn get_blob(
    State(app): State<Arc<AppState>>,
    method: Method,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let key: BlobKey = key.parse().map_err(|e: crate::cas::KeyError| {
        ApiError::new(ErrorCode::InvalidBlobKey, e.to_string())
    })?;
    // Quota and admission before the manifest or any block is read. HEAD moves no body
    // bytes: it is charged as a request but holds no transfer permit.
    let tenant = crate::edge::auth::tenant_header(&headers)?;
    // With auth on: bearer verified, tenant bound to the token's organization.
    let tenant = crate::edge::auth::caller_tenant(&app, &headers, tenant).await?;
    super::admission::charge_request(&app, tenant.as_ref()).await?;
    let permit = if method == Method::HEAD {
        None
    } else {
        // A spent egress window is a 429 with Retry-After now, not a 200 that aborts.
        if let Some(tenant) = &tenant {
            app.admission.check_egress(tenant).await?;
        }
        Some(
            app.admission
                .admit_transfer(Operation::Download, tenant)
                .await?,
        )
    };
    let manifest = match app.manifests.get(key).await {
        Ok(Some(manifest)) => Arc::new(manifest),
        Ok(None) => {
            return Err(ApiError::new(
                ErrorCode::BlobNotFound,
                "no blob with this key",
            ));
        }
        Err(err) => return Err(err.into()),
    };
    let etag = key.etag();
    if let Some(candidates) = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        && candidates
            .split(',')
            .any(|c| c.trim() == etag || c.trim() == "*")
    {
        let mut response = Answer::NotModified.into_response();
        response.headers_mut().insert(
            header::ETAG,
            HeaderValue::from_str(&etag).expect("hex etag"),
        );
        return Ok(response);
    }

    let size = manifest.size();
    let range_header = headers.get(header::RANGE).and_then(|v| v.to_str().ok());
    let (status, range) = match parse_range(range_header, size) {
        RangeRequest::Full => (Answer::Ok, None),
        RangeRequest::Partial(range) => (Answer::PartialContent, Some(range)),
        RangeRequest::Unsatisfiable => {
            let mut response = ApiError::new(
                ErrorCode::RangeNotSatisfiable,
                "the requested range lies outside the blob",
            )
            .into_response();
            response.headers_mut().insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&format!("bytes */{size}")).expect("ascii"),
            );
            return Ok(response);
        }
    };
    let length = range.map(|r| r.len()).unwrap_or(size);

    let body = if method == Method::HEAD {
        Body::empty()
    } else {
        let mut blocks = Box::pin(read_blob(app.blocks.clone(), manifest, range));
        // The first block before the status line (module doc).
        let first = blocks.next().await;
        if let Some(Err(err)) = first {
            if let Some(permit) = &permit {
                permit.set_outcome(Outcome::Failed);
            }
            app.metrics
                .downloads
                .get_or_create(&OutcomeLabels {
                    outcome: "server_error",
                })
                .inc();
            return Err(err.into());
        }
        let stream = futures_util::stream::iter(first).chain(blocks);
        let stream = charge_egress(stream, app.admission.clone(), tenant, permit, length);
        Body::from_stream(MeteredDownload::new(stream, app.metrics.clone(), length))
    };
    let mut response = Response::builder()
        .status(status.status())
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, length)
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::ETAG, &etag)
        .body(body)
        .map_err(|e| ApiError::internal(format!("build response: {e}")))?;
    if let Some(range) = range {
        response.headers_mut().insert(
            header::CONTENT_RANGE,
            HeaderValue::from_str(&range.content_range(size)).expect("ascii"),
        );
    }
    Ok(response)
}

/// The status class a request whose download body was aborted with `err` is counted as
/// (`http::observe`): a tenant's egress quota running out mid-stream is the client's
/// (`4xx`, like its `429` before the head); anything else (the block store, damage, a
/// lost lease, the coordinator) is the server's (`5xx`).
pub(crate) fn aborted_class(err: &(dyn std::error::Error + 'static)) -> &'static str {
    let mut cause = Some(err);
    while let Some(current) = cause {
        if let Some(stop) = current.downcast_ref::<EgressStop<ReadError>>() {
            return match stop {
                EgressStop::Refused(crate::admission::Error::QuotaExceeded { .. }) => "4xx",
                _ => "5xx",
            };
        }
        cause = current.source();
    }
    "5xx"
}
