//! The listeners' metrics: connections held and bounded, what was refused and why, and the body
//! bytes in flight.

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// Registered once per registry; every listener of the process labels its series by name.
#[derive(Clone)]
pub struct ListenerMetrics {
    pub(crate) connections: IntGaugeVec,
    pub(crate) max_connections: IntGaugeVec,
    pub(crate) refused: IntCounterVec,
    pub(crate) accept_failures: IntCounterVec,
    pub(crate) body_bytes_in_flight: IntGauge,
}

/// Why a connection or request was refused, as `relay_listener_refused_total{reason}` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The listener serves `max_connections` already.
    TooManyConnections,
    /// The client holds `max_connections_per_client` connections already.
    ClientConnections,
    /// The client holds `max_headless_per_address` connections without a request head.
    Headless,
    /// The client (named by X-Forwarded-For) has `max_connections_per_client` requests in flight.
    ClientRequests,
    /// The body did not fit in the body budget.
    BodyBudget,
    /// A trusted proxy's connection did not begin with a readable PROXY protocol v2 header.
    ProxyHeader,
}

impl Refusal {
    const ALL: [Refusal; 6] = [
        Refusal::TooManyConnections,
        Refusal::ClientConnections,
        Refusal::Headless,
        Refusal::ClientRequests,
        Refusal::BodyBudget,
        Refusal::ProxyHeader,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Refusal::TooManyConnections => "too_many_connections",
            Refusal::ClientConnections => "client_connections",
            Refusal::Headless => "headless",
            Refusal::ClientRequests => "client_requests",
            Refusal::BodyBudget => "body_budget",
            Refusal::ProxyHeader => "proxy_header",
        }
    }
}

/// How `accept` failed, as `relay_listener_accept_failures_total{error}` says.
pub(crate) fn accept_failure_label(error: &std::io::Error) -> &'static str {
    match error.raw_os_error() {
        Some(libc::EMFILE) => "emfile",
        Some(libc::ENFILE) => "enfile",
        _ => "other",
    }
}

const ACCEPT_FAILURE_LABELS: [&str; 3] = ["emfile", "enfile", "other"];

impl ListenerMetrics {
    /// Shows the listener `name` with its bound, and every refusal and accept failure it can
    /// count at zero, so that a rate over them is 0 rather than absent before the first one.
    pub(crate) fn show_listener(&self, name: &str, max_connections: usize) {
        self.max_connections
            .with_label_values(&[name])
            .set(i64::try_from(max_connections).unwrap_or(i64::MAX));
        self.connections.with_label_values(&[name]);
        for refusal in Refusal::ALL {
            self.refused.with_label_values(&[name, refusal.label()]);
        }
        for error in ACCEPT_FAILURE_LABELS {
            self.accept_failures.with_label_values(&[name, error]);
        }
    }

    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let connections = prometheus::register_int_gauge_vec_with_registry!(
            Opts::new(
                "relay_listener_connections",
                "Connections each listener serves now",
            ),
            &["listener"],
            registry
        )?;
        let max_connections = prometheus::register_int_gauge_vec_with_registry!(
            Opts::new(
                "relay_listener_max_connections",
                "Each listener's bound on connections, as fitted to the open-file limit",
            ),
            &["listener"],
            registry
        )?;
        let refused = prometheus::register_int_counter_vec_with_registry!(
            Opts::new(
                "relay_listener_refused_total",
                "Connections and requests refused by a listener's bounds, by reason",
            ),
            &["listener", "reason"],
            registry
        )?;
        let accept_failures = prometheus::register_int_counter_vec_with_registry!(
            Opts::new(
                "relay_listener_accept_failures_total",
                "Connections a listener could not accept (out of file descriptors: EMFILE), by \
                 error",
            ),
            &["listener", "error"],
            registry
        )?;
        let body_bytes_in_flight = prometheus::register_int_gauge_with_registry!(
            "relay_listener_body_bytes_in_flight",
            "Request body bytes the process holds while reading them (all listeners)",
            registry
        )?;
        Ok(Self {
            connections,
            max_connections,
            refused,
            accept_failures,
            body_bytes_in_flight,
        })
    }
}
