//! Rendering the model as the wire file's JSON: items, CloudEvents-shaped events and message
//! bodies, with deterministic ids.
//!
//! Every id is derived by hashing what it names, never drawn at random, so that a replay with the
//! same seed sends byte-identical bodies, and so that an event id is the same for one change
//! rendered under one key's access and language wherever it is sent (a retry, a rewind, another
//! endpoint of the key, /v1/feed/since), as the wire file promises.

use std::collections::BTreeSet;

use relay_wire::{Cursor, ItemKind};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::model::{Access, Change, Company, Item, Key, PartKind, Selection, UnixMs, World};

pub const FEED_SOURCE: &str = "https://api.quanor.com/v1/feed";
pub const ENDPOINTS_SOURCE: &str = "https://api.quanor.com/v1/webhook-endpoints";
pub const TRACK_FEED: &str = "feed";

/// Crockford-style lowercase base32, as the upstream's ids use.
const BASE32: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";

fn digest(parts: &[&[u8]]) -> [u8; 32] {
    let mut hash = Sha256::new();
    for part in parts {
        // Length-prefixed so that ("ab","c") and ("a","bc") differ.
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    hash.finalize().into()
}

/// `evt_` and 26 base32 characters (130 bits; the first character carries 3 bits, as a TypeID's).
pub fn event_id(parts: &[&[u8]]) -> String {
    let bytes = digest(parts);
    let mut bits: u128 = u128::from_be_bytes(bytes[..16].try_into().expect("16 bytes"));
    let mut chars = [0u8; 26];
    for slot in chars.iter_mut().rev().take(25) {
        *slot = BASE32[(bits & 31) as usize];
        bits >>= 5;
    }
    chars[0] = BASE32[(bytes[16] & 7) as usize];
    format!("evt_{}", String::from_utf8(chars.to_vec()).expect("ascii"))
}

/// `msg_` and 32 hex digits, from the endpoint and the exact body: the same on every attempt of
/// an identical body, and new whenever a retry is rebuilt with other content.
pub fn webhook_id(endpoint_id: Uuid, body: &[u8]) -> String {
    let bytes = digest(&[b"message", endpoint_id.as_bytes(), body]);
    format!("msg_{}", hex::encode(&bytes[..16]))
}

/// A deterministic UUID (version 4 layout) from a name.
pub fn uuid_from(parts: &[&[u8]]) -> Uuid {
    let bytes = digest(parts);
    let raw: [u8; 16] = bytes[..16].try_into().expect("16 bytes");
    uuid::Builder::from_random_bytes(raw).into_uuid()
}

/// The upstream's timestamp form: `2026-10-08T06:00:00.300000Z` (microseconds, UTC).
pub fn timestamp(at_ms: UnixMs) -> String {
    let at = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(at_ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second(),
        at.microsecond()
    )
}

fn headline_in(lang: &str, headline: &str) -> String {
    if lang == "en" {
        headline.to_owned()
    } else {
        format!("[{lang}] {headline}")
    }
}

fn dataschema(event_type: &str) -> String {
    format!("https://api.quanor.com/api/docs/events/{event_type}.v1.data.schema.json")
}

/// An item as GET /v1/feed and a feed event's data carry it, in `lang`, under `access`, with
/// only the parts of `part_kinds` (all when `None`).
pub fn render_item(
    item: &Item,
    company: &Company,
    lang: &str,
    access: Access,
    part_kinds: Option<&BTreeSet<PartKind>>,
) -> Value {
    let teaser = access == Access::Teaser;
    let edition_id = 5000 + (item.number % 1000) as i64;
    let parts: Vec<Value> = item
        .parts
        .iter()
        .filter(|p| part_kinds.is_none_or(|kinds| kinds.contains(&p.kind)))
        .enumerate()
        .map(|(index, part)| match part.kind {
            PartKind::Flash => json!({
                "corrects": [],
                "created_at": timestamp(part.created_at_ms),
                "edition_id": edition_id,
                "flash_id": part.number,
                "flash_type": if index == 0 { "main" } else { "context" },
                "headline": headline_in(lang, &part.headline),
                "kind": "flash",
                "part_id": part.part_id(),
                "part_version": part.part_version,
                "relevance": 4,
                "sentiment": part.sentiment,
                "sentiment_confidence": 4,
            }),
            PartKind::Story => json!({
                "corrected": part.corrected,
                "first_published_at": timestamp(part.created_at_ms),
                "headline": headline_in(lang, &part.headline),
                "inside_information": true,
                "kicker": null,
                "kind": "story",
                "lang": lang,
                "lede_first_sentence": if teaser {
                    Value::Null
                } else {
                    Value::String(headline_in(lang, &format!("{}: the details.", part.headline)))
                },
                "part_id": part.part_id(),
                "part_version": part.part_version,
                "reason": if part.corrected { "correction" } else if part.version > 1 { "update" } else { "new" },
                "relevance": 4,
                "report": null,
                "story_id": part.number,
                "treatment": if teaser { "teaser" } else { "full" },
                "url": if teaser {
                    Value::Null
                } else {
                    Value::String(format!("https://app.quanor.com/articles/story/{}", part.number))
                },
                "version": part.version,
                "version_published_at": timestamp(part.version_published_at_ms),
            }),
        })
        .collect();
    let first_flash_at = item
        .parts
        .iter()
        .find(|p| p.kind == PartKind::Flash)
        .map(|p| timestamp(p.created_at_ms));
    let head = match item.kind {
        ItemKind::Announcement => json!({
            "announcement_id": item.number,
            "announcement_kind": "order",
            "edition_ids": [edition_id],
            "first_flash_at": first_flash_at,
            "inside_information": true,
            "language": "sv",
            "received_at": timestamp(item.published_at_ms),
            "report": null,
            "route": "press_release",
            "title": headline_in(lang, &item.title),
        }),
        ItemKind::PreEarningsAnalysis => json!({
            "analysis_id": item.number,
            "first_flash_at": first_flash_at,
            "language": "en",
            "received_at": timestamp(item.published_at_ms),
            "report": {"fiscal_period": "2026-Q3"},
            "title": headline_in(lang, &item.title),
        }),
    };
    json!({
        "access": access.as_str(),
        "changes": [],
        "company": {
            "company_id": company.company_id,
            "listed_exchange": company.listed_exchange(),
            "logo_url": null,
            "market_exchange_id": company.market_exchange_id(),
            "market_exchange_mic": company.mic,
            "name": company.name,
            "short_name": company.short_name,
            "symbol": company.symbol,
        },
        "corrected_at": item.corrected_at_ms.map(timestamp),
        "feed_item_id": item.feed_item_id(),
        "first_seq": item.first_seq,
        "flags": {"corrected": item.corrected_at_ms.is_some()},
        "head": head,
        "item_kind": item.kind.as_str(),
        "lang": lang,
        "op": if item.seq == item.first_seq { "new" } else { "changed" },
        "parts": parts,
        "published_at": timestamp(item.published_at_ms),
        "seq": item.seq,
        "sort_at": timestamp(item.published_at_ms),
        "superseded_parts": item.superseded_parts,
        "type": "item",
    })
}

/// What a change becomes for one reader (a key's access, a selection, a language).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventForm {
    /// The item is selected after the change: `updated`, carrying the item.
    Item,
    /// `updated`, as a refetch.
    Refetch,
    /// The item was selected and was hidden or withdrawn.
    Removal,
}

