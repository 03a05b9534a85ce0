//! gRPC: the `graviton.v1.Blobs` service (`proto/graviton/v1/blobs.proto`) on its own
//! listener (`[grpc] listen`, off by default), served by tonic over HTTP/2, with TLS when
//! `[grpc.tls]` is set. `grpc::listener` bounds and times its connections.
//!
//! Every call, in this order (docs/api.md, "gRPC"; invariants GRPC-1…GRPC-3):
//! 1. the caller is authenticated with the HTTP rules (`edge::auth::caller_tenant`): the
//!    `authorization: Bearer …` metadata with `[auth]` on, the `x-graviton-tenant-id`
//!    metadata otherwise. Nothing is charged before this (GRPC-1);
//! 2. one request-counter charge (`Admission::charge_request`);
//! 3. `GetBlob` only: the egress window is checked and the transfer admitted like an HTTP
//!    download (`Operation::Download`), before the manifest is read;
//! 4. `GetBlob` streams the verified block slices of `pipeline::read::read_blob`, one frame per
//!    slice. Each frame is charged to the egress quota immediately before it is handed to
//!    tonic (GRPC-2), by the same `admission::egress::charge_egress` as HTTP downloads,
//!    and counted in the same download metrics (`metrics::MeteredDownload`); the next
//!    frame is read only when tonic polls for it, so HTTP/2 flow control is the
//!    back-pressure and nothing is buffered beyond one frame. A refused frame ends the
//!    call with `RESOURCE_EXHAUSTED`, a coordinator failure or a lost lease with
//!    `UNAVAILABLE`, after exactly the frames already charged (GRPC-3).

pub mod config;
pub mod listener;

/// Code generated from the proto by `tonic-prost-build` (see `build.rs`).
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod proto {
    tonic::include_proto!("graviton.v1");
}

use std::pin::Pin;
use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use crate::admission::egress::{EgressStop, charge_egress};
use crate::admission::{AdmissionPermit, Operation};
use crate::cas::BlobKey;
use crate::cas::range::ByteRange;
use crate::edge::AppState;
use crate::edge::{ApiError, ErrorCode};
use crate::ids::TenantId;
use crate::metrics::MeteredDownload;
use crate::pipeline::read::{ReadError, read_blob};
use proto::blobs_server::{Blobs, BlobsServer};
use proto::{BlobFrame, BlobStat, GetBlobRequest, StatBlobRequest};

/// The service over the node's shared state.
pub struct BlobService {
    app: Arc<AppState>,
}

impl BlobService {
    pub fn new(app: Arc<AppState>) -> Self {
        Self { app }
    }

    /// Steps 1 and 2 of the module doc: who calls, then one request charge.
    async fn caller<T>(&self, request: &Request<T>) -> Result<Option<TenantId>, Status> {
        let headers = request.metadata().clone().into_headers();
        let header_tenant =
            crate::edge::auth::tenant_header(&headers).map_err(ApiError::into_grpc)?;
        let tenant = crate::edge::auth::caller_tenant(&self.app, &headers, header_tenant)
            .await
            .map_err(ApiError::into_grpc)?;
        if let Some(tenant) = &tenant {
            self.app
                .admission
                .charge_request(tenant)
                .await
                .map_err(admission_status)?;
        }
        Ok(tenant)
    }

    async fn manifest(&self, key: BlobKey) -> Result<Arc<crate::cas::manifest::Manifest>, Status> {
        match self.app.manifests.get(key).await {
            Ok(Some(manifest)) => Ok(Arc::new(manifest)),
            Ok(None) => {
                Err(ApiError::new(ErrorCode::BlobNotFound, "no blob with this key").into_grpc())
            }
            Err(err) => {
                tracing::error!(error = %err, "gRPC: manifest store failed");
                Err(ApiError::new(
                    ErrorCode::StorageUnavailable,
                    "the manifest store is unavailable",
                )
                .into_grpc())
            }
        }
    }
}

