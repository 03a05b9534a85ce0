//! The internal listener: owner ingest of uploads forwarded by other nodes.
//!
//! Routes (on their own port, `control.internal_listen`, private network only):
//! - `HEAD /internal/v1/sessions/{tenant}/{session}/blobs`: pre-flight. Runs every
//!   check of the POST below and answers 204, or the error the POST would get. The
//!   forwarder calls it while the upload body is still unread, so a stale epoch can be
//!   re-resolved and retried without replaying anything. After the checks the owner
//!   admits the transfer ([`OwnerIngest::reserve`]): a refusal is answered here (status,
//!   `Retry-After`, and the error code in `X-Graviton-Error`, since a HEAD answer has no
//!   body); an admission is parked and named by `X-Graviton-Admission-Reservation`.
//! - `POST /internal/v1/sessions/{tenant}/{session}/blobs`: owner ingest; the same 201
//!   (JSON receipt, `Location`, `ETag`) as a direct upload.
//!   With `X-Graviton-Admission-Reservation` the ingest adopts the pre-flight's
//!   admission instead of admitting again (one lease per transfer).
//!
//! Every check happens **before any body byte is pulled**, in this order: internal
//! token (constant time; `X-Graviton-Internal-Token` or `Authorization: Bearer`) → 401;
//! path ids canonical UUIDs → 400; `Content-Length` ASCII digits only → 400;
//! `X-Graviton-Shard` and `X-Graviton-Shard-Epoch` digits only → 400; the caller's
//! [`EpochCheck`] → 409 `stale_epoch` naming the current owner (JSON body and the
//! `X-Graviton-Current-Owner` / `X-Graviton-Current-Epoch` headers, which also survive
//! on HEAD). Only then is the body handed to the caller's [`OwnerIngest`].
//!
//! In a node both seams are bound to the real thing: [`EpochCheck`] to the placement
//! routing port (`ClusterHandle::check_forwarded`, advisory: the commit fence binds) and
//! [`OwnerIngest`] to the `upload::UploadService`, the same service direct uploads use.
//!
//! Failure model: errors are JSON `{"error","message"}` (see `edge::error`); the token
//! and tenant ids never appear in responses or logs above debug.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::head;
use axum::{Json, Router};
use futures_util::future::BoxFuture;
use serde::Serialize;

use crate::actors::ClusterHandle;
use crate::edge::headers::{bearer_token, parse_digits};
use crate::edge::{Answer, ApiError, ErrorCode};
use crate::ids::{NodeId, SessionId, SessionKey, TenantId};
use crate::placement::{Epoch, EpochVerdict, LocalRoute, ShardId};
use crate::relay::protocol::{
    CURRENT_EPOCH_HEADER, CURRENT_OWNER_HEADER, ERROR_CODE_HEADER, ERROR_MESSAGE_HEADER,
    INTERNAL_TOKEN_HEADER, RESERVATION_HEADER, SHARD_EPOCH_HEADER, SHARD_HEADER, message_header,
};
use crate::upload::UploadService;
use crate::values::Secret;

/// Implemented by the node's placement: does this node own `shard` at `epoch`?
/// `key` is given so the implementation can verify that `shard` is the key's shard.
pub trait EpochCheck: Send + Sync + 'static {
    fn check(&self, key: &SessionKey, shard: ShardId, epoch: Epoch) -> EpochVerdict;
}

impl<F> EpochCheck for F
where
    F: Fn(&SessionKey, ShardId, Epoch) -> EpochVerdict + Send + Sync + 'static,
{
    fn check(&self, key: &SessionKey, shard: ShardId, epoch: Epoch) -> EpochVerdict {
        self(key, shard, epoch)
    }
}

impl EpochCheck for ClusterHandle {
    fn check(&self, key: &SessionKey, shard: ShardId, epoch: Epoch) -> EpochVerdict {
        self.check_forwarded(key, shard, epoch)
    }
}

