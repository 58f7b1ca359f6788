//! What the upstream's REST API answers (`upstream-api.md`), read as strictly as its webhooks.
//!
//! A tenant chooses its upstream's URL, so every answer may be hostile. Before anything of it
//! reaches the copy, it is checked here with the checks webhook bodies go through: a feed item
//! by [`FeedItem::from_value`], a story or a stories event by [`Story::from_value`] and
//! [`StoryEvent::from_value`], and the strings the relay keeps, decides by or sends back
//! (subjects, sequences, access versions, cursors, the endpoint's language and filter) by the
//! identifier rule of webhook messages: no control character (Postgres' `text` cannot hold NUL,
//! `jsonb` refuses U+0000, and one such value fails every statement it shares). Each also has a
//! length bound here: an answer's strings go into indexed columns and URLs, and nothing the
//! contract describes is longer.
//!
//! Parsing is bounded too ([`parse`]): JSON can take many times its own size once parsed (an
//! array of small objects, 8 bytes each as text, takes about 670 bytes each as a
//! `serde_json::Value`; the benchmark's 1 KB feed items take 6.5 KB each), so an answer is
//! parsed against a budget of the memory its value may take, estimated as it is built, and
//! refused past it.
//!
//! Errors name the field, as a message's do. [`AnswerError::NotJson`] is an answer that is no
//! JSON at all, [`AnswerError::TooLarge`] one over its budget; every other error is an answer
//! of the wrong shape or with values the relay refuses to keep.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::fields::{self, FieldError};
use crate::message::{check_identifier, FeedItem, MessageError};
use crate::sequence::Sequence;
use crate::story::{Story, StoryEvent, StoryEventError, MAX_ID_BYTES};

/// Entries of one page at most: the contract's largest `limit`.
pub const MAX_PAGE_ENTRIES: usize = 500;
/// The longest cursor taken, in bytes: it is sent back in a URL, and a stories endpoint's
/// catch-up cursor is stored.
pub const MAX_CURSOR_BYTES: usize = 4096;
/// The longest language tag taken, in bytes (BCP 47 tags are far shorter).
pub const MAX_LANG_BYTES: usize = 64;
/// Entries of one filter list at most (the endpoint read's companies, markets, ...): each is
/// sent back in `/v1/feed`'s query.
pub const MAX_FILTER_ENTRIES: usize = 10_000;
/// The largest generation kept: Postgres' bigint.
const MAX_GENERATION: u64 = i64::MAX as u64;

/// Why an answer is refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum AnswerError {
    #[error("the answer is not JSON: {0}")]
    NotJson(String),
    /// The value would take more memory than `budget` bytes (see [`parse`]).
    #[error("the answer's JSON would take more than {budget} bytes once parsed")]
    TooLarge { budget: u64 },
    /// The shape or values of a field (a feed item's checks included).
    #[error(transparent)]
    Message(#[from] MessageError),
    /// A story or a stories event's checks.
    #[error(transparent)]
    Story(#[from] StoryEventError),
    #[error("{field} must be at most {max} bytes long")]
    TooLong { field: String, max: usize },
    #[error("{field} holds {count} entries; at most {max} are taken")]
    TooMany {
        field: String,
        count: usize,
        max: usize,
    },
}

impl AnswerError {
    /// The failure's name for users: `body` (not JSON), `too_large`, or `invalid` (JSON the
    /// relay refuses: its shape, or a value it will not keep).
    pub fn kind(&self) -> &'static str {
        match self {
            AnswerError::NotJson(_) => "body",
            AnswerError::TooLarge { .. } => "too_large",
            _ => "invalid",
        }
    }
}

// ---- Parsing against a budget ----

/// A parsed answer and the memory its value takes, as [`parse`] estimates it.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub value: Value,
    /// Estimated bytes of memory the value holds: at least what a `serde_json::Value` of it
    /// allocates, with mimalloc (the relay's) or glibc's allocator, for every shape measured
    /// (the benchmark's feed items: estimated 8.1 KB each, 6.5 KB with mimalloc, 7.5 KB with
    /// glibc; arrays of numbers, of empty arrays or objects, of one-entry objects, one object of
    /// millions of entries: each estimated above what it took).
    pub weight: u64,
}

