//! `relay api` and `relay token issue`: their flags (each also an environment variable), read
//! once into an [`ApiConfig`] or a minted token.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::builder::TypedValueParser as _;
use clap::{ArgGroup, Args};
use relay_listener::ListenerLimits;
use time::OffsetDateTime;
use uuid::Uuid;

use relay_publisher::DEFAULT_AMQP_URL;
use relay_rules::DestinationPolicy;
use relay_store::quotas::QuotaDefaults;

use crate::auth::{self, IssuedToken, JwtKeys, KeyError, Rotation, Subject, TokenError};
use crate::broker::{
    BrokerAccess, DeadLetters, ManagementSettings, DEAD_LETTER_RETENTION_HOURS, DELIVERY_LIMIT,
};
use crate::envelope::{EnvelopeLimits, ENVELOPE_LIMITS};

/// Where the JWT signing key comes from. Shared by `relay api` and `relay token issue`, which
/// must use the same key.
#[derive(Clone, Args)]
pub struct JwtKeyArgs {
    /// The HS256 signing key (at least 32 bytes). Prefer --jwt-secret-file: a value here is
    /// visible to other users of the machine.
    #[arg(long, env = "RELAY_API_JWT_SECRET", hide_env_values = true)]
    pub jwt_secret: Option<String>,
    /// A file holding the HS256 signing key (surrounding whitespace is ignored).
    #[arg(long, env = "RELAY_API_JWT_SECRET_FILE", conflicts_with = "jwt_secret")]
    pub jwt_secret_file: Option<PathBuf>,
    /// A file holding the previous signing key during a rotation (never signed with): tokens
    /// it signed and issued before the rotation began keep verifying until the overlap ends,
    /// so a key can be rotated without cutting off tokens already handed out.
    #[arg(long, env = "RELAY_API_JWT_PREVIOUS_SECRET_FILE")]
    pub jwt_previous_secret_file: Option<PathBuf>,
    /// When the rotation began (the new key began signing): RFC 3339 or Unix seconds. Required
    /// with a previous key; a token the previous key signed is refused when its `iat` is not
    /// before it. Whoever holds the previous key can back-date `iat`: only the overlap's end
    /// stops a leaked key.
    #[arg(long, env = "RELAY_API_JWT_ROTATION_STARTED_AT", value_parser = parse_instant)]
    pub jwt_rotation_started_at: Option<OffsetDateTime>,
    /// Seconds after the rotation began that the previous key stops verifying altogether.
    #[arg(long, env = "RELAY_API_JWT_PREVIOUS_KEY_OVERLAP_S",
          default_value_t = PREVIOUS_KEY_OVERLAP_S,
          value_parser = clap::value_parser!(u64).range(1..=auth::MAX_TTL.as_secs()))]
    pub jwt_previous_key_overlap_s: u64,
    /// The audience tokens are minted for and must name.
    #[arg(long, env = "RELAY_API_AUDIENCE", default_value = "relay")]
    pub jwt_audience: String,
}

// By hand: the derived form would print the key.
impl std::fmt::Debug for JwtKeyArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtKeyArgs")
            .field("jwt_secret", &self.jwt_secret.as_ref().map(|_| "<set>"))
            .field("jwt_secret_file", &self.jwt_secret_file)
            .field("jwt_previous_secret_file", &self.jwt_previous_secret_file)
            .field("jwt_rotation_started_at", &self.jwt_rotation_started_at)
            .field(
                "jwt_previous_key_overlap_s",
                &self.jwt_previous_key_overlap_s,
            )
            .field("jwt_audience", &self.jwt_audience)
            .finish()
    }
}

/// How long the previous key verifies after a rotation began, by default: a day, for tools
/// holding tokens of the old key to be given new ones.
pub const PREVIOUS_KEY_OVERLAP_S: u64 = 86_400;

/// How far ahead of this machine's clock a rotation's start may be: a clock's skew, no more.
/// A start in the future would let the previous key mint tokens until then.
const ROTATION_START_SKEW: Duration = Duration::from_secs(300);

/// An instant given as RFC 3339 (`2026-12-03T10:00:00Z`) or as Unix seconds.
fn parse_instant(text: &str) -> Result<OffsetDateTime, String> {
    let text = text.trim();
    if let Ok(seconds) = text.parse::<i64>() {
        return OffsetDateTime::from_unix_timestamp(seconds).map_err(|e| e.to_string());
    }
    OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
        .map_err(|_| "RFC 3339 (2026-12-03T10:00:00Z) or Unix seconds".to_owned())
}

/// Configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("no JWT signing key: set RELAY_API_JWT_SECRET_FILE (or RELAY_API_JWT_SECRET)")]
    NoKey,
    #[error(
        "RELAY_API_JWT_PREVIOUS_SECRET_FILE is set without RELAY_API_JWT_ROTATION_STARTED_AT: \
         set it to when the new key began signing (RFC 3339 or Unix seconds); tokens the \
         previous key signs after it are refused"
    )]
    NoRotationStart,
    #[error(
        "RELAY_API_JWT_ROTATION_STARTED_AT ({0}) is in the future: it is when the new key \
         began signing, and until then the previous key could still mint tokens"
    )]
    RotationStartAhead(OffsetDateTime),
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("the audience is 1 to 200 characters")]
    Audience,
    #[error("give --operator or --tenant <id>")]
    Subject,
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error("the relay's broker: {0}")]
    Broker(String),
}

fn read_key(path: &Path) -> Result<Vec<u8>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    Ok(text.trim().as_bytes().to_vec())
}

impl JwtKeyArgs {
    pub fn keys(&self) -> Result<JwtKeys, ConfigError> {
        let signing = match (&self.jwt_secret, &self.jwt_secret_file) {
            (_, Some(path)) => read_key(path)?,
            (Some(text), None) => text.trim().as_bytes().to_vec(),
            (None, None) => return Err(ConfigError::NoKey),
        };
        let keys = JwtKeys::new(signing)?;
        let Some(path) = &self.jwt_previous_secret_file else {
            return Ok(keys);
        };
        let started_at = self
            .jwt_rotation_started_at
            .ok_or(ConfigError::NoRotationStart)?;
        if started_at > OffsetDateTime::now_utc() + ROTATION_START_SKEW {
            return Err(ConfigError::RotationStartAhead(started_at));
        }
        let rotation = Rotation {
            started_at,
            overlap: Duration::from_secs(self.jwt_previous_key_overlap_s),
        };
        Ok(keys.with_previous(read_key(path)?, rotation)?)
    }

    fn audience(&self) -> Result<String, ConfigError> {
        let audience = self.jwt_audience.trim();
        if audience.is_empty() || audience.chars().count() > 200 {
            return Err(ConfigError::Audience);
        }
        Ok(audience.to_owned())
    }
}

/// The control plane listener's bounds: its clients are a few tenants' tools and the operators'.
/// One client holds at most a quarter of the connections, whatever they do.
pub const LISTENER_LIMITS: ListenerLimits = ListenerLimits {
    header_read_timeout: Duration::from_secs(5),
    body_read_timeout: Duration::from_secs(10),
    idle_timeout: Duration::from_secs(5),
    max_connections: 256,
    max_headless_per_address: 64,
    max_connections_per_client: 64,
    client_address: relay_listener::ClientAddressFrom::Peer,
};

