//! The control plane's metrics, named by Prometheus' conventions (base units, `_total`
//! counters). Labels are route templates, never paths: paths hold ids, which would make a series
//! per endpoint.

use prometheus::{exponential_buckets, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

pub struct ApiMetrics {
    pub requests: IntCounterVec,
    pub request_seconds: HistogramVec,
    pub rewinds: IntCounterVec,
}

impl ApiMetrics {
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "relay_api_requests_total",
                "Control plane requests answered, by route template, method and status.",
            ),
            &["route", "method", "status"],
        )?;
        let request_seconds = HistogramVec::new(
            HistogramOpts::new(
                "relay_api_request_duration_seconds",
                "Time to answer a control plane request, by route template and method.",
            )
            .buckets(exponential_buckets(0.001, 4.0, 8)?),
            &["route", "method"],
        )?;
        let rewinds = IntCounterVec::new(
            Opts::new(
                "relay_api_rewinds_total",
                "Rewinds after a restore, by outcome: nothing, reload_begun, \
                 reload_already_running, upstream_failed.",
            ),
            &["outcome"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(request_seconds.clone()))?;
        registry.register(Box::new(rewinds.clone()))?;
        Ok(Self {
            requests,
            request_seconds,
            rewinds,
        })
    }
}
