//! AMQP: connecting (lapin on tokio), the tenant's queue, and confirmed publishes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::publisher_confirm::{Confirmation, PublisherConfirm};
use lapin::tcp::{HandshakeResult, RustlsConnector, TcpStream};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use relay_netguard::{CertificateFailure, TrustRoots};
use relay_rules::{DestinationPolicy, Refusal};
use relay_store::destinations::Destination;
use relay_store::SecretText;
use uuid::Uuid;

use crate::message::CONTENT_TYPE;
use crate::outbox::OutboxChange;

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    #[error("not an AMQP URL: {0}")]
    Url(String),
    #[error("the relay's broker is down: {0}")]
    Down(String),
    #[error("{0} publishes neither confirmed nor refused")]
    Unconfirmed(u64),
    #[error("{0} timed out after {1:?}")]
    Timeout(&'static str, Duration),
    /// The tenant's destination points where tenants may not send (see [`checked_uri`]).
    #[error("destination refused: {0}")]
    Refused(#[from] Refusal),
    #[error("resolving {0}: {1}")]
    Resolve(String, String),
}

impl BrokerError {
    /// The certificate check that refused the broker, when that is why connecting failed.
    pub fn certificate_failure(&self) -> Option<CertificateFailure> {
        relay_netguard::certificate_failure(self)
    }

    /// What went wrong, with every cause under it; a refused certificate first says which
    /// check refused it (`the certificate's issuer is not a trusted CA (unknown_issuer): ...`).
    pub fn describe(&self) -> String {
        let chain = relay_netguard::error_chain(self);
        match self.certificate_failure() {
            Some(failure) => format!("{failure} ({}): {chain}", failure.as_str()),
            None => chain,
        }
    }
}

/// The queue the relay declares for a tenant without a destination of its own.
pub fn tenant_queue(tenant: Uuid) -> String {
    format!("relay.tenant.{tenant}")
}

/// The heartbeat asked for when the URL names none: a connection that went silent (a broker
/// host gone, a network that drops packets) is closed by lapin after two of these.
const HEARTBEAT_S: u16 = 10;

/// The URLs of a broker setting: one URL, or the nodes of a cluster separated by commas (a
/// comma cannot appear unescaped in an AMQP URL), each tried in turn.
pub fn broker_urls(setting: &str) -> Vec<&str> {
    setting
        .split(',')
        .map(str::trim)
        .filter(|url| !url.is_empty())
        .collect()
}

/// Connects to `url` (`amqp://`, or `amqps://` checked against `trust`) with lapin's IO and
/// tasks on the current tokio runtime, within `timeout`.
///
/// lapin runs each connection's IO on a thread of its own, which our timeout does not stop; so
/// the URL's own bounds are set too (unless it names them): the TCP connect gives up after
/// `timeout`, and an established connection that stops answering ends by the heartbeat.
pub async fn connect(
    url: &str,
    name: &str,
    timeout: Duration,
    trust: &TrustRoots,
) -> Result<Connection, BrokerError> {
    let uri: AMQPUri = url.parse().map_err(BrokerError::Url)?;
    let server_name = bare_host(&uri);
    connect_uri(uri, Peer::Named, &server_name, name, timeout, trust).await
}

/// Connects to the first node of `setting` ([`broker_urls`]) that answers, starting from
/// `first` (the node that answered last time, so a dead node is not tried before it on every
/// reconnect), each within `timeout`: the connection and which node it reached.
pub async fn connect_any(
    setting: &str,
    first: usize,
    name: &str,
    timeout: Duration,
    trust: &TrustRoots,
) -> Result<(Connection, usize), BrokerError> {
    let urls = broker_urls(setting);
    if urls.is_empty() {
        return Err(BrokerError::Url("no broker URL".to_owned()));
    }
    let mut failures = Vec::new();
    for offset in 0..urls.len() {
        let node = (first + offset) % urls.len();
        match connect(urls[node], name, timeout, trust).await {
            Ok(connection) => return Ok((connection, node)),
            Err(error) if urls.len() == 1 => return Err(error),
            Err(error) => failures.push(format!("node {}: {}", node + 1, error.describe())),
        }
    }
    Err(BrokerError::Down(failures.join("; ")))
}

/// Where the TCP connection goes.
#[derive(Debug, Clone)]
enum Peer {
    /// To the URL's host, resolved as the connection is made.
    Named,
    /// To the first of these addresses that answers, resolved and checked beforehand.
    Checked(Vec<SocketAddr>),
}

/// The URL's host without an IPv6 address's brackets: the name its certificate must carry.
fn bare_host(uri: &AMQPUri) -> String {
    uri.authority
        .host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned()
}

/// Connects to `peer`; over `amqps://`, TLS checks the certificate against `trust` for
/// `server_name` (the host the tenant or the operator named, also when `peer` is the address
/// it was resolved to).
async fn connect_uri(
    mut uri: AMQPUri,
    peer: Peer,
    server_name: &str,
    name: &str,
    timeout: Duration,
    trust: &TrustRoots,
) -> Result<Connection, BrokerError> {
    let tcp_timeout = *uri
        .query
        .connection_timeout
        .get_or_insert(timeout.as_millis().max(1) as u64);
    let tcp_timeout = Duration::from_millis(tcp_timeout);
    uri.query.heartbeat.get_or_insert(HEARTBEAT_S);
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current())
        .with_connection_name(LongString::from(name.to_owned()));
    let tls = RustlsConnector::from(Arc::new(trust.client_config()));
    let server_name = server_name.to_owned();
    // Runs on lapin's IO thread, blocking: the TLS handshake is bounded by the socket's own
    // timeouts, so a broker that accepts TCP and then says nothing frees the thread.
    // The result type is lapin's (`Connection::connector`), large as it is.
    #[allow(clippy::result_large_err)]
    let open = move |uri: &AMQPUri| -> HandshakeResult {
        let stream = match &peer {
            Peer::Checked(addresses) => TcpStream::connect_timeout(&addresses[..], tcp_timeout)?,
            Peer::Named => TcpStream::connect_timeout(
                (uri.authority.host.as_str(), uri.authority.port),
                tcp_timeout,
            )?,
        };
        let stream = match uri.scheme {
            AMQPScheme::AMQP => stream,
            AMQPScheme::AMQPS => {
                stream.set_read_timeout(Some(tcp_timeout))?;
                stream.set_write_timeout(Some(tcp_timeout))?;
                let stream = stream.into_rustls(&tls, &server_name)?;
                stream.set_read_timeout(None)?;
                stream.set_write_timeout(None)?;
                stream
            }
        };
        stream.set_nonblocking(true)?;
        Ok(stream)
    };
    tokio::time::timeout(
        timeout,
        Connection::connector(uri, Box::new(open), properties),
    )
    .await
    .map_err(|_| BrokerError::Timeout("connecting", timeout))?
    .map_err(BrokerError::from)
}

