//! Starting and stopping the publisher: a coordinator that polls Postgres for tenants with
//! unpublished changes, takes the ones nobody holds, and runs a task per owned tenant.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::Registry;
use sqlx::PgPool;
use tokio::sync::{watch, Notify};
use tokio::task::{JoinHandle, JoinSet};
use uuid::Uuid;

use crate::broker::RelayBroker;
use crate::config::{redact, PublisherConfig};
use crate::metrics::PublisherMetrics;
use crate::outbox;
use crate::ownership::{OwnershipError, TenantOwners};

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
        registry: &Registry,
    ) -> Result<PublisherHandle, PublisherError> {
        let metrics = PublisherMetrics::register(registry)?;
        let owners = crate::ownership::connect(
            &config.redis_url,
            pool.clone(),
            config.key_prefix.clone(),
            config.lease,
        )
        .await?;
        tracing::info!(amqp = %redact(&config.amqp_url), "publisher starting");
        let relay = RelayBroker::new(config.amqp_url.clone(), config.connect_timeout);
        let shared = Arc::new(Shared {
            pool,
            config,
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
    /// Stops gracefully: every tenant task finishes its round (confirms awaited, confirmed
    /// changes marked), closes its connection and releases its lease.
    pub async fn stop(mut self) {
        self.stop.send_replace(true);
        if let Some(task) = self.task.take() {
            if let Err(error) = task.await {
                tracing::error!(error = %error, "the publisher's coordinator failed");
            }
        }
    }

    /// Stops at once, mid-round if need be, releasing nothing: what a killed process leaves.
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
async fn coordinate(shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let config = &shared.config;
    let mut tasks = JoinSet::new();
    let mut running: HashMap<tokio::task::Id, Uuid> = HashMap::new();
    // The tenants this process runs, each with the signal that wakes its idle task.
    let mut owned: HashMap<Uuid, Arc<Notify>> = HashMap::new();
    // Tenants another publisher holds: not asked for again before this, so that a poll every
    // 50 ms does not turn into a Redis write per tenant per poll. A holder that died is taken
    // over within a lease plus this.
    let retry_taken = (config.lease / 4).min(Duration::from_secs(1));
    let mut not_before: HashMap<Uuid, Instant> = HashMap::new();
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            Some(done) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                let id = match &done {
                    Ok((id, _)) => *id,
                    Err(error) => {
                        tracing::error!(error = %error, "a tenant task failed");
                        error.id()
                    }
                };
                if let Some(tenant) = running.remove(&id) {
                    owned.remove(&tenant);
                }
                shared.metrics.tenants_owned.set(owned.len() as i64);
                continue;
            }
            _ = tokio::time::sleep(config.poll_interval) => {}
        }
        if *stopped.borrow() {
            break;
        }
        let tenants = match outbox::tenants_with_backlog(&shared.pool, 100_000).await {
            Ok(tenants) => tenants,
            Err(error) => {
                tracing::warn!(error = %error, "looking for unpublished changes failed");
                continue;
            }
        };
        shared.metrics.backlog_tenants.set(tenants.len() as i64);
        let now = Instant::now();
        not_before.retain(|_, until| *until > now);
        for tenant in tenants {
            if let Some(wake) = owned.get(&tenant) {
                wake.notify_one();
                continue;
            }
            if owned.len() >= config.max_tenants || not_before.contains_key(&tenant) {
                continue;
            }
            match shared.owners.try_acquire(tenant).await {
                Ok(Some(lease)) => {
                    tracing::info!(%tenant, token = lease.token, "publisher takes the tenant");
                    let wake = Arc::new(Notify::new());
                    let handle = tasks.spawn(crate::tenant::run(
                        shared.clone(),
                        lease,
                        wake.clone(),
                        stopped.clone(),
                    ));
                    running.insert(handle.id(), tenant);
                    owned.insert(tenant, wake);
                }
                Ok(None) => {
                    not_before.insert(tenant, now + retry_taken);
                }
                Err(error) => {
                    // Not `break`: one tenant that cannot be claimed (say, deleted while its
                    // changes remain) must not keep the others from being taken.
                    tracing::warn!(%tenant, error = %error, "taking a tenant's lease failed");
                    not_before.insert(tenant, now + retry_taken);
                }
            }
        }
        shared.metrics.tenants_owned.set(owned.len() as i64);
    }
    // Every tenant task watches the same signal; wait until each has released its tenant.
    while tasks.join_next().await.is_some() {}
    shared.relay.close().await;
    shared.metrics.tenants_owned.set(0);
}
