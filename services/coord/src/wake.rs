//! The fast path from the front tier to the sequencer: after a batch of messages commits, the
//! front tier publishes the endpoints' ids on a Redis channel; every sequencer process listens.
//! One message carries a whole batch's ids, separated by spaces (see [`Waker::publish`]): a
//! message per endpoint cost Redis, the publishing process and every listener a frame each, as
//! many as there are messages.
//! Pub/sub loses what is sent while nobody listens, which is why the sequencer also sweeps
//! Postgres periodically: the wake-up only makes the common case quick.
//!
//! The same mechanism carries the sequencer's own news to the publisher: after a transaction
//! that appended changes commits, the sequencer publishes `<tenant>:<endpoint>` on
//! [`changes_channel`], so the publisher reads that endpoint's new changes at once instead of
//! waiting for its poll.

use futures::StreamExt;
use redis::aio::ConnectionManager;
use relay_netguard::{RetryPolicy, TrustRoots};
use relay_store::{EndpointId, TenantId};
use tokio::sync::{mpsc, watch};
use uuid::Uuid;

/// The channel wake-ups go on, under the deployment's key prefix.
pub fn wake_channel(key_prefix: &str) -> String {
    format!("{key_prefix}wake")
}

/// The channel on which the sequencer announces new changes (`<tenant>:<endpoint>`).
pub fn changes_channel(key_prefix: &str) -> String {
    format!("{key_prefix}changes")
}

/// The payload of a change announcement.
pub fn change_payload(tenant: TenantId, endpoint: EndpointId) -> String {
    format!("{tenant}:{endpoint}")
}

/// Reads a change announcement back: `(tenant, endpoint)`.
pub fn parse_change_payload(payload: &str) -> Option<(TenantId, EndpointId)> {
    let (tenant, endpoint) = payload.split_once(':')?;
    Some((tenant.parse().ok()?, endpoint.parse().ok()?))
}

/// Publishes wake-ups: the front tier's to the sequencer, the sequencer's to the publisher.
#[derive(Clone)]
pub struct Waker {
    redis: ConnectionManager,
    channel: String,
}

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waker")
            .field("channel", &self.channel)
            .finish_non_exhaustive()
    }
}

impl Waker {
    /// The front tier's waker: endpoint ids on [`wake_channel`].
    pub async fn connect(
        redis_url: &str,
        trust: &TrustRoots,
        key_prefix: &str,
    ) -> Result<Self, redis::RedisError> {
        Self::connect_channel(redis_url, trust, wake_channel(key_prefix)).await
    }

    /// A waker publishing on `channel`.
    pub async fn connect_channel(
        redis_url: &str,
        trust: &TrustRoots,
        channel: String,
    ) -> Result<Self, redis::RedisError> {
        let client = crate::redis_client::open_redis(redis_url, trust)?;
        let redis = crate::redis_client::connection_manager(client, WAKE_TIMEOUT).await?;
        Ok(Self { redis, channel })
    }

    /// Wakes the listeners for `endpoints` (see [`Waker::publish`]).
    pub async fn wake(&self, endpoints: &[Uuid]) -> Result<(), redis::RedisError> {
        let payloads: Vec<String> = endpoints.iter().map(Uuid::to_string).collect();
        self.publish(&payloads).await
    }

    /// Publishes `payloads` (none may contain a space) in one round trip: joined by spaces into
    /// as few messages as `PAYLOADS_PER_MESSAGE` allows. [`listen_parsed`] reads each message
    /// back.
    pub async fn publish(&self, payloads: &[String]) -> Result<(), redis::RedisError> {
        if payloads.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for chunk in payloads.chunks(PAYLOADS_PER_MESSAGE) {
            pipe.cmd("PUBLISH")
                .arg(&self.channel)
                .arg(chunk.join(" "))
                .ignore();
        }
        pipe.query_async::<()>(&mut self.redis.clone()).await
    }
}

