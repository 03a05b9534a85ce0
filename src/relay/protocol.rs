//! The node-to-node protocol of a relayed request, shared by the relay (the client) and
//! the owner's internal listener (`http::internal`, `http::tus_internal`): header names,
//! resource paths, and the codec of a refusal's message (`X-Graviton-Error-Message`).

use axum::http::HeaderValue;

use crate::ids::SessionKey;
use crate::tus::UploadId;

/// Header carrying the internal token.
pub const INTERNAL_TOKEN_HEADER: &str = "x-graviton-internal-token";
/// Header carrying the shard the relay routed by.
pub const SHARD_HEADER: &str = "x-graviton-shard";
/// Header carrying the shard epoch the relay routed by.
pub const SHARD_EPOCH_HEADER: &str = "x-graviton-shard-epoch";
/// On 409: the node that owns the shard now (when known).
pub const CURRENT_OWNER_HEADER: &str = "x-graviton-current-owner";
/// On 409: the shard's current epoch.
pub const CURRENT_EPOCH_HEADER: &str = "x-graviton-current-epoch";
/// Pre-flight answer and request header: the admission the owner parked for this transfer.
pub const RESERVATION_HEADER: &str = "x-graviton-admission-reservation";
/// On a refused pre-flight (HEAD has no body): the error code the request would answer.
pub const ERROR_CODE_HEADER: &str = "x-graviton-error";
/// On a refused pre-flight: the message the request would answer (printable ASCII, at
/// most [`ERROR_MESSAGE_MAX`] bytes), so the relay passes on the reason, not only the code.
pub const ERROR_MESSAGE_HEADER: &str = "x-graviton-error-message";
/// Longest relayed error message, in bytes.
pub const ERROR_MESSAGE_MAX: usize = 512;

/// The path of the owner-ingest resource of a plain upload.
pub fn ingest_path(key: &SessionKey) -> String {
    format!("/internal/v1/sessions/{}/{}/blobs", key.tenant, key.session)
}

/// The owner-side path of a resumable upload.
pub fn tus_path(id: &UploadId) -> String {
    format!("/internal/v1/uploads/{id}")
}

/// `message` as a header value: printable ASCII (anything else becomes `?`), cut at
/// [`ERROR_MESSAGE_MAX`] bytes.
pub fn message_header(message: &str) -> Option<HeaderValue> {
    let text: String = message
        .chars()
        .map(|c| {
            if c == ' ' || c.is_ascii_graphic() {
                c
            } else {
                '?'
            }
        })
        .take(ERROR_MESSAGE_MAX)
        .collect();
    HeaderValue::from_str(text.trim()).ok()
}

/// The message an owner sent with a refused pre-flight, when it is well formed.
pub fn relayed_message(headers: &reqwest::header::HeaderMap) -> Option<String> {
    let text = headers.get(ERROR_MESSAGE_HEADER)?.to_str().ok()?;
    (!text.is_empty()
        && text.len() <= ERROR_MESSAGE_MAX
        && text.bytes().all(|b| b == b' ' || b.is_ascii_graphic()))
    .then(|| text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_printable_ascii_crosses_and_comes_back() {
        // Anything else is replaced, never dropped silently.
        assert_eq!(message_header("caf\u{e9}\nx").unwrap(), "caf??x");
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(
            ERROR_MESSAGE_HEADER,
            message_header("transfer capacity is busy; retry later").unwrap(),
        );
        assert_eq!(
            relayed_message(&headers).as_deref(),
            Some("transfer capacity is busy; retry later")
        );
        let long = "x".repeat(2 * ERROR_MESSAGE_MAX);
        assert_eq!(message_header(&long).unwrap().len(), ERROR_MESSAGE_MAX);
    }
}
