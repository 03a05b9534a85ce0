//! The HTTP client behind `graviton put` and `graviton get`.
//!
//! `put` streams a file from disk (never loading it into memory) with its exact
//! `Content-Length`. `get` streams the blob into a temporary file next to the target,
//! checks its BLAKE3 hash and size against the key, and only then renames it into place,
//! so a failed or corrupted download never leaves a partial file behind. Both show a
//! progress bar when stderr is a terminal, send the caller's [`Credentials`] (a bearer
//! token, a tenant for quotas), and turn a refusal into an error that names the fix.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::cas::BlobKey;
use crate::ids::{SessionKey, TenantId};
use crate::upload::UploadReceipt as UploadResponse;
use crate::values::Secret;

/// Default server for client commands (`GRAVITON_SERVER` overrides).
pub const SERVER_DEFAULT: &str = "http://127.0.0.1:7070";

/// Who the client acts for: a bearer token (`--token`, `GRAVITON_TOKEN`) and, for a
/// download, the tenant its egress is charged to (`--tenant`).
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    pub token: Option<Secret>,
    pub tenant: Option<TenantId>,
}

impl Credentials {
    fn bearer(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(token) => request.bearer_auth(token.expose()),
            None => request,
        }
    }

    /// The token and the tenant (a download's egress tenant).
    fn apply(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let mut request = self.bearer(request);
        if let Some(tenant) = &self.tenant {
            request = request.header(crate::edge::headers::TENANT_HEADER, tenant.to_string());
        }
        request
    }
}

/// What to do about a refusal, when the answer says it.
fn fix_for(status: reqwest::StatusCode, code: &str) -> &'static str {
    match (status.as_u16(), code) {
        (401, _) => " (the server requires a bearer token: pass --token or set GRAVITON_TOKEN)",
        (403, "tenant_mismatch") => " (--tenant must be the token's organization, or left out)",
        (413, _) => " (the file is larger than the server's upload.max_blob_size)",
        (429, _) | (503, _) => " (temporary: retry after the time the server named)",
        (400, "digest_mismatch") => " (the file changed while it was read; upload it again)",
        _ => "",
    }
}