/// Every address `uri`'s host resolves to, with its port, within `timeout`.
async fn resolve(uri: &AMQPUri, timeout: Duration) -> Result<Vec<SocketAddr>, BrokerError> {
    let (host, port) = (uri.authority.host.clone(), uri.authority.port);
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let failed = |error: String| BrokerError::Resolve(host.clone(), error);
    let lookup = tokio::net::lookup_host((host.clone(), port));
    match tokio::time::timeout(timeout, lookup).await {
        Ok(Ok(addresses)) => Ok(addresses.collect()),
        Ok(Err(error)) => Err(failed(error.to_string())),
        Err(_) => Err(failed(format!("timed out after {timeout:?}"))),
    }
}

/// A tenant's own broker, checked against `policy` and every node of the relay's own broker
/// (`relay_setting`, [`broker_urls`]) after resolving both: the URI, and the addresses that were checked, which the connection is
/// made to, so that lapin cannot resolve the name again to somewhere else (a DNS answer that
/// changed since the control plane accepted the destination, or changes between check and
/// connect). TLS still checks the certificate for the URL's host name.
pub async fn checked_uri(
    url: &str,
    relay_setting: &str,
    policy: &DestinationPolicy,
    timeout: Duration,
) -> Result<(AMQPUri, Vec<SocketAddr>), BrokerError> {
    let uri: AMQPUri = url.parse().map_err(BrokerError::Url)?;
    let host = uri.authority.host.to_ascii_lowercase();
    policy.check_host(host.trim_start_matches('[').trim_end_matches(']'))?;
    let resolved = resolve(&uri, timeout).await?;
    let mut relay_addresses = Vec::new();
    for relay_url in broker_urls(relay_setting) {
        let relay: AMQPUri = relay_url.parse().map_err(BrokerError::Url)?;
        relay_addresses.extend(resolve(&relay, timeout).await?);
    }
    policy.check(
        host.trim_start_matches('[').trim_end_matches(']'),
        &resolved,
        &relay_addresses,
    )?;
    Ok((uri, resolved))
}

