//! rustls configurations (aws-lc-rs provider, TLS 1.2 and 1.3) built from PEM files:
//! - [`public_acceptor`]: server certificate of the public listener (`[http.tls]`);
//! - [`grpc_acceptor`]: the same for the gRPC listener (`[grpc.tls]`, ALPN `h2`);
//! - [`internal_acceptor`]: the internal listener with mutual TLS: client certificates
//!   must chain to `http.internal_tls.ca_file` (`[http.internal_tls]`);
//! - [`internal_client_config`]: the forwarding client, presenting this node's
//!   certificate and trusting only the same CA;
//! - [`control_tls`]: the same pair for the ractor_cluster control plane.
//!
//! The TLS sections' types ([`TlsConfig`] for `[http.tls]` and `[grpc.tls]`,
//! [`InternalTlsConfig`] for `[http.internal_tls]`) live here, where they are read.
//!
//! Errors name the file at fault, never key material.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};

use serde::{Deserialize, Serialize};

/// `[http.tls]`: TLS on the public listener.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain (leaf first). Set together with `key_file`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
}

impl TlsConfig {
    pub fn enabled(&self) -> bool {
        self.cert_file.is_some()
    }
}

/// `[http.internal_tls]`: mutual TLS on the internal listener. Every node presents
/// `cert_file` (as server and as forwarding client) and accepts peers whose certificate
/// chains to `ca_file`. The internal token is still required on top.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct InternalTlsConfig {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    /// PEM CA certificate(s) that peer certificates must chain to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
}

impl InternalTlsConfig {
    pub fn enabled(&self) -> bool {
        self.cert_file.is_some()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate found", path.display()));
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| format!("{}: no usable private key ({e})", path.display()))
}

fn roots(path: &Path) -> Result<Arc<RootCertStore>, String> {
    let mut roots = RootCertStore::empty();
    for cert in certs(path)? {
        roots
            .add(cert)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(Arc::new(roots))
}

fn required<'a>(path: &'a Option<std::path::PathBuf>, key: &str) -> Result<&'a Path, String> {
    path.as_deref().ok_or_else(|| format!("{key} is required"))
}

/// The public listener's acceptor (HTTP/1.1 over TLS).
pub fn public_acceptor(config: &TlsConfig) -> Result<TlsAcceptor, String> {
    server_acceptor(config, "http.tls", b"http/1.1")
}

/// The gRPC listener's acceptor (HTTP/2 over TLS, `[grpc.tls]`).
pub fn grpc_acceptor(config: &TlsConfig) -> Result<TlsAcceptor, String> {
    server_acceptor(config, "grpc.tls", b"h2")
}

/// A server certificate without client authentication, offering one ALPN protocol;
/// `section` names the config section in errors.
fn server_acceptor(config: &TlsConfig, section: &str, alpn: &[u8]) -> Result<TlsAcceptor, String> {
    let cert = required(&config.cert_file, &format!("{section}.cert_file"))?;
    let key_file = required(&config.key_file, &format!("{section}.key_file"))?;
    let mut server = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(certs(cert)?, key(key_file)?)
        .map_err(|e| format!("{section}: {e}"))?;
    server.alpn_protocols = vec![alpn.to_vec()];
    Ok(TlsAcceptor::from(Arc::new(server)))
}

/// The internal listener's acceptor: a client certificate chaining to the CA is required.
pub fn internal_acceptor(config: &InternalTlsConfig) -> Result<TlsAcceptor, String> {
    let cert = required(&config.cert_file, "http.internal_tls.cert_file")?;
    let key_file = required(&config.key_file, "http.internal_tls.key_file")?;
    let ca = required(&config.ca_file, "http.internal_tls.ca_file")?;
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(ca)?, provider())
            .build()
            .map_err(|e| format!("http.internal_tls.ca_file: {e}"))?;
    let mut server = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs(cert)?, key(key_file)?)
        .map_err(|e| format!("http.internal_tls: {e}"))?;
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(server)))
}

/// The forwarding client's TLS: this node's certificate, trusting only the cluster CA.
pub fn internal_client_config(config: &InternalTlsConfig) -> Result<ClientConfig, String> {
    let cert = required(&config.cert_file, "http.internal_tls.cert_file")?;
    let key_file = required(&config.key_file, "http.internal_tls.key_file")?;
    let ca = required(&config.ca_file, "http.internal_tls.ca_file")?;
    let mut client = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots(ca)?)
        .with_client_auth_cert(certs(cert)?, key(key_file)?)
        .map_err(|e| format!("http.internal_tls: {e}"))?;
    client.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(client)
}

/// Mutual TLS of the ractor_cluster control plane, from `[http.internal_tls]`.
pub fn control_tls(
    config: &InternalTlsConfig,
) -> Result<crate::control::cluster::ControlTls, String> {
    let acceptor = internal_acceptor(config)?;
    let mut server = (**acceptor.config()).clone();
    server.alpn_protocols.clear();
    let mut client = internal_client_config(config)?;
    client.alpn_protocols.clear();
    Ok(crate::control::cluster::ControlTls {
        acceptor: TlsAcceptor::from(Arc::new(server)),
        connector: tokio_rustls::TlsConnector::from(Arc::new(client)),
    })
}