/// How long a wake-up's connect or publish may take: it is a hint (the sweep finds the work
/// anyway), so a Redis that stopped answering is given up on quickly.
const WAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// The most payloads one published message joins: a front-tier batch's endpoints (256 at
/// most by default) fit in one message of about 9 kB.
const PAYLOADS_PER_MESSAGE: usize = 512;

/// The payloads one published message carries. A message of one payload (what earlier versions
/// sent) reads the same way.
fn split_payloads(message: &str) -> impl Iterator<Item = &str> {
    message.split(' ').filter(|payload| !payload.is_empty())
}

/// Listens for wake-ups until `stop`, reconnecting after errors, and forwards each endpoint id.
pub async fn listen(
    redis_url: String,
    trust: TrustRoots,
    channel: String,
    wakes: mpsc::UnboundedSender<Uuid>,
    stop: watch::Receiver<bool>,
) {
    listen_parsed(redis_url, trust, channel, wakes, stop, |p| {
        Uuid::parse_str(p).ok()
    })
    .await
}

/// The pauses between attempts to subscribe again: short at first (a Redis restart is over in
/// moments), never long (the sweep covers meanwhile, but more slowly).
const RESUBSCRIBE: RetryPolicy = RetryPolicy {
    first: std::time::Duration::from_millis(100),
    max: std::time::Duration::from_secs(5),
};

/// Listens on `channel` until `stop`, reconnecting after errors, and forwards every payload (of
/// every message, see [`Waker::publish`]) that `parse` reads (the others are dropped).
pub async fn listen_parsed<T, F>(
    redis_url: String,
    trust: TrustRoots,
    channel: String,
    wakes: mpsc::UnboundedSender<T>,
    mut stop: watch::Receiver<bool>,
    parse: F,
) where
    F: Fn(&str) -> Option<T>,
{
    let mut pauses = RESUBSCRIBE.pauses();
    while !*stop.borrow() {
        match subscribe(&redis_url, &trust, &channel, &wakes, &mut stop, &parse).await {
            Ok(()) => return,
            Err(error) => {
                let error = relay_netguard::error_chain(&error);
                tracing::warn!(%error, "wake-up subscription failed; the sweep covers until it is back");
                tokio::select! {
                    _ = tokio::time::sleep(pauses.next_pause()) => {}
                    _ = stop.changed() => return,
                }
            }
        }
    }
}

async fn subscribe<T, F>(
    redis_url: &str,
    trust: &TrustRoots,
    channel: &str,
    wakes: &mpsc::UnboundedSender<T>,
    stop: &mut watch::Receiver<bool>,
    parse: &F,
) -> Result<(), redis::RedisError>
where
    F: Fn(&str) -> Option<T>,
{
    let client = crate::redis_client::open_redis(redis_url, trust)?;
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(channel).await?;
    let mut messages = pubsub.on_message();
    loop {
        tokio::select! {
            message = messages.next() => {
                let Some(message) = message else {
                    return Err(redis::RedisError::from((
                        redis::ErrorKind::IoError,
                        "wake-up subscription closed",
                    )));
                };
                let payload: String = message.get_payload()?;
                for wake in split_payloads(&payload).filter_map(parse) {
                    if wakes.send(wake).is_err() {
                        return Ok(());
                    }
                }
            }
            _ = stop.changed() => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_carries_many_payloads_and_one_alone_reads_as_before() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let joined = [
            change_payload(TenantId(a), EndpointId(b)),
            change_payload(TenantId(b), EndpointId(a)),
        ]
        .join(" ");
        let read: Vec<_> = split_payloads(&joined)
            .filter_map(parse_change_payload)
            .collect();
        assert_eq!(
            read,
            vec![(TenantId(a), EndpointId(b)), (TenantId(b), EndpointId(a))]
        );
        let alone: Vec<_> = split_payloads(&a.to_string())
            .filter_map(|p| Uuid::parse_str(p).ok())
            .collect();
        assert_eq!(alone, vec![a]);
        assert_eq!(split_payloads("").count(), 0);
    }
}