/// `relay api`: serve the control plane. Every flag is prefixed (`--api-...`, `--jwt-...`) so
/// that `relay all` can take these beside the other tiers' flags without a clash.
#[derive(Clone, Args)]
pub struct ApiArgs {
    /// Where the API listens.
    #[arg(long, env = "RELAY_API_LISTEN", default_value = "127.0.0.1:8081")]
    pub api_listen: SocketAddr,
    #[command(flatten)]
    pub jwt: JwtKeyArgs,
    /// How long a call to the upstream's API (a rewind) may take, in seconds.
    #[arg(long, env = "RELAY_API_UPSTREAM_TIMEOUT_S", default_value_t = 10)]
    pub api_upstream_timeout_s: u64,
    /// Requests one tenant may have in flight at once (the operators' tokens, together, the
    /// same); one more is answered 429 with Retry-After before its handler runs.
    #[arg(long, env = "RELAY_API_MAX_REQUESTS_PER_TENANT",
          default_value_t = ENVELOPE_LIMITS.max_requests_per_tenant,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub api_max_requests_per_tenant: u32,
    /// Rewinds one tenant may have in flight at once (each waits on the tenant's upstream);
    /// one more is answered 429 with Retry-After.
    #[arg(long, env = "RELAY_API_MAX_REWINDS_PER_TENANT",
          default_value_t = ENVELOPE_LIMITS.max_rewinds_per_tenant,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub api_max_rewinds_per_tenant: u32,
    /// Rewinds all tenants together may have in flight at once (each holds an upstream answer
    /// of up to 1 MiB); one more is answered 429 with Retry-After.
    #[arg(long, env = "RELAY_API_MAX_REWINDS",
          default_value_t = ENVELOPE_LIMITS.max_rewinds,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub api_max_rewinds: u32,
    /// Seconds a rewind may take, its call to the upstream included; then it is answered 502
    /// `upstream_failed` (timed out). Keep it under RELAY_API_UPSTREAM_TIMEOUT_S.
    #[arg(long, env = "RELAY_API_REWIND_TIMEOUT_S",
          default_value_t = ENVELOPE_LIMITS.rewind_timeout.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub api_rewind_timeout_s: u64,
    /// Milliseconds a request's head may take to arrive (from the connection's opening or its
    /// previous answer); a slower connection is closed.
    #[arg(long, env = "RELAY_API_HEADER_READ_TIMEOUT_MS",
          default_value_t = LISTENER_LIMITS.header_read_timeout.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub api_header_read_timeout_ms: u64,
    /// Milliseconds a request's body may take to arrive after its head; a slower one is
    /// answered 408 and its connection closed.
    #[arg(long, env = "RELAY_API_BODY_READ_TIMEOUT_MS",
          default_value_t = LISTENER_LIMITS.body_read_timeout.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub api_body_read_timeout_ms: u64,
    /// Connections served at once; one more is answered 503 with Retry-After and closed.
    #[arg(long, env = "RELAY_API_MAX_CONNECTIONS",
          default_value_t = LISTENER_LIMITS.max_connections,
          value_parser = clap::value_parser!(u32).range(1..).map(|n| n as usize))]
    pub api_max_connections: usize,
    /// Connections from one address that have not sent a complete request head yet; one more
    /// from that address is answered 503 with Retry-After and closed.
    #[arg(long, env = "RELAY_API_MAX_HEADLESS_PER_ADDRESS",
          default_value_t = LISTENER_LIMITS.max_headless_per_address,
          value_parser = clap::value_parser!(u32).range(1..).map(|n| n as usize))]
    pub api_max_headless_per_address: usize,
    /// Connections one client holds at once, whatever they do; one more from it is answered
    /// 503 with Retry-After and closed. With `x-forwarded-for`, the client's requests in flight
    /// instead (429 past it).
    #[arg(long, env = "RELAY_API_MAX_CONNECTIONS_PER_CLIENT",
          default_value_t = LISTENER_LIMITS.max_connections_per_client,
          value_parser = clap::value_parser!(u32).range(1..).map(|n| n as usize))]
    pub api_max_connections_per_client: usize,
    /// Milliseconds a kept-alive connection waits for its next request (a new one for its
    /// first) before it is closed; the head read timeout, when shorter, closes it too.
    #[arg(long, env = "RELAY_API_IDLE_TIMEOUT_MS",
          default_value_t = LISTENER_LIMITS.idle_timeout.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub api_idle_timeout_ms: u64,
    /// Where a client's address comes from: `peer`, `proxy-protocol` or `x-forwarded-for`
    /// (from a proxy in RELAY_TRUSTED_PROXIES), as RELAY_INGEST_CLIENT_ADDRESS.
    #[arg(long, env = "RELAY_API_CLIENT_ADDRESS", default_value = "peer")]
    pub api_client_address: relay_listener::ClientAddressFrom,
    /// The RabbitMQ management API of the relay's broker (plugin rabbitmq_management), where
    /// tenants' users are made. Default: http://<RELAY_AMQP_URL's host>:15672.
    #[arg(long, env = "RELAY_AMQP_MANAGEMENT_URL")]
    pub amqp_management_url: Option<String>,
    /// The management API's user (needs the `administrator` tag). Default: RELAY_AMQP_URL's.
    #[arg(long, env = "RELAY_AMQP_MANAGEMENT_USER")]
    pub amqp_management_user: Option<String>,
    /// The management API's password. Default: RELAY_AMQP_URL's.
    #[arg(long, env = "RELAY_AMQP_MANAGEMENT_PASSWORD", hide_env_values = true)]
    pub amqp_management_password: Option<String>,
    /// host:port tenants connect to for their queue, when not RELAY_AMQP_URL's (the relay may
    /// reach its broker by an internal name).
    #[arg(long, env = "RELAY_AMQP_TENANT_ADDRESS")]
    pub amqp_tenant_address: Option<String>,
    /// Deliveries of one message to a tenant's consumers (each nack or reject with requeue,
    /// or consumer that dies holding it, is one more) before the broker moves it to the
    /// tenant's dead-letter queue, so a poison message does not loop for ever.
    #[arg(long, env = "RELAY_TENANT_QUEUE_DELIVERY_LIMIT", default_value_t = DELIVERY_LIMIT,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub tenant_queue_delivery_limit: u32,
    /// Hours a message stays in a tenant's dead-letter queue.
    #[arg(long, env = "RELAY_DEAD_LETTER_RETENTION_HOURS",
          default_value_t = DEAD_LETTER_RETENTION_HOURS,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub dead_letter_retention_hours: u64,
    /// The relay's own broker. Not a flag of its own: the `relay` binary sets it from
    /// RELAY_AMQP_URL, which the publisher reads too.
    #[arg(skip = DEFAULT_AMQP_URL.to_owned())]
    pub relay_amqp_url: String,
    /// Where tenants' own-exchange destinations may point. Not flags of their own: the `relay`
    /// binary sets it from RELAY_DESTINATION_*, which the publisher reads too.
    #[arg(skip)]
    pub destination_policy: DestinationPolicy,
    /// The operator's default quotas. Not flags of their own: the `relay` binary sets them
    /// from RELAY_QUOTA_*, which every tier reads.
    #[arg(skip)]
    pub quota_defaults: QuotaDefaults,
}

