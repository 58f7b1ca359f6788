//! The fast path from the front tier to the sequencer: after a batch of messages commits, the
//! front tier publishes each endpoint's id on a Redis channel; every sequencer process listens.
//! Pub/sub loses what is sent while nobody listens, which is why the sequencer also sweeps
//! Postgres periodically: the wake-up only makes the common case quick.
//!
//! The same mechanism carries the sequencer's own news to the publisher: after a transaction
//! that appended changes commits, the sequencer publishes `<tenant>:<endpoint>` on
//! [`changes_channel`], so the publisher reads that endpoint's new changes at once instead of
//! waiting for its poll.

use futures::StreamExt;
use redis::aio::ConnectionManager;
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
pub fn change_payload(tenant: Uuid, endpoint: Uuid) -> String {
    format!("{tenant}:{endpoint}")
}

/// Reads a change announcement back: `(tenant, endpoint)`.
pub fn parse_change_payload(payload: &str) -> Option<(Uuid, Uuid)> {
    let (tenant, endpoint) = payload.split_once(':')?;
    Some((
        Uuid::parse_str(tenant).ok()?,
        Uuid::parse_str(endpoint).ok()?,
    ))
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
    pub async fn connect(redis_url: &str, key_prefix: &str) -> Result<Self, redis::RedisError> {
        Self::connect_channel(redis_url, wake_channel(key_prefix)).await
    }

    /// A waker publishing on `channel`.
    pub async fn connect_channel(
        redis_url: &str,
        channel: String,
    ) -> Result<Self, redis::RedisError> {
        let client = redis::Client::open(redis_url)?;
        let redis = ConnectionManager::new(client).await?;
        Ok(Self { redis, channel })
    }

    /// One PUBLISH per endpoint, pipelined in one round trip.
    pub async fn wake(&self, endpoints: &[Uuid]) -> Result<(), redis::RedisError> {
        let payloads: Vec<String> = endpoints.iter().map(Uuid::to_string).collect();
        self.publish(&payloads).await
    }

    /// One PUBLISH per payload, pipelined in one round trip.
    pub async fn publish(&self, payloads: &[String]) -> Result<(), redis::RedisError> {
        if payloads.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for payload in payloads {
            pipe.cmd("PUBLISH").arg(&self.channel).arg(payload).ignore();
        }
        pipe.query_async::<()>(&mut self.redis.clone()).await
    }
}

/// Listens for wake-ups until `stop`, reconnecting after errors, and forwards each endpoint id.
pub async fn listen(
    redis_url: String,
    channel: String,
    wakes: mpsc::UnboundedSender<Uuid>,
    stop: watch::Receiver<bool>,
) {
    listen_parsed(redis_url, channel, wakes, stop, |p| Uuid::parse_str(p).ok()).await
}

/// Listens on `channel` until `stop`, reconnecting after errors, and forwards every payload that
/// `parse` reads (the others are dropped).
pub async fn listen_parsed<T, F>(
    redis_url: String,
    channel: String,
    wakes: mpsc::UnboundedSender<T>,
    mut stop: watch::Receiver<bool>,
    parse: F,
) where
    F: Fn(&str) -> Option<T>,
{
    let mut pause = std::time::Duration::from_millis(100);
    while !*stop.borrow() {
        match subscribe(&redis_url, &channel, &wakes, &mut stop, &parse).await {
            Ok(()) => return,
            Err(error) => {
                tracing::warn!(%error, "wake-up subscription failed; the sweep covers until it is back");
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.changed() => return,
                }
                pause = (pause * 2).min(std::time::Duration::from_secs(5));
            }
        }
    }
}

async fn subscribe<T, F>(
    redis_url: &str,
    channel: &str,
    wakes: &mpsc::UnboundedSender<T>,
    stop: &mut watch::Receiver<bool>,
    parse: &F,
) -> Result<(), redis::RedisError>
where
    F: Fn(&str) -> Option<T>,
{
    let client = redis::Client::open(redis_url)?;
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
                if let Some(wake) = parse(&payload) {
                    if wakes.send(wake).is_err() {
                        return Ok(());
                    }
                }
            }
            _ = stop.changed() => return Ok(()),
        }
    }
}
