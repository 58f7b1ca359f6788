//! Logging and metrics serving.

use std::net::SocketAddr;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus::{Encoder, Registry, TextEncoder};
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;

pub fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    // A second init (tests start many apps in one process) is not an error worth stopping for.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// The router serving `/metrics` from `registry`, and `/healthz` for liveness probes.
pub fn metrics_router(registry: Registry) -> Router {
    Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(registry)
}

/// Serves [`metrics_router`] on `listener` until the task is aborted.
pub async fn serve_metrics(listener: TcpListener, registry: Registry) {
    relay_listener::serve(
        listener,
        metrics_router(registry),
        relay_listener::ListenerLimits::METRICS,
        std::future::pending(),
    )
    .await
}

async fn render_metrics(State(registry): State<Registry>) -> impl IntoResponse {
    let encoder = TextEncoder::new();
    let mut buffer = Vec::new();
    match encoder.encode(&registry.gather(), &mut buffer) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, encoder.format_type().to_owned())],
            buffer,
        )
            .into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

pub async fn bind(address: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    use anyhow::Context as _;
    let listener = TcpListener::bind(address)
        .await
        .with_context(|| format!("binding the {what} listener to {address}"))?;
    tracing::info!(address = %listener.local_addr()?, "{what} listening");
    Ok(listener)
}
