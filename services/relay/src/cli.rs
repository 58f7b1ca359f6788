//! The command line. Every setting is a flag with a `RELAY_*` environment variable and a default
//! that works on a development machine with Postgres on 127.0.0.1; `relay --help` and
//! `relay <command> --help` list them.

use std::net::SocketAddr;

use clap::builder::TypedValueParser as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
use relay_ingest::defaults as ingest;
use relay_sequencer::defaults as sequencer;

#[derive(Debug, Parser)]
#[command(
    name = "relay",
    version,
    about = "A multi-tenant hosted receiver for Quanor's webhooks.",
    long_about = "A multi-tenant hosted receiver for Quanor's webhooks: verifies and durably \
                  stores every message, keeps each endpoint's copy of the feed in Postgres, and \
                  pushes the changes to each tenant's queue.\n\nEvery option can also be set \
                  with the environment variable shown beside it."
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Args)]
pub struct GlobalArgs {
    /// Postgres connection URL.
    #[arg(
        long,
        env = "RELAY_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/relay",
        global = true
    )]
    pub database_url: String,

    /// Most Postgres connections this process opens.
    #[arg(
        long,
        env = "RELAY_DATABASE_MAX_CONNECTIONS",
        default_value_t = 10,
        global = true
    )]
    pub database_max_connections: u32,

    /// Redis URL: the sequencers' endpoint locks and the front tier's wake-ups.
    #[arg(
        long,
        env = "RELAY_REDIS_URL",
        default_value = relay_coord::DEFAULT_REDIS_URL,
        global = true
    )]
    pub redis_url: String,

    /// Prefix of every Redis key and channel this deployment uses, so several deployments
    /// (or tests) can share one Redis.
    #[arg(
        long,
        env = "RELAY_REDIS_KEY_PREFIX",
        default_value = relay_coord::DEFAULT_KEY_PREFIX,
        global = true
    )]
    pub redis_key_prefix: String,

    /// Log format: `text` for people, `json` for log collectors. Levels follow RUST_LOG
    /// (default `info`).
    #[arg(long, env = "RELAY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,

    /// Endpoints a tenant may register, unless the operator set its own
    /// (`PUT /v1/tenants/{id}/quotas`).
    #[arg(
        long,
        env = "RELAY_QUOTA_MAX_ENDPOINTS",
        default_value_t = relay_store::quotas::DEFAULT_MAX_ENDPOINTS,
        value_parser = clap::value_parser!(u32).range(1..=i64::from(relay_store::quotas::MAX_QUOTA)),
        global = true
    )]
    pub quota_max_endpoints: u32,

    /// Messages per second the front tier takes for one tenant's endpoints together, unless the
    /// operator set the tenant's own (`PUT /v1/tenants/{id}/quotas`).
    #[arg(
        long,
        env = "RELAY_QUOTA_MESSAGES_PER_SECOND",
        default_value_t = relay_store::quotas::DEFAULT_MESSAGES_PER_SECOND,
        value_parser = clap::value_parser!(u32).range(1..=i64::from(relay_store::quotas::MAX_QUOTA)),
        global = true
    )]
    pub quota_messages_per_second: u32,

    /// Where the sequencer and the control plane may send requests on a tenant's behalf.
    #[command(flatten)]
    pub outbound: relay_netguard::OutboundArgs,

    /// Whom every TLS connection trusts (upstream, brokers, Postgres, Redis).
    #[command(flatten)]
    pub tls: relay_netguard::TlsArgs,

    /// What the process's listeners share: the trusted proxies and the body budget.
    #[command(flatten)]
    pub listeners: relay_listener::SharedArgs,

    /// The keys that seal secrets at rest.
    #[command(flatten)]
    pub seal: SealArgs,
}

/// The key-encryption keys every stored secret (signing secrets, upstream API keys, own
/// brokers' URLs) is sealed under. Keep them outside the database and its backups: a backup
/// restored without them opens no secret.
#[derive(Clone, Args)]
pub struct SealArgs {
    /// A file of key-encryption keys, one `<id>=<base64 of 32 random bytes>` per line (`relay
    /// keys generate` prints one): the first seals every new value, the others only open what
    /// they sealed until `relay keys rotate` re-seals it under the first.
    #[arg(long, env = "RELAY_SEAL_KEYS_FILE", global = true)]
    pub seal_keys_file: Option<std::path::PathBuf>,

