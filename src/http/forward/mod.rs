//! The forwarding client: streams an upload body from a non-owner to the owner's
//! internal listener, exactly once.
//!
//! Protocol (see docs/control-plane.md):
//! 1. **Pre-flight** `HEAD /internal/v1/sessions/{t}/{s}/blobs` with the token, shard
//!    and epoch. The body is untouched. `409 stale_epoch` → ask the caller's
//!    [`OwnerResolver`] once for the current owner and pre-flight again.
//! 2. **Stream** `POST` the same path with the original body wrapped, frame by frame,
//!    in `reqwest::Body::wrap_stream` (no buffering beyond the frames hyper holds, no
//!    replay). `Content-Type`, `Content-Length`, `Content-Digest` and `X-Content-Hash`
//!    are copied.
//! 3. **Relay** the owner's status, JSON body (capped at 1 MiB) and its `Content-Type`,
//!    `Retry-After`, `Location` and `ETag` headers.
//!
//! Admission hand-over: the owner admits the upload in the pre-flight (one cluster lease
//! for the whole transfer) and names the parked admission in
//! `X-Graviton-Admission-Reservation`, which the POST repeats so the owner adopts it. A
//! pre-flight refused by admission (or any owner check) is answered to the client with
//! the owner's status, error code (`X-Graviton-Error`) and `Retry-After`, before a byte of
//! the client's body is read. The pre-flight may wait up to the admission wait budget
//! ([`Forwarder::with_admission_wait`]) on top of the connect and read timeouts.
//!
//! If the epoch moves between pre-flight and POST, the owner still refuses before
//! reading; the forwarder retries (once in total) only if no byte of the body was
//! pulled yet, else it answers `503 owner_moved` with `Retry-After`.
//!
//! Failure model: one shared `reqwest::Client` with a connect timeout and no total
//! deadline (long uploads are fine, stalls are not). `forward_read_timeout` bounds the
//! owner's *silence*: the time during which the owner neither pulls body bytes that the
//! client has already sent nor answers. A client that trickles its body slowly is not
//! the owner's silence: while the forwarder waits on the client, the clock does not run. Owner unreachable →
//! `503 owner_unavailable`; owner lost mid-stream → `502 owner_unavailable`; both with
//! `Retry-After`. The client's own body failing → `400 upload_interrupted`. Nothing
//! waits without a deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::future::BoxFuture;

use crate::values::Secret;
mod source;
mod tus;

pub use tus::tus_path;

use source::Source;

use crate::actors::ClusterHandle;
use crate::http::ApiError;
use crate::http::error::RETRY_OWNERSHIP;
use crate::http::headers::{CONTENT_DIGEST_HEADER, CONTENT_HASH_HEADER, parse_digits};
use crate::http::internal::{
    CURRENT_EPOCH_HEADER, CURRENT_OWNER_HEADER, ERROR_CODE_HEADER, INTERNAL_TOKEN_HEADER,
    RESERVATION_HEADER, SHARD_EPOCH_HEADER, SHARD_HEADER, ingest_path, relayed_message,
};
use crate::ids::{NodeId, SessionKey};
use crate::placement::{Epoch, OwnerTarget, RouteError, StaleEpoch};

/// Largest owner response relayed (the owner answers a small JSON document).
pub const MAX_OWNER_RESPONSE_BYTES: usize = 1024 * 1024;

/// Implemented by the node's placement (`ClusterHandle`): find the current owner after a
/// stale epoch (e.g. re-read the shard table). Tests give fixed answers.
pub trait OwnerResolver: Send + Sync {
    fn re_resolve<'a>(
        &'a self,
        key: &'a SessionKey,
        stale: &'a StaleEpoch,
    ) -> BoxFuture<'a, Result<OwnerTarget, RouteError>>;
}

impl OwnerResolver for ClusterHandle {
    fn re_resolve<'a>(
        &'a self,
        key: &'a SessionKey,
        stale: &'a StaleEpoch,
    ) -> BoxFuture<'a, Result<OwnerTarget, RouteError>> {
        Box::pin(ClusterHandle::re_resolve(self, key, stale))
    }
}