/// Declares `relay.tenant.<id>`: durable, quorum (replicated, and it survives a broker restart
/// with its messages, which are persistent). Idempotent when the queue exists as declared.
pub async fn declare_tenant_queue(channel: &Channel, queue: &str) -> Result<(), BrokerError> {
    let mut arguments = FieldTable::default();
    arguments.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    channel
        .queue_declare(
            queue,
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await?;
    Ok(())
}

/// Where one tenant's messages go, resolved from its [`Destination`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Holds the broker's password: shown only through `redact`.
    pub url: SecretText,
    pub exchange: String,
    pub routing_key: String,
    /// The queue to declare before publishing (the relay's own queue only).
    pub declare: Option<String>,
}

impl Target {
    pub fn resolve(tenant: Uuid, destination: &Destination, relay_amqp_url: &str) -> Self {
        match destination {
            Destination::RelayQueue => {
                let queue = tenant_queue(tenant);
                Target {
                    url: SecretText::new(relay_amqp_url),
                    exchange: String::new(),
                    routing_key: queue.clone(),
                    declare: Some(queue),
                }
            }
            Destination::OwnExchange {
                amqp_url,
                exchange,
                routing_key,
            } => Target {
                url: amqp_url.clone(),
                exchange: exchange.clone(),
                routing_key: routing_key.clone(),
                declare: None,
            },
        }
    }

    /// The relay's own queue: published over the connection every such tenant shares.
    fn on_relay_broker(&self) -> bool {
        self.declare.is_some()
    }
}

/// The relay's own broker: one connection for every tenant whose queue is there, each tenant on
/// a channel of its own. lapin gives each connection an OS thread, so a connection per tenant
/// would cost a thread per tenant; and they all reach the same broker, so they would all fail
/// together anyway. (A tenant's own broker gets a connection per tenant: those fail one by one.)
pub struct RelayBroker {
    /// RELAY_AMQP_URL: one URL, or the cluster's nodes ([`broker_urls`]).
    url: String,
    timeout: Duration,
    /// The roots `amqps://` brokers (the relay's, and tenants' own) are checked against.
    trust: TrustRoots,
    current: tokio::sync::Mutex<Current>,
}

#[derive(Default)]
struct Current {
    connection: Option<Arc<Connection>>,
    /// The node the last connection reached: tried first next time.
    node: usize,
    /// The last failed connect: tenants that queued behind it fail at once rather than each
    /// wait a connect timeout of its own in turn.
    failed: Option<(std::time::Instant, String)>,
}

impl RelayBroker {
    pub fn new(url: String, timeout: Duration, trust: TrustRoots) -> Self {
        Self {
            url,
            timeout,
            trust,
            current: tokio::sync::Mutex::new(Current::default()),
        }
    }