    /// The same entries in the environment (separated by newlines, commas or spaces), when no
    /// file is given.
    #[arg(long, env = "RELAY_SEAL_KEYS", global = true, hide_env_values = true)]
    pub seal_keys: Option<String>,
}

impl SealArgs {
    /// The keys given, or an error that says what to set.
    pub fn keyring(&self) -> anyhow::Result<relay_store::Keyring> {
        use anyhow::Context as _;
        let text = match (&self.seal_keys_file, &self.seal_keys) {
            (Some(_), Some(_)) => {
                anyhow::bail!("both RELAY_SEAL_KEYS_FILE and RELAY_SEAL_KEYS are set: keep one")
            }
            (Some(path), None) => zeroize::Zeroizing::new(
                std::fs::read_to_string(path)
                    .with_context(|| format!("reading RELAY_SEAL_KEYS_FILE {}", path.display()))?,
            ),
            (None, Some(text)) => zeroize::Zeroizing::new(text.clone()),
            (None, None) => zeroize::Zeroizing::new(String::new()),
        };
        let keys = relay_seal::LocalKeys::parse(&text)?;
        Ok(relay_store::Keyring::new(std::sync::Arc::new(keys)))
    }
}

impl SealArgs {
    /// The same settings as environment variables, for a process this one starts.
    pub fn environment(&self) -> Vec<(&'static str, std::ffi::OsString)> {
        let mut environment = Vec::new();
        if let Some(path) = &self.seal_keys_file {
            environment.push(("RELAY_SEAL_KEYS_FILE", path.clone().into_os_string()));
        }
        if let Some(keys) = &self.seal_keys {
            environment.push(("RELAY_SEAL_KEYS", keys.into()));
        }
        environment
    }
}

// By hand: the keys themselves are secrets.
impl std::fmt::Debug for SealArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SealArgs")
            .field("seal_keys_file", &self.seal_keys_file)
            .field("seal_keys", &self.seal_keys.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl GlobalArgs {
    /// The roots every TLS client trusts: the platform's and the operator's CA file.
    pub fn trust(&self) -> anyhow::Result<relay_netguard::TrustRoots> {
        self.tls.trust().map_err(anyhow::Error::from)
    }

    /// The operator's default quotas, which every tier reads (a tenant's overrides replace
    /// them).
    pub fn quota_defaults(&self) -> relay_store::quotas::QuotaDefaults {
        relay_store::quotas::QuotaDefaults {
            max_endpoints: self.quota_max_endpoints,
            messages_per_second: self.quota_messages_per_second,
        }
    }
}

// By hand: the URLs may hold passwords.
impl std::fmt::Debug for GlobalArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use relay_publisher::redact;
        f.debug_struct("GlobalArgs")
            .field("database_url", &redact(&self.database_url))
            .field("database_max_connections", &self.database_max_connections)
            .field("redis_url", &redact(&self.redis_url))
            .field("redis_key_prefix", &self.redis_key_prefix)
            .field("log_format", &self.log_format)
            .field("quota_max_endpoints", &self.quota_max_endpoints)
            .field("quota_messages_per_second", &self.quota_messages_per_second)
            .field("outbound", &self.outbound)
            .field("tls", &self.tls)
            .field("listeners", &self.listeners)
            .field("seal", &self.seal)
            .finish()
    }
}

impl Cli {
    /// Parses the command line (and the environment) as [`command`] describes it.
    pub fn parse_env() -> Self {
        use clap::FromArgMatches as _;
        let matches = command().get_matches();
        Self::from_arg_matches(&matches).unwrap_or_else(|error| error.exit())
    }
}

