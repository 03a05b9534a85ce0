//! `Connection: close` on an answer sent while the request body is still unread.
//!
//! An upload can be refused before or while its body streams (a size limit, admission, a
//! store that went away): the answer goes out early and hyper then closes the connection
//! rather than read the rest. A keep-alive client that is not told so may send its next
//! request on that connection and fail (`IncompleteMessage`, seen by the `s3_outage`
//! tests). RFC 9112 §9.6: a server that closes the connection after a response says so
//! with `Connection: close`. This layer wraps the request body, notes whether it was read
//! to its end, and if not adds that header. It owns nothing else: the decision to answer
//! early stays with the handlers.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};

/// A request body that records when it has been read to its end.
struct Tracked {
    inner: Body,
    ended: Arc<AtomicBool>,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        let ended = match &polled {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => self.inner.is_end_stream(),
            _ => false,
        };
        if ended {
            self.ended.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Middleware: answers sent before the request body was read to its end carry
/// `Connection: close`.
pub async fn close_if_unread(request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let ended = Arc::new(AtomicBool::new(http_body::Body::is_end_stream(&body)));
    let body = Body::new(Tracked {
        inner: body,
        ended: ended.clone(),
    });
    let mut response = next.run(Request::from_parts(parts, body)).await;
    if !ended.load(Ordering::Acquire) {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::routing::post;
    use tower::ServiceExt;

    async fn answer(read: bool, body: Body) -> Response {
        let app = Router::new()
            .route(
                "/",
                post(move |body: Body| async move {
                    if read {
                        let _ = axum::body::to_bytes(body, usize::MAX).await;
                    }
                    "ok"
                }),
            )
            .layer(axum::middleware::from_fn(close_if_unread));
        let request = Request::post("/").body(body).unwrap();
        app.oneshot(request).await.unwrap()
    }

    fn streamed(pieces: usize) -> Body {
        let frames = (0..pieces).map(|_| Ok::<_, std::io::Error>(Bytes::from_static(b"abcd")));
        Body::from_stream(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn an_answer_before_the_body_is_read_closes_the_connection() {
        let response = answer(false, streamed(3)).await;
        assert_eq!(response.headers()[header::CONNECTION], "close");
    }

    #[tokio::test]
    async fn an_answer_after_the_whole_body_keeps_the_connection() {
        let response = answer(true, streamed(3)).await;
        assert!(response.headers().get(header::CONNECTION).is_none());
        // no body at all: nothing left unread
        let response = answer(false, Body::empty()).await;
        assert!(response.headers().get(header::CONNECTION).is_none());
    }
}
