//! The v1 message body and its events.
//!
//! Reading is strict about what version 1 names and lenient about everything else, as the wire
//! file's last reading rule asks: an event type, a track or a field that version 1 does not name
//! is kept as an ignored value, never an error. A field that version 1 names but that has the
//! wrong shape is an error, because applying a half-understood change would corrupt a copy,
//! while refusing the message makes the upstream retry it and, in the end, reset the endpoint.
//!
//! The strings the relay keeps as identifiers (the track, event ids and types, subjects,
//! sequences and positions, access versions, feed item and part ids) may not hold control
//! characters: Postgres' text cannot hold NUL, one such value would fail every message it shares
//! a statement with, and a control character in an id only ever forges or breaks what shows it.

use serde_json::{Map, Value};
use uuid::Uuid;

use crate::fields::{self, join};
use crate::limits::MAX_EVENTS;
use crate::sequence::Sequence;

/// A parsed message body. `ignored` holds the top-level fields version 1 does not name.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub v: u64,
    pub webhook_endpoint_id: Uuid,
    /// Absent on test messages, which belong to no track.
    pub track: Option<Track>,
    pub generation: Option<u64>,
    pub access_version: Option<String>,
    /// Short-form position the message's events follow (`E.S`).
    pub since: Option<String>,
    /// Short-form position the message's events reach (`E.S`).
    pub through: Option<String>,
    pub complete: Option<bool>,
    pub events: Vec<Event>,
    pub ignored: Map<String, Value>,
}

/// A message's track. Version 1 names only `feed`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Track {
    Feed,
    /// A track version 1 does not name: its messages are stored and ignored.
    Ignored(String),
}

impl Track {
    pub fn parse(name: &str) -> Self {
        match name {
            "feed" => Track::Feed,
            other => Track::Ignored(other.to_owned()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Track::Feed => "feed",
            Track::Ignored(name) => name,
        }
    }
}

/// One CloudEvents-shaped event of a message.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub id: String,
    /// The `type` attribute exactly as sent.
    pub event_type: String,
    pub body: EventBody,
}

/// What an event says, routed by its type.
#[derive(Debug, Clone, PartialEq)]
pub enum EventBody {
    /// `announcement.*` and `pre_earnings_analysis.*`.
    Feed {
        kind: ItemKind,
        action: FeedAction,
        /// The feed item the event is about (`announcement:88001`).
        subject: String,
        sequence: Sequence,
        data: FeedData,
    },
    /// `webhook_endpoint.reset`.
    Reset(ResetData),
    /// `webhook_endpoint.tested`: answered like any message, never applied.
    Tested(TestedData),
    /// A type version 1 does not name, or a feed action it does not name. Kept, never applied.
    Ignored { data: Value },
}

/// The two kinds of feed item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ItemKind {
    Announcement,
    PreEarningsAnalysis,
}

impl ItemKind {
    pub const ALL: [ItemKind; 2] = [ItemKind::Announcement, ItemKind::PreEarningsAnalysis];

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "announcement" => Some(ItemKind::Announcement),
            "pre_earnings_analysis" => Some(ItemKind::PreEarningsAnalysis),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ItemKind::Announcement => "announcement",
            ItemKind::PreEarningsAnalysis => "pre_earnings_analysis",
        }
    }
}

/// The action half of a feed event's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FeedAction {
    Updated,
    Withdrawn,
    Hidden,
}

impl FeedAction {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "updated" => Some(FeedAction::Updated),
            "withdrawn" => Some(FeedAction::Withdrawn),
            "hidden" => Some(FeedAction::Hidden),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FeedAction::Updated => "updated",
            FeedAction::Withdrawn => "withdrawn",
            FeedAction::Hidden => "hidden",
        }
    }

    pub fn is_removal(self) -> bool {
        matches!(self, FeedAction::Withdrawn | FeedAction::Hidden)
    }
}