/// A forwarded upload that passed every check; its body is still unread.
pub struct IngestRequest {
    pub key: SessionKey,
    pub shard: ShardId,
    pub epoch: Epoch,
    /// `Content-Type` as sent (default `application/octet-stream`).
    pub content_type: String,
    /// `Content-Length` when the forwarder knew it.
    pub content_length: Option<u64>,
    /// The body's SHA-256 as the client declared it (`Content-Digest` / `X-Content-Hash`,
    /// passed on by the forwarder).
    pub digest: Option<crate::cas::digest::ContentDigest>,
    /// The admission parked by this upload's pre-flight, if the forwarder sent one.
    pub reservation: Option<String>,
    pub body: Body,
}

/// Implemented by the node's upload service: the owner-local ingest. Returns the answer
/// (201 with the receipt) or an [`ApiError`].
pub trait OwnerIngest: Send + Sync + 'static {
    fn ingest(&self, request: IngestRequest) -> BoxFuture<'static, Result<Response, ApiError>>;

    /// Admit the upload in the pre-flight, before the forwarder reads the client's body;
    /// `Some(id)` names the parked admission the POST will adopt. The default admits
    /// nothing here (the POST admits).
    fn reserve(&self, key: &SessionKey) -> BoxFuture<'static, Result<Option<String>, ApiError>> {
        let _ = key;
        Box::pin(async { Ok(None) })
    }

    /// Drop a parked admission whose POST was refused before ingest.
    fn discard(&self, key: &SessionKey, reservation: &str) {
        let _ = (key, reservation);
    }
}

impl OwnerIngest for Arc<UploadService> {
    fn ingest(&self, request: IngestRequest) -> BoxFuture<'static, Result<Response, ApiError>> {
        let uploads = self.clone();
        Box::pin(async move {
            let route = LocalRoute {
                key: request.key,
                shard: request.shard,
                epoch: request.epoch,
            };
            // The pre-flight's admission, when it is still parked; without one (an older
            // forwarder, or a reservation that expired) the service admits itself.
            let admitted = request
                .reservation
                .as_deref()
                .and_then(|id| uploads.adopt_reservation(&request.key, id));
            let body = request.body.into_data_stream();
            let receipt = UploadService::ingest(
                &uploads,
                Some(route),
                admitted,
                None,
                crate::upload::Declared {
                    length: request.content_length,
                    digest: request.digest,
                    media: crate::cas::pdf::select::MediaType::of(Some(&request.content_type)),
                },
                body,
            )
            .await?;
            Ok(super::upload::created(receipt))
        })
    }

    fn reserve(&self, key: &SessionKey) -> BoxFuture<'static, Result<Option<String>, ApiError>> {
        let uploads = self.clone();
        let key = *key;
        Box::pin(async move { Ok(Some(uploads.reserve_forwarded(&key).await?)) })
    }

    fn discard(&self, key: &SessionKey, reservation: &str) {
        self.discard_reservation(key, reservation);
    }
}

/// A reservation id as the owner issues it: 32 lowercase hex digits.
pub(crate) fn reservation_header(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(RESERVATION_HEADER) else {
        return Ok(None);
    };
    let bytes = value.as_bytes();
    if bytes.len() == 32 && bytes.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(Some(String::from_utf8_lossy(bytes).into_owned()))
    } else {
        Err(ApiError::new(
            ErrorCode::InvalidReservation,
            "X-Graviton-Admission-Reservation is malformed",
        ))
    }
}

/// A refusal answered to a HEAD pre-flight: the status, headers and error code of the
/// JSON error the POST would answer.
pub(crate) fn refused_preflight(error: ApiError) -> Response {
    let code = HeaderValue::from_static(error.code.as_str());
    let message = message_header(&error.message);
    let mut response = error.into_response();
    response.headers_mut().insert(ERROR_CODE_HEADER, code);
    if let Some(message) = message {
        response.headers_mut().insert(ERROR_MESSAGE_HEADER, message);
    }
    response
}

