//! The relay: the node-to-node client that hands a request for a session owned by
//! another node to the owner's internal listener, streaming its body exactly once.
//!
//! Two kinds of request are relayed ([`Relayed`]): a plain upload (`POST /v1/blobs` →
//! `/internal/v1/sessions/{t}/{s}/blobs`) and a tus request (`/v1/uploads/{id}` →
//! `/internal/v1/uploads/{id}`, `http::tus_internal`), so a client may upload or resume
//! through any node. Both go through the same steps (docs/control-plane.md, §7):
//!
//! 1. **Pre-flight** (a plain upload, and a tus `PATCH`): `HEAD` of the resource (for a
//!    PATCH, its `/part`) with the internal token, shard and epoch. The body is
//!    untouched. The owner runs every check of the request and admits the transfer (one
//!    cluster lease), naming the parked admission in `X-Graviton-Admission-Reservation`,
//!    which the request repeats so the owner adopts it. One triage ([`Forwarder::triage`])
//!    reads the owner's answer for both kinds: go on; a stale epoch (409 with
//!    `X-Graviton-Current-Epoch`) → ask the caller's [`OwnerResolver`] once for the
//!    current owner and start again; the internal token refused → `503 owner_unavailable`;
//!    a refusal whose code ([`ErrorCode::from_wire`] of `X-Graviton-Error`) the client may
//!    act on ([`ErrorCode::is_relayed`]) → that refusal, rebuilt from the code with the
//!    owner's message (`X-Graviton-Error-Message`) and `Retry-After`, before a byte of the
//!    client's body is read; anything else → `503 owner_unavailable` whose message names
//!    the owner's status, code and message. The pre-flight may wait up to the admission
//!    wait budget ([`Forwarder::with_admission_wait`]) on top of the connect and read
//!    timeouts. HEAD, DELETE and POST (creation) of tus go without one: they carry no
//!    body, except a creation-with-upload, which the owner admits before reading it.
//! 2. **Stream** the request with the original body wrapped, frame by frame, in
//!    `reqwest::Body::wrap_stream` (no buffering beyond the frames hyper holds, no
//!    replay). The headers the owner needs are copied ([`Relayed`] says which).
//! 3. **Relay** the owner's status, JSON body (capped at 1 MiB) and the answer headers
//!    the client needs.
//!
//! If the epoch moves between pre-flight and request, the owner still refuses before
//! reading; the relay retries (once in total) only if no byte of the body was pulled
//! yet, else it answers `503 owner_moved` with `Retry-After`.
//!
//! Failure model: one shared `reqwest::Client` with a connect timeout and no total
//! deadline (long uploads are fine, stalls are not). `forward_read_timeout` bounds the
//! owner's *silence*: the time during which the owner neither pulls body bytes that the
//! client has already sent nor answers. A client that trickles its body slowly is not
//! the owner's silence: while the relay waits on the client, the clock does not run.
//! Owner unreachable → `503 owner_unavailable`; owner lost mid-stream → `502
//! owner_unavailable`; both with `Retry-After`. The client's own body failing → `400
//! upload_interrupted`. Nothing waits without a deadline. Every answer of the relay's
//! own comes from the error vocabulary (`edge::error`).
//!
//! - [`protocol`]: header names, paths and the message codec shared with the owner side.
//! - `source`: the inbound body shared between attempts.

pub mod protocol;
mod source;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::future::BoxFuture;

use self::protocol::{
    CURRENT_EPOCH_HEADER, CURRENT_OWNER_HEADER, ERROR_CODE_HEADER, INTERNAL_TOKEN_HEADER,
    RESERVATION_HEADER, SHARD_EPOCH_HEADER, SHARD_HEADER, ingest_path, relayed_message, tus_path,
};
use self::source::Source;
use crate::actors::ClusterHandle;
use crate::edge::error::refuses_credentials;
use crate::edge::headers::{CONTENT_DIGEST_HEADER, CONTENT_HASH_HEADER, parse_digits};
use crate::edge::{ApiError, ErrorCode};
use crate::ids::{NodeId, SessionKey};
use crate::placement::{Epoch, OwnerTarget, RouteError, StaleEpoch};
use crate::tus::{self, UploadId};
use crate::values::Secret;

