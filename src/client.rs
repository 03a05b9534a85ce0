//! The HTTP client behind `graviton put` and `graviton get`.
//!
//! `put` streams a file from disk (never loading it into memory) with its exact
//! `Content-Length`. `get` streams the blob into a temporary file next to the target,
//! checks its BLAKE3 hash and size against the key, and only then renames it into place,
//! so a failed or corrupted download never leaves a partial file behind. Both show a
//! progress bar when stderr is a terminal.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::cas::BlobKey;
use crate::ids::SessionKey;
use crate::upload::UploadReceipt as UploadResponse;

/// Default server for client commands (`GRAVITON_SERVER` overrides).
pub const SERVER_DEFAULT: &str = "http://127.0.0.1:7070";

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

async fn error_of(response: reqwest::Response) -> anyhow::Error {
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    match serde_json::from_str::<serde_json::Value>(&body) {
        Ok(json) => anyhow::anyhow!(
            "server answered {status}: {} ({})",
            json["message"].as_str().unwrap_or("no message"),
            json["error"].as_str().unwrap_or("unknown")
        ),
        Err(_) => anyhow::anyhow!("server answered {status}"),
    }
}

/// Upload `file`; returns the server's answer.
pub async fn put(
    server: &str,
    file: &Path,
    session: Option<SessionKey>,
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
    if let Some(key) = session {
        request = request
            .header(crate::http::headers::TENANT_HEADER, key.tenant.to_string())
            .header(
                crate::http::headers::SESSION_HEADER,
                key.session.to_string(),
            );
    }
    let response = request
        .send()
        .await
        .with_context(|| format!("upload to {server}"))?;
    bar.finish_and_clear();
    if !response.status().is_success() {
        return Err(error_of(response).await);
    }
    let body = response.bytes().await.context("read upload response")?;
    serde_json::from_slice(&body).context("decode upload response")
}

/// Download `key` into `output` (or stdout when `None`), verifying it.
pub async fn get(server: &str, key: &str, output: Option<&Path>) -> anyhow::Result<u64> {
    let key: BlobKey = key
        .parse()
        .with_context(|| format!("{key:?} is not a blob key"))?;
    let response = http_client()?
        .get(format!("{}/v1/blobs/{key}", server.trim_end_matches('/')))
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