/// The command line, with no environment variable's value shown in any `--help`: the values of
/// RELAY_DATABASE_URL, RELAY_REDIS_URL and RELAY_AMQP_URL hold passwords, and a setting added
/// later may hold one too, so none is shown (only its name).
pub fn command() -> clap::Command {
    fn hide(command: clap::Command) -> clap::Command {
        command
            .mut_args(|arg| arg.hide_env_values(true))
            .mut_subcommands(hide)
    }
    hide(<Cli as clap::CommandFactory>::command())
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// See the relay work: a database of its own, every tier in this process and the simulated
    /// upstream with faults; a tenant and its endpoints registered through the API; live
    /// progress; then the verdict: each copy, and each copy rebuilt from the tenant's queue,
    /// against the simulator's truth.
    Demo(Box<crate::demo::DemoArgs>),
    /// Create the database if it does not exist and apply every pending migration.
    Migrate,
    /// Run once on a database restored from a backup, before any tier starts on it
    /// (docs/restore.md): every endpoint holds the backup's position for its rewind and begins
    /// a new epoch of its change stream, opened by a snapshot of its copy.
    Restored,
    /// Run the front tier: take webhook messages, verify, store, answer.
    Ingest(IngestArgs),
    /// Run the sequencer: apply each endpoint's stored messages, in order, into its copy; run
    /// reloads and refetches against the upstream's API.
    Sequencer(SequencerCommand),
    /// Run the publisher: send each endpoint's changes, in order and confirmed, to its tenant's
    /// RabbitMQ destination.
    Publisher(PublisherCommand),
    /// Run the control plane: the `/v1` HTTP API for operators and tenants (JWT auth).
    Api(ApiCommand),
    /// Read a tenant's queue, rebuild the copy from its change messages and print it.
    Tail(relay_publisher::TailArgs),
    /// Mint JWTs for the control plane.
    #[command(subcommand)]
    Token(TokenCommand),
    /// The keys that seal secrets at rest: make one, see what each seals, re-seal every value
    /// under the current one.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Migrate, then run every tier in this one process (metrics of all on one listener). The
    /// control plane runs when a JWT key is configured.
    All(Box<AllArgs>),
    /// Send correctly signed messages to a running front tier and report throughput and latency.
    Loadgen(crate::loadgen::LoadgenArgs),
    /// The sequencer's benchmarks (they drop and create RELAY_DATABASE_URL's database).
    #[command(subcommand)]
    Bench(crate::bench::BenchCommand),
    /// Play the upstream (Quanor): its REST API, a webhook sender per endpoint with the wire
    /// file's retry rules, seeded faults and a random workload, against any receiver URL.
    Simulate(SimulateCommand),
}

#[derive(Debug, Args)]
pub struct SimulateCommand {
    #[command(flatten)]
    pub args: relay_simulator::SimulateArgs,
    #[command(flatten)]
    pub tls: relay_simulator::ApiTlsArgs,
    /// First register the simulated tenants and endpoints (ids, secrets, API keys, and the
    /// API's address, so give `--listen` a fixed port) in RELAY_DATABASE_URL, so a relay using
    /// that database takes their messages.
    #[arg(long)]
    pub register: bool,
}

#[derive(Debug, Clone, Args)]
pub struct IngestArgs {
    /// Address the webhook receiver listens on.
    #[arg(long, env = "RELAY_INGEST_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,

    /// Address `/metrics` (Prometheus text format) is served on. Keep it off the public
    /// interface: it is for your scraper, not for the upstream.
    #[arg(long, env = "RELAY_METRICS_LISTEN", default_value = "127.0.0.1:9464")]
    pub metrics_listen: SocketAddr,

    /// Largest body accepted, in bytes (the wire file's max_body_bytes is 1048576).
    #[arg(long, env = "RELAY_INGEST_MAX_BODY_BYTES", default_value_t = relay_wire::limits::MAX_BODY_BYTES)]
    pub max_body_bytes: usize,

