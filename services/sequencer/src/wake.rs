//! The fast path from the front tier to the sequencer: after a batch of messages commits, the
//! front tier publishes each endpoint's id on a Redis channel; every sequencer process listens.
//! Pub/sub loses what is sent while nobody listens, which is why the sequencer also sweeps
//! Postgres periodically: the wake-up only makes the common case quick.

use futures::StreamExt;
use redis::aio::ConnectionManager;
use tokio::sync::{mpsc, watch};
use uuid::Uuid;

/// The channel wake-ups go on, under the deployment's key prefix.
pub fn wake_channel(key_prefix: &str) -> String {
    format!("{key_prefix}wake")
}

/// Publishes wake-ups (the front tier's side).
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
    pub async fn connect(redis_url: &str, key_prefix: &str) -> Result<Self, redis::RedisError> {
        let client = redis::Client::open(redis_url)?;
        let redis = ConnectionManager::new(client).await?;
        Ok(Self {
            redis,
            channel: wake_channel(key_prefix),
        })
    }

    /// One PUBLISH per endpoint, pipelined in one round trip.
    pub async fn wake(&self, endpoints: &[Uuid]) -> Result<(), redis::RedisError> {
        if endpoints.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for endpoint in endpoints {
            pipe.cmd("PUBLISH")
                .arg(&self.channel)
                .arg(endpoint.to_string())
                .ignore();
        }
        pipe.query_async::<()>(&mut self.redis.clone()).await
    }
}

/// Listens for wake-ups until `stop`, reconnecting after errors, and forwards each endpoint id.
pub async fn listen(
    redis_url: String,
    channel: String,
    wakes: mpsc::UnboundedSender<Uuid>,
    mut stop: watch::Receiver<bool>,
) {
    let mut pause = std::time::Duration::from_millis(100);
    while !*stop.borrow() {
        match subscribe(&redis_url, &channel, &wakes, &mut stop).await {
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

async fn subscribe(
    redis_url: &str,
    channel: &str,
    wakes: &mpsc::UnboundedSender<Uuid>,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), redis::RedisError> {
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
                if let Ok(endpoint) = Uuid::parse_str(&payload) {
                    if wakes.send(endpoint).is_err() {
                        return Ok(());
                    }
                }
            }
            _ = stop.changed() => return Ok(()),
        }
    }
}
