//! The upstream's REST API (shared/upstream-api.md) over axum. Handlers only parse, lock the
//! [`Upstream`](crate::upstream::Upstream), call it, and map its answer to a status.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tokio_rustls::server::TlsStream;
use uuid::Uuid;

use crate::driver::Simulation;
use crate::model::{PartKind, Selection};
use crate::upstream::{ApiError, ItemRead};

/// The API's routes over a simulation: the feed's, and the stories' ([`crate::stories::routes`]).
pub fn router(sim: Arc<Simulation>) -> Router {
    Router::new()
        .route("/v1/webhook-endpoints/{id}", get(endpoint_view))
        .route(
            "/v1/webhook-endpoints/{id}/tracks/{track}/rewind",
            post(rewind),
        )
        .route("/v1/feed", get(feed))
        .route("/v1/feed/since", get(feed_since))
        .route("/v1/feed/items/{feed_item_id}", get(item_read))
        .merge(crate::stories::routes::routes())
        .with_state(sim)
}

/// Serves the API on `listener` in a background task; returns the address it listens on.
pub async fn serve(
    listener: tokio::net::TcpListener,
    sim: Arc<Simulation>,
) -> std::io::Result<SocketAddr> {
    let addr = listener.local_addr()?;
    let app = router(sim);
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "simulator API stopped");
        }
    });
    Ok(addr)
}

/// The certificate chain and key the API presents over HTTPS, read from PEM.
pub fn tls_config(
    certificate_pem: &[u8],
    key_pem: &[u8],
) -> Result<Arc<rustls::ServerConfig>, TlsSetupError> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(certificate_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsSetupError::Certificate(e.to_string()))?;
    if chain.is_empty() {
        return Err(TlsSetupError::Certificate(
            "no PEM certificate in it".to_owned(),
        ));
    }
    let key =
        PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsSetupError::Key(e.to_string()))?;
    let config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| TlsSetupError::Key(e.to_string()))?;
    Ok(Arc::new(config))
}

/// The API's certificate or key could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("the certificate: {0}")]
    Certificate(String),
    #[error("the key: {0}")]
    Key(String),
}

/// Serves the API over HTTPS on `listener`, presenting `tls`'s certificate, in a background
/// task; returns the address it listens on.
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    sim: Arc<Simulation>,
    tls: Arc<rustls::ServerConfig>,
) -> std::io::Result<SocketAddr> {
    let addr = listener.local_addr()?;
    let app = router(sim);
    let listener = TlsListener::new(listener, tls);
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "simulator API stopped");
        }
    });
    Ok(addr)
}

/// Connections whose TLS handshake is done. Handshakes run in tasks of their own, so a client
/// that stalls (or refuses the certificate) holds up no other.
struct TlsListener {
    ready: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    addr: SocketAddr,
}

impl TlsListener {
    fn new(listener: tokio::net::TcpListener, tls: Arc<rustls::ServerConfig>) -> Self {
        let addr = listener
            .local_addr()
            .expect("a bound listener has an address");
        let (ready_tx, ready) = tokio::sync::mpsc::channel(64);
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        tokio::spawn(async move {
            loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::debug!(%error, "accepting a connection");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                if ready_tx.is_closed() {
                    return;
                }
                let (acceptor, ready_tx) = (acceptor.clone(), ready_tx.clone());
                tokio::spawn(async move {
                    match acceptor.accept(stream).await {
                        Ok(stream) => {
                            let _ = ready_tx.send((stream, peer)).await;
                        }
                        Err(error) => tracing::debug!(%peer, %error, "TLS handshake failed"),
                    }
                });
            }
        });
        Self { ready, addr }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(connection) => connection,
            // The accepting task ended (the runtime is shutting down): no more connections.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = match &self {
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized".to_owned()),
            ApiError::NotFound => (StatusCode::NOT_FOUND, "not_found".to_owned()),
            ApiError::BadRequest(detail) => (StatusCode::BAD_REQUEST, detail.clone()),
            ApiError::Rewind(refusal) => (StatusCode::CONFLICT, refusal.code().to_owned()),
            ApiError::CursorExpired => (StatusCode::GONE, "cursor_expired".to_owned()),
        };
        (status, Json(json!({"error": code}))).into_response()
    }
}

pub(crate) fn bearer(headers: &HeaderMap) -> Result<String, ApiError> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
        .ok_or(ApiError::Unauthorized)
}