    /// Every message is answered within this many milliseconds; one not committed by then
    /// gets 503. Must stay under the upstream's 15 s send timeout.
    #[arg(long, env = "RELAY_INGEST_ANSWER_DEADLINE_MS", default_value_t = ingest::ANSWER_DEADLINE_MS,
          value_parser = clap::value_parser!(u64).range(100..=14_000))]
    pub answer_deadline_ms: u64,

    /// Retry-After, in seconds, sent with a 503.
    #[arg(long, env = "RELAY_INGEST_RETRY_AFTER_S", default_value_t = ingest::RETRY_AFTER_S)]
    pub retry_after_s: u64,

    /// Concurrent batch writers (each uses one Postgres connection while writing).
    #[arg(long, env = "RELAY_INGEST_WRITERS", default_value_t = ingest::WRITERS)]
    pub writers: usize,

    /// Most messages stored per transaction.
    #[arg(long, env = "RELAY_INGEST_BATCH_MAX_MESSAGES", default_value_t = ingest::BATCH_MAX_MESSAGES)]
    pub batch_max_messages: usize,

    /// Microseconds a transaction may wait for more messages to share its commit: while one is
    /// being verified, or while they arrive closer together than this (0: never).
    #[arg(long, env = "RELAY_INGEST_BATCH_LINGER_US", default_value_t = ingest::BATCH_LINGER_US,
          value_parser = clap::value_parser!(u64).range(0..=100_000))]
    pub batch_linger_us: u64,

    /// Seconds an endpoint's secrets and status stay cached while change notifications flow
    /// (0 disables the cache).
    #[arg(long, env = "RELAY_INGEST_ENDPOINT_CACHE_TTL_S", default_value_t = ingest::ENDPOINT_CACHE_TTL_S)]
    pub endpoint_cache_ttl_s: u64,

    /// Most endpoints held in the cache; unknown ids count too, so a scan of random ids cannot
    /// grow memory without limit.
    #[arg(
        long,
        env = "RELAY_INGEST_ENDPOINT_CACHE_MAX_ENTRIES",
        default_value_t = ingest::ENDPOINT_CACHE_MAX_ENTRIES
    )]
    pub endpoint_cache_max_entries: usize,

    /// Milliseconds a request's head may take to arrive (from the connection's opening or its
    /// previous answer); a slower connection is closed.
    #[arg(long, env = "RELAY_INGEST_HEADER_READ_TIMEOUT_MS",
          default_value_t = relay_ingest::LISTENER_LIMITS.header_read_timeout.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub header_read_timeout_ms: u64,

    /// Milliseconds a request's body may take to arrive after its head; a slower one is
    /// answered 408 and its connection closed. Keep it under the answer deadline.
    #[arg(long, env = "RELAY_INGEST_BODY_READ_TIMEOUT_MS",
          default_value_t = relay_ingest::LISTENER_LIMITS.body_read_timeout.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub body_read_timeout_ms: u64,

    /// Webhook connections served at once; one more is answered 503 with Retry-After and
    /// closed. Keep the process's open-file limit (LimitNOFILE) well above it.
    #[arg(long, env = "RELAY_INGEST_MAX_CONNECTIONS",
          default_value_t = relay_ingest::LISTENER_LIMITS.max_connections,
          value_parser = clap::value_parser!(u32).range(1..).map(|n| n as usize))]
    pub max_connections: usize,

    /// Webhook connections from one client that have not sent a complete request head yet;
    /// one more from that client is answered 503 with Retry-After and closed. The upstream
    /// sends its head at once, so this bounds only slow clients.
    #[arg(long, env = "RELAY_INGEST_MAX_HEADLESS_PER_ADDRESS",
          default_value_t = relay_ingest::LISTENER_LIMITS.max_headless_per_address,
          value_parser = clap::value_parser!(u32).range(1..).map(|n| n as usize))]
    pub max_headless_per_address: usize,

    /// Webhook connections one client holds at once, whatever they do; one more from it is
    /// answered 503 with Retry-After and closed. With `x-forwarded-for`, the client's requests
    /// in flight instead (429 past it).
    #[arg(long, env = "RELAY_INGEST_MAX_CONNECTIONS_PER_CLIENT",
          default_value_t = relay_ingest::LISTENER_LIMITS.max_connections_per_client,
          value_parser = clap::value_parser!(u32).range(1..).map(|n| n as usize))]
    pub max_connections_per_client: usize,

    /// Milliseconds a kept-alive webhook connection waits for its next request (a new one for
    /// its first) before it is closed; the head read timeout, when shorter, closes it too.
    #[arg(long, env = "RELAY_INGEST_IDLE_TIMEOUT_MS",
          default_value_t = relay_ingest::LISTENER_LIMITS.idle_timeout.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout_ms: u64,

    /// Where a webhook client's address comes from: `peer` (who connected), `proxy-protocol`
    /// (a PROXY protocol v2 header from a proxy in RELAY_TRUSTED_PROXIES) or `x-forwarded-for`
    /// (that header, from a proxy in RELAY_TRUSTED_PROXIES).
    #[arg(long, env = "RELAY_INGEST_CLIENT_ADDRESS", default_value = "peer")]
    pub client_address: relay_listener::ClientAddressFrom,
}