/// Everything the internal router needs.
#[derive(Clone)]
pub struct InternalState {
    pub token: Secret,
    pub epochs: Arc<dyn EpochCheck>,
    pub ingest: Arc<dyn OwnerIngest>,
}

/// The internal router. Serve it on its own listener (see [`serve`]).
pub fn router(state: InternalState) -> Router {
    Router::new()
        .route(
            "/internal/v1/sessions/{tenant}/{session}/blobs",
            head(preflight).post(ingest),
        )
        .layer(axum::middleware::from_fn(super::unread::close_if_unread))
        .with_state(state)
}

/// Serve `router` on `listener` until `shutdown` completes, with default connection
/// limits and no TLS (see [`serve_with`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(
        listener,
        router,
        crate::edge::listener::ServeOptions::plain(crate::edge::listener::INTERNAL),
        shutdown,
    )
    .await
}

/// Serve `router` with explicit connection limits, TLS (mutual, in a cluster) and
/// metrics (see `edge::listener`).
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    router: Router,
    options: crate::edge::listener::ServeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    crate::edge::listener::serve(listener, router, options, shutdown).await
}

/// The parsed, validated head of a forwarded upload.
pub(crate) struct Checked {
    pub(crate) key: SessionKey,
    pub(crate) shard: ShardId,
    pub(crate) epoch: Epoch,
    content_type: String,
    content_length: Option<u64>,
    digest: Option<crate::cas::digest::ContentDigest>,
}

#[derive(Serialize)]
struct StaleBody<'a> {
    error: ErrorCode,
    message: &'static str,
    current_owner: Option<&'a str>,
    current_epoch: i64,
}

fn stale_response(current_owner: Option<NodeId>, current_epoch: Epoch) -> Response {
    let body = StaleBody {
        error: ErrorCode::StaleEpoch,
        message: "the shard epoch is stale; re-resolve the owner",
        current_owner: current_owner.as_ref().map(|n| n.as_str()),
        current_epoch: current_epoch.0,
    };
    let mut response = (ErrorCode::StaleEpoch.status(), Json(body)).into_response();
    let headers = response.headers_mut();
    if let Some(owner) = current_owner.and_then(|n| HeaderValue::from_str(n.as_str()).ok()) {
        headers.insert(CURRENT_OWNER_HEADER, owner);
    }
    headers.insert(CURRENT_EPOCH_HEADER, HeaderValue::from(current_epoch.0));
    response
}

fn presented_token(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(value) = headers.get(INTERNAL_TOKEN_HEADER) {
        return Some(value.as_bytes());
    }
    bearer_token(headers).ok().map(str::as_bytes)
}

fn numeric_header<T: TryFrom<u64>>(
    headers: &HeaderMap,
    name: &'static str,
    code: ErrorCode,
) -> Result<T, ApiError> {
    let value = headers
        .get(name)
        .ok_or_else(|| ApiError::new(code, format!("the {name} header is required")))?;
    parse_digits(value.as_bytes())
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| ApiError::new(code, format!("the {name} header must be ASCII digits")))
}

/// Why a forwarded upload is refused before its body is read.
pub(crate) enum Refusal {
    Api(ApiError),
    Stale {
        current_owner: Option<NodeId>,
        current_epoch: Epoch,
    },
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::Api(error) => error.into_response(),
            Refusal::Stale {
                current_owner,
                current_epoch,
            } => stale_response(current_owner, current_epoch),
        }
    }
}

