//! The stories API's events and stories (seed 000, and `upstream-api.md`, "The stories API").
//!
//! One [`StoryEvent`] is one webhook body, or one entry of a `GET /v1/events` page: both carry
//! the same shape. One [`Story`] is a story object: an event's `data.story` or `merged_into`, an
//! entry of a `GET /v1/stories` page, or the answer of `GET /v1/stories/{id}`.
//!
//! Reading follows the feed's rule: strict about what the stories API names, lenient about the
//! rest. A type the relay does not name is [`StoryEventBody::Ignored`], never an error, and a
//! story keeps every field it arrived with in [`Story::snapshot`]. A field the relay decides by
//! (an id, a version, the origin) in the wrong shape is an error naming the field, so the event
//! is set aside rather than half applied.
//!
//! What the relay keeps must fit where it keeps it:
//! - ids (the event's, a story's) are 1 to [`MAX_ID_BYTES`] bytes with no control characters,
//!   as are the type and a ticker (without the length rule): Postgres' `text` cannot hold NUL,
//!   and a control character in an id only ever forges or breaks what shows it;
//! - a version is a whole number from 0 to `i64::MAX`, the `bigint` it is stored in;
//! - a snapshot holds no U+0000 in any string or key: it is stored as `jsonb`, which refuses it,
//!   and one such story would fail every write it shares a transaction with.

use serde_json::Value;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::fields::{self, join};

/// The longest id (event or story) the relay keeps, in bytes.
pub const MAX_ID_BYTES: usize = 200;

/// Where an event comes from. Backfill events change the copy like any other but never cause a
/// notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    Live,
    Backfill,
}

impl Origin {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "live" => Some(Origin::Live),
            "backfill" => Some(Origin::Backfill),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Live => "live",
            Origin::Backfill => "backfill",
        }
    }
}

/// The three event types that carry a full snapshot in `data.story`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SnapshotKind {
    Created,
    Updated,
    BecameStrong,
}

impl SnapshotKind {
    /// The kind of a `story.*` event type that carries a snapshot.
    pub fn parse(event_type: &str) -> Option<Self> {
        match event_type {
            "story.created" => Some(SnapshotKind::Created),
            "story.updated" => Some(SnapshotKind::Updated),
            "story.became_strong" => Some(SnapshotKind::BecameStrong),
            _ => None,
        }
    }

    /// The event type.
    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotKind::Created => "story.created",
            SnapshotKind::Updated => "story.updated",
            SnapshotKind::BecameStrong => "story.became_strong",
        }
    }
}

/// A story object. The typed fields are what the relay decides by; `snapshot` is the whole
/// object exactly as received (unknown fields included): what the copy stores.
#[derive(Debug, Clone, PartialEq)]
pub struct Story {
    pub id: String,
    pub ticker: Option<String>,
    pub version: i64,
    pub snapshot: Value,
}

/// What a stories event says, routed by its type.
#[derive(Debug, Clone, PartialEq)]
pub enum StoryEventBody {
    /// `story.created`, `story.updated`, `story.became_strong`: `data.story`.
    Snapshot { kind: SnapshotKind, story: Story },
    /// `story.closed`: `data.story_id`, `data.version` (the closing version) and
    /// `data.merged_into` (the surviving story's snapshot, or null).
    Closed {
        story_id: String,
        version: i64,
        merged_into: Option<Story>,
    },
    /// `article.shortlisted`: `data.article.story_id`.
    ArticleShortlisted { story_id: String },
    /// Any other type: kept, never applied.
    Ignored { event_type: String },
}

/// One stories event: a webhook body, or one entry of a `GET /v1/events` page.
#[derive(Debug, Clone, PartialEq)]
pub struct StoryEvent {
    pub event_id: String,
    /// The `type` exactly as sent.
    pub event_type: String,
    pub origin: Origin,
    /// When the upstream created the event (`created_at`, RFC 3339); `None` when it is missing
    /// or unreadable. Only a notification's policy looks at it, and an event without one is
    /// still applied rather than set aside.
    pub created_at: Option<OffsetDateTime>,
    pub body: StoryEventBody,
}

