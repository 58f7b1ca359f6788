//! The publisher's settings: [`PublisherConfig`] as the code takes it, [`PublisherArgs`] as the
//! command line and the `RELAY_*` environment give it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use relay_netguard::{RetryPolicy, TrustRoots};
use relay_rules::DestinationPolicy;
use uuid::Uuid;

/// How the publisher runs. [`Default`] is what [`PublisherArgs`] defaults to.
#[derive(Clone)]
pub struct PublisherConfig {
    /// The relay's own broker: where the tenants without a destination of their own get a
    /// durable quorum queue `relay.tenant.<tenant_id>`.
    pub amqp_url: String,
    /// Where a tenant's own-exchange destination may point; checked at every connect, after
    /// resolving its host. The relay's own broker is refused whatever this allows.
    pub destination_policy: DestinationPolicy,
    /// The roots TLS connections trust: `amqps://` brokers (the relay's and tenants' own),
    /// `rediss://`.
    pub trust: TrustRoots,
    /// Redis, for the per-tenant ownership leases.
    pub redis_url: String,
    /// Every Redis key starts with this (several relays, or tests, can share one Redis).
    pub key_prefix: String,
    /// How often Postgres is asked which tenants have unpublished changes (one query per
    /// process, however many tenants it owns), and each owned tenant with a backlog sweeps all
    /// its endpoints. The sequencer's announcements bring new changes at once; this finds what
    /// an announcement lost.
    pub poll_interval: Duration,
    /// How long a tenant's lease lasts without renewal (renewed every third of it). Keep it
    /// above `connect_timeout` plus `confirm_timeout`: one step of a tenant's loop may take both.
    pub lease: Duration,
    /// Most publishes of one tenant awaiting the broker's confirm at once, whichever endpoints
    /// they are of. Sixteen times this many changes are held in memory per tenant at most.
    pub max_in_flight: usize,
    /// Most changes of one endpoint sent before the first of them is confirmed (each endpoint's
    /// window; the tenant's `max_in_flight` bounds them all together). Twice this many (and at
    /// least 16) are read ahead per endpoint. 1 sends an endpoint's changes one at a time.
    pub endpoint_window: usize,
    /// Most tenants this process owns at once.
    pub max_tenants: usize,
    /// Connecting to a broker (TCP, TLS and the AMQP handshake) and declaring the queue.
    pub connect_timeout: Duration,
    /// Waiting for the broker's confirm of a publish.
    pub confirm_timeout: Duration,
    /// The first pause after broker trouble; doubled on each failure in a row, up to
    /// `retry_max`, each with jitter ([`PublisherConfig::retry`]).
    pub retry_min: Duration,
    pub retry_max: Duration,
    /// A tenant with no unpublished change for this long is released (its connection closed).
    pub idle_release: Duration,
    /// Confirmed changes are marked published at most this long after the first of them was
    /// confirmed (sooner when many wait): a mark moves one row per endpoint however many of its
    /// changes it covers. What a crash leaves confirmed and unmarked is sent again, under the
    /// same message ids (the stream is at least once), so this bounds how much that is.
    pub mark_interval: Duration,
    /// How often the backlog gauges of an owned tenant are refreshed (its endpoints' change
    /// counters against their publish cursors).
    pub metrics_interval: Duration,
    /// How often an owned tenant's destination row is read again (the control plane may change
    /// it); a changed destination closes the connection and opens one to the new place.
    pub destination_refresh: Duration,
    /// For tests and the benchmark: called with the (endpoint, change_seq) of a batch of
    /// confirmed publishes, awaited before they are marked published. A hook that never returns stands for a publisher that dies
    /// between the broker's confirm and the mark.
    pub before_mark: Option<BeforeMark>,
    /// For the benchmark: told of each change the moment its broker confirm is taken in.
    pub on_confirm: Option<OnConfirm>,
    /// This process's sequencer, when one runs here (`relay all`): the changes it commits for a
    /// tenant this publisher owns are handed over in memory, so they are not read back from
    /// the outbox (see the tenant loop's "Finding changes").
    pub changes_handoff: Option<relay_coord::Handoff<relay_store::changes::Unpublished>>,
}

