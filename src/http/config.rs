//! `[http]`: connection hygiene of every listener, CORS and TLS of the public listener
//! (shape, defaults and validation; applied by `edge::listener`, `http::cors`, `edge::tls`,
//! whose TLS sections' types are `edge::tls`'s).

use serde::{Deserialize, Serialize};

use crate::edge::listener::ConnectionLimits;
use crate::edge::tls::{InternalTlsConfig, TlsConfig};
use crate::values::Problem;
use crate::values::{ByteSize, HumanDuration};

/// `[http]` section.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// A request head (request line plus headers) must arrive within this long of the
    /// moment the server starts waiting for it: on a new connection and on an idle
    /// keep-alive connection alike (so it is also the keep-alive idle timeout). TLS
    /// handshakes have the same deadline.
    pub header_read_timeout: HumanDuration,
    /// Keep connections open between requests.
    pub keep_alive: bool,
    /// Largest request head accepted (431 above it).
    pub max_header_size: ByteSize,
    /// Most connections open at once on the public listener; excess ones get 503.
    pub max_connections: usize,
    /// Most connections open at once on the internal listener (cluster mode).
    pub internal_max_connections: usize,
    pub cors: CorsConfig,
    pub tls: TlsConfig,
    /// `[http.internal_tls]`: mutual TLS between cluster nodes (internal listener and
    /// the forwarding client).
    pub internal_tls: InternalTlsConfig,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: HumanDuration::secs(10),
            keep_alive: true,
            max_header_size: ByteSize::kib(16),
            max_connections: 4096,
            internal_max_connections: 1024,
            cors: CorsConfig::default(),
            tls: TlsConfig::default(),
            internal_tls: InternalTlsConfig::default(),
        }
    }
}

/// `[http.cors]`: browser cross-origin access to the public API.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CorsConfig {
    /// Exact origins (`https://app.example.com`) allowed; `["*"]` allows any origin.
    /// Empty (the default): no CORS headers at all.
    pub allowed_origins: Vec<String>,
    /// How long a browser may cache a preflight answer.
    pub max_age: HumanDuration,
}

impl Default for CorsConfig {
    fn default() -> Self {
        Self {
            allowed_origins: Vec::new(),
            max_age: HumanDuration::secs(600),
        }
    }
}

impl HttpConfig {
    /// Limits of the public listener.
    pub fn public_limits(&self) -> ConnectionLimits {
        ConnectionLimits {
            header_read_timeout: self.header_read_timeout.get(),
            keep_alive: self.keep_alive,
            max_header_bytes: self.max_header_size.bytes() as usize,
            max_connections: self.max_connections,
        }
    }

    /// Limits of the internal listener.
    pub fn internal_limits(&self) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: self.internal_max_connections,
            ..self.public_limits()
        }
    }

    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.header_read_timeout.get().is_zero() {
            problems.push(Problem::new(
                "http.header_read_timeout",
                "must be greater than zero",
            ));
        }
        let header = self.max_header_size.bytes();
        if !(1024..=1024 * 1024).contains(&header) {
            problems.push(Problem::new(
                "http.max_header_size",
                "must be between 1KiB and 1MiB",
            ));
        }
        if self.max_connections == 0 {
            problems.push(Problem::new("http.max_connections", "must be at least 1"));
        }
        if self.internal_max_connections == 0 {
            problems.push(Problem::new(
                "http.internal_max_connections",
                "must be at least 1",
            ));
        }
        for origin in &self.cors.allowed_origins {
            let ok = origin == "*"
                || ((origin.starts_with("https://") || origin.starts_with("http://"))
                    && !origin.ends_with('/')
                    && origin.parse::<axum::http::HeaderValue>().is_ok());
            if !ok {
                problems.push(Problem::new(
                    "http.cors.allowed_origins",
                    format!("{origin:?} is not an origin (scheme://host[:port], no path) or \"*\""),
                ));
            }
        }
        if self.cors.allowed_origins.len() > 1 && self.cors.allowed_origins.iter().any(|o| o == "*")
        {
            problems.push(Problem::new(
                "http.cors.allowed_origins",
                "\"*\" must be the only entry when present",
            ));
        }
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            problems.push(Problem::new(
                "http.tls.cert_file",
                "cert_file and key_file must be set together",
            ));
        }
        let i = &self.internal_tls;
        if (i.cert_file.is_some() || i.key_file.is_some() || i.ca_file.is_some())
            && !(i.cert_file.is_some() && i.key_file.is_some() && i.ca_file.is_some())
        {
            problems.push(Problem::new(
                "http.internal_tls.cert_file",
                "cert_file, key_file and ca_file must be set together",
            ));
        }
        problems
    }
}
