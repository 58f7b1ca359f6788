//! The stories upstream (seed 000, upstream-api.md's "The stories API"): tickers' stories, their
//! events, the endpoints that receive them as webhooks, the REST API's answers and the oracle.
//!
//! Like [`crate::upstream`], [`Stories`] is a sans-IO state machine: every call takes `now_ms`
//! (the driver's monotonic milliseconds, or virtual time in tests) and, where a webhook is signed,
//! the wall-clock Unix seconds. The tokio side ([`driver`]) owns the clock and the sockets.
//!
//! # Layout
//! - [`model`]: the truth model ([`StoryBook`]): create, update, became strong, shortlist, close,
//!   merge. Pure.
//! - [`events`]: the events' JSON and ids, and the log they are published in.
//! - [`sender`]: each endpoint's queue of webhooks: faults (duplicates, reordering, late
//!   `story.created`), retries by the wire file's backoff, and giving up.
//! - [`reads`]: the API's answers (GET /v1/events, /v1/stories, /v1/stories/{id}) and their
//!   faults. [`routes`] serves them over axum.
//! - [`oracle`]: what a receiver's copy must hold, and whom it must notify.
//! - [`workload`]: a seeded random stream of story changes.
//! - [`driver`]: the [`Simulation`](crate::Simulation) methods that send the webhooks and run
//!   the workload.
//!
//! # Which events an endpoint gets
//! An endpoint's *stream* is every event published while it was subscribed to the event's ticker
//! ([`Stories::set_stories_tickers`] starts and ends subscriptions). Webhooks carry the stream,
//! one webhook per event; GET /v1/events serves the stream (within the window) to the endpoint's
//! API key; the oracle's notifications are counted over it. Catch-up therefore never serves an
//! event from before the endpoint subscribed to its ticker: a receiver loads a new ticker's
//! stories with GET /v1/stories, as seed 000 says.
//!
//! # The window
//! GET /v1/events serves the events from the window's start on ([`Stories::window_start`]): the
//! newest `window_events` events (when set), none older than `window_ms`, and none published
//! before what [`Stories::expire_cursors_before`] or [`Stories::advance_window`] dropped. A cursor
//! from before the start answers 410 `cursor_expired`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use relay_wire::SigningSecret;
use uuid::Uuid;

use crate::faults::StoriesFaults;
use crate::model::UnixMs;

pub mod driver;
pub mod events;
pub mod model;
pub mod oracle;
pub mod reads;
pub mod routes;
pub mod sender;
pub mod workload;

pub use events::{LoggedEvent, Origin, StoryEventType};
pub use model::{Article, Story, StoryBook, StoryChange, StoryError};
pub use oracle::{CopyRow, ExpectedStory};
pub use reads::{StoriesApiError, StoryRead, STALE_HORIZON_MS};
pub use sender::{StoriesLogEntry, StoriesSenderConfig};
pub use workload::{StoriesEndpointInfo, StoriesWorkload, StoriesWorkloadConfig, StoryStep};

/// The stories upstream's timings.
#[derive(Debug, Clone, PartialEq)]
pub struct StoriesConfig {
    pub sender: StoriesSenderConfig,
    /// How long an event stays in /v1/events' window, in driver milliseconds (30 days,
    /// compressed).
    pub window_ms: u64,
    /// When set, the window holds at most this many events (the newest).
    pub window_events: Option<usize>,
    /// The upstream time at driver time 0: an event's `created_at` is this plus `now_ms`.
    pub start_unix_ms: UnixMs,
}

/// Thirty days: how far back GET /v1/events reaches.
pub const WINDOW_S: u64 = 30 * 86_400;

impl StoriesConfig {
    /// The wire file's timings and a 30-day window, every time divided by `time_compression`.
    pub fn from_wire_limits(time_compression: f64) -> Self {
        let sender = StoriesSenderConfig::from_wire_limits(time_compression);
        let window_ms = ((WINDOW_S as f64 * 1000.0) / sender.time_compression).round() as u64;
        Self {
            sender,
            window_ms,
            window_events: None,
            start_unix_ms: crate::workload::START_MS,
        }
    }
}

impl Default for StoriesConfig {
    fn default() -> Self {
        Self::from_wire_limits(1.0)
    }
}

