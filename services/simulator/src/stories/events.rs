//! The stories' events as upstream-api.md shapes them, and the log they are published in.
//!
//! One event's JSON is rendered once, when it is published, and its bytes are every webhook's
//! body and every /v1/events entry: `{"event_id", "type", "origin", "created_at", "data"}`.

use std::sync::Arc;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::model::StoryChange;
use crate::model::UnixMs;

/// Where an event comes from. A backfill event changes the copy like any other but never causes
/// a notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    Live,
    Backfill,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Live => "live",
            Origin::Backfill => "backfill",
        }
    }
}

/// The event types upstream-api.md names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum StoryEventType {
    #[serde(rename = "story.created")]
    Created,
    #[serde(rename = "story.updated")]
    Updated,
    #[serde(rename = "story.became_strong")]
    BecameStrong,
    #[serde(rename = "story.closed")]
    Closed,
    #[serde(rename = "article.shortlisted")]
    Shortlisted,
}

impl StoryEventType {
    pub fn as_str(self) -> &'static str {
        match self {
            StoryEventType::Created => "story.created",
            StoryEventType::Updated => "story.updated",
            StoryEventType::BecameStrong => "story.became_strong",
            StoryEventType::Closed => "story.closed",
            StoryEventType::Shortlisted => "article.shortlisted",
        }
    }
}

/// One published event.
#[derive(Debug, Clone)]
pub struct LoggedEvent {
    /// Its place in publication order (0, 1, ...), over every ticker.
    pub position: usize,
    pub event_id: String,
    pub event_type: StoryEventType,
    pub origin: Origin,
    pub ticker: String,
    /// The story it is about (the closed one, for `story.closed`).
    pub story_id: String,
    /// The driver's clock when it was published (the window's age counts from it).
    pub published_ms: u64,
    pub json: Value,
    /// `json`'s bytes: the webhook body.
    pub body: Arc<Vec<u8>>,
}

/// `evt_` and 16 hex digits, from the upstream's seed and the event's position: the same on every
/// delivery and every read, and the same in a replay with the seed.
pub fn event_id(seed: u64, position: usize) -> String {
    let mut hash = Sha256::new();
    hash.update(b"story-event");
    hash.update(seed.to_be_bytes());
    hash.update((position as u64).to_be_bytes());
    format!("evt_{}", hex::encode(&hash.finalize()[..8]))
}

/// The event's type and `data`.
pub fn type_and_data(change: &StoryChange) -> (StoryEventType, Value) {
    match change {
        StoryChange::Created { story } => (StoryEventType::Created, json!({"story": story})),
        StoryChange::Updated { story } => (StoryEventType::Updated, json!({"story": story})),
        StoryChange::BecameStrong { story } => {
            (StoryEventType::BecameStrong, json!({"story": story}))
        }
        StoryChange::Shortlisted { article } => (
            StoryEventType::Shortlisted,
            json!({"article": article.to_json()}),
        ),
        StoryChange::Closed {
            story_id,
            version,
            merged_into,
        } => (
            StoryEventType::Closed,
            json!({"story_id": story_id, "version": version, "merged_into": merged_into}),
        ),
    }
}

/// The event as webhooks and /v1/events carry it.
pub fn render(
    event_id: &str,
    event_type: StoryEventType,
    origin: Origin,
    created_at_ms: UnixMs,
    data: Value,
) -> Value {
    json!({
        "event_id": event_id,
        "type": event_type.as_str(),
        "origin": origin.as_str(),
        "created_at": crate::render::timestamp(created_at_ms),
        "data": data,
    })
}
