//! The upstream as a pure state machine: the truth model, the change log, each endpoint's feed
//! track (what has been delivered, the message being attempted, its retries), the oracle, and
//! the API's answers.
//!
//! Like quinn-proto, it never reads a clock and does no IO: every call takes `now_ms` (a
//! monotonic millisecond count: real time in the driver, virtual time in tests) and, where a
//! message is signed, the wall-clock Unix seconds. The driver ([`crate::driver`]) owns the clock
//! and the sockets: it pulls messages with [`Upstream::poll_send`] and reports each answer with
//! [`Upstream::on_answer`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_wire::{Cursor, ItemKind, Sequence, SigningSecret};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::faults::Faults;
use crate::model::{
    Access, Change, ChangeKind, Endpoint, EndpointStatus, Filter, ModelError, PartKind, Selection,
    UnixMs, World,
};
use crate::render::{self, EventForm};

/// The sender's limits and timings, in milliseconds of the driver's clock.
#[derive(Debug, Clone, PartialEq)]
pub struct SenderConfig {
    pub message_bytes: usize,
    pub max_events: usize,
    /// The first backoff's ceiling; each further failure doubles it, up to `backoff_max_ms`.
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    pub retry_after_max_ms: u64,
    pub reset_after_failing_ms: u64,
    pub pause_after_ms: u64,
    /// Upstream seconds per driver second: a Retry-After of N seconds waits N*1000/compression ms.
    pub time_compression: f64,
}

impl SenderConfig {
    /// The wire file's limits, with every time divided by `time_compression` (1 = real time).
    pub fn from_wire_limits(time_compression: f64) -> Self {
        use relay_wire::limits::*;
        let compression = time_compression.max(1e-9);
        let ms = |s: u64| upstream_seconds_to_ms(s, compression);
        Self {
            message_bytes: MESSAGE_BYTES,
            max_events: MAX_EVENTS,
            backoff_base_ms: ms(1).max(1),
            backoff_max_ms: ms(BACKOFF_MAX_S),
            retry_after_max_ms: ms(RETRY_AFTER_MAX_S),
            reset_after_failing_ms: ms(RESET_AFTER_FAILING_S),
            pause_after_ms: ms(PAUSE_AFTER_S),
            time_compression: compression,
        }
    }
}

/// `seconds` of the upstream's time in milliseconds of the driver's clock, which runs
/// `time_compression` upstream seconds per second.
pub(crate) fn upstream_seconds_to_ms(seconds: u64, time_compression: f64) -> u64 {
    ((seconds as f64 * 1000.0) / time_compression).round() as u64
}

/// The ceiling of the wire file's full-jitter backoff after `attempts` attempts: `base_ms`,
/// doubled for each further failure, up to `max_ms`.
pub(crate) fn backoff_ceiling(base_ms: u64, max_ms: u64, attempts: u32) -> u64 {
    base_ms
        .saturating_mul(1u64 << attempts.min(40).saturating_sub(1))
        .min(max_ms)
}

impl Default for SenderConfig {
    fn default() -> Self {
        Self::from_wire_limits(1.0)
    }
}

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageKind {
    Events,
    Reset,
    Test,
    /// A fault: a delivered message sent again (same id and body).
    Duplicate,
    /// A fault: an older delivered message sent after newer ones.
    Redelivery,
}

/// A message ready to POST: the body and every header, signed.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub endpoint_id: Uuid,
    /// Names this attempt; pass it back with the answer.
    pub serial: u64,
    pub kind: MessageKind,
    pub webhook_id: String,
    pub attempt: u32,
    pub body: Arc<Vec<u8>>,
    pub url: String,
    pub headers: Vec<(&'static str, String)>,
}

impl Outgoing {
    /// Attempt `attempt` (numbered `serial`) of the message `webhook_id` to the endpoint
    /// `endpoint_id` at `url`, signed with every one of `secrets` at `wall_unix_s`, with the
    /// upstream's headers.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn signed(
        endpoint_id: Uuid,
        url: &str,
        secrets: &[SigningSecret],
        serial: u64,
        kind: MessageKind,
        webhook_id: String,
        attempt: u32,
        body: Arc<Vec<u8>>,
        wall_unix_s: i64,
    ) -> Self {
        let signature = relay_wire::sign(&webhook_id, wall_unix_s, &body, secrets);
        let headers = vec![
            ("webhook-id", webhook_id.clone()),
            ("webhook-timestamp", wall_unix_s.to_string()),
            ("webhook-signature", signature),
            ("quanor-webhook-attempt", attempt.to_string()),
            ("content-type", "application/json".to_owned()),
            ("user-agent", "Quanor-Webhooks/1".to_owned()),
        ];
        Outgoing {
            endpoint_id,
            serial,
            kind,
            webhook_id,
            attempt,
            body,
            url: url.to_owned(),
            headers,
        }
    }
}

/// How an attempt was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Status {
        code: u16,
        /// The Retry-After header's value, as received.
        retry_after: Option<String>,
    },
    /// No answer within the send timeout, or the connection failed.
    NoAnswer,
}

impl Answer {
    /// The status code of an answer that came, and the delay its Retry-After asks for in
    /// milliseconds of the driver's clock (which runs `time_compression` upstream seconds per
    /// second), at most `max_ms`.
    pub(crate) fn code_and_retry_after(
        &self,
        wall_unix_s: i64,
        time_compression: f64,
        max_ms: u64,
    ) -> (Option<u16>, Option<u64>) {
        match self {
            Answer::Status { code, retry_after } => (
                Some(*code),
                retry_after
                    .as_deref()
                    .and_then(|v| parse_retry_after(v, wall_unix_s))
                    .map(|s| upstream_seconds_to_ms(s, time_compression).min(max_ms)),
            ),
            Answer::NoAnswer => (None, None),
        }
    }

