//! The relay's own broker, as the control plane sees it: where it is (so a tenant's destination
//! can be refused when it points there), and its management HTTP API (plugin
//! `rabbitmq_management`), through which each tenant gets a user of its own that may consume
//! the tenant's queue and nothing else.
//!
//! # A tenant's user
//! `relay-tenant-<tenant_id>`, with these permissions on the relay's vhost (RabbitMQ's own
//! permission model, checked by the broker on every operation):
//! - configure `^$`: nothing (no declare but a passive one, no delete, no bind);
//! - write `^$`: nothing (no publish, not even to the default exchange, which permissions name
//!   `amq.default`; no bind, which needs write on the queue too);
//! - read `^relay\.tenant\.<tenant_id>(\.dead-letter)?$`: consume (and get) from the tenant's
//!   queue and its dead-letter queue alone.
//!
//! The password is random, sent to the broker only as RabbitMQ's salted SHA-256 hash, and
//! shown to the tenant once; the relay keeps neither. The tenant's queue is declared (as the
//! publisher declares it) when the user is made, so the tenant can consume at once.
//!
//! # Poison messages
//! A message the tenant's consumer keeps returning (nack or reject with requeue, or a consumer
//! that dies holding it) would otherwise come back for ever, ahead of everything after it. A
//! policy on the tenant queues (`relay-tenant-queues`) gives them a delivery limit and the
//! dead-letter exchange `relay.dead-letter`: past the limit the broker moves the message to
//! the tenant's `relay.tenant.<tenant_id>.dead-letter` queue (bound by the tenant queue's name,
//! which is the routing key the publisher used), where it is kept for the retention
//! (`relay-tenant-dead-letters`) for the tenant to read. Policies rather than queue arguments:
//! a queue's arguments cannot change once declared, and a policy's settings reach queues that
//! already exist. The read permission covers both queues.

use std::net::SocketAddr;
use std::time::Duration;

use base64::Engine as _;
use rand::RngCore as _;
use relay_publisher::{broker_urls, tenant_queue};
use relay_rules::DestinationPolicy;
use relay_store::TenantId;
use reqwest::{Method, Url};
use serde_json::json;
use sha2::{Digest as _, Sha256};

use crate::config::ConfigError;
use crate::error::ApiError;

/// The RabbitMQ management API's default port.
const MANAGEMENT_PORT: u16 = 15672;

/// Where the broker sends a tenant's messages past their delivery limit.
const DEAD_LETTER_EXCHANGE: &str = "relay.dead-letter";
const TENANT_QUEUES_POLICY: &str = "relay-tenant-queues";
const DEAD_LETTER_QUEUES_POLICY: &str = "relay-tenant-dead-letters";
/// The policies' priority: above a catch-all operator policy at the default 0, as only one
/// policy applies to a queue.
const POLICY_PRIORITY: u32 = 10;
/// A tenant queue's name: the tenant id's 36 characters after the prefix.
const TENANT_QUEUE_PATTERN: &str = r"^relay\.tenant\.[0-9a-f-]{36}$";
const DEAD_LETTER_QUEUE_PATTERN: &str = r"^relay\.tenant\.[0-9a-f-]{36}\.dead-letter$";

/// Deliveries of one message to a tenant's consumers before it is dead-lettered: enough for a
/// consumer that restarts a few times over a passing fault, few enough that a poison message
/// stops blocking the queue within minutes.
pub const DELIVERY_LIMIT: u32 = 20;
/// Hours a dead-lettered message is kept: two weeks, time for a team to notice and read it.
pub const DEAD_LETTER_RETENTION_HOURS: u64 = 14 * 24;

/// The tenant's dead-letter queue, beside its queue.
pub fn dead_letter_queue(tenant: TenantId) -> String {
    format!("{}.dead-letter", tenant_queue(tenant.0))
}

/// What happens to a message a tenant's consumer keeps returning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadLetters {
    /// Deliveries before the message moves to the tenant's dead-letter queue.
    pub delivery_limit: u32,
    /// How long a dead-lettered message is kept.
    pub retention: Duration,
}