/// A feed event's data.
#[derive(Debug, Clone, PartialEq)]
pub enum FeedData {
    /// `updated` with `data.type = "item"`: the item itself.
    Item(FeedItem),
    /// `data.type = "refetch"`: read the item from the API instead.
    Refetch { feed_item_id: String, seq: u64 },
    /// `withdrawn` or `hidden`: remove the item, keep a tombstone.
    Removal { feed_item_id: String, seq: u64 },
}

/// A feed item as an event or an API page carries it. `raw` is the whole object as received
/// (what the copy stores); the typed fields are what the relay decides by.
#[derive(Debug, Clone, PartialEq)]
pub struct FeedItem {
    pub feed_item_id: String,
    pub item_kind: ItemKind,
    pub seq: u64,
    pub company_id: Option<i64>,
    pub lang: Option<String>,
    pub parts: Vec<PartRef>,
    pub raw: Value,
}

/// What identifies one version of a part: compare these to learn what changed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartRef {
    pub part_id: String,
    pub part_version: i64,
}

/// `webhook_endpoint.reset` data.
#[derive(Debug, Clone, PartialEq)]
pub struct ResetData {
    pub access_version: String,
    pub generation: u64,
    pub reason: String,
    pub resume_from: Option<String>,
    pub track: Track,
}

/// `webhook_endpoint.tested` data. `example` is a type's example: never a change.
#[derive(Debug, Clone, PartialEq)]
pub struct TestedData {
    pub test_send_id: String,
    pub example: Option<Value>,
}

/// Why a body is not a readable v1 message.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum MessageError {
    #[error("the body is not JSON: {0}")]
    NotJson(String),
    #[error("{0} is missing")]
    Missing(String),
    #[error("{field} must be {expected}")]
    WrongShape {
        field: String,
        expected: &'static str,
    },
    #[error("message version {0} is not one this relay reads (it reads 1)")]
    UnsupportedVersion(u64),
    #[error("{field} holds a control character (U+{code:04X})")]
    ControlCharacter { field: String, code: u32 },
    #[error("the message holds {count} events; a message holds at most {max} (the wire file's max_events)")]
    TooManyEvents { count: usize, max: usize },
}

/// The largest generation kept: Postgres' bigint.
const MAX_GENERATION: u64 = i64::MAX as u64;

/// Refuses `text` when it holds a control character (C0, DEL or C1), naming `field`.
pub(crate) fn check_identifier(
    text: &str,
    field: impl FnOnce() -> String,
) -> Result<(), MessageError> {
    match text.chars().find(|c| c.is_control()) {
        None => Ok(()),
        Some(c) => Err(MessageError::ControlCharacter {
            field: field(),
            code: u32::from(c),
        }),
    }
}

impl Message {
    /// Reads a message body. Call only after the signature has been verified over these bytes.
    pub fn parse(body: &[u8]) -> Result<Self, MessageError> {
        let value: Value =
            serde_json::from_slice(body).map_err(|e| MessageError::NotJson(e.to_string()))?;
        let Value::Object(mut fields) = value else {
            return Err(MessageError::WrongShape {
                field: "the body".into(),
                expected: "a JSON object",
            });
        };
        let mut at = Fields::new(&mut fields, "");
        let v = at.required_u64("v")?;
        if v != 1 {
            return Err(MessageError::UnsupportedVersion(v));
        }
        let endpoint_text = at.required_str("webhook_endpoint_id")?;
        let webhook_endpoint_id =
            Uuid::parse_str(&endpoint_text).map_err(|_| MessageError::WrongShape {
                field: "webhook_endpoint_id".into(),
                expected: "a UUID",
            })?;
        let track = at.optional_id("track")?.map(|t| Track::parse(&t));
        let generation = at.optional_generation("generation")?;
        let access_version = at.optional_id("access_version")?;
        let since = at.optional_id("since")?;
        let through = at.optional_id("through")?;
        let complete = at.optional_bool("complete")?;
        let raw_events = match at.take("events") {
            Some(Value::Array(events)) => events,
            Some(_) => return Err(at.wrong("events", "an array")),
            None => return Err(MessageError::Missing("events".into())),
        };
        // The upstream never sends more: a message over the limit is not one it sent, and
        // applying it would let one signed body cost the sequencer without bound.
        if raw_events.len() > MAX_EVENTS {
            return Err(MessageError::TooManyEvents {
                count: raw_events.len(),
                max: MAX_EVENTS,
            });
        }
        let events = raw_events
            .into_iter()
            .enumerate()
            .map(|(index, event)| Event::parse(event, &format!("events[{index}]")))
            .collect::<Result<_, _>>()?;
        Ok(Message {
            v,
            webhook_endpoint_id,
            track,
            generation,
            access_version,
            since,
            through,
            complete,
            events,
            ignored: fields,
        })
    }

