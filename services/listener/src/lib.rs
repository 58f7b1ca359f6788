//! Serving an axum router on a TCP listener with the bounds a port open to strangers needs.
//!
//! `axum::serve` reads a request's head and body for as long as the client takes, buffers what
//! bodies claim, and accepts connections until the process runs out of file descriptors: a few
//! hundred clients sending a header byte a second, or bodies that stop one byte short, then stop
//! every listener of the process. [`serve`] is used by every listener of the relay (webhooks, the
//! control plane, `/metrics`) and bounds:
//! - time: the request head (and the wait for the next one on a kept-alive connection) must
//!   arrive within [`ListenerLimits::header_read_timeout`], or hyper closes the connection; the
//!   body within [`ListenerLimits::body_read_timeout`] of its head (the reader gets a
//!   [`BodyReadTimeout`] error, the client a 408 with the connection closed); a kept-alive
//!   connection waits at most [`ListenerLimits::idle_timeout`] for its next request;
//! - connections: at most [`ListenerLimits::max_connections`] at once (fitted under the
//!   open-file limit at start-up: [`fit_connections`]), at most
//!   [`ListenerLimits::max_connections_per_client`] of one client's, and at most
//!   [`ListenerLimits::max_headless_per_address`] of one client's that have not yet sent a
//!   complete request head. One more is answered 503 with Retry-After and closed straight away,
//!   so a crowd costs the others a quick refusal, not a file descriptor the process no longer
//!   has, and one client (one address, however many connections it opens) cannot fill the
//!   listener;
//! - memory: request bodies are charged as they arrive against the process's [`BodyBudget`]
//!   and their client's share of it; a body that does not fit is answered 503 with Retry-After
//!   before it is read ([`BodyBudgetSpent`]). hyper's read buffer is at most [`MAX_READ_BUFFER`]
//!   a connection.
//!
//! Who the client is: the connection's peer, or, behind a proxy the operator trusts
//! ([`TrustedProxies`]), the address that proxy names ([`ClientAddressFrom`]). Each request
//! carries it as a [`ClientAddr`] extension.
//!
//! # Layout
//! - [`client`](ClientAddressFrom): client addresses (PROXY protocol v2, X-Forwarded-For) and
//!   the per-client counts.
//! - [`budget`](BodyBudget): the body bytes in flight.
//! - [`descriptors`](fit_connections): the open-file limit and the bounds that fit under it.
//! - [`metrics`](ListenerMetrics): what the listeners count.

mod budget;
mod client;
mod descriptors;
mod metrics;

use std::error::Error as StdError;
use std::future::Future;
use std::net::IpAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
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

pub use budget::{
    BodyBudget, BodyBudgetSpent, DEFAULT_BODY_BYTES_IN_FLIGHT, DEFAULT_BODY_BYTES_PER_CLIENT,
};
pub use client::{ClientAddressFrom, ProxyHeaderError, TrustedProxies};
pub use descriptors::{
    fit_connections, raise_open_file_limit, DescriptorPlan, BASE_DESCRIPTORS, PER_LISTENER_OVERHEAD,
};
pub use metrics::ListenerMetrics;

use budget::RequestCharge;
use client::{ClientSlot, PerClient};
use metrics::Refusal;

/// How long a listener waits for clients, and how many it serves at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    /// A request's head must arrive within this long of the connection opening or of the
    /// previous answer.
    pub header_read_timeout: Duration,
    /// A request's body must arrive within this long of its head.
    pub body_read_timeout: Duration,
    /// A kept-alive connection waits this long for its next request head (and a new one for
    /// its first) before it is closed: the head timeout, when that is shorter, closes it too.
    pub idle_timeout: Duration,
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Connections from one client that have not sent a complete request head yet; more from
    /// that client are answered 503 and closed.
    pub max_headless_per_address: usize,
    /// Connections one client holds at once, whatever they are doing; more from that client are
    /// answered 503 and closed. With [`ClientAddressFrom::ForwardedFor`], where a trusted
    /// proxy's connections carry many clients' requests, it bounds each client's requests in
    /// flight instead (429 past it).
    pub max_connections_per_client: usize,
    /// Where the client's address comes from.
    pub client_address: ClientAddressFrom,
}

