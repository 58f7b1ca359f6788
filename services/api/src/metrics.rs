//! The control plane's metrics, named by Prometheus' conventions (base units, `_total`
//! counters). Labels are route templates, never paths: paths hold ids, which would make a series
//! per endpoint.

use prometheus::{exponential_buckets, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

pub struct ApiMetrics {
    pub requests: IntCounterVec,
    pub request_seconds: HistogramVec,
    pub rewinds: IntCounterVec,
    /// Requests answered 429 by a caller's bound, by bound: `requests` (requests in flight per
    /// tenant, or the operators') or `rewinds` (rewinds in flight per tenant).
    pub throttled: IntCounterVec,
    /// Writes refused by a tenant's quota, by quota (`max_endpoints`).
    pub quota_refusals: IntCounterVec,
}

impl ApiMetrics {
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = prometheus::register_int_counter_vec_with_registry!(
            Opts::new(
                "relay_api_requests_total",
                "Control plane requests answered, by route template, method and status.",
            ),
            &["route", "method", "status"],
            registry
        )?;
        let request_seconds = prometheus::register_histogram_vec_with_registry!(
            HistogramOpts::new(
                "relay_api_request_duration_seconds",
                "Time to answer a control plane request, by route template and method.",
            )
            .buckets(exponential_buckets(0.001, 4.0, 8)?),
            &["route", "method"],
            registry
        )?;
        let rewinds = prometheus::register_int_counter_vec_with_registry!(
            Opts::new(
                "relay_api_rewinds_total",
                "Rewinds after a restore, by outcome: nothing, reload_begun, \
                 reload_already_running, upstream_failed.",
            ),
            &["outcome"],
            registry
        )?;
        let throttled = prometheus::register_int_counter_vec_with_registry!(
            Opts::new(
                "relay_api_throttled_total",
                "Requests answered 429 because their caller had as many in flight as it may, \
                 by bound: requests, rewinds.",
            ),
            &["bound"],
            registry
        )?;
        let quota_refusals = prometheus::register_int_counter_vec_with_registry!(
            Opts::new(
                "relay_api_quota_refusals_total",
                "Writes refused because the tenant's quota was reached, by quota: max_endpoints.",
            ),
            &["quota"],
            registry
        )?;
        Ok(Self {
            requests,
            request_seconds,
            rewinds,
            throttled,
            quota_refusals,
        })
    }
}
