//! Serving an axum router on a TCP listener with the bounds a port open to strangers needs.
//!
//! `axum::serve` reads a request's head and body for as long as the client takes and accepts
//! connections until the process runs out of file descriptors: a few hundred clients sending a
//! header byte a second then stop every listener of the process. [`serve`] is used by every
//! listener of the relay (webhooks, the control plane, `/metrics`) and bounds three things:
//! - the request head (and the wait for the next one on a kept-alive connection) must arrive
//!   within [`ListenerLimits::header_read_timeout`], or hyper closes the connection;
//! - the body must arrive within [`ListenerLimits::body_read_timeout`] of its head: the reader
//!   gets a [`BodyReadTimeout`] error, and the client a 408 with the connection closed;
//! - at most [`ListenerLimits::max_connections`] connections are served at once. One more is
//!   answered 503 with Retry-After and closed straight away, so a crowd of slow clients costs
//!   the others a quick refusal, not a file descriptor the process no longer has;
//! - at most [`ListenerLimits::max_headless_per_address`] connections from one address that
//!   have not yet sent a complete request head are held at once: a slow client's connections
//!   take slots only until then, so one address cannot fill the listener with them while the
//!   upstream's connections, which send their head at once, never meet this bound.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::future::Future;
use std::net::IpAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use axum::Router;
use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::{Instant, Sleep};
use tower::Service as _;

/// How long a listener waits for clients, and how many it serves at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    /// A request's head must arrive within this long of the connection opening or of the
    /// previous answer (an idle kept-alive connection is closed after it too).
    pub header_read_timeout: Duration,
    /// A request's body must arrive within this long of its head.
    pub body_read_timeout: Duration,
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Connections from one address that have not sent a complete request head yet; more from
    /// that address are answered 503 and closed.
    pub max_headless_per_address: usize,
}

impl ListenerLimits {
    /// `/metrics` and `/healthz`: a scraper and a few probes, all on a private address.
    pub const METRICS: ListenerLimits = ListenerLimits {
        header_read_timeout: Duration::from_secs(5),
        body_read_timeout: Duration::from_secs(5),
        max_connections: 64,
        max_headless_per_address: 16,
    };
}

/// Connections past the bound that are answered (written to, then drained briefly) at once;
/// further ones are closed unanswered. Keeps a flood of refusals from costing descriptors.
const MAX_REFUSALS_IN_FLIGHT: usize = 64;
/// How long a refused connection is given to take its 503 before it is closed.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

/// The body did not arrive within [`ListenerLimits::body_read_timeout`].
#[derive(Debug, Clone, Copy)]
pub struct BodyReadTimeout(pub Duration);

impl std::fmt::Display for BodyReadTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the request body did not arrive within {} ms",
            self.0.as_millis()
        )
    }
}

impl StdError for BodyReadTimeout {}

