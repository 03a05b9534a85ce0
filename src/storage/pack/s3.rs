//! Packs in an S3-compatible bucket through `object_store`'s `AmazonS3`.
//!
//! One PUT per sealed pack (no multipart: packs are 16-64 MiB, and multipart would cost
//! 3+ requests per pack), ranged GETs for blocks. The PUT body is the sealed spool file
//! mapped read-only (`mmap`), not a heap copy: page-cache pages the kernel can drop and
//! re-read under memory pressure, where a buffer would pin `pack_size` of anonymous
//! memory per concurrent seal.
//! Throttling (503 SlowDown), other 5xx and timeouts are retried by `object_store` with
//! exponential backoff and jitter, bounded by `max_retries` and `request_timeout`; what is
//! still failing surfaces as [`StoreError::Unavailable`], which uploads answer with 503 and
//! `Retry-After`. At start the medium probes whether the server honours a conditional
//! create (`If-None-Match: *`) by creating one probe key twice; when it does, packs are
//! created conditionally, otherwise they are plain PUTs, which is still safe because a
//! pack's name fixes its bytes (see `format`). Credentials never appear in `Debug`, logs
//! or errors.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, ClientOptions, GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions,
    PutPayload, RetryConfig,
};
use tokio::runtime::Handle;

use super::format::PackId;
use super::medium::{Medium, OpenRange, SyncTrace, TraceHook};
use crate::storage::StoreError;
use crate::storage::config::S3Config;
use crate::values::Secret;

pub struct S3Medium {
    store: Arc<AmazonS3>,
    prefix: String,
    runtime: Handle,
    conditional: AtomicBool,
    /// GET requests sent for block reads (ranged reads and streamed runs).
    reads: AtomicU64,
    puts: AtomicU64,
    /// `storage.s3.bucket` and the endpoint (`AWS` when unset), for errors.
    bucket: String,
    endpoint: String,
    label: String,
    trace: Option<TraceHook>,
}

impl std::fmt::Debug for S3Medium {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label)
    }
}

/// Credentials resolved from the config, a secret file, or the environment (also
/// checked by `config::files`, so `check-config` refuses what this would).
pub(crate) fn credentials(config: &S3Config) -> Result<(String, Secret), StoreError> {
    let mut key_id = config.access_key_id.clone();
    let mut secret = config.secret_access_key.clone();
    if let Some(path) = &config.credentials_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| StoreError::io("read storage.s3.credentials_file", e))?;
        for line in text.lines() {
            if let Some((name, value)) = line.split_once('=') {
                match name.trim() {
                    "access_key_id" if key_id.is_empty() => key_id = value.trim().to_string(),
                    "secret_access_key" if secret.is_none() => {
                        secret = Some(Secret::new(value.trim()))
                    }
                    _ => {}
                }
            }
        }
    }
    if key_id.is_empty() {
        key_id = std::env::var("AWS_ACCESS_KEY_ID").unwrap_or_default();
    }
    if secret.is_none() {
        secret = std::env::var("AWS_SECRET_ACCESS_KEY").ok().map(Secret::new);
    }
    match (key_id.is_empty(), secret) {
        (false, Some(secret)) => Ok((key_id, secret)),
        _ => Err(StoreError::Unavailable(
            "S3 credentials missing: set storage.s3.access_key_id/secret_access_key, \
             storage.s3.credentials_file, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
                .into(),
        )),
    }
}

fn s3_err(op: &'static str) -> impl Fn(object_store::Error) -> StoreError {
    move |e| match e {
        object_store::Error::NotFound { .. } => StoreError::Corrupt(format!("{op}: pack missing")),
        // object_store errors carry the URL and status, never the signing secret.
        other => StoreError::Unavailable(format!("{op}: {other}")),
    }
}