/// Decides whether (and how) a change reaches a reader. `None`: the change is not theirs.
pub fn event_form(
    world: &World,
    key: &Key,
    selection: &Selection,
    change: &Change,
    force_refetch: bool,
) -> Option<EventForm> {
    if world.visible(key, selection, &change.after).is_some() {
        return Some(if change.as_refetch || force_refetch {
            EventForm::Refetch
        } else {
            EventForm::Item
        });
    }
    let was_visible = change
        .before
        .as_ref()
        .is_some_and(|before| world.visible(key, selection, before).is_some());
    (was_visible && change.kind.is_removal()).then_some(EventForm::Removal)
}

/// The event type a change has in a form: `announcement.updated`, `...hidden`, ...
pub fn event_type(change: &Change, form: EventForm) -> String {
    let action = match (form, change.kind) {
        (EventForm::Removal, crate::model::ChangeKind::Hidden) => "hidden",
        (EventForm::Removal, _) => "withdrawn",
        _ => "updated",
    };
    format!("{}.{action}", change.after.kind.as_str())
}

/// The id of one change rendered under `access_version` in `lang` (a refetch is its own event).
pub fn feed_event_id(change: &Change, form: EventForm, access_version: &str, lang: &str) -> String {
    let form_tag: &[u8] = match form {
        EventForm::Refetch => b"refetch",
        _ => b"event",
    };
    event_id(&[
        b"feed",
        &change.epoch.to_be_bytes(),
        &change.seq.to_be_bytes(),
        access_version.as_bytes(),
        lang.as_bytes(),
        form_tag,
    ])
}