/// Forwarding options.
#[derive(Debug, Clone)]
pub struct ForwardOptions {
    pub token: Secret,
    pub connect_timeout: Duration,
    /// Longest silence of the owner (see the module docs); there is no total deadline.
    pub read_timeout: Duration,
}

impl ForwardOptions {
    /// Options from the `[control]` section; `None` without an internal token.
    pub fn from_config(config: &crate::control::ControlConfig) -> Option<Self> {
        Some(Self {
            token: config.internal_token.clone()?,
            connect_timeout: config.forward_connect_timeout.get(),
            read_timeout: config.forward_read_timeout.get(),
        })
    }
}

/// Counters (process-wide totals; no ids).
#[derive(Debug, Default)]
pub struct ForwardStats {
    /// Body bytes pulled from inbound uploads.
    pub bytes_pulled: AtomicU64,
    pub forwards: AtomicU64,
    pub stale_retries: AtomicU64,
    pub owner_failures: AtomicU64,
}

/// The forwarding client. Clone it freely: one connection pool is shared.
#[derive(Clone)]
pub struct Forwarder {
    client: reqwest::Client,
    /// The internal token, marked sensitive (never shown by header `Debug`).
    token: HeaderValue,
    head_deadline: Duration,
    /// Longest silence of the owner during a streamed POST.
    silence: Duration,
    /// Extra time a pre-flight may take while the owner waits for admission.
    admission_wait: Duration,
    stats: Arc<ForwardStats>,
    /// `https` with `[http.internal_tls]`, else `http`.
    scheme: &'static str,
}

enum Preflight {
    /// Go ahead; the owner's parked admission, when it made one.
    Go(Option<HeaderValue>),
    Stale(StaleEpoch),
    Refuse(Response),
}

/// Why a [`Forwarder`] could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ForwarderError {
    #[error("HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("the internal token is not a valid header value")]
    Token,
    #[error("internal TLS: {0}")]
    Tls(String),
}

impl Forwarder {
    pub fn new(options: ForwardOptions) -> Result<Self, ForwarderError> {
        Self::build(options, None)
    }

    /// A forwarder that speaks HTTPS to owners, presenting this node's certificate and
    /// trusting only the cluster CA (`[http.internal_tls]`, see `http::tls`).
    pub fn with_mutual_tls(
        options: ForwardOptions,
        tls: &crate::http::config::InternalTlsConfig,
    ) -> Result<Self, ForwarderError> {
        let read = |path: &Option<std::path::PathBuf>| {
            path.as_deref()
                .ok_or_else(|| ForwarderError::Tls("http.internal_tls is incomplete".into()))
                .and_then(|p| {
                    std::fs::read(p)
                        .map_err(|e| ForwarderError::Tls(format!("{}: {e}", p.display())))
                })
        };
        let mut identity = read(&tls.cert_file)?;
        identity.push(b'\n');
        identity.extend(read(&tls.key_file)?);
        let identity = reqwest::Identity::from_pem(&identity)?;
        let ca = reqwest::Certificate::from_pem_bundle(&read(&tls.ca_file)?)?;
        Self::build(options, Some((identity, ca)))
    }

    fn build(
        options: ForwardOptions,
        tls: Option<(reqwest::Identity, Vec<reqwest::Certificate>)>,
    ) -> Result<Self, ForwarderError> {
        let mut token =
            HeaderValue::from_str(options.token.expose()).map_err(|_| ForwarderError::Token)?;
        token.set_sensitive(true);
        let mut builder = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(options.connect_timeout)
            .tcp_nodelay(true)
            .http1_only()
            .pool_idle_timeout(Duration::from_secs(30));
        let scheme = match tls {
            Some((identity, ca)) => {
                builder = builder.tls_certs_only(ca).identity(identity);
                "https"
            }
            None => "http",
        };
        let client = builder.build()?;
        Ok(Self {
            client,
            token,
            head_deadline: options.connect_timeout + options.read_timeout,
            silence: options.read_timeout,
            admission_wait: Duration::ZERO,
            stats: Arc::default(),
            scheme,
        })
    }