impl S3Medium {
    /// Connect (no request yet); call [`S3Medium::probe`] before use.
    pub fn new(config: &S3Config, trace: Option<SyncTrace>) -> Result<Self, StoreError> {
        let (key_id, secret) = credentials(config)?;
        let timeout = config.request_timeout.get();
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_access_key_id(key_id)
            .with_secret_access_key(secret.expose())
            .with_virtual_hosted_style_request(!config.path_style)
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(5),
                    base: 2.0,
                },
                max_retries: config.max_retries,
                retry_timeout: timeout,
            })
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(timeout)
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_allow_http(true),
            );
        if !config.endpoint.is_empty() {
            builder = builder.with_endpoint(&config.endpoint);
        }
        let store = builder
            .build()
            .map_err(|e| StoreError::Unavailable(format!("configure S3 client: {e}")))?;
        let runtime = Handle::try_current()
            .map_err(|_| StoreError::Unavailable("S3 medium needs a tokio runtime".into()))?;
        Ok(Self {
            store: Arc::new(store),
            prefix: config.prefix.trim_matches('/').to_string(),
            runtime,
            conditional: AtomicBool::new(false),
            reads: AtomicU64::new(0),
            puts: AtomicU64::new(0),
            bucket: config.bucket.clone(),
            endpoint: if config.endpoint.is_empty() {
                "AWS".to_string()
            } else {
                config.endpoint.clone()
            },
            label: format!(
                "S3 packs in bucket {} at {} (prefix {})",
                config.bucket,
                if config.endpoint.is_empty() {
                    "AWS"
                } else {
                    &config.endpoint
                },
                config.prefix
            ),
            trace: trace.map(TraceHook),
        })
    }

    fn path(&self, id: &PackId) -> ObjectPath {
        let hex = id.to_hex();
        ObjectPath::from(format!("{}/{}/{hex}.pack", self.prefix, &hex[..2]))
    }

    /// Check the bucket answers and whether it honours `If-None-Match: *`.
    pub async fn probe(&self) -> Result<bool, StoreError> {
        let key = ObjectPath::from(format!(
            "{}/probe/{}",
            self.prefix,
            uuid::Uuid::new_v4().simple()
        ));
        let create = || PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        let first = self
            .store
            .put_opts(&key, PutPayload::from_static(b"probe"), create())
            .await;
        let honoured = match first {
            Ok(_) => matches!(
                self.store
                    .put_opts(&key, PutPayload::from_static(b"probe"), create())
                    .await,
                Err(object_store::Error::AlreadyExists { .. })
                    | Err(object_store::Error::Precondition { .. })
            ),
            // A server that rejects the header outright: no conditional creates.
            Err(object_store::Error::NotImplemented { .. }) => false,
            // The bucket itself is missing: name it, the endpoint and the keys.
            Err(object_store::Error::NotFound { .. }) => {
                return Err(StoreError::Unavailable(format!(
                    "the S3 bucket {:?} does not exist at {} (storage.s3.bucket, \
                     storage.s3.endpoint): create it, or correct those keys",
                    self.bucket, self.endpoint
                )));
            }
            Err(e) => return Err(s3_err("probe the S3 bucket")(e)),
        };
        let _ = self.store.delete(&key).await;
        self.conditional.store(honoured, Ordering::SeqCst);
        Ok(honoured)
    }

    pub fn conditional_create(&self) -> bool {
        self.conditional.load(Ordering::SeqCst)
    }

    /// GET requests sent so far for block reads (tests and benchmarks count them).
    pub fn block_reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// Packs PUT so far (tests and benchmarks count them).
    pub fn pack_puts(&self) -> u64 {
        self.puts.load(Ordering::Relaxed)
    }

    /// One PUT of `data` as pack `id` (used by publish and compaction).
    pub fn put_pack(&self, id: &PackId, data: Bytes) -> Result<(), StoreError> {
        self.puts.fetch_add(1, Ordering::Relaxed);
        let path = self.path(id);
        let mode = if self.conditional_create() {
            PutMode::Create
        } else {
            PutMode::Overwrite
        };
        let result = self.runtime.block_on(self.store.put_opts(
            &path,
            PutPayload::from_bytes(data),
            PutOptions {
                mode,
                ..Default::default()
            },
        ));
        match result {
            Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => Ok(()),
            Err(e) => Err(s3_err("store pack on S3")(e)),
        }
    }
}

/// A read-only private mapping of a whole sealed spool file.
struct Mapped {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is read-only and never changes while mapped (the spool file is
// sealed before it is mapped, and only this process writes spool files); sharing `&[u8]`
// views of it across threads is therefore sound.
unsafe impl Send for Mapped {}
unsafe impl Sync for Mapped {}

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes until `drop` unmaps them.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: exactly the region `mmap` returned; no view outlives the owner.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// The bytes of a sealed file as a `Bytes` backed by a mapping (no heap copy). Removing
/// the file afterwards is fine: the mapping keeps the inode's pages until dropped.
fn map_file(file: &File) -> std::io::Result<Bytes> {
    use std::os::fd::AsRawFd;
    let len = usize::try_from(file.metadata()?.len())
        .map_err(|_| std::io::Error::other("spool file too large to map"))?;
    if len == 0 {
        return Ok(Bytes::new());
    }
    // SAFETY: a fresh read-only private mapping of an open descriptor; checked below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let ptr = std::ptr::NonNull::new(ptr.cast::<u8>())
        .ok_or_else(|| std::io::Error::other("mmap returned null"))?;
    // SAFETY: a valid mapping of `len` bytes; the advice only affects read-ahead.
    unsafe {
        libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_SEQUENTIAL);
    }
    Ok(Bytes::from_owner(Mapped { ptr, len }))
}

impl Medium for S3Medium {
    fn groups_small_packs(&self) -> bool {
        true
    }

