//! `[storage]` keys owned by the block store: backend, pack size, S3 and the collector.

use serde::{Deserialize, Serialize};

use crate::values::Problem;
use crate::values::Secret;
use crate::values::{ByteSize, HumanDuration};

/// Where packs live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Packs under `<data_dir>/packs` (embedded default).
    #[default]
    Fs,
    /// Packs in an S3-compatible bucket (`[storage.s3]`); cluster default.
    S3,
}

/// `[storage.s3]`: the bucket that holds packs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct S3Config {
    /// `http(s)://host:port` of the S3 API (empty: AWS for `region`).
    pub endpoint: String,
    pub bucket: String,
    /// Signing region (Garage: `garage`).
    pub region: String,
    /// Path-style requests (`endpoint/bucket/key`); Garage and MinIO want this.
    pub path_style: bool,
    /// Key prefix inside the bucket.
    pub prefix: String,
    /// Access key id; when empty, `AWS_ACCESS_KEY_ID` from the environment.
    pub access_key_id: String,
    /// Secret key; when absent, `credentials_file` or `AWS_SECRET_ACCESS_KEY`.
    pub secret_access_key: Option<Secret>,
    /// A file holding `access_key_id=...` and `secret_access_key=...` lines.
    pub credentials_file: Option<std::path::PathBuf>,
    /// Give up a request (after retries with backoff) after this long.
    pub request_timeout: HumanDuration,
    pub max_retries: usize,
}

impl Default for S3Config {
    fn default() -> Self {
        Self {
            endpoint: String::new(),
            bucket: String::new(),
            region: "us-east-1".into(),
            path_style: true,
            prefix: "graviton/packs".into(),
            access_key_id: String::new(),
            secret_access_key: None,
            credentials_file: None,
            request_timeout: HumanDuration::secs(30),
            max_retries: 4,
        }
    }
}

/// `[storage.gc]`: the collector.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GcConfig {
    /// Unreferenced blocks younger than this (last written or deduplicated) are kept.
    pub min_age: HumanDuration,
    /// Quarantined blocks and retired packs are purged after this long.
    pub retention: HumanDuration,
    /// Rewrite packs whose live bytes are below this fraction of their size.
    pub compact_below: f64,
    /// Run the collector in `serve` this often (0 = only `graviton gc`).
    pub interval: HumanDuration,
    /// Index entries per write transaction of the quarantine and the purge: what bounds
    /// the collector's memory (docs/storage.md, "Memory").
    pub batch: usize,
}

impl Default for GcConfig {
    fn default() -> Self {
        Self {
            min_age: HumanDuration::secs(6 * 3600),
            retention: HumanDuration::secs(24 * 3600),
            compact_below: 0.5,
            interval: HumanDuration::secs(0),
            batch: 4096,
        }
    }
}

/// The smallest `storage.gc.min_age` accepted for the periodic collector.
pub const MIN_GC_MIN_AGE: std::time::Duration = std::time::Duration::from_secs(1);

impl GcConfig {
    /// Problems of the collector's keys. A periodic collector (`interval` > 0) runs beside
    /// uploads, so its `min_age` below [`MIN_GC_MIN_AGE`] (0 above all) is refused: it is
    /// the grace of every running upload's packs written but not yet indexed (an upload
    /// whose pack is older than it when the collector runs fails with 503) and, in a
    /// cluster, of a dedup hit before its commit. A manifest's own blocks never rely on it
    /// (STO-25). A run by hand (`graviton gc`, `POST /v1/admin/gc`) may use 0, on a store
    /// with no upload running (after a crash, in tests and benchmarks).
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if !self.interval.get().is_zero() && self.min_age.get() < MIN_GC_MIN_AGE {
            out.push(Problem::new(
                "storage.gc.min_age",
                "must be at least 1s when storage.gc.interval runs the collector beside \
                 uploads: running uploads rely on it for their packs not yet indexed (an \
                 upload longer than min_age may fail with 503); use hours in production \
                 (default 6h)",
            ));
        }
        out
    }
}

/// Defaults of the pack keys.
pub fn default_pack_size() -> ByteSize {
    ByteSize(32 << 20)
}

/// Problems of the block-store keys.
pub fn problems(
    backend: Backend,
    pack_size: ByteSize,
    s3: &S3Config,
    cluster: bool,
    shared_mount: bool,
) -> Vec<Problem> {
    let mut out = Vec::new();
    if !(1 << 20..=1 << 30).contains(&pack_size.bytes()) {
        out.push(Problem::new(
            "storage.pack_size",
            "must be between 1 MiB and 1 GiB (16-64 MiB recommended)",
        ));
    }
    if backend == Backend::S3 && s3.bucket.trim().is_empty() {
        out.push(Problem::new(
            "storage.s3.bucket",
            "is required with backend = \"s3\"",
        ));
    }
    if cluster && backend == Backend::Fs && !shared_mount {
        out.push(Problem::new(
            "storage.backend",
            "cluster mode keeps blocks in S3 (backend = \"s3\"); a local directory is only \
             allowed when every node mounts the same one (storage.shared_mount = true)",
        ));
    }
    out
}