    /// Let a pre-flight wait `wait` longer for the owner's admission decision (the
    /// owner's `admission.acquisition_timeout`).
    pub fn with_admission_wait(mut self, wait: Duration) -> Self {
        self.admission_wait = wait;
        self
    }

    pub fn stats(&self) -> &Arc<ForwardStats> {
        &self.stats
    }

    /// Forward one upload to `target`, re-resolving once on a stale epoch. Always
    /// returns a response; never panics, never waits without a deadline.
    pub async fn forward_upload(
        &self,
        target: OwnerTarget,
        key: SessionKey,
        headers: &HeaderMap,
        body: Body,
        resolver: &dyn OwnerResolver,
    ) -> Response {
        self.stats.forwards.fetch_add(1, Ordering::Relaxed);
        let source = Source::new(body);
        let mut target = target;
        let mut retried = false;
        loop {
            let stale = match self.preflight(&target, &key, headers).await {
                Preflight::Refuse(response) => return response,
                Preflight::Stale(stale) => stale,
                Preflight::Go(reservation) => match self
                    .post(&target, &key, headers, reservation, &source)
                    .await
                {
                    Ok(response) => return response,
                    Err(stale) if source.reclaim() => stale,
                    Err(_) => {
                        return owner_moved("the owner changed while the upload was streaming");
                    }
                },
            };
            if retried {
                return owner_moved("the owner changed again while re-routing");
            }
            retried = true;
            self.stats.stale_retries.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(refused_by = %stale.refused_by, "forward: stale epoch, re-resolving");
            let resolved =
                tokio::time::timeout(self.head_deadline, resolver.re_resolve(&key, &stale)).await;
            target = match resolved {
                Ok(Ok(next)) => next,
                Ok(Err(error)) => return ApiError::from(error).into_response(),
                Err(_) => {
                    return self.unavailable(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the session's owner could not be resolved in time",
                    );
                }
            };
        }
    }

    fn url(&self, target: &OwnerTarget, key: &SessionKey) -> String {
        format!(
            "{}://{}{}",
            self.scheme,
            target.internal_addr,
            ingest_path(key)
        )
    }

    fn request(
        &self,
        method: reqwest::Method,
        target: &OwnerTarget,
        key: &SessionKey,
        headers: &HeaderMap,
    ) -> reqwest::RequestBuilder {
        let mut request = self
            .client
            .request(method, self.url(target, key))
            .header(INTERNAL_TOKEN_HEADER, self.token.clone())
            .header(SHARD_HEADER, target.shard.0)
            .header(SHARD_EPOCH_HEADER, target.epoch.0);
        // The owner checks the declared digest before its commit: pass it on.
        for name in [
            header::CONTENT_TYPE.as_str(),
            CONTENT_DIGEST_HEADER,
            CONTENT_HASH_HEADER,
        ] {
            if let Some(value) = headers.get(name) {
                request = request.header(name, value.clone());
            }
        }
        request
    }