impl Default for DeadLetters {
    fn default() -> Self {
        Self {
            delivery_limit: DELIVERY_LIMIT,
            retention: Duration::from_secs(DEAD_LETTER_RETENTION_HOURS * 3600),
        }
    }
}

/// The relay's broker and what tenants may do about it.
#[derive(Clone)]
pub struct BrokerAccess {
    /// The relay's own broker, as the publisher connects to it: `host`, `port`, `vhost`.
    pub host: String,
    pub port: u16,
    /// The cluster's other nodes (host, port), when RELAY_AMQP_URL names several.
    pub other_nodes: Vec<(String, u16)>,
    pub vhost: String,
    /// Where tenants connect to consume their queue (host:port), when not `host:port`.
    pub tenant_address: Option<String>,
    /// Where tenants' own-exchange destinations may point.
    pub destination_policy: DestinationPolicy,
    /// The tenant queues' delivery limit and their dead letters' retention.
    pub dead_letters: DeadLetters,
    management_url: Url,
    management_user: String,
    management_password: String,
}

// By hand: the derived form would print the management password.
impl std::fmt::Debug for BrokerAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerAccess")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("vhost", &self.vhost)
            .field("tenant_address", &self.tenant_address)
            .field("destination_policy", &self.destination_policy)
            .field("dead_letters", &self.dead_letters)
            .field("management_url", &self.management_url.as_str())
            .field("management_user", &self.management_user)
            .finish()
    }
}

/// The management API's settings, as given (each may be left to its default).
#[derive(Debug, Clone, Default)]
pub struct ManagementSettings {
    /// Default: `http://<the AMQP URL's host>:15672/`.
    pub url: Option<String>,
    /// Default: the AMQP URL's user.
    pub user: Option<String>,
    /// Default: the AMQP URL's password.
    pub password: Option<String>,
}

