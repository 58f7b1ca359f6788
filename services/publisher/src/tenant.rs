//! One owned tenant: read its endpoints' next changes, publish them, mark what was confirmed,
//! again and again until it has been idle a while, its lease is lost, or the publisher stops.
//!
//! # Order
//! Each endpoint has at most one change in flight: a round takes the first unpublished change
//! of each of the tenant's endpoints (up to `max_in_flight` of them), publishes them all, waits
//! for all their confirms, and marks the confirmed ones. An endpoint's change k+1 is therefore
//! never sent before its change k was confirmed, that is, before k was in the queue. Pipelining
//! inside one endpoint would break that on a nack or a return: k refused, k+1 already accepted
//! behind it, k sent again after it. Rounds pipeline across endpoints instead, which is where
//! the load spreads (a tenant has many endpoints). The one change in doubt per endpoint (no
//! confirm came) is sent again before anything after it, so a late copy of it can only be a
//! repeat of a change_seq already delivered.
//!
//! # Broker trouble
//! Nothing is marked unless confirmed, so the backlog stays in Postgres whatever happens. A
//! failed connect, a closed channel or connection, or a confirm that does not come in time drops
//! the connection and retries after a pause (doubled each failure in a row, with jitter, up to
//! `retry_max`). A return (the queue was deleted under us) declares the queue again; a nack is
//! retried. Every wait is bounded, and each tenant has a task and a channel of its own (and a
//! connection of its own when its destination is its own broker), so a tenant whose broker does
//! not answer holds up only itself.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng as _;
use time::OffsetDateTime;
use tokio::sync::{watch, Notify};
use uuid::Uuid;

use crate::broker::{publish_round, BrokerError, Link, Outcome, Target};
use crate::outbox::{self, Marked};
use crate::ownership::TenantLease;
use crate::publisher::Shared;

/// Why a tenant's task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Shutdown,
    Idle,
    /// The lease ran out or another publisher fenced this one out: not ours to release.
    Lost,
}

/// Runs one owned tenant until it is idle, lost, or the publisher stops. `wake` is notified by
/// the coordinator whenever its poll finds the tenant with unpublished changes; an idle tenant
/// waits for that instead of asking Postgres itself.
pub(crate) async fn run(
    shared: Arc<Shared>,
    lease: TenantLease,
    wake: Arc<Notify>,
    shutdown: watch::Receiver<bool>,
) {
    let tenant = lease.key;
    let mut worker = Worker {
        label: tenant.to_string(),
        tenant,
        shared,
        lease,
        wake,
        shutdown,
        link: None,
        target: None,
        backoff: Backoff::default(),
        unmarked: Vec::new(),
    };
    worker.backoff.reset(worker.shared.config.retry_min);
    let end = worker.run().await;
    tracing::info!(%tenant, ?end, "publisher gives the tenant up");
    let Worker {
        shared,
        lease,
        link,
        label,
        ..
    } = worker;
    if let Some(link) = link {
        link.close().await;
    }
    shared.metrics.forget_tenant(&label);
    if end == End::Lost {
        shared.metrics.ownership_losses.inc();
    } else if let Err(error) = shared.owners.release(lease).await {
        // It runs out by itself within a lease.
        tracing::warn!(%tenant, error = %error, "could not release the tenant's lease");
    }
}

struct Worker {
    tenant: Uuid,
    label: String,
    shared: Arc<Shared>,
    lease: TenantLease,
    wake: Arc<Notify>,
    shutdown: watch::Receiver<bool>,
    link: Option<Link>,
    target: Option<Target>,
    backoff: Backoff,
    /// Confirmed by the broker, not yet marked (the mark failed): marked before anything else
    /// is sent, so a Postgres hiccup does not turn into resends.
    unmarked: Vec<(Uuid, i64)>,
}