    /// True when every event is a test: such a message is answered and never applied.
    pub fn is_test(&self) -> bool {
        !self.events.is_empty()
            && self
                .events
                .iter()
                .all(|e| matches!(e.body, EventBody::Tested(_)))
    }
}

impl Event {
    fn parse(value: Value, path: &str) -> Result<Self, MessageError> {
        let mut fields = object(value, path)?;
        let mut at = Fields::new(&mut fields, path);
        let id = at.required_id("id")?;
        let event_type = at.required_id("type")?;
        let data = at.take("data").unwrap_or(Value::Null);
        let body = match event_type.split_once('.') {
            Some(("webhook_endpoint", "reset")) => {
                EventBody::Reset(ResetData::parse(data, &at.path("data"))?)
            }
            Some(("webhook_endpoint", "tested")) => {
                EventBody::Tested(TestedData::parse(data, &at.path("data"))?)
            }
            Some((kind, action)) => match (ItemKind::parse(kind), FeedAction::parse(action)) {
                (Some(kind), Some(action)) => {
                    let subject = at.required_id("subject")?;
                    let sequence = Sequence::new(at.required_id("sequence")?);
                    let data = FeedData::parse(data, action, &at.path("data"))?;
                    EventBody::Feed {
                        kind,
                        action,
                        subject,
                        sequence,
                        data,
                    }
                }
                _ => EventBody::Ignored { data },
            },
            None => EventBody::Ignored { data },
        };
        Ok(Event {
            id,
            event_type,
            body,
        })
    }
}

impl FeedData {
    fn parse(value: Value, action: FeedAction, path: &str) -> Result<Self, MessageError> {
        let mut fields = object(value, path)?;
        let data_type = Fields::new(&mut fields, path).required_str("type")?;
        if data_type == "refetch" {
            let mut at = Fields::new(&mut fields, path);
            return Ok(FeedData::Refetch {
                feed_item_id: at.required_id("feed_item_id")?,
                seq: at.required_u64("seq")?,
            });
        }
        if action.is_removal() {
            let mut at = Fields::new(&mut fields, path);
            return Ok(FeedData::Removal {
                feed_item_id: at.required_id("feed_item_id")?,
                seq: at.required_u64("seq")?,
            });
        }
        if data_type != "item" {
            return Err(MessageError::WrongShape {
                field: format!("{path}.type"),
                expected: "\"item\" or \"refetch\" on an updated event",
            });
        }
        fields.insert("type".into(), Value::String(data_type));
        FeedItem::from_value(Value::Object(fields), path).map(FeedData::Item)
    }
}

