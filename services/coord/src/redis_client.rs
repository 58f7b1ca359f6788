//! Opening Redis: one place that turns the operator's `RELAY_REDIS_URL` and TLS trust into a
//! client, for every tier that talks to Redis (the sequencer's leases and wake-ups, the front
//! tier's waker, the publisher's leases and its listener).
//!
//! `redis://host:port` is plain TCP; `rediss://host:port` is TLS, checked against the
//! platform's roots, or, when the operator gave a CA file, against the platform's roots and
//! that file's (the Redis client takes one bundle that replaces the platform's roots, hence
//! [`TrustRoots::bundle_pem`], which holds both). There is no way to skip the check.

use redis::{ConnectionAddr, IntoConnectionInfo as _, TlsCertificates};
use relay_netguard::TrustRoots;

/// Where Redis is unless the operator says otherwise: the local default port.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// Prefix of every Redis key and channel a deployment uses unless the operator sets another
/// (several deployments, or tests, can then share one Redis).
pub const DEFAULT_KEY_PREFIX: &str = "relay:";

/// A Redis client for `url`, trusting `trust` when the URL asks for TLS.
pub fn open_redis(url: &str, trust: &TrustRoots) -> redis::RedisResult<redis::Client> {
    let info = url.into_connection_info()?;
    match (&info.addr, trust.bundle_pem()) {
        (ConnectionAddr::TcpTls { .. }, Some(bundle)) => redis::Client::build_with_tls(
            info,
            TlsCertificates {
                client_tls: None,
                root_cert: Some(bundle),
            },
        ),
        _ => redis::Client::open(info),
    }
}

/// The longest pause between reconnects of a kept connection to Redis.
const RECONNECT_MAX_PAUSE_MS: u64 = 1_000;

/// A kept connection to Redis that reconnects by itself, each connect and each command bounded
/// by `timeout`, pausing at most [`RECONNECT_MAX_PAUSE_MS`] (with jitter) between reconnects.
/// The redis crate's default multiplies each pause by 100 (its retry factor), capped at 60 s:
/// one failed reconnect then leaves leases unrenewable and wake-ups unsent for a minute after
/// Redis is back (the fault campaign saw 92 s).
pub async fn connection_manager(
    client: redis::Client,
    timeout: std::time::Duration,
) -> redis::RedisResult<redis::aio::ConnectionManager> {
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_factor(2)
        .set_max_delay(RECONNECT_MAX_PAUSE_MS)
        .set_connection_timeout(timeout)
        .set_response_timeout(timeout);
    redis::aio::ConnectionManager::new_with_config(client, config).await
}

/// Whether Redis at `url` answers a PING on a connection of its own (a readiness probe: the
/// tiers' shared connections may be busy, or reconnecting, and say nothing of a new one).
pub async fn redis_answers(url: &str, trust: &TrustRoots) -> redis::RedisResult<()> {
    let client = open_redis(url, trust)?;
    let mut connection = client.get_multiplexed_async_connection().await?;
    redis::cmd("PING")
        .query_async::<String>(&mut connection)
        .await
        .map(drop)
}