    /// The answer as a JSON object: `{"status": code, "retry_after": ...}`, or
    /// `{"status": null}` when none came.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Answer::Status { code, retry_after } => {
                serde_json::json!({"status": code, "retry_after": retry_after})
            }
            Answer::NoAnswer => serde_json::json!({"status": null}),
        }
    }

    pub fn status(code: u16) -> Self {
        Answer::Status {
            code,
            retry_after: None,
        }
    }
}

/// One line of an endpoint's log: what was sent and how each answer was taken.
#[derive(Debug, Clone)]
pub enum LogEntry {
    Sent {
        at_ms: u64,
        serial: u64,
        kind: MessageKind,
        webhook_id: String,
        attempt: u32,
        body: Arc<Vec<u8>>,
    },
    Answered {
        at_ms: u64,
        serial: u64,
        webhook_id: String,
        answer: Answer,
        /// What the sender does next, in words.
        decision: String,
    },
    ResetQueued {
        at_ms: u64,
        reason: String,
        generation: u64,
    },
    Rewound {
        at_ms: u64,
        since: Cursor,
        generation: u64,
    },
}

/// Why a rewind was refused (409), as the wire file names the situations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RewindRefusal {
    /// `since` is no newer than the last reset's `resume_from`.
    #[error("before_reset")]
    BeforeReset,
    /// `since` is of another epoch than the feed's (older than a restore of the feed).
    #[error("cursor_not_in_epoch")]
    CursorNotInEpoch,
    /// `since` is past the feed's head, or past the position the track sends from next (it
    /// was rewound on the upstream's side, or a message the receiver kept was never answered
    /// 2xx): the messages that follow overlap the copy.
    #[error("cursor_ahead")]
    CursorAhead,
    /// A reset is queued or being sent: it will read everything again.
    #[error("reset_pending")]
    ResetPending,
}

impl RewindRefusal {
    pub fn code(self) -> &'static str {
        match self {
            RewindRefusal::BeforeReset => "before_reset",
            RewindRefusal::CursorNotInEpoch => "cursor_not_in_epoch",
            RewindRefusal::CursorAhead => "cursor_ahead",
            RewindRefusal::ResetPending => "reset_pending",
        }
    }
}

/// Why an API call failed, mapped to a status by the API layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    #[error("unauthorized")]
    Unauthorized,
    #[error("not_found")]
    NotFound,
    #[error("bad_request: {0}")]
    BadRequest(String),
    #[error("{0}")]
    Rewind(RewindRefusal),
    /// A /v1/feed cursor the upstream no longer serves: read the pass again from the start.
    #[error("cursor_expired")]
    CursorExpired,
}

/// An item read's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum ItemRead {
    Found(Value),
    /// 404 with `{access_version, error: "not_found"}`.
    Gone(Value),
    /// A load balancer's 404: plain text, no access_version.
    LoadBalancer404,
}

/// How to make an endpoint.
#[derive(Debug, Clone)]
pub struct EndpointSpec {
    pub key_token: String,
    pub lang: String,
    pub filter: Filter,
    pub url: String,
    pub secrets: Vec<SigningSecret>,
    /// Fixed id; derived from the seed and a counter when `None`.
    pub id: Option<Uuid>,
    /// Queue a reset (reason `created`) so the receiver loads the feed as it is.
    pub initial_reset: bool,
}

#[derive(Debug, Clone)]
struct Built {
    kind: MessageKind,
    webhook_id: String,
    body: Arc<Vec<u8>>,
    through: Cursor,
    subjects: usize,
    seqs: Vec<u64>,
    all_refetch: bool,
}

#[derive(Debug, Clone)]
struct InFlight {
    serial: u64,
    generation: u64,
    /// Extras (tests, duplicates, redeliveries) change no state when answered.
    extra: bool,
    webhook_id: String,
}

#[derive(Debug, Clone)]
struct Extra {
    kind: MessageKind,
    webhook_id: String,
    body: Arc<Vec<u8>>,
    attempt: u32,
}

#[derive(Debug, Clone)]
struct Delivered {
    webhook_id: String,
    body: Arc<Vec<u8>>,
    attempt: u32,
    through: Option<Cursor>,
}

/// One endpoint's feed track.
#[derive(Debug, Clone)]
struct TrackState {
    generation: u64,
    /// Everything at or before this position was delivered (or replaced by a reset).
    cursor: Cursor,
    pending_reset: Option<String>,
    last_reset_resume: Option<Cursor>,
    current: Option<Built>,
    in_flight: Option<InFlight>,
    /// Attempts since the last 2xx (the quanor-webhook-attempt header).
    attempts: u32,
    failing_since: Option<u64>,
    not_before: u64,
    events_cap: usize,
    forced_refetch: BTreeSet<u64>,
    extras: VecDeque<Extra>,
    delivered: Vec<Delivered>,
    rng: ChaCha8Rng,
}

/// The upstream: truth model, change log, endpoints and their tracks, the send log.
#[derive(Debug)]
pub struct Upstream {
    pub world: World,
    changes: Vec<Change>,
    endpoints: BTreeMap<Uuid, Endpoint>,
    tracks: BTreeMap<Uuid, TrackState>,
    log: BTreeMap<Uuid, Vec<LogEntry>>,
    snapshots: VecDeque<World>,
    /// For each key, the newest position a message handed to one of its endpoints reaches (an
    /// events message's `through`, a reset's `resume_from`): a stale read is never older.
    sent_through: BTreeMap<String, Cursor>,
    config: SenderConfig,
    faults: Faults,
    seed: u64,
    api_rng: ChaCha8Rng,
    next_serial: u64,
    endpoints_made: u64,
    tests_made: u64,
}

const SNAPSHOTS_KEPT: usize = 8;

impl Upstream {
    pub fn new(world: World, config: SenderConfig, faults: Faults, seed: u64) -> Self {
        Self {
            world,
            changes: Vec::new(),
            endpoints: BTreeMap::new(),
            tracks: BTreeMap::new(),
            log: BTreeMap::new(),
            snapshots: VecDeque::new(),
            sent_through: BTreeMap::new(),
            config,
            faults,
            seed,
            api_rng: ChaCha8Rng::seed_from_u64(seed ^ 0xA110_FA91),
            next_serial: 0,
            endpoints_made: 0,
            tests_made: 0,
        }
    }

    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    pub fn set_faults(&mut self, faults: Faults) {
        self.faults = faults;
    }

