//! Forwarding of tus requests (`/v1/uploads/{id}`) from a non-owner to the owner's
//! internal listener (`/internal/v1/uploads/{id}`, `http::tus_internal`), so a client may
//! resume through any node.
//!
//! The same protocol as a plain upload: a PATCH is first pre-flighted with
//! `HEAD /internal/v1/uploads/{id}/part` (the owner checks the upload, the offset and the
//! length and admits the part, all before the client's body is read); a stale epoch is
//! re-resolved once; then the request is streamed with the body untouched until the
//! owner pulls it. HEAD, DELETE and POST (creation) go without a pre-flight: they carry
//! no body, except a creation-with-upload, which the owner admits before reading it.
//! The owner's status, tus headers and JSON body are relayed.

use std::sync::atomic::Ordering;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::source::Source;
use super::{Forwarder, OwnerResolver, read_capped, stale_from};
use crate::edge::ApiError;
use crate::http::internal::{
    CURRENT_EPOCH_HEADER, ERROR_CODE_HEADER, INTERNAL_TOKEN_HEADER, RESERVATION_HEADER,
    SHARD_EPOCH_HEADER, SHARD_HEADER,
};
use crate::placement::{OwnerTarget, StaleEpoch};
use crate::tus::{self, UploadId};

/// The owner-side path of an upload.
pub fn tus_path(id: &UploadId) -> String {
    format!("/internal/v1/uploads/{id}")
}

/// Request headers the owner needs (everything else is the relay's business).
const PASSED: &[&str] = &[
    "content-type",
    "content-length",
    tus::TUS_RESUMABLE,
    tus::UPLOAD_LENGTH,
    tus::UPLOAD_OFFSET,
    tus::UPLOAD_METADATA,
    tus::UPLOAD_CHECKSUM,
    tus::UPLOAD_DEFER_LENGTH,
];

/// Answer headers the client needs.
const RELAYED: &[&str] = &[
    "content-type",
    "retry-after",
    "location",
    "cache-control",
    tus::TUS_RESUMABLE,
    tus::TUS_VERSION,
    tus::UPLOAD_OFFSET,
    tus::UPLOAD_LENGTH,
    tus::UPLOAD_EXPIRES,
    tus::UPLOAD_METADATA,
    tus::BLOB_KEY,
];

enum Step {
    Done(Response),
    Stale(StaleEpoch),
}

impl Forwarder {
    fn tus_request(
        &self,
        method: reqwest::Method,
        path: &str,
        target: &OwnerTarget,
        headers: &HeaderMap,
    ) -> reqwest::RequestBuilder {
        let mut request = self
            .client
            .request(
                method,
                format!("{}://{}{path}", self.scheme, target.internal_addr),
            )
            .header(INTERNAL_TOKEN_HEADER, self.token.clone())
            .header(SHARD_HEADER, target.shard.0)
            .header(SHARD_EPOCH_HEADER, target.epoch.0);
        for name in PASSED {
            if let Some(value) = headers.get(*name) {
                request = request.header(*name, value.clone());
            }
        }
        request
    }

    /// Forward one tus request for `id` to `target` (see the module docs). `method` is
    /// the client's; a PATCH is pre-flighted. Always returns a response.
    pub async fn forward_tus(
        &self,
        target: OwnerTarget,
        id: UploadId,
        method: reqwest::Method,
        headers: &HeaderMap,
        body: Body,
        resolver: &dyn OwnerResolver,
    ) -> Response {
        self.stats.forwards.fetch_add(1, Ordering::Relaxed);
        let preflight = method == reqwest::Method::PATCH;
        let source = Source::new(body);
        let mut target = target;
        let mut retried = false;
        loop {
            let step = self
                .tus_once(&target, &id, method.clone(), headers, &source, preflight)
                .await;
            let stale = match step {
                Step::Done(response) => return response,
                Step::Stale(stale) if source.untouched() || source.reclaim() => stale,
                Step::Stale(_) => {
                    return super::owner_moved("the owner changed while the upload was streaming");
                }
            };
            if retried {
                return super::owner_moved("the owner changed again while re-routing");
            }
            retried = true;
            self.stats.stale_retries.fetch_add(1, Ordering::Relaxed);
            let resolved =
                tokio::time::timeout(self.head_deadline, resolver.re_resolve(&id.key(), &stale))
                    .await;
            target = match resolved {
                Ok(Ok(next)) => next,
                Ok(Err(error)) => return ApiError::from(error).into_response(),
                Err(_) => {
                    return self.unavailable("the upload's owner could not be resolved in time");
                }
            };
        }
    }

