//! Starting and stopping the publisher: a coordinator that hears the sequencer's announcements
//! of new changes and polls Postgres for tenants with unpublished changes, takes the tenants
//! nobody holds, and runs a task per owned tenant.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::Registry;
use relay_store::{changes, EndpointId, Keyring, TenantId};
use sqlx::PgPool;
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use uuid::Uuid;

use crate::broker::RelayBroker;
use crate::config::{redact, PublisherConfig};
use crate::metrics::PublisherMetrics;
use crate::ownership::{OwnershipError, TenantOwners};
use crate::tenant::TenantSignal;

#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    #[error("connecting to redis for the tenant leases: {0}")]
    Ownership(#[from] OwnershipError),
    #[error("registering the publisher's metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// What the coordinator and every tenant task share.
pub(crate) struct Shared {
    pub pool: PgPool,
    pub config: PublisherConfig,
    /// Opens the tenants' own brokers' URLs, which are stored sealed.
    pub keys: Keyring,
    pub metrics: PublisherMetrics,
    pub owners: TenantOwners,
    pub relay: RelayBroker,
}

/// The publisher tier.
pub struct Publisher;

impl Publisher {
    /// Registers the metrics, connects to Redis, and starts publishing in the background.
    /// Brokers are connected to per tenant as needed: one that is down is retried, not an error.
    pub async fn start(
        pool: PgPool,
        config: PublisherConfig,
        keys: Keyring,
        registry: &Registry,
    ) -> Result<PublisherHandle, PublisherError> {
        let metrics = PublisherMetrics::register(registry)?;
        let owners = crate::ownership::connect(
            &config.redis_url,
            &config.trust,
            pool.clone(),
            config.key_prefix.clone(),
            config.lease,
        )
        .await?;
        tracing::info!(amqp = %redact(&config.amqp_url), "publisher starting");
        let relay = RelayBroker::new(
            config.amqp_url.clone(),
            config.connect_timeout,
            config.trust.clone(),
        );
        let shared = Arc::new(Shared {
            pool,
            config,
            keys,
            metrics,
            owners,
            relay,
        });
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(coordinate(shared, stopped));
        Ok(PublisherHandle {
            stop,
            task: Some(task),
        })
    }
}

/// A running publisher. Dropping it without [`PublisherHandle::stop`] aborts it, as a crash
/// would: tenants stay leased until their leases run out.
pub struct PublisherHandle {
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl PublisherHandle {
    /// Stops gracefully: every tenant task stops sending, awaits the confirms in flight, marks
    /// what they confirmed, closes its connection and releases its lease.
    pub async fn stop(mut self) {
        self.stop.send_replace(true);
        if let Some(task) = self.task.take() {
            if let Err(error) = task.await {
                tracing::error!(error = %error, "the publisher's coordinator failed");
            }
        }
    }

    /// Stops at once, between a confirm and its mark if need be, releasing nothing: what a killed process leaves.
    pub fn abort(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Drop for PublisherHandle {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// The coordinator. Owns the tenant tasks in a `JoinSet`, so aborting it aborts them all.
///
/// Work is found two ways: the sequencer's announcements (an endpoint of a tenant has new
/// changes), handed at once to the task owning the tenant or starting one; and a poll of
/// Postgres every `poll_interval` for tenants with unpublished changes, which finds what an
/// announcement lost (Redis pub/sub keeps nothing for a listener that was away).
async fn coordinate(shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let config = &shared.config;
    let (announced_tx, mut announced) = mpsc::unbounded_channel::<(TenantId, EndpointId)>();
    let listener = tokio::spawn(relay_coord::listen_parsed(
        config.redis_url.clone(),
        config.trust.clone(),
        relay_coord::changes_channel(&config.key_prefix),
        announced_tx,
        stopped.clone(),
        relay_coord::parse_change_payload,
    ));
    let mut coordinator = Coordinator {
        shared: shared.clone(),
        stopped: stopped.clone(),
        tasks: JoinSet::new(),
        running: HashMap::new(),
        owned: HashMap::new(),
        // Tenants another publisher holds: not asked for again before this, so that polls and
        // announcements do not turn into a Redis write per tenant each. A holder that died is
        // taken over within a lease plus this.
        retry_taken: (config.lease / 4).min(Duration::from_secs(1)),
        not_before: HashMap::new(),
    };
    let mut next_poll = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            Some(done) = coordinator.tasks.join_next_with_id(), if !coordinator.tasks.is_empty() => {
                let id = match &done {
                    Ok((id, _)) => *id,
                    Err(error) => {
                        tracing::error!(error = %error, "a tenant task failed");
                        error.id()
                    }
                };
                if let Some(tenant) = coordinator.running.remove(&id) {
                    coordinator.owned.remove(&tenant);
                }
                shared.metrics.tenants_owned.set(coordinator.owned.len() as i64);
                continue;
            }
            Some((TenantId(tenant), EndpointId(endpoint))) = announced.recv() => {
                match coordinator.owned.get(&tenant) {
                    Some(signal) => signal.endpoint(endpoint),
                    // A new task sweeps the whole tenant first.
                    None => coordinator.take(tenant).await,
                }
                continue;
            }
            _ = tokio::time::sleep_until(next_poll) => {}
        }
        if *stopped.borrow() {
            break;
        }
        next_poll = tokio::time::Instant::now() + config.poll_interval;
        let tenants = match changes::tenants_with_backlog(&shared.pool, 100_000).await {
            Ok(tenants) => tenants,
            Err(error) => {
                shared
                    .metrics
                    .postgres_errors
                    .with_label_values(&["poll"])
                    .inc();
                tracing::warn!(error = %error, "looking for unpublished changes failed");
                continue;
            }
        };
        shared.metrics.backlog_tenants.set(tenants.len() as i64);
        for tenant in tenants.iter().map(TenantId::as_uuid) {
            match coordinator.owned.get(&tenant) {
                Some(signal) => signal.sweep(),
                None => coordinator.take(tenant).await,
            }
        }
    }
    listener.abort();
    // Every tenant task watches the same signal; wait until each has released its tenant.
    while coordinator.tasks.join_next().await.is_some() {}
    shared.relay.close().await;
    shared.metrics.tenants_owned.set(0);
}

struct Coordinator {
    shared: Arc<Shared>,
    stopped: watch::Receiver<bool>,
    tasks: JoinSet<()>,
    running: HashMap<tokio::task::Id, Uuid>,
    /// The tenants this process runs, each with the signal its task listens to.
    owned: HashMap<Uuid, Arc<TenantSignal>>,
    retry_taken: Duration,
    not_before: HashMap<Uuid, Instant>,
}

impl Coordinator {
    /// Takes `tenant` if nobody holds it and this process has room, and starts its task.
    async fn take(&mut self, tenant: Uuid) {
        let now = Instant::now();
        self.not_before.retain(|_, until| *until > now);
        if self.owned.len() >= self.shared.config.max_tenants
            || self.not_before.contains_key(&tenant)
        {
            return;
        }
        match self.shared.owners.hold(tenant).await {
            Ok(Some(held)) => {
                tracing::info!(%tenant, token = held.token(), "publisher takes the tenant");
                let signal = Arc::new(TenantSignal::default());
                let handle = self.tasks.spawn(crate::tenant::run(
                    self.shared.clone(),
                    held,
                    signal.clone(),
                    self.stopped.clone(),
                ));
                self.running.insert(handle.id(), tenant);
                self.owned.insert(tenant, signal);
                self.shared
                    .metrics
                    .tenants_owned
                    .set(self.owned.len() as i64);
            }
            Ok(None) => {
                self.not_before.insert(tenant, now + self.retry_taken);
            }
            Err(error) => {
                // One tenant that cannot be claimed (say, deleted while its changes remain)
                // must not keep the others from being taken.
                tracing::warn!(%tenant, error = %relay_netguard::error_chain(&error), "taking a tenant's lease failed");
                self.not_before.insert(tenant, now + self.retry_taken);
            }
        }
    }
}