    pub fn config(&self) -> &SenderConfig {
        &self.config
    }

    pub fn changes(&self) -> &[Change] {
        &self.changes
    }

    // ---- endpoints -------------------------------------------------------------------------

    /// Adds an endpoint; its track starts at the feed's head.
    pub fn add_endpoint(&mut self, spec: EndpointSpec, now_ms: u64) -> Uuid {
        self.endpoints_made += 1;
        let id = spec.id.unwrap_or_else(|| {
            render::uuid_from(&[
                b"endpoint",
                &self.seed.to_be_bytes(),
                &self.endpoints_made.to_be_bytes(),
            ])
        });
        let url = spec.url.replace("{id}", &id.to_string());
        self.endpoints.insert(
            id,
            Endpoint {
                id,
                key_token: spec.key_token,
                lang: spec.lang,
                filter: spec.filter,
                status: EndpointStatus::Active,
                secrets: spec.secrets,
                url,
            },
        );
        let rng_seed = self.seed ^ u64::from_be_bytes(id.as_bytes()[..8].try_into().expect("8"));
        self.tracks.insert(
            id,
            TrackState {
                generation: 1,
                cursor: self.world.head(),
                pending_reset: None,
                last_reset_resume: None,
                current: None,
                in_flight: None,
                attempts: 0,
                failing_since: None,
                not_before: 0,
                events_cap: self.config.max_events,
                forced_refetch: BTreeSet::new(),
                extras: VecDeque::new(),
                delivered: Vec::new(),
                rng: ChaCha8Rng::seed_from_u64(rng_seed),
            },
        );
        self.log.insert(id, Vec::new());
        if spec.initial_reset {
            self.queue_reset(id, "created", now_ms);
        }
        id
    }

    pub fn endpoint(&self, id: Uuid) -> Option<&Endpoint> {
        self.endpoints.get(&id)
    }

    pub fn endpoint_ids(&self) -> Vec<Uuid> {
        self.endpoints.keys().copied().collect()
    }

    pub fn generation(&self, id: Uuid) -> Option<u64> {
        self.tracks.get(&id).map(|t| t.generation)
    }

    /// The position through which the track has delivered (or reset).
    pub fn delivered_through(&self, id: Uuid) -> Option<Cursor> {
        self.tracks.get(&id).map(|t| t.cursor)
    }

    /// True when nothing is queued, being attempted, or waiting in the change log.
    pub fn is_idle(&self, id: Uuid) -> bool {
        let Some(track) = self.tracks.get(&id) else {
            return true;
        };
        track.pending_reset.is_none()
            && track.current.is_none()
            && track.in_flight.is_none()
            && track.extras.is_empty()
            && self.backlog_is_empty(id)
    }

    fn backlog_is_empty(&self, id: Uuid) -> bool {
        let (Some(endpoint), Some(track)) = (self.endpoints.get(&id), self.tracks.get(&id)) else {
            return true;
        };
        let Some(key) = self.world.keys.get(&endpoint.key_token) else {
            return true;
        };
        let selection = Selection::for_endpoint(endpoint);
        let start = self
            .changes
            .partition_point(|c| c.position() <= track.cursor);
        !self.changes[start..].iter().any(|c| {
            render::event_form(&self.world, key, &selection, c, false).is_some_and(|form| {
                endpoint
                    .filter
                    .sends_event_type(&render::event_type(c, form))
            })
        })
    }

    pub fn is_paused(&self, id: Uuid) -> bool {
        self.endpoints
            .get(&id)
            .is_some_and(|e| e.status == EndpointStatus::Paused)
    }

    /// Resumes a paused endpoint; the backlog is replaced by a reset (reason `resumed`).
    pub fn resume_endpoint(&mut self, id: Uuid, now_ms: u64) {
        if let Some(endpoint) = self.endpoints.get_mut(&id) {
            endpoint.status = EndpointStatus::Active;
            if let Some(track) = self.tracks.get_mut(&id) {
                track.failing_since = None;
                track.not_before = now_ms;
            }
            self.queue_reset(id, "resumed", now_ms);
        }
    }

    /// Adds a signing secret (a rotation: both sign until the old one is retired).
    pub fn rotate_secret(&mut self, id: Uuid, secret: SigningSecret) {
        if let Some(endpoint) = self.endpoints.get_mut(&id) {
            endpoint.secrets.push(secret);
        }
    }

    /// Stops signing with the oldest secret, when more than one signs.
    pub fn retire_oldest_secret(&mut self, id: Uuid) {
        if let Some(endpoint) = self.endpoints.get_mut(&id) {
            if endpoint.secrets.len() > 1 {
                endpoint.secrets.remove(0);
            }
        }
    }

    pub fn set_endpoint_url(&mut self, id: Uuid, url: &str) {
        if let Some(endpoint) = self.endpoints.get_mut(&id) {
            endpoint.url = url.replace("{id}", &id.to_string());
        }
    }

    /// Replaces the backlog with a reset: the generation rises now, and the next message is the
    /// reset (its resume_from is the head when it is built).
    pub fn queue_reset(&mut self, id: Uuid, reason: &str, now_ms: u64) {
        let Some(track) = self.tracks.get_mut(&id) else {
            return;
        };
        track.generation += 1;
        track.pending_reset = Some(reason.to_owned());
        track.current = None;
        track.forced_refetch.clear();
        track.events_cap = self.config.max_events;
        let generation = track.generation;
        self.push_log(
            id,
            LogEntry::ResetQueued {
                at_ms: now_ms,
                reason: reason.to_owned(),
                generation,
            },
        );
    }

    // ---- changes ---------------------------------------------------------------------------