/// A feed event as a message's `events` and /v1/feed/since carry it.
pub fn render_feed_event(
    world: &World,
    key: &Key,
    selection: &Selection,
    change: &Change,
    form: EventForm,
) -> Value {
    let item = &change.after;
    let feed_item_id = item.feed_item_id();
    let event_type = event_type(change, form);
    let mut event = Map::new();
    let data = match form {
        EventForm::Item => {
            let company = &world.companies[&item.company_id];
            let access = world
                .visible(key, selection, item)
                .unwrap_or(Access::Teaser);
            event.insert("companyid".into(), json!(item.company_id));
            render_item(
                item,
                company,
                &selection.lang,
                access,
                selection.part_kinds.as_ref(),
            )
        }
        EventForm::Refetch => json!({
            "feed_item_id": feed_item_id,
            "op": if item.seq == item.first_seq { "new" } else { "changed" },
            "seq": item.seq,
            "type": "refetch",
        }),
        EventForm::Removal => json!({
            "feed_item_id": feed_item_id,
            "seq": item.seq,
            "type": if change.kind == crate::model::ChangeKind::Hidden { "hidden" } else { "withdrawn" },
        }),
    };
    event.insert("data".into(), data);
    event.insert("datacontenttype".into(), json!("application/json"));
    event.insert("dataschema".into(), json!(dataschema(&event_type)));
    event.insert(
        "id".into(),
        json!(feed_event_id(
            change,
            form,
            &key.access_version(),
            &selection.lang
        )),
    );
    event.insert("sequence".into(), json!(item.sequence().as_str()));
    event.insert("source".into(), json!(FEED_SOURCE));
    event.insert("specversion".into(), json!("1.0"));
    event.insert("subject".into(), json!(feed_item_id));
    event.insert("type".into(), json!(event_type));
    Value::Object(event)
}

/// A `webhook_endpoint.reset` event.
pub fn render_reset_event(
    endpoint_id: Uuid,
    access_version: &str,
    generation: u64,
    reason: &str,
    resume_from: Cursor,
) -> Value {
    let event_type = "webhook_endpoint.reset";
    json!({
        "data": {
            "access_version": access_version,
            "generation": generation,
            "reason": reason,
            "resume_from": resume_from.to_string(),
            "track": TRACK_FEED,
        },
        "datacontenttype": "application/json",
        "dataschema": dataschema(event_type),
        "id": event_id(&[b"reset", endpoint_id.as_bytes(), &generation.to_be_bytes(), reason.as_bytes(), resume_from.to_string().as_bytes()]),
        "source": ENDPOINTS_SOURCE,
        "specversion": "1.0",
        "type": event_type,
    })
}

/// A `webhook_endpoint.tested` event; `example` is a type's example event when one was named.
pub fn render_test_event(test_send_id: Uuid, example: Option<Value>) -> Value {
    let event_type = "webhook_endpoint.tested";
    let mut data = Map::new();
    if let Some(example) = example {
        data.insert("example".into(), example);
    }
    data.insert("test_send_id".into(), json!(test_send_id.to_string()));
    json!({
        "data": data,
        "datacontenttype": "application/json",
        "dataschema": dataschema(event_type),
        "id": event_id(&[b"test", test_send_id.as_bytes()]),
        "source": ENDPOINTS_SOURCE,
        "specversion": "1.0",
        "type": event_type,
    })
}

/// The body of a message of feed events.
#[allow(clippy::too_many_arguments)]
pub fn events_body(
    endpoint_id: Uuid,
    access_version: &str,
    generation: u64,
    since: Cursor,
    through: Cursor,
    complete: bool,
    events: Vec<Value>,
) -> Vec<u8> {
    let body = json!({
        "access_version": access_version,
        "complete": complete,
        "events": events,
        "generation": generation,
        "since": since.to_string(),
        "through": through.to_string(),
        "track": TRACK_FEED,
        "v": 1,
        "webhook_endpoint_id": endpoint_id.to_string(),
    });
    serde_json::to_vec(&body).expect("a JSON value serialises")
}

/// The body of a reset message.
pub fn reset_body(
    endpoint_id: Uuid,
    access_version: &str,
    generation: u64,
    reason: &str,
    resume_from: Cursor,
) -> Vec<u8> {
    let body = json!({
        "access_version": access_version,
        "events": [render_reset_event(endpoint_id, access_version, generation, reason, resume_from)],
        "generation": generation,
        "track": TRACK_FEED,
        "v": 1,
        "webhook_endpoint_id": endpoint_id.to_string(),
    });
    serde_json::to_vec(&body).expect("a JSON value serialises")
}

/// The body of a test message.
pub fn test_body(endpoint_id: Uuid, test_send_id: Uuid, example: Option<Value>) -> Vec<u8> {
    let body = json!({
        "events": [render_test_event(test_send_id, example)],
        "v": 1,
        "webhook_endpoint_id": endpoint_id.to_string(),
    });
    serde_json::to_vec(&body).expect("a JSON value serialises")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_the_wire_forms() {
        let id = event_id(&[b"x"]);
        assert_eq!(id.len(), 4 + 26);
        assert!(id[4..].bytes().all(|b| BASE32.contains(&b)));
        assert!(id.as_bytes()[4] <= b'7');
        let msg = webhook_id(Uuid::nil(), b"{}");
        assert_eq!(msg.len(), 4 + 32);
        assert!(msg[4..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(msg, webhook_id(Uuid::nil(), b"{}"));
        assert_ne!(msg, webhook_id(Uuid::nil(), b"{ }"));
    }

    #[test]
    fn timestamps_have_microseconds() {
        assert_eq!(timestamp(1_791_439_200_351), "2026-10-08T06:00:00.351000Z");
    }
}