/// What a value costs beyond its own 32-byte slot, estimated from above for
/// `serde_json::Value` without `preserve_order`: strings and keys on the heap, arrays as a
/// `Vec` grown by doubling, objects as a `BTreeMap` (nodes of 11 entries, 632 bytes a leaf and
/// 728 an internal node, at least half full after a split).
mod cost {
    /// A string or a key: its bytes, and an allocator's header and rounding (glibc's smallest
    /// chunk is 32 bytes).
    pub fn string(len: usize) -> u64 {
        len as u64 + 32
    }
    /// An array's element: its slot in a `Vec` of twice the length, while the half-size one it
    /// was grown from is still held.
    pub const ELEMENT: u64 = 96;
    /// An object's first entry: its leaf node.
    pub const FIRST_ENTRY: u64 = 640;
    /// Past [`FULL_LEAF`] entries the root splits: an internal node, and from then on a share
    /// of half-full leaves and their parents per entry.
    pub const FULL_LEAF: usize = 11;
    pub const SPLIT: u64 = 736;
    pub const ENTRY_PAST_A_LEAF: u64 = 160;
}

/// Parses `bytes` as JSON, refusing it as [`AnswerError::TooLarge`] as soon as its value would
/// take more than `budget` bytes of memory. Nesting is bounded by serde_json (128 levels).
pub fn parse(bytes: &[u8], budget: u64) -> Result<Parsed, AnswerError> {
    let meter = Meter {
        left: Cell::new(budget),
        over: Cell::new(false),
    };
    let mut reader = serde_json::Deserializer::from_slice(bytes);
    let read = Weighed(&meter)
        .deserialize(&mut reader)
        .and_then(|value| reader.end().map(|()| value));
    match read {
        Ok(value) => Ok(Parsed {
            value,
            weight: budget - meter.left.get(),
        }),
        Err(_) if meter.over.get() => Err(AnswerError::TooLarge { budget }),
        Err(error) => Err(AnswerError::NotJson(error.to_string())),
    }
}

struct Meter {
    left: Cell<u64>,
    over: Cell<bool>,
}

impl Meter {
    fn charge<E: de::Error>(&self, cost: u64) -> Result<(), E> {
        match self.left.get().checked_sub(cost) {
            Some(left) => {
                self.left.set(left);
                Ok(())
            }
            None => {
                self.over.set(true);
                Err(E::custom("over the answer's memory budget"))
            }
        }
    }
}

/// Builds a `Value` as serde_json's own `Deserialize` does, charging each part to the meter.
struct Weighed<'m>(&'m Meter);

impl<'de> DeserializeSeed<'de> for Weighed<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Weighed<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        self.0.charge(cost::string(v.len()))?;
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        self.0.charge(cost::string(v.len()))?;
        Ok(Value::String(v))
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        Weighed(self.0).deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Weighed(self.0))? {
            self.0.charge(cost::ELEMENT)?;
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Value, A::Error> {
        let mut map = Map::new();
        let mut entries = 0usize;
        while let Some(key) = access.next_key::<String>()? {
            entries += 1;
            let node = match entries {
                1 => cost::FIRST_ENTRY,
                n if n == cost::FULL_LEAF + 1 => cost::SPLIT + cost::ENTRY_PAST_A_LEAF,
                n if n > cost::FULL_LEAF => cost::ENTRY_PAST_A_LEAF,
                _ => 0,
            };
            self.0.charge(node + cost::string(key.len()))?;
            let value = access.next_value_seed(Weighed(self.0))?;
            map.insert(key, value);
        }
        Ok(Value::Object(map))
    }
}

// ---- Fields ----

type Fields<'a> = fields::Fields<'a, AnswerError>;

/// An answer's fields are named as a message's are.
impl FieldError for AnswerError {
    fn missing(field: String) -> Self {
        MessageError::missing(field).into()
    }

    fn wrong(field: String, expected: &'static str) -> Self {
        MessageError::wrong(field, expected).into()
    }

    fn not_an_object(what: String) -> Self {
        MessageError::not_an_object(what).into()
    }
}

/// The checks of what the relay keeps of an answer, or sends back.
impl<'a> Fields<'a> {
    /// A string the relay keeps or sends back: no control character, at most `max` bytes.
    fn optional_text(&self, name: &str, max: usize) -> Result<Option<String>, AnswerError> {
        let Some(text) = self.optional_str(name)? else {
            return Ok(None);
        };
        check_text(text, max, || self.path(name))?;
        Ok(Some(text.to_owned()))
    }