impl FeedItem {
    /// Reads a feed item object (from an event's data or an API page), keeping it whole in `raw`.
    pub fn from_value(raw: Value, path: &str) -> Result<Self, MessageError> {
        // Read by reference: `raw` keeps every field, known or not, without a copy.
        let at = FieldsRef::of(&raw, path, path)?;
        let feed_item_id = at.required_id("feed_item_id")?.to_owned();
        let kind_text = at.required_str("item_kind")?;
        let item_kind = ItemKind::parse(kind_text)
            .ok_or_else(|| at.wrong("item_kind", "announcement or pre_earnings_analysis"))?;
        let seq = at.required_u64("seq")?;
        let lang = at.optional_str("lang")?.map(str::to_owned);
        let company_id = at
            .get("company")
            .and_then(|company| company.get("company_id"))
            .and_then(Value::as_i64);
        let parts = match at.get("parts") {
            None => Vec::new(),
            Some(Value::Array(parts)) => parts
                .iter()
                .enumerate()
                .map(|(i, part)| PartRef::parse(part, &format!("{}[{i}]", at.path("parts"))))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(at.wrong("parts", "an array")),
        };
        Ok(FeedItem {
            feed_item_id,
            item_kind,
            seq,
            company_id,
            lang,
            parts,
            raw,
        })
    }
}

impl PartRef {
    fn parse(value: &Value, path: &str) -> Result<Self, MessageError> {
        let at = FieldsRef::of(value, path, path)?;
        let part_version = at
            .required("part_version")?
            .as_i64()
            .ok_or_else(|| at.wrong("part_version", "an integer"))?;
        Ok(PartRef {
            part_id: at.required_id("part_id")?.to_owned(),
            part_version,
        })
    }
}

impl ResetData {
    fn parse(value: Value, path: &str) -> Result<Self, MessageError> {
        let mut fields = object(value, path)?;
        let mut at = Fields::new(&mut fields, path);
        Ok(ResetData {
            access_version: at.required_id("access_version")?,
            generation: at
                .optional_generation("generation")?
                .ok_or_else(|| MessageError::Missing(at.path("generation")))?,
            reason: at.optional_id("reason")?.unwrap_or_default(),
            resume_from: at.optional_id("resume_from")?,
            track: Track::parse(&at.required_id("track")?),
        })
    }
}

impl TestedData {
    fn parse(value: Value, path: &str) -> Result<Self, MessageError> {
        let mut fields = object(value, path)?;
        let mut at = Fields::new(&mut fields, path);
        Ok(TestedData {
            test_send_id: at.required_id("test_send_id")?,
            example: at.take("example"),
        })
    }
}

/// Reads named fields of a JSON object in place, naming the full path in every error.
type FieldsRef<'a> = fields::Fields<'a, MessageError>;

fields::field_error!(MessageError, "an object");

/// The checks of what a message's feed item keeps.
impl<'a> FieldsRef<'a> {
    /// A string kept as an identifier: no control characters.
    fn required_id(&self, name: &str) -> Result<&'a str, MessageError> {
        let text = self.required_str(name)?;
        check_identifier(text, || self.path(name))?;
        Ok(text)
    }

    fn required_u64(&self, name: &str) -> Result<u64, MessageError> {
        self.required(name)?
            .as_u64()
            .ok_or_else(|| self.wrong(name, "a whole number of at least 0"))
    }
}

/// Takes named fields out of a JSON object, naming the full path in every error.
struct Fields<'a> {
    fields: &'a mut Map<String, Value>,
    prefix: &'a str,
}

/// The fields of the object at `path`, or what the value is not.
fn object(value: Value, path: &str) -> Result<Map<String, Value>, MessageError> {
    match value {
        Value::Object(fields) => Ok(fields),
        _ => Err(MessageError::WrongShape {
            field: path.to_owned(),
            expected: "an object",
        }),
    }
}

impl<'a> Fields<'a> {
    fn new(fields: &'a mut Map<String, Value>, prefix: &'a str) -> Self {
        Self { fields, prefix }
    }

    fn path(&self, name: &str) -> String {
        join(self.prefix, name)
    }

    fn wrong(&self, name: &str, expected: &'static str) -> MessageError {
        MessageError::WrongShape {
            field: self.path(name),
            expected,
        }
    }

