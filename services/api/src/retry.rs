//! A read whose database connection was lost is asked once more before it is answered.
//!
//! A Postgres restart or failover ends every connection the pool holds: the statement in flight
//! on one fails with "terminating connection" or a closed socket although nothing was wrong
//! with it, and the pool's other idle connections may be just as dead. A GET or HEAD changes
//! nothing, so it is run again at once, once, with every connection it takes checked first
//! (`relay_store::with_every_connection_checked`), so the second run gets a live connection or a
//! new one. If that fails too the answer is the first one: 503 with
//! Retry-After. A write is never run again here: it may have committed before the connection
//! went, and only its caller can know whether to ask again.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::Request;
use axum::http::Method;
use axum::response::Response;
use tower::{Layer, Service, ServiceExt};

use crate::error::ConnectionLost;

/// Wraps each route so that a read answered [`ConnectionLost`] runs once more.
#[derive(Debug, Clone, Copy, Default)]
pub struct RetryLostReads;

impl<S> Layer<S> for RetryLostReads {
    type Service = RetryLostReadsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryLostReadsService { inner }
    }
}

#[derive(Debug, Clone)]
pub struct RetryLostReadsService<S> {
    inner: S,
}

impl<S> Service<Request> for RetryLostReadsService<S>
where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // The service polled ready is the one that takes this request; a clone takes the next.
        let again = self.inner.clone();
        let mut first = std::mem::replace(&mut self.inner, again.clone());
        let repeat = matches!(*request.method(), Method::GET | Method::HEAD).then(|| {
            // A read has no body: its head (with the route's extensions) is all it is.
            let mut copy = Request::new(Body::empty());
            *copy.method_mut() = request.method().clone();
            *copy.uri_mut() = request.uri().clone();
            *copy.version_mut() = request.version();
            *copy.headers_mut() = request.headers().clone();
            *copy.extensions_mut() = request.extensions().clone();
            copy
        });
        Box::pin(async move {
            let answer = first.call(request).await?;
            match repeat {
                Some(copy) if answer.extensions().get::<ConnectionLost>().is_some() => {
                    tracing::info!(
                        path = %copy.uri().path(),
                        "a read lost its database connection; asking again"
                    );
                    let second =
                        relay_store::with_every_connection_checked(again.oneshot(copy)).await?;
                    Ok(second)
                }
                _ => Ok(answer),
            }
        })
    }
}
