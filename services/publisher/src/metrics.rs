//! The publisher's metrics, named by Prometheus' conventions (base units, `_total` counters),
//! registered on the registry the process serves at `/metrics`.

use prometheus::{
    exponential_buckets, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

/// Where broker trouble happened, as the `stage` label of `relay_publisher_broker_errors_total`.
/// `refused`: the tenant's destination resolved to the relay's own broker or to an address the
/// operator does not allow; nothing was sent.
pub const BROKER_STAGES: [&str; 4] = ["connect", "refused", "publish", "confirm"];

/// What the publisher was doing when Postgres failed it, as the `stage` label of
/// `relay_publisher_postgres_errors_total`.
/// The `source` labels of `relay_publisher_changes_taken_total`.
pub const CHANGE_SOURCES: [&str; 2] = ["handed", "outbox"];

pub const POSTGRES_STAGES: [&str; 5] = ["poll", "read", "mark", "backlog", "destination"];

#[derive(Clone)]
pub struct PublisherMetrics {
    /// Messages handed to a broker (each attempt counts, a resend too).
    pub published: IntCounter,
    /// Changes confirmed in turn: acked (not returned), and every change before them of their
    /// endpoint too. Once each, however many times they were sent.
    pub confirmed: IntCounter,
    /// Publishes the broker nacked.
    pub nacked: IntCounter,
    /// Publishes the broker returned as unroutable (the mandatory flag).
    pub returned: IntCounter,
    /// Changes marked published in Postgres.
    pub marked: IntCounter,
    /// Unpublished changes of each tenant this process owns.
    pub backlog: IntGaugeVec,
    /// Age of the oldest unpublished change of each tenant this process owns.
    pub oldest_age: GaugeVec,
    /// From a change's creation (the sequencer's commit) to the broker's confirm.
    pub latency: Histogram,
    /// From handing a change's message to the broker to its confirm (acked or nacked).
    pub confirm_wait: Histogram,
    pub tenants_owned: IntGauge,
    /// Tenants with unpublished changes, whoever owns them (as this process' last poll saw).
    pub backlog_tenants: IntGauge,
    pub broker_errors: IntCounterVec,
    /// Postgres failures (unreachable, timed out, no connection free in the pool), by stage.
    pub postgres_errors: IntCounterVec,
    /// Tenants given up because their lease was lost or their fence taken.
    pub ownership_losses: IntCounter,
    /// Changes taken to send, by where they were found: `handed` over in memory by the
    /// sequencer of this process, or read from the `outbox`.
    pub changes_taken: IntCounterVec,
    /// Changes sent again: put back, with every later change of their endpoint in flight, after
    /// a nack, a return or a lost channel of one of them or of an earlier one.
    pub resent: IntCounter,
    /// An endpoint's changes in its window (sent, not yet confirmed in turn) as each is sent,
    /// that one included: how much of the window a busy endpoint uses.
    pub endpoint_in_flight: Histogram,
}

impl PublisherMetrics {
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let counter = |name: &str, help: &str| IntCounter::with_opts(Opts::new(name, help));
        let metrics = Self {
            published: counter(
                "relay_publisher_messages_published_total",
                "Change messages handed to a broker, resends included.",
            )?,
            confirmed: counter(
                "relay_publisher_messages_confirmed_total",
                "Change messages the broker confirmed (acked, not returned), each once, when every \
                 earlier change of its endpoint is confirmed too.",
            )?,
            nacked: counter(
                "relay_publisher_messages_nacked_total",
                "Change messages the broker nacked; they are sent again.",
            )?,
            returned: counter(
                "relay_publisher_messages_returned_total",
                "Change messages the broker returned as unroutable; they are sent again.",
            )?,
            marked: counter(
                "relay_publisher_changes_marked_total",
                "Changes marked published in Postgres after their confirm.",
            )?,
            backlog: IntGaugeVec::new(
                Opts::new(
                    "relay_publisher_backlog_changes",
                    "Unpublished changes of each tenant this publisher owns.",
                ),
                &["tenant"],
            )?,
            oldest_age: GaugeVec::new(
                Opts::new(
                    "relay_publisher_oldest_unpublished_age_seconds",
                    "Age of the oldest unpublished change of each tenant this publisher owns.",
                ),
                &["tenant"],
            )?,
            latency: Histogram::with_opts(
                HistogramOpts::new(
                    "relay_publisher_publish_latency_seconds",
                    "From a change's creation to the broker's confirm of its message.",
                )
                .buckets(exponential_buckets(0.001, 2.0, 17)?),
            )?,
            confirm_wait: Histogram::with_opts(
                HistogramOpts::new(
                    "relay_publisher_confirm_wait_seconds",
                    "From handing a message to the broker to its confirm (ack or nack).",
                )
                .buckets(exponential_buckets(0.00025, 2.0, 17)?),
            )?,
            tenants_owned: IntGauge::new(
                "relay_publisher_tenants_owned",
                "Tenants this publisher holds the lease of.",
            )?,
            backlog_tenants: IntGauge::new(
                "relay_publisher_backlog_tenants",
                "Tenants with unpublished changes, owned by any publisher or by none.",
            )?,
            broker_errors: IntCounterVec::new(
                Opts::new(
                    "relay_publisher_broker_errors_total",
                    "Broker failures (unreachable, closed, timed out), by stage.",
                ),
                &["stage"],
            )?,
            postgres_errors: IntCounterVec::new(
                Opts::new(
                    "relay_publisher_postgres_errors_total",
                    "Postgres failures (unreachable, timed out, no pooled connection free), by \
                     stage; each is retried.",
                ),
                &["stage"],
            )?,
            ownership_losses: counter(
                "relay_publisher_ownership_losses_total",
                "Tenants given up because their lease ran out or another publisher fenced \
                 this one out.",
            )?,
            changes_taken: IntCounterVec::new(
                Opts::new(
                    "relay_publisher_changes_taken_total",
                    "Changes taken to send, by where they were found: handed over by the \
                     sequencer of this process, or read from the outbox.",
                ),
                &["source"],
            )?,
            resent: counter(
                "relay_publisher_changes_resent_total",
                "Changes sent again, with every change of their endpoint sent after them, after a \
                 nack, a return or a lost channel (each resend counted).",
            )?,
            endpoint_in_flight: Histogram::with_opts(
                HistogramOpts::new(
                    "relay_publisher_endpoint_in_flight_changes",
                    "An endpoint's changes sent and not yet confirmed in turn, as each is sent \
                     (that one included).",
                )
                .buckets(exponential_buckets(1.0, 2.0, 11)?),
            )?,
        };
        for source in CHANGE_SOURCES {
            metrics.changes_taken.with_label_values(&[source]);
        }
        for stage in POSTGRES_STAGES {
            metrics.postgres_errors.with_label_values(&[stage]);
        }
        for stage in BROKER_STAGES {
            metrics.broker_errors.with_label_values(&[stage]);
        }
        registry.register(Box::new(metrics.published.clone()))?;
        registry.register(Box::new(metrics.confirmed.clone()))?;
        registry.register(Box::new(metrics.nacked.clone()))?;
        registry.register(Box::new(metrics.returned.clone()))?;
        registry.register(Box::new(metrics.marked.clone()))?;
        registry.register(Box::new(metrics.backlog.clone()))?;
        registry.register(Box::new(metrics.oldest_age.clone()))?;
        registry.register(Box::new(metrics.latency.clone()))?;
        registry.register(Box::new(metrics.confirm_wait.clone()))?;
        registry.register(Box::new(metrics.tenants_owned.clone()))?;
        registry.register(Box::new(metrics.backlog_tenants.clone()))?;
        registry.register(Box::new(metrics.broker_errors.clone()))?;
        registry.register(Box::new(metrics.postgres_errors.clone()))?;
        registry.register(Box::new(metrics.ownership_losses.clone()))?;
        registry.register(Box::new(metrics.changes_taken.clone()))?;
        registry.register(Box::new(metrics.resent.clone()))?;
        registry.register(Box::new(metrics.endpoint_in_flight.clone()))?;
        Ok(metrics)
    }

    pub(crate) fn forget_tenant(&self, tenant: &str) {
        let _ = self.backlog.remove_label_values(&[tenant]);
        let _ = self.oldest_age.remove_label_values(&[tenant]);
    }
}