/// How to make a stories endpoint.
#[derive(Debug, Clone)]
pub struct StoriesEndpointSpec {
    /// Fixed id; derived from the seed and a counter when `None`.
    pub id: Option<Uuid>,
    /// Where webhooks go; `{id}` is replaced by the endpoint's id.
    pub url: String,
    /// Every secret signs each webhook (several during a rotation).
    pub secrets: Vec<SigningSecret>,
    /// The API key its receiver reads the API with: it maps to this endpoint's tickers. One key
    /// per stories endpoint.
    pub api_key: String,
    pub tickers: BTreeSet<String>,
}

/// A span of positions in the event log during which an endpoint was subscribed to a ticker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Subscription {
    from: usize,
    until: Option<usize>,
}

/// A stories endpoint: where its webhooks go, how they are signed, its tickers, its queue.
#[derive(Debug, Clone)]
pub struct StoriesEndpoint {
    pub id: Uuid,
    pub url: String,
    pub secrets: Vec<SigningSecret>,
    pub api_key: String,
    /// A 410 answer pauses the endpoint (its webhooks wait) until resumed.
    pub paused: bool,
    /// When its receiver registered it, as the receiver records it (the relay's
    /// `webhook_endpoints.created_at`): a receiver notifies only of `story.became_strong`
    /// events created since. `None`: registered before every event.
    pub registered_at: Option<time::OffsetDateTime>,
    subscriptions: BTreeMap<String, Vec<Subscription>>,
    queue: sender::Queue,
    rng: ChaCha8Rng,
    log: Vec<StoriesLogEntry>,
}

impl StoriesEndpoint {
    /// The tickers it is subscribed to now.
    pub fn tickers(&self) -> BTreeSet<String> {
        self.subscriptions
            .iter()
            .filter(|(_, spans)| spans.last().is_some_and(|s| s.until.is_none()))
            .map(|(ticker, _)| ticker.clone())
            .collect()
    }

    /// Whether the event at `position`, of `ticker`, is in the endpoint's stream (published while
    /// it was subscribed to the ticker).
    pub fn receives(&self, ticker: &str, position: usize) -> bool {
        self.subscriptions.get(ticker).is_some_and(|spans| {
            spans
                .iter()
                .any(|s| s.from <= position && s.until.is_none_or(|u| position < u))
        })
    }

    /// Every ticker it was ever subscribed to.
    pub fn tickers_ever(&self) -> BTreeSet<String> {
        self.subscriptions.keys().cloned().collect()
    }
}

/// The stories upstream.
#[derive(Debug)]
pub struct Stories {
    book: StoryBook,
    events: Vec<LoggedEvent>,
    endpoints: BTreeMap<Uuid, StoriesEndpoint>,
    keys: BTreeMap<String, Uuid>,
    config: StoriesConfig,
    faults: StoriesFaults,
    seed: u64,
    api_rng: ChaCha8Rng,
    next_serial: u64,
    endpoints_made: u64,
    /// Events before this position left the window by [`Stories::expire_cursors_before`].
    expired_before: usize,
    api_paused: bool,
}

impl Default for Stories {
    fn default() -> Self {
        Self::new(StoriesConfig::default(), StoriesFaults::default(), 0)
    }
}