    fn required_text(&self, name: &str, max: usize) -> Result<String, AnswerError> {
        self.optional_text(name, max)?
            .ok_or_else(|| self.missing(name))
    }

    /// A generation: a whole number that fits the bigint it is stored in.
    fn optional_generation(&self, name: &str) -> Result<Option<u64>, AnswerError> {
        match self.get(name).map(|value| value.as_u64()) {
            None => Ok(None),
            Some(Some(g)) if g <= MAX_GENERATION => Ok(Some(g)),
            Some(_) => Err(self.wrong(name, "a whole number from 0 to 9223372036854775807")),
        }
    }

    /// An array of at most `max` entries (`None` when absent or null).
    fn optional_array(&self, name: &str, max: usize) -> Result<Option<&'a [Value]>, AnswerError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Array(items)) if items.len() > max => Err(AnswerError::TooMany {
                field: self.path(name),
                count: items.len(),
                max,
            }),
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(_) => Err(self.wrong(name, "an array")),
        }
    }

    fn required_array(&self, name: &str, max: usize) -> Result<&'a [Value], AnswerError> {
        self.optional_array(name, max)?
            .ok_or_else(|| self.missing(name))
    }

    /// An array of at most `max_entries` entries, each read by `read` (given the entry and its
    /// path, made only when an error needs it).
    fn optional_list<T>(
        &self,
        name: &str,
        max_entries: usize,
        read: impl Fn(&'a Value, &dyn Fn() -> String) -> Result<T, AnswerError>,
    ) -> Result<Option<Vec<T>>, AnswerError> {
        let Some(items) = self.optional_array(name, max_entries)? else {
            return Ok(None);
        };
        let path = self.path(name);
        items
            .iter()
            .enumerate()
            .map(|(i, item)| read(item, &|| format!("{path}[{i}]")))
            .collect::<Result<_, _>>()
            .map(Some)
    }

    /// A list of strings kept or sent back, each checked as [`check_text`] checks one.
    fn optional_texts(
        &self,
        name: &str,
        max_entries: usize,
        max_bytes: usize,
    ) -> Result<Option<Vec<String>>, AnswerError> {
        self.optional_list(name, max_entries, |item, path| match item {
            Value::String(text) => {
                check_text(text, max_bytes, path)?;
                Ok(text.clone())
            }
            _ => Err(AnswerError::wrong(path(), "a string")),
        })
    }

    fn optional_ids(
        &self,
        name: &str,
        max_entries: usize,
    ) -> Result<Option<Vec<i64>>, AnswerError> {
        self.optional_list(name, max_entries, |item, path| {
            item.as_i64()
                .ok_or_else(|| AnswerError::wrong(path(), "a whole number"))
        })
    }
}

/// Refuses `text` when it holds a control character (the identifier rule of webhook messages)
/// or is longer than `max` bytes, naming `field`.
pub fn check_text(text: &str, max: usize, field: impl Fn() -> String) -> Result<(), AnswerError> {
    check_identifier(text, &field)?;
    if text.len() > max {
        return Err(AnswerError::TooLong {
            field: field(),
            max,
        });
    }
    Ok(())
}

// ---- The feed's answers ----

/// One entry of a `/v1/feed` page, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct FeedEntry {
    pub subject: String,
    pub sequence: Sequence,
    pub item: FeedItem,
}

/// A `GET /v1/feed` page, checked: at most [`MAX_PAGE_ENTRIES`] entries, each a subject and a
/// sequence kept as identifiers are and an item read as a message's item is.
#[derive(Debug, Clone, PartialEq)]
pub struct FeedPage {
    pub access_version: String,
    pub entries: Vec<FeedEntry>,
    /// The next page's cursor, when `has_more` says there is one.
    pub next_cursor: Option<String>,
}

