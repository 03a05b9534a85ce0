//! `POST /v1/blobs`: the public upload handler.
//!
//! Order of work: header checks (length syntax, size limit, media type, locality
//! headers) -> bearer token and tenant binding (`edge::auth`, when auth is on) -> request
//! quota -> route (`placement::routing`) -> either the upload service ingests here
//! (`upload::UploadService`: admission, ingest permit, session, body, fenced commit), or
//! the relay's local permits and the forwarder stream the body to the owner. Nothing
//! before the ingest or the forwarder's pre-flight touches the body, so every refusal
//! before them leaves the body unread.

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};

use super::Relay;
use crate::admission::Outcome;
use crate::edge::AppState;
use crate::edge::headers::upload_headers;
use crate::edge::{Answer, ApiError, ErrorCode};
use crate::metrics::KindLabels;
use crate::placement::Route;
use crate::upload::{Declared, UploadReceipt};

pub async fn post_blob(
    State(app): State<Arc<AppState>>,
    State(relay): State<Relay>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let parsed = upload_headers(&headers, app.config.upload.max_blob_size.bytes())?;
    // With auth on, the bearer token is verified here and the tenant is its organization
    // (a differing tenant header is refused); all before the body (`edge::auth`).
    let tenant =
        crate::edge::auth::caller_tenant(&app, &headers, parsed.session.as_ref().map(|k| k.tenant))
            .await?;
    // The request quota is charged here, on the node the client called, before the body
    // is read; admission happens where the bytes are held (the upload service, or the
    // owner's pre-flight for a forwarded upload).
    super::admission::charge_request(&app, tenant.as_ref()).await?;
    let declared = Declared {
        length: parsed.content_length,
        digest: parsed.digest,
        media: crate::cas::pdf::select::MediaType::of(
            headers
                .get(axum::http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
        ),
    };
    let Some(key) = parsed.session else {
        // No session: content-addressed data can be ingested by any node.
        let receipt = app
            .uploads
            .ingest(None, None, tenant, declared, body.into_data_stream())
            .await?;
        return Ok(created(receipt));
    };
    type Counters = prometheus_client::metrics::family::Family<
        KindLabels,
        prometheus_client::metrics::counter::Counter,
    >;
    let count = |family: &Counters, kind| {
        family.get_or_create(&KindLabels { kind }).inc();
    };
    let route = app.cluster.route(&key).inspect_err(|err| {
        let stage = match err {
            crate::placement::RouteError::Unresolved(_) => "resolve",
            crate::placement::RouteError::NoInternalAddr(_) => "owner_address",
        };
        count(&app.metrics.routing_failures, stage);
    })?;
    let target = match route {
        Route::Local(route) => {
            count(&app.metrics.routing, "local");
            let receipt = app
                .uploads
                .ingest(Some(route), None, None, declared, body.into_data_stream())
                .await?;
            return Ok(created(receipt));
        }
        Route::Remote(target) => target,
    };
    count(&app.metrics.routing, "remote");
    let Some(forwarder) = &relay.0 else {
        count(&app.metrics.routing_failures, "forward_config");
        return Err(ApiError::new(
            ErrorCode::OwnerUnavailable,
            "this session is owned by another node and forwarding is not configured",
        ));
    };
    // The relay holds local permits for its (small) footprint; the owner admits the
    // transfer's one cluster lease in the pre-flight, before the body is read.
    let admission = app.admission.admit_relay(key.tenant).await?;
    app.metrics.forwarded_uploads.inc();
    let response = forwarder
        .relay(
            target,
            crate::relay::Relayed::Upload(key),
            &headers,
            body,
            app.cluster.as_ref(),
        )
        .await;
    admission.set_outcome(if response.status().is_success() {
        Outcome::Completed
    } else {
        Outcome::Failed
    });
    Ok(response)
}

/// The 201 response for an ingested blob: the receipt as JSON, `Location` and `ETag`.
pub fn created(receipt: UploadReceipt) -> Response {
    let location = HeaderValue::from_str(&format!("/v1/blobs/{}", receipt.key));
    let etag = HeaderValue::from_str(&receipt.etag);
    let mut response = (Answer::Created.status(), Json(receipt)).into_response();
    let headers = response.headers_mut();
    if let Ok(location) = location {
        headers.insert(header::LOCATION, location);
    }
    if let Ok(etag) = etag {
        headers.insert(header::ETAG, etag);
    }
    response
}
