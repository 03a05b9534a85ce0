//! `[grpc]`: the gRPC listener (`graviton.v1.Blobs`, see `grpc`). Off unless `listen` is set.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::edge::tls::TlsConfig;
use crate::values::HumanDuration;
use crate::values::Problem;

/// `[grpc]` section.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcConfig {
    /// Address of the gRPC listener (HTTP/2; TLS with `[grpc.tls]`). Absent: no gRPC
    /// listener.
    pub listen: Option<SocketAddr>,
    /// Most concurrent calls (HTTP/2 streams) on one connection.
    pub max_concurrent_streams: u32,
    /// Most connections open at once; further ones are closed at once (`grpc::listener`).
    pub max_connections: usize,
    /// Deadline for a new connection's TLS handshake, or its HTTP/2 preface in plaintext.
    pub handshake_timeout: HumanDuration,
    /// Interval of HTTP/2 keep-alive pings; a connection whose peer does not answer one
    /// within `handshake_timeout` is closed.
    pub keepalive_interval: HumanDuration,
    /// `[grpc.tls]`: serve TLS (ALPN `h2`) with this certificate and key.
    pub tls: TlsConfig,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        Self {
            listen: None,
            max_concurrent_streams: 128,
            max_connections: 1024,
            handshake_timeout: HumanDuration::secs(10),
            keepalive_interval: HumanDuration::secs(30),
            tls: TlsConfig::default(),
        }
    }
}

impl GrpcConfig {
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.max_concurrent_streams == 0 {
            problems.push(Problem::new(
                "grpc.max_concurrent_streams",
                "must be at least 1",
            ));
        }
        if self.max_connections == 0 {
            problems.push(Problem::new("grpc.max_connections", "must be at least 1"));
        }
        if self.handshake_timeout.0.is_zero() {
            problems.push(Problem::new("grpc.handshake_timeout", "must be positive"));
        }
        if self.keepalive_interval.0.is_zero() {
            problems.push(Problem::new("grpc.keepalive_interval", "must be positive"));
        }
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            problems.push(Problem::new(
                "grpc.tls",
                "cert_file and key_file must be set together",
            ));
        }
        problems
    }
}