fn progress_bar(total: Option<u64>, verb: &str) -> ProgressBar {
    let bar = match total {
        Some(total) => ProgressBar::new(total),
        None => ProgressBar::new_spinner(),
    };
    if std::io::stderr().is_terminal() {
        bar.set_style(
            ProgressStyle::with_template(&format!(
                "{verb} {{bar:40.cyan/blue}} {{bytes}}/{{total_bytes}} {{bytes_per_sec}} eta {{eta}}"
            ))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
    } else {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar
}

fn http_client() -> anyhow::Result<reqwest::Client> {
    reqwest::Client::builder()
        .connect_timeout(std::time::Duration::from_secs(10))
        .read_timeout(std::time::Duration::from_secs(300))
        .build()
        .context("build HTTP client")
}

/// The server's refusal as the error to print: its status, code, message and
/// `Retry-After`, then what to change.
async fn error_of(response: reqwest::Response) -> anyhow::Error {
    let status = response.status();
    let retry = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .map(|seconds| format!("; Retry-After: {seconds} s"))
        .unwrap_or_default();
    let body = response.text().await.unwrap_or_default();
    match serde_json::from_str::<serde_json::Value>(&body) {
        Ok(json) => {
            let code = json["error"].as_str().unwrap_or("unknown");
            anyhow::anyhow!(
                "server answered {status}: {} ({code}){retry}{}",
                json["message"].as_str().unwrap_or("no message"),
                fix_for(status, code)
            )
        }
        Err(_) => anyhow::anyhow!("server answered {status}{retry}{}", fix_for(status, "")),
    }
}

/// Upload `file`; returns the server's answer.
pub async fn put(
    server: &str,
    file: &Path,
    session: Option<SessionKey>,
    credentials: &Credentials,
) -> anyhow::Result<UploadResponse> {
    let handle = tokio::fs::File::open(file)
        .await
        .with_context(|| format!("open {}", file.display()))?;
    let size = handle
        .metadata()
        .await
        .with_context(|| format!("stat {}", file.display()))?
        .len();
    let bar = progress_bar(Some(size), "uploading");
    let progress = bar.clone();
    let stream =
        tokio_util::io::ReaderStream::with_capacity(handle, 256 * 1024).inspect(move |chunk| {
            if let Ok(chunk) = chunk {
                progress.inc(chunk.len() as u64);
            }
        });
    let mut request = http_client()?
        .post(format!("{}/v1/blobs", server.trim_end_matches('/')))
        .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
        .header(reqwest::header::CONTENT_LENGTH, size)
        .body(reqwest::Body::wrap_stream(stream));
    // An upload's tenant travels with its session (`--tenant` and `--session` together).
    request = credentials.bearer(request);
    if let Some(key) = session {
        request = request
            .header(crate::edge::headers::TENANT_HEADER, key.tenant.to_string())
            .header(
                crate::edge::headers::SESSION_HEADER,
                key.session.to_string(),
            );
    }
    // A server that refuses the request (a missing token, a size limit) answers before
    // reading the body and closes; a large body then fails with a broken connection
    // instead of the answer, so say what usually causes that.
    let response = request.send().await.with_context(|| {
        format!(
            "upload to {server} (if the server closed the connection early it refused the request before reading it: check --token / GRAVITON_TOKEN, --tenant/--session and upload.max_blob_size)"
        )
    })?;
    bar.finish_and_clear();
    if !response.status().is_success() {
        return Err(error_of(response).await);
    }
    let body = response.bytes().await.context("read upload response")?;
    serde_json::from_slice(&body).context("decode upload response")
}

/// Download `key` into `output` (or stdout when `None`), verifying it.
pub async fn get(
    server: &str,
    key: &str,
    output: Option<&Path>,
    credentials: &Credentials,
) -> anyhow::Result<u64> {
    let key: BlobKey = key.parse().with_context(|| {
        format!(
            "{key:?} is not a blob key (expected blake3:<64 hex>:<size>, as `graviton put` prints)"
        )
    })?;
    let request = http_client()?.get(format!("{}/v1/blobs/{key}", server.trim_end_matches('/')));
    let response = credentials
        .apply(request)
        .send()
        .await
        .with_context(|| format!("download from {server}"))?;
    if !response.status().is_success() {
        return Err(error_of(response).await);
    }
    let bar = progress_bar(Some(key.size), "downloading");
    let mut hasher = blake3::Hasher::new();
    let mut received = 0u64;
    let (mut sink, temp): (
        Box<dyn Write + Send>,
        Option<(tempfile::NamedTempFile, PathBuf)>,
    ) = match output {
        Some(path) => {
            let dir = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            let temp = tempfile::NamedTempFile::new_in(dir)
                .with_context(|| format!("create a file in {}", dir.display()))?;
            let file = temp.reopen().context("open temporary file")?;
            (
                Box::new(std::io::BufWriter::new(file)),
                Some((temp, path.to_path_buf())),
            )
        }
        None => (Box::new(std::io::stdout()), None),
    };
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.context("download interrupted")?;
        hasher.update(&chunk);
        received += chunk.len() as u64;
        sink.write_all(&chunk).context("write output")?;
        bar.inc(chunk.len() as u64);
    }
    sink.flush().context("flush output")?;
    drop(sink);
    bar.finish_and_clear();
    if received != key.size || *hasher.finalize().as_bytes() != key.hash {
        bail!(
            "downloaded content does not match {key} ({received} bytes received); nothing was written"
        );
    }
    if let Some((temp, path)) = temp {
        temp.persist(&path)
            .with_context(|| format!("move download into {}", path.display()))?;
    }
    Ok(received)
}
