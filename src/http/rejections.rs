//! Turns axum's extractor rejections (a malformed query string, a JSON body of the wrong
//! type or shape) into the API's error format.
//!
//! axum answers them with `text/plain` bodies that echo parser messages, which may quote
//! the input (a tenant id in a query string, say). docs/api.md promises JSON errors with
//! stable codes and messages that never carry tenant ids, so this layer replaces any such
//! 4xx answer with an [`ApiError`] of a fixed code and message. Found by `scripts/fuzz-api`.

use axum::extract::Request;
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::edge::{ApiError, ErrorCode};

/// Middleware: rewrite plain-text 4xx rejections as JSON errors.
pub async fn json_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let plain = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/plain"));
    if !plain {
        return response;
    }
    // Each rejection status, as the code of the same status.
    let Some((code, message)) = [
        (
            ErrorCode::InvalidRequest,
            "the request's path, query string or body could not be parsed",
        ),
        (
            ErrorCode::InvalidBody,
            "the JSON body does not have the documented shape",
        ),
        (
            ErrorCode::UnsupportedMediaType,
            "this endpoint takes a body of the documented content type",
        ),
        (
            ErrorCode::BodyTooLarge,
            "the request body is too large for this endpoint",
        ),
    ]
    .into_iter()
    .find(|(code, _)| code.status() == response.status()) else {
        return response;
    };
    ApiError::new(code, message).into_response()
}