    /// The open connection, or a new one (one tenant connects; the others wait for it).
    async fn get(&self) -> Result<Arc<Connection>, BrokerError> {
        let mut current = self.current.lock().await;
        if let Some(connection) = current.connection.as_ref() {
            if connection.status().connected() {
                return Ok(connection.clone());
            }
        }
        if let Some(old) = current.connection.take() {
            // The node it reached went away or stopped answering: the others first.
            current.node += 1;
            tokio::spawn(async move { close_quietly(&old).await });
        }
        if let Some((at, error)) = &current.failed {
            if at.elapsed() < self.timeout.min(Duration::from_secs(1)) {
                return Err(BrokerError::Down(error.clone()));
            }
        }
        let first = current.node;
        match connect_any(
            &self.url,
            first,
            "relay-publisher",
            self.timeout,
            &self.trust,
        )
        .await
        {
            Ok((connection, node)) => {
                if node != first {
                    tracing::warn!(
                        node = node + 1,
                        "the relay's broker: connected to another node"
                    );
                }
                let connection = Arc::new(connection);
                current.connection = Some(connection.clone());
                current.node = node;
                current.failed = None;
                Ok(connection)
            }
            Err(error) => {
                current.failed = Some((std::time::Instant::now(), error.describe()));
                Err(error)
            }
        }
    }

    /// Drops the connection if it is still `suspect` (a publish on it timed out: it may be
    /// dead without knowing it yet), so that the next tenant to publish connects anew.
    async fn invalidate(&self, suspect: &Arc<Connection>) {
        let mut current = self.current.lock().await;
        if current
            .connection
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(c, suspect))
        {
            if let Some(old) = current.connection.take() {
                current.node += 1;
                tokio::spawn(async move { close_quietly(&old).await });
            }
        }
    }

    pub async fn close(&self) {
        if let Some(connection) = self.current.lock().await.connection.take() {
            close_quietly(&connection).await;
        }
    }
}

/// A connection to a tenant's own broker: the first of its nodes ([`broker_urls`]) that
/// answers, each checked first. One node the policy refuses refuses the destination: it is the
/// tenant's setting that is wrong, whichever node is up.
async fn connect_own(
    setting: &str,
    tenant: Uuid,
    relay: &RelayBroker,
    policy: &DestinationPolicy,
    timeout: Duration,
) -> Result<Connection, BrokerError> {
    let name = format!("relay-publisher {tenant}");
    let mut failure = BrokerError::Url("no broker URL".to_owned());
    for url in broker_urls(setting) {
        let (uri, addresses) = match checked_uri(url, &relay.url, policy, timeout).await {
            Ok(checked) => checked,
            Err(refused @ BrokerError::Refused(_)) => return Err(refused),
            Err(error) => {
                failure = error;
                continue;
            }
        };
        let server_name = bare_host(&uri);
        let peer = Peer::Checked(addresses);
        match connect_uri(uri, peer, &server_name, &name, timeout, &relay.trust).await {
            Ok(connection) => return Ok(connection),
            Err(error) => failure = error,
        }
    }
    Err(failure)
}

/// A tenant's channel in confirm mode, on the relay's shared connection or on a connection of
/// its own to the tenant's broker.
pub struct Link {
    connection: Arc<Connection>,
    shared: bool,
    channel: Channel,
    pub target: Target,
}

impl Link {
    /// Connects (or takes the relay's shared connection), opens a channel in confirm mode, and
    /// declares the tenant's queue when it is the relay's; each step within `timeout`.
    pub async fn open(
        target: Target,
        tenant: Uuid,
        relay: &RelayBroker,
        policy: &DestinationPolicy,
        timeout: Duration,
    ) -> Result<Self, BrokerError> {
        let shared = target.on_relay_broker();
        let connection = if shared {
            relay.get().await?
        } else {
            Arc::new(connect_own(target.url.expose(), tenant, relay, policy, timeout).await?)
        };
        let setup = async {
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            if let Some(queue) = &target.declare {
                declare_tenant_queue(&channel, queue).await?;
            }
            Ok::<_, BrokerError>(channel)
        };
        let failure = match tokio::time::timeout(timeout, setup).await {
            Ok(Ok(channel)) => {
                return Ok(Self {
                    connection,
                    shared,
                    channel,
                    target,
                })
            }
            Ok(Err(error)) => error,
            Err(_) => BrokerError::Timeout("opening the channel", timeout),
        };
        if !shared {
            close_quietly(&connection).await;
        } else if matches!(failure, BrokerError::Timeout(..)) {
            relay.invalidate(&connection).await;
        }
        Err(failure)
    }