fn percent_decoded(text: &str) -> String {
    let mut out = Vec::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(byte) = u8::from_str_radix(&text[i + 1..i + 3], 16) {
                out.push(byte);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl BrokerAccess {
    /// From the relay's AMQP URL (`RELAY_AMQP_URL`), the management API's settings and the
    /// destination policy.
    pub fn new(
        relay_amqp_url: &str,
        management: &ManagementSettings,
        tenant_address: Option<String>,
        destination_policy: DestinationPolicy,
    ) -> Result<Self, ConfigError> {
        let bad = |why: &str| ConfigError::Broker(why.to_owned());
        // A cluster's nodes (`relay_publisher::broker_urls`): the first is where tenants and
        // the management API are sent unless said otherwise; all of them are the relay's own
        // broker, which no tenant destination may point at.
        let mut nodes = Vec::new();
        for url in broker_urls(relay_amqp_url) {
            let url = Url::parse(url).map_err(|_| bad("RELAY_AMQP_URL is not a URL"))?;
            let host = match url.host_str() {
                Some(host) if !host.is_empty() => host.trim_matches(['[', ']']).to_owned(),
                _ => return Err(bad("RELAY_AMQP_URL has no host")),
            };
            let port = url
                .port()
                .unwrap_or(if url.scheme() == "amqps" { 5671 } else { 5672 });
            nodes.push((url, host, port));
        }
        if nodes.is_empty() {
            return Err(bad("RELAY_AMQP_URL names no broker"));
        }
        let other_nodes = nodes[1..]
            .iter()
            .map(|(_, host, port)| (host.clone(), *port))
            .collect();
        let (amqp, host, port) = nodes.swap_remove(0);
        // The vhost is the path without its leading slash, percent-decoded; none is "/".
        let path = amqp.path().strip_prefix('/').unwrap_or("");
        let vhost = if path.is_empty() {
            "/".to_owned()
        } else {
            percent_decoded(path)
        };
        let management_url = match &management.url {
            Some(url) => Url::parse(url).map_err(|_| bad("the management URL is not a URL"))?,
            None => {
                let mut url = Url::parse("http://127.0.0.1/").expect("a URL");
                url.set_host(amqp.host_str())
                    .map_err(|_| bad("RELAY_AMQP_URL's host"))?;
                url.set_port(Some(MANAGEMENT_PORT)).expect("http has ports");
                url
            }
        };
        if !matches!(management_url.scheme(), "http" | "https") {
            return Err(bad("the management URL is http:// or https://"));
        }
        Ok(Self {
            host,
            port,
            other_nodes,
            vhost,
            tenant_address,
            destination_policy,
            dead_letters: DeadLetters::default(),
            management_url,
            management_user: management
                .user
                .clone()
                .unwrap_or_else(|| percent_decoded(amqp.username())),
            management_password: management
                .password
                .clone()
                .or_else(|| amqp.password().map(percent_decoded))
                .unwrap_or_default(),
        })
    }

    /// Every address the relay's broker resolves to (an error when it resolves to none: then
    /// no destination can be told apart from it).
    pub async fn addresses(&self, timeout: Duration) -> Result<Vec<SocketAddr>, ApiError> {
        let mut addresses = Vec::new();
        let nodes = std::iter::once((&self.host, self.port))
            .chain(self.other_nodes.iter().map(|(host, port)| (host, *port)));
        for (host, port) in nodes {
            addresses.extend(resolve(host, port, timeout).await.map_err(|e| {
                ApiError::BrokerUnavailable(format!("resolving the relay's broker: {e}"))
            })?);
        }
        Ok(addresses)
    }

    /// The tenant's user's name.
    pub fn username(tenant: TenantId) -> String {
        format!("relay-tenant-{tenant}")
    }

    /// Where tenants connect: `tenant_address`, or the relay's own host and port.
    pub fn address_for_tenants(&self) -> (String, u16) {
        if let Some(address) = &self.tenant_address {
            if let Some((host, port)) = address.rsplit_once(':') {
                if let Ok(port) = port.parse() {
                    return (host.trim_matches(['[', ']']).to_owned(), port);
                }
            }
            return (address.clone(), self.port);
        }
        (self.host.clone(), self.port)
    }

    fn endpoint(&self, segments: &[&str]) -> Url {
        let mut url = self.management_url.clone();
        url.path_segments_mut()
            .expect("an http URL has a path")
            .pop_if_empty()
            .push("api")
            .extend(segments);
        url
    }

    async fn call(
        &self,
        http: &reqwest::Client,
        method: Method,
        segments: &[&str],
        body: Option<serde_json::Value>,
        absent_ok: bool,
    ) -> Result<(), ApiError> {
        let what = format!("{method} /api/{}", segments.first().copied().unwrap_or(""));
        let mut request = http
            .request(method, self.endpoint(segments))
            .basic_auth(&self.management_user, Some(&self.management_password));
        if let Some(body) = body {
            request = request.json(&body);
        }
        let answer = request
            .send()
            .await
            .map_err(|e| ApiError::BrokerUnavailable(format!("{what}: {e}")))?;
        let status = answer.status();
        if status.is_success() || (absent_ok && status == reqwest::StatusCode::NOT_FOUND) {
            Ok(())
        } else {
            Err(ApiError::BrokerUnavailable(format!(
                "{what}: the management API answered {status}"
            )))
        }
    }

    /// PUTs `body` at `segments` (a declaration or a setting: idempotent).
    async fn put(
        &self,
        http: &reqwest::Client,
        segments: &[&str],
        body: serde_json::Value,
    ) -> Result<(), ApiError> {
        self.call(http, Method::PUT, segments, Some(body), false)
            .await
    }

    /// DELETEs what is at `segments`; what is absent already is no error.
    async fn delete(&self, http: &reqwest::Client, segments: &[&str]) -> Result<(), ApiError> {
        self.call(http, Method::DELETE, segments, None, true).await
    }

    /// Makes the tenant's user (or sets its password anew) with its permissions, and declares
    /// its queue; returns the new password. Ends every connection the user had open, so a
    /// rotated password is no longer in use anywhere.
    pub async fn issue(
        &self,
        http: &reqwest::Client,
        tenant: TenantId,
    ) -> Result<String, ApiError> {
        let username = Self::username(tenant);
        let mut secret = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut secret);
        let password = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret);
        let user = json!({
            "password_hash": rabbit_password_hash(&password),
            "hashing_algorithm": "rabbit_password_hashing_sha256",
            "tags": "",
        });
        self.put(http, &["users", &username], user).await?;
        let queue = tenant_queue(tenant.0);
        let permissions = json!({
            "configure": "^$",
            "write": "^$",
            "read": format!("^{}(\\.dead-letter)?$", queue.replace('.', "\\.")),
        });
        self.put(http, &["permissions", &self.vhost, &username], permissions)
            .await?;
        self.declare_queue(http, &queue).await?;
        self.ensure_dead_lettering(http).await?;
        self.declare_dead_letter_queue(http, tenant).await?;
        self.close_connections(http, &username).await?;
        Ok(password)
    }

    /// Declares `queue` as the publisher declares a tenant's (durable, quorum): the same
    /// arguments, so neither declaration refuses the other. Idempotent.
    async fn declare_queue(&self, http: &reqwest::Client, queue: &str) -> Result<(), ApiError> {
        let declaration = json!({
            "durable": true,
            "auto_delete": false,
            "arguments": {"x-queue-type": "quorum"},
        });
        self.put(http, &["queues", &self.vhost, queue], declaration)
            .await
    }

    /// Declares the dead-letter exchange and sets the two policies to [`DeadLetters`]'s
    /// values; idempotent, so every start of the control plane brings existing queues to the
    /// current settings.
    pub async fn ensure_dead_lettering(&self, http: &reqwest::Client) -> Result<(), ApiError> {
        let exchange = json!({"type": "direct", "durable": true, "auto_delete": false});
        self.put(
            http,
            &["exchanges", &self.vhost, DEAD_LETTER_EXCHANGE],
            exchange,
        )
        .await?;
        let tenant_queues = json!({
            "delivery-limit": self.dead_letters.delivery_limit,
            "dead-letter-exchange": DEAD_LETTER_EXCHANGE,
        });
        self.set_policy(
            http,
            TENANT_QUEUES_POLICY,
            TENANT_QUEUE_PATTERN,
            tenant_queues,
        )
        .await?;
        let dead_letter_queues = json!({
            "message-ttl": u64::try_from(self.dead_letters.retention.as_millis())
                .unwrap_or(u64::MAX),
        });
        self.set_policy(
            http,
            DEAD_LETTER_QUEUES_POLICY,
            DEAD_LETTER_QUEUE_PATTERN,
            dead_letter_queues,
        )
        .await
    }

    /// Sets the policy `name`: `definition` on every queue whose name matches `pattern`.
    async fn set_policy(
        &self,
        http: &reqwest::Client,
        name: &str,
        pattern: &str,
        definition: serde_json::Value,
    ) -> Result<(), ApiError> {
        let policy = json!({
            "pattern": pattern,
            "apply-to": "queues",
            "priority": POLICY_PRIORITY,
            "definition": definition,
        });
        self.put(http, &["policies", &self.vhost, name], policy)
            .await
    }

    /// Declares the tenant's dead-letter queue (durable, quorum) and binds it to the
    /// dead-letter exchange by the tenant queue's name; idempotent.
    pub async fn declare_dead_letter_queue(
        &self,
        http: &reqwest::Client,
        tenant: TenantId,
    ) -> Result<(), ApiError> {
        let queue = dead_letter_queue(tenant);
        self.declare_queue(http, &queue).await?;
        // Binding an existing binding again changes nothing.
        self.call(
            http,
            Method::POST,
            &[
                "bindings",
                &self.vhost,
                "e",
                DEAD_LETTER_EXCHANGE,
                "q",
                &queue,
            ],
            Some(json!({"routing_key": tenant_queue(tenant.0)})),
            false,
        )
        .await
    }

    /// Deletes the tenant's queue and dead-letter queue, with what they hold; absent ones are
    /// no error. Only once nothing publishes for the tenant: the publisher declares the queue
    /// again with its next change.
    pub async fn delete_queues(
        &self,
        http: &reqwest::Client,
        tenant: TenantId,
    ) -> Result<(), ApiError> {
        for queue in [tenant_queue(tenant.0), dead_letter_queue(tenant)] {
            self.delete(http, &["queues", &self.vhost, &queue]).await?;
        }
        Ok(())
    }

    /// Deletes the tenant's user (and with it its permissions), and ends its connections.
    pub async fn revoke(&self, http: &reqwest::Client, tenant: TenantId) -> Result<(), ApiError> {
        let username = Self::username(tenant);
        self.delete(http, &["users", &username]).await?;
        self.close_connections(http, &username).await
    }

    async fn close_connections(
        &self,
        http: &reqwest::Client,
        username: &str,
    ) -> Result<(), ApiError> {
        self.delete(http, &["connections", "username", username])
            .await
    }
}