impl Worker {
    async fn run(&mut self) -> End {
        let config = self.shared.config.clone();
        let now = Instant::now();
        let mut next_renew = now + config.lease / 3;
        let mut next_metrics = now;
        let mut next_destination = now;
        let mut idle_since = now;
        let mut cursor = Uuid::nil();
        loop {
            if *self.shutdown.borrow() {
                return End::Shutdown;
            }
            if !self.keep_lease(&mut next_renew).await {
                return End::Lost;
            }
            let now = Instant::now();
            if now >= next_metrics {
                next_metrics = now + config.metrics_interval;
                self.refresh_backlog_metrics().await;
            }
            if now >= next_destination || self.target.is_none() {
                next_destination = now + config.destination_refresh;
                if let Err(error) = self.refresh_target().await {
                    tracing::warn!(tenant = %self.tenant, error = %error, "reading the destination failed");
                    if self.pause().await {
                        return End::Shutdown;
                    }
                    continue;
                }
            }

            if !self.unmarked.is_empty() {
                let keys = std::mem::take(&mut self.unmarked);
                match self.mark(keys).await {
                    Ok(true) => {}
                    Ok(false) => return End::Lost,
                    Err(()) => {
                        if self.pause().await {
                            return End::Shutdown;
                        }
                        continue;
                    }
                }
            }

            let (changes, next) = match outbox::next_round(
                &self.shared.pool,
                self.tenant,
                cursor,
                config.max_in_flight,
            )
            .await
            {
                Ok(round) => round,
                Err(error) => {
                    tracing::warn!(tenant = %self.tenant, error = %error, "reading the outbox failed");
                    if self.pause().await {
                        return End::Shutdown;
                    }
                    continue;
                }
            };
            if changes.is_empty() {
                let idle = now.duration_since(idle_since);
                if idle >= config.idle_release {
                    return End::Idle;
                }
                if self.wait_for_work(config.idle_release - idle).await {
                    return End::Shutdown;
                }
                continue;
            }
            cursor = next;
            idle_since = now;

            let link = match self.link.take() {
                Some(link) if link.is_open() => link,
                stale => {
                    if let Some(stale) = stale {
                        stale.close().await;
                    }
                    let target = self.target.clone().expect("the target is read above");
                    let relay = &self.shared.relay;
                    match Link::open(target, self.tenant, relay, config.connect_timeout).await {
                        Ok(link) => {
                            // Connecting may have taken a while: renew before the round if due.
                            if !self.keep_lease(&mut next_renew).await {
                                link.close().await;
                                return End::Lost;
                            }
                            link
                        }
                        Err(error) => {
                            self.broker_trouble("connect", &error);
                            if self.pause().await {
                                return End::Shutdown;
                            }
                            continue;
                        }
                    }
                }
            };

            let metrics = &self.shared.metrics;
            let (outcomes, failure) =
                publish_round(&link, &changes, config.confirm_timeout, || {
                    metrics.published.inc()
                })
                .await;
            let confirmed_at = OffsetDateTime::now_utc();
            let mut confirmed = Vec::new();
            let mut ids = Vec::new();
            let (mut returned, mut nacked, mut unknown) = (0u64, 0u64, 0u64);
            for (change, outcome) in changes.iter().zip(&outcomes) {
                match outcome {
                    Outcome::Confirmed => {
                        confirmed.push(change.key());
                        ids.push(change.message.message_id());
                        let latency = (confirmed_at - change.created_at).as_seconds_f64();
                        metrics.latency.observe(latency.max(0.0));
                    }
                    Outcome::Returned => returned += 1,
                    Outcome::Nacked => nacked += 1,
                    Outcome::Unknown => unknown += 1,
                }
            }
            metrics.confirmed.inc_by(confirmed.len() as u64);
            metrics.returned.inc_by(returned);
            metrics.nacked.inc_by(nacked);

            if !confirmed.is_empty() {
                if let Some(hook) = &config.before_mark {
                    (hook.0)(ids).await;
                }
                match self.mark(confirmed).await {
                    Ok(true) => {}
                    Ok(false) => {
                        link.close().await;
                        return End::Lost;
                    }
                    // Kept in `unmarked`; marked first thing next time round.
                    Err(()) => {}
                }
            }

            // An outcome unknown without a failure to explain it (a channel not in confirm
            // mode) is handled as one: the link is not to be trusted.
            let failure = failure
                .or_else(|| (unknown > 0).then(|| ("confirm", BrokerError::Unconfirmed(unknown))));
            if let Some((stage, error)) = failure {
                self.broker_trouble(stage, &error);
                link.close_after(&error, &self.shared.relay).await;
                if self.pause().await {
                    return End::Shutdown;
                }
                continue;
            }
            if returned > 0 {
                tracing::warn!(
                    tenant = %self.tenant, returned, exchange = %link.target.exchange,
                    routing_key = %link.target.routing_key,
                    "messages came back unroutable; declaring the queue (if ours) and retrying"
                );
                if let Err(error) = link.redeclare(config.connect_timeout).await {
                    self.broker_trouble("connect", &error);
                    link.close_after(&error, &self.shared.relay).await;
                    if self.pause().await {
                        return End::Shutdown;
                    }
                    continue;
                }
            }
            self.link = Some(link);
            if returned > 0 || nacked > 0 {
                if nacked > 0 {
                    tracing::warn!(tenant = %self.tenant, nacked, "the broker nacked messages; retrying");
                }
                if self.pause().await {
                    return End::Shutdown;
                }
            } else {
                self.backoff.reset(config.retry_min);
            }
        }
    }