/// Why a body is not a readable stories event (or a value not a readable story).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum StoryEventError {
    #[error("the body is not JSON: {0}")]
    NotJson(String),
    #[error("{0} is missing")]
    Missing(String),
    #[error("{field} must be {expected}")]
    WrongShape {
        field: String,
        expected: &'static str,
    },
    #[error("{field} must be 1 to {max} bytes long", max = MAX_ID_BYTES)]
    IdLength { field: String },
    #[error("{field} holds a control character (U+{code:04X})")]
    ControlCharacter { field: String, code: u32 },
    #[error("{field} holds U+0000, which the copy cannot store")]
    NulInSnapshot { field: String },
}

impl StoryEvent {
    /// Reads a webhook body. Call only after the signature has been verified over these bytes.
    pub fn parse(body: &[u8]) -> Result<Self, StoryEventError> {
        let value: Value =
            serde_json::from_slice(body).map_err(|e| StoryEventError::NotJson(e.to_string()))?;
        Self::read(&value, "the body")
    }

    /// Reads one event as a value: an entry of a `GET /v1/events` page's `data`.
    pub fn from_value(value: &Value) -> Result<Self, StoryEventError> {
        Self::read(value, "the event")
    }

    /// Reads the event `value`, called `what` when it is not an object.
    fn read(value: &Value, what: &str) -> Result<Self, StoryEventError> {
        let at = Fields::of(value, what, "")?;
        let event_id = at.required_id("event_id")?;
        let event_type = at.required_text("type")?;
        let origin = at.required_str("origin")?;
        let origin =
            Origin::parse(origin).ok_or_else(|| at.wrong("origin", "\"live\" or \"backfill\""))?;
        let created_at = match at.get("created_at") {
            Some(Value::String(text)) => OffsetDateTime::parse(text, &Rfc3339).ok(),
            _ => None,
        };
        let body = match (SnapshotKind::parse(&event_type), event_type.as_str()) {
            (Some(kind), _) => {
                let data = at.required_object("data")?;
                let story = data.required("story")?;
                StoryEventBody::Snapshot {
                    kind,
                    story: Story::read(story, "data.story", "data.story")?,
                }
            }
            (None, "story.closed") => {
                let data = at.required_object("data")?;
                let merged_into = match data.get("merged_into") {
                    None => None,
                    Some(story) => {
                        Some(Story::read(story, "data.merged_into", "data.merged_into")?)
                    }
                };
                StoryEventBody::Closed {
                    story_id: data.required_id("story_id")?,
                    version: data.required_version("version")?,
                    merged_into,
                }
            }
            (None, "article.shortlisted") => {
                let data = at.required_object("data")?;
                let article = data.required_object("article")?;
                StoryEventBody::ArticleShortlisted {
                    story_id: article.required_id("story_id")?,
                }
            }
            _ => StoryEventBody::Ignored {
                event_type: event_type.clone(),
            },
        };
        Ok(StoryEvent {
            event_id,
            event_type,
            origin,
            created_at,
            body,
        })
    }
}

impl Story {
    /// Reads a story object: an entry of a `GET /v1/stories` page, or the answer of
    /// `GET /v1/stories/{id}`.
    pub fn from_value(value: &Value) -> Result<Self, StoryEventError> {
        Self::read(value, "the story", "")
    }

    /// Reads the story `value`, called `what` when it is not an object, its fields named under
    /// `prefix`.
    fn read(value: &Value, what: &str, prefix: &str) -> Result<Self, StoryEventError> {
        let at = Fields::of(value, what, prefix)?;
        let id = at.required_id("id")?;
        let version = at.required_version("version")?;
        let ticker = at.optional_str("ticker")?.map(str::to_owned);
        if let Some(ticker) = &ticker {
            check_control(ticker, || at.path("ticker"))?;
        }
        check_no_nul(value, prefix)?;
        Ok(Story {
            id,
            ticker,
            version,
            snapshot: value.clone(),
        })
    }
}