impl PublisherConfig {
    /// The pauses after broker trouble (and Postgres trouble in a tenant's loop).
    pub fn retry(&self) -> RetryPolicy {
        RetryPolicy {
            first: self.retry_min,
            max: self.retry_max,
        }
    }
}

/// See [`PublisherConfig::before_mark`]: each confirmed change as (endpoint, change_seq).
#[derive(Clone)]
pub struct BeforeMark(pub Arc<dyn Fn(Vec<ChangeKey>) -> BoxFuture<'static, ()> + Send + Sync>);

/// A change of the outbox: its endpoint and change_seq (in the endpoint's current epoch).
pub type ChangeKey = (Uuid, i64);

impl fmt::Debug for BeforeMark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BeforeMark(..)")
    }
}

/// See [`PublisherConfig::on_confirm`]: called with the endpoint and the change_seq.
#[derive(Clone)]
pub struct OnConfirm(pub Arc<dyn Fn(Uuid, i64) + Send + Sync>);

impl fmt::Debug for OnConfirm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OnConfirm(..)")
    }
}

impl fmt::Debug for PublisherConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URLs may hold passwords: show them without.
        f.debug_struct("PublisherConfig")
            .field("amqp_url", &redact(&self.amqp_url))
            .field("destination_policy", &self.destination_policy)
            .field("trust", &self.trust)
            .field("redis_url", &redact(&self.redis_url))
            .field("key_prefix", &self.key_prefix)
            .field("poll_interval", &self.poll_interval)
            .field("lease", &self.lease)
            .field("max_in_flight", &self.max_in_flight)
            .field("endpoint_window", &self.endpoint_window)
            .field("max_tenants", &self.max_tenants)
            .field("connect_timeout", &self.connect_timeout)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("retry_min", &self.retry_min)
            .field("retry_max", &self.retry_max)
            .field("idle_release", &self.idle_release)
            .field("mark_interval", &self.mark_interval)
            .field("metrics_interval", &self.metrics_interval)
            .field("destination_refresh", &self.destination_refresh)
            .field("before_mark", &self.before_mark)
            .field("on_confirm", &self.on_confirm)
            .field("changes_handoff", &self.changes_handoff.is_some())
            .finish()
    }
}