    /// Renews the lease when due; `false` once it is lost (not renewed in time, or taken).
    async fn keep_lease(&mut self, next_renew: &mut Instant) -> bool {
        let lease = self.shared.config.lease;
        let now = Instant::now();
        if now >= *next_renew {
            match self.shared.owners.renew(&mut self.lease).await {
                Ok(true) => *next_renew = now + lease / 3,
                Ok(false) => return false,
                Err(error) => {
                    // Try again soon; the validity check below stops us if it lasts.
                    tracing::warn!(tenant = %self.tenant, error = %error, "lease renewal failed");
                    *next_renew = now + (lease / 10).max(Duration::from_millis(50));
                }
            }
        }
        self.lease.is_valid(Instant::now())
    }

    /// Marks confirmed changes published. `Ok(false)`: fenced out. `Err`: Postgres failed;
    /// the keys are kept to be marked again.
    async fn mark(&mut self, keys: Vec<(Uuid, i64)>) -> Result<bool, ()> {
        match outbox::mark_published(&self.shared.pool, self.tenant, self.lease.token, &keys).await
        {
            Ok(Marked::Marked(n)) => {
                self.shared.metrics.marked.inc_by(n);
                Ok(true)
            }
            Ok(Marked::FencedOut) => {
                tracing::warn!(tenant = %self.tenant, token = self.lease.token,
                               "another publisher took the tenant over");
                Ok(false)
            }
            Err(error) => {
                tracing::warn!(tenant = %self.tenant, error = %error,
                               "marking confirmed changes failed; will retry");
                self.unmarked = keys;
                Err(())
            }
        }
    }

    async fn refresh_target(&mut self) -> Result<(), outbox::OutboxError> {
        let destination = outbox::destination(&self.shared.pool, self.tenant).await?;
        let target = Target::resolve(self.tenant, &destination, &self.shared.config.amqp_url);
        if self.target.as_ref() != Some(&target) {
            if self.target.is_some() {
                tracing::info!(tenant = %self.tenant, "the tenant's destination changed");
            }
            if let Some(link) = self.link.take() {
                link.close().await;
            }
            self.target = Some(target);
        }
        Ok(())
    }

    async fn refresh_backlog_metrics(&self) {
        match outbox::backlog(&self.shared.pool, self.tenant).await {
            Ok((count, oldest)) => {
                let metrics = &self.shared.metrics;
                metrics.backlog.with_label_values(&[&self.label]).set(count);
                let age = oldest.map_or(0.0, |t| {
                    (OffsetDateTime::now_utc() - t).as_seconds_f64().max(0.0)
                });
                metrics
                    .oldest_age
                    .with_label_values(&[&self.label])
                    .set(age);
            }
            Err(error) => {
                tracing::debug!(tenant = %self.tenant, error = %error, "backlog metrics not refreshed")
            }
        }
    }

    fn broker_trouble(&self, stage: &'static str, error: &BrokerError) {
        self.shared
            .metrics
            .broker_errors
            .with_label_values(&[stage])
            .inc();
        let url = self
            .target
            .as_ref()
            .map(|t| crate::config::redact(&t.url))
            .unwrap_or_default();
        tracing::warn!(tenant = %self.tenant, stage, broker = %url, error = %error,
                       "broker trouble; the backlog waits in Postgres");
    }

    /// Waits the next backoff step; `true` when the publisher is stopping.
    async fn pause(&mut self) -> bool {
        let wait = self.backoff.next(self.shared.config.retry_max);
        self.sleep(wait).await
    }

    /// Waits until the coordinator sees new changes of the tenant (or `longest` passes, or a
    /// renewal falls due). `true` when the publisher is stopping.
    async fn wait_for_work(&mut self, longest: Duration) -> bool {
        let wait = longest.min(self.shared.config.lease / 3);
        tokio::select! {
            _ = self.wake.notified() => *self.shutdown.borrow(),
            _ = tokio::time::sleep(wait) => *self.shutdown.borrow(),
            _ = self.shutdown.changed() => true,
        }
    }

    /// Sleeps, but no longer than the lease stays valid without a renewal due in between, and
    /// wakes at once on shutdown. `true` when the publisher is stopping.
    async fn sleep(&mut self, wait: Duration) -> bool {
        let wait = wait.min(self.shared.config.lease / 3);
        tokio::select! {
            _ = tokio::time::sleep(wait) => *self.shutdown.borrow(),
            _ = self.shutdown.changed() => true,
        }
    }
}

/// Exponential backoff with jitter, reset on success.
#[derive(Debug, Default)]
struct Backoff {
    current: Duration,
    min: Duration,
}

impl Backoff {
    fn reset(&mut self, min: Duration) {
        self.min = min;
        self.current = min;
    }

    fn next(&mut self, max: Duration) -> Duration {
        let base = self.current.min(max);
        self.current = (self.current * 2).min(max).max(self.min);
        // Between half and all of it, so tenants that failed together do not retry together.
        base.mul_f64(rand::thread_rng().gen_range(0.5..=1.0))
    }
}
