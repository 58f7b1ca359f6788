//! Serving the API: bind, serve until stopped, answer what is in flight, end.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinHandle;

use crate::auth::Verifier;
use crate::broker::BrokerAccess;
use crate::config::ApiConfig;
use crate::envelope::{self, Envelope};
use crate::metrics::ApiMetrics;
use crate::routes::{self, AppState};

/// The API could not start, or failed while serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("binding {address}: {source}")]
    Bind {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("building the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("serving: {0}")]
    Serve(#[source] std::io::Error),
    #[error("registering the API's metrics: {0}")]
    Metrics(#[source] prometheus::Error),
    #[error("the API task panicked")]
    Panicked,
}

/// The API's router over `pool`; `purge` wakes the purge that finishes deletes.
fn build(pool: PgPool, config: &ApiConfig, purge: Arc<Notify>) -> Result<Router, ServeError> {
    // No redirect is followed (GuardedClient): one is not an answer version 1 describes, and
    // following it would send the API key to wherever it points.
    let http = relay_netguard::GuardedClient::new(
        config.outbound.clone(),
        &config.trust,
        config.upstream_timeout,
    )
    .map_err(ServeError::Client)?;
    let management = management_client(config)?;
    let metrics = Arc::new(ApiMetrics::register(&config.registry).map_err(ServeError::Metrics)?);
    let state = AppState {
        purge,
        pool,
        verifier: Arc::new(Verifier::new(config.keys.clone(), &config.audience)),
        http,
        management,
        metrics: metrics.clone(),
        broker: Arc::new(config.broker.clone()),
        envelope: Arc::new(Envelope::new(&config.envelope)),
        quotas: config.quotas,
        sealing: config.sealing.clone(),
    };
    // Inside `observe`, so that a request refused 429 is counted and timed like any other;
    // `no_store` outside `admit`, so that its 429 is not kept either.
    Ok(routes::router(state.clone())
        .layer(middleware::from_fn_with_state(state, envelope::admit))
        .layer(middleware::from_fn(no_store))
        .layer(middleware::from_fn_with_state(metrics, observe)))
}

/// `Cache-Control: no-store` on every answer that does not say its own (the console's files
/// do): an answer may show a secret, a password or a token once, every read is one tenant's, and
/// an error may echo what was sent. No browser or proxy keeps any of them.
async fn no_store(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    response
        .headers_mut()
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// A client for the relay's own broker's management API: an address the operator configured,
/// not one a tenant named, so no outbound policy applies; still no redirect followed.
fn management_client(config: &ApiConfig) -> Result<reqwest::Client, ServeError> {
    reqwest::Client::builder()
        .use_preconfigured_tls(config.trust.client_config())
        .timeout(config.upstream_timeout)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(ServeError::Client)
}

/// Brings the broker's dead-lettering to the current settings: the policies, then each
/// tenant's dead-letter queue (tenants whose user was made before it existed get theirs).
/// Tries again, less and less often, until the management API has answered every call.
async fn bring_dead_lettering_up(pool: PgPool, broker: BrokerAccess, http: reqwest::Client) {
    let mut pause = std::time::Duration::from_secs(1);
    loop {
        match dead_lettering_up(&pool, &broker, &http).await {
            Ok(tenants) => {
                tracing::info!(tenants, "dead-lettering of tenants' queues is set");
                return;
            }
            Err(error) => {
                tracing::warn!(%error, ?pause, "setting dead-lettering on the broker; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(60));
            }
        }
    }
}

async fn dead_lettering_up(
    pool: &PgPool,
    broker: &BrokerAccess,
    http: &reqwest::Client,
) -> Result<usize, crate::ApiError> {
    broker.ensure_dead_lettering(http).await?;
    let tenants = relay_store::broker_users::tenants(pool).await?;
    for &tenant in &tenants {
        broker.declare_dead_letter_queue(http, tenant).await?;
    }
    Ok(tenants.len())
}

/// One line and one count per request: method, route (the template, not the path: paths hold
/// ids), status and duration. Never headers or bodies, which hold tokens, secrets and keys.
async fn observe(State(metrics): State<Arc<ApiMetrics>>, request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let started = Instant::now();
    let response = next.run(request).await;
    let status = response.status().as_u16();
    let seconds = started.elapsed().as_secs_f64();
    let ms = seconds * 1000.0;
    metrics
        .requests
        .with_label_values(&[route.as_str(), method.as_str(), &status.to_string()])
        .inc();
    metrics
        .request_seconds
        .with_label_values(&[route.as_str(), method.as_str()])
        .observe(seconds);
    if status >= 500 {
        tracing::warn!(%method, route, status, ms, "api request");
    } else {
        tracing::debug!(%method, route, status, ms, "api request");
    }
    response
}

/// The API serving on its listener, stopped by [`ApiServer::stop`].
pub struct ApiServer {
    /// Where it listens (the port the system chose, when the config said 0).
    pub address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    done: JoinHandle<Result<(), ServeError>>,
    dead_lettering: JoinHandle<()>,
    purging: JoinHandle<()>,
    counting_sealed: JoinHandle<()>,
}

impl ApiServer {
    /// Binds `config.listen` and serves until stopped.
    pub async fn start(pool: PgPool, config: ApiConfig) -> Result<Self, ServeError> {
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| ServeError::Bind {
                    address: config.listen,
                    source,
                })?;
        Self::start_on(listener, pool, &config)
    }

    /// Serves on a listener the caller bound.
    pub fn start_on(
        listener: TcpListener,
        pool: PgPool,
        config: &ApiConfig,
    ) -> Result<Self, ServeError> {
        let address = listener.local_addr().map_err(ServeError::Serve)?;
        let dead_lettering = tokio::spawn(bring_dead_lettering_up(
            pool.clone(),
            config.broker.clone(),
            management_client(config)?,
        ));
        // Whatever a crash left marked is finished from the start.
        let purge = Arc::new(Notify::new());
        let purging = tokio::spawn(crate::offboarding::run(
            pool.clone(),
            config.broker.clone(),
            management_client(config)?,
            purge.clone(),
        ));
        let counting_sealed = tokio::spawn(crate::sealed_census::run(
            pool.clone(),
            config.sealing.clone(),
            crate::sealed_census::SealedGauges::register(&config.registry)
                .map_err(ServeError::Metrics)?,
        ));
        let app = build(pool, config, purge)?;
        let (stop, stopped) = oneshot::channel::<()>();
        let limits = config.listener;
        let shared = config
            .shared
            .clone()
            .with_metrics_in(&config.registry)
            .map_err(ServeError::Metrics)?;
        let done = tokio::spawn(async move {
            relay_listener::serve(listener, app, limits, shared, "api", async move {
                let _ = stopped.await;
            })
            .await;
            Ok(())
        });
        tracing::info!(%address, "control plane API listening");
        Ok(Self {
            address,
            stop: Some(stop),
            done,
            dead_lettering,
            purging,
            counting_sealed,
        })
    }

    /// Stops taking connections, answers the requests in flight, and returns once they are.
    pub async fn stop(mut self) -> Result<(), ServeError> {
        self.dead_lettering.abort();
        self.purging.abort();
        self.counting_sealed.abort();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.done).await.map_err(|_| ServeError::Panicked)?
    }

    /// Waits until the server ends by itself (it does not, unless it fails).
    pub async fn wait(&mut self) -> Result<(), ServeError> {
        (&mut self.done).await.map_err(|_| ServeError::Panicked)?
    }
}