/// Largest owner response relayed (the owner answers a small JSON document).
pub const MAX_OWNER_RESPONSE_BYTES: usize = 1024 * 1024;

/// What is relayed: the two kinds of request, each with what the owner needs.
#[derive(Debug, Clone)]
pub enum Relayed {
    /// `POST /v1/blobs` of a session: pre-flighted, then posted.
    Upload(SessionKey),
    /// A tus request on an upload, with the client's method: a `PATCH` is pre-flighted.
    Tus {
        id: UploadId,
        method: reqwest::Method,
    },
}

/// Request headers a plain upload passes on (plus `Content-Length` on the POST): the owner
/// checks the declared digest before its commit.
const UPLOAD_PASSED: &[&str] = &["content-type", CONTENT_DIGEST_HEADER, CONTENT_HASH_HEADER];
/// Answer headers of a plain upload the client needs.
const UPLOAD_RELAYED: &[&str] = &["content-type", "retry-after", "location", "etag"];
/// Request headers a tus request passes on (everything else is the relay's business).
const TUS_PASSED: &[&str] = &[
    "content-type",
    "content-length",
    tus::TUS_RESUMABLE,
    tus::UPLOAD_LENGTH,
    tus::UPLOAD_OFFSET,
    tus::UPLOAD_METADATA,
    tus::UPLOAD_CHECKSUM,
    tus::UPLOAD_DEFER_LENGTH,
];
/// Answer headers of a tus request the client needs.
const TUS_RELAYED: &[&str] = &[
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

impl Relayed {
    /// The session whose owner answers.
    fn key(&self) -> SessionKey {
        match self {
            Relayed::Upload(key) => *key,
            Relayed::Tus { id, .. } => id.key(),
        }
    }

    /// The owner-side path of the request.
    fn path(&self) -> String {
        match self {
            Relayed::Upload(key) => ingest_path(key),
            Relayed::Tus { id, .. } => tus_path(id),
        }
    }

    /// The path of the pre-flight, when this request has one.
    fn preflight_path(&self) -> Option<String> {
        match self {
            Relayed::Upload(key) => Some(ingest_path(key)),
            Relayed::Tus { id, method } if method == reqwest::Method::PATCH => {
                Some(format!("{}/part", tus_path(id)))
            }
            Relayed::Tus { .. } => None,
        }
    }

    fn method(&self) -> reqwest::Method {
        match self {
            Relayed::Upload(_) => reqwest::Method::POST,
            Relayed::Tus { method, .. } => method.clone(),
        }
    }

    fn passed(&self) -> &'static [&'static str] {
        match self {
            Relayed::Upload(_) => UPLOAD_PASSED,
            Relayed::Tus { .. } => TUS_PASSED,
        }
    }

    fn relayed(&self) -> &'static [&'static str] {
        match self {
            Relayed::Upload(_) => UPLOAD_RELAYED,
            Relayed::Tus { .. } => TUS_RELAYED,
        }
    }

    /// Who could not be found in time, for the client's message.
    fn unresolved(&self) -> &'static str {
        match self {
            Relayed::Upload(_) => "the session's owner could not be resolved in time",
            Relayed::Tus { .. } => "the upload's owner could not be resolved in time",
        }
    }
}

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

/// Relay options.
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
    /// Body bytes pulled from inbound requests.
    pub bytes_pulled: AtomicU64,
    pub forwards: AtomicU64,
    pub stale_retries: AtomicU64,
    pub owner_failures: AtomicU64,
}

/// The relay's client. Clone it freely: one connection pool is shared.
#[derive(Clone)]
pub struct Forwarder {
    client: reqwest::Client,
    /// The internal token, marked sensitive (never shown by header `Debug`).
    token: HeaderValue,
    head_deadline: Duration,
    /// Longest silence of the owner during a streamed request.
    silence: Duration,
    /// Extra time a pre-flight may take while the owner waits for admission.
    admission_wait: Duration,
    stats: Arc<ForwardStats>,
    /// `https` with `[http.internal_tls]`, else `http`.
    scheme: &'static str,
}

