//! The accept loop shared by every HTTP/1 listener (public and internal): connection
//! hygiene, optional TLS, and graceful shutdown.
//!
//! Each accepted connection is served by hyper's HTTP/1 connection builder with a tokio
//! timer, so that:
//! - a client must finish a request head within `header_read_timeout` of the moment the
//!   server starts waiting for it (a fresh connection, or an idle keep-alive connection
//!   between requests: hyper arms the same timer in both cases, so this is also the
//!   keep-alive idle timeout); a slowloris client is disconnected when it runs out;
//! - a head larger than `max_header_bytes` is refused (`431`) and the connection closed;
//! - at most `max_connections` connections are open at once. An excess connection is
//!   answered `503 {"error":"too_many_connections"}` with `Connection: close` (written
//!   without waiting) and closed at once; it is counted in
//!   `graviton_connections_refused_total{listener}`;
//! - with TLS configured, the handshake must also finish within `header_read_timeout`.
//! - a body is read in frames of up to [`READ_BUFFER_MAX`] (256 KiB) once the client
//!   sends fast enough to fill them: fewer reads, wake-ups and writes per upload.
//! - a connection closed with part of a request body still unread (an upload refused
//!   before its body: admission, a size limit; `http::unread` marks that answer
//!   `Connection: close`) is closed in two steps, a lingering close:
//!   the server's side first (FIN, after the answer), then the rest of the body is read
//!   and dropped until the client closes, for at most [`LINGER_BYTES`] or
//!   [`LINGER_TIME`]. Closing at once with unread bytes makes the kernel answer the
//!   client's next write with a reset, and a client still sending its body then sees
//!   `Broken pipe` or `Connection reset` instead of the answer that was sent.
//!
//! Shutdown: when `shutdown` completes the listener stops accepting, every connection is
//! asked to finish its in-flight request and close (hyper's graceful shutdown), and the
//! future resolves once all are closed. Dropping (aborting) the future aborts every
//! connection task with it: connections live in a `JoinSet` owned by the loop.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Limits applied to every connection of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Deadline for a complete request head (and for a TLS handshake).
    pub header_read_timeout: Duration,
    /// Keep connections open between requests (bounded by `header_read_timeout`).
    pub keep_alive: bool,
    /// Largest accepted request head (request line plus headers), in bytes.
    pub max_header_bytes: usize,
    /// Most connections open at once; further ones are refused.
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            keep_alive: true,
            max_header_bytes: 16 * 1024,
            max_connections: 4096,
        }
    }
}

/// Metric label of the public listener.
pub const PUBLIC: &str = "public";
/// Metric label of the internal listener (relayed requests, cluster mode).
pub const INTERNAL: &str = "internal";
/// Metric label of the gRPC listener (`grpc::listener`).
pub const GRPC: &str = "grpc";
/// Every listener of a node, by metric label.
pub const LISTENERS: [&str; 3] = [PUBLIC, INTERNAL, GRPC];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    /// "public", "internal" or "grpc"
    pub listener: &'static str,
}

/// Connection metrics of every listener of the node (labelled by listener name).
#[derive(Clone, Debug, Default)]
pub struct ConnectionMetrics {
    /// Connections refused because the listener was at `max_connections`.
    pub refused: Family<ListenerLabels, Counter>,
    /// Connections currently open.
    pub open: Family<ListenerLabels, Gauge>,
    /// Connections closed because the head (or TLS handshake) did not arrive in time.
    pub header_timeouts: Family<ListenerLabels, Counter>,
}

impl ConnectionMetrics {
    /// Register into a registry (the node's `Metrics::register_with`).
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        // Every series at zero from the start (listed in /metrics, first event counted).
        for listener in LISTENERS {
            let labels = ListenerLabels { listener };
            drop(self.refused.get_or_create(&labels));
            drop(self.header_timeouts.get_or_create(&labels));
        }
        registry.register(
            "connections_refused",
            "Connections refused because the listener was at its connection bound",
            self.refused.clone(),
        );
        registry.register(
            "connections_open",
            "Connections currently open, by listener",
            self.open.clone(),
        );
        registry.register(
            "connection_header_timeouts",
            "Connections closed because a request head or TLS handshake was too slow",
            self.header_timeouts.clone(),
        );
    }
}

/// How one listener serves connections.
#[derive(Clone)]
pub struct ServeOptions {
    /// Metric label of this listener.
    pub name: &'static str,
    pub limits: ConnectionLimits,
    /// Serve TLS with this acceptor (rustls) instead of plaintext.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    pub metrics: ConnectionMetrics,
}

impl ServeOptions {
    /// Plaintext, default limits, private metrics.
    pub fn plain(name: &'static str) -> Self {
        Self {
            name,
            limits: ConnectionLimits::default(),
            tls: None,
            metrics: ConnectionMetrics::default(),
        }
    }
}

/// Largest body frame read from a connection at once. hyper grows its read buffer up to
/// this only while reads fill it (a fast upload); a 24 KiB cap made a 512 MiB upload cost
/// about 22,000 reads, wake-ups and writes per hop, which was most of a forwarding node's
/// CPU (docs/performance.md, "Forwarding").
pub const READ_BUFFER_MAX: usize = 256 * 1024;