    fn take(&mut self, name: &str) -> Option<Value> {
        self.fields.remove(name)
    }

    fn optional_str(&mut self, name: &str) -> Result<Option<String>, MessageError> {
        match self.take(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(self.wrong(name, "a string")),
        }
    }

    fn required_str(&mut self, name: &str) -> Result<String, MessageError> {
        self.optional_str(name)?
            .ok_or_else(|| MessageError::Missing(self.path(name)))
    }

    /// A string kept as an identifier: no control characters.
    fn optional_id(&mut self, name: &str) -> Result<Option<String>, MessageError> {
        let text = self.optional_str(name)?;
        if let Some(text) = &text {
            check_identifier(text, || self.path(name))?;
        }
        Ok(text)
    }

    fn required_id(&mut self, name: &str) -> Result<String, MessageError> {
        self.optional_id(name)?
            .ok_or_else(|| MessageError::Missing(self.path(name)))
    }

    /// A generation: a whole number that fits the bigint it is stored in.
    fn optional_generation(&mut self, name: &str) -> Result<Option<u64>, MessageError> {
        match self.optional_u64(name)? {
            Some(generation) if generation > MAX_GENERATION => {
                Err(self.wrong(name, "at most 9223372036854775807"))
            }
            generation => Ok(generation),
        }
    }