/// The owner's answer to a pre-flight, read once for both kinds ([`Forwarder::triage`]).
enum Preflight {
    /// Go ahead; the owner's parked admission, when it made one.
    Go(Option<HeaderValue>),
    Stale(StaleEpoch),
    /// The client's answer, given before its body is read.
    Refuse(Response),
}

/// One attempt: the answer, or a stale epoch to re-resolve.
enum Step {
    Done(Response),
    Stale(StaleEpoch),
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

    /// A relay that speaks HTTPS to owners, presenting this node's certificate and
    /// trusting only the cluster CA (`[http.internal_tls]`, see `edge::tls`).
    pub fn with_mutual_tls(
        options: ForwardOptions,
        tls: &crate::edge::tls::InternalTlsConfig,
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

    /// Relay one request to `target`, re-resolving once on a stale epoch (module doc).
    /// Always returns a response; never panics, never waits without a deadline.
    pub async fn relay(
        &self,
        target: OwnerTarget,
        request: Relayed,
        headers: &HeaderMap,
        body: Body,
        resolver: &dyn OwnerResolver,
    ) -> Response {
        self.stats.forwards.fetch_add(1, Ordering::Relaxed);
        let source = Source::new(body);
        let key = request.key();
        let mut target = target;
        let mut retried = false;
        loop {
            let stale = match self.attempt(&target, &request, headers, &source).await {
                Step::Done(response) => return response,
                // A body none of which was pulled can go to the next owner.
                Step::Stale(stale) if source.reclaim() => stale,
                Step::Stale(_) => {
                    return owner_moved("the owner changed while the upload was streaming");
                }
            };
            if retried {
                return owner_moved("the owner changed again while re-routing");
            }
            retried = true;
            self.stats.stale_retries.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(refused_by = %stale.refused_by, "relay: stale epoch, re-resolving");
            let resolved =
                tokio::time::timeout(self.head_deadline, resolver.re_resolve(&key, &stale)).await;
            target = match resolved {
                Ok(Ok(next)) => next,
                Ok(Err(error)) => return ApiError::from(error).into_response(),
                Err(_) => return self.unavailable(request.unresolved()),
            };
        }
    }

    fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        target: &OwnerTarget,
        passed: &[&str],
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
        for name in passed {
            if let Some(value) = headers.get(*name) {
                request = request.header(*name, value.clone());
            }
        }
        request
    }

    /// One attempt at `target`: the pre-flight when the request has one, then the
    /// request with the body.
    async fn attempt(
        &self,
        target: &OwnerTarget,
        request: &Relayed,
        headers: &HeaderMap,
        source: &Source,
    ) -> Step {
        let mut reservation = None;
        if let Some(path) = request.preflight_path() {
            let head = self.request(
                reqwest::Method::HEAD,
                &path,
                target,
                request.passed(),
                headers,
            );
            match self.preflight(target, request, head).await {
                Preflight::Go(parked) => reservation = parked,
                Preflight::Stale(stale) => return Step::Stale(stale),
                Preflight::Refuse(response) => return Step::Done(response),
            }
        }
        let mut outbound = self.request(
            request.method(),
            &request.path(),
            target,
            request.passed(),
            headers,
        );
        if let Relayed::Upload(_) = request
            && let Some(value) = headers.get(header::CONTENT_LENGTH)
        {
            outbound = outbound.header(header::CONTENT_LENGTH, value.clone());
        }
        if let Some(value) = reservation {
            outbound = outbound.header(RESERVATION_HEADER, value);
        }
        self.stream(target, request, outbound, source).await
    }

    /// Send a pre-flight and read its answer.
    async fn preflight(
        &self,
        target: &OwnerTarget,
        request: &Relayed,
        head: reqwest::RequestBuilder,
    ) -> Preflight {
        let deadline = self.head_deadline + self.admission_wait;
        match tokio::time::timeout(deadline, head.send()).await {
            Ok(Ok(response)) => self.triage(target, request, response.status(), response.headers()),
            Ok(Err(error)) => {
                tracing::warn!(owner = %target.node, error = %error.without_url(), "relay: owner unreachable");
                Preflight::Refuse(self.unavailable("the owner node is unreachable"))
            }
            Err(_) => {
                tracing::warn!(owner = %target.node, "relay: owner pre-flight timed out");
                Preflight::Refuse(self.unavailable("the owner node did not answer in time"))
            }
        }
    }