impl FeedPage {
    pub fn from_value(value: Value) -> Result<Self, AnswerError> {
        let at = Fields::of(&value, "the page", "")?;
        let access_version = at.required_text("access_version", MAX_ID_BYTES)?;
        let next_cursor = at.optional_text("next_cursor", MAX_CURSOR_BYTES)?;
        let has_more = at.optional_bool("has_more")?.unwrap_or(false);
        at.optional_array("data", MAX_PAGE_ENTRIES)?;
        let Value::Object(mut fields) = value else {
            unreachable!("checked to be an object above")
        };
        let data = match fields.remove("data") {
            Some(Value::Array(data)) => data,
            _ => return Err(MessageError::Missing("data".to_owned()).into()),
        };
        let entries = data
            .into_iter()
            .enumerate()
            .map(|(i, entry)| feed_entry(entry, &format!("data[{i}]")))
            .collect::<Result<_, _>>()?;
        Ok(FeedPage {
            access_version,
            entries,
            next_cursor: next_cursor.filter(|_| has_more),
        })
    }
}

fn feed_entry(entry: Value, path: &str) -> Result<FeedEntry, AnswerError> {
    let at = Fields::of(&entry, path, path)?;
    let subject = at.required_text("subject", MAX_ID_BYTES)?;
    let sequence = Sequence::new(at.required_text("sequence", MAX_ID_BYTES)?);
    at.required("item")?;
    let Value::Object(mut fields) = entry else {
        unreachable!("checked to be an object above")
    };
    let item = fields.remove("item").unwrap_or_default();
    let item = FeedItem::from_value(item, &format!("{path}.item"))?;
    Ok(FeedEntry {
        subject,
        sequence,
        item,
    })
}

/// A `GET /v1/feed/items/{id}` answer of `200`, checked: its access version and sequence as
/// identifiers, its item as a message's item.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemAnswer {
    pub access_version: String,
    pub sequence: Sequence,
    pub item: FeedItem,
}

impl ItemAnswer {
    pub fn from_value(value: Value) -> Result<Self, AnswerError> {
        let at = Fields::of(&value, "the answer", "")?;
        let access_version = at.required_text("access_version", MAX_ID_BYTES)?;
        let sequence = Sequence::new(at.required_text("sequence", MAX_ID_BYTES)?);
        at.required("item")?;
        let Value::Object(mut fields) = value else {
            unreachable!("checked to be an object above")
        };
        let item = FeedItem::from_value(fields.remove("item").unwrap_or_default(), "item")?;
        Ok(ItemAnswer {
            access_version,
            sequence,
            item,
        })
    }
}

/// The `access_version` an answer carries (a `404`'s says the item is gone under it; one
/// without it is a load balancer's), checked as an identifier. `None` when the answer is no
/// object or has none.
pub fn access_version(value: &Value) -> Result<Option<String>, AnswerError> {
    match value {
        Value::Object(_) => {
            Fields::of(value, "the answer", "")?.optional_text("access_version", MAX_ID_BYTES)
        }
        _ => Ok(None),
    }
}

/// The endpoint's filter as `GET /v1/webhook-endpoints/{id}` answers it (`None`: no
/// restriction).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FilterAnswer {
    pub companies: Option<Vec<i64>>,
    pub markets: Option<Vec<String>>,
    pub part_kinds: Option<Vec<String>>,
    pub teasers: Option<bool>,
    pub event_types: Option<Vec<String>>,
}

/// A `GET /v1/webhook-endpoints/{id}` answer, checked: the language and every filter entry
/// without control characters and bounded, each list at most [`MAX_FILTER_ENTRIES`] long, the
/// feed track's generation within a bigint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointAnswer {
    pub lang: String,
    pub filter: FilterAnswer,
    pub feed_generation: Option<u64>,
}

impl EndpointAnswer {
    pub fn from_value(value: &Value) -> Result<Self, AnswerError> {
        let at = Fields::of(value, "the answer", "")?;
        let lang = at.required_text("lang", MAX_LANG_BYTES)?;
        let filter = match at.get("filter") {
            None => FilterAnswer::default(),
            Some(filter) => {
                let f = Fields::of(filter, "filter", "filter")?;
                FilterAnswer {
                    companies: f.optional_ids("companies", MAX_FILTER_ENTRIES)?,
                    markets: f.optional_texts("markets", MAX_FILTER_ENTRIES, MAX_ID_BYTES)?,
                    part_kinds: f.optional_texts("part_kinds", MAX_FILTER_ENTRIES, MAX_ID_BYTES)?,
                    teasers: f.optional_bool("teasers")?,
                    event_types: f.optional_texts(
                        "event_types",
                        MAX_FILTER_ENTRIES,
                        MAX_ID_BYTES,
                    )?,
                }
            }
        };
        let feed_generation = match at.get("tracks") {
            None => None,
            Some(tracks) => match Fields::of(tracks, "tracks", "tracks")?.get("feed") {
                None => None,
                Some(feed) => Fields::of(feed, "tracks.feed", "tracks.feed")?
                    .optional_generation("generation")?,
            },
        };
        Ok(EndpointAnswer {
            lang,
            filter,
            feed_generation,
        })
    }
}