    fn optional_u64(&mut self, name: &str) -> Result<Option<u64>, MessageError> {
        match self.take(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => n
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.wrong(name, "a whole number of at least 0")),
            Some(_) => Err(self.wrong(name, "a whole number of at least 0")),
        }
    }

    fn required_u64(&mut self, name: &str) -> Result<u64, MessageError> {
        self.optional_u64(name)?
            .ok_or_else(|| MessageError::Missing(self.path(name)))
    }

    fn optional_bool(&mut self, name: &str) -> Result<Option<bool>, MessageError> {
        match self.take(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(_) => Err(self.wrong(name, "true or false")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const ENDPOINT: &str = "8d2f0c39-2b63-4c55-9a8a-3f5b1d7c1e20";

    fn parse(value: Value) -> Result<Message, MessageError> {
        Message::parse(value.to_string().as_bytes())
    }

    #[test]
    fn unknown_types_tracks_and_fields_are_ignored_not_errors() {
        let message = parse(json!({
            "v": 1, "webhook_endpoint_id": ENDPOINT, "track": "stories", "shiny": [1],
            "events": [
                {"id": "evt_1", "type": "story.created", "data": {"anything": true}},
                {"id": "evt_2", "type": "announcement.promoted", "subject": "x", "data": {}},
                {"id": "evt_3", "type": "nodot"}
            ]
        }))
        .unwrap();
        assert_eq!(message.track, Some(Track::Ignored("stories".into())));
        assert_eq!(message.ignored.get("shiny"), Some(&json!([1])));
        assert_eq!(message.events.len(), 3);
        assert!(message
            .events
            .iter()
            .all(|e| matches!(e.body, EventBody::Ignored { .. })));
    }

    #[test]
    fn refuses_what_version_1_names_in_the_wrong_shape() {
        let cases = [
            (json!([1]), "the body must be a JSON object"),
            (
                json!({"webhook_endpoint_id": ENDPOINT, "events": []}),
                "v is missing",
            ),
            (
                json!({"v": 2, "webhook_endpoint_id": ENDPOINT, "events": []}),
                "message version 2 is not one this relay reads (it reads 1)",
            ),
            (
                json!({"v": 1, "webhook_endpoint_id": "abc", "events": []}),
                "webhook_endpoint_id must be a UUID",
            ),
            (
                json!({"v": 1, "webhook_endpoint_id": ENDPOINT}),
                "events is missing",
            ),
            (
                json!({"v": 1, "webhook_endpoint_id": ENDPOINT, "generation": "3", "events": []}),
                "generation must be a whole number of at least 0",
            ),
            (
                json!({"v": 1, "webhook_endpoint_id": ENDPOINT, "events": [
                    {"id": "e", "type": "announcement.updated", "subject": "announcement:1",
                     "sequence": "0000000001.0000000000000000001", "data": {"type": "item"}}]}),
                "events[0].data.feed_item_id is missing",
            ),
            (
                json!({"v": 1, "webhook_endpoint_id": ENDPOINT, "events": [
                    {"id": "e", "type": "announcement.hidden", "subject": "announcement:1",
                     "data": {"type": "hidden", "feed_item_id": "announcement:1", "seq": 1}}]}),
                "events[0].sequence is missing",
            ),
        ];
        for (body, expected) in cases {
            assert_eq!(parse(body).unwrap_err().to_string(), expected);
        }
        assert!(matches!(
            Message::parse(b"{not json"),
            Err(MessageError::NotJson(_))
        ));
    }

    /// A v1 feed message whose every identifier is valid, for tests to spoil one at a time.
    fn good_feed_message() -> Value {
        json!({
            "v": 1, "webhook_endpoint_id": ENDPOINT, "track": "feed", "generation": 2,
            "access_version": "av_1", "since": "1.8", "through": "1.10",
            "events": [
                {"id": "evt_u", "type": "announcement.updated", "subject": "announcement:5",
                 "sequence": "0000000001.0000000000000000009",
                 "data": {"type": "item", "feed_item_id": "announcement:5",
                          "item_kind": "announcement", "seq": 9, "title": "Q3 \u{0007} ok",
                          "parts": [{"part_id": "p_1", "part_version": 1}]}},
                {"id": "evt_r", "type": "announcement.hidden", "subject": "announcement:6",
                 "sequence": "0000000001.0000000000000000010",
                 "data": {"type": "refetch", "feed_item_id": "announcement:6", "seq": 10}},
                {"id": "evt_x", "type": "webhook_endpoint.reset",
                 "data": {"access_version": "av_2", "generation": 3, "reason": "behind",
                          "resume_from": "1.10", "track": "feed"}}
            ]
        })
    }

    #[test]
    fn control_characters_in_identifiers_are_refused_and_named() {
        assert!(parse(good_feed_message()).is_ok());
        type Slot = fn(&mut Value) -> &mut Value;
        let spoil: [(&str, Slot); 16] = [
            ("track", |m| &mut m["track"]),
            ("access_version", |m| &mut m["access_version"]),
            ("since", |m| &mut m["since"]),
            ("through", |m| &mut m["through"]),
            ("events[0].id", |m| &mut m["events"][0]["id"]),
            ("events[0].type", |m| &mut m["events"][0]["type"]),
            ("events[0].subject", |m| &mut m["events"][0]["subject"]),
            ("events[0].sequence", |m| &mut m["events"][0]["sequence"]),
            ("events[0].data.feed_item_id", |m| {
                &mut m["events"][0]["data"]["feed_item_id"]
            }),
            ("events[0].data.parts[0].part_id", |m| {
                &mut m["events"][0]["data"]["parts"][0]["part_id"]
            }),
            ("events[1].data.feed_item_id", |m| {
                &mut m["events"][1]["data"]["feed_item_id"]
            }),
            ("events[2].id", |m| &mut m["events"][2]["id"]),
            ("events[2].data.access_version", |m| {
                &mut m["events"][2]["data"]["access_version"]
            }),
            ("events[2].data.reason", |m| {
                &mut m["events"][2]["data"]["reason"]
            }),
            ("events[2].data.resume_from", |m| {
                &mut m["events"][2]["data"]["resume_from"]
            }),
            ("events[2].data.track", |m| {
                &mut m["events"][2]["data"]["track"]
            }),
        ];
        for (field, at) in spoil {
            for bad in ['\u{0}', '\n', '\u{1b}', '\u{7f}', '\u{9b}'] {
                let mut message = good_feed_message();
                let slot = at(&mut message);
                let spoiled = format!("{}{bad}x", slot.as_str().unwrap());
                *slot = Value::String(spoiled);
                assert_eq!(
                    parse(message).unwrap_err(),
                    MessageError::ControlCharacter {
                        field: field.to_owned(),
                        code: u32::from(bad),
                    },
                    "{field} with {bad:?}"
                );
            }
        }
        // The wire's own example of a NUL in a track, as a JSON escape in the raw bytes.
        let body = br#"{"v":1,"webhook_endpoint_id":"8d2f0c39-2b63-4c55-9a8a-3f5b1d7c1e20","track":"feed\u0000x","events":[]}"#;
        assert_eq!(
            Message::parse(body).unwrap_err().to_string(),
            "track holds a control character (U+0000)"
        );
        // Text that is not an identifier (an item's title) keeps whatever it holds, and
        // identifiers may be any other Unicode.
        let mut message = good_feed_message();
        message["events"][0]["subject"] = json!("announcement:é€😀 tab-free");
        assert!(parse(message).is_ok());
    }

    #[test]
    fn a_message_of_more_events_than_the_wire_allows_is_refused() {
        let event = good_feed_message()["events"][0].clone();
        let mut message = good_feed_message();
        message["events"] = Value::Array(vec![event.clone(); MAX_EVENTS]);
        assert_eq!(parse(message).unwrap().events.len(), MAX_EVENTS);
        let mut message = good_feed_message();
        message["events"] = Value::Array(vec![event; MAX_EVENTS + 1]);
        assert_eq!(
            parse(message).unwrap_err(),
            MessageError::TooManyEvents {
                count: MAX_EVENTS + 1,
                max: MAX_EVENTS
            }
        );
    }

    #[test]
    fn generations_past_a_bigint_are_refused() {
        let mut message = good_feed_message();
        message["generation"] = json!(9_223_372_036_854_775_807u64);
        assert_eq!(parse(message).unwrap().generation, Some(i64::MAX as u64));
        let mut message = good_feed_message();
        message["generation"] = json!(9_223_372_036_854_775_808u64);
        assert_eq!(
            parse(message).unwrap_err().to_string(),
            "generation must be at most 9223372036854775807"
        );
        let mut message = good_feed_message();
        message["events"][2]["data"]["generation"] = json!(u64::MAX);
        assert_eq!(
            parse(message).unwrap_err().to_string(),
            "events[2].data.generation must be at most 9223372036854775807"
        );
    }

    #[test]
    fn withdrawn_and_refetch_data_are_typed() {
        let message = parse(json!({
            "v": 1, "webhook_endpoint_id": ENDPOINT, "track": "feed", "generation": 2,
            "events": [
                {"id": "evt_w", "type": "pre_earnings_analysis.withdrawn",
                 "subject": "pre_earnings_analysis:5", "sequence": "0000000001.0000000000000000009",
                 "data": {"type": "withdrawn", "feed_item_id": "pre_earnings_analysis:5", "seq": 9}},
                {"id": "evt_r", "type": "pre_earnings_analysis.hidden",
                 "subject": "pre_earnings_analysis:6", "sequence": "0000000001.0000000000000000010",
                 "data": {"type": "refetch", "feed_item_id": "pre_earnings_analysis:6", "seq": 10}}
            ]
        }))
        .unwrap();
        match &message.events[0].body {
            EventBody::Feed {
                kind, action, data, ..
            } => {
                assert_eq!(*kind, ItemKind::PreEarningsAnalysis);
                assert_eq!(*action, FeedAction::Withdrawn);
                assert_eq!(
                    *data,
                    FeedData::Removal {
                        feed_item_id: "pre_earnings_analysis:5".into(),
                        seq: 9
                    }
                );
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            &message.events[1].body,
            EventBody::Feed {
                data: FeedData::Refetch { seq: 10, .. },
                ..
            }
        ));
    }
}
