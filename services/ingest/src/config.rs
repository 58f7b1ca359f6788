//! The front tier's settings. The binary fills them from flags and `RELAY_*` variables; the
//! defaults here are the documented ones.

use std::time::Duration;

use relay_listener::ListenerLimits;

/// The webhook listener's bounds. A head takes the upstream one write; a 1 MiB body at 5 s
/// still needs only 200 kB/s; past 4,096 connections at once (the upstream holds one per message
/// in flight) a new one is answered 503 rather than taking a file descriptor. One client holds
/// at most 1,024 connections, a quarter of the listener, whatever they do (the upstream holds
/// one per endpoint it is sending to, and a 503 with Retry-After only delays its message), and
/// at most 256 that have not sent their head yet: the upstream sends its head the moment it
/// connects, so only a burst of that many new connections in the same instant meets the bound,
/// while a slow client can hold no more than a sixteenth of the listener. A kept-alive
/// connection waits 5 s idle.
pub const LISTENER_LIMITS: ListenerLimits = ListenerLimits {
    header_read_timeout: Duration::from_secs(5),
    body_read_timeout: Duration::from_secs(5),
    idle_timeout: Duration::from_secs(5),
    max_connections: 4096,
    max_headless_per_address: 256,
    max_connections_per_client: 1024,
    client_address: relay_listener::ClientAddressFrom::Peer,
};

/// Each setting's default, written once: [`IngestConfig::default`] and relay's command line both
/// take them from here.
pub mod defaults {
    pub const ANSWER_DEADLINE_MS: u64 = 10_000;
    pub const RETRY_AFTER_S: u64 = 5;
    pub const WRITERS: usize = 2;
    pub const BATCH_MAX_MESSAGES: usize = 256;
    /// A batch waits at most this long for more messages (relay-coord's `Linger`: while one is
    /// being verified, or while they arrive closer together than this and waiting has been
    /// gaining some): a few commits' time, well inside any answer deadline, and nothing at a
    /// trickle or for a lone sender.
    pub const BATCH_LINGER_US: u64 = 5_000;
    pub const ENDPOINT_CACHE_TTL_S: u64 = 60;
    pub const ENDPOINT_CACHE_MAX_ENTRIES: usize = 100_000;
}

#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// Bodies larger than this are refused with 413 without being read further. The wire file
    /// requires accepting up to its max_body_bytes (1 MiB).
    pub max_body_bytes: usize,
    /// Every request is answered within this long of its arrival; a message not committed by
    /// then gets 503. Kept well inside the upstream's 15 s send timeout.
    pub answer_deadline: Duration,
    /// The Retry-After (seconds) sent with a 503.
    pub retry_after: Duration,
    /// Concurrent batch writers (each holds one connection while it writes).
    pub writers: usize,
    /// The most messages one transaction stores.
    pub batch_max_messages: usize,
    /// How long a batch may wait for more messages: see relay-coord's `Linger`.
    pub batch_linger: Duration,
    /// The most body bytes one transaction stores (a batch is closed once it passes this).
    pub batch_max_bytes: usize,
    /// Messages waiting for a writer, at most; further requests wait for room.
    pub queue_capacity: usize,
    /// How long an endpoint stays cached while change notifications are flowing.
    /// Zero disables the cache.
    pub endpoint_cache_ttl: Duration,
    /// The most endpoints (known or not) held in the cache. Unknown ids are cached too, so
    /// that a scanner does not cost a query per request; the bound keeps one posting to random
    /// ids from growing memory without limit. Past it, lookups go to Postgres uncached.
    pub endpoint_cache_max_entries: usize,
    /// Tells the sequencers which endpoints just got messages (a Redis publish after each
    /// commit). `None`: they find them by their periodic sweep alone.
    pub waker: Option<relay_coord::Waker>,
    /// The sequencer of this process (`relay all`): each stored message is handed to the
    /// worker that owns its endpoint here, if one does and has room, instead of announced
    /// through `waker` and read back from Postgres.
    pub messages_handoff: Option<relay_coord::Handoff<relay_store::cursors::PendingMessage>>,
    /// Header and body read timeouts and the bound on open connections of the webhook listener.
    /// The body's timeout counts within the answer deadline, so keep it shorter.
    pub listener: ListenerLimits,
    /// What the process's listeners share: the body budget, the trusted proxies, the metrics.
    pub shared: relay_listener::Shared,
    /// The operator's default quotas; the messages per second is this tier's to apply.
    pub quotas: relay_store::quotas::QuotaDefaults,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: relay_wire::limits::MAX_BODY_BYTES,
            answer_deadline: Duration::from_millis(defaults::ANSWER_DEADLINE_MS),
            retry_after: Duration::from_secs(defaults::RETRY_AFTER_S),
            writers: defaults::WRITERS,
            batch_max_messages: defaults::BATCH_MAX_MESSAGES,
            batch_linger: Duration::from_micros(defaults::BATCH_LINGER_US),
            batch_max_bytes: 8 * 1024 * 1024,
            queue_capacity: 4096,
            endpoint_cache_ttl: Duration::from_secs(defaults::ENDPOINT_CACHE_TTL_S),
            endpoint_cache_max_entries: defaults::ENDPOINT_CACHE_MAX_ENTRIES,
            waker: None,
            messages_handoff: None,
            listener: LISTENER_LIMITS,
            shared: relay_listener::Shared::default(),
            quotas: relay_store::quotas::QuotaDefaults::default(),
        }
    }
}