// By hand: the derived form would print the management password.
impl std::fmt::Debug for ApiArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiArgs")
            .field("api_listen", &self.api_listen)
            .field("jwt", &self.jwt)
            .field("api_upstream_timeout_s", &self.api_upstream_timeout_s)
            .field(
                "api_max_requests_per_tenant",
                &self.api_max_requests_per_tenant,
            )
            .field(
                "api_max_rewinds_per_tenant",
                &self.api_max_rewinds_per_tenant,
            )
            .field("api_rewind_timeout_s", &self.api_rewind_timeout_s)
            .field("amqp_management_url", &self.amqp_management_url)
            .field("amqp_management_user", &self.amqp_management_user)
            .field("amqp_tenant_address", &self.amqp_tenant_address)
            .field(
                "tenant_queue_delivery_limit",
                &self.tenant_queue_delivery_limit,
            )
            .field(
                "dead_letter_retention_hours",
                &self.dead_letter_retention_hours,
            )
            .field("destination_policy", &self.destination_policy)
            .field("quota_defaults", &self.quota_defaults)
            .finish_non_exhaustive()
    }
}

/// The control plane's settings, validated.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    pub listen: SocketAddr,
    pub keys: JwtKeys,
    /// Seals what tenants give the relay to keep (signing secrets, upstream API keys, broker
    /// URLs) and re-seals it under the current key.
    pub sealing: relay_store::Keyring,
    pub audience: String,
    pub upstream_timeout: Duration,
    /// Header and body read timeouts and the bound on open connections.
    pub listener: ListenerLimits,
    /// Each caller's share: requests and rewinds in flight, the rewind's deadline.
    pub envelope: EnvelopeLimits,
    /// The operator's default quotas, which a tenant's overrides replace.
    pub quotas: QuotaDefaults,
    /// What the process's listeners share: the body budget, the trusted proxies, the metrics
    /// (registered in `registry` when none are given).
    pub shared: relay_listener::Shared,
    /// The relay's own broker: destinations are refused there, and tenants' users are made
    /// there.
    pub broker: BrokerAccess,
    /// Which upstream URLs endpoints may name, and where the rewind call may go.
    pub outbound: relay_netguard::OutboundPolicy,
    /// The roots https requests (the rewind call, the broker's management API) trust.
    pub trust: relay_netguard::TrustRoots,
    /// Where the API's metrics are registered: the binary's registry, served on its
    /// `/metrics`. A fresh one by default.
    pub registry: prometheus::Registry,
}

impl ApiConfig {
    /// Settings for `keys`, listening on 127.0.0.1 with a port the system picks, the relay's
    /// broker at its defaults (tests).
    pub fn new(keys: JwtKeys, sealing: relay_store::Keyring) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            keys,
            sealing,
            audience: "relay".to_owned(),
            upstream_timeout: Duration::from_secs(10),
            listener: LISTENER_LIMITS,
            envelope: ENVELOPE_LIMITS,
            quotas: QuotaDefaults::default(),
            shared: relay_listener::Shared::default(),
            broker: BrokerAccess::new(
                DEFAULT_AMQP_URL,
                &ManagementSettings::default(),
                None,
                DestinationPolicy::default(),
            )
            .expect("the default AMQP URL is valid"),
            outbound: relay_netguard::OutboundPolicy::default(),
            trust: relay_netguard::TrustRoots::platform(),
            registry: prometheus::Registry::new(),
        }
    }
}

