//! Connections of the gRPC listener, with the same hygiene as the HTTP listeners
//! (`edge::listener`), for HTTP/2:
//! - at most `grpc.max_connections` connections are open at once. An excess connection is
//!   closed at once (a gRPC client sees the connection closed, `UNAVAILABLE` or
//!   `CANCELLED`, and may retry) and counted in
//!   `graviton_connections_refused_total{listener="grpc"}`;
//! - a connection's start must arrive within `grpc.handshake_timeout`: the TLS handshake
//!   (ALPN `h2`) with `[grpc.tls]`, the HTTP/2 client preface without. A client that
//!   stalls is disconnected and counted in
//!   `graviton_connection_header_timeouts_total{listener="grpc"}`. Handshakes run
//!   concurrently, so one slow client never holds back the others. Once connected,
//!   HTTP/2 keep-alive pings (`grpc.keepalive_interval`) close connections whose peer
//!   stopped answering;
//! - open connections are in `graviton_connections_open{listener="grpc"}`.
//!
//! [`incoming`] hands the accepted (and, with TLS, handshaken) connections to tonic as a
//! stream; each holds its slot of the bound until it is closed. When tonic drops the
//! stream at shutdown, the accept task ends and the listening socket closes.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::edge::listener::{ConnectionMetrics, GRPC as LISTENER, ListenerLabels};

/// How the gRPC listener accepts connections.
pub struct AcceptOptions {
    pub max_connections: usize,
    pub handshake_timeout: Duration,
    /// TLS with this acceptor (ALPN `h2`); plaintext HTTP/2 without.
    pub tls: Option<TlsAcceptor>,
    pub metrics: ConnectionMetrics,
}

enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

/// One accepted connection: its stream and its slot of the connection bound.
pub struct GrpcConnection {
    io: Io,
    open: Gauge,
    _slot: OwnedSemaphorePermit,
}

impl Drop for GrpcConnection {
    fn drop(&mut self) {
        self.open.dec();
    }
}

impl Connected for GrpcConnection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match &self.io {
            Io::Plain(stream) => stream.connect_info(),
            Io::Tls(stream) => stream.get_ref().0.connect_info(),
        }
    }
}

impl AsyncRead for GrpcConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match &mut self.io {
            Io::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Io::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for GrpcConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match &mut self.io {
            Io::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Io::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match &mut self.io {
            Io::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Io::Tls(stream) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(stream) => stream.is_write_vectored(),
            Io::Tls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.io {
            Io::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Io::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.io {
            Io::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Io::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}

/// The client connection preface every HTTP/2 connection starts with (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The part of a connection's start that must arrive within the handshake timeout: the
/// TLS handshake, or, in plaintext, the HTTP/2 preface (peeked, not consumed, so hyper
/// still reads it). A stalled client is then dropped instead of holding a slot forever.
async fn handshake(stream: TcpStream, tls: Option<TlsAcceptor>) -> std::io::Result<Io> {
    if let Some(acceptor) = tls {
        return Ok(Io::Tls(Box::new(acceptor.accept(stream).await?)));
    }
    let mut seen = [0u8; PREFACE.len()];
    loop {
        let n = stream.peek(&mut seen).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if n == PREFACE.len() || seen[..n] != PREFACE[..n] {
            // A full preface, or bytes that are not one: hyper answers the latter.
            return Ok(Io::Plain(stream));
        }
        // Part of the preface so far: wait a little for the rest.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The connections accepted on `listener` (module doc), for tonic's
/// `serve_with_incoming_shutdown`.
pub fn incoming(
    listener: TcpListener,
    options: AcceptOptions,
) -> impl Stream<Item = std::io::Result<GrpcConnection>> + Send + 'static {
    // Connections wait here only until tonic takes them; a full queue pauses accepting.
    let (tx, mut rx) = mpsc::channel(64);
    tokio::spawn(accept_loop(listener, options, tx));
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn accept_loop(
    listener: TcpListener,
    options: AcceptOptions,
    tx: mpsc::Sender<std::io::Result<GrpcConnection>>,
) {
    let labels = ListenerLabels { listener: LISTENER };
    let slots = Arc::new(Semaphore::new(options.max_connections.max(1)));
    let open = options.metrics.open.get_or_create(&labels).clone();
    let mut handshakes = tokio::task::JoinSet::new();
    loop {
        let stream = tokio::select! {
            () = tx.closed() => break,
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(err) => {
                    // EMFILE and the like must not end the listener (edge::listener).
                    tracing::warn!(listener = LISTENER, error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            options.metrics.refused.get_or_create(&labels).inc();
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        open.inc();
        let tx = tx.clone();
        let open = open.clone();
        let timeouts = options
            .metrics
            .header_timeouts
            .get_or_create(&labels)
            .clone();
        let timeout = options.handshake_timeout;
        let tls = options.tls.clone();
        handshakes.spawn(async move {
            match tokio::time::timeout(timeout, handshake(stream, tls)).await {
                Ok(Ok(io)) => {
                    let connection = GrpcConnection {
                        io,
                        open,
                        _slot: slot,
                    };
                    let _ = tx.send(Ok(connection)).await;
                }
                Ok(Err(err)) => {
                    open.dec();
                    tracing::debug!(error = %err, "gRPC connection handshake failed");
                }
                Err(_) => {
                    open.dec();
                    timeouts.inc();
                    tracing::debug!("gRPC connection handshake not finished in time");
                }
            }
        });
    }
}