/// RabbitMQ's `rabbit_password_hashing_sha256`: base64 of a 4-byte random salt followed by
/// SHA-256(salt ++ password).
fn rabbit_password_hash(password: &str) -> String {
    let mut salt = [0u8; 4];
    rand::thread_rng().fill_bytes(&mut salt);
    let digest = Sha256::new()
        .chain_update(salt)
        .chain_update(password.as_bytes())
        .finalize();
    let mut salted = salt.to_vec();
    salted.extend_from_slice(&digest);
    base64::engine::general_purpose::STANDARD.encode(salted)
}

/// Every address `host` resolves to, with `port`, within `timeout`.
pub async fn resolve(host: &str, port: u16, timeout: Duration) -> Result<Vec<SocketAddr>, String> {
    match tokio::time::timeout(timeout, tokio::net::lookup_host((host, port))).await {
        Ok(Ok(addresses)) => Ok(addresses.collect()),
        Ok(Err(error)) => Err(error.to_string()),
        Err(_) => Err(format!("timed out after {timeout:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relays_url_gives_the_vhost_and_the_management_defaults() {
        let access = BrokerAccess::new(
            "amqp://guest:gu%40st@127.0.0.1:5672/%2f",
            &ManagementSettings::default(),
            None,
            DestinationPolicy::default(),
        )
        .unwrap();
        assert_eq!(
            (access.host.as_str(), access.port, access.vhost.as_str()),
            ("127.0.0.1", 5672, "/")
        );
        assert_eq!(access.management_url.as_str(), "http://127.0.0.1:15672/");
        assert_eq!(access.management_password, "gu@st");
        assert_eq!(
            access
                .endpoint(&["permissions", "/", "relay-tenant-x"])
                .as_str(),
            "http://127.0.0.1:15672/api/permissions/%2F/relay-tenant-x"
        );
        assert!(!format!("{access:?}").contains("gu@st"));
        let named = BrokerAccess::new(
            "amqp://u:p@[::1]/relay-test-1",
            &ManagementSettings {
                url: Some("https://mq.example/admin/".into()),
                ..ManagementSettings::default()
            },
            Some("broker.example:5673".into()),
            DestinationPolicy::default(),
        )
        .unwrap();
        assert_eq!(
            (named.host.as_str(), named.port, named.vhost.as_str()),
            ("::1", 5672, "relay-test-1")
        );
        assert_eq!(
            named.endpoint(&["users", "a"]).as_str(),
            "https://mq.example/admin/api/users/a"
        );
        assert_eq!(
            named.address_for_tenants(),
            ("broker.example".to_owned(), 5673)
        );
    }

    #[test]
    fn the_password_hash_is_rabbitmqs_salted_sha256() {
        let hash = base64::engine::general_purpose::STANDARD
            .decode(rabbit_password_hash("secret"))
            .unwrap();
        assert_eq!(hash.len(), 4 + 32);
        let digest = Sha256::new()
            .chain_update(&hash[..4])
            .chain_update(b"secret")
            .finalize();
        assert_eq!(&hash[4..], digest.as_slice());
    }
}