/// A URL with any password replaced by `***`, for logs.
pub fn redact(url: &str) -> String {
    // A broker setting may list a cluster's nodes, each a URL with its own password.
    if url.contains(',') {
        return url.split(',').map(redact).collect::<Vec<_>>().join(",");
    }
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Each setting's default, written once: [`PublisherConfig::default`] and [`PublisherArgs`]
/// both take them from here.
mod defaults {
    pub const POLL_MS: u64 = 500;
    pub const LEASE_MS: u64 = 15_000;
    pub const MAX_IN_FLIGHT: usize = 256;
    pub const ENDPOINT_WINDOW: usize = 64;
    pub const MAX_TENANTS: usize = 1024;
    pub const CONNECT_TIMEOUT_MS: u64 = 5_000;
    pub const CONFIRM_TIMEOUT_MS: u64 = 5_000;
    /// The first pause after broker trouble (the longest pause, when shorter, replaces it).
    pub const RETRY_MIN_MS: u64 = 100;
    pub const RETRY_MAX_MS: u64 = 5_000;
    pub const IDLE_RELEASE_MS: u64 = 30_000;
    pub const MARK_INTERVAL_MS: u64 = 1_000;
}

/// The same values as [`PublisherArgs`]' defaults (without reading the environment).
impl Default for PublisherConfig {
    fn default() -> Self {
        let ms = Duration::from_millis;
        PublisherConfig {
            amqp_url: DEFAULT_AMQP_URL.to_owned(),
            destination_policy: DestinationPolicy::default(),
            trust: TrustRoots::platform(),
            redis_url: relay_coord::DEFAULT_REDIS_URL.to_owned(),
            key_prefix: relay_coord::DEFAULT_KEY_PREFIX.to_owned(),
            poll_interval: ms(defaults::POLL_MS),
            lease: ms(defaults::LEASE_MS),
            max_in_flight: defaults::MAX_IN_FLIGHT,
            endpoint_window: defaults::ENDPOINT_WINDOW,
            max_tenants: defaults::MAX_TENANTS,
            connect_timeout: ms(defaults::CONNECT_TIMEOUT_MS),
            confirm_timeout: ms(defaults::CONFIRM_TIMEOUT_MS),
            retry_min: ms(defaults::RETRY_MIN_MS),
            retry_max: ms(defaults::RETRY_MAX_MS),
            idle_release: ms(defaults::IDLE_RELEASE_MS),
            mark_interval: ms(defaults::MARK_INTERVAL_MS),
            metrics_interval: Duration::from_secs(1),
            destination_refresh: Duration::from_secs(10),
            before_mark: None,
            on_confirm: None,
            changes_handoff: None,
        }
    }
}

/// The publisher's flags, each with its `RELAY_*` environment variable. The database is not
/// here: the caller passes a pool.
#[derive(Debug, Clone, clap::Args)]
pub struct PublisherArgs {
    /// The relay's own RabbitMQ: tenants without a destination of their own get a durable
    /// quorum queue `relay.tenant.<tenant_id>` there.
    #[arg(long, env = "RELAY_AMQP_URL", default_value = DEFAULT_AMQP_URL, hide_env_values = true)]
    pub amqp_url: String,

    #[command(flatten)]
    pub destinations: DestinationArgs,

    /// Redis, for the per-tenant ownership leases. Not a flag of its own: the `relay` binary
    /// sets it from its global `--redis-url` (RELAY_REDIS_URL), which every tier shares.
    #[arg(skip = relay_coord::DEFAULT_REDIS_URL.to_owned())]
    pub redis_url: String,

    /// Prefix of every Redis key and channel the publisher uses. Not a flag of its own: the
    /// `relay` binary sets it from its global `--redis-key-prefix` (RELAY_REDIS_KEY_PREFIX), so
    /// the publisher hears the sequencer's announcements of new changes on the same prefix.
    #[arg(skip = relay_coord::DEFAULT_KEY_PREFIX.to_owned())]
    pub publisher_key_prefix: String,

    /// How often Postgres is asked which tenants have unpublished changes, in milliseconds
    /// (one cheap query per process). The sequencer announces new changes through Redis, so
    /// this is the safety net: the longest a change waits when an announcement was lost.
    #[arg(long, env = "RELAY_PUBLISHER_POLL_MS", default_value_t = defaults::POLL_MS)]
    pub publisher_poll_ms: u64,

    /// A tenant's ownership lease, in milliseconds: another publisher takes the tenant over
    /// this long after its owner stopped renewing. Keep it above the connect timeout plus the
    /// confirm timeout.
    #[arg(long, env = "RELAY_PUBLISHER_LEASE_MS", default_value_t = defaults::LEASE_MS,
          value_parser = clap::value_parser!(u64).range(300..))]
    pub publisher_lease_ms: u64,

    /// Most publishes of one tenant awaiting the broker's confirm at once (all its endpoints
    /// together).
    #[arg(long, env = "RELAY_PUBLISHER_MAX_IN_FLIGHT", default_value_t = defaults::MAX_IN_FLIGHT as u64,
          value_parser = clap::value_parser!(u64).range(1..=65_535))]
    pub publisher_max_in_flight: u64,

    /// Most changes of one endpoint sent before the first of them is confirmed; still in
    /// change_seq order, and after a nack, a return or a lost connection sent again from the
    /// change in trouble on. 1: one change at a time.
    #[arg(long, env = "RELAY_PUBLISHER_ENDPOINT_WINDOW", default_value_t = defaults::ENDPOINT_WINDOW as u64,
          value_parser = clap::value_parser!(u64).range(1..=65_535))]
    pub publisher_endpoint_window: u64,

    /// Most tenants one publisher process owns at once.
    #[arg(long, env = "RELAY_PUBLISHER_MAX_TENANTS", default_value_t = defaults::MAX_TENANTS)]
    pub publisher_max_tenants: usize,

    /// Timeout for connecting to a broker and declaring the queue, in milliseconds.
    #[arg(
        long,
        env = "RELAY_PUBLISHER_CONNECT_TIMEOUT_MS",
        default_value_t = defaults::CONNECT_TIMEOUT_MS
    )]
    pub publisher_connect_timeout_ms: u64,

    /// Timeout for the broker's confirm of a publish, in milliseconds.
    #[arg(
        long,
        env = "RELAY_PUBLISHER_CONFIRM_TIMEOUT_MS",
        default_value_t = defaults::CONFIRM_TIMEOUT_MS
    )]
    pub publisher_confirm_timeout_ms: u64,

    /// Longest pause between retries after broker trouble, in milliseconds (the first is 100),
    /// before jitter, which adds up to as much again.
    #[arg(long, env = "RELAY_PUBLISHER_RETRY_MAX_MS", default_value_t = defaults::RETRY_MAX_MS)]
    pub publisher_retry_max_ms: u64,

    /// A tenant with nothing to publish for this many milliseconds is released.
    #[arg(
        long,
        env = "RELAY_PUBLISHER_IDLE_RELEASE_MS",
        default_value_t = defaults::IDLE_RELEASE_MS
    )]
    pub publisher_idle_release_ms: u64,

    /// Confirmed changes are recorded as published at most this many milliseconds after the
    /// first of them was confirmed (each record moves one row per endpoint, whatever it covers).
    /// A publisher that stops abruptly sends what it had not recorded again, under the same
    /// message ids.
    #[arg(
        long,
        env = "RELAY_PUBLISHER_MARK_INTERVAL_MS",
        default_value_t = defaults::MARK_INTERVAL_MS
    )]
    pub publisher_mark_interval_ms: u64,
}

