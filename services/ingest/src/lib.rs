//! The front tier: takes `POST /webhooks/{webhook_endpoint_id}`, verifies the message, stores it
//! durably, and only then answers 2xx. Stateless: any number of replicas can share a database.
//!
//! # Layout
//! - [`config`]: the tier's settings and their defaults.
//! - [`clock`]: the time source, passed in so tests can stand at the wire file's example time.
//! - [`endpoint_cache`]: endpoints and secrets held in memory, dropped when Postgres says
//!   (LISTEN/NOTIFY) that one changed.
//! - [`writer`]: groups concurrent messages into shared transactions (group commit).
//! - [`rates`]: each tenant's quota of messages per second.
//! - [`handler`]: the HTTP route and the order of its checks.
//! - [`metrics`]: the tier's Prometheus metrics.

mod clock;
mod config;
mod endpoint_cache;
mod handler;
mod metrics;
mod rates;
mod writer;

use std::sync::Arc;

use axum::routing::post;
use axum::Router;
use sqlx::PgPool;
use tokio::task::JoinHandle;

pub use clock::{Clock, FixedClock, SystemClock};
pub use config::{defaults, IngestConfig, LISTENER_LIMITS};
pub use metrics::IngestMetrics;
pub use writer::{BatchWriter, WriteError};

/// A running front tier: its router and the background tasks it needs.
pub struct Ingest {
    pub router: Router,
    /// The batch writers. They end by themselves once the router (and with it every sender)
    /// is dropped and the queue is drained.
    pub writers: Vec<JoinHandle<()>>,
    /// Listens for endpoint changes; runs until aborted.
    pub cache_listener: JoinHandle<()>,
}

/// Builds the front tier on a pool, registering its metrics in `registry`; `keys` open the
/// endpoints' sealed secrets.
pub fn build(
    pool: PgPool,
    config: IngestConfig,
    keys: relay_store::Keyring,
    registry: &prometheus::Registry,
    clock: Arc<dyn Clock>,
) -> Result<Ingest, prometheus::Error> {
    let metrics = Arc::new(IngestMetrics::register(registry)?);
    let (cache, cache_listener) = endpoint_cache::EndpointCache::start(
        pool.clone(),
        keys,
        config.endpoint_cache_ttl,
        config.endpoint_cache_max_entries,
        metrics.clone(),
    );
    let rates = rates::TenantRates::new(pool.clone(), config.quotas);
    let (writer, writers) = writer::BatchWriter::start(pool, &config, metrics.clone());
    let state = Arc::new(handler::AppState {
        config,
        cache,
        writer,
        metrics,
        clock,
        rates,
    });
    let router = Router::new()
        .route("/webhooks/{webhook_endpoint_id}", post(handler::receive))
        .with_state(state);
    Ok(Ingest {
        router,
        writers,
        cache_listener,
    })
}