/// Refuses `text` when it holds a control character (C0, DEL or C1), naming `field`.
fn check_control(text: &str, field: impl FnOnce() -> String) -> Result<(), StoryEventError> {
    match text.chars().find(|c| c.is_control()) {
        None => Ok(()),
        Some(c) => Err(StoryEventError::ControlCharacter {
            field: field(),
            code: u32::from(c),
        }),
    }
}

/// Refuses a snapshot holding U+0000 in any string or key, naming where (`path` is the
/// snapshot's own). Walks with its own stack rather than by recursion.
fn check_no_nul(value: &Value, path: &str) -> Result<(), StoryEventError> {
    let mut stack: Vec<(&Value, String)> = vec![(value, path.to_owned())];
    while let Some((value, path)) = stack.pop() {
        match value {
            Value::String(text) if text.contains('\0') => {
                return Err(StoryEventError::NulInSnapshot { field: path });
            }
            Value::Array(items) => {
                for (index, item) in items.iter().enumerate() {
                    stack.push((item, format!("{path}[{index}]")));
                }
            }
            Value::Object(fields) => {
                for (key, item) in fields {
                    if key.contains('\0') {
                        let of = if path.is_empty() { "the story" } else { &path };
                        return Err(StoryEventError::NulInSnapshot {
                            field: format!("a key of {of}"),
                        });
                    }
                    stack.push((item, join(&path, key)));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

type Fields<'a> = fields::Fields<'a, StoryEventError>;

fields::field_error!(StoryEventError, "a JSON object");

/// The checks of what a stories event keeps.
impl Fields<'_> {
    /// A string kept as text the relay decides by: no control characters.
    fn required_text(&self, name: &str) -> Result<String, StoryEventError> {
        let text = self.required_str(name)?;
        check_control(text, || self.path(name))?;
        Ok(text.to_owned())
    }

    /// An id: 1 to [`MAX_ID_BYTES`] bytes, no control characters.
    fn required_id(&self, name: &str) -> Result<String, StoryEventError> {
        let text = self.required_text(name)?;
        if text.is_empty() || text.len() > MAX_ID_BYTES {
            return Err(StoryEventError::IdLength {
                field: self.path(name),
            });
        }
        Ok(text)
    }

    /// A version: a whole number that fits the `bigint` it is stored in.
    fn required_version(&self, name: &str) -> Result<i64, StoryEventError> {
        const EXPECTED: &str = "a whole number from 0 to 9223372036854775807";
        match self.required(name)? {
            Value::Number(n) => match n.as_i64() {
                Some(version) if version >= 0 => Ok(version),
                _ => Err(self.wrong(name, EXPECTED)),
            },
            _ => Err(self.wrong(name, EXPECTED)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The example event of `upstream-api.md`, "The stories API", "Webhooks".
    const EXAMPLE: &str = r#"{"event_id": "evt_5c1b0a2f9d7e4c3a", "type": "story.updated", "origin": "live",
 "created_at": "2026-10-08T06:40:00.300000Z",
 "data": {"story": {"id": "st_7101", "ticker": "ALFA B", "version": 3,
                    "headline": "...", "articles": [{"id": "ar_1", "story_id": "st_7101"}]}}}"#;

    fn parse(value: Value) -> Result<StoryEvent, StoryEventError> {
        StoryEvent::parse(value.to_string().as_bytes())
    }

    fn error(value: Value) -> String {
        parse(value).unwrap_err().to_string()
    }

    #[test]
    fn reads_the_example_event_and_keeps_the_story_as_received() {
        let event = StoryEvent::parse(EXAMPLE.as_bytes()).unwrap();
        let raw: Value = serde_json::from_str(EXAMPLE).unwrap();
        assert_eq!(event, StoryEvent::from_value(&raw).unwrap());
        assert_eq!(event.event_id, "evt_5c1b0a2f9d7e4c3a");
        assert_eq!(event.event_type, "story.updated");
        assert_eq!(event.origin, Origin::Live);
        let StoryEventBody::Snapshot { kind, story } = &event.body else {
            panic!("unexpected {:?}", event.body);
        };
        assert_eq!(*kind, SnapshotKind::Updated);
        assert_eq!(story.id, "st_7101");
        assert_eq!(story.ticker.as_deref(), Some("ALFA B"));
        assert_eq!(story.version, 3);
        assert_eq!(story.snapshot, raw["data"]["story"]);
        assert_eq!(
            Story::from_value(&raw["data"]["story"]).unwrap(),
            story.clone()
        );
    }

    #[test]
    fn created_at_is_read_as_rfc_3339_and_none_when_missing_or_unreadable() {
        // 2026-10-08T06:40:00Z.
        let at = OffsetDateTime::from_unix_timestamp(1_791_441_600).unwrap();
        let event = StoryEvent::parse(EXAMPLE.as_bytes()).unwrap();
        assert_eq!(
            event.created_at,
            Some(at + time::Duration::milliseconds(300))
        );
        let base = json!({"event_id": "e", "type": "story.promoted", "origin": "live"});
        for created_at in [
            None,
            Some(Value::Null),
            Some(json!("yesterday")),
            Some(json!(1_760_000_000)),
            Some(json!("2026-10-08 06:40:00")),
        ] {
            let mut value = base.clone();
            if let Some(created_at) = &created_at {
                value["created_at"] = created_at.clone();
            }
            let event = parse(value).unwrap();
            assert_eq!(event.created_at, None, "created_at {created_at:?}");
        }
        let mut offset = base.clone();
        offset["created_at"] = json!("2026-10-08T08:40:00+02:00");
        assert_eq!(parse(offset).unwrap().created_at, Some(at));
    }

    #[test]
    fn reads_every_named_type() {
        for (kind, name) in [
            (SnapshotKind::Created, "story.created"),
            (SnapshotKind::Updated, "story.updated"),
            (SnapshotKind::BecameStrong, "story.became_strong"),
        ] {
            assert_eq!(kind.as_str(), name);
            let event = parse(json!({"event_id": "e", "type": name, "origin": "backfill",
                "data": {"story": {"id": "st_1", "version": 0, "shiny": [1]}}}))
            .unwrap();
            assert_eq!(event.origin, Origin::Backfill);
            assert!(matches!(
                event.body,
                StoryEventBody::Snapshot { kind: k, story: Story { ticker: None, version: 0, .. } }
                    if k == kind
            ));
        }
        let closed = parse(
            json!({"event_id": "e", "type": "story.closed", "origin": "live",
            "data": {"story_id": "st_1", "version": 7,
                     "merged_into": {"id": "st_2", "ticker": "B", "version": 4}}}),
        )
        .unwrap();
        assert_eq!(
            closed.body,
            StoryEventBody::Closed {
                story_id: "st_1".into(),
                version: 7,
                merged_into: Some(Story {
                    id: "st_2".into(),
                    ticker: Some("B".into()),
                    version: 4,
                    snapshot: json!({"id": "st_2", "ticker": "B", "version": 4}),
                }),
            }
        );
        for merged_into in [json!(null), json!("absent")] {
            let mut data = json!({"story_id": "st_1", "version": 7, "merged_into": merged_into});
            if merged_into == json!("absent") {
                data.as_object_mut().unwrap().remove("merged_into");
            }
            let closed = parse(
                json!({"event_id": "e", "type": "story.closed", "origin": "live", "data": data}),
            )
            .unwrap();
            assert!(matches!(
                closed.body,
                StoryEventBody::Closed {
                    merged_into: None,
                    ..
                }
            ));
        }
        let shortlisted = parse(json!({"event_id": "e", "type": "article.shortlisted",
            "origin": "live", "data": {"article": {"id": "ar_1", "story_id": "st_9"}}}))
        .unwrap();
        assert_eq!(
            shortlisted.body,
            StoryEventBody::ArticleShortlisted {
                story_id: "st_9".into()
            }
        );
    }

    #[test]
    fn other_types_are_ignored_not_errors() {
        for event_type in ["story.promoted", "article.created", "nodot", ""] {
            let event = parse(
                json!({"event_id": "e", "type": event_type, "origin": "live",
                "data": "anything"}),
            )
            .unwrap();
            assert_eq!(
                event.body,
                StoryEventBody::Ignored {
                    event_type: event_type.into()
                }
            );
        }
        // Without data at all, too.
        assert!(parse(json!({"event_id": "e", "type": "x.y", "origin": "live"})).is_ok());
    }

    #[test]
    fn refuses_what_the_relay_decides_by_in_the_wrong_shape() {
        let story = |story: Value| {
            json!({"event_id": "e", "type": "story.created", "origin": "live",
                   "data": {"story": story}})
        };
        let closed = |data: Value| json!({"event_id": "e", "type": "story.closed", "origin": "live", "data": data});
        let long = "x".repeat(MAX_ID_BYTES + 1);
        let cases = [
            (json!([1]), "the body must be a JSON object"),
            (json!("text"), "the body must be a JSON object"),
            (
                json!({"type": "story.created", "origin": "live"}),
                "event_id is missing",
            ),
            (
                json!({"event_id": 5, "type": "story.created", "origin": "live"}),
                "event_id must be a string",
            ),
            (
                json!({"event_id": "", "type": "x", "origin": "live"}),
                "event_id must be 1 to 200 bytes long",
            ),
            (
                json!({"event_id": "e", "origin": "live"}),
                "type is missing",
            ),
            (json!({"event_id": "e", "type": "x"}), "origin is missing"),
            (
                json!({"event_id": "e", "type": "x", "origin": "Live"}),
                "origin must be \"live\" or \"backfill\"",
            ),
            (
                json!({"event_id": "e", "type": "story.created", "origin": "live"}),
                "data is missing",
            ),
            (
                json!({"event_id": "e", "type": "story.created", "origin": "live", "data": []}),
                "data must be an object",
            ),
            (
                json!({"event_id": "e", "type": "story.created", "origin": "live", "data": {}}),
                "data.story is missing",
            ),
            (story(json!(3)), "data.story must be a JSON object"),
            (story(json!({"version": 1})), "data.story.id is missing"),
            (story(json!({"id": "s"})), "data.story.version is missing"),
            (
                story(json!({"id": "", "version": 1})),
                "data.story.id must be 1 to 200 bytes long",
            ),
            (
                story(json!({"id": long, "version": 1})),
                "data.story.id must be 1 to 200 bytes long",
            ),
            (
                story(json!({"id": "s", "version": -1})),
                "data.story.version must be a whole number from 0 to 9223372036854775807",
            ),
            (
                story(json!({"id": "s", "version": 1.5})),
                "data.story.version must be a whole number from 0 to 9223372036854775807",
            ),
            (
                story(json!({"id": "s", "version": 2.0})),
                "data.story.version must be a whole number from 0 to 9223372036854775807",
            ),
            (
                story(json!({"id": "s", "version": 9_223_372_036_854_775_808u64})),
                "data.story.version must be a whole number from 0 to 9223372036854775807",
            ),
            (
                story(json!({"id": "s", "version": "3"})),
                "data.story.version must be a whole number from 0 to 9223372036854775807",
            ),
            (
                story(json!({"id": "s", "version": 1, "ticker": 7})),
                "data.story.ticker must be a string",
            ),
            (
                story(json!({"id": "s", "version": 1, "headline": "a\u{0}b"})),
                "data.story.headline holds U+0000, which the copy cannot store",
            ),
            (
                story(json!({"id": "s", "version": 1, "articles": [{"t": "\u{0}"}]})),
                "data.story.articles[0].t holds U+0000, which the copy cannot store",
            ),
            (
                story(json!({"id": "s", "version": 1, "x": {"a\u{0}": 1}})),
                "a key of data.story.x holds U+0000, which the copy cannot store",
            ),
            (closed(json!({"version": 2})), "data.story_id is missing"),
            (closed(json!({"story_id": "s"})), "data.version is missing"),
            (
                closed(json!({"story_id": "s", "version": 2, "merged_into": "st_2"})),
                "data.merged_into must be a JSON object",
            ),
            (
                closed(json!({"story_id": "s", "version": 2, "merged_into": {"id": "t"}})),
                "data.merged_into.version is missing",
            ),
            (
                json!({"event_id": "e", "type": "article.shortlisted", "origin": "live",
                       "data": {"article": {"id": "ar_1"}}}),
                "data.article.story_id is missing",
            ),
            (
                json!({"event_id": "e", "type": "article.shortlisted", "origin": "live",
                       "data": {"article": "ar_1"}}),
                "data.article must be an object",
            ),
        ];
        for (body, expected) in cases {
            assert_eq!(error(body.clone()), expected, "{body}");
        }
        assert!(matches!(
            StoryEvent::parse(b"{not json"),
            Err(StoryEventError::NotJson(_))
        ));
        assert!(matches!(
            StoryEvent::parse(b""),
            Err(StoryEventError::NotJson(_))
        ));
        assert_eq!(
            Story::from_value(&json!(null)).unwrap_err().to_string(),
            "the story must be a JSON object"
        );
        assert_eq!(
            Story::from_value(&json!({"id": "s"}))
                .unwrap_err()
                .to_string(),
            "version is missing"
        );
    }

    #[test]
    fn ids_may_be_200_bytes_of_any_text_but_no_control_characters() {
        let id = "é".repeat(MAX_ID_BYTES / 2);
        let story = Story::from_value(&json!({"id": id, "version": i64::MAX})).unwrap();
        assert_eq!(story.version, i64::MAX);
        let too_long = format!("{id}x");
        assert!(Story::from_value(&json!({"id": too_long, "version": 1})).is_err());
        for (field, body) in [
            (
                "event_id",
                json!({"event_id": "e\u{0}", "type": "x", "origin": "live"}),
            ),
            (
                "type",
                json!({"event_id": "e", "type": "x\u{1b}", "origin": "live"}),
            ),
            (
                "data.story.id",
                json!({"event_id": "e", "type": "story.created", "origin": "live",
                       "data": {"story": {"id": "s\n", "version": 1}}}),
            ),
            (
                "data.story.ticker",
                json!({"event_id": "e", "type": "story.created", "origin": "live",
                       "data": {"story": {"id": "s", "ticker": "A\u{9b}", "version": 1}}}),
            ),
            (
                "data.story_id",
                json!({"event_id": "e", "type": "story.closed", "origin": "live",
                       "data": {"story_id": "s\u{7f}", "version": 1}}),
            ),
        ] {
            assert!(
                matches!(
                    parse(body.clone()),
                    Err(StoryEventError::ControlCharacter { field: f, .. }) if f == field
                ),
                "{body}"
            );
        }
        // Text the relay does not decide by keeps whatever it holds but NUL.
        let event = parse(
            json!({"event_id": "e", "type": "story.created", "origin": "live",
            "data": {"story": {"id": "s", "version": 1, "headline": "a\u{7}\n€😀"}}}),
        )
        .unwrap();
        assert!(matches!(event.body, StoryEventBody::Snapshot { .. }));
    }

    #[test]
    fn hostile_bodies_are_errors_not_panics() {
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(StoryEvent::parse(deep.as_bytes()).is_err());
        let mut nested = json!({"id": "s", "version": 1});
        for _ in 0..500 {
            nested = json!({"id": "s", "version": 1, "inner": [nested]});
        }
        assert!(Story::from_value(&nested).is_ok());
        nested["inner"][0]["inner"][0]["x"] = json!("\u{0}");
        assert_eq!(
            Story::from_value(&nested).unwrap_err().to_string(),
            "inner[0].inner[0].x holds U+0000, which the copy cannot store"
        );
        for bytes in [
            &b"\xff\xfe"[..],
            b"null",
            b"{}",
            b"{\"event_id\":null}",
            b"1e999",
        ] {
            assert!(StoryEvent::parse(bytes).is_err());
        }
        // A lone surrogate is not text.
        assert!(StoryEvent::parse(br#"{"event_id":"\ud800","type":"x","origin":"live"}"#).is_err());
    }
}