// ---- The stories API's answers ----

/// A `GET /v1/events` page: each event read as a webhook's (an event that is not one is kept
/// as its error, for the handler to set aside, as a webhook's would be), and a cursor, which
/// the catch-up stores, checked as an identifier.
#[derive(Debug, Clone, PartialEq)]
pub struct EventsAnswer {
    pub events: Vec<Result<StoryEvent, String>>,
    pub next_cursor: Option<String>,
    pub has_more: bool,
}

impl EventsAnswer {
    pub fn from_value(value: &Value) -> Result<Self, AnswerError> {
        let at = Fields::of(value, "the page", "")?;
        let data = at.required_array("data", MAX_PAGE_ENTRIES)?;
        Ok(EventsAnswer {
            events: data
                .iter()
                .map(|event| StoryEvent::from_value(event).map_err(|e| e.to_string()))
                .collect(),
            next_cursor: at.optional_text("next_cursor", MAX_CURSOR_BYTES)?,
            has_more: at.optional_bool("has_more")?.unwrap_or(false),
        })
    }
}

/// A `GET /v1/stories` page: every story read as a webhook's (the first that is not one
/// refuses the page), and the next page's cursor when `has_more` says there is one.
#[derive(Debug, Clone, PartialEq)]
pub struct StoriesAnswer {
    pub stories: Vec<Story>,
    pub next_cursor: Option<String>,
}

impl StoriesAnswer {
    pub fn from_value(value: &Value) -> Result<Self, AnswerError> {
        let at = Fields::of(value, "the page", "")?;
        let data = at.required_array("data", MAX_PAGE_ENTRIES)?;
        let stories = data
            .iter()
            .map(Story::from_value)
            .collect::<Result<_, _>>()?;
        let next_cursor = at.optional_text("next_cursor", MAX_CURSOR_BYTES)?;
        let has_more = at.optional_bool("has_more")?.unwrap_or(false);
        Ok(StoriesAnswer {
            stories,
            next_cursor: next_cursor.filter(|_| has_more),
        })
    }
}

/// The `error` an answer carries (`{"error": "not_found"}`), checked as an identifier; `None`
/// when the answer is no object or has none.
pub fn error_code(value: &Value) -> Result<Option<String>, AnswerError> {
    match value {
        Value::Object(_) => {
            Fields::of(value, "the answer", "")?.optional_text("error", MAX_ID_BYTES)
        }
        _ => Ok(None),
    }
}

// ---- A track's rewind ----

/// A rewind's `202` answer: the generation the track resends under, within a bigint.
pub fn rewind_generation(value: &Value) -> Result<u64, AnswerError> {
    Fields::of(value, "the answer", "")?
        .optional_generation("generation")?
        .ok_or_else(|| MessageError::Missing("generation".to_owned()).into())
}