impl ListenerLimits {
    /// `/metrics` and `/healthz`: a scraper and a few probes, all on a private address.
    pub const METRICS: ListenerLimits = ListenerLimits {
        header_read_timeout: Duration::from_secs(5),
        body_read_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(5),
        max_connections: 64,
        max_headless_per_address: 16,
        max_connections_per_client: 64,
        client_address: ClientAddressFrom::Peer,
    };
}

/// hyper's read buffer per connection at most (its smallest allowed is 8 KiB): a request head
/// must fit in it, and a body is read through it in pieces of at most this size. Bounds what a
/// connection that sends a huge head, slowly, holds.
pub const MAX_READ_BUFFER: usize = 16 * 1024;

/// Connections past the bound that are answered (written to, then drained briefly) at once;
/// further ones are closed unanswered. Keeps a flood of refusals from costing descriptors.
pub const MAX_REFUSALS_IN_FLIGHT: usize = 64;
/// How long a refused connection is given to take its 503 before it is closed.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

/// The client a request came from, as its listener identified it (a request extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub IpAddr);

/// What every listener of one process shares: the body budget, the trusted proxies, and where
/// the listeners' metrics go.
#[derive(Clone, Default)]
pub struct Shared {
    pub body_budget: BodyBudget,
    pub trusted_proxies: TrustedProxies,
    pub metrics: Option<ListenerMetrics>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("body_budget", &self.body_budget)
            .field("trusted_proxies", &self.trusted_proxies)
            .field("metrics", &self.metrics.is_some())
            .finish()
    }
}

/// The operator's settings every listener of the process shares, as flags and environment
/// variables.
#[derive(Debug, Clone, clap::Args)]
pub struct SharedArgs {
    /// Networks (comma-separated CIDRs, `10.0.0.0/8`) of the proxies or load balancers in front
    /// of the relay, which may name the client they forward (see RELAY_INGEST_CLIENT_ADDRESS and
    /// RELAY_API_CLIENT_ADDRESS). Empty: every client is the address that connected.
    #[arg(
        long,
        env = "RELAY_TRUSTED_PROXIES",
        global = true,
        value_delimiter = ','
    )]
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Request body bytes the process holds at once while reading them, all listeners together;
    /// a body that does not fit is answered 503 with Retry-After before it is read.
    #[arg(long, env = "RELAY_BODY_BYTES_IN_FLIGHT", global = true,
          default_value_t = DEFAULT_BODY_BYTES_IN_FLIGHT)]
    pub body_bytes_in_flight: usize,
    /// Of those, the most one client's bodies may hold (keep it at least the largest body a
    /// listener takes, 1 MiB for webhooks).
    #[arg(long, env = "RELAY_BODY_BYTES_PER_CLIENT", global = true,
          default_value_t = DEFAULT_BODY_BYTES_PER_CLIENT)]
    pub body_bytes_per_client: usize,
}

impl SharedArgs {
    /// What the process's listeners share (no metrics yet: [`Shared::with_metrics_in`]).
    pub fn shared(&self) -> Shared {
        Shared {
            body_budget: BodyBudget::new(self.body_bytes_in_flight, self.body_bytes_per_client),
            trusted_proxies: TrustedProxies::new(self.trusted_proxies.clone()),
            metrics: None,
        }
    }
}

impl Shared {
    /// Registers the listeners' metrics in `registry`, unless they are registered already.
    pub fn with_metrics_in(
        mut self,
        registry: &prometheus::Registry,
    ) -> Result<Self, prometheus::Error> {
        if self.metrics.is_none() {
            self.metrics = Some(ListenerMetrics::register(registry)?);
        }
        Ok(self)
    }
}

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
        has_cause::<BodyReadTimeout>(error)
    }
}

fn has_cause<E: StdError + 'static>(error: &(dyn StdError + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if error.is::<E>() {
            return true;
        }
        cause = error.source();
    }
    false
}

/// One listener being served: its settings and its clients' counts.
struct Served {
    name: &'static str,
    router: Router,
    limits: ListenerLimits,
    shared: Shared,
    client_connections: PerClient,
    headless: PerClient,
    client_requests: PerClient,
}