#[derive(Debug, Clone, Args)]
pub struct SequencerArgs {
    /// Milliseconds an endpoint's lock lasts unless renewed (renewed every third of it). A
    /// worker that stalls longer loses the endpoint; its fencing token stops its writes.
    #[arg(long, env = "RELAY_SEQUENCER_LEASE_MS", default_value_t = sequencer::LEASE_MS,
          value_parser = clap::value_parser!(u64).range(300..))]
    pub lease_ms: u64,

    /// Endpoints worked at once by this process (each reads its messages on a connection of
    /// its own, and hands them to the appliers' shared transactions).
    #[arg(
        long,
        env = "RELAY_SEQUENCER_MAX_CONCURRENT_ENDPOINTS",
        default_value_t = sequencer::MAX_CONCURRENT_ENDPOINTS
    )]
    pub max_concurrent_endpoints: usize,

    /// The most of those endpoints one tenant's may be, as a fraction (0 to 1, at least one
    /// endpoint): a tenant with many endpoints, or a hanging upstream, leaves the rest to others.
    #[arg(
        long,
        env = "RELAY_SEQUENCER_MAX_TENANT_SHARE",
        default_value_t = sequencer::MAX_TENANT_SHARE
    )]
    pub max_tenant_share: f64,

    /// Tries of a stored message whose apply fails (with jittered exponential backoff, the
    /// endpoint's slot given back between them) before it is quarantined and the feed read again.
    #[arg(
        long,
        env = "RELAY_SEQUENCER_APPLY_ATTEMPTS",
        default_value_t = sequencer::APPLY_ATTEMPTS,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub apply_attempts: u32,

    /// Apply transactions open at once, for each source kind; each applies the endpoints' runs
    /// of its kind that gathered while the others committed.
    #[arg(long, env = "RELAY_SEQUENCER_APPLIERS", default_value_t = sequencer::APPLIERS)]
    pub appliers: usize,

    /// Microseconds an apply transaction may wait for more endpoints' runs, while runs are on
    /// their way or arriving closer together than this (0: never).
    #[arg(long, env = "RELAY_SEQUENCER_APPLY_LINGER_US", default_value_t = sequencer::APPLY_LINGER_US,
          value_parser = clap::value_parser!(u64).range(0..=100_000))]
    pub apply_linger_us: u64,

    /// Endpoints' runs applied in one transaction at most.
    #[arg(
        long,
        env = "RELAY_SEQUENCER_RUNS_PER_TRANSACTION",
        default_value_t = sequencer::RUNS_PER_TRANSACTION
    )]
    pub runs_per_transaction: usize,

    /// No more endpoints' runs join an apply transaction once it holds this many messages.
    #[arg(
        long,
        env = "RELAY_SEQUENCER_MESSAGES_PER_TRANSACTION",
        default_value_t = sequencer::MESSAGES_PER_TRANSACTION
    )]
    pub messages_per_transaction: usize,

    /// Stored messages read at a time per endpoint.
    #[arg(long, env = "RELAY_SEQUENCER_MESSAGES_PER_READ", default_value_t = sequencer::MESSAGES_PER_READ)]
    pub messages_per_read: i64,

    /// Milliseconds between sweeps of Postgres for endpoints with work (the safety net under
    /// the Redis wake-ups).
    #[arg(
        long,
        env = "RELAY_SEQUENCER_SWEEP_INTERVAL_MS",
        default_value_t = sequencer::SWEEP_INTERVAL_MS
    )]
    pub sweep_interval_ms: u64,

    /// Milliseconds an idle worker keeps its endpoint before letting go. Taking an endpoint
    /// costs a lock, a fencing-token commit and a few reads; an endpoint that gets a message
    /// every minute should not pay that per message. A lingering worker holds no database
    /// connection and no concurrency slot, only its lock (renewed with every other lock of the
    /// process, every third of a lease).
    #[arg(long, env = "RELAY_SEQUENCER_IDLE_LINGER_MS", default_value_t = sequencer::IDLE_LINGER_MS)]
    pub idle_linger_ms: u64,

    /// Idle endpoints this process keeps at most; past it, those idle longest are let go
    /// (each idle one holds a few kilobytes and its lock; 0: none is kept once idle).
    #[arg(long, env = "RELAY_SEQUENCER_MAX_IDLE_ENDPOINTS", default_value_t = sequencer::MAX_IDLE_ENDPOINTS)]
    pub max_idle_endpoints: usize,

    /// Days applied event ids are kept for de-duplication (0: for ever). Keep them as long as
    /// the oldest backup that may be restored, plus a day: a rewind after a restore resends
    /// what was applied since that backup.
    #[arg(
        long,
        env = "RELAY_SEQUENCER_APPLIED_EVENTS_RETENTION_DAYS",
        default_value_t = sequencer::APPLIED_EVENTS_RETENTION_DAYS,
        value_parser = retention_days
    )]
    pub applied_events_retention_days: f64,

    /// Days applied messages are kept (0: for ever), for the message listing and a quarantined
    /// message's retry; a message quarantined and not acted on is kept regardless. A restore
    /// from a backup needs none of them (the upstream's rewind resends what the backup lacks).
    #[arg(
        long,
        env = "RELAY_SEQUENCER_MESSAGE_RETENTION_DAYS",
        default_value_t = sequencer::MESSAGE_RETENTION_DAYS,
        value_parser = retention_days
    )]
    pub message_retention_days: f64,

    /// Days published changes are kept (0: for ever): how far back `POST .../replay` reaches.
    /// Unpublished changes are kept regardless.
    #[arg(
        long,
        env = "RELAY_SEQUENCER_CHANGE_RETENTION_DAYS",
        default_value_t = sequencer::CHANGE_RETENTION_DAYS,
        value_parser = retention_days
    )]
    pub change_retention_days: f64,

    /// Seconds between the sweeps that delete what is past its retention (and read the tables'
    /// sizes).
    #[arg(
        long,
        env = "RELAY_SEQUENCER_RETENTION_INTERVAL_S",
        default_value_t = sequencer::RETENTION_INTERVAL_S,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub retention_interval_s: u64,

    /// Seconds between a stories endpoint's catch-ups from `GET /v1/events`, the safety net
    /// under its webhooks (it also catches up on start-up and after downtime).
    #[arg(
        long,
        env = "RELAY_SEQUENCER_STORIES_CATCH_UP_INTERVAL_S",
        default_value_t = sequencer::STORIES_CATCH_UP_INTERVAL_S,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub stories_catch_up_interval_s: u64,

    /// Timeout, in milliseconds, of each upstream API request (reload pages, refetch reads).
    #[arg(
        long,
        env = "RELAY_SEQUENCER_UPSTREAM_TIMEOUT_MS",
        default_value_t = sequencer::UPSTREAM_TIMEOUT_MS
    )]
    pub upstream_timeout_ms: u64,

    /// Reload passes (and stories endpoints' syncs) reading at once in this process; one tenant
    /// holds at most RELAY_SEQUENCER_MAX_TENANT_SHARE of them. With the next setting, what
    /// bounds the memory reloads hold (README, "Memory").
    #[arg(
        long,
        env = "RELAY_SEQUENCER_MAX_CONCURRENT_RELOADS",
        default_value_t = sequencer::MAX_CONCURRENT_RELOADS,
        value_parser = clap::value_parser!(u32).range(1..).map(|n| n as usize)
    )]
    pub max_concurrent_reloads: usize,

    /// The most one reload pass (or stories sync) reads, in bytes: the memory its answers'
    /// values take once parsed, as estimated while parsing (or their bytes, when more). Past it
    /// the pass fails as `too_large` and is read again after a pause. The default (1 GiB) holds
    /// about 130,000 items of the benchmark's 1 KB.
    #[arg(
        long,
        env = "RELAY_SEQUENCER_MAX_RELOAD_BYTES",
        default_value_t = sequencer::MAX_RELOAD_BYTES,
        value_parser = clap::value_parser!(u64).range(1024..)
    )]
    pub max_reload_bytes: u64,
}