    fn keep_snapshot(&mut self) {
        self.snapshots.push_back(self.world.clone());
        if self.snapshots.len() > SNAPSHOTS_KEPT {
            self.snapshots.pop_front();
        }
    }

    fn record(&mut self, mut change: Change, as_refetch: bool) -> Change {
        change.as_refetch = as_refetch && !change.kind.is_removal();
        self.changes.push(change.clone());
        change
    }

    pub fn create_item(
        &mut self,
        kind: ItemKind,
        company_id: i64,
        title: &str,
        at_ms: UnixMs,
    ) -> Result<Change, ModelError> {
        self.keep_snapshot();
        let change = self.world.create_item(kind, company_id, title, at_ms)?;
        Ok(self.record(change, false))
    }

    /// Applies a change to an item; `as_refetch` sends an update as a refetch.
    pub fn change_item(
        &mut self,
        feed_item_id: &str,
        kind: ChangeKind,
        headline: &str,
        at_ms: UnixMs,
        as_refetch: bool,
    ) -> Result<Change, ModelError> {
        self.keep_snapshot();
        let change = self
            .world
            .change_item(feed_item_id, kind, headline, at_ms)?;
        Ok(self.record(change, as_refetch))
    }

    /// Changes a key's access to one company and resets every endpoint of the key
    /// (reason `access_changed`). Returns the new access_version.
    pub fn set_access(
        &mut self,
        token: &str,
        company_id: i64,
        access: Option<Access>,
        now_ms: u64,
    ) -> Result<String, ModelError> {
        self.keep_snapshot();
        let version = self.world.set_access(token, company_id, access)?;
        self.reset_endpoints_of_key(token, "access_changed", now_ms);
        Ok(version)
    }

    /// Queues a reset (for `reason`) on every endpoint of the key `token`.
    fn reset_endpoints_of_key(&mut self, token: &str, reason: &str, now_ms: u64) {
        let ids: Vec<Uuid> = self
            .endpoints
            .values()
            .filter(|e| e.key_token == token)
            .map(|e| e.id)
            .collect();
        for id in ids {
            self.queue_reset(id, reason, now_ms);
        }
    }

    // ---- the sender --------------------------------------------------------------------------

    /// When the endpoint's track next wants [`Upstream::poll_send`] called, if it is waiting.
    pub fn next_send_at(&self, id: Uuid) -> Option<u64> {
        let track = self.tracks.get(&id)?;
        (track.in_flight.is_none()).then_some(track.not_before)
    }