    /// The one reading of a pre-flight's answer, for both kinds (module doc, step 1).
    fn triage(
        &self,
        target: &OwnerTarget,
        request: &Relayed,
        status: reqwest::StatusCode,
        headers: &reqwest::header::HeaderMap,
    ) -> Preflight {
        if status.is_success() {
            return Preflight::Go(headers.get(RESERVATION_HEADER).cloned());
        }
        if is_stale(status, headers) {
            return Preflight::Stale(stale_from(target, headers));
        }
        if refuses_credentials(status) {
            tracing::error!(owner = %target.node, "relay: owner rejected the internal token");
            return Preflight::Refuse(self.unavailable("the owner node refused the upload"));
        }
        let wire = headers
            .get(ERROR_CODE_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|c| c.len() <= 64 && c.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'));
        if let Some(code) = wire
            .and_then(ErrorCode::from_wire)
            .filter(|c| c.is_relayed())
        {
            tracing::debug!(owner = %target.node, %status, %code, "relay: owner refused in the pre-flight");
            return Preflight::Refuse(refusal(request, code, headers));
        }
        let code = wire.unwrap_or("no code");
        tracing::error!(owner = %target.node, %status, code, "relay: owner refused the pre-flight");
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
        Preflight::Refuse(ApiError::new(ErrorCode::OwnerUnavailable, reason).into_response())
    }

    /// Stream the request with the body and relay the owner's answer.
    async fn stream(
        &self,
        target: &OwnerTarget,
        request: &Relayed,
        outbound: reqwest::RequestBuilder,
        source: &Source,
    ) -> Step {
        let tap = source.tap(self.stats.clone());
        let send = outbound.body(reqwest::Body::wrap_stream(tap)).send();
        let response = tokio::select! {
            sent = send => match sent {
                Ok(response) => response,
                Err(error) => return Step::Done(self.failure(target, source, &error)),
            },
            _ = source.owner_silent(self.silence) => return Step::Done(self.silent(target, source)),
        };
        let status = response.status();
        // Only a stale-epoch refusal names the current epoch; any other 409 (for example
        // `session_busy`) is the owner's answer and is relayed as it is.
        if is_stale(status, response.headers()) {
            return Step::Stale(stale_from(target, response.headers()));
        }
        // The relay verified the client's token; the owner checks only the internal one.
        if refuses_credentials(status) {
            tracing::error!(owner = %target.node, "relay: owner rejected the internal token");
            return Step::Done(self.unavailable("the owner node refused the upload"));
        }
        let relayed = relayed_headers(request.relayed(), response.headers());
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
            Ok(None) => {
                tracing::error!(owner = %target.node, "relay: owner answer exceeds 1 MiB");
                Step::Done(self.owner_failed("the owner node sent an invalid answer"))
            }
            Err(error) => Step::Done(self.failure(target, source, &error)),
        }
    }

    fn failure(&self, target: &OwnerTarget, source: &Source, error: &reqwest::Error) -> Response {
        if source.failed() {
            return ApiError::new(
                ErrorCode::UploadInterrupted,
                "the upload body ended with an error",
            )
            .into_response();
        }
        tracing::warn!(owner = %target.node, error = %ErrorChain(error), "relay: owner failed during the upload");
        if source.untouched() {
            // Nothing of the body was pulled: the client may retry at once.
            self.unavailable("the owner node is unreachable")
        } else {
            self.owner_failed("the owner node failed during the upload; retry it")
        }
    }

    fn silent(&self, target: &OwnerTarget, source: &Source) -> Response {
        tracing::warn!(owner = %target.node, silence = ?self.silence, "relay: the owner went silent during the upload");
        if source.untouched() {
            self.unavailable("the owner node did not answer in time")
        } else {
            self.owner_failed("the owner node stopped reading the upload; retry it")
        }
    }