/// A connection's places among its client's: given back when the connection ends (the
/// headless one with its first request head).
#[derive(Default)]
struct ClientSlots {
    connection: Option<ClientSlot>,
    headless: Option<ClientSlot>,
}

impl Served {
    fn refused(&self, refusal: Refusal) {
        if let Some(metrics) = &self.shared.metrics {
            metrics
                .refused
                .with_label_values(&[self.name, refusal.label()])
                .inc();
        }
    }

    /// Places for one more connection of `client`'s, or why there are none.
    fn admit(&self, client: IpAddr) -> Result<ClientSlots, Refusal> {
        let connection = self
            .client_connections
            .admit(client)
            .ok_or(Refusal::ClientConnections)?;
        let headless = self.headless.admit(client).ok_or(Refusal::Headless)?;
        Ok(ClientSlots {
            connection: Some(connection),
            headless: Some(headless),
        })
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` completes; then stops
/// accepting, lets each connection finish the request it is on, and returns once all have.
/// `name` labels the listener's metrics.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ListenerLimits,
    shared: Shared,
    name: &'static str,
    shutdown: impl Future<Output = ()> + Send,
) {
    if let Some(metrics) = &shared.metrics {
        metrics.show_listener(name, limits.max_connections);
        shared
            .body_budget
            .show_in(metrics.body_bytes_in_flight.clone());
    }
    let served = Arc::new(Served {
        name,
        router,
        limits,
        client_connections: PerClient::new(limits.max_connections_per_client),
        headless: PerClient::new(limits.max_headless_per_address),
        client_requests: PerClient::new(limits.max_connections_per_client),
        shared,
    });
    let connections = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let refusals = Arc::new(Semaphore::new(MAX_REFUSALS_IN_FLIGHT));
    let (stopping, stop_seen) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    served.accept_failed(error).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let peer = client::canonical(peer.ip());
        let behind_proxy = limits.client_address != ClientAddressFrom::Peer
            && served.shared.trusted_proxies.trusts(peer);
        // A trusted proxy's connection names its client once its PROXY header is read, or in
        // each of its requests: its own address is no client's, and bounds no one.
        let admitted = match connections.clone().try_acquire_owned() {
            Err(_) => Err(Refusal::TooManyConnections),
            Ok(permit) if behind_proxy => Ok((permit, ClientSlots::default())),
            Ok(permit) => served.admit(peer).map(|slots| (permit, slots)),
        };
        match admitted {
            Ok((permit, slots)) => {
                let served = served.clone();
                let stop_seen = stop_seen.clone();
                tokio::spawn(async move {
                    let client = match (behind_proxy, limits.client_address) {
                        (true, ClientAddressFrom::ProxyProtocol) => {
                            match proxied_client(&served, stream, peer).await {
                                Some(proxied) => proxied,
                                None => return drop(permit),
                            }
                        }
                        (true, _) => (stream, None, slots),
                        (false, _) => (stream, Some(peer), slots),
                    };
                    serve_connection(served, client, peer, stop_seen).await;
                    drop(permit);
                });
            }
            Err(refusal) => {
                served.refused(refusal);
                match refusals.clone().try_acquire_owned() {
                    Ok(permit) => {
                        tokio::spawn(async move {
                            refuse(stream, limits, refusal).await;
                            drop(permit);
                        });
                    }
                    Err(_) => drop(stream),
                }
            }
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

/// The client a trusted proxy names in its PROXY protocol v2 header, admitted among that
/// client's connections; `None` when the header cannot be read or the client is refused (the
/// connection is closed, answered 503 in the second case).
async fn proxied_client(
    served: &Served,
    mut stream: TcpStream,
    peer: IpAddr,
) -> Option<(TcpStream, Option<IpAddr>, ClientSlots)> {
    let client =
        match client::read_proxy_header(&mut stream, peer, served.limits.header_read_timeout).await
        {
            Ok(client) => client,
            Err(error) => {
                tracing::debug!(%peer, %error, "closing a proxy's connection");
                served.refused(Refusal::ProxyHeader);
                return None;
            }
        };
    match served.admit(client) {
        Ok(slots) => Some((stream, Some(client), slots)),
        Err(refusal) => {
            served.refused(refusal);
            refuse(stream, served.limits, refusal).await;
            None
        }
    }
}

/// Why a request's body failed, for its answer.
const BODY_OK: u8 = 0;
const BODY_TIMED_OUT: u8 = 1;
const BODY_OVER_BUDGET: u8 = 2;

async fn serve_connection(
    served: Arc<Served>,
    (stream, client, slots): (TcpStream, Option<IpAddr>, ClientSlots),
    peer: IpAddr,
    mut stop_seen: watch::Receiver<bool>,
) {
    let gauge = served
        .shared
        .metrics
        .as_ref()
        .map(|m| m.connections.with_label_values(&[served.name]));
    if let Some(gauge) = &gauge {
        gauge.inc();
    }
    let ClientSlots {
        connection: _connection_slot,
        headless,
    } = slots;
    // Given back with the first request head (or when the connection ends before one).
    let headless = Arc::new(Mutex::new(headless));
    let limits = served.limits;
    let service = {
        let served = served.clone();
        service_fn(move |request: Request<Incoming>| {
            headless.lock().unwrap_or_else(|p| p.into_inner()).take();
            answer(served.clone(), client, peer, request)
        })
    };
    let mut builder = http1::Builder::new();
    // hyper's head timer runs from the connection's opening and from each answer: it is the
    // idle timeout too. hyper reads what arrived before it looks at the timer, so a request sent
    // just before the deadline is answered, never cut.
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout.min(limits.idle_timeout))
        .max_buf_size(MAX_READ_BUFFER);
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
    if let Some(gauge) = &gauge {
        gauge.dec();
    }
}

/// Answers one request: its client named (by the connection, or by X-Forwarded-For when a
/// trusted proxy forwards many clients' requests), its body bounded in time and bytes.
async fn answer(
    served: Arc<Served>,
    connection_client: Option<IpAddr>,
    peer: IpAddr,
    mut request: Request<Incoming>,
) -> Result<Response<axum::body::Body>, std::convert::Infallible> {
    let limits = served.limits;
    let (client, _request_slot) = match connection_client {
        Some(client) => (client, None),
        None => {
            let client = served
                .shared
                .trusted_proxies
                .forwarded_client(peer, request.headers());
            match served.client_requests.admit(client) {
                Some(slot) => (client, Some(slot)),
                None => {
                    served.refused(Refusal::ClientRequests);
                    return Ok(too_many_requests_response(limits));
                }
            }
        }
    };
    request.extensions_mut().insert(ClientAddr(client));
    let budget = &served.shared.body_budget;
    let has_body = !request.body().is_end_stream();
    // hyper answered 400 to a Content-Length that is not digits (ASCII or not): one here is a
    // number.
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let want = usize::try_from(declared.unwrap_or(1))
        .unwrap_or(usize::MAX)
        .max(1);
    // Refused before a byte is read; the handler's reads fail at once, and its answer becomes
    // the 503 below.
    let refused = has_body && !budget.has_room(client, want);
    let charge = Arc::new(RequestCharge::new(budget.clone(), client));
    let failure = Arc::new(AtomicU8::new(BODY_OK));
    let request = request.map(|body| {
        axum::body::Body::new(GuardedBody {
            inner: body,
            limit: limits.body_read_timeout,
            deadline: Instant::now() + limits.body_read_timeout,
            sleep: None,
            charge: charge.clone(),
            refused,
            failure: failure.clone(),
        })
    });
    let mut router = served.router.clone();
    let response = router.call(request).await?;
    let response = match failure.load(Ordering::Acquire) {
        BODY_TIMED_OUT => body_timeout_response(limits.body_read_timeout),
        BODY_OVER_BUDGET => {
            served.refused(Refusal::BodyBudget);
            budget_spent_response(limits)
        }
        _ => response,
    };
    drop(charge);
    Ok(response)
}

/// 503 with Retry-After, then close: a bound on connections is reached.
async fn refuse(mut stream: TcpStream, limits: ListenerLimits, refusal: Refusal) {
    let detail = match refusal {
        Refusal::ClientConnections => "this client holds as many connections as the relay allows one client; retry later",
        Refusal::Headless => "this client holds as many connections without a request as the relay allows one client; retry later",
        _ => "the relay is serving as many connections as it allows; retry later",
    };
    let body = serde_json::json!({"error": "too_many_connections", "detail": detail}).to_string();
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

/// An error answer with `Retry-After` (when given) and, when `close`, the connection closed
/// after it.
fn error_response(
    status: StatusCode,
    error: &str,
    detail: String,
    retry_after_s: Option<u64>,
    close: bool,
) -> Response<axum::body::Body> {
    let body = serde_json::json!({"error": error, "detail": detail}).to_string();
    let mut response = Response::new(axum::body::Body::from(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(seconds) = retry_after_s {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    if close {
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

fn body_timeout_response(limit: Duration) -> Response<axum::body::Body> {
    // The rest of the body may still be on its way: this connection cannot carry another
    // request.
    error_response(
        StatusCode::REQUEST_TIMEOUT,
        "body_timeout",
        BodyReadTimeout(limit).to_string(),
        None,
        true,
    )
}

/// 503: the body did not fit in the body budget. Bodies in flight end within the body read
/// timeout, so room is made by then; the unread rest of the body rules out another request on
/// this connection.
fn budget_spent_response(limits: ListenerLimits) -> Response<axum::body::Body> {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "body_budget_spent",
        format!("{}; retry later", BodyBudgetSpent),
        Some(limits.body_read_timeout.as_secs().max(1)),
        true,
    )
}

/// 429: the client a trusted proxy named has as many requests in flight as one client may.
fn too_many_requests_response(limits: ListenerLimits) -> Response<axum::body::Body> {
    error_response(
        StatusCode::TOO_MANY_REQUESTS,
        "too_many_requests",
        format!(
            "this client has {} requests in flight, as many as the relay allows one client; \
             retry later",
            limits.max_connections_per_client
        ),
        Some(limits.body_read_timeout.as_secs().max(1)),
        true,
    )
}

impl Served {
    /// Accept errors other than a client giving up are the process's own (out of descriptors):
    /// counted, and waited out a little rather than spun on.
    async fn accept_failed(&self, error: std::io::Error) {
        use std::io::ErrorKind;
        if matches!(
            error.kind(),
            ErrorKind::ConnectionRefused
                | ErrorKind::ConnectionAborted
                | ErrorKind::ConnectionReset
        ) {
            return;
        }
        if let Some(metrics) = &self.shared.metrics {
            metrics
                .accept_failures
                .with_label_values(&[self.name, metrics::accept_failure_label(&error)])
                .inc();
        }
        tracing::error!(listener = self.name, %error, "accepting a connection failed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A request body bounded in time and bytes: it fails with [`BodyReadTimeout`] once its
/// deadline passes, and with [`BodyBudgetSpent`] at once when it was refused room, or at the
/// frame that does not fit. The timer is armed only when the body is not all there already,
/// which it usually is.
struct GuardedBody {
    inner: Incoming,
    limit: Duration,
    deadline: Instant,
    sleep: Option<Pin<Box<Sleep>>>,
    charge: Arc<RequestCharge>,
    refused: bool,
    failure: Arc<AtomicU8>,
}

/// What a body's poll gives.
type FramePoll = Poll<Option<Result<Frame<Bytes>, Box<dyn StdError + Send + Sync>>>>;

impl GuardedBody {
    fn fail(&self, why: u8) -> FramePoll {
        self.failure.store(why, Ordering::Release);
        let error: Box<dyn StdError + Send + Sync> = match why {
            BODY_TIMED_OUT => Box::new(BodyReadTimeout(self.limit)),
            _ => Box::new(BodyBudgetSpent),
        };
        Poll::Ready(Some(Err(error)))
    }
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = Box<dyn StdError + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> FramePoll {
        let this = &mut *self;
        if this.refused {
            return this.fail(BODY_OVER_BUDGET);
        }
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            if let Some(Ok(data)) = frame.as_ref().map(|f| f.as_ref().map(Frame::data_ref)) {
                let bytes = data.map_or(0, Bytes::len);
                if bytes > 0 && !this.charge.take(bytes) {
                    return this.fail(BODY_OVER_BUDGET);
                }
            }
            return Poll::Ready(frame.map(|result| result.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.as_mut().poll(cx).is_ready() {
            return this.fail(BODY_TIMED_OUT);
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        !self.refused && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use axum::extract::Extension;
    use axum::routing::{get, post};
    use http_body_util::BodyExt as _;

    use super::*;

    /// A router that names the client it was given, and reads a body whole.
    fn router() -> Router {
        Router::new()
            .route(
                "/client",
                get(
                    |Extension(ClientAddr(client)): Extension<ClientAddr>| async move {
                        client.to_string()
                    },
                ),
            )
            .route(
                "/body",
                post(|body: axum::body::Body| async move {
                    match body.collect().await {
                        Ok(collected) => (StatusCode::OK, collected.to_bytes().len().to_string()),
                        Err(error) => (StatusCode::BAD_REQUEST, error.to_string()),
                    }
                }),
            )
    }

    const LIMITS: ListenerLimits = ListenerLimits {
        header_read_timeout: Duration::from_secs(5),
        body_read_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(5),
        max_connections: 64,
        max_headless_per_address: 8,
        max_connections_per_client: 4,
        client_address: ClientAddressFrom::Peer,
    };

    async fn start(limits: ListenerLimits, shared: Shared) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(serve(
            listener,
            router(),
            limits,
            shared,
            "test",
            std::future::pending(),
        ));
        address
    }

    /// Connects from `from` (a loopback address of this machine's: all of 127/8 is).
    async fn connect(to: SocketAddr, from: &str) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket
            .bind(SocketAddr::new(from.parse().unwrap(), 0))
            .unwrap();
        socket.connect(to).await.unwrap()
    }

    /// Sends `request` and reads until the answer's head is in: its first line and whole text.
    async fn exchange(stream: &mut TcpStream, request: &[u8]) -> String {
        stream.write_all(request).await.unwrap();
        read_answer(stream).await
    }

    async fn read_answer(stream: &mut TcpStream) -> String {
        let mut answer = Vec::new();
        let mut buffer = [0u8; 4096];
        loop {
            let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buffer))
                .await
                .expect("an answer in time")
                .unwrap_or(0);
            answer.extend_from_slice(&buffer[..read]);
            let text = String::from_utf8_lossy(&answer);
            if read == 0 || head_and_body_in(&text) {
                return text.into_owned();
            }
        }
    }

    fn head_and_body_in(text: &str) -> bool {
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            return false;
        };
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .and_then(|l| l.trim().parse::<usize>().ok());
        length.is_some_and(|length| body.len() >= length)
    }

    const GET_CLIENT: &[u8] = b"GET /client HTTP/1.1\r\nhost: x\r\n\r\n";

    #[tokio::test]
    async fn one_client_holds_at_most_its_connections_and_others_still_get_theirs() {
        let address = start(LIMITS, Shared::default()).await;
        let mut held = Vec::new();
        for _ in 0..LIMITS.max_connections_per_client {
            let mut stream = connect(address, "127.0.0.7").await;
            // Kept alive after a request: no longer headless, still the client's.
            let answer = exchange(&mut stream, GET_CLIENT).await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            assert!(answer.ends_with("127.0.0.7"), "{answer}");
            held.push(stream);
        }
        let mut one_more = connect(address, "127.0.0.7").await;
        let answer = read_answer(&mut one_more).await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains("too_many_connections"), "{answer}");
        let mut other = connect(address, "127.0.0.8").await;
        assert!(exchange(&mut other, GET_CLIENT)
            .await
            .starts_with("HTTP/1.1 200"));
        drop(held.pop());
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut again = connect(address, "127.0.0.7").await;
        assert!(exchange(&mut again, GET_CLIENT)
            .await
            .starts_with("HTTP/1.1 200"));
    }

    #[tokio::test]
    async fn an_idle_kept_alive_connection_is_closed() {
        let limits = ListenerLimits {
            idle_timeout: Duration::from_millis(300),
            ..LIMITS
        };
        let address = start(limits, Shared::default()).await;
        let mut stream = connect(address, "127.0.0.9").await;
        assert!(exchange(&mut stream, GET_CLIENT)
            .await
            .starts_with("HTTP/1.1 200"));
        let mut rest = [0u8; 16];
        let closed = tokio::time::timeout(Duration::from_secs(3), stream.read(&mut rest)).await;
        assert!(matches!(closed, Ok(Ok(0))), "{closed:?}");
    }

    #[tokio::test]
    async fn bodies_past_the_budget_are_refused_before_they_are_read() {
        let budget = BodyBudget::new(1000, 600);
        let shared = Shared {
            body_budget: budget.clone(),
            ..Shared::default()
        };
        let address = start(LIMITS, shared).await;
        // A body that stops short holds what it sent.
        let mut slow = connect(address, "127.0.0.10").await;
        slow.write_all(b"POST /body HTTP/1.1\r\nhost: x\r\ncontent-length: 600\r\n\r\n")
            .await
            .unwrap();
        slow.write_all(&[b'a'; 500]).await.unwrap();
        for _ in 0..50 {
            if budget.in_flight() == 500 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(budget.in_flight(), 500);
        // The same client's share has 100 left: a body claiming more is refused unread.
        let mut more = connect(address, "127.0.0.10").await;
        let answer = exchange(
            &mut more,
            b"POST /body HTTP/1.1\r\nhost: x\r\ncontent-length: 200\r\n\r\n",
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains("body_budget_spent"), "{answer}");
        assert!(answer.contains("retry-after: 5"), "{answer}");
        assert!(answer.contains("connection: close"), "{answer}");
        // Another client fits in what the total has left.
        let mut other = connect(address, "127.0.0.11").await;
        let mut request = b"POST /body HTTP/1.1\r\nhost: x\r\ncontent-length: 400\r\n\r\n".to_vec();
        request.extend_from_slice(&[b'b'; 400]);
        let answer = exchange(&mut other, &request).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("400"), "{answer}");
        // Answered bodies give their bytes back; the slow one's go when it is cut.
        assert_eq!(budget.in_flight(), 500);
        drop(slow);
        for _ in 0..50 {
            if budget.in_flight() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(budget.in_flight(), 0);
    }

    #[tokio::test]
    async fn behind_a_trusted_proxy_the_client_is_the_one_it_names() {
        let shared = Shared {
            trusted_proxies: TrustedProxies::new(vec!["127.0.0.12/32".parse().unwrap()]),
            ..Shared::default()
        };
        let forwarded = start(
            ListenerLimits {
                client_address: ClientAddressFrom::ForwardedFor,
                max_connections_per_client: 1,
                ..LIMITS
            },
            shared.clone(),
        )
        .await;
        let mut proxy = connect(forwarded, "127.0.0.12").await;
        let request =
            b"GET /client HTTP/1.1\r\nhost: x\r\nx-forwarded-for: 6.6.6.6, 203.0.113.9\r\n\r\n";
        assert!(exchange(&mut proxy, request).await.ends_with("203.0.113.9"));
        // A peer that is no trusted proxy names nobody but itself.
        let mut stranger = connect(forwarded, "127.0.0.13").await;
        assert!(exchange(&mut stranger, request)
            .await
            .ends_with("127.0.0.13"));

        let proxied = start(
            ListenerLimits {
                client_address: ClientAddressFrom::ProxyProtocol,
                ..LIMITS
            },
            shared,
        )
        .await;
        let mut proxy = connect(proxied, "127.0.0.12").await;
        let mut header = b"\r\n\r\n\0\r\nQUIT\n\x21\x11\x00\x0c".to_vec();
        header.extend_from_slice(&[198, 51, 100, 4, 127, 0, 0, 1, 0, 80, 0, 80]);
        header.extend_from_slice(GET_CLIENT);
        assert!(exchange(&mut proxy, &header)
            .await
            .ends_with("198.51.100.4"));
        // Many connections of the proxy's, one client each: the proxy's address bounds none.
        let mut streams = Vec::new();
        for i in 0..(LIMITS.max_connections_per_client + 2) as u8 {
            let mut stream = connect(proxied, "127.0.0.12").await;
            let mut header = b"\r\n\r\n\0\r\nQUIT\n\x21\x11\x00\x0c".to_vec();
            header.extend_from_slice(&[198, 51, 100, 10 + i, 127, 0, 0, 1, 0, 80, 0, 80]);
            header.extend_from_slice(GET_CLIENT);
            let answer = exchange(&mut stream, &header).await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            streams.push(stream);
        }
    }
}