    /// The next message to send to the endpoint, if one is due: one at a time per track, the
    /// next only after the previous was answered.
    pub fn poll_send(&mut self, id: Uuid, now_ms: u64, wall_unix_s: i64) -> Option<Outgoing> {
        let endpoint = self.endpoints.get(&id)?.clone();
        let track = self.tracks.get(&id)?;
        if track.in_flight.is_some() {
            return None;
        }
        if let Some(extra) = self.tracks.get_mut(&id)?.extras.pop_front() {
            return Some(self.hand_out(
                &endpoint,
                extra.kind,
                extra.webhook_id,
                extra.body,
                extra.attempt,
                true,
                now_ms,
                wall_unix_s,
            ));
        }
        let track = self.tracks.get(&id)?;
        if endpoint.status == EndpointStatus::Paused || now_ms < track.not_before {
            return None;
        }
        let built = if let Some(reason) = track.pending_reset.clone() {
            self.build_reset(&endpoint, &reason)?
        } else {
            self.build_events(&endpoint)?
        };
        let sent = self
            .sent_through
            .entry(endpoint.key_token.clone())
            .or_insert(built.through);
        *sent = (*sent).max(built.through);
        let track = self.tracks.get_mut(&id)?;
        track.attempts += 1;
        let attempt = track.attempts;
        track.current = Some(built.clone());
        Some(self.hand_out(
            &endpoint,
            built.kind,
            built.webhook_id,
            built.body,
            attempt,
            false,
            now_ms,
            wall_unix_s,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn hand_out(
        &mut self,
        endpoint: &Endpoint,
        kind: MessageKind,
        webhook_id: String,
        body: Arc<Vec<u8>>,
        attempt: u32,
        extra: bool,
        now_ms: u64,
        wall_unix_s: i64,
    ) -> Outgoing {
        self.next_serial += 1;
        let serial = self.next_serial;
        let track = self
            .tracks
            .get_mut(&endpoint.id)
            .expect("track of a known endpoint");
        track.in_flight = Some(InFlight {
            serial,
            generation: track.generation,
            extra,
            webhook_id: webhook_id.clone(),
        });
        self.push_log(
            endpoint.id,
            LogEntry::Sent {
                at_ms: now_ms,
                serial,
                kind,
                webhook_id: webhook_id.clone(),
                attempt,
                body: body.clone(),
            },
        );
        Outgoing::signed(
            endpoint.id,
            &endpoint.url,
            &endpoint.secrets,
            serial,
            kind,
            webhook_id,
            attempt,
            body,
            wall_unix_s,
        )
    }

    fn build_reset(&self, endpoint: &Endpoint, reason: &str) -> Option<Built> {
        let track = self.tracks.get(&endpoint.id)?;
        let key = self.world.keys.get(&endpoint.key_token)?;
        let head = self.world.head();
        let body = render::reset_body(
            endpoint.id,
            &key.access_version(),
            track.generation,
            reason,
            head,
        );
        Some(Built {
            kind: MessageKind::Reset,
            webhook_id: render::webhook_id(endpoint.id, &body),
            body: Arc::new(body),
            through: head,
            subjects: 0,
            seqs: Vec::new(),
            all_refetch: false,
        })
    }

    /// Builds the next message of events after the track's cursor: at most `events_cap` events
    /// and `message_bytes` bytes (one event larger than that goes alone).
    fn build_events(&mut self, endpoint: &Endpoint) -> Option<Built> {
        let key = self.world.keys.get(&endpoint.key_token)?.clone();
        let selection = Selection::for_endpoint(endpoint);
        let track = self.tracks.get(&endpoint.id)?;
        let cap = track.events_cap.clamp(1, self.config.max_events);
        let since = track.cursor;
        let start = self.changes.partition_point(|c| c.position() <= since);
        // Room for the envelope's fields around the events.
        let mut size = 300;
        let mut events = Vec::new();
        let mut subjects = BTreeSet::new();
        let mut seqs = Vec::new();
        let mut all_refetch = true;
        let mut through = since;
        for change in &self.changes[start..] {
            let forced = track.forced_refetch.contains(&change.seq);
            if let Some(form) = render::event_form(&self.world, &key, &selection, change, forced) {
                if endpoint
                    .filter
                    .sends_event_type(&render::event_type(change, form))
                {
                    if events.len() >= cap {
                        break;
                    }
                    let event =
                        render::render_feed_event(&self.world, &key, &selection, change, form);
                    let len = serde_json::to_vec(&event).map(|b| b.len()).unwrap_or(0) + 1;
                    if !events.is_empty() && size + len > self.config.message_bytes {
                        break;
                    }
                    size += len;
                    all_refetch &= form == EventForm::Refetch || form == EventForm::Removal;
                    subjects.insert(change.feed_item_id.clone());
                    seqs.push(change.seq);
                    events.push(event);
                }
            }
            through = change.position();
        }
        if events.is_empty() {
            // Nothing of this endpoint's: the cursor moves on without a message.
            self.tracks.get_mut(&endpoint.id)?.cursor = through;
            return None;
        }
        let body = render::events_body(
            endpoint.id,
            &key.access_version(),
            track.generation,
            since,
            through,
            true,
            events,
        );
        Some(Built {
            kind: MessageKind::Events,
            webhook_id: render::webhook_id(endpoint.id, &body),
            body: Arc::new(body),
            through,
            subjects: subjects.len(),
            seqs,
            all_refetch,
        })
    }

    /// Takes an answer to the attempt `serial` and decides what the track does next.
    pub fn on_answer(
        &mut self,
        id: Uuid,
        serial: u64,
        answer: Answer,
        now_ms: u64,
        wall_unix_s: i64,
    ) {
        let Some(track) = self.tracks.get_mut(&id) else {
            return;
        };
        let Some(in_flight) = track.in_flight.clone().filter(|f| f.serial == serial) else {
            return;
        };
        track.in_flight = None;
        let webhook_id = in_flight.webhook_id.clone();
        let decision = if in_flight.extra {
            "extra send: answer logged only".to_owned()
        } else if in_flight.generation != track.generation || track.current.is_none() {
            "stale: the track moved on (rewind or reset) while it was in flight".to_owned()
        } else {
            self.decide(id, answer.clone(), now_ms, wall_unix_s)
        };
        tracing::debug!(endpoint = %id, serial, %webhook_id, ?answer, %decision, "answer taken");
        self.push_log(
            id,
            LogEntry::Answered {
                at_ms: now_ms,
                serial,
                webhook_id,
                answer,
                decision,
            },
        );
    }

    fn decide(&mut self, id: Uuid, answer: Answer, now_ms: u64, wall_unix_s: i64) -> String {
        let config = self.config.clone();
        let faults = self.faults.clone();
        let track = self.tracks.get_mut(&id).expect("checked by on_answer");
        let built = track.current.clone().expect("checked by on_answer");
        let (code, retry_after) = answer.code_and_retry_after(
            wall_unix_s,
            config.time_compression,
            config.retry_after_max_ms,
        );
        match code {
            Some(200..=299) => {
                track.current = None;
                track.attempts = 0;
                track.failing_since = None;
                track.events_cap = config.max_events;
                track.not_before = now_ms;
                if built.kind == MessageKind::Reset {
                    track.pending_reset = None;
                    track.last_reset_resume = Some(built.through);
                }
                track.cursor = built.through;
                track.forced_refetch.retain(|seq| *seq > built.through.seq);
                track.delivered.push(Delivered {
                    webhook_id: built.webhook_id.clone(),
                    body: built.body.clone(),
                    attempt: 1,
                    through: (built.kind == MessageKind::Events).then_some(built.through),
                });
                let mut decision = "delivered: next message".to_owned();
                // Faults, drawn from the track's own RNG so each track replays alike.
                if track.rng.gen_bool(faults.duplicate.clamp(0.0, 1.0)) {
                    track.extras.push_back(Extra {
                        kind: MessageKind::Duplicate,
                        webhook_id: built.webhook_id.clone(),
                        body: built.body.clone(),
                        attempt: 2,
                    });
                    decision.push_str("; fault: will deliver it again");
                }
                if track.delivered.len() > 2
                    && track.rng.gen_bool(faults.redeliver_old.clamp(0.0, 1.0))
                {
                    let index = track.rng.gen_range(0..track.delivered.len() - 1);
                    let old = track.delivered[index].clone();
                    track.extras.push_back(Extra {
                        kind: MessageKind::Redelivery,
                        webhook_id: old.webhook_id,
                        body: old.body,
                        attempt: old.attempt + 1,
                    });
                    decision.push_str("; fault: will redeliver an older message");
                }
                if track.rng.gen_bool(faults.rewind.clamp(0.0, 1.0)) {
                    let candidates: Vec<Cursor> = track
                        .delivered
                        .iter()
                        .filter_map(|d| d.through)
                        .filter(|t| track.last_reset_resume.is_none_or(|r| *t > r))
                        .collect();
                    if !candidates.is_empty() {
                        let since = candidates[track.rng.gen_range(0..candidates.len())];
                        match self.rewind(id, since, now_ms) {
                            Ok(generation) => decision.push_str(&format!(
                                "; fault: rewound to {since} (generation {generation})"
                            )),
                            Err(refusal) => decision.push_str(&format!(
                                "; fault: rewind to {since} refused: {refusal}"
                            )),
                        }
                    }
                }
                decision
            }
            Some(410) => {
                track.current = None;
                if let Some(endpoint) = self.endpoints.get_mut(&id) {
                    endpoint.status = EndpointStatus::Paused;
                }
                "410: endpoint paused until resumed".to_owned()
            }
            Some(413) if built.kind == MessageKind::Events && built.subjects > 1 => {
                track.failing_since.get_or_insert(now_ms);
                let half = (built.seqs.len() / 2).max(1);
                track.events_cap = half;
                track.current = None;
                track.not_before = now_ms + retry_after.unwrap_or(0);
                format!("413: sending again with at most {half} events")
            }
            Some(413) if built.kind == MessageKind::Events && !built.all_refetch => {
                track.failing_since.get_or_insert(now_ms);
                track.forced_refetch.extend(built.seqs.iter().copied());
                track.current = None;
                track.not_before = now_ms + retry_after.unwrap_or(0);
                "413: a single item's events: sending again as its refetch".to_owned()
            }
            Some(429) | Some(503) if retry_after.is_some() => {
                let delay = retry_after.unwrap_or(0);
                Self::failed(track, &built, now_ms, delay);
                let mut decision = format!(
                    "{}: Retry-After honoured, again in {delay} ms",
                    code.unwrap_or(0)
                );
                decision.push_str(&self.check_failing(id, now_ms));
                decision
            }
            _ => {
                let ceiling = backoff_ceiling(
                    config.backoff_base_ms,
                    config.backoff_max_ms,
                    track.attempts,
                );
                let jitter = track.rng.gen_range(0..=ceiling);
                let delay = jitter.max(retry_after.unwrap_or(0));
                Self::failed(track, &built, now_ms, delay);
                let mut decision = match code {
                    Some(code) => format!("{code}: backoff, again in {delay} ms"),
                    None => format!("no answer: backoff, again in {delay} ms"),
                };
                decision.push_str(&self.check_failing(id, now_ms));
                decision
            }
        }
    }

    fn failed(track: &mut TrackState, built: &Built, now_ms: u64, delay: u64) {
        track.failing_since.get_or_insert(now_ms);
        track.current = None;
        track.not_before = now_ms + delay;
        if built.kind == MessageKind::Reset {
            // A reset the receiver may have stored is sent again in the next generation.
            track.generation += 1;
        }
    }

    /// After long enough failing: replace the backlog by a reset (`behind`), later pause.
    fn check_failing(&mut self, id: Uuid, now_ms: u64) -> String {
        let Some(track) = self.tracks.get(&id) else {
            return String::new();
        };
        let Some(since) = track.failing_since else {
            return String::new();
        };
        let failing_for = now_ms.saturating_sub(since);
        if failing_for >= self.config.pause_after_ms {
            if let Some(endpoint) = self.endpoints.get_mut(&id) {
                endpoint.status = EndpointStatus::Paused;
            }
            return format!("; failing for {failing_for} ms: endpoint paused");
        }
        if failing_for >= self.config.reset_after_failing_ms && track.pending_reset.is_none() {
            self.queue_reset(id, "behind", now_ms);
            return format!("; failing for {failing_for} ms: backlog replaced by a reset");
        }
        String::new()
    }

    /// Resends the track from `since` under a new generation, without a reset.
    pub fn rewind(&mut self, id: Uuid, since: Cursor, now_ms: u64) -> Result<u64, RewindRefusal> {
        let head = self.world.head();
        let track = self
            .tracks
            .get_mut(&id)
            .expect("rewind of a known endpoint");
        if since.epoch != head.epoch {
            return Err(RewindRefusal::CursorNotInEpoch);
        }
        if since.seq > head.seq {
            return Err(RewindRefusal::CursorAhead);
        }
        if track.pending_reset.is_some() {
            return Err(RewindRefusal::ResetPending);
        }
        // The track already sends from before `since`: what follows overlaps the receiver's
        // copy, so there is nothing to rewind.
        if since > track.cursor {
            return Err(RewindRefusal::CursorAhead);
        }
        if track.last_reset_resume.is_some_and(|r| since <= r) {
            return Err(RewindRefusal::BeforeReset);
        }
        track.generation += 1;
        track.cursor = since;
        track.current = None;
        track.forced_refetch.clear();
        track.events_cap = self.config.max_events;
        track.not_before = now_ms;
        let generation = track.generation;
        self.push_log(
            id,
            LogEntry::Rewound {
                at_ms: now_ms,
                since,
                generation,
            },
        );
        Ok(generation)
    }

    /// A restore of the feed on the upstream's side: a new epoch. Every endpoint is reset.
    pub fn restore_feed(&mut self, now_ms: u64) {
        self.world.epoch += 1;
        for id in self.endpoint_ids() {
            self.queue_reset(id, "restored", now_ms);
        }
    }

    /// Queues a test message (`webhook_endpoint.tested`), ahead of the track's next message.
    /// With `example_type`, data.example is an example event of that type.
    pub fn send_test(&mut self, id: Uuid, example_type: Option<&str>) -> Option<Uuid> {
        let endpoint = self.endpoints.get(&id)?.clone();
        self.tests_made += 1;
        let test_send_id = render::uuid_from(&[
            b"test",
            &self.seed.to_be_bytes(),
            &self.tests_made.to_be_bytes(),
        ]);
        let example = example_type.map(|t| self.example_event(&endpoint, t));
        let body = render::test_body(id, test_send_id, example);
        let webhook_id = render::webhook_id(id, &body);
        self.tracks.get_mut(&id)?.extras.push_back(Extra {
            kind: MessageKind::Test,
            webhook_id,
            body: Arc::new(body),
            attempt: 1,
        });
        Some(test_send_id)
    }

    /// An example event of a type, from the latest change that has that type for the endpoint.
    fn example_event(&self, endpoint: &Endpoint, event_type: &str) -> Value {
        let selection = Selection::for_endpoint(endpoint);
        if let Some(key) = self.world.keys.get(&endpoint.key_token) {
            for change in self.changes.iter().rev() {
                for form in [EventForm::Item, EventForm::Removal] {
                    if render::event_type(change, form) == event_type {
                        let visible =
                            render::event_form(&self.world, key, &selection, change, false);
                        if visible == Some(form) {
                            return render::render_feed_event(
                                &self.world,
                                key,
                                &selection,
                                change,
                                form,
                            );
                        }
                    }
                }
            }
        }
        json!({"type": event_type})
    }

    // ---- the oracle and the log ----------------------------------------------------------------

    /// Exactly what GET /v1/feed serves the endpoint now (its filter, language and key access):
    /// subject → (sequence, item).
    pub fn expected_copy(&self, id: Uuid) -> BTreeMap<String, (Sequence, Value)> {
        let Some(endpoint) = self.endpoints.get(&id) else {
            return BTreeMap::new();
        };
        let Some(key) = self.world.keys.get(&endpoint.key_token) else {
            return BTreeMap::new();
        };
        let selection = Selection::for_endpoint(endpoint);
        self.world
            .feed(key, &selection)
            .into_iter()
            .map(|(item, access)| {
                let company = &self.world.companies[&item.company_id];
                let rendered = render::render_item(
                    &item,
                    company,
                    &selection.lang,
                    access,
                    selection.part_kinds.as_ref(),
                );
                (item.feed_item_id(), (item.sequence(), rendered))
            })
            .collect()
    }

    pub fn log(&self, id: Uuid) -> &[LogEntry] {
        self.log.get(&id).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Every body sent to the endpoint, in order (retries, duplicates and tests included).
    pub fn sent_bodies(&self, id: Uuid) -> Vec<Arc<Vec<u8>>> {
        self.log(id)
            .iter()
            .filter_map(|entry| match entry {
                LogEntry::Sent { body, .. } => Some(body.clone()),
                _ => None,
            })
            .collect()
    }

    fn push_log(&mut self, id: Uuid, entry: LogEntry) {
        self.log.entry(id).or_default().push(entry);
    }

    // ---- the API's answers -------------------------------------------------------------------

    fn key_of(&self, token: &str) -> Result<&crate::model::Key, ApiError> {
        self.world.keys.get(token).ok_or(ApiError::Unauthorized)
    }

    fn own_endpoint(&self, token: &str, id: Uuid) -> Result<&Endpoint, ApiError> {
        self.key_of(token)?;
        self.endpoints
            .get(&id)
            .filter(|e| e.key_token == token)
            .ok_or(ApiError::NotFound)
    }

    /// A real-time delay for this API read, when the slow-reads fault strikes.
    pub fn api_delay_ms(&mut self) -> Option<u64> {
        let p = self.faults.slow_reads.clamp(0.0, 1.0);
        self.api_rng.gen_bool(p).then_some(self.faults.slow_read_ms)
    }

    /// GET /v1/webhook-endpoints/{id}.
    pub fn endpoint_view(&self, token: &str, id: Uuid) -> Result<Value, ApiError> {
        let endpoint = self.own_endpoint(token, id)?;
        Ok(json!({
            "id": endpoint.id.to_string(),
            "lang": endpoint.lang,
            "status": endpoint.status,
            "filter": endpoint.filter,
            "tracks": {"feed": {"generation": self.generation(id).unwrap_or(0)}},
        }))
    }

    /// The world to serve a key's read from: now, or a stale snapshot when that fault strikes.
    ///
    /// A snapshot older than what the key's endpoints were already sent is never served: the
    /// upstream's reads show at least what its messages told (a reset's `resume_from`, an events
    /// message's `through`). Without that promise no receiver could follow the reading rules to a
    /// correct copy: a reset's pages read from before a removal it replaced would bring the item
    /// back at the new generation, and nothing later would remove it again.
    fn world_for_read(&mut self, token: &str) -> World {
        let p = self.faults.stale_reads.clamp(0.0, 1.0);
        if !self.snapshots.is_empty() && self.api_rng.gen_bool(p) {
            let floor = self.sent_through.get(token).copied();
            let fresh_enough: Vec<usize> = (0..self.snapshots.len())
                .filter(|&i| floor.is_none_or(|f| self.snapshots[i].head() >= f))
                .collect();
            if !fresh_enough.is_empty() {
                let index = fresh_enough[self.api_rng.gen_range(0..fresh_enough.len())];
                return self.snapshots[index].clone();
            }
        }
        self.world.clone()
    }

    /// Mid-reload faults, before a page after the first.
    fn mid_reload_faults(&mut self, token: &str, now_ms: u64) {
        let p_access = self.faults.access_change_mid_reload.clamp(0.0, 1.0);
        if self.api_rng.gen_bool(p_access) {
            let companies: Vec<i64> = self.world.companies.keys().copied().collect();
            if !companies.is_empty() {
                let company = companies[self.api_rng.gen_range(0..companies.len())];
                let current = self
                    .world
                    .keys
                    .get(token)
                    .and_then(|k| k.access.get(&company).copied());
                let next = match current {
                    Some(Access::Full) => Some(Access::Teaser),
                    Some(Access::Teaser) => None,
                    None => Some(Access::Full),
                };
                let _ = self.set_access(token, company, next, now_ms);
                tracing::info!(token, company, ?next, "fault: access changed mid-reload");
            }
        }
        let p_reset = self.faults.reset_mid_reload.clamp(0.0, 1.0);
        if self.api_rng.gen_bool(p_reset) {
            self.reset_endpoints_of_key(token, "behind", now_ms);
            tracing::info!(token, "fault: newer reset mid-reload");
        }
    }

    /// GET /v1/feed: one page. `cursor` is the previous page's next_cursor.
    pub fn feed_page(
        &mut self,
        token: &str,
        selection: &Selection,
        cursor: Option<&str>,
        limit: usize,
        now_ms: u64,
    ) -> Result<Value, ApiError> {
        self.key_of(token)?;
        let after = match cursor {
            None => None,
            Some(text) => Some(parse_page_cursor(text)?),
        };
        if after.is_some() {
            let p_expired = self.faults.cursor_expired.clamp(0.0, 1.0);
            if self.api_rng.gen_bool(p_expired) {
                tracing::info!(token, "fault: feed cursor expired");
                return Err(ApiError::CursorExpired);
            }
            self.mid_reload_faults(token, now_ms);
        }
        let world = self.world_for_read(token);
        let key = world.keys.get(token).ok_or(ApiError::Unauthorized)?;
        let limit = limit.clamp(1, 500);
        let items: Vec<_> = world
            .feed(key, selection)
            .into_iter()
            .filter(|(item, _)| after.is_none_or(|a| item.first_seq > a))
            .collect();
        let has_more = items.len() > limit;
        let page: Vec<_> = items.into_iter().take(limit).collect();
        let next_cursor = page
            .last()
            .filter(|_| has_more)
            .map(|(item, _)| format!("fs{:x}", item.first_seq));
        let data: Vec<Value> = page
            .iter()
            .map(|(item, access)| {
                let company = &world.companies[&item.company_id];
                json!({
                    "subject": item.feed_item_id(),
                    "sequence": item.sequence().as_str(),
                    "item": render::render_item(item, company, &selection.lang, *access, selection.part_kinds.as_ref()),
                })
            })
            .collect();
        Ok(json!({
            "access_version": key.access_version(),
            "data": data,
            "next_cursor": next_cursor,
            "has_more": has_more,
        }))
    }

    /// GET /v1/feed/items/{feed_item_id}.
    pub fn item_read(
        &mut self,
        token: &str,
        feed_item_id: &str,
        lang: &str,
        part_kinds: Option<BTreeSet<PartKind>>,
    ) -> Result<ItemRead, ApiError> {
        self.key_of(token)?;
        let p = self.faults.lb_404.clamp(0.0, 1.0);
        if self.api_rng.gen_bool(p) {
            return Ok(ItemRead::LoadBalancer404);
        }
        let world = self.world_for_read(token);
        let key = world.keys.get(token).ok_or(ApiError::Unauthorized)?;
        let selection = Selection {
            lang: lang.to_owned(),
            part_kinds,
            ..Selection::default()
        };
        let found = world.items.get(feed_item_id).and_then(|item| {
            world
                .visible(key, &selection, item)
                .map(|access| (item.clone(), access))
        });
        Ok(match found {
            Some((item, access)) => {
                let company = &world.companies[&item.company_id];
                ItemRead::Found(json!({
                    "access_version": key.access_version(),
                    "sequence": item.sequence().as_str(),
                    "item": render::render_item(&item, company, lang, access, selection.part_kinds.as_ref()),
                }))
            }
            None => ItemRead::Gone(json!({
                "access_version": key.access_version(),
                "error": "not_found",
            })),
        })
    }

    /// POST /v1/webhook-endpoints/{id}/tracks/{track}/rewind.
    pub fn api_rewind(
        &mut self,
        token: &str,
        id: Uuid,
        track: &str,
        since: &str,
        now_ms: u64,
    ) -> Result<u64, ApiError> {
        self.own_endpoint(token, id)?;
        if track != render::TRACK_FEED {
            return Err(ApiError::NotFound);
        }
        let since = Cursor::parse(since).map_err(|e| ApiError::BadRequest(e.to_string()))?;
        self.rewind(id, since, now_ms).map_err(ApiError::Rewind)
    }

    /// GET /v1/feed/since: the events after `since` for the selection, in message form.
    pub fn feed_since(
        &mut self,
        token: &str,
        selection: &Selection,
        since: &str,
        include_event_ids: bool,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<Value, ApiError> {
        let key = self.key_of(token)?.clone();
        let since = Cursor::parse(since).map_err(|e| ApiError::BadRequest(e.to_string()))?;
        let after = match cursor {
            Some(text) => Cursor::parse(text).map_err(|e| ApiError::BadRequest(e.to_string()))?,
            None => since,
        };
        let limit = limit.clamp(1, 500);
        let start = self.changes.partition_point(|c| c.position() <= after);
        let mut events = Vec::new();
        let mut last = after;
        let mut has_more = false;
        for change in &self.changes[start..] {
            if let Some(form) = render::event_form(&self.world, &key, selection, change, false) {
                if events.len() >= limit {
                    has_more = true;
                    break;
                }
                events.push(render::render_feed_event(
                    &self.world,
                    &key,
                    selection,
                    change,
                    form,
                ));
            }
            last = change.position();
        }
        let mut answer = json!({
            "access_version": key.access_version(),
            "data": events,
            "next_cursor": has_more.then(|| last.to_string()),
            "has_more": has_more,
        });
        if include_event_ids {
            let ids: Vec<Value> = answer["data"]
                .as_array()
                .map(|events| events.iter().map(|e| e["id"].clone()).collect())
                .unwrap_or_default();
            answer["event_ids"] = Value::Array(ids);
        }
        Ok(answer)
    }
}

fn parse_page_cursor(text: &str) -> Result<u64, ApiError> {
    text.strip_prefix("fs")
        .and_then(|hex| u64::from_str_radix(hex, 16).ok())
        .ok_or_else(|| ApiError::BadRequest(format!("`{text}` is not a cursor this feed gave")))
}

/// A Retry-After value in upstream seconds: delta-seconds, or an HTTP date (relative to
/// `wall_unix_s`; a date in the past means at once).
pub fn parse_retry_after(value: &str, wall_unix_s: i64) -> Option<u64> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(seconds);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let at_s = at.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs() as i64;
    Some(at_s.saturating_sub(wall_unix_s).max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        assert_eq!(parse_retry_after("120", 0), Some(120));
        let now = 1_791_439_212;
        let date = httpdate::fmt_http_date(
            std::time::UNIX_EPOCH + std::time::Duration::from_secs((now + 30) as u64),
        );
        assert_eq!(parse_retry_after(&date, now), Some(30));
        assert_eq!(parse_retry_after("soon", now), None);
    }
}