#[derive(Debug, Clone, Args)]
pub struct SequencerCommand {
    #[command(flatten)]
    pub args: SequencerArgs,
    /// Address `/metrics` is served on.
    #[arg(
        long,
        env = "RELAY_SEQUENCER_METRICS_LISTEN",
        default_value = "127.0.0.1:9465"
    )]
    pub metrics_listen: SocketAddr,
}

#[derive(Debug, Clone, Args)]
pub struct PublisherCommand {
    #[command(flatten)]
    pub args: relay_publisher::PublisherArgs,
    /// Address `/metrics` is served on.
    #[arg(
        long,
        env = "RELAY_PUBLISHER_METRICS_LISTEN",
        default_value = "127.0.0.1:9466"
    )]
    pub metrics_listen: SocketAddr,
}

#[derive(Debug, Clone, Args)]
pub struct ApiCommand {
    #[command(flatten)]
    pub args: relay_api::ApiArgs,
    /// The relay's own RabbitMQ (as the publisher's RELAY_AMQP_URL): tenants' destinations
    /// there are refused, and tenants' users are made there.
    #[arg(long, env = "RELAY_AMQP_URL", default_value = relay_publisher::DEFAULT_AMQP_URL,
          hide_env_values = true)]
    pub amqp_url: String,
    #[command(flatten)]
    pub destinations: relay_publisher::DestinationArgs,
    /// Address `/metrics` is served on.
    #[arg(
        long,
        env = "RELAY_API_METRICS_LISTEN",
        default_value = "127.0.0.1:9467"
    )]
    pub metrics_listen: SocketAddr,
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Print a new key's entry, `<id>=<base64>`, for RELAY_SEAL_KEYS_FILE.
    Generate {
        /// The key's name, stored beside every value it seals (1 to 64 of `A-Za-z0-9-_.`),
        /// such as the month it was made.
        #[arg(long)]
        id: String,
    },
    /// Print (JSON) how many values each key seals, and how many remain under an old key.
    Status,
    /// Re-seal every value held under an old key under the current one, in batches of 500,
    /// while the tiers run (their data keys are re-wrapped; the values are not touched). Then
    /// an old key may be removed.
    Rotate {
        /// Milliseconds between batches, so the database's other work goes first.
        #[arg(long, default_value_t = 50)]
        pause_ms: u64,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Print a signed token (JSON: token, expires_at) for an operator or a tenant.
    Issue(relay_api::TokenArgs),
}

#[derive(Debug, Clone, Args)]
pub struct AllArgs {
    #[command(flatten)]
    pub ingest: IngestArgs,
    #[command(flatten)]
    pub sequencer: SequencerArgs,
    #[command(flatten)]
    pub publisher: relay_publisher::PublisherArgs,
    #[command(flatten)]
    pub api: relay_api::ApiArgs,
}

/// A retention in days: a fraction of a day is allowed (0.5, twelve hours); 0 keeps for ever.
fn retention_days(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(days) if days.is_finite() && (0.0..=36_500.0).contains(&days) => Ok(days),
        _ => Err("a number of days from 0 (for ever) to 36500, such as 7 or 0.5".to_owned()),
    }
}