type FrameStream = Pin<Box<dyn Stream<Item = Result<BlobFrame, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Blobs for BlobService {
    type GetBlobStream = FrameStream;

    async fn get_blob(
        &self,
        request: Request<GetBlobRequest>,
    ) -> Result<Response<Self::GetBlobStream>, Status> {
        // A bad key is refused before anything else, as over HTTP: it charges nothing.
        let key = parse_key(&request.get_ref().key)?;
        let tenant = self.caller(&request).await?;
        let message = request.into_inner();
        if let Some(tenant) = &tenant {
            self.app
                .admission
                .check_egress(tenant)
                .await
                .map_err(admission_status)?;
        }
        let permit = self
            .app
            .admission
            .admit_transfer(Operation::Download, tenant)
            .await
            .map_err(admission_status)?;
        let manifest = self.manifest(key).await?;
        let range = plan_range(message.range, manifest.size())?;
        let first = range.map(|r| r.first).unwrap_or(0);
        let length = range.map(|r| r.len()).unwrap_or(manifest.size());
        let frames = read_blob(self.app.blocks.clone(), manifest, range);
        Ok(Response::new(Box::pin(charged_frames(
            frames, first, length, &self.app, tenant, permit,
        ))))
    }

    async fn stat_blob(
        &self,
        request: Request<StatBlobRequest>,
    ) -> Result<Response<BlobStat>, Status> {
        let key = parse_key(&request.get_ref().key)?;
        self.caller(&request).await?;
        let manifest = self.manifest(key).await?;
        Ok(Response::new(BlobStat {
            size: manifest.size(),
            blocks: manifest.blocks.len() as u64,
            etag: manifest.key.etag(),
        }))
    }
}

fn parse_key(key: &str) -> Result<BlobKey, Status> {
    key.parse().map_err(|e: crate::cas::KeyError| {
        ApiError::new(ErrorCode::InvalidBlobKey, format!("invalid blob key: {e}")).into_grpc()
    })
}

/// The requested range as an inclusive byte range (`None`: the whole blob). `length = 0`
/// means "to the end"; a range reaching past the end is cut at the end; an offset at or
/// past the end is `OUT_OF_RANGE`.
fn plan_range(range: Option<proto::ByteRange>, size: u64) -> Result<Option<ByteRange>, Status> {
    let Some(range) = range else {
        return Ok(None);
    };
    if range.offset >= size {
        return Err(ApiError::new(
            ErrorCode::RangeNotSatisfiable,
            format!("the range starts at or past the end of the blob ({size} bytes)"),
        )
        .into_grpc());
    }
    let end = if range.length == 0 {
        size
    } else {
        range.offset.saturating_add(range.length).min(size)
    };
    Ok(Some(ByteRange {
        first: range.offset,
        last: end - 1,
    }))
}

/// One frame per verified slice, charged just before it is yielded (GRPC-2, through the
/// shared `admission::egress::charge_egress`) and metered like an HTTP download. The next
/// slice is only pulled when tonic asks for the next frame.
fn charged_frames<S>(
    inner: S,
    offset: u64,
    length: u64,
    app: &AppState,
    tenant: Option<TenantId>,
    permit: AdmissionPermit,
) -> impl Stream<Item = Result<BlobFrame, Status>> + Send + 'static
where
    S: Stream<Item = Result<bytes::Bytes, ReadError>> + Send + 'static,
{
    let charged = charge_egress(inner, app.admission.clone(), tenant, Some(permit), length);
    MeteredDownload::new(charged, app.metrics.clone(), length).scan(offset, |offset, item| {
        let frame = match item {
            Ok(data) => {
                let frame = BlobFrame {
                    offset: *offset,
                    data,
                };
                *offset += frame.data.len() as u64;
                Ok(frame)
            }
            Err(stop) => Err(stop_status(stop)),
        };
        std::future::ready(Some(frame))
    })
}