    /// Whether the connection and channel are still open (the broker closes a channel on a
    /// soft error, e.g. a publish to an exchange that does not exist).
    pub fn is_open(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }

    /// Declares the tenant's queue again (after a publish came back unroutable: deleted).
    pub async fn redeclare(&self, timeout: Duration) -> Result<(), BrokerError> {
        let Some(queue) = &self.target.declare else {
            return Ok(());
        };
        tokio::time::timeout(timeout, declare_tenant_queue(&self.channel, queue))
            .await
            .map_err(|_| BrokerError::Timeout("declaring the queue", timeout))?
    }

    /// Closes the channel, and the connection unless it is the shared one.
    pub async fn close(self) {
        if self.shared {
            let close = self.channel.close(200, "bye");
            let _ = tokio::time::timeout(Duration::from_secs(1), close).await;
        } else {
            close_quietly(&self.connection).await;
        }
    }

    /// Closes after `error`. A timeout means the connection itself may be dead: the shared one
    /// is dropped too, and whoever publishes next connects anew.
    pub async fn close_after(self, error: &BrokerError, relay: &RelayBroker) {
        if self.shared && matches!(error, BrokerError::Timeout(..)) {
            relay.invalidate(&self.connection).await;
        }
        self.close().await;
    }
}

async fn close_quietly(connection: &Connection) {
    // A broker that is gone does not answer the close; the socket goes with the connection.
    let _ = tokio::time::timeout(Duration::from_secs(1), connection.close(200, "bye")).await;
}

/// What became of one publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Acked, not returned: the broker has it. Only these are marked published.
    Confirmed,
    Nacked,
    /// Acked but returned as unroutable (the mandatory flag): it reached no queue.
    Returned,
    /// Not sent, or no confirm came (the connection or channel failed, or the confirm timed
    /// out): the broker may or may not have it.
    Unknown,
}

/// The AMQP properties of a change's message.
pub fn properties(change: &OutboxChange) -> BasicProperties {
    let message = &change.message;
    BasicProperties::default()
        .with_message_id(ShortString::from(message.message_id()))
        .with_content_type(ShortString::from(CONTENT_TYPE))
        .with_type(ShortString::from(message.amqp_type()))
        .with_timestamp(change.created_at.unix_timestamp().max(0) as u64)
        .with_delivery_mode(2)
        .with_app_id(ShortString::from("relay"))
}

/// Hands one change to the broker (persistent, mandatory), within `timeout`. The returned
/// confirm resolves when the broker acks, nacks or returns it (see [`classify`]).
pub fn publish(
    link: &Link,
    change: &OutboxChange,
    timeout: Duration,
) -> impl std::future::Future<Output = Result<PublisherConfirm, BrokerError>> + Send + 'static {
    // Everything is taken from `link` and `change` now, so the future owns what it needs and
    // the caller can keep many in flight without awaiting each in turn.
    let channel = link.channel.clone();
    let (exchange, routing_key) = (
        link.target.exchange.clone(),
        link.target.routing_key.clone(),
    );
    let body = change.message.encode();
    let properties = properties(change);
    async move {
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let send = channel.basic_publish(&exchange, &routing_key, options, &body, properties);
        match tokio::time::timeout(timeout, send).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(BrokerError::Timeout("publishing", timeout)),
        }
    }
}

/// What a confirm says of its publish.
pub fn classify(confirmation: Confirmation) -> Outcome {
    match confirmation {
        Confirmation::Ack(None) => Outcome::Confirmed,
        Confirmation::Ack(Some(_)) => Outcome::Returned,
        Confirmation::Nack(_) => Outcome::Nacked,
        // Confirm mode is set on every channel opened here; one without it tells nothing.
        Confirmation::NotRequested => Outcome::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_url_names_the_root_vhost() {
        let uri: AMQPUri = crate::config::DEFAULT_AMQP_URL.parse().unwrap();
        assert_eq!(uri.vhost, "/");
        assert_eq!(uri.authority.port, 5672);
    }
}