    async fn preflight(
        &self,
        target: &OwnerTarget,
        key: &SessionKey,
        headers: &HeaderMap,
    ) -> Preflight {
        let send = self
            .request(reqwest::Method::HEAD, target, key, headers)
            .send();
        let deadline = self.head_deadline + self.admission_wait;
        let response = match tokio::time::timeout(deadline, send).await {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => {
                tracing::warn!(owner = %target.node, error = %error.without_url(), "forward: owner unreachable");
                return Preflight::Refuse(self.unavailable(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the owner node is unreachable",
                ));
            }
            Err(_) => {
                tracing::warn!(owner = %target.node, "forward: owner pre-flight timed out");
                return Preflight::Refuse(self.unavailable(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the owner node did not answer in time",
                ));
            }
        };
        match response.status() {
            StatusCode::NO_CONTENT | StatusCode::OK => {
                Preflight::Go(response.headers().get(RESERVATION_HEADER).cloned())
            }
            StatusCode::CONFLICT => Preflight::Stale(stale_from(target, response.headers())),
            status if relayed_refusal(status, response.headers()).is_some() => {
                let error = relayed_refusal(status, response.headers()).expect("checked");
                tracing::debug!(owner = %target.node, %status, code = error.code, "forward: owner refused the upload in the pre-flight");
                Preflight::Refuse(error.into_response())
            }
            status => {
                let headers = response.headers();
                let code = headers
                    .get(ERROR_CODE_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .filter(|c| {
                        c.len() <= 64 && c.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
                    })
                    .unwrap_or("no code");
                tracing::error!(owner = %target.node, %status, code, "forward: owner refused the pre-flight");
                // Not a code the client may act on as ours: still say what the owner said.
                let reason = match relayed_message(headers) {
                    Some(message) => format!(
                        "the owner node refused the upload ({} {code}: {message})",
                        status.as_u16()
                    ),
                    None => format!(
                        "the owner node refused the upload ({} {code})",
                        status.as_u16()
                    ),
                };
                self.stats.owner_failures.fetch_add(1, Ordering::Relaxed);
                Preflight::Refuse(
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "owner_unavailable", reason)
                        .with_retry_after(RETRY_OWNERSHIP)
                        .into_response(),
                )
            }
        }
    }

    /// `Err` only for a stale epoch refused by the owner (the caller decides whether
    /// the body is still intact).
    async fn post(
        &self,
        target: &OwnerTarget,
        key: &SessionKey,
        headers: &HeaderMap,
        reservation: Option<HeaderValue>,
        source: &Source,
    ) -> Result<Response, StaleEpoch> {
        let mut request = self.request(reqwest::Method::POST, target, key, headers);
        if let Some(value) = headers.get(header::CONTENT_LENGTH) {
            request = request.header(header::CONTENT_LENGTH, value.clone());
        }
        if let Some(value) = reservation {
            request = request.header(RESERVATION_HEADER, value);
        }
        let tap = source.tap(self.stats.clone());
        let send = request.body(reqwest::Body::wrap_stream(tap)).send();
        let response = tokio::select! {
            sent = send => match sent {
                Ok(response) => response,
                Err(error) => return Ok(self.failure(target, source, &error)),
            },
            _ = source.owner_silent(self.silence) => return Ok(self.silent(target, source)),
        };
        let status = response.status();
        // Only a stale-epoch refusal names the current epoch; any other 409 (for example
        // `session_busy`) is the owner's answer and is relayed as it is.
        if status == StatusCode::CONFLICT && response.headers().contains_key(CURRENT_EPOCH_HEADER) {
            return Err(stale_from(target, response.headers()));
        }
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            tracing::error!(owner = %target.node, "forward: owner rejected the internal token");
            return Ok(self.unavailable(
                StatusCode::SERVICE_UNAVAILABLE,
                "the owner node refused the upload",
            ));
        }
        // The owner's answer headers that matter to the client.
        let relayed_headers: Vec<_> = [
            header::CONTENT_TYPE,
            header::RETRY_AFTER,
            header::LOCATION,
            header::ETAG,
        ]
        .into_iter()
        .filter_map(|name| {
            let value = response.headers().get(&name)?.clone();
            Some((name, value))
        })
        .collect();
        let Ok(read) = tokio::time::timeout(self.silence, read_capped(response)).await else {
            return Ok(self.silent(target, source));
        };
        match read {
            Ok(None) => {
                tracing::error!(owner = %target.node, "forward: owner answer exceeds 1 MiB");
                Ok(self.unavailable(
                    StatusCode::BAD_GATEWAY,
                    "the owner node sent an invalid answer",
                ))
            }
            Ok(Some(bytes)) => {
                let mut relayed = (status, bytes).into_response();
                for (name, value) in relayed_headers {
                    relayed.headers_mut().insert(name, value);
                }
                Ok(relayed)
            }
            Err(error) => Ok(self.failure(target, source, &error)),
        }
    }

    fn failure(&self, target: &OwnerTarget, source: &Source, error: &reqwest::Error) -> Response {
        if source.failed() {
            return ApiError::bad_request(
                "upload_interrupted",
                "the upload body ended with an error",
            )
            .into_response();
        }
        tracing::warn!(owner = %target.node, error = %ErrorChain(error), "forward: owner failed during the upload");
        if source.untouched() {
            // Nothing of the body was pulled: the client may retry at once.
            self.unavailable(
                StatusCode::SERVICE_UNAVAILABLE,
                "the owner node is unreachable",
            )
        } else {
            self.unavailable(
                StatusCode::BAD_GATEWAY,
                "the owner node failed during the upload; retry it",
            )
        }
    }

    fn silent(&self, target: &OwnerTarget, source: &Source) -> Response {
        tracing::warn!(owner = %target.node, silence = ?self.silence, "forward: the owner went silent during the upload");
        if source.untouched() {
            self.unavailable(
                StatusCode::SERVICE_UNAVAILABLE,
                "the owner node did not answer in time",
            )
        } else {
            self.unavailable(
                StatusCode::BAD_GATEWAY,
                "the owner node stopped reading the upload; retry it",
            )
        }
    }

    fn unavailable(&self, status: StatusCode, message: &'static str) -> Response {
        self.stats.owner_failures.fetch_add(1, Ordering::Relaxed);
        ApiError::new(status, "owner_unavailable", message)
            .with_retry_after(RETRY_OWNERSHIP)
            .into_response()
    }
}

