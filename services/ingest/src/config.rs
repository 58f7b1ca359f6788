//! The front tier's settings. The binary fills them from flags and `RELAY_*` variables; the
//! defaults here are the documented ones.

use std::time::Duration;

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
    pub waker: Option<relay_sequencer::Waker>,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: relay_wire::limits::MAX_BODY_BYTES,
            answer_deadline: Duration::from_secs(10),
            retry_after: Duration::from_secs(5),
            writers: 2,
            batch_max_messages: 256,
            batch_max_bytes: 8 * 1024 * 1024,
            queue_capacity: 4096,
            endpoint_cache_ttl: Duration::from_secs(60),
            endpoint_cache_max_entries: 100_000,
            waker: None,
        }
    }
}