/// Where tenants' own-exchange destinations may point: read by the publisher (at every
/// connect) and the control plane (when a destination is set).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DestinationArgs {
    /// Hosts a tenant's own-exchange destination may name, comma-separated: `broker.example.com`
    /// or `*.example.com` (any name below it). Empty: any host that resolves to public
    /// addresses. The relay's own broker is refused whatever this allows.
    #[arg(long, env = "RELAY_DESTINATION_ALLOWED_HOSTS", value_delimiter = ',')]
    pub destination_allowed_hosts: Vec<String>,

    /// Let destinations resolve to loopback, private, link-local and other non-public
    /// addresses (tenants' brokers on the relay's own network; tests on one machine). The
    /// relay's own broker stays refused.
    #[arg(long, env = "RELAY_DESTINATION_ALLOW_PRIVATE", default_value_t = false)]
    pub destination_allow_private: bool,
}

impl DestinationArgs {
    pub fn policy(&self) -> DestinationPolicy {
        DestinationPolicy {
            allowed_hosts: self
                .destination_allowed_hosts
                .iter()
                .map(|host| host.trim().to_owned())
                .filter(|host| !host.is_empty())
                .collect(),
            allow_private: self.destination_allow_private,
        }
    }
}

impl PublisherArgs {
    pub fn config(&self) -> PublisherConfig {
        let ms = Duration::from_millis;
        PublisherConfig {
            amqp_url: self.amqp_url.clone(),
            destination_policy: self.destinations.policy(),
            redis_url: self.redis_url.clone(),
            key_prefix: self.publisher_key_prefix.clone(),
            poll_interval: ms(self.publisher_poll_ms.max(1)),
            lease: ms(self.publisher_lease_ms),
            max_in_flight: self.publisher_max_in_flight as usize,
            endpoint_window: self.publisher_endpoint_window as usize,
            max_tenants: self.publisher_max_tenants.max(1),
            connect_timeout: ms(self.publisher_connect_timeout_ms),
            confirm_timeout: ms(self.publisher_confirm_timeout_ms),
            retry_min: ms(defaults::RETRY_MIN_MS.min(self.publisher_retry_max_ms)),
            retry_max: ms(self.publisher_retry_max_ms),
            idle_release: ms(self.publisher_idle_release_ms),
            mark_interval: ms(self.publisher_mark_interval_ms),
            ..PublisherConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flags_default_to_the_default_config() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: PublisherArgs,
        }
        let args = Cli::try_parse_from(["relay"]).unwrap().args;
        assert_eq!(
            format!("{:?}", args.config()),
            format!("{:?}", PublisherConfig::default())
        );
    }

    #[test]
    fn passwords_are_not_logged() {
        assert_eq!(
            redact("amqp://user:secret@host:5672/%2f"),
            "amqp://user:***@host:5672/%2f"
        );
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
    }
}