/// Error codes an owner may answer to a pre-flight that the forwarder passes on to the
/// client unchanged (admission, quota and session capacity refusals).
const RELAYED_CODES: &[&str] = &[
    "transfer_admission_limited",
    "transfer_admission_busy",
    "admission_unavailable",
    "quota_exceeded",
    "shard_unavailable",
    "session_unavailable",
    "session_capacity",
    "blob_too_large",
];

/// The client-facing error of a pre-flight the owner refused with a relayable code:
/// the owner's status, code and `Retry-After` (whole seconds).
fn relayed_refusal(status: StatusCode, headers: &HeaderMap) -> Option<ApiError> {
    if !(status.is_client_error() || status.is_server_error())
        || matches!(
            status,
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN | StatusCode::CONFLICT
        )
    {
        return None;
    }
    let presented = headers.get(ERROR_CODE_HEADER)?.as_bytes();
    let code = RELAYED_CODES
        .iter()
        .copied()
        .find(|c| c.as_bytes() == presented)?;
    // The owner's own message (the reason), or a generic one from an older owner.
    let message =
        relayed_message(headers).unwrap_or_else(|| "the owner node refused the upload".to_string());
    let mut error = ApiError::new(status, code, message);
    if let Some(secs) = headers
        .get(header::RETRY_AFTER)
        .and_then(|v| parse_digits(v.as_bytes()))
    {
        error = error.with_retry_after(Duration::from_secs(secs.min(3600)));
    }
    Some(error)
}

fn owner_moved(message: &'static str) -> Response {
    ApiError::unavailable("owner_moved", message)
        .with_retry_after(RETRY_OWNERSHIP)
        .into_response()
}

fn stale_from(target: &OwnerTarget, headers: &HeaderMap) -> StaleEpoch {
    let current_owner = headers
        .get(CURRENT_OWNER_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| NodeId::parse(s).ok());
    let current_epoch = headers
        .get(CURRENT_EPOCH_HEADER)
        .and_then(|v| parse_digits(v.as_bytes()))
        .and_then(|n| i64::try_from(n).ok())
        .map(Epoch);
    StaleEpoch {
        refused_by: target.node.clone(),
        current_owner,
        current_epoch,
    }
}