    fn publish_behind(&self) -> bool {
        true
    }

    fn publish(&self, spool: File, spool_path: &Path, id: &PackId) -> Result<(), StoreError> {
        drop(spool);
        // The spool was written through a write-only handle: map a reading one.
        let data = File::open(spool_path)
            .and_then(|file| map_file(&file))
            .map_err(|e| StoreError::io("map spool file", e));
        let result = data.and_then(|data| self.put_pack(id, data));
        let _ = std::fs::remove_file(spool_path);
        result?;
        if let Some(trace) = &self.trace {
            (trace.0)("pack stored on S3");
        }
        Ok(())
    }

    fn read(&self, id: &PackId, offset: u64, len: u64) -> Result<Bytes, StoreError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let data = self
            .runtime
            .block_on(self.store.get_range(&self.path(id), offset..offset + len))
            .map_err(s3_err("read pack range from S3"))?;
        if data.len() as u64 != len {
            return Err(StoreError::Corrupt(format!("pack {id} is truncated")));
        }
        Ok(data)
    }

    fn read_all(&self, id: &PackId) -> Result<Bytes, StoreError> {
        self.runtime
            .block_on(async { self.store.get(&self.path(id)).await?.bytes().await })
            .map_err(s3_err("read pack from S3"))
    }

    fn delete(&self, id: &PackId) -> Result<(), StoreError> {
        match self.runtime.block_on(self.store.delete(&self.path(id))) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(s3_err("delete pack on S3")(e)),
        }
    }

    fn exists(&self, id: &PackId) -> Result<bool, StoreError> {
        match self.runtime.block_on(self.store.head(&self.path(id))) {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(s3_err("check a pack on S3")(e)),
        }
    }

    fn list(&self) -> Result<Vec<(PackId, u64)>, StoreError> {
        let prefix = ObjectPath::from(self.prefix.as_str());
        self.runtime.block_on(async {
            let mut out = Vec::new();
            let mut listing = self.store.list(Some(&prefix));
            while let Some(meta) = listing.next().await {
                let meta = meta.map_err(s3_err("list packs on S3"))?;
                if let Some(id) = meta
                    .location
                    .filename()
                    .and_then(|n| n.strip_suffix(".pack"))
                    .and_then(PackId::from_hex)
                {
                    out.push((id, meta.last_modified.timestamp_millis().max(0) as u64));
                }
            }
            Ok(out)
        })
    }

    fn describe(&self) -> String {
        self.label.clone()
    }

    /// One `HEAD` in the bucket: an absent object is an answer, so only a server that does
    /// not answer (or refuses the credentials) fails it.
    fn probe(&self) -> Result<(), StoreError> {
        let key = ObjectPath::from(format!("{}/probe/health", self.prefix));
        match self.runtime.block_on(self.store.head(&key)) {
            Ok(_) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(s3_err("probe the S3 bucket")(e)),
        }
    }

    fn coalesces_reads(&self) -> bool {
        true
    }

    /// One ranged GET whose body is streamed: `object_store` sends the request and
    /// resolves when the response headers arrive (retrying what fails before that); the
    /// body is read from the connection only as it is pulled.
    fn open_range(self: Arc<Self>, id: PackId, offset: u64, len: u64) -> OpenRange {
        Box::pin(async move {
            self.reads.fetch_add(1, Ordering::Relaxed);
            let options = GetOptions::new().with_range(Some(offset..offset + len));
            match self.store.get_opts(&self.path(&id), options).await {
                Ok(result) => Ok(Some(
                    result
                        .into_stream()
                        .map(|chunk| chunk.map_err(s3_err("read pack range from S3")))
                        .boxed(),
                )),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(s3_err("read pack range from S3")(e)),
            }
        })
    }
}
