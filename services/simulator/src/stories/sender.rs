//! Each stories endpoint's webhooks: one per event of its stream, the body the event alone,
//! signed as the feed's messages are (Standard Webhooks headers, every secret signing).
//!
//! Unlike the feed's track, webhooks are independent: each is retried on its own by the wire
//! file's rules (a backoff with full jitter up to `backoff_max_ms`; after a 429 or 503 with a
//! Retry-After, at the time it states), so a failing one never holds up the next. After
//! `max_attempts` attempts, or `give_up_after_ms` of failing, the webhook is given up: the
//! stories have no reset, and only catch-up (GET /v1/events) recovers what was lost. A 410
//! pauses the endpoint until it is resumed.
//!
//! Faults ([`StoriesFaults`](crate::StoriesFaults)): a delivered webhook sent again (same
//! webhook-id, same body); a webhook held back by a random delay, so newer ones overtake it;
//! several in flight at once; a `story.created` held back until the story's `story.closed` was
//! answered.

use std::collections::BTreeMap;
use std::sync::Arc;

use rand::Rng;
use uuid::Uuid;

use super::events::{LoggedEvent, StoryEventType};
use super::{Stories, StoriesEndpoint};
use crate::faults::StoriesFaults;
use crate::upstream::{backoff_ceiling, Answer, MessageKind, Outgoing, SenderConfig};

/// The stories sender's timings, in milliseconds of the driver's clock.
#[derive(Debug, Clone, PartialEq)]
pub struct StoriesSenderConfig {
    /// The first backoff's ceiling; each further failure doubles it, up to `backoff_max_ms`.
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    pub retry_after_max_ms: u64,
    /// Upstream seconds per driver second.
    pub time_compression: f64,
    /// A webhook is given up after this many attempts...
    pub max_attempts: u32,
    /// ...or once it has been failing this long.
    pub give_up_after_ms: u64,
}

/// Attempts before a stories webhook is given up (the simulator's choice: the wire file names
/// the backoff, not a count). Twelve attempts back off for about an hour of upstream time.
pub const MAX_ATTEMPTS: u32 = 12;

impl StoriesSenderConfig {
    /// The feed sender's backoff ([`SenderConfig::from_wire_limits`]), [`MAX_ATTEMPTS`]
    /// attempts, and giving up after `reset_after_failing_s` (where the feed replaces its backlog
    /// by a reset), every time divided by `time_compression`.
    pub fn from_wire_limits(time_compression: f64) -> Self {
        let feed = SenderConfig::from_wire_limits(time_compression);
        Self {
            backoff_base_ms: feed.backoff_base_ms,
            backoff_max_ms: feed.backoff_max_ms,
            retry_after_max_ms: feed.retry_after_max_ms,
            time_compression: feed.time_compression,
            max_attempts: MAX_ATTEMPTS,
            give_up_after_ms: feed.reset_after_failing_ms,
        }
    }
}

impl Default for StoriesSenderConfig {
    fn default() -> Self {
        Self::from_wire_limits(1.0)
    }
}

/// One line of a stories endpoint's log.
#[derive(Debug, Clone)]
pub enum StoriesLogEntry {
    Sent {
        at_ms: u64,
        serial: u64,
        kind: MessageKind,
        webhook_id: String,
        event_id: String,
        attempt: u32,
    },
    Answered {
        at_ms: u64,
        serial: u64,
        webhook_id: String,
        event_id: String,
        answer: Answer,
        /// What the sender does next, in words.
        decision: String,
    },
    GaveUp {
        at_ms: u64,
        webhook_id: String,
        event_id: String,
        attempts: u32,
    },
}

#[derive(Debug, Clone)]
struct Delivery {
    event_id: String,
    event_type: StoryEventType,
    story_id: String,
    /// `Events` for the webhook itself, `Duplicate` for a fault's second delivery.
    kind: MessageKind,
    webhook_id: String,
    body: Arc<Vec<u8>>,
    attempts: u32,
    failing_since: Option<u64>,
    not_before: u64,
    /// A late `story.created`: held until the story's `story.closed` was answered, or this time.
    held_until: Option<u64>,
    in_flight: Option<u64>,
}

impl Delivery {
    fn ready_at(&self) -> u64 {
        self.not_before.max(self.held_until.unwrap_or(0))
    }
}

/// An endpoint's webhooks not yet delivered nor given up, in the order they were queued.
#[derive(Debug, Clone, Default)]
pub(crate) struct Queue {
    deliveries: BTreeMap<u64, Delivery>,
    queued: u64,
}

impl Queue {
    fn push(&mut self, delivery: Delivery) {
        self.queued += 1;
        self.deliveries.insert(self.queued, delivery);
    }

    fn in_flight(&self) -> usize {
        self.deliveries
            .values()
            .filter(|d| d.in_flight.is_some())
            .count()
    }