/// The owner's answer, or `None` when it exceeds [`MAX_OWNER_RESPONSE_BYTES`].
async fn read_capped(mut response: reqwest::Response) -> Result<Option<Bytes>, reqwest::Error> {
    let mut out = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if out.len() + chunk.len() > MAX_OWNER_RESPONSE_BYTES {
            return Ok(None);
        }
        out.extend_from_slice(&chunk);
    }
    Ok(Some(Bytes::from(out)))
}

/// Walks `source()` so logs show the root cause, without the URL (it has ids).
struct ErrorChain<'a>(&'a reqwest::Error);

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut current: Option<&dyn std::error::Error> = Some(self.0);
        let mut first = true;
        while let Some(error) = current {
            if !first {
                f.write_str(": ")?;
            }
            if first {
                write!(f, "{}", kind(self.0))?;
            } else {
                write!(f, "{error}")?;
            }
            first = false;
            current = error.source();
        }
        Ok(())
    }
}

fn kind(error: &reqwest::Error) -> &'static str {
    if error.is_connect() {
        "connect"
    } else if error.is_timeout() {
        "timeout"
    } else if error.is_body() {
        "body"
    } else if error.is_request() {
        "request"
    } else {
        "other"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Checks OPS-8.
    #[test]
    fn owner_refusals_keep_their_status_code_and_retry_after() {
        let mut headers = HeaderMap::new();
        headers.insert(
            ERROR_CODE_HEADER,
            HeaderValue::from_static("transfer_admission_busy"),
        );
        headers.insert(header::RETRY_AFTER, HeaderValue::from_static("3"));
        let error = relayed_refusal(StatusCode::SERVICE_UNAVAILABLE, &headers).unwrap();
        assert_eq!(error.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(error.code, "transfer_admission_busy");
        assert_eq!(error.retry_after, Some(Duration::from_secs(3)));
        // No message from the owner (an older one): the generic reason.
        assert_eq!(error.message, "the owner node refused the upload");
        // The owner's message is its reason, relayed as it is.
        let owner = crate::http::internal::message_header("transfer capacity is busy; retry later")
            .unwrap();
        headers.insert(crate::http::internal::ERROR_MESSAGE_HEADER, owner);
        let error = relayed_refusal(StatusCode::SERVICE_UNAVAILABLE, &headers).unwrap();
        assert_eq!(error.message, "transfer capacity is busy; retry later");
        // Only printable ASCII crosses: anything else is replaced, never dropped silently.
        assert_eq!(
            crate::http::internal::message_header("caf\u{e9}\nx").unwrap(),
            "caf??x"
        );
        headers.remove(crate::http::internal::ERROR_MESSAGE_HEADER);
        // Token refusals and stale epochs are not relayed; unknown codes neither.
        assert!(relayed_refusal(StatusCode::UNAUTHORIZED, &headers).is_none());
        assert!(relayed_refusal(StatusCode::CONFLICT, &headers).is_none());
        headers.insert(ERROR_CODE_HEADER, HeaderValue::from_static("made_up"));
        assert!(relayed_refusal(StatusCode::SERVICE_UNAVAILABLE, &headers).is_none());
        headers.insert(
            ERROR_CODE_HEADER,
            HeaderValue::from_static("quota_exceeded"),
        );
        headers.remove(header::RETRY_AFTER);
        let error = relayed_refusal(StatusCode::TOO_MANY_REQUESTS, &headers).unwrap();
        assert_eq!((error.code, error.retry_after), ("quota_exceeded", None));
    }

    #[test]
    fn content_length_is_digits_only() {
        let mut headers = HeaderMap::new();
        assert_eq!(
            crate::http::headers::content_length(&headers).unwrap(),
            None
        );
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0042"));
        assert_eq!(
            crate::http::headers::content_length(&headers).unwrap(),
            Some(42)
        );
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("+42"));
        assert_eq!(
            crate::http::headers::content_length(&headers)
                .unwrap_err()
                .code,
            "invalid_content_length"
        );
    }
}
