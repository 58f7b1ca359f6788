//! Builders shared by the test files: events and messages shaped like the wire file's examples,
//! snapshot-mode plans of story events, and the proptest configuration.
#![allow(dead_code)]

use std::collections::HashMap;

use proptest::test_runner::Config as ProptestConfig;
use relay_rules::{decide_stories_run, HeldStory, ReadItem, StoriesMode, StoriesPlan, StoriesRun};
use relay_wire::{
    Event, EventBody, FeedAction, FeedData, FeedItem, ItemKind, Message, Sequence, StoryEvent,
};
use serde_json::{json, Value};

pub const ENDPOINT: &str = "8d2f0c39-2b63-4c55-9a8a-3f5b1d7c1e20";
pub const WIRE_FILE: &str = include_str!("../../../wire/tests/fixtures/wire-v1.json");

/// The wire file's example message `name`, parsed from its exact body bytes.
pub fn wire_example(name: &str) -> Message {
    let wire: Value = serde_json::from_str(WIRE_FILE).unwrap();
    let body = wire["messages"][name]["body_bytes"].as_str().unwrap();
    Message::parse(body.as_bytes()).unwrap()
}

pub fn parse(body: Value) -> Message {
    Message::parse(body.to_string().as_bytes()).unwrap()
}

pub fn seq(n: u64) -> Sequence {
    Sequence::from_parts(1, n)
}

pub fn subject(n: u32) -> String {
    format!("announcement:{n}")
}

/// An item's JSON as a feed event's data carries it, with the given parts.
pub fn item_json(subject_n: u32, item_seq: u64, parts: &[(&str, i64)], note: &str) -> Value {
    let parts: Vec<Value> = parts
        .iter()
        .map(|(id, v)| json!({"kind": "flash", "part_id": id, "part_version": v}))
        .collect();
    json!({"type": "item", "feed_item_id": subject(subject_n), "item_kind": "announcement",
           "seq": item_seq, "first_seq": item_seq, "op": "changed", "changes": [],
           "parts": parts, "lang": "en", "note": note})
}

/// An `announcement.updated` event's JSON at `sequence`, carrying `item`.
pub fn update_json(id: &str, subject_n: u32, sequence: u64, item: Value) -> Value {
    json!({"id": id, "type": "announcement.updated", "subject": subject(subject_n),
           "sequence": seq(sequence).as_str(), "specversion": "1.0", "data": item})
}

/// [`update_json`] carrying an item of no parts whose `seq` is the event's sequence.
pub fn plain_update_json(id: &str, subject_n: u32, sequence: u64, note: &str) -> Value {
    update_json(
        id,
        subject_n,
        sequence,
        item_json(subject_n, sequence, &[], note),
    )
}

/// An `announcement.<action>` removal event's JSON at `sequence`.
pub fn removal_json(id: &str, action: &str, subject_n: u32, sequence: u64) -> Value {
    json!({"id": id, "type": format!("announcement.{action}"), "subject": subject(subject_n),
           "sequence": seq(sequence).as_str(),
           "data": {"type": action, "feed_item_id": subject(subject_n), "seq": sequence}})
}

/// A refetch event's JSON at `sequence`.
pub fn refetch_json(id: &str, subject_n: u32, sequence: u64) -> Value {
    json!({"id": id, "type": "announcement.updated", "subject": subject(subject_n),
           "sequence": seq(sequence).as_str(),
           "data": {"type": "refetch", "op": "changed", "feed_item_id": subject(subject_n),
                    "seq": sequence}})
}

/// A feed message of `generation` under `access_version` holding `events`.
pub fn message(
    generation: u64,
    access_version: &str,
    through: &str,
    events: Vec<Value>,
) -> Message {
    parse(
        json!({"v": 1, "webhook_endpoint_id": ENDPOINT, "track": "feed",
                 "generation": generation, "access_version": access_version,
                 "since": "1.1", "through": through, "complete": true, "events": events}),
    )
}

