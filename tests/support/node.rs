//! An in-process graviton node on a random loopback port with its own data directory.

use graviton::config::Config;
use graviton::node::{NodeOptions, RunningNode};

pub struct TestNode {
    pub node: Option<RunningNode>,
    pub dir: tempfile::TempDir,
    pub url: String,
}

impl TestNode {
    pub async fn start() -> Self {
        Self::start_with(|_| {}, NodeOptions::default()).await
    }

    /// Start with a config tweak and optional replacement stores.
    pub async fn start_with(tweak: impl FnOnce(&mut Config), options: NodeOptions) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = Config::for_test(dir.path());
        tweak(&mut config);
        config.validate().expect("valid test config");
        let node = graviton::node::start_with(config, options)
            .await
            .expect("start node");
        let url = node.base_url();
        Self {
            node: Some(node),
            dir,
            url,
        }
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        self.node.as_ref().expect("running").local_addr()
    }

    /// The value of the sample named exactly `series` (see [`super::metrics`]), `None`
    /// when absent.
    pub fn metric(&self, series: &str) -> Option<u64> {
        super::metrics::count(&self.metrics_text(), series)
    }

    pub fn metrics_text(&self) -> String {
        self.node
            .as_ref()
            .expect("running")
            .state()
            .metrics
            .encode()
    }

    /// Number of manifest files on disk.
    pub fn manifest_count(&self) -> usize {
        count_files(&self.dir.path().join("manifests"))
    }

    /// Blocks on disk: the entries of every sealed pack (read from each pack's trailer)
    /// plus any file of the legacy file-per-block layout.
    pub fn block_count(&self) -> usize {
        packed_blocks(&self.dir.path().join("packs")) + count_files(&self.dir.path().join("blocks"))
    }

    pub async fn shutdown(&mut self) -> graviton::node::ShutdownOutcome {
        self.node.take().expect("running").shutdown().await
    }
}

/// Pack files (`*.pack`) under `dir`, at any depth.
pub fn pack_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .flat_map(|e| {
            let path = e.path();
            if path.is_dir() {
                pack_files(&path)
            } else if path.extension().is_some_and(|x| x == "pack") {
                vec![path]
            } else {
                Vec::new()
            }
        })
        .collect()
}

/// Sum of the block counts in the trailers of the `.pack` files under `dir`.
pub fn packed_blocks(dir: &std::path::Path) -> usize {
    pack_files(dir)
        .iter()
        .map(|path| {
            let bytes = std::fs::read(path).expect("read pack");
            let tail = &bytes[bytes.len() - 8..];
            assert_eq!(&tail[4..], b"GVPK", "pack trailer of {}", path.display());
            u32::from_le_bytes(tail[..4].try_into().unwrap()) as usize
        })
        .sum()
}

pub fn count_files(dir: &std::path::Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| {
            let path = e.path();
            if path.is_dir() { count_files(&path) } else { 1 }
        })
        .sum()
}

/// Deterministic pseudo-random bytes.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Send raw bytes on a fresh connection and read whatever the server answers first
/// (status line and headers, up to the end of the head), without closing our side.
pub async fn raw_exchange(
    addr: std::net::SocketAddr,
    head_and_partial_body: &[u8],
) -> (tokio::net::TcpStream, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(head_and_partial_body)
        .await
        .expect("write request");
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let read = tokio::time::timeout_at(deadline, stream.read(&mut chunk))
            .await
            .expect("server answered within 10s while the body was still incomplete")
            .expect("read");
        if read == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..read]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            // read the JSON body too when Content-Length is small and already here
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let body_len = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                })
                .unwrap_or(0);
            if buf.len() >= end + 4 + body_len {
                break;
            }
        }
    }
    (stream, String::from_utf8_lossy(&buf).to_string())
}

/// Serve an internal (owner-ingest) listener with `token`, `epochs` and `ingest` on a free
/// loopback port for the rest of the test; returns its address.
pub async fn serve_internal(
    token: &str,
    epochs: impl graviton::http::internal::EpochCheck,
    ingest: impl graviton::http::internal::OwnerIngest,
) -> std::net::SocketAddr {
    use graviton::http::internal;
    let state = internal::InternalState {
        token: graviton::config::Secret::new(token),
        epochs: std::sync::Arc::new(epochs),
        ingest: std::sync::Arc::new(ingest),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(internal::serve(
        listener,
        internal::router(state),
        std::future::pending(),
    ));
    addr
}