impl BodyReadTimeout {
    /// True when `error` or one of its causes is a [`BodyReadTimeout`] (body readers wrap it).
    pub fn is_cause_of(error: &(dyn StdError + 'static)) -> bool {
        let mut cause = Some(error);
        while let Some(error) = cause {
            if error.is::<BodyReadTimeout>() {
                return true;
            }
            cause = error.source();
        }
        false
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` completes; then stops
/// accepting, lets each connection finish the request it is on, and returns once all have.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ListenerLimits,
    shutdown: impl Future<Output = ()> + Send,
) {
    let connections = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let headless = Headless::new(limits.max_headless_per_address);
    let refusals = Arc::new(Semaphore::new(MAX_REFUSALS_IN_FLIGHT));
    let (stopping, stop_seen) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    accept_failed(error).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let admitted = headless
            .admit(peer.ip())
            .and_then(|headless| Some((headless, connections.clone().try_acquire_owned().ok()?)));
        match admitted {
            Some((headless, permit)) => {
                let router = router.clone();
                let stop_seen = stop_seen.clone();
                tokio::spawn(async move {
                    serve_connection(stream, router, limits, headless, stop_seen).await;
                    drop(permit);
                });
            }
            None => match refusals.clone().try_acquire_owned() {
                Ok(permit) => {
                    tokio::spawn(async move {
                        refuse(stream, limits).await;
                        drop(permit);
                    });
                }
                Err(_) => drop(stream),
            },
        }
    }
    drop(listener);
    let _ = stopping.send(true);
    // Every connection task holds a permit until it ends: having them all back means every
    // connection has ended.
    let _ = connections
        .acquire_many(limits.max_connections.max(1) as u32)
        .await;
}

async fn serve_connection(
    stream: TcpStream,
    router: Router,
    limits: ListenerLimits,
    headless: HeadlessSlot,
    mut stop_seen: watch::Receiver<bool>,
) {
    // Given back with the first request head (or when the connection ends before one).
    let headless = Arc::new(std::sync::Mutex::new(Some(headless)));
    let service = service_fn(move |request: Request<Incoming>| {
        headless.lock().unwrap_or_else(|p| p.into_inner()).take();
        let mut router = router.clone();
        let timed_out = Arc::new(AtomicBool::new(false));
        let request = request.map(|body| {
            axum::body::Body::new(TimedBody {
                inner: body,
                limit: limits.body_read_timeout,
                deadline: Instant::now() + limits.body_read_timeout,
                sleep: None,
                timed_out: timed_out.clone(),
            })
        });
        async move {
            let response = router.call(request).await?;
            if timed_out.load(Ordering::Acquire) {
                return Ok(body_timeout_response(limits.body_read_timeout));
            }
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let mut connection = pin!(builder.serve_connection(TokioIo::new(stream), service));
    let mut stopping = false;
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(error) = result {
                tracing::debug!(%error, "connection ended");
            }
        }
        _ = stop_seen.wait_for(|stopping| *stopping) => {
            connection.as_mut().graceful_shutdown();
            stopping = true;
        }
    }
    if stopping {
        let _ = connection.await;
    }
}

/// How many connections each address holds that have not sent a request head yet.
#[derive(Clone)]
struct Headless {
    limit: usize,
    held: Arc<std::sync::Mutex<HashMap<IpAddr, usize>>>,
}

/// One connection's place among its address's headless ones, given back when dropped.
struct HeadlessSlot {
    address: IpAddr,
    held: Arc<std::sync::Mutex<HashMap<IpAddr, usize>>>,
}

impl Headless {
    fn new(limit: usize) -> Self {
        Self {
            limit: limit.max(1),
            held: Arc::default(),
        }
    }

    /// A place for one more headless connection from `address`, unless it holds its limit.
    fn admit(&self, address: IpAddr) -> Option<HeadlessSlot> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let count = held.entry(address).or_default();
        if *count >= self.limit {
            return None;
        }
        *count += 1;
        Some(HeadlessSlot {
            address,
            held: self.held.clone(),
        })
    }
}

impl Drop for HeadlessSlot {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = held.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.address);
            }
        }
    }
}

/// 503 with Retry-After, then close: the bound on connections is reached.
async fn refuse(mut stream: TcpStream, limits: ListenerLimits) {
    let body = serde_json::json!({
        "error": "too_many_connections",
        "detail": "the relay is serving as many connections as it allows; retry later",
    })
    .to_string();
    // A slot held by a slow client is free again at the latest once its head times out.
    let retry_after_s = limits.header_read_timeout.as_secs().max(1);
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\nretry-after: {retry_after_s}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_LINGER, async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await?;
        // Read what the client sent before closing: closing with unread bytes resets the
        // connection, and a reset can make the client drop the answer it has not read yet.
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

fn body_timeout_response(limit: Duration) -> Response<axum::body::Body> {
    let body = serde_json::json!({
        "error": "body_timeout",
        "detail": BodyReadTimeout(limit).to_string(),
    })
    .to_string();
    let mut response = Response::new(axum::body::Body::from(body));
    *response.status_mut() = StatusCode::REQUEST_TIMEOUT;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    // The rest of the body may still be on its way: this connection cannot carry another
    // request.
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Accept errors other than a client giving up are the process's own (out of descriptors):
/// wait a little rather than spin on them.
async fn accept_failed(error: std::io::Error) {
    use std::io::ErrorKind;
    if matches!(
        error.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!(%error, "accepting a connection failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// A request body that fails with [`BodyReadTimeout`] once its deadline passes. The timer is
/// armed only when the body is not all there already, which it usually is.
struct TimedBody {
    inner: Incoming,
    limit: Duration,
    deadline: Instant,
    sleep: Option<Pin<Box<Sleep>>>,
    timed_out: Arc<AtomicBool>,
}

impl Body for TimedBody {
    type Data = Bytes;
    type Error = Box<dyn StdError + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|result| result.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.as_mut().poll(cx).is_ready() {
            this.timed_out.store(true, Ordering::Release);
            return Poll::Ready(Some(Err(Box::new(BodyReadTimeout(this.limit)))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
