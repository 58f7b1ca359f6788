//! The front tier's metrics, named by Prometheus' conventions (base units, `_total` counters).

use prometheus::{
    exponential_buckets, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts,
    Registry,
};

/// Every way a message can be answered, as the `outcome` label says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Accepted,
    AcceptedUnparsed,
    Duplicate,
    BadSignature,
    StaleTimestamp,
    TooLarge,
    UnknownEndpoint,
    Paused,
    Malformed,
    BodyTimeout,
    BodyBudgetSpent,
    RateLimited,
    EndpointMismatch,
    Unavailable,
}

impl Outcome {
    pub const ALL: [Outcome; 14] = [
        Outcome::Accepted,
        Outcome::AcceptedUnparsed,
        Outcome::Duplicate,
        Outcome::BadSignature,
        Outcome::StaleTimestamp,
        Outcome::TooLarge,
        Outcome::UnknownEndpoint,
        Outcome::Paused,
        Outcome::Malformed,
        Outcome::BodyTimeout,
        Outcome::BodyBudgetSpent,
        Outcome::RateLimited,
        Outcome::EndpointMismatch,
        Outcome::Unavailable,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Accepted => "accepted",
            Outcome::AcceptedUnparsed => "accepted_unparsed",
            Outcome::Duplicate => "duplicate",
            Outcome::BadSignature => "bad_signature",
            Outcome::StaleTimestamp => "stale_timestamp",
            Outcome::TooLarge => "too_large",
            Outcome::UnknownEndpoint => "unknown_endpoint",
            Outcome::Paused => "paused",
            Outcome::Malformed => "malformed",
            Outcome::BodyTimeout => "body_timeout",
            Outcome::BodyBudgetSpent => "body_budget_spent",
            Outcome::RateLimited => "rate_limited",
            Outcome::EndpointMismatch => "endpoint_mismatch",
            Outcome::Unavailable => "unavailable",
        }
    }
}

pub struct IngestMetrics {
    messages: IntCounterVec,
    body_bytes: Histogram,
    answer_seconds: HistogramVec,
    pub batch_messages: Histogram,
    pub batch_seconds: Histogram,
    pub cache_lookups: IntCounterVec,
    pub cache_entries: IntGauge,
}

impl IngestMetrics {
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let messages = prometheus::register_int_counter_vec_with_registry!(
            Opts::new(
                "relay_ingest_messages_total",
                "Webhook messages answered by the front tier, by outcome.",
            ),
            &["outcome"],
            registry
        )?;
        let body_bytes = prometheus::register_histogram_with_registry!(
            HistogramOpts::new(
                "relay_ingest_message_body_bytes",
                "Size of the webhook message bodies read in full.",
            )
            .buckets(exponential_buckets(256.0, 4.0, 8)?),
            registry
        )?;
        let answer_seconds = prometheus::register_histogram_vec_with_registry!(
            HistogramOpts::new(
                "relay_ingest_answer_duration_seconds",
                "Time from a request's arrival to its answer, by outcome.",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 15.0,
            ]),
            &["outcome"],
            registry
        )?;
        let batch_messages = prometheus::register_histogram_with_registry!(
            HistogramOpts::new(
                "relay_ingest_batch_messages",
                "Messages stored per shared transaction.",
            )
            .buckets(exponential_buckets(1.0, 2.0, 10)?),
            registry
        )?;
        let batch_seconds = prometheus::register_histogram_with_registry!(
            HistogramOpts::new(
                "relay_ingest_batch_duration_seconds",
                "Time to store one batch, from BEGIN to COMMIT.",
            )
            .buckets(exponential_buckets(0.0005, 2.0, 14)?),
            registry
        )?;
        let cache_lookups = prometheus::register_int_counter_vec_with_registry!(
            Opts::new(
                "relay_ingest_endpoint_cache_lookups_total",
                "Endpoint lookups, by whether the cache answered (hit) or Postgres did (miss).",
            ),
            &["result"],
            registry
        )?;
        let cache_entries = prometheus::register_int_gauge_with_registry!(
            "relay_ingest_endpoint_cache_entries",
            "Endpoints (known or unknown ids) held in the front tier's cache.",
            registry
        )?;
        // Every outcome is exported from the start, at zero, so dashboards and alerts see the
        // series before the first event of its kind.
        for outcome in Outcome::ALL {
            messages.with_label_values(&[outcome.label()]);
            answer_seconds.with_label_values(&[outcome.label()]);
        }
        for result in ["hit", "miss"] {
            cache_lookups.with_label_values(&[result]);
        }
        Ok(Self {
            messages,
            body_bytes,
            answer_seconds,
            batch_messages,
            batch_seconds,
            cache_lookups,
            cache_entries,
        })
    }

    pub fn answered(&self, outcome: Outcome, seconds: f64) {
        self.messages.with_label_values(&[outcome.label()]).inc();
        self.answer_seconds
            .with_label_values(&[outcome.label()])
            .observe(seconds);
    }

    pub fn body_read(&self, bytes: usize) {
        self.body_bytes.observe(bytes as f64);
    }
}