/// A reset message of `generation` under `access_version`.
pub fn reset(generation: u64, access_version: &str, reason: &str) -> Message {
    parse(
        json!({"v": 1, "webhook_endpoint_id": ENDPOINT, "track": "feed",
                 "generation": generation, "access_version": access_version,
                 "events": [{"id": format!("evt_reset_{generation}_{access_version}"),
                             "type": "webhook_endpoint.reset",
                             "data": {"access_version": access_version, "generation": generation,
                                      "reason": reason, "resume_from": "1.1", "track": "feed"}}]}),
    )
}

/// The single event of a one-event message built from `event`.
pub fn event(event: Value) -> Event {
    message(1, "av", "1.1", vec![event]).events.remove(0)
}

/// The content the property tests give a position: a function of (subject, seq / 2), so that
/// some different positions carry an identical item (exercising `Unchanged`).
pub fn content(subject_n: u32, sequence: u64) -> FeedItem {
    let v = (sequence / 2) as i64;
    let raw = item_json(
        subject_n,
        sequence / 2,
        &[("flash:1", v), ("flash:2", 1)],
        "p",
    );
    let mut raw = raw;
    if v % 2 == 0 {
        raw["parts"].as_array_mut().unwrap().pop();
    }
    FeedItem::from_value(raw, "data").unwrap()
}

/// A feed event built directly: (subject, generation, sequence, removal) names it, so its id is
/// the same whenever the same change is sent again.
pub fn feed_event(subject_n: u32, generation: u64, sequence: u64, removal: bool) -> Event {
    let id = format!("evt_{subject_n}_{generation}_{sequence}_{removal}");
    let (action, data) = if removal {
        (
            FeedAction::Hidden,
            FeedData::Removal {
                feed_item_id: subject(subject_n),
                seq: sequence,
            },
        )
    } else {
        (
            FeedAction::Updated,
            FeedData::Item(content(subject_n, sequence)),
        )
    };
    Event {
        id,
        event_type: format!("announcement.{}", action.as_str()),
        body: EventBody::Feed {
            kind: ItemKind::Announcement,
            action,
            subject: subject(subject_n),
            sequence: seq(sequence),
            data,
        },
    }
}

pub fn read_item(subject_n: u32, sequence: u64) -> ReadItem {
    ReadItem {
        subject: subject(subject_n),
        sequence: seq(sequence),
        item: content(subject_n, sequence),
    }
}

/// [`feed_event`]'s JSON, for building whole messages.
pub fn feed_event_json(subject_n: u32, generation: u64, sequence: u64, removal: bool) -> Value {
    let id = format!("evt_{subject_n}_{generation}_{sequence}_{removal}");
    if removal {
        removal_json(&id, "hidden", subject_n, sequence)
    } else {
        update_json(&id, subject_n, sequence, content(subject_n, sequence).raw)
    }
}

/// A feed message of `generation` under `access_version` holding one [`feed_event_json`] per
/// (subject, generation, sequence, removal).
pub fn feed_message(
    generation: u64,
    access_version: &str,
    through: &str,
    events: &[(u32, u64, u64, bool)],
) -> Message {
    let events = events
        .iter()
        .map(|&(s, g, n, r)| feed_event_json(s, g, n, r))
        .collect();
    message(generation, access_version, through, events)
}

/// The proptest configuration of a block: `PROPTEST_CASES` when set (and a number), else
/// `default_cases`. (`ProptestConfig::with_cases` would override the variable.)
pub fn config(default_cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default_cases),
        ..ProptestConfig::default()
    }
}

/// The plan of `events` in snapshot mode (no reads, every ticker followed) against `held`,
/// notifying events created from `registered_at` on (unix nanoseconds; `None`: every one).
pub fn snapshot_plan(
    events: &[Result<StoryEvent, String>],
    held: &HashMap<String, HeldStory>,
    registered_at: Option<i128>,
) -> StoriesPlan {
    decide_stories_run(StoriesRun {
        mode: StoriesMode::Snapshot,
        events,
        held,
        reads: &HashMap::new(),
        tickers: None,
        registered_at,
    })
}