/// A rewind's `409` answer: the refusal's code, checked as an identifier.
pub fn rewind_refusal(value: &Value) -> Result<String, AnswerError> {
    Fields::of(value, "the answer", "")?.required_text("error", MAX_ID_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn item(n: u64) -> Value {
        json!({"type": "item", "feed_item_id": format!("announcement:{n}"),
               "item_kind": "announcement", "seq": n, "headline": "Alfa wins an order",
               "parts": [{"part_id": format!("story:{n}"), "part_version": 1}]})
    }

    fn page(entries: Vec<Value>) -> Value {
        json!({"access_version": "av1", "data": entries, "next_cursor": "c2", "has_more": true})
    }

    fn entry(subject: &str, sequence: &str, item: Value) -> Value {
        json!({"subject": subject, "sequence": sequence, "item": item})
    }

    const SEQ: &str = "0000000001.0000000000000001045";

    fn page_error(entries: Vec<Value>) -> String {
        FeedPage::from_value(page(entries)).unwrap_err().to_string()
    }

    #[test]
    fn a_feed_page_is_read_with_its_items_as_a_message_reads_them() {
        let read = FeedPage::from_value(page(vec![
            entry("announcement:1", SEQ, item(1)),
            entry("announcement:2", SEQ, item(2)),
        ]))
        .unwrap();
        assert_eq!(read.access_version, "av1");
        assert_eq!(read.next_cursor.as_deref(), Some("c2"));
        assert_eq!(read.entries.len(), 2);
        assert_eq!(read.entries[1].subject, "announcement:2");
        assert_eq!(read.entries[1].sequence.as_str(), SEQ);
        assert_eq!(read.entries[1].item.feed_item_id, "announcement:2");
        assert_eq!(read.entries[1].item.raw, item(2));
        // The last page: no cursor whatever the answer says.
        let last = json!({"access_version": "av1", "data": [], "next_cursor": "x",
                          "has_more": false});
        assert_eq!(FeedPage::from_value(last).unwrap().next_cursor, None);
    }

    #[test]
    fn control_characters_in_a_pages_subject_or_sequence_are_refused_and_named() {
        assert_eq!(
            page_error(vec![
                entry("announcement:1", SEQ, item(1)),
                entry("announcement:\u{0}2", SEQ, item(2)),
            ]),
            "data[1].subject holds a control character (U+0000)"
        );
        assert_eq!(
            page_error(vec![entry("announcement:1", "0000000001.\n1", item(1))]),
            "data[0].sequence holds a control character (U+000A)"
        );
        let error = FeedPage::from_value(page(vec![entry("a\u{1b}b", SEQ, item(1))])).unwrap_err();
        assert_eq!(error.kind(), "invalid");
    }

    #[test]
    fn a_pages_item_is_checked_as_a_webhook_item_is() {
        let mut bad = item(1);
        bad["parts"][0]["part_id"] = json!("story:\u{0}1");
        assert_eq!(
            page_error(vec![entry("announcement:1", SEQ, bad)]),
            "data[0].item.parts[0].part_id holds a control character (U+0000)"
        );
        let mut no_kind = item(1);
        no_kind.as_object_mut().unwrap().remove("item_kind");
        assert_eq!(
            page_error(vec![entry("announcement:1", SEQ, no_kind)]),
            "data[0].item.item_kind is missing"
        );
        assert_eq!(
            page_error(vec![json!({"subject": "announcement:1", "sequence": SEQ})]),
            "data[0].item is missing"
        );
    }

    #[test]
    fn lengths_and_counts_past_the_bounds_are_refused() {
        let long = "a".repeat(MAX_ID_BYTES + 1);
        assert_eq!(
            page_error(vec![entry(&long, SEQ, item(1))]),
            format!("data[0].subject must be at most {MAX_ID_BYTES} bytes long")
        );
        let at_bound = "a".repeat(MAX_ID_BYTES);
        FeedPage::from_value(page(vec![entry(&at_bound, SEQ, item(1))])).unwrap();
        let many = (0..=MAX_PAGE_ENTRIES as u64)
            .map(|n| entry("announcement:1", SEQ, item(n)))
            .collect();
        assert_eq!(
            page_error(many),
            format!("data holds 501 entries; at most {MAX_PAGE_ENTRIES} are taken")
        );
        let cursor = json!({"access_version": "av1", "data": [], "has_more": true,
                            "next_cursor": "c".repeat(MAX_CURSOR_BYTES + 1)});
        assert_eq!(
            FeedPage::from_value(cursor).unwrap_err().to_string(),
            format!("next_cursor must be at most {MAX_CURSOR_BYTES} bytes long")
        );
        let access = json!({"access_version": "a\u{7f}", "data": []});
        assert_eq!(
            FeedPage::from_value(access).unwrap_err().to_string(),
            "access_version holds a control character (U+007F)"
        );
    }

    #[test]
    fn an_item_read_is_checked_like_a_page_entry() {
        let found = json!({"access_version": "av1", "sequence": SEQ, "item": item(7)});
        let read = ItemAnswer::from_value(found).unwrap();
        assert_eq!(
            (read.access_version.as_str(), read.sequence.as_str()),
            ("av1", SEQ)
        );
        assert_eq!(read.item.feed_item_id, "announcement:7");
        let bad_sequence = json!({"access_version": "av1", "sequence": "1\u{0}", "item": item(7)});
        assert_eq!(
            ItemAnswer::from_value(bad_sequence)
                .unwrap_err()
                .to_string(),
            "sequence holds a control character (U+0000)"
        );
        let bad_access = json!({"access_version": "av\u{85}", "sequence": SEQ, "item": item(7)});
        assert_eq!(
            ItemAnswer::from_value(bad_access).unwrap_err().to_string(),
            "access_version holds a control character (U+0085)"
        );
        assert_eq!(
            access_version(&json!({"access_version": "av1", "error": "not_found"})).unwrap(),
            Some("av1".to_owned())
        );
        assert_eq!(
            access_version(&json!("upstream unavailable")).unwrap(),
            None
        );
        assert!(access_version(&json!({"access_version": "a\u{0}"})).is_err());
    }

    #[test]
    fn an_endpoint_read_keeps_only_bounded_text_without_control_characters() {
        let good = json!({"id": "x", "lang": "en", "status": "active",
            "filter": {"companies": [28, 31], "markets": ["XSTO"], "part_kinds": ["flash"],
                       "teasers": true, "event_types": ["announcement.updated"]},
            "tracks": {"feed": {"generation": 4}}});
        let read = EndpointAnswer::from_value(&good).unwrap();
        assert_eq!(read.lang, "en");
        assert_eq!(read.filter.companies, Some(vec![28, 31]));
        assert_eq!(read.filter.markets, Some(vec!["XSTO".to_owned()]));
        assert_eq!(read.filter.teasers, Some(true));
        assert_eq!(read.feed_generation, Some(4));
        let open = EndpointAnswer::from_value(&json!({"lang": "sv", "filter": null})).unwrap();
        assert_eq!(open.filter, FilterAnswer::default());
        assert_eq!(open.feed_generation, None);
        for (answer, error) in [
            (
                json!({"lang": "e\u{0}n"}),
                "lang holds a control character (U+0000)",
            ),
            (
                json!({"lang": "x".repeat(65)}),
                "lang must be at most 64 bytes long",
            ),
            (
                json!({"lang": "en", "filter": {"markets": ["XSTO", "X\tS"]}}),
                "filter.markets[1] holds a control character (U+0009)",
            ),
            (
                json!({"lang": "en", "filter": {"part_kinds": [7]}}),
                "filter.part_kinds[0] must be a string",
            ),
            (
                json!({"lang": "en", "filter": {"companies": ["28"]}}),
                "filter.companies[0] must be a whole number",
            ),
            (
                json!({"lang": "en", "tracks": {"feed": {"generation": u64::MAX}}}),
                "tracks.feed.generation must be a whole number from 0 to 9223372036854775807",
            ),
            (json!(["en"]), "the answer must be an object"),
        ] {
            assert_eq!(
                EndpointAnswer::from_value(&answer).unwrap_err().to_string(),
                error,
                "{answer}"
            );
        }
        let companies: Vec<i64> = (0..=MAX_FILTER_ENTRIES as i64).collect();
        let many = json!({"lang": "en", "filter": {"companies": companies}});
        assert!(matches!(
            EndpointAnswer::from_value(&many),
            Err(AnswerError::TooMany { .. })
        ));
    }

    fn story(id: &str) -> Value {
        json!({"id": id, "ticker": "ALFA B", "version": 3, "headline": "..."})
    }

    #[test]
    fn stories_answers_use_the_webhooks_checks() {
        let list = json!({"data": [story("st_1"), story("st_2")], "next_cursor": "n",
                          "has_more": true});
        let read = StoriesAnswer::from_value(&list).unwrap();
        assert_eq!(read.stories.len(), 2);
        assert_eq!(read.next_cursor.as_deref(), Some("n"));
        let mut nul = story("st_2");
        nul["headline"] = json!("a\u{0}b");
        let list = json!({"data": [story("st_1"), nul], "has_more": false});
        assert_eq!(
            StoriesAnswer::from_value(&list).unwrap_err().to_string(),
            "headline holds U+0000, which the copy cannot store"
        );
        let event = json!({"event_id": "evt_1", "type": "story.updated", "origin": "live",
                           "data": {"story": story("st_1")}});
        let page = json!({"data": [event, {"event_id": "e\u{0}"}], "next_cursor": "c",
                          "has_more": true});
        let read = EventsAnswer::from_value(&page).unwrap();
        assert!(read.events[0].is_ok());
        assert_eq!(
            read.events[1].as_ref().unwrap_err(),
            "event_id holds a control character (U+0000)"
        );
        assert_eq!(
            (read.next_cursor.as_deref(), read.has_more),
            (Some("c"), true)
        );
        // The catch-up cursor is stored: checked as an identifier.
        let page = json!({"data": [], "next_cursor": "c\u{0}", "has_more": true});
        assert_eq!(
            EventsAnswer::from_value(&page).unwrap_err().to_string(),
            "next_cursor holds a control character (U+0000)"
        );
        assert_eq!(
            error_code(&json!({"error": "not_found"}))
                .unwrap()
                .as_deref(),
            Some("not_found")
        );
        assert_eq!(error_code(&json!("gateway")).unwrap(), None);
    }

    #[test]
    fn a_rewinds_answers_are_bounded_and_checked() {
        assert_eq!(rewind_generation(&json!({"generation": 5})).unwrap(), 5);
        assert!(rewind_generation(&json!({"generation": u64::MAX})).is_err());
        assert!(rewind_generation(&json!({})).is_err());
        assert_eq!(
            rewind_refusal(&json!({"error": "cursor_ahead"})).unwrap(),
            "cursor_ahead"
        );
        assert_eq!(
            rewind_refusal(&json!({"error": "x\u{1b}[31m"}))
                .unwrap_err()
                .to_string(),
            "error holds a control character (U+001B)"
        );
    }

    #[test]
    fn parsing_gives_serde_jsons_value_and_its_weight() {
        let text = serde_json::to_vec(&page(vec![entry("announcement:1", SEQ, item(1))])).unwrap();
        let parsed = parse(&text, u64::MAX).unwrap();
        assert_eq!(
            parsed.value,
            serde_json::from_slice::<Value>(&text).unwrap()
        );
        assert!(parsed.weight > text.len() as u64, "{}", parsed.weight);
        assert_eq!(parse(&text, parsed.weight).unwrap().weight, parsed.weight);
        assert_eq!(
            parse(&text, parsed.weight - 1),
            Err(AnswerError::TooLarge {
                budget: parsed.weight - 1
            })
        );
        // The estimate, part by part: an object's leaf node and its key and string; each
        // element's slot in a doubled Vec; past 11 entries, the split root's internal node.
        assert_eq!(
            parse(br#"{"a": "b"}"#, u64::MAX).unwrap().weight,
            640 + (1 + 32) + (1 + 32)
        );
        assert_eq!(parse(b"[1, [2, 3]]", u64::MAX).unwrap().weight, 4 * 96);
        let twelve: Map<String, Value> = (0..12).map(|i| (format!("k{i:02}"), json!(i))).collect();
        let text = serde_json::to_vec(&twelve).unwrap();
        assert_eq!(
            parse(&text, u64::MAX).unwrap().weight,
            640 + 736 + 160 + 12 * (3 + 32)
        );
        assert!(matches!(
            parse(b"{\"a\": ", 1 << 20),
            Err(AnswerError::NotJson(_))
        ));
        assert!(matches!(
            parse(b"{} {}", 1 << 20),
            Err(AnswerError::NotJson(_))
        ));
        assert_eq!(
            parse(b" [1, 2.5, null, true] ", 1 << 20).unwrap().value,
            json!([1, 2.5, null, true])
        );
    }

    #[test]
    fn json_that_swells_when_parsed_is_refused_by_its_weight_not_its_bytes() {
        // 8 bytes of text per element, hundreds of bytes each once parsed.
        let small_objects = format!("[{}]", vec!["{\"a\":0}"; 10_000].join(","));
        let budget = 4 * small_objects.len() as u64;
        assert!(matches!(
            parse(small_objects.as_bytes(), budget),
            Err(AnswerError::TooLarge { .. })
        ));
        // Text of the same length in strings weighs about what it reads.
        let strings = format!("[\"{}\"]", "x".repeat(small_objects.len()));
        let parsed = parse(strings.as_bytes(), budget).unwrap();
        assert!(
            parsed.weight < 2 * strings.len() as u64,
            "{}",
            parsed.weight
        );
        // Deep nesting stops at serde_json's limit, as an answer that is not JSON.
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(matches!(
            parse(deep.as_bytes(), u64::MAX),
            Err(AnswerError::NotJson(_))
        ));
    }
}