impl ApiArgs {
    /// Reads the key files and checks every value; `outbound` is the operator's policy for
    /// upstream URLs (a setting every tier shares).
    pub fn to_config(
        &self,
        outbound: relay_netguard::OutboundPolicy,
        trust: relay_netguard::TrustRoots,
        sealing: relay_store::Keyring,
    ) -> Result<ApiConfig, ConfigError> {
        let mut broker = BrokerAccess::new(
            &self.relay_amqp_url,
            &ManagementSettings {
                url: self.amqp_management_url.clone(),
                user: self.amqp_management_user.clone(),
                password: self.amqp_management_password.clone(),
            },
            self.amqp_tenant_address.clone(),
            self.destination_policy.clone(),
        )?;
        broker.dead_letters = DeadLetters {
            delivery_limit: self.tenant_queue_delivery_limit,
            retention: Duration::from_secs(self.dead_letter_retention_hours * 3600),
        };
        Ok(ApiConfig {
            listen: self.api_listen,
            keys: self.jwt.keys()?,
            sealing,
            audience: self.jwt.audience()?,
            upstream_timeout: Duration::from_secs(self.api_upstream_timeout_s.max(1)),
            listener: ListenerLimits {
                header_read_timeout: Duration::from_millis(self.api_header_read_timeout_ms),
                body_read_timeout: Duration::from_millis(self.api_body_read_timeout_ms),
                max_connections: self.api_max_connections,
                max_headless_per_address: self.api_max_headless_per_address,
                max_connections_per_client: self.api_max_connections_per_client,
                idle_timeout: Duration::from_millis(self.api_idle_timeout_ms),
                client_address: self.api_client_address,
            },
            envelope: EnvelopeLimits {
                max_requests_per_tenant: self.api_max_requests_per_tenant,
                max_rewinds_per_tenant: self.api_max_rewinds_per_tenant,
                max_rewinds: self.api_max_rewinds,
                rewind_timeout: Duration::from_secs(self.api_rewind_timeout_s),
            },
            quotas: self.quota_defaults,
            shared: relay_listener::Shared::default(),
            broker,
            outbound,
            trust,
            registry: prometheus::Registry::new(),
        })
    }
}

/// `relay token issue`: mint a token for an operator or a tenant.
#[derive(Debug, Clone, Args)]
#[command(group(ArgGroup::new("subject").required(true).args(["operator", "tenant"])))]
pub struct TokenArgs {
    /// An operator's token: manages tenants.
    #[arg(long)]
    pub operator: bool,
    /// A tenant's token: manages that tenant's endpoints, destination and reads.
    #[arg(long)]
    pub tenant: Option<Uuid>,
    /// Who the operator token is for (recorded in its `sub`, for logs).
    #[arg(long, default_value = "operator")]
    pub name: String,
    /// How long the token lives, in seconds.
    #[arg(long = "ttl-s", default_value_t = 3600)]
    pub ttl_s: u64,
    #[command(flatten)]
    pub jwt: JwtKeyArgs,
}

