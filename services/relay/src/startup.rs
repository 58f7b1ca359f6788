//! Starting the tiers: bind the listeners, build each tier, serve until told to stop.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use relay_ingest::{Clock, IngestConfig, SystemClock};
use relay_listener::ListenerLimits;
use relay_store::PoolOptions;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::cli::{
    AllArgs, ApiCommand, GlobalArgs, IngestArgs, PublisherCommand, SequencerArgs, SequencerCommand,
};
use crate::telemetry::{self, Readiness};

impl IngestArgs {
    pub fn to_config(&self) -> IngestConfig {
        IngestConfig {
            max_body_bytes: self.max_body_bytes,
            answer_deadline: Duration::from_millis(self.answer_deadline_ms),
            retry_after: Duration::from_secs(self.retry_after_s),
            writers: self.writers,
            batch_max_messages: self.batch_max_messages,
            batch_linger: Duration::from_micros(self.batch_linger_us),
            endpoint_cache_ttl: Duration::from_secs(self.endpoint_cache_ttl_s),
            endpoint_cache_max_entries: self.endpoint_cache_max_entries,
            listener: ListenerLimits {
                header_read_timeout: Duration::from_millis(self.header_read_timeout_ms),
                body_read_timeout: Duration::from_millis(self.body_read_timeout_ms),
                max_connections: self.max_connections,
                max_headless_per_address: self.max_headless_per_address,
                max_connections_per_client: self.max_connections_per_client,
                idle_timeout: Duration::from_millis(self.idle_timeout_ms),
                client_address: self.client_address,
            },
            ..IngestConfig::default()
        }
    }
}

/// Descriptors the front tier needs besides its connections: its pool, its Redis wake-ups.
const INGEST_DESCRIPTORS: usize = 8;
/// Descriptors the publisher needs: its pool aside, the relay's broker and tenants' own.
const PUBLISHER_DESCRIPTORS: usize = 32;
/// Descriptors the control plane needs besides its connections: the calls it makes (rewinds to
/// tenants' upstreams, the broker's management API), its background purge.
const API_DESCRIPTORS: usize = 64;