/// Sleeps when the slow-reads fault strikes. The lock is not held while sleeping.
pub(crate) async fn maybe_slow(sim: &Simulation) {
    let delay = sim.lock().api_delay_ms();
    if let Some(ms) = delay {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

fn list<T>(
    query: &HashMap<String, String>,
    name: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<Option<Vec<T>>, ApiError> {
    match query.get(name).map(String::as_str) {
        None | Some("") => Ok(None),
        Some(text) => text
            .split(',')
            .map(|part| {
                parse(part.trim())
                    .ok_or_else(|| ApiError::BadRequest(format!("{name}: `{part}` is not valid")))
            })
            .collect::<Result<Vec<T>, _>>()
            .map(Some),
    }
}

fn selection_from(query: &HashMap<String, String>) -> Result<Selection, ApiError> {
    let teasers = match query.get("teasers").map(String::as_str) {
        None | Some("") => None,
        Some("true") => Some(true),
        Some("false") => Some(false),
        Some(other) => {
            return Err(ApiError::BadRequest(format!(
                "teasers: `{other}` is not true or false"
            )))
        }
    };
    Ok(Selection {
        lang: query.get("lang").cloned().unwrap_or_else(|| "en".into()),
        companies: list(query, "companies", |t| t.parse::<i64>().ok())?
            .map(|v| v.into_iter().collect()),
        markets: list(query, "markets", |t| Some(t.to_owned()))?.map(|v| v.into_iter().collect()),
        part_kinds: list(query, "part_kinds", PartKind::parse)?.map(|v| v.into_iter().collect()),
        teasers,
        item_kinds: list(query, "item_kinds", relay_wire::ItemKind::parse)?
            .map(|v| v.into_iter().collect()),
    })
}

pub(crate) fn limit_from(query: &HashMap<String, String>) -> Result<usize, ApiError> {
    match query.get("limit") {
        None => Ok(100),
        Some(text) => text
            .parse::<usize>()
            .map(|l| l.clamp(1, 500))
            .map_err(|_| ApiError::BadRequest(format!("limit: `{text}` is not a number"))),
    }
}

/// What a paged read asks: the caller's key, the selection, the page size and the cursor.
struct PageRead<'q> {
    token: String,
    selection: Selection,
    limit: usize,
    cursor: Option<&'q str>,
}

impl<'q> PageRead<'q> {
    fn of(headers: &HeaderMap, query: &'q HashMap<String, String>) -> Result<Self, ApiError> {
        Ok(Self {
            token: bearer(headers)?,
            selection: selection_from(query)?,
            limit: limit_from(query)?,
            cursor: query.get("cursor").map(String::as_str),
        })
    }
}

async fn endpoint_view(
    State(sim): State<Arc<Simulation>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let token = bearer(&headers)?;
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::NotFound)?;
    maybe_slow(&sim).await;
    let view = sim.lock().endpoint_view(&token, id)?;
    Ok(Json(view))
}

async fn feed(
    State(sim): State<Arc<Simulation>>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let read = PageRead::of(&headers, &query)?;
    maybe_slow(&sim).await;
    let now_ms = sim.clock.now_ms();
    let page = sim.lock().feed_page(
        &read.token,
        &read.selection,
        read.cursor,
        read.limit,
        now_ms,
    )?;
    sim.wake.notify_waiters();
    Ok(Json(page))
}

async fn feed_since(
    State(sim): State<Arc<Simulation>>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let read = PageRead::of(&headers, &query)?;
    let since = query
        .get("since")
        .ok_or_else(|| ApiError::BadRequest("since is required".into()))?;
    let include_event_ids = query.get("include_event_ids").map(String::as_str) == Some("true");
    maybe_slow(&sim).await;
    let answer = sim.lock().feed_since(
        &read.token,
        &read.selection,
        since,
        include_event_ids,
        read.cursor,
        read.limit,
    )?;
    Ok(Json(answer))
}

async fn item_read(
    State(sim): State<Arc<Simulation>>,
    headers: HeaderMap,
    Path(feed_item_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let token = bearer(&headers)?;
    let lang = query.get("lang").cloned().unwrap_or_else(|| "en".into());
    let part_kinds: Option<BTreeSet<PartKind>> =
        list(&query, "part_kinds", PartKind::parse)?.map(|v| v.into_iter().collect());
    maybe_slow(&sim).await;
    let answer = sim
        .lock()
        .item_read(&token, &feed_item_id, &lang, part_kinds)?;
    Ok(match answer {
        ItemRead::Found(body) => (StatusCode::OK, Json(body)).into_response(),
        ItemRead::Gone(body) => (StatusCode::NOT_FOUND, Json(body)).into_response(),
        ItemRead::LoadBalancer404 => (
            StatusCode::NOT_FOUND,
            [(header::CONTENT_TYPE, "text/plain")],
            "404 Not Found",
        )
            .into_response(),
    })
}

#[derive(serde::Deserialize)]
struct RewindBody {
    since: String,
}

async fn rewind(
    State(sim): State<Arc<Simulation>>,
    headers: HeaderMap,
    Path((id, track)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let token = bearer(&headers)?;
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::NotFound)?;
    let body: RewindBody = serde_json::from_slice(&body)
        .map_err(|_| ApiError::BadRequest("the body is {\"since\": \"E.S\"}".into()))?;
    let now_ms = sim.clock.now_ms();
    let generation = sim
        .lock()
        .api_rewind(&token, id, &track, &body.since, now_ms)?;
    sim.wake.notify_waiters();
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"generation": generation})),
    )
        .into_response())
}