    /// The first queued webhook that may be sent at `now_ms`.
    fn next_due(&self, now_ms: u64) -> Option<u64> {
        self.deliveries
            .iter()
            .find(|(_, d)| d.in_flight.is_none() && d.ready_at() <= now_ms)
            .map(|(key, _)| *key)
    }

    fn next_ready_at(&self) -> Option<u64> {
        self.deliveries
            .values()
            .filter(|d| d.in_flight.is_none())
            .map(Delivery::ready_at)
            .min()
    }

    /// Everything waiting may go at once (after a resume).
    pub(crate) fn due_now(&mut self, now_ms: u64) {
        for delivery in self.deliveries.values_mut() {
            delivery.not_before = delivery.not_before.min(now_ms);
        }
    }

    /// The story's late `story.created`, if one is held, may go now.
    fn release_created(&mut self, story_id: &str) {
        for delivery in self.deliveries.values_mut() {
            if delivery.story_id == story_id && delivery.event_type == StoryEventType::Created {
                delivery.held_until = None;
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.deliveries.is_empty()
    }
}

/// Queues the event's webhook for the endpoint, drawing the queueing faults.
pub(super) fn enqueue(
    endpoint: &mut StoriesEndpoint,
    event: &LoggedEvent,
    faults: &StoriesFaults,
    now_ms: u64,
) {
    let rng = &mut endpoint.rng;
    let mut not_before = now_ms;
    if rng.gen_bool(faults.reorder.clamp(0.0, 1.0)) {
        not_before += rng.gen_range(0..=faults.reorder_delay_ms);
    }
    let held_until = (event.event_type == StoryEventType::Created
        && rng.gen_bool(faults.late_created.clamp(0.0, 1.0)))
    .then_some(now_ms + faults.late_created_max_hold_ms);
    endpoint.queue.push(Delivery {
        event_id: event.event_id.clone(),
        event_type: event.event_type,
        story_id: event.story_id.clone(),
        kind: MessageKind::Events,
        webhook_id: crate::render::webhook_id(endpoint.id, &event.body),
        body: event.body.clone(),
        attempts: 0,
        failing_since: None,
        not_before,
        held_until,
        in_flight: None,
    });
}

impl Stories {
    /// Every webhook due at `now_ms`, over every endpoint that is not paused, as many per
    /// endpoint as its free slots allow (`StoriesFaults::concurrency`). Report each answer with
    /// [`Stories::on_answer`].
    pub fn poll_sends(&mut self, now_ms: u64, wall_unix_s: i64) -> Vec<Outgoing> {
        let concurrency = self.faults.concurrency.max(1);
        let mut sends = Vec::new();
        for endpoint in self.endpoints.values_mut() {
            if endpoint.paused {
                continue;
            }
            let mut free = concurrency.saturating_sub(endpoint.queue.in_flight());
            while free > 0 {
                let Some(key) = endpoint.queue.next_due(now_ms) else {
                    break;
                };
                self.next_serial += 1;
                let serial = self.next_serial;
                let delivery = endpoint
                    .queue
                    .deliveries
                    .get_mut(&key)
                    .expect("next_due names a queued webhook");
                delivery.attempts += 1;
                delivery.in_flight = Some(serial);
                let attempt = delivery.attempts;
                let (kind, webhook_id, body) = (
                    delivery.kind,
                    delivery.webhook_id.clone(),
                    delivery.body.clone(),
                );
                let event_id = delivery.event_id.clone();
                endpoint.log.push(StoriesLogEntry::Sent {
                    at_ms: now_ms,
                    serial,
                    kind,
                    webhook_id: webhook_id.clone(),
                    event_id,
                    attempt,
                });
                sends.push(Outgoing::signed(
                    endpoint.id,
                    &endpoint.url,
                    &endpoint.secrets,
                    serial,
                    kind,
                    webhook_id,
                    attempt,
                    body,
                    wall_unix_s,
                ));
                free -= 1;
            }
        }
        sends
    }

    /// When [`Stories::poll_sends`] next has something to send, if anything waits that a free
    /// slot could take.
    pub fn next_send_at(&self) -> Option<u64> {
        let concurrency = self.faults.concurrency.max(1);
        self.endpoints
            .values()
            .filter(|e| !e.paused && e.queue.in_flight() < concurrency)
            .filter_map(|e| e.queue.next_ready_at())
            .min()
    }

    /// Takes the answer to the attempt `serial` of endpoint `id` and decides what follows.
    pub fn on_answer(
        &mut self,
        id: Uuid,
        serial: u64,
        answer: Answer,
        now_ms: u64,
        wall_unix_s: i64,
    ) {
        let config = self.config.sender.clone();
        let duplicate = self.faults.duplicate.clamp(0.0, 1.0);
        let Some(endpoint) = self.endpoints.get_mut(&id) else {
            return;
        };
        let Some(key) = endpoint
            .queue
            .deliveries
            .iter()
            .find(|(_, d)| d.in_flight == Some(serial))
            .map(|(key, _)| *key)
        else {
            return;
        };
        let queue = &mut endpoint.queue;
        let delivery = queue.deliveries.get_mut(&key).expect("found above");
        delivery.in_flight = None;
        let (webhook_id, event_id) = (delivery.webhook_id.clone(), delivery.event_id.clone());
        let (code, retry_after) = answer.code_and_retry_after(
            wall_unix_s,
            config.time_compression,
            config.retry_after_max_ms,
        );
        let mut gave_up = None;
        let decision = if delivery.kind == MessageKind::Duplicate {
            queue.deliveries.remove(&key);
            "extra send: answer logged only".to_owned()
        } else {
            match code {
                Some(200..=299) => {
                    let done = queue.deliveries.remove(&key).expect("found above");
                    if done.event_type == StoryEventType::Closed {
                        queue.release_created(&done.story_id);
                    }
                    let mut decision = "delivered".to_owned();
                    if endpoint.rng.gen_bool(duplicate) {
                        queue.push(Delivery {
                            kind: MessageKind::Duplicate,
                            attempts: done.attempts,
                            failing_since: None,
                            not_before: now_ms,
                            held_until: None,
                            in_flight: None,
                            ..done
                        });
                        decision.push_str("; fault: will deliver it again");
                    }
                    decision
                }
                Some(410) => {
                    endpoint.paused = true;
                    "410: endpoint paused until resumed".to_owned()
                }
                _ => {
                    let failing_since = *delivery.failing_since.get_or_insert(now_ms);
                    let exhausted = delivery.attempts >= config.max_attempts
                        || now_ms.saturating_sub(failing_since) >= config.give_up_after_ms;
                    let delay = match (code, retry_after) {
                        (Some(429) | Some(503), Some(delay)) => delay,
                        _ => {
                            let ceiling = backoff_ceiling(
                                config.backoff_base_ms,
                                config.backoff_max_ms,
                                delivery.attempts,
                            );
                            endpoint
                                .rng
                                .gen_range(0..=ceiling)
                                .max(retry_after.unwrap_or(0))
                        }
                    };
                    let what = code.map_or("no answer".to_owned(), |c| c.to_string());
                    if exhausted {
                        let done = queue.deliveries.remove(&key).expect("found above");
                        if done.event_type == StoryEventType::Closed {
                            queue.release_created(&done.story_id);
                        }
                        gave_up = Some(done.attempts);
                        format!("{what}: given up after {} attempts", done.attempts)
                    } else {
                        delivery.not_before = now_ms + delay;
                        format!("{what}: again in {delay} ms")
                    }
                }
            }
        };
        tracing::debug!(endpoint = %id, serial, %webhook_id, ?answer, %decision, "stories answer taken");
        endpoint.log.push(StoriesLogEntry::Answered {
            at_ms: now_ms,
            serial,
            webhook_id: webhook_id.clone(),
            event_id: event_id.clone(),
            answer,
            decision,
        });
        if let Some(attempts) = gave_up {
            endpoint.log.push(StoriesLogEntry::GaveUp {
                at_ms: now_ms,
                webhook_id,
                event_id,
                attempts,
            });
        }
    }

    /// True when no endpoint has a webhook waiting or in flight (a paused endpoint's wait).
    pub fn is_idle(&self) -> bool {
        self.endpoints
            .values()
            .all(|e| e.paused || e.queue.is_empty())
    }

    /// True when the endpoint has nothing waiting or in flight.
    pub fn is_endpoint_idle(&self, id: Uuid) -> bool {
        self.endpoints.get(&id).is_none_or(|e| e.queue.is_empty())
    }

    /// What was sent to the endpoint and how each answer was taken.
    pub fn stories_log(&self, id: Uuid) -> &[StoriesLogEntry] {
        self.endpoints
            .get(&id)
            .map(|e| e.log.as_slice())
            .unwrap_or(&[])
    }

    /// The event ids of the webhooks given up, in the order they were.
    pub fn given_up(&self, id: Uuid) -> Vec<String> {
        self.stories_log(id)
            .iter()
            .filter_map(|entry| match entry {
                StoriesLogEntry::GaveUp { event_id, .. } => Some(event_id.clone()),
                _ => None,
            })
            .collect()
    }

    /// The event ids of every attempt answered 2xx (duplicates included), in answer order.
    pub fn delivered(&self, id: Uuid) -> Vec<String> {
        self.stories_log(id)
            .iter()
            .filter_map(|entry| match entry {
                StoriesLogEntry::Answered {
                    event_id,
                    answer: Answer::Status { code, .. },
                    ..
                } if (200..300).contains(code) => Some(event_id.clone()),
                _ => None,
            })
            .collect()
    }
}
