//! Request metrics middleware: counts and times every request by route template.
//!
//! The duration is the time to the response head. The request is counted when its
//! response body has ended or was dropped, with the status class of the head, except
//! that a body the server aborted with an error (a download whose block store failed
//! after the head) is counted as `5xx`: the client got a broken answer, whatever the
//! status line said, and the error-rate alert has to see it. A download aborted because
//! the tenant's egress quota ran out is counted as `4xx` (`download::aborted_class`).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use bytes::Bytes;
use http_body::{Frame, SizeHint};

use crate::edge::AppState;
use crate::metrics::{HttpLabels, Metrics, status_class};

pub async fn record(State(app): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let method = match request.method().as_str() {
        m @ ("GET" | "HEAD" | "POST" | "PUT" | "DELETE") => m.to_string(),
        _ => "other".to_string(),
    };
    let response = next.run(request).await;
    let labels = HttpLabels {
        route,
        method,
        status: status_class(response.status().as_u16()),
    };
    app.metrics
        .http_duration
        .get_or_create(&labels)
        .observe(started.elapsed().as_secs_f64());
    let metrics = app.metrics.clone();
    response.map(|body| {
        Body::new(CountedBody {
            inner: body,
            metrics,
            labels: Some(labels),
        })
    })
}

/// A response body that counts its request once, when it ends, fails or is dropped.
struct CountedBody {
    inner: Body,
    metrics: Metrics,
    /// `None` once counted.
    labels: Option<HttpLabels>,
}

impl CountedBody {
    fn count(&mut self, aborted: Option<&'static str>) {
        if let Some(mut labels) = self.labels.take() {
            if let Some(class) = aborted {
                labels.status = class;
            }
            self.metrics.http_requests.get_or_create(&labels).inc();
        }
    }
}

impl http_body::Body for CountedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Err(err))) => {
                let class = super::download::aborted_class(err);
                self.count(Some(class))
            }
            Poll::Ready(None) => self.count(None),
            _ => {}
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

impl Drop for CountedBody {
    fn drop(&mut self) {
        self.count(None);
    }
}