    /// 503 `owner_unavailable`: nothing of the body reached the owner.
    fn unavailable(&self, message: &'static str) -> Response {
        self.stats.owner_failures.fetch_add(1, Ordering::Relaxed);
        ApiError::new(ErrorCode::OwnerUnavailable, message).into_response()
    }

    /// 502 `owner_unavailable`: the owner failed once the body was moving.
    fn owner_failed(&self, message: &'static str) -> Response {
        self.stats.owner_failures.fetch_add(1, Ordering::Relaxed);
        ApiError::owner_failed(message).into_response()
    }
}

/// A stale epoch: the owner's 409 naming the current epoch.
fn is_stale(status: reqwest::StatusCode, headers: &reqwest::header::HeaderMap) -> bool {
    status == ErrorCode::StaleEpoch.status() && headers.contains_key(CURRENT_EPOCH_HEADER)
}

/// A pre-flight refusal the client may act on, rebuilt from its code (a HEAD has no
/// body): the owner's message and `Retry-After`, and for tus the tus headers it sent
/// (the current `Upload-Offset` of a conflict).
fn refusal(request: &Relayed, code: ErrorCode, headers: &reqwest::header::HeaderMap) -> Response {
    let retry_after = headers
        .get(header::RETRY_AFTER)
        .and_then(|v| parse_digits(v.as_bytes()));
    let mut answer = ApiError::relayed(code, relayed_message(headers), retry_after).into_response();
    if let Relayed::Tus { .. } = request {
        for (name, value) in relayed_headers(TUS_RELAYED, headers) {
            if name != header::CONTENT_TYPE && name != header::RETRY_AFTER {
                answer.headers_mut().insert(name, value);
            }
        }
    }
    answer
}

