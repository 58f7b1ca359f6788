//! Starting the tiers: bind the listeners, build each tier, serve until told to stop.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use relay_ingest::{Clock, IngestConfig, SystemClock};
use relay_store::PoolOptions;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::cli::{GlobalArgs, IngestArgs};
use crate::telemetry;

impl IngestArgs {
    pub fn to_config(&self) -> IngestConfig {
        IngestConfig {
            max_body_bytes: self.max_body_bytes,
            answer_deadline: Duration::from_millis(self.answer_deadline_ms),
            retry_after: Duration::from_secs(self.retry_after_s),
            writers: self.writers,
            batch_max_messages: self.batch_max_messages,
            endpoint_cache_ttl: Duration::from_secs(self.endpoint_cache_ttl_s),
            endpoint_cache_max_entries: self.endpoint_cache_max_entries,
            ..IngestConfig::default()
        }
    }
}

/// The front tier's pool: its statements end server-side before the answer deadline, and its
/// few fixed statements are planned once.
pub fn ingest_pool(global: &GlobalArgs, statement_timeout: Duration) -> anyhow::Result<PgPool> {
    let options = PoolOptions {
        max_connections: global.database_max_connections,
        acquire_timeout: statement_timeout,
        statement_timeout: Some(statement_timeout),
        generic_plans: true,
    };
    relay_store::connect(&global.database_url, &options).context("reading RELAY_DATABASE_URL")
}

/// A front tier serving on its listeners, stopped by [`IngestServer::stop`].
pub struct IngestServer {
    pub address: SocketAddr,
    pub metrics_address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    done: JoinHandle<anyhow::Result<()>>,
}

impl IngestServer {
    /// Builds the front tier and serves it and its metrics until stopped.
    pub fn start(
        pool: PgPool,
        config: IngestConfig,
        listener: TcpListener,
        metrics_listener: TcpListener,
        clock: Arc<dyn Clock>,
    ) -> anyhow::Result<Self> {
        let address = listener.local_addr()?;
        let metrics_address = metrics_listener.local_addr()?;
        let registry = prometheus::Registry::new();
        let ingest = relay_ingest::build(pool, config, &registry, clock)?;
        let (stop, stopped) = oneshot::channel::<()>();
        let done = tokio::spawn(async move {
            let metrics = tokio::spawn(async move {
                axum::serve(metrics_listener, telemetry::metrics_router(registry)).await
            });
            let served = axum::serve(listener, ingest.router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
            metrics.abort();
            ingest.cache_listener.abort();
            // The router is gone, so once the in-flight requests finished every queue sender
            // is dropped: the writers drain what is queued and end.
            for writer in ingest.writers {
                let _ = writer.await;
            }
            served.context("serving webhooks")
        });
        Ok(Self {
            address,
            metrics_address,
            stop: Some(stop),
            done,
        })
    }

    /// Stops taking connections, answers what is in flight, and waits for the writers.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.done).await.context("ingest task panicked")?
    }

    /// Waits until the server ends by itself (it does not, unless it fails).
    pub async fn wait(&mut self) -> anyhow::Result<()> {
        (&mut self.done).await.context("ingest task panicked")?
    }
}

/// `relay ingest`: serve until SIGINT or SIGTERM.
pub async fn run_ingest(global: &GlobalArgs, args: &IngestArgs) -> anyhow::Result<()> {
    let config = args.to_config();
    // Statements must end before the answer deadline, leaving time to answer.
    let pool = ingest_pool(global, config.answer_deadline.mul_f64(0.8))?;
    let listener = telemetry::bind(args.listen, "webhook").await?;
    let metrics_listener = telemetry::bind(args.metrics_listen, "metrics").await?;
    let mut server = IngestServer::start(
        pool,
        config,
        listener,
        metrics_listener,
        Arc::new(SystemClock),
    )?;
    tokio::select! {
        result = server.wait() => result,
        () = shutdown_signal() => {
            tracing::info!("shutting down: answering in-flight messages");
            server.stop().await
        }
    }
}

/// `relay all`: every tier in one process. The front tier is the only one so far.
pub async fn run_all(global: &GlobalArgs, args: &IngestArgs) -> anyhow::Result<()> {
    run_ingest(global, args).await
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