    async fn tus_once(
        &self,
        target: &OwnerTarget,
        id: &UploadId,
        method: reqwest::Method,
        headers: &HeaderMap,
        source: &Source,
        preflight: bool,
    ) -> Step {
        let path = tus_path(id);
        let mut reservation = None;
        if preflight {
            let send = self
                .tus_request(
                    reqwest::Method::HEAD,
                    &format!("{path}/part"),
                    target,
                    headers,
                )
                .send();
            let deadline = self.head_deadline + self.admission_wait;
            let response = match tokio::time::timeout(deadline, send).await {
                Ok(Ok(response)) => response,
                Ok(Err(_)) | Err(_) => {
                    tracing::warn!(owner = %target.node, "forward: owner pre-flight failed");
                    return Step::Done(self.unavailable("the owner node is unreachable"));
                }
            };
            match response.status() {
                StatusCode::NO_CONTENT | StatusCode::OK => {
                    reservation = response.headers().get(RESERVATION_HEADER).cloned();
                }
                StatusCode::CONFLICT if response.headers().contains_key(CURRENT_EPOCH_HEADER) => {
                    return Step::Stale(stale_from(target, response.headers()));
                }
                StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                    tracing::error!(owner = %target.node, "forward: owner rejected the internal token");
                    return Step::Done(self.unavailable("the owner node refused the upload"));
                }
                status => return Step::Done(refusal_from_head(status, response.headers())),
            }
        }
        let mut request = self.tus_request(method, &path, target, headers);
        if let Some(value) = reservation {
            request = request.header(RESERVATION_HEADER, value);
        }
        let tap = source.tap(self.stats.clone());
        let send = request.body(reqwest::Body::wrap_stream(tap)).send();
        let response = tokio::select! {
            sent = send => match sent {
                Ok(response) => response,
                Err(error) => return Step::Done(self.failure(target, source, &error)),
            },
            _ = source.owner_silent(self.silence) => return Step::Done(self.silent(target, source)),
        };
        let status = response.status();
        if status == StatusCode::CONFLICT && response.headers().contains_key(CURRENT_EPOCH_HEADER) {
            return Step::Stale(stale_from(target, response.headers()));
        }
        // The relay verified the client's token; the owner checks only the internal one.
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            tracing::error!(owner = %target.node, "forward: owner rejected the internal token");
            return Step::Done(self.unavailable("the owner node refused the upload"));
        }
        let relayed = relayed_headers(response.headers());
        let Ok(read) = tokio::time::timeout(self.silence, read_capped(response)).await else {
            return Step::Done(self.silent(target, source));
        };
        match read {
            Ok(Some(bytes)) => {
                let mut answer = (status, bytes).into_response();
                for (name, value) in relayed {
                    answer.headers_mut().insert(name, value);
                }
                Step::Done(answer)
            }
            Ok(None) => Step::Done(self.owner_failed("the owner node sent an invalid answer")),
            Err(error) => Step::Done(self.failure(target, source, &error)),
        }
    }
}

fn relayed_headers(headers: &reqwest::header::HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    RELAYED
        .iter()
        .filter_map(|name| {
            let value = headers.get(*name)?.clone();
            Some((HeaderName::from_static(name), value))
        })
        .collect()
}

/// A refused pre-flight as the client's answer: the owner's status, its error code
/// (`X-Graviton-Error`, a HEAD has no body) and the tus headers it sent.
fn refusal_from_head(status: StatusCode, headers: &reqwest::header::HeaderMap) -> Response {
    let code = headers
        .get(ERROR_CODE_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|c| c.len() <= 64 && c.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
        .unwrap_or("owner_refused")
        .to_string();
    // The owner's reason when it sent one (`X-Graviton-Error-Message`).
    let message = crate::http::internal::relayed_message(headers)
        .unwrap_or_else(|| "the owner node refused the upload".to_string());
    let body = serde_json::json!({
        "error": code,
        "message": message,
    });
    let mut answer = (status, axum::Json(body)).into_response();
    for (name, value) in relayed_headers(headers) {
        if name != "content-type" {
            answer.headers_mut().insert(name, value);
        }
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_of(response: Response) -> serde_json::Value {
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    // Checks OPS-8.
    #[tokio::test]
    async fn a_refused_part_pre_flight_keeps_the_owners_code_and_reason() {
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(
            ERROR_CODE_HEADER,
            HeaderValue::from_static("transfer_admission_limited"),
        );
        headers.insert(
            crate::http::internal::ERROR_MESSAGE_HEADER,
            HeaderValue::from_static("the transfer exceeds an admission ceiling"),
        );
        headers.insert("retry-after", HeaderValue::from_static("2"));
        let answer = refusal_from_head(StatusCode::TOO_MANY_REQUESTS, &headers);
        assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(answer.headers()["retry-after"], "2");
        let body = body_of(answer).await;
        assert_eq!(body["error"], "transfer_admission_limited");
        assert_eq!(body["message"], "the transfer exceeds an admission ceiling");
        // An owner that sent no message (an older one): the generic reason.
        headers.remove(crate::http::internal::ERROR_MESSAGE_HEADER);
        let body = body_of(refusal_from_head(StatusCode::TOO_MANY_REQUESTS, &headers)).await;
        assert_eq!(body["message"], "the owner node refused the upload");
    }
}