impl Stories {
    pub fn new(config: StoriesConfig, faults: StoriesFaults, seed: u64) -> Self {
        Self {
            book: StoryBook::default(),
            events: Vec::new(),
            endpoints: BTreeMap::new(),
            keys: BTreeMap::new(),
            config,
            faults,
            seed,
            api_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x5707_1E5A),
            next_serial: 0,
            endpoints_made: 0,
            expired_before: 0,
            api_paused: false,
        }
    }

    pub fn config(&self) -> &StoriesConfig {
        &self.config
    }

    pub fn set_config(&mut self, config: StoriesConfig) {
        self.config = config;
    }

    pub fn faults(&self) -> &StoriesFaults {
        &self.faults
    }

    pub fn set_faults(&mut self, faults: StoriesFaults) {
        self.faults = faults;
    }

    pub fn book(&self) -> &StoryBook {
        &self.book
    }

    pub fn story(&self, id: &str) -> Option<&Story> {
        self.book.story(id)
    }

    /// Every event published, in publication order.
    pub fn events(&self) -> &[LoggedEvent] {
        &self.events
    }

    // ---- endpoints -------------------------------------------------------------------------

    /// Adds an endpoint, subscribed to its tickers from now on.
    ///
    /// # Panics
    /// When another stories endpoint has the same API key (a key maps to one endpoint's
    /// tickers).
    pub fn add_stories_endpoint(&mut self, spec: StoriesEndpointSpec) -> Uuid {
        assert!(
            !self.keys.contains_key(&spec.api_key),
            "the API key of a stories endpoint is its own"
        );
        self.endpoints_made += 1;
        let id = spec.id.unwrap_or_else(|| {
            crate::render::uuid_from(&[
                b"stories-endpoint",
                &self.seed.to_be_bytes(),
                &self.endpoints_made.to_be_bytes(),
            ])
        });
        let from = self.events.len();
        let subscriptions = spec
            .tickers
            .into_iter()
            .map(|t| (t, vec![Subscription { from, until: None }]))
            .collect();
        let rng_seed = self.seed ^ u64::from_be_bytes(id.as_bytes()[..8].try_into().expect("8"));
        self.keys.insert(spec.api_key.clone(), id);
        self.endpoints.insert(
            id,
            StoriesEndpoint {
                id,
                url: spec.url.replace("{id}", &id.to_string()),
                secrets: spec.secrets,
                api_key: spec.api_key,
                paused: false,
                registered_at: None,
                subscriptions,
                queue: sender::Queue::default(),
                rng: ChaCha8Rng::seed_from_u64(rng_seed),
                log: Vec::new(),
            },
        );
        id
    }

    pub fn stories_endpoint(&self, id: Uuid) -> Option<&StoriesEndpoint> {
        self.endpoints.get(&id)
    }

    pub fn stories_endpoint_ids(&self) -> Vec<Uuid> {
        self.endpoints.keys().copied().collect()
    }

    /// Records when the endpoint's receiver registered it (the instant it compares events'
    /// `created_at` with), for the oracle's notifications. Events are created at
    /// [`StoriesConfig::start_unix_ms`] plus the driver's time: a test whose receiver registers
    /// at the wall clock's now starts the upstream's time there, or every event predates it.
    pub fn set_registered_at(&mut self, id: Uuid, at: time::OffsetDateTime) {
        if let Some(endpoint) = self.endpoints.get_mut(&id) {
            endpoint.registered_at = Some(at);
        }
    }

    /// The event's `created_at`, as its JSON carries it.
    pub fn created_at(&self, event: &LoggedEvent) -> time::OffsetDateTime {
        let ms = self.config.start_unix_ms + event.published_ms as UnixMs;
        time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
            .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
    }

    /// Replaces the endpoint's tickers: a new ticker's events reach it from now on; a dropped
    /// ticker's stop (what was already published while subscribed is still delivered).
    pub fn set_stories_tickers(&mut self, id: Uuid, tickers: impl IntoIterator<Item = String>) {
        let position = self.events.len();
        let Some(endpoint) = self.endpoints.get_mut(&id) else {
            return;
        };
        let wanted: BTreeSet<String> = tickers.into_iter().collect();
        for (ticker, spans) in endpoint.subscriptions.iter_mut() {
            if let Some(open) = spans.last_mut().filter(|s| s.until.is_none()) {
                if !wanted.contains(ticker) {
                    open.until = Some(position);
                }
            }
        }
        for ticker in wanted {
            let spans = endpoint.subscriptions.entry(ticker).or_default();
            if spans.last().is_none_or(|s| s.until.is_some()) {
                spans.push(Subscription {
                    from: position,
                    until: None,
                });
            }
        }
    }

    /// Adds a signing secret (a rotation: both sign until the old one is retired).
    pub fn rotate_stories_secret(&mut self, id: Uuid, secret: SigningSecret) {
        if let Some(endpoint) = self.endpoints.get_mut(&id) {
            endpoint.secrets.push(secret);
        }
    }

    pub fn set_stories_url(&mut self, id: Uuid, url: &str) {
        if let Some(endpoint) = self.endpoints.get_mut(&id) {
            endpoint.url = url.replace("{id}", &id.to_string());
        }
    }

    /// Stops sending to the endpoint (as a 410 answer does); its webhooks wait, none given up.
    pub fn pause_stories_endpoint(&mut self, id: Uuid) {
        if let Some(endpoint) = self.endpoints.get_mut(&id) {
            endpoint.paused = true;
        }
    }

    /// Sends again what waited.
    pub fn resume_stories_endpoint(&mut self, id: Uuid, now_ms: u64) {
        if let Some(endpoint) = self.endpoints.get_mut(&id) {
            endpoint.paused = false;
            endpoint.queue.due_now(now_ms);
        }
    }

    /// While paused, every stories API call answers 503 `{"error": "unavailable"}`.
    pub fn set_api_paused(&mut self, paused: bool) {
        self.api_paused = paused;
    }

    // ---- changes ---------------------------------------------------------------------------

    /// Creates a story of `ticker` (version 1, one article); returns its id.
    pub fn create_story(
        &mut self,
        ticker: &str,
        headline: &str,
        origin: Origin,
        now_ms: u64,
    ) -> String {
        let (id, change) = self.book.create(ticker, headline);
        self.publish(change, origin, now_ms);
        id
    }

    /// A new headline (when given) and, with `add_article`, one more article: `story.updated`.
    pub fn update_story(
        &mut self,
        id: &str,
        headline: Option<&str>,
        add_article: bool,
        origin: Origin,
        now_ms: u64,
    ) -> Result<(), StoryError> {
        let change = self.book.update(id, headline, add_article)?;
        self.publish(change, origin, now_ms);
        Ok(())
    }

    /// `story.became_strong` (once per story).
    pub fn make_strong(&mut self, id: &str, origin: Origin, now_ms: u64) -> Result<(), StoryError> {
        let change = self.book.make_strong(id)?;
        self.publish(change, origin, now_ms);
        Ok(())
    }

    /// `article.shortlisted` for one of the story's articles; the story's version stays.
    pub fn shortlist_article(
        &mut self,
        story_id: &str,
        article_id: &str,
        origin: Origin,
        now_ms: u64,
    ) -> Result<(), StoryError> {
        let change = self.book.shortlist(story_id, article_id)?;
        self.publish(change, origin, now_ms);
        Ok(())
    }

    /// `story.closed` with `merged_into: null`.
    pub fn close_story(&mut self, id: &str, origin: Origin, now_ms: u64) -> Result<(), StoryError> {
        let change = self.book.close(id)?;
        self.publish(change, origin, now_ms);
        Ok(())
    }

    /// Merges `from` into `into`: `story.closed` for `from`, `merged_into` the survivor's new
    /// snapshot.
    pub fn merge_stories(
        &mut self,
        from: &str,
        into: &str,
        origin: Origin,
        now_ms: u64,
    ) -> Result<(), StoryError> {
        let change = self.book.merge(from, into)?;
        self.publish(change, origin, now_ms);
        Ok(())
    }

    /// Logs the change as an event and queues a webhook for every endpoint subscribed to its
    /// ticker.
    fn publish(&mut self, change: StoryChange, origin: Origin, now_ms: u64) {
        let story_id = match &change {
            StoryChange::Shortlisted { article } => article.story_id.clone(),
            StoryChange::Closed { story_id, .. } => story_id.clone(),
            StoryChange::Created { story }
            | StoryChange::Updated { story }
            | StoryChange::BecameStrong { story } => story["id"].as_str().unwrap_or("").to_owned(),
        };
        let ticker = self
            .book
            .story(&story_id)
            .map(|s| s.ticker.clone())
            .unwrap_or_default();
        let position = self.events.len();
        // Publication times never go back: the window's age is a prefix of the log.
        let published_ms = self
            .events
            .last()
            .map_or(now_ms, |e| e.published_ms.max(now_ms));
        let (event_type, data) = events::type_and_data(&change);
        let event_id = events::event_id(self.seed, position);
        let json = events::render(
            &event_id,
            event_type,
            origin,
            self.config.start_unix_ms + published_ms as UnixMs,
            data,
        );
        let body = Arc::new(serde_json::to_vec(&json).expect("JSON values serialise"));
        let event = LoggedEvent {
            position,
            event_id,
            event_type,
            origin,
            ticker,
            story_id,
            published_ms,
            json,
            body,
        };
        for endpoint in self.endpoints.values_mut() {
            if endpoint.receives(&event.ticker, position) {
                sender::enqueue(endpoint, &event, &self.faults, now_ms);
            }
        }
        self.events.push(event);
    }

    // ---- the window ------------------------------------------------------------------------

    /// The position of the first event GET /v1/events still serves at `now_ms`.
    pub fn window_start(&self, now_ms: u64) -> usize {
        let by_age = self
            .events
            .partition_point(|e| e.published_ms.saturating_add(self.config.window_ms) < now_ms);
        let by_count = self
            .config
            .window_events
            .map_or(0, |n| self.events.len().saturating_sub(n));
        self.expired_before.max(by_age).max(by_count)
    }

    /// Every event published before `now_ms` leaves the window: a cursor that has not read past
    /// all of them answers 410, and a read without a cursor starts after them.
    pub fn expire_cursors_before(&mut self, now_ms: u64) {
        let before = self.events.partition_point(|e| e.published_ms < now_ms);
        self.expired_before = self.expired_before.max(before);
    }

    /// Every event published so far leaves the window.
    pub fn advance_window(&mut self) {
        self.expired_before = self.events.len();
    }
}