fn relayed_headers(
    names: &[&'static str],
    headers: &reqwest::header::HeaderMap,
) -> Vec<(HeaderName, HeaderValue)> {
    names
        .iter()
        .filter_map(|name| {
            let value = headers.get(*name)?.clone();
            Some((HeaderName::from_static(name), value))
        })
        .collect()
}

fn owner_moved(message: &'static str) -> Response {
    ApiError::new(ErrorCode::OwnerMoved, message).into_response()
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
    use crate::ids::{SessionId, TenantId};
    use protocol::{ERROR_MESSAGE_HEADER, message_header};

    fn forwarder() -> Forwarder {
        Forwarder::new(ForwardOptions {
            token: Secret::new("t"),
            connect_timeout: Duration::from_secs(1),
            read_timeout: Duration::from_secs(1),
        })
        .unwrap()
    }

    fn target() -> OwnerTarget {
        OwnerTarget {
            node: NodeId::parse("node-b").unwrap(),
            internal_addr: "127.0.0.1:1".parse().unwrap(),
            shard: crate::placement::ShardId(1),
            epoch: Epoch(1),
        }
    }

    fn upload() -> Relayed {
        Relayed::Upload(SessionKey {
            tenant: TenantId::new_random(),
            session: SessionId::new_random(),
        })
    }

    fn tus_patch() -> Relayed {
        Relayed::Tus {
            id: UploadId(upload().key()),
            method: reqwest::Method::PATCH,
        }
    }

    fn refused(preflight: Preflight) -> Response {
        match preflight {
            Preflight::Refuse(response) => response,
            Preflight::Go(_) => panic!("went on"),
            Preflight::Stale(_) => panic!("stale"),
        }
    }

    async fn body_of(response: Response) -> serde_json::Value {
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    fn code(wire: &'static str) -> reqwest::header::HeaderMap {
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(ERROR_CODE_HEADER, HeaderValue::from_static(wire));
        headers
    }

    // Checks OPS-8.
    #[tokio::test]
    async fn owner_refusals_keep_their_code_status_reason_and_retry_after_for_both_kinds() {
        let relay = forwarder();
        for request in [upload(), tus_patch()] {
            let mut headers = code("transfer_admission_busy");
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("3"));
            let answer =
                refused(relay.triage(&target(), &request, 503.try_into().unwrap(), &headers));
            assert_eq!(answer.status(), 503);
            assert_eq!(answer.headers()[header::RETRY_AFTER], "3");
            let body = body_of(answer).await;
            assert_eq!(body["error"], "transfer_admission_busy");
            // No message from the owner (an older one): the generic reason.
            assert_eq!(body["message"], "the owner node refused the upload");
            // The owner's message is its reason, relayed as it is.
            headers.insert(
                ERROR_MESSAGE_HEADER,
                message_header("transfer capacity is busy; retry later").unwrap(),
            );
            let answer =
                refused(relay.triage(&target(), &request, 503.try_into().unwrap(), &headers));
            assert_eq!(
                body_of(answer).await["message"],
                "transfer capacity is busy; retry later"
            );
            // A quota refusal without the owner's window carries none.
            let answer = refused(relay.triage(
                &target(),
                &request,
                429.try_into().unwrap(),
                &code("quota_exceeded"),
            ));
            assert_eq!(answer.status(), 429);
            assert!(answer.headers().get(header::RETRY_AFTER).is_none());
        }
    }

    #[tokio::test]
    async fn a_refused_part_pre_flight_keeps_the_owners_tus_headers() {
        let mut headers = code("offset_mismatch");
        headers.insert(tus::UPLOAD_OFFSET, HeaderValue::from_static("42"));
        let answer =
            refused(forwarder().triage(&target(), &tus_patch(), 409.try_into().unwrap(), &headers));
        assert_eq!(answer.status(), 409);
        assert_eq!(answer.headers()[tus::UPLOAD_OFFSET], "42");
        assert_eq!(body_of(answer).await["error"], "offset_mismatch");
        // A plain upload passes no tus headers on.
        let answer =
            refused(forwarder().triage(&target(), &upload(), 409.try_into().unwrap(), &headers));
        assert!(answer.headers().get(tus::UPLOAD_OFFSET).is_none());
    }

    /// Token refusals, node-to-node codes and unknown codes are the relay's failure:
    /// `503 owner_unavailable` with `Retry-After`, naming what the owner said.
    #[tokio::test]
    async fn other_refusals_are_owner_unavailable_for_both_kinds() {
        let relay = forwarder();
        for request in [upload(), tus_patch()] {
            for (status, wire) in [
                (401, "unauthorized"),
                (400, "invalid_shard"),
                (400, "made_up"),
                (500, "internal"),
            ] {
                let answer = refused(relay.triage(
                    &target(),
                    &request,
                    status.try_into().unwrap(),
                    &code(wire),
                ));
                assert_eq!(answer.status(), 503, "{wire}");
                assert_eq!(answer.headers()[header::RETRY_AFTER], "1", "{wire}");
                let body = body_of(answer).await;
                assert_eq!(body["error"], "owner_unavailable", "{wire}");
                if status != 401 {
                    assert!(body["message"].as_str().unwrap().contains(wire), "{body}");
                }
            }
        }
    }

    #[test]
    fn only_a_409_naming_the_current_epoch_is_stale() {
        let relay = forwarder();
        let mut headers = code("stale_epoch");
        headers.insert(CURRENT_EPOCH_HEADER, HeaderValue::from_static("9"));
        headers.insert(CURRENT_OWNER_HEADER, HeaderValue::from_static("node-c"));
        for request in [upload(), tus_patch()] {
            match relay.triage(&target(), &request, 409.try_into().unwrap(), &headers) {
                Preflight::Stale(stale) => {
                    assert_eq!(stale.current_epoch, Some(Epoch(9)));
                    assert_eq!(stale.current_owner.unwrap().as_str(), "node-c");
                }
                _ => panic!("not stale"),
            }
            assert!(matches!(
                relay.triage(
                    &target(),
                    &request,
                    409.try_into().unwrap(),
                    &code("session_busy")
                ),
                Preflight::Refuse(_)
            ));
        }
    }

    #[test]
    fn only_a_patch_of_tus_is_pre_flighted() {
        assert!(upload().preflight_path().is_some());
        assert!(tus_patch().preflight_path().unwrap().ends_with("/part"));
        for method in [
            reqwest::Method::HEAD,
            reqwest::Method::DELETE,
            reqwest::Method::POST,
        ] {
            let request = Relayed::Tus {
                id: UploadId(upload().key()),
                method,
            };
            assert!(request.preflight_path().is_none());
        }
    }
}