pub(crate) fn check(
    state: &InternalState,
    tenant: &str,
    session: &str,
    headers: &HeaderMap,
) -> Result<Checked, Refusal> {
    let token_ok = presented_token(headers).is_some_and(|t| state.token.matches(t));
    if !token_ok {
        return Err(Refusal::Api(ApiError::new(
            ErrorCode::Unauthorized,
            "missing or invalid internal credentials",
        )));
    }
    let (Ok(tenant), Ok(session)) = (tenant.parse::<TenantId>(), session.parse::<SessionId>())
    else {
        return Err(Refusal::Api(ApiError::new(
            ErrorCode::InvalidSession,
            "tenant and session must be canonical UUIDs",
        )));
    };
    let key = SessionKey { tenant, session };
    let content_length = crate::edge::headers::content_length(headers).map_err(Refusal::Api)?;
    let digest = crate::edge::headers::content_digest(headers).map_err(Refusal::Api)?;
    let content_type = match headers.get(header::CONTENT_TYPE) {
        None => "application/octet-stream".to_string(),
        Some(value) => value
            .to_str()
            .ok()
            .filter(|v| !v.trim().is_empty() && v.contains('/'))
            .map(str::to_string)
            .ok_or_else(|| {
                Refusal::Api(ApiError::new(
                    ErrorCode::InvalidContentType,
                    "Content-Type is malformed",
                ))
            })?,
    };
    let shard = ShardId(
        numeric_header::<u32>(headers, SHARD_HEADER, ErrorCode::InvalidShard)
            .map_err(Refusal::Api)?,
    );
    let epoch = Epoch(
        numeric_header::<i64>(headers, SHARD_EPOCH_HEADER, ErrorCode::InvalidEpoch)
            .map_err(Refusal::Api)?,
    );
    match state.epochs.check(&key, shard, epoch) {
        EpochVerdict::Current => {}
        EpochVerdict::Stale {
            current_owner,
            current_epoch,
        } => {
            tracing::debug!(
                shard = shard.0,
                epoch = epoch.0,
                current_epoch = current_epoch.0,
                "internal ingest refused: stale epoch"
            );
            return Err(Refusal::Stale {
                current_owner,
                current_epoch,
            });
        }
    }
    Ok(Checked {
        key,
        shard,
        epoch,
        content_type,
        content_length,
        digest,
    })
}

async fn preflight(
    State(state): State<InternalState>,
    Path((tenant, session)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let checked = match check(&state, &tenant, &session, &headers) {
        Ok(checked) => checked,
        Err(Refusal::Api(error)) => return refused_preflight(error),
        Err(refusal) => return refusal.into_response(),
    };
    match state.ingest.reserve(&checked.key).await {
        Ok(None) => Answer::NoContent.into_response(),
        Ok(Some(id)) => {
            let mut response = Answer::NoContent.into_response();
            if let Ok(value) = HeaderValue::from_str(&id) {
                response.headers_mut().insert(RESERVATION_HEADER, value);
            }
            response
        }
        Err(error) => refused_preflight(error),
    }
}

async fn ingest(
    State(state): State<InternalState>,
    Path((tenant, session)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let reservation = match reservation_header(&headers) {
        Ok(reservation) => reservation,
        Err(error) => return error.into_response(),
    };
    let checked = match check(&state, &tenant, &session, &headers) {
        Ok(checked) => checked,
        Err(refusal) => {
            // Only a stale epoch comes after the token check: then the parked admission
            // of this upload is of no use any more (the forwarder re-resolves).
            if let (Refusal::Stale { .. }, Some(id), Ok(tenant), Ok(session)) = (
                &refusal,
                &reservation,
                tenant.parse::<TenantId>(),
                session.parse::<SessionId>(),
            ) {
                state.ingest.discard(&SessionKey { tenant, session }, id);
            }
            return refusal.into_response();
        }
    };
    let request = IngestRequest {
        key: checked.key,
        shard: checked.shard,
        epoch: checked.epoch,
        content_type: checked.content_type,
        content_length: checked.content_length,
        digest: checked.digest,
        reservation,
        body,
    };
    match state.ingest.ingest(request).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_response_names_the_owner_in_body_and_headers() {
        let response = stale_response(Some(NodeId::parse("node-c").unwrap()), Epoch(9));
        assert_eq!(response.status(), ErrorCode::StaleEpoch.status());
        assert_eq!(response.headers()[CURRENT_OWNER_HEADER], "node-c");
        assert_eq!(response.headers()[CURRENT_EPOCH_HEADER], "9");
    }
}