/// hyper's buffer bound: [`READ_BUFFER_MAX`], or more when a head may be larger (hyper
/// needs the whole head in its buffer; its floor is 8 KiB).
fn read_buffer_max(max_header_bytes: usize) -> usize {
    READ_BUFFER_MAX.max(max_header_bytes.max(8192) + 8192)
}

/// A lingering close reads at most this much of an abandoned request body...
pub const LINGER_BYTES: u64 = 64 << 20;
/// ...for at most this long.
pub const LINGER_TIME: Duration = Duration::from_secs(2);

/// Serve `router` on `listener` until `shutdown` completes (see the module doc).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let labels = ListenerLabels {
        listener: options.name,
    };
    let permits = Arc::new(Semaphore::new(options.limits.max_connections.max(1)));
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(options.limits.header_read_timeout)
        .keep_alive(options.limits.keep_alive)
        .max_header_size(options.limits.max_header_bytes)
        // The head is bounded by `max_header_size` above; this bounds hyper's read (and
        // write) buffer, so also the size of each body frame read from the socket.
        .max_buf_size(read_buffer_max(options.limits.max_header_bytes));
    let builder = Arc::new(builder);
    let refused = super::ApiError::new(
        super::ErrorCode::TooManyConnections,
        "the server is at its connection limit",
    )
    .to_http1_bytes();
    let stop = CancellationToken::new();
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, _peer) = tokio::select! {
            () = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Per-connection errors (EMFILE, ECONNABORTED) must not stop the
                    // listener; back off briefly so a descriptor shortage is not a spin.
                    tracing::warn!(listener = options.name, error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            options.metrics.refused.get_or_create(&labels).inc();
            refuse(stream, &refused);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let builder = builder.clone();
        let router = router.clone();
        let tls = options.tls.clone();
        let metrics = options.metrics.clone();
        let labels = labels.clone();
        let stop = stop.clone();
        let timeout = options.limits.header_read_timeout;
        connections.spawn(async move {
            let open = metrics.open.get_or_create(&labels).clone();
            open.inc();
            match tls {
                None => serve_connection(&builder, stream, router, stop, &metrics, &labels).await,
                Some(acceptor) => {
                    match tokio::time::timeout(timeout, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            serve_connection(&builder, stream, router, stop, &metrics, &labels)
                                .await
                        }
                        Ok(Err(err)) => {
                            tracing::debug!(error = %err, "TLS handshake failed");
                        }
                        Err(_) => {
                            metrics.header_timeouts.get_or_create(&labels).inc();
                        }
                    }
                }
            }
            open.dec();
            drop(permit);
        });
    }
    drop(listener);
    stop.cancel();
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// Answer a connection over the bound without waiting on it, then close it.
fn refuse(stream: TcpStream, answer: &[u8]) {
    // A fresh socket's send buffer takes the whole answer; if it does not, the client
    // simply sees the connection closed.
    let _ = stream.try_write(answer);
    if let Ok(std) = stream.into_std() {
        let _ = std.shutdown(std::net::Shutdown::Write);
    }
}

async fn serve_connection<I>(
    builder: &http1::Builder,
    io: I,
    router: Router,
    stop: CancellationToken,
    metrics: &ConnectionMetrics,
    labels: &ListenerLabels,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // A boxed future per request keeps the connection `Unpin`, so it can be polled
    // without shutting its socket down and the socket taken back for the lingering close.
    // An answer with `Connection: close` (`http::unread`: the request body was left
    // unread) ends the connection while the client may still be sending: linger then.
    let service = TowerToHyperService::new(router);
    let closing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let closed_early = closing.clone();
    let service = hyper::service::service_fn(move |request| {
        let answer = hyper::service::Service::call(&service, request);
        let closing = closing.clone();
        let future: BoxedResponse = Box::pin(async move {
            let response = answer.await?;
            if response
                .headers()
                .get(axum::http::header::CONNECTION)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"))
            {
                closing.store(true, std::sync::atomic::Ordering::Release);
            }
            Ok(response)
        });
        future
    });
    let mut connection = builder.serve_connection(TokioIo::new(io), service);
    let result = tokio::select! {
        result = std::future::poll_fn(|cx| connection.poll_without_shutdown(cx)) => result,
        () = stop.cancelled() => {
            std::pin::Pin::new(&mut connection).graceful_shutdown();
            std::future::poll_fn(|cx| connection.poll_without_shutdown(cx)).await
        }
    };
    if result.is_ok() && closed_early.load(std::sync::atomic::Ordering::Acquire) {
        linger(connection.into_parts().io.into_inner()).await;
    }
    if let Err(err) = result {
        if err.is_timeout() {
            metrics.header_timeouts.get_or_create(labels).inc();
            tracing::debug!("connection closed: request head not received in time");
        } else {
            tracing::debug!(error = %err, "connection ended with an error");
        }
    }
}

type BoxedResponse = std::pin::Pin<
    Box<dyn Future<Output = Result<axum::response::Response, std::convert::Infallible>> + Send>,
>;

/// Close `io` after its last answer (module doc, lingering close): shut the sending side,
/// then read and drop what the client still sends until it closes, within
/// [`LINGER_BYTES`] and [`LINGER_TIME`].
async fn linger<I>(mut io: I)
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if io.shutdown().await.is_err() {
        return;
    }
    let drain = async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut left = LINGER_BYTES;
        while left > 0 {
            match io.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => left = left.saturating_sub(n as u64),
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIME, drain).await;
}