/// Raises the open-file limit to the hard one and cuts each of `listeners`' bounds on
/// connections (in proportion) so that they fit under it beside `reserved` descriptors the
/// process needs otherwise and its `/metrics` listener; logs what each listener may hold. A
/// bound above the limit would make `accept` fail with EMFILE before the bound is reached.
fn fit_listeners(
    global: &GlobalArgs,
    pools: usize,
    reserved: usize,
    listeners: &mut [(&'static str, &mut ListenerLimits)],
) {
    let Some(open_files) = relay_listener::raise_open_file_limit() else {
        tracing::warn!("the open-file limit cannot be read: connection bounds are as configured");
        return;
    };
    let reserved = relay_listener::BASE_DESCRIPTORS
        + pools * global.database_max_connections as usize
        + ListenerLimits::METRICS.max_connections
        + relay_listener::PER_LISTENER_OVERHEAD
        + reserved;
    let mut limits: Vec<&mut ListenerLimits> = listeners
        .iter_mut()
        .map(|(_, limits)| &mut **limits)
        .collect();
    let plan = relay_listener::fit_connections(open_files, reserved, &mut limits);
    for ((name, _), (configured, bound)) in listeners.iter().zip(plan.bounds) {
        if bound < configured {
            tracing::warn!(
                listener = name,
                open_files,
                reserved,
                configured,
                bound,
                "the open-file limit is too low for the configured connections: bound lowered \
                 (raise LimitNOFILE / ulimit -n)"
            );
        } else {
            tracing::info!(
                listener = name,
                open_files,
                reserved,
                bound,
                "connection bound"
            );
        }
    }
}

/// A pool on RELAY_DATABASE_URL with `options`, trusting the operator's CA file (checked as
/// every TLS client's roots are).
pub fn connect(global: &GlobalArgs, options: PoolOptions) -> anyhow::Result<PgPool> {
    let options = PoolOptions {
        ca_file: global.trust()?.ca_file().map(std::path::Path::to_path_buf),
        ..options
    };
    relay_store::connect(&global.database_url, &options).context("reading RELAY_DATABASE_URL")
}

/// A tier's pool of RELAY_DATABASE_MAX_CONNECTIONS: it waits `acquire_timeout` for a
/// connection, its statements end server-side after `statement_timeout`, and with
/// `generic_plans` each statement is planned once.
pub fn tier_pool(
    global: &GlobalArgs,
    acquire_timeout: Duration,
    statement_timeout: Duration,
    generic_plans: bool,
) -> anyhow::Result<PgPool> {
    connect(
        global,
        PoolOptions {
            max_connections: global.database_max_connections,
            acquire_timeout,
            statement_timeout: Some(statement_timeout),
            generic_plans,
            ..PoolOptions::default()
        },
    )
}

/// The front tier's pool: its statements end server-side before the answer deadline, and its
/// few fixed statements are planned once.
pub fn ingest_pool(global: &GlobalArgs, statement_timeout: Duration) -> anyhow::Result<PgPool> {
    tier_pool(global, statement_timeout, statement_timeout, true)
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
        keys: relay_store::Keyring,
        listener: TcpListener,
        metrics_listener: TcpListener,
        clock: Arc<dyn Clock>,
    ) -> anyhow::Result<Self> {
        Self::start_with_registry(
            pool,
            config,
            keys,
            listener,
            metrics_listener,
            clock,
            telemetry::tier_registry("ingest")?,
            Readiness::default(),
        )
    }

    /// As [`IngestServer::start`], serving `registry` (which other tiers of the process may
    /// register in too) on the metrics listener, and reporting ready when Postgres and what
    /// `readiness` names (the other tiers' needs, in `relay all`) answer.
    #[allow(clippy::too_many_arguments)]
    pub fn start_with_registry(
        pool: PgPool,
        config: IngestConfig,
        keys: relay_store::Keyring,
        listener: TcpListener,
        metrics_listener: TcpListener,
        clock: Arc<dyn Clock>,
        registry: prometheus::Registry,
        readiness: Readiness,
    ) -> anyhow::Result<Self> {
        let address = listener.local_addr()?;
        let metrics_address = metrics_listener.local_addr()?;
        let limits = config.listener;
        let shared = config.shared.clone().with_metrics_in(&registry)?;
        let readiness = readiness.postgres(&pool);
        let ingest = relay_ingest::build(pool, config, keys, &registry, clock)?;
        let (stop, stopped) = oneshot::channel::<()>();
        let done = tokio::spawn(async move {
            let metrics = tokio::spawn(telemetry::serve_metrics(
                metrics_listener,
                registry,
                readiness,
                shared.clone(),
            ));
            relay_listener::serve(
                listener,
                ingest.router,
                limits,
                shared,
                "webhook",
                async move {
                    let _ = stopped.await;
                },
            )
            .await;
            metrics.abort();
            ingest.cache_listener.abort();
            // The router is gone, so once the in-flight requests finished every queue sender
            // is dropped: the writers drain what is queued and end.
            for writer in ingest.writers {
                let _ = writer.await;
            }
            Ok(())
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

/// The front tier's wake-up publisher, when Redis answers: the front tier never depends on
/// Redis to answer (the sequencers' sweep finds what a missing wake-up would have announced).
pub async fn ingest_waker(global: &GlobalArgs) -> anyhow::Result<Option<relay_coord::Waker>> {
    let trust = global.trust()?;
    let connect = relay_coord::Waker::connect(&global.redis_url, &trust, &global.redis_key_prefix);
    Ok(
        match tokio::time::timeout(Duration::from_secs(5), connect).await {
            Ok(Ok(waker)) => Some(waker),
            Ok(Err(error)) => {
                let error = relay_netguard::error_chain(&error);
                tracing::warn!(%error, "no Redis: sequencers will find new messages by sweeping");
                None
            }
            Err(_) => {
                tracing::warn!(
                    "Redis did not answer: sequencers will find new messages by sweeping"
                );
                None
            }
        },
    )
}

/// A retention given in days: `None` (for ever) for 0.
fn days(days: f64) -> Option<Duration> {
    (days > 0.0).then(|| Duration::from_secs_f64(days * 24.0 * 3600.0))
}

impl SequencerArgs {
    pub fn to_config(
        &self,
        global: &GlobalArgs,
    ) -> anyhow::Result<relay_sequencer::SequencerConfig> {
        Ok(relay_sequencer::SequencerConfig {
            redis_url: global.redis_url.clone(),
            key_prefix: global.redis_key_prefix.clone(),
            lease: Duration::from_millis(self.lease_ms),
            max_concurrent_endpoints: self.max_concurrent_endpoints,
            max_tenant_share: self.max_tenant_share,
            apply_attempts: self.apply_attempts,
            messages_per_read: self.messages_per_read,
            appliers: self.appliers,
            apply_linger: Duration::from_micros(self.apply_linger_us),
            runs_per_transaction: self.runs_per_transaction,
            messages_per_transaction: self.messages_per_transaction,
            sweep_interval: Duration::from_millis(self.sweep_interval_ms),
            idle_linger: Duration::from_millis(self.idle_linger_ms),
            max_idle_endpoints: self.max_idle_endpoints,
            applied_events_retention: days(self.applied_events_retention_days),
            message_retention: days(self.message_retention_days),
            change_retention: days(self.change_retention_days),
            retention_interval: Duration::from_secs(self.retention_interval_s),
            upstream_timeout: Duration::from_millis(self.upstream_timeout_ms),
            stories_catch_up_interval: Duration::from_secs(self.stories_catch_up_interval_s),
            max_concurrent_reloads: self.max_concurrent_reloads,
            max_reload_bytes: self.max_reload_bytes,
            outbound: global.outbound.policy(),
            trust: global.trust()?,
            ..relay_sequencer::SequencerConfig::default()
        })
    }
}

/// The sequencer's pool: no statement timeout shorter than a large reload's merge statements
/// need, and plans made once.
pub fn sequencer_pool(global: &GlobalArgs) -> anyhow::Result<PgPool> {
    tier_pool(
        global,
        Duration::from_secs(30),
        Duration::from_secs(300),
        true,
    )
}

/// Serves a tier's `/metrics` and readiness on `listener`, under the process's listener
/// settings (whose own metrics go into `registry` too): the task, to abort when the tier stops.
fn spawn_metrics(
    global: &GlobalArgs,
    listener: TcpListener,
    registry: prometheus::Registry,
    readiness: Readiness,
) -> anyhow::Result<JoinHandle<()>> {
    let shared = global.listeners.shared().with_metrics_in(&registry)?;
    Ok(tokio::spawn(telemetry::serve_metrics(
        listener, registry, readiness, shared,
    )))
}

/// `relay sequencer`: apply until SIGINT or SIGTERM, then let every worker finish its
/// transaction and release its endpoint.
pub async fn run_sequencer(global: &GlobalArgs, command: &SequencerCommand) -> anyhow::Result<()> {
    let pool = sequencer_pool(global)?;
    let registry = telemetry::tier_registry("sequencer")?;
    let metrics = relay_sequencer::SequencerMetrics::register(&registry)?;
    let readiness = Readiness::default()
        .postgres(&pool)
        .redis(&global.redis_url, &global.trust()?);
    let metrics_listener = telemetry::bind(command.metrics_listen, "metrics").await?;
    fit_listeners(
        global,
        1,
        2 * command.args.max_concurrent_endpoints,
        &mut [],
    );
    let keys = crate::keys::opened(global, &pool).await?;
    let serve_metrics = spawn_metrics(global, metrics_listener, registry, readiness)?;
    let sequencer =
        relay_sequencer::Sequencer::start(pool, command.args.to_config(global)?, keys, metrics)
            .await
            .context("starting the sequencer (is Redis up?)")?;
    tracing::info!("sequencer running");
    shutdown_signal().await;
    tracing::info!("shutting down: finishing the transactions in flight");
    sequencer.stop().await;
    serve_metrics.abort();
    Ok(())
}

/// A pool for the publisher and the control plane: short statements, plans made once.
fn service_pool(global: &GlobalArgs) -> anyhow::Result<PgPool> {
    tier_pool(
        global,
        Duration::from_secs(10),
        Duration::from_secs(30),
        false,
    )
}

fn publisher_config(
    global: &GlobalArgs,
    args: &relay_publisher::PublisherArgs,
) -> anyhow::Result<relay_publisher::PublisherConfig> {
    let mut args = args.clone();
    args.redis_url = global.redis_url.clone();
    args.publisher_key_prefix = global.redis_key_prefix.clone();
    Ok(relay_publisher::PublisherConfig {
        trust: global.trust()?,
        ..args.config()
    })
}

/// `relay publisher`: publish until SIGINT or SIGTERM, then finish the rounds in flight.
pub async fn run_publisher(global: &GlobalArgs, command: &PublisherCommand) -> anyhow::Result<()> {
    let registry = telemetry::tier_registry("publisher")?;
    let pool = service_pool(global)?;
    let trust = global.trust()?;
    let readiness = Readiness::default()
        .postgres(&pool)
        .redis(&global.redis_url, &trust)
        .broker(&command.args.amqp_url, &trust);
    let keys = crate::keys::opened(global, &pool).await?;
    let publisher = relay_publisher::Publisher::start(
        pool,
        publisher_config(global, &command.args)?,
        keys,
        &registry,
    )
    .await
    .context("starting the publisher (is Redis up?)")?;
    let metrics_listener = telemetry::bind(command.metrics_listen, "metrics").await?;
    fit_listeners(global, 1, PUBLISHER_DESCRIPTORS, &mut []);
    let serve_metrics = spawn_metrics(global, metrics_listener, registry, readiness)?;
    tracing::info!("publisher running");
    shutdown_signal().await;
    tracing::info!("shutting down: finishing the rounds in flight");
    publisher.stop().await;
    serve_metrics.abort();
    Ok(())
}

/// `relay api`: serve the control plane until SIGINT or SIGTERM.
pub async fn run_api(global: &GlobalArgs, command: &ApiCommand) -> anyhow::Result<()> {
    let registry = telemetry::tier_registry("api")?;
    let mut args = command.args.clone();
    args.relay_amqp_url = command.amqp_url.clone();
    args.destination_policy = command.destinations.policy();
    args.quota_defaults = global.quota_defaults();
    let pool = service_pool(global)?;
    let keys = crate::keys::opened(global, &pool).await?;
    let mut config = args.to_config(global.outbound.policy(), global.trust()?, keys)?;
    config.registry = registry.clone();
    config.shared = global.listeners.shared().with_metrics_in(&registry)?;
    fit_listeners(
        global,
        1,
        API_DESCRIPTORS,
        &mut [("api", &mut config.listener)],
    );
    let readiness = Readiness::default().postgres(&pool);
    let config_shared = config.shared.clone();
    let mut server = relay_api::ApiServer::start(pool, config).await?;
    tracing::info!(address = %server.address, "control plane running");
    let metrics_listener = telemetry::bind(command.metrics_listen, "metrics").await?;
    let serve_metrics = tokio::spawn(telemetry::serve_metrics(
        metrics_listener,
        registry,
        readiness,
        config_shared,
    ));
    let result = tokio::select! {
        result = server.wait() => result.map_err(anyhow::Error::from),
        () = shutdown_signal() => server.stop().await.map_err(anyhow::Error::from),
    };
    serve_metrics.abort();
    result
}

/// `relay ingest`: serve until SIGINT or SIGTERM.
pub async fn run_ingest(global: &GlobalArgs, args: &IngestArgs) -> anyhow::Result<()> {
    let mut config = args.to_config();
    config.shared = global.listeners.shared();
    config.quotas = global.quota_defaults();
    fit_listeners(
        global,
        1,
        INGEST_DESCRIPTORS,
        &mut [("webhook", &mut config.listener)],
    );
    config.waker = ingest_waker(global).await?;
    // Statements must end before the answer deadline, leaving time to answer.
    let pool = ingest_pool(global, config.answer_deadline.mul_f64(0.8))?;
    let keys = crate::keys::opened(global, &pool).await?;
    let listener = telemetry::bind(args.listen, "webhook").await?;
    let metrics_listener = telemetry::bind(args.metrics_listen, "metrics").await?;
    let mut server = IngestServer::start(
        pool,
        config,
        keys,
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

/// Every tier in one process, as `relay all` and `relay demo` run them: their metrics in one
/// registry, served on the front tier's metrics listener.
pub struct AllTiers {
    pub ingest: IngestServer,
    /// The control plane, when a JWT key is configured.
    pub api: Option<relay_api::ApiServer>,
    pub registry: prometheus::Registry,
    sequencer: relay_sequencer::Sequencer,
    publisher: relay_publisher::PublisherHandle,
}

/// The changes the sequencer hands the publisher of its process in memory (`relay all`) that
/// may wait for one tenant's task, and for all of them together, in bytes; past either, changes
/// are announced and read back from the outbox as between processes.
const HANDOFF_BYTES_PER_TENANT: usize = 8 << 20;
const HANDOFF_BYTES: usize = 64 << 20;

/// The messages the front tier hands the sequencer's worker of their endpoint in memory that
/// may wait for one worker, and for all of them together, in bytes; past either, messages are
/// announced and read back from Postgres as between processes.
const MESSAGE_HANDOFF_BYTES_PER_ENDPOINT: usize = 4 << 20;
const MESSAGE_HANDOFF_BYTES: usize = 64 << 20;

impl AllTiers {
    /// Starts every tier on `global`'s database (migrated already) with `args`' settings.
    pub async fn start(global: &GlobalArgs, args: &AllArgs) -> anyhow::Result<Self> {
        let registry = telemetry::tier_registry("all")?;
        let keys = crate::keys::opened(global, &sequencer_pool(global)?).await?;
        let sequencer_metrics = relay_sequencer::SequencerMetrics::register(&registry)?;
        let changes = relay_coord::Handoff::new(HANDOFF_BYTES_PER_TENANT, HANDOFF_BYTES);
        let messages =
            relay_coord::Handoff::new(MESSAGE_HANDOFF_BYTES_PER_ENDPOINT, MESSAGE_HANDOFF_BYTES);
        let sequencer = relay_sequencer::Sequencer::start(
            sequencer_pool(global)?,
            relay_sequencer::SequencerConfig {
                changes_handoff: Some(changes.clone()),
                messages_handoff: Some(messages.clone()),
                ..args.sequencer.to_config(global)?
            },
            keys.clone(),
            sequencer_metrics,
        )
        .await
        .context("starting the sequencer (is Redis up?)")?;

        let publisher = relay_publisher::Publisher::start(
            service_pool(global)?,
            relay_publisher::PublisherConfig {
                changes_handoff: Some(changes),
                ..publisher_config(global, &args.publisher)?
            },
            keys.clone(),
            &registry,
        )
        .await
        .context("starting the publisher (is Redis up?)")?;
        // The control plane needs a signing key; without one the other tiers still run.
        // The control plane refuses destinations by the publisher's broker and policy.
        let shared = global.listeners.shared().with_metrics_in(&registry)?;
        let mut api_args = args.api.clone();
        api_args.relay_amqp_url = args.publisher.amqp_url.clone();
        api_args.destination_policy = args.publisher.destinations.policy();
        api_args.quota_defaults = global.quota_defaults();
        let mut api_config =
            api_args.to_config(global.outbound.policy(), global.trust()?, keys.clone());
        let mut config = args.ingest.to_config();
        config.shared = shared.clone();
        config.quotas = global.quota_defaults();
        // Four pools; the sequencer's upstream reads (one or two per endpoint worked), the
        // publisher's brokers, and both listeners' own needs.
        let reserved = INGEST_DESCRIPTORS
            + API_DESCRIPTORS
            + 2 * args.sequencer.max_concurrent_endpoints
            + PUBLISHER_DESCRIPTORS;
        match &mut api_config {
            Ok(api) => fit_listeners(
                global,
                4,
                reserved,
                &mut [
                    ("webhook", &mut config.listener),
                    ("api", &mut api.listener),
                ],
            ),
            Err(_) => fit_listeners(
                global,
                4,
                reserved,
                &mut [("webhook", &mut config.listener)],
            ),
        }
        let api = match api_config {
            Ok(mut api_config) => {
                api_config.registry = registry.clone();
                api_config.shared = shared;
                let server = relay_api::ApiServer::start(service_pool(global)?, api_config).await?;
                tracing::info!(address = %server.address, "control plane running");
                Some(server)
            }
            Err(relay_api::ConfigError::NoKey) => {
                tracing::warn!("control plane not started (set RELAY_API_JWT_SECRET_FILE)");
                None
            }
            // A key given but not usable (too short, a previous key without when its rotation
            // began) is a mistake to fix, not a control plane to do without.
            Err(error) => return Err(error.into()),
        };

        config.waker = ingest_waker(global).await?;
        config.messages_handoff = Some(messages);
        let pool = ingest_pool(global, config.answer_deadline.mul_f64(0.8))?;
        let listener = telemetry::bind(args.ingest.listen, "webhook").await?;
        let metrics_listener = telemetry::bind(args.ingest.metrics_listen, "metrics").await?;
        let trust = global.trust()?;
        let readiness = Readiness::default()
            .redis(&global.redis_url, &trust)
            .broker(&args.publisher.amqp_url, &trust);
        let ingest = IngestServer::start_with_registry(
            pool,
            config,
            keys,
            listener,
            metrics_listener,
            Arc::new(SystemClock),
            registry.clone(),
            readiness,
        )?;
        Ok(Self {
            ingest,
            api,
            registry,
            sequencer,
            publisher,
        })
    }

    /// Stops every tier: the front tier answers what is in flight (unless it ended by itself
    /// with `ingest_ended`), the sequencer and the publisher finish their transactions and
    /// rounds.
    pub async fn stop(self, ingest_ended: Option<anyhow::Result<()>>) -> anyhow::Result<()> {
        let result = match ingest_ended {
            Some(result) => result,
            None => self.ingest.stop().await,
        };
        if let Some(api) = self.api {
            let _ = api.stop().await;
        }
        self.sequencer.stop().await;
        self.publisher.stop().await;
        result
    }
}

/// `relay all`: every tier in one process until SIGINT or SIGTERM.
pub async fn run_all(global: &GlobalArgs, args: &AllArgs) -> anyhow::Result<()> {
    let mut tiers = AllTiers::start(global, args).await?;
    let ingest_ended = tokio::select! {
        result = tiers.ingest.wait() => Some(result),
        () = shutdown_signal() => {
            tracing::info!("shutting down: answering in-flight messages");
            None
        }
    };
    tiers.stop(ingest_ended).await
}

/// SIGINT or SIGTERM.
pub async fn shutdown_signal() {
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