/// Mints the token `args` describe, valid from now.
pub fn issue_token(args: &TokenArgs) -> Result<IssuedToken, ConfigError> {
    let subject = match (args.operator, args.tenant) {
        (true, None) => Subject::Operator {
            name: args.name.clone(),
        },
        (false, Some(tenant)) => Subject::Tenant(tenant),
        _ => return Err(ConfigError::Subject),
    };
    Ok(auth::mint(
        &args.jwt.keys()?,
        &args.jwt.audience()?,
        &subject,
        Duration::from_secs(args.ttl_s),
        OffsetDateTime::now_utc(),
    )?)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::auth::{Role, Verifier};

    fn sealing() -> relay_store::Keyring {
        let entry = relay_seal::LocalKeys::generate_entry("test").unwrap();
        relay_store::Keyring::new(std::sync::Arc::new(
            relay_seal::LocalKeys::parse(&entry).unwrap(),
        ))
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        token: TokenArgs,
    }

    #[test]
    fn issue_mints_a_token_the_api_accepts() {
        let secret = "k".repeat(32);
        let tenant = Uuid::new_v4();
        let cli = Cli::try_parse_from([
            "relay",
            "--tenant",
            &tenant.to_string(),
            "--ttl-s",
            "60",
            "--jwt-secret",
            &secret,
        ])
        .unwrap();
        let issued = issue_token(&cli.token).unwrap();
        let claims = Verifier::new(cli.token.jwt.keys().unwrap(), "relay")
            .verify(&issued.token)
            .unwrap();
        assert_eq!((claims.role, claims.tenant), (Role::Tenant, Some(tenant)));
        assert!(!format!("{:?}", cli.token).contains(&secret));
    }

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        api: ApiArgs,
    }

    #[test]
    fn api_args_read_the_key_file_and_default_the_rest() {
        let dir = std::env::temp_dir().join(format!("relay-api-{}", Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("jwt.key");
        std::fs::write(&path, format!("{}\n", "s".repeat(40))).unwrap();
        let serve = Serve::try_parse_from([
            "relay",
            "--jwt-secret-file",
            path.to_str().unwrap(),
            "--api-listen",
            "127.0.0.1:0",
        ])
        .unwrap();
        let config = serve.api.to_config(
            Default::default(),
            relay_netguard::TrustRoots::platform(),
            sealing(),
        );
        std::fs::remove_dir_all(&dir).unwrap();
        let config = config.unwrap();
        assert_eq!(config.listen.port(), 0);
        assert_eq!(config.audience, "relay");
        assert_eq!(config.upstream_timeout, Duration::from_secs(10));
        assert_eq!(config.listener, LISTENER_LIMITS);
        assert_eq!(config.envelope, ENVELOPE_LIMITS);
        assert!(config.envelope.rewind_timeout < config.upstream_timeout);
        assert_eq!(config.quotas, QuotaDefaults::default());
        let short = Serve::try_parse_from(["relay", "--jwt-secret", "short"]).unwrap();
        assert!(matches!(
            short.api.to_config(
                Default::default(),
                relay_netguard::TrustRoots::platform(),
                sealing(),
            ),
            Err(ConfigError::Key(KeyError::TooShort(5)))
        ));
    }

    #[test]
    fn a_previous_key_needs_when_the_rotation_began() {
        let dir = std::env::temp_dir().join(format!("relay-api-{}", Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let previous = dir.join("previous.key");
        std::fs::write(&previous, "p".repeat(32)).unwrap();
        let secret = "k".repeat(32);
        let keys = |extra: &[&str]| {
            let mut args = vec![
                "relay",
                "--tenant",
                "00000000-0000-0000-0000-000000000001",
                "--jwt-secret",
                &secret,
                "--jwt-previous-secret-file",
                previous.to_str().unwrap(),
            ];
            args.extend_from_slice(extra);
            Cli::try_parse_from(args).map(|cli| cli.token.jwt.keys())
        };
        let refused = keys(&[]).unwrap();
        assert!(
            matches!(refused, Err(ConfigError::NoRotationStart)),
            "{refused:?}"
        );
        let rfc3339 = keys(&["--jwt-rotation-started-at", "2026-01-01T00:00:00Z"]);
        let rotation = rfc3339.unwrap().unwrap().rotation().unwrap();
        assert_eq!(rotation.started_at.unix_timestamp(), 1_767_225_600);
        assert_eq!(
            rotation.overlap,
            Duration::from_secs(PREVIOUS_KEY_OVERLAP_S)
        );
        let unix = keys(&[
            "--jwt-rotation-started-at",
            "1767225600",
            "--jwt-previous-key-overlap-s",
            "600",
        ]);
        let rotation = unix.unwrap().unwrap().rotation().unwrap();
        assert_eq!(rotation.started_at.unix_timestamp(), 1_767_225_600);
        assert_eq!(rotation.overlap, Duration::from_secs(600));
        let ahead = (OffsetDateTime::now_utc() + Duration::from_secs(3600))
            .unix_timestamp()
            .to_string();
        let ahead = keys(&["--jwt-rotation-started-at", &ahead]).unwrap();
        assert!(
            matches!(ahead, Err(ConfigError::RotationStartAhead(_))),
            "{ahead:?}"
        );
        assert!(keys(&["--jwt-rotation-started-at", "yesterday"]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn issue_needs_exactly_one_subject() {
        let secret = "k".repeat(32);
        assert!(Cli::try_parse_from(["relay", "--jwt-secret", &secret]).is_err());
        assert!(Cli::try_parse_from([
            "relay",
            "--operator",
            "--tenant",
            &Uuid::new_v4().to_string(),
            "--jwt-secret",
            &secret
        ])
        .is_err());
    }
}
