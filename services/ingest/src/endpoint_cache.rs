//! Endpoints and their secrets, held in memory.
//!
//! Every message needs its endpoint's status and secrets before anything else; reading them
//! from Postgres for each one would cost more than storing the message. Entries are trusted only
//! while this process is listening for `relay_endpoint_changed` notifications (fired by
//! triggers on the endpoint and secret tables), and each change drops its entry, so a pause or
//! a rotated secret takes effect as soon as it commits. While the listener is down, every
//! lookup goes to Postgres.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use relay_store::endpoints::{self, EndpointAuth, CHANGED_CHANNEL};
use relay_store::{Keyring, StoreError};
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::metrics::IngestMetrics;

struct Entry {
    /// `None` caches "no such endpoint", so a scanner cannot make us query for each request.
    auth: Option<Arc<EndpointAuth>>,
    loaded_at: Instant,
}

struct Entries {
    map: HashMap<Uuid, Entry>,
    /// When expired entries were last swept out: at most once a quarter TTL, so that a full
    /// cache under a scan does not cost a sweep per request.
    swept_at: Instant,
}

struct Shared {
    entries: RwLock<Entries>,
    /// Bumped on every invalidation: a load that began before one must not be cached.
    invalidations: AtomicU64,
    listening: AtomicBool,
}

#[derive(Clone)]
pub struct EndpointCache {
    pool: PgPool,
    /// Opens the endpoints' sealed secrets, once per load (never per message).
    keys: Keyring,
    ttl: Duration,
    max_entries: usize,
    shared: Arc<Shared>,
    metrics: Arc<IngestMetrics>,
}

impl EndpointCache {
    /// Starts the cache and its listener task.
    pub fn start(
        pool: PgPool,
        keys: Keyring,
        ttl: Duration,
        max_entries: usize,
        metrics: Arc<IngestMetrics>,
    ) -> (Self, JoinHandle<()>) {
        let cache = Self {
            pool,
            keys,
            ttl,
            max_entries,
            shared: Arc::new(Shared {
                entries: RwLock::new(Entries {
                    map: HashMap::new(),
                    swept_at: Instant::now(),
                }),
                invalidations: AtomicU64::new(0),
                listening: AtomicBool::new(false),
            }),
            metrics,
        };
        let task = tokio::spawn(cache.clone().listen());
        (cache, task)
    }

    /// The endpoint's status and secrets, or `None` when it does not exist.
    pub async fn get(&self, id: Uuid) -> Result<Option<Arc<EndpointAuth>>, StoreError> {
        if self.ttl > Duration::ZERO && self.shared.listening.load(Ordering::Acquire) {
            let entries = self.shared.entries.read().expect("cache lock poisoned");
            if let Some(entry) = entries.map.get(&id) {
                if entry.loaded_at.elapsed() < self.ttl {
                    self.metrics.cache_lookups.with_label_values(&["hit"]).inc();
                    return Ok(entry.auth.clone());
                }
            }
        }
        self.metrics
            .cache_lookups
            .with_label_values(&["miss"])
            .inc();
        let before = self.shared.invalidations.load(Ordering::Acquire);
        let auth = endpoints::load_auth(&self.pool, &self.keys, id)
            .await?
            .map(Arc::new);
        if self.ttl > Duration::ZERO && self.shared.listening.load(Ordering::Acquire) {
            let mut entries = self.shared.entries.write().expect("cache lock poisoned");
            if entries.map.len() >= self.max_entries && entries.swept_at.elapsed() >= self.ttl / 4 {
                let ttl = self.ttl;
                entries
                    .map
                    .retain(|_, entry| entry.loaded_at.elapsed() < ttl);
                entries.swept_at = Instant::now();
            }
            // Checked under the write lock, which every invalidation also takes. Past the bound
            // (ids that are all fresh, as a scan makes them), the answer is not kept.
            if self.shared.invalidations.load(Ordering::Acquire) == before
                && entries.map.len() < self.max_entries
            {
                entries.map.insert(
                    id,
                    Entry {
                        auth: auth.clone(),
                        loaded_at: Instant::now(),
                    },
                );
            }
            self.metrics.cache_entries.set(entries.map.len() as i64);
        }
        Ok(auth)
    }

    fn invalidate(&self, id: Option<Uuid>) {
        let mut entries = self.shared.entries.write().expect("cache lock poisoned");
        self.shared.invalidations.fetch_add(1, Ordering::AcqRel);
        match id {
            Some(id) => {
                entries.map.remove(&id);
            }
            None => entries.map.clear(),
        }
        self.metrics.cache_entries.set(entries.map.len() as i64);
    }

    async fn listen(self) {
        loop {
            match self.listen_once().await {
                Ok(()) => {}
                Err(error) => {
                    tracing::warn!(%error, "endpoint change listener lost; cache bypassed until it is back")
                }
            }
            self.shared.listening.store(false, Ordering::Release);
            self.invalidate(None);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    async fn listen_once(&self) -> Result<(), sqlx::Error> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        // Once LISTEN is in place nothing can be missed; anything cached before is suspect.
        listener.listen(CHANGED_CHANNEL).await?;
        self.invalidate(None);
        self.shared.listening.store(true, Ordering::Release);
        tracing::debug!("listening for endpoint changes");
        loop {
            // `try_recv` answers `None` when the connection dropped, when notifications may
            // have been missed: stop trusting the cache until LISTEN is back.
            match listener.try_recv().await? {
                Some(notification) => {
                    self.invalidate(Uuid::parse_str(notification.payload()).ok());
                }
                None => return Ok(()),
            }
        }
    }
}