/// Why a GetBlob stream ended early, as a gRPC status.
fn stop_status(stop: EgressStop<ReadError>) -> Status {
    match stop {
        // Damage found mid-stream: gRPC's own code for it (over HTTP the transfer aborts).
        EgressStop::Source(ReadError::MissingBlock(_) | ReadError::CorruptBlock(_)) => {
            Status::data_loss("a block of this blob is missing or corrupt")
        }
        EgressStop::Source(ReadError::Store(_)) => {
            ApiError::new(ErrorCode::StorageUnavailable, "the block store failed").into_grpc()
        }
        EgressStop::LeaseLost => ApiError::new(
            ErrorCode::AdmissionUnavailable,
            "the transfer admission lease was lost",
        )
        .into_grpc(),
        EgressStop::Refused(err) => admission_status(err),
    }
}

/// Admission errors as gRPC statuses, through the error vocabulary
/// (`edge::error`): refusals are `RESOURCE_EXHAUSTED`, coordinator failures
/// `UNAVAILABLE`; both carry a `retry-after` metadata (seconds) when waiting helps, as
/// HTTP's `Retry-After`. The message is the admission error's own.
pub fn admission_status(err: crate::admission::Error) -> Status {
    let message = err.to_string();
    ApiError {
        message,
        ..ApiError::from(err)
    }
    .into_grpc()
}

/// Serve `graviton.v1.Blobs` on `listener` until `shutdown` resolves; calls in flight
/// are then allowed to finish (the node bounds the wait by `node.shutdown_grace`).
/// Connections are bounded and timed as `grpc::listener` says. A bad `[grpc.tls]`
/// certificate or key is an error before anything is served (the node checks it at
/// start as well).
pub async fn serve(
    listener: TcpListener,
    app: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let config = &app.config.grpc;
    let tls = if config.tls.enabled() {
        match crate::edge::tls::grpc_acceptor(&config.tls) {
            Ok(acceptor) => Some(acceptor),
            Err(err) => {
                tracing::error!(error = %err, "gRPC listener not started");
                return Ok(());
            }
        }
    } else {
        None
    };
    let incoming = listener::incoming(
        listener,
        listener::AcceptOptions {
            max_connections: config.max_connections,
            handshake_timeout: config.handshake_timeout.0,
            tls,
            metrics: app.edge.connections.clone(),
        },
    );
    tonic::transport::Server::builder()
        .max_concurrent_streams(config.max_concurrent_streams)
        .http2_keepalive_interval(Some(config.keepalive_interval.0))
        .http2_keepalive_timeout(Some(config.handshake_timeout.0))
        .add_service(BlobsServer::new(BlobService::new(app.clone())))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_cut_at_the_end_and_refused_past_it() {
        let r = |offset, length| Some(proto::ByteRange { offset, length });
        assert_eq!(plan_range(None, 10).unwrap(), None);
        assert_eq!(
            plan_range(r(2, 0), 10).unwrap(),
            Some(ByteRange { first: 2, last: 9 })
        );
        assert_eq!(
            plan_range(r(2, 3), 10).unwrap(),
            Some(ByteRange { first: 2, last: 4 })
        );
        assert_eq!(
            plan_range(r(9, 100), 10).unwrap(),
            Some(ByteRange { first: 9, last: 9 })
        );
        assert_eq!(
            plan_range(r(10, 1), 10).unwrap_err().code(),
            tonic::Code::OutOfRange
        );
    }

    #[test]
    fn admission_errors_map_to_grpc_codes() {
        use crate::admission::Error;
        let quota = admission_status(Error::QuotaExceeded {
            kind: crate::admission::QuotaKind::Egress,
            retry_after: std::time::Duration::from_millis(1500),
        });
        assert_eq!(quota.code(), tonic::Code::ResourceExhausted);
        assert_eq!(quota.metadata().get("retry-after").unwrap(), "2");
        assert_eq!(quota.message(), "egress quota exceeded");
        let unavailable = admission_status(Error::Unavailable("io".into()));
        assert_eq!(unavailable.code(), tonic::Code::Unavailable);
        assert_eq!(unavailable.metadata().get("retry-after").unwrap(), "1");
        assert_eq!(
            admission_status(Error::TimedOut("bytes")).code(),
            tonic::Code::ResourceExhausted
        );
        assert!(
            admission_status(Error::NeverFits(crate::admission::Dimension::TenantBytes))
                .metadata()
                .get("retry-after")
                .is_none()
        );
    }
}
