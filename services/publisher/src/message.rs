//! The change messages, version 1: what a tenant's destination receives for each row of the
//! outbox. A feed endpoint's changes are [`ChangeMessage`]s, documented for users in
//! `docs/change-message.v1.schema.json` ([`SCHEMA`]); a stories endpoint's are
//! [`StoryMessage`]s, version 1 of their own kind, in `docs/story-message.v1.schema.json`
//! ([`STORY_SCHEMA`]). Both go to the same queue, in one change_seq stream per endpoint;
//! `docs/asyncapi.yaml` describes the queues and the AMQP properties. [`Delivered::decode`] tells
//! the two apart by the body's `kind` (a feed message has none).

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;
use time::OffsetDateTime;
use uuid::Uuid;

/// The JSON Schema of the feed's message body, as shipped in `docs/`.
pub const SCHEMA: &str = include_str!("../../../docs/change-message.v1.schema.json");

/// The JSON Schema of a stories endpoint's message body, as shipped in `docs/`.
pub const STORY_SCHEMA: &str = include_str!("../../../docs/story-message.v1.schema.json");

/// The body's content type (the AMQP `content_type` property).
pub const CONTENT_TYPE: &str = "application/json";

/// The only version this crate writes and reads.
pub const VERSION: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Operation {
    Upsert,
    Remove,
    /// The first change of an epoch opened by a restore: what the consumer holds of the
    /// endpoint is replaced by the snapshot's upserts that follow.
    SnapshotBegin,
    /// The snapshot is whole: the consumer's copy is the endpoint's as of this change.
    SnapshotEnd,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Upsert => "upsert",
            Operation::Remove => "remove",
            Operation::SnapshotBegin => "snapshot_begin",
            Operation::SnapshotEnd => "snapshot_end",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "upsert" => Some(Operation::Upsert),
            "remove" => Some(Operation::Remove),
            "snapshot_begin" => Some(Operation::SnapshotBegin),
            "snapshot_end" => Some(Operation::SnapshotEnd),
            _ => None,
        }
    }

    /// A snapshot's marker, which names no subject.
    pub fn is_marker(self) -> bool {
        matches!(self, Operation::SnapshotBegin | Operation::SnapshotEnd)
    }
}

/// The epoch of every stream before epochs were sent, and of every endpoint's first stream.
pub const FIRST_EPOCH: u64 = 1;

fn first_epoch() -> u64 {
    FIRST_EPOCH
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartsDiff {
    pub added: Vec<String>,
    pub changed: Vec<String>,
    pub removed: Vec<String>,
}

/// One change of one endpoint's copy. Field by field as the schema describes it.
///
/// `Item` is how the item is held: a parsed [`Value`] for a consumer (what [`decode`] gives),
/// or the JSON text itself ([`RawValue`]) for the publisher, which sends the item as the outbox
/// holds it rather than parsing it only to write it out again.
///
/// [`decode`]: ChangeMessage::decode
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChangeMessage<Item = Value> {
    pub v: u32,
    pub tenant_id: Uuid,
    pub webhook_endpoint_id: Uuid,
    /// The epoch of the endpoint's change stream: a restore of the relay's database begins a
    /// greater one, numbered from 1 again and opened by a snapshot. Absent in messages sent
    /// before epochs were: those are of the first.
    #[serde(default = "first_epoch")]
    pub epoch: u64,
    pub change_seq: i64,
    pub operation: Operation,
    pub subject: String,
    pub item_kind: Option<String>,
    pub generation: u64,
    pub sequence: Option<String>,
    pub event_id: Option<String>,
    pub reload_generation: Option<u64>,
    /// Part of the snapshot that opens an epoch (its markers and the upserts between them),
    /// which no event and no reload caused.
    #[serde(default)]
    pub snapshot: bool,
    /// On upsert only; absent (not null) on remove.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item: Option<Item>,
    pub parts_diff: PartsDiff,
    #[serde(with = "time::serde::rfc3339")]
    pub changed_at: OffsetDateTime,
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("not a change message: {0}")]
    Json(#[from] serde_json::Error),
    #[error("change message version {0}; this consumer reads version 1 only")]
    Version(u32),
    #[error("change message {0} is inconsistent: {1}")]
    Inconsistent(String, &'static str),
    /// A `kind` this consumer does not know (a feed message has none; a stories endpoint's is
    /// `story` or `notification`).
    #[error(
        "change message of kind {0:?}; this consumer reads the feed's, story and notification"
    )]
    Kind(String),
}

/// The fields read before the whole body: its version, and its kind (none on the feed's).
#[derive(Deserialize)]
struct Peek {
    v: u32,
    #[serde(default)]
    kind: Option<String>,
}

impl<Item: Serialize> ChangeMessage<Item> {
    /// The AMQP `message_id`: `<endpoint>:<epoch>:<change_seq>`, the same each time a change is
    /// sent, and never the same for two changes (a restore begins a new epoch).
    pub fn message_id(&self) -> String {
        message_id(self.webhook_endpoint_id, self.epoch, self.change_seq)
    }

    pub fn encode(&self) -> Vec<u8> {
        // Serializing plain data with string keys (and an item that is JSON already) cannot
        // fail.
        serde_json::to_vec(self).expect("a change message serializes")
    }
}

impl ChangeMessage {
    /// Parses a body, refusing other versions and bodies whose fields contradict each other
    /// (what the schema's conditions say, checked here too so a consumer need not run a
    /// schema validator).
    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        // The version first, so a v2 body is refused as such rather than as malformed.
        #[derive(Deserialize)]
        struct Versioned {
            v: u32,
        }
        let Versioned { v } = serde_json::from_slice(body)?;
        if v != VERSION {
            return Err(DecodeError::Version(v));
        }
        Self::decode_v1(body)
    }

    /// [`decode`](Self::decode) of a body whose version was read already.
    fn decode_v1(body: &[u8]) -> Result<Self, DecodeError> {
        let message: ChangeMessage = serde_json::from_slice(body)?;
        let bad = |why| Err(DecodeError::Inconsistent(message.message_id(), why));
        if message.change_seq < 1 || message.epoch < FIRST_EPOCH {
            return bad("change_seq or epoch below 1");
        }
        if (message.operation == Operation::Upsert) != message.item.is_some() {
            return bad("an item on remove, or none on upsert");
        }
        let causes = usize::from(message.event_id.is_some())
            + usize::from(message.reload_generation.is_some())
            + usize::from(message.snapshot);
        if causes != 1 {
            return bad("not exactly one of event_id, reload_generation and snapshot");
        }
        if message.operation.is_marker() && !message.snapshot {
            return bad("a snapshot marker outside a snapshot");
        }
        Ok(message)
    }
}

pub fn message_id(endpoint: Uuid, epoch: u64, change_seq: i64) -> String {
    format!("{endpoint}:{epoch}:{change_seq}")
}

/// Which of a stories endpoint's messages: a change of its copy of the stories, or a
/// notification it claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoryKind {
    Story,
    Notification,
}

impl StoryKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StoryKind::Story => "story",
            StoryKind::Notification => "notification",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "story" => Some(StoryKind::Story),
            "notification" => Some(StoryKind::Notification),
            _ => None,
        }
    }
}

/// What a stories endpoint's change did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoryOperation {
    /// Kind `story`: the story's row is open and holds `story`, its snapshot at `version`.
    Saved,
    /// Kind `story`: the story closed for good (merged into `merged_into`, when set): its row
    /// is kept, closed, with no snapshot, so a late event cannot open it again.
    Closed,
    /// Kind `story`: the story's ticker was removed from the endpoint, and its open row with it.
    Dropped,
    /// Kind `notification`: the endpoint claimed the story's notification (once ever per
    /// story); `story` is the snapshot of the event that claimed it.
    Notified,
}

impl StoryOperation {
    pub fn as_str(self) -> &'static str {
        match self {
            StoryOperation::Saved => "saved",
            StoryOperation::Closed => "closed",
            StoryOperation::Dropped => "dropped",
            StoryOperation::Notified => "notified",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "saved" => Some(StoryOperation::Saved),
            "closed" => Some(StoryOperation::Closed),
            "dropped" => Some(StoryOperation::Dropped),
            "notified" => Some(StoryOperation::Notified),
            _ => None,
        }
    }

    /// The kind of message the operation is one of.
    pub fn kind(self) -> StoryKind {
        match self {
            StoryOperation::Saved | StoryOperation::Closed | StoryOperation::Dropped => {
                StoryKind::Story
            }
            StoryOperation::Notified => StoryKind::Notification,
        }
    }

    /// The operations that carry a snapshot (`story`).
    pub fn has_story(self) -> bool {
        matches!(self, StoryOperation::Saved | StoryOperation::Notified)
    }
}

/// One change of a stories endpoint: a change of its copy of the stories (kind `story`) or a
/// notification it claimed (kind `notification`), in the endpoint's change_seq stream, which it
/// shares with nothing else (an endpoint is the feed's or the stories'). Field by field as
/// `docs/story-message.v1.schema.json` describes it.
///
/// `Story` is how the snapshot is held: a parsed [`Value`] for a consumer (what [`decode`]
/// gives), the JSON text ([`RawValue`]) for the publisher.
///
/// [`decode`]: StoryMessage::decode
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoryMessage<Story = Value> {
    pub v: u32,
    pub kind: StoryKind,
    pub tenant_id: Uuid,
    pub webhook_endpoint_id: Uuid,
    /// As the feed's: a restore of the relay's database begins a greater one.
    pub epoch: u64,
    pub change_seq: i64,
    pub operation: StoryOperation,
    pub story_id: String,
    /// The story's ticker, as the copy's row holds it (null when the story named none).
    pub ticker: Option<String>,
    /// The row's version after the change (on notified: the claiming snapshot's).
    pub version: u64,
    /// On saved and notified only; absent (not null) otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub story: Option<Story>,
    /// On closed only, when the story merged into another: the surviving story's id. Absent
    /// otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged_into: Option<String>,
    /// The upstream event that caused the change; null when a round did.
    pub event_id: Option<String>,
    /// The endpoint's round that caused the change (a reload in full, a ticker's first load,
    /// or a ticker's removal); null when an event did.
    pub reload_round: Option<u64>,
    /// Part of the snapshot that opens an epoch (after a restore or a resync: every row of the
    /// copy, `saved` or `closed`, between the feed's `snapshot_begin` and `snapshot_end`
    /// markers), which no event and no round caused.
    #[serde(default)]
    pub snapshot: bool,
    #[serde(with = "time::serde::rfc3339")]
    pub changed_at: OffsetDateTime,
}

impl<Story: Serialize> StoryMessage<Story> {
    /// The AMQP `message_id`: `<endpoint>:<epoch>:<change_seq>`, as the feed's.
    pub fn message_id(&self) -> String {
        message_id(self.webhook_endpoint_id, self.epoch, self.change_seq)
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a story message serializes")
    }

    /// What the schema's conditions say, bar the snapshot's own content: `None` when the
    /// message keeps them, else what it breaks.
    pub fn contradiction(&self) -> Option<&'static str> {
        if self.v != VERSION {
            return Some("a version other than 1");
        }
        if self.change_seq < 1 || self.epoch < FIRST_EPOCH {
            return Some("change_seq or epoch below 1");
        }
        if self.operation.kind() != self.kind {
            return Some("an operation of another kind");
        }
        if self.story_id.is_empty() {
            return Some("an empty story_id");
        }
        if self.operation.has_story() != self.story.is_some() {
            return Some("a story on closed or dropped, or none on saved or notified");
        }
        if self.merged_into.is_some() && self.operation != StoryOperation::Closed {
            return Some("merged_into on an operation other than closed");
        }
        if self.merged_into.as_deref() == Some("") {
            return Some("an empty merged_into");
        }
        match (&self.event_id, self.reload_round, self.snapshot) {
            (Some(_), None, false) | (None, Some(_), false) | (None, None, true) => {}
            _ => return Some("not exactly one of event_id, reload_round and snapshot"),
        }
        if self.snapshot
            && !matches!(
                self.operation,
                StoryOperation::Saved | StoryOperation::Closed
            )
        {
            return Some("a snapshot of something other than a saved or closed row");
        }
        if self.reload_round == Some(0) {
            return Some("reload_round 0");
        }
        if self.operation == StoryOperation::Notified && self.event_id.is_none() {
            return Some("a notification no event claimed");
        }
        if self.operation == StoryOperation::Dropped && self.reload_round.is_none() {
            return Some("a drop no round made");
        }
        None
    }
}

impl StoryMessage {
    /// Parses a body, refusing other versions and bodies whose fields contradict each other
    /// (the schema's conditions, and the snapshot naming the message's story).
    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        let Peek { v, .. } = serde_json::from_slice(body)?;
        if v != VERSION {
            return Err(DecodeError::Version(v));
        }
        Self::decode_v1(body)
    }

    fn decode_v1(body: &[u8]) -> Result<Self, DecodeError> {
        let message: StoryMessage = serde_json::from_slice(body)?;
        let bad = |why| Err(DecodeError::Inconsistent(message.message_id(), why));
        if let Some(why) = message.contradiction() {
            return bad(why);
        }
        if let Some(story) = &message.story {
            if story.get("id").and_then(Value::as_str) != Some(message.story_id.as_str()) {
                return bad("a story whose id is not story_id");
            }
        }
        Ok(message)
    }
}

/// A change message as the outbox sends it: the feed's or a stories endpoint's, its item or
/// snapshot the outbox's JSON text, unparsed.
#[derive(Debug, Clone)]
pub enum Outbound {
    Item(ChangeMessage<Box<RawValue>>),
    Story(StoryMessage<Box<RawValue>>),
}

impl Outbound {
    pub fn endpoint(&self) -> Uuid {
        match self {
            Outbound::Item(m) => m.webhook_endpoint_id,
            Outbound::Story(m) => m.webhook_endpoint_id,
        }
    }

    pub fn epoch(&self) -> u64 {
        match self {
            Outbound::Item(m) => m.epoch,
            Outbound::Story(m) => m.epoch,
        }
    }

    pub fn change_seq(&self) -> i64 {
        match self {
            Outbound::Item(m) => m.change_seq,
            Outbound::Story(m) => m.change_seq,
        }
    }

    /// The AMQP `message_id`: `<endpoint>:<epoch>:<change_seq>`.
    pub fn message_id(&self) -> String {
        message_id(self.endpoint(), self.epoch(), self.change_seq())
    }

    /// The AMQP `type`: the operation (`upsert`, ..., `saved`, `notified`, ...).
    pub fn amqp_type(&self) -> &'static str {
        match self {
            Outbound::Item(m) => m.operation.as_str(),
            Outbound::Story(m) => m.operation.as_str(),
        }
    }

    /// The body: a feed message exactly as [`ChangeMessage::encode`] writes it.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Outbound::Item(m) => m.encode(),
            Outbound::Story(m) => m.encode(),
        }
    }
}

/// A change message as a consumer receives it: the feed's or a stories endpoint's. Serialized,
/// it is the message itself (as its `encode` writes it).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Delivered {
    Item(ChangeMessage),
    Story(StoryMessage),
}

impl Delivered {
    /// Parses a body of either kind: one with `kind` `story` or `notification` is a
    /// [`StoryMessage`], one without `kind` the feed's [`ChangeMessage`]; each checked as its
    /// own `decode` does. Other versions and other kinds are refused.
    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        let Peek { v, kind } = serde_json::from_slice(body)?;
        if v != VERSION {
            return Err(DecodeError::Version(v));
        }
        match kind.as_deref() {
            None => Ok(Delivered::Item(ChangeMessage::decode_v1(body)?)),
            Some(kind) if StoryKind::parse(kind).is_some() => {
                Ok(Delivered::Story(StoryMessage::decode_v1(body)?))
            }
            Some(other) => Err(DecodeError::Kind(other.to_owned())),
        }
    }

    pub fn tenant(&self) -> Uuid {
        match self {
            Delivered::Item(m) => m.tenant_id,
            Delivered::Story(m) => m.tenant_id,
        }
    }

    pub fn endpoint(&self) -> Uuid {
        match self {
            Delivered::Item(m) => m.webhook_endpoint_id,
            Delivered::Story(m) => m.webhook_endpoint_id,
        }
    }

    pub fn epoch(&self) -> u64 {
        match self {
            Delivered::Item(m) => m.epoch,
            Delivered::Story(m) => m.epoch,
        }
    }

    pub fn change_seq(&self) -> i64 {
        match self {
            Delivered::Item(m) => m.change_seq,
            Delivered::Story(m) => m.change_seq,
        }
    }

    pub fn message_id(&self) -> String {
        message_id(self.endpoint(), self.epoch(), self.change_seq())
    }

    /// The operation's name, as the AMQP `type` carries it.
    pub fn operation(&self) -> &'static str {
        match self {
            Delivered::Item(m) => m.operation.as_str(),
            Delivered::Story(m) => m.operation.as_str(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        match self {
            Delivered::Item(m) => m.encode(),
            Delivered::Story(m) => m.encode(),
        }
    }

    pub fn as_item(&self) -> Option<&ChangeMessage> {
        match self {
            Delivered::Item(m) => Some(m),
            Delivered::Story(_) => None,
        }
    }

    pub fn as_story(&self) -> Option<&StoryMessage> {
        match self {
            Delivered::Item(_) => None,
            Delivered::Story(m) => Some(m),
        }
    }
}

impl From<ChangeMessage> for Delivered {
    fn from(message: ChangeMessage) -> Self {
        Delivered::Item(message)
    }
}

impl From<StoryMessage> for Delivered {
    fn from(message: StoryMessage) -> Self {
        Delivered::Story(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn upsert() -> ChangeMessage {
        ChangeMessage {
            v: 1,
            tenant_id: Uuid::from_u128(1),
            webhook_endpoint_id: Uuid::from_u128(2),
            epoch: 1,
            change_seq: 7,
            operation: Operation::Upsert,
            subject: "announcement:88001".into(),
            item_kind: Some("announcement".into()),
            generation: 3,
            sequence: Some("0000000003.0000000012".into()),
            event_id: Some("evt_1".into()),
            reload_generation: None,
            snapshot: false,
            item: Some(json!({"feed_item_id": "announcement:88001", "parts": []})),
            parts_diff: PartsDiff {
                added: vec!["flash:1".into()],
                ..PartsDiff::default()
            },
            changed_at: OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap(),
        }
    }

    #[test]
    fn a_message_round_trips_and_names_itself_by_endpoint_and_change_seq() {
        let message = upsert();
        assert_eq!(
            message.message_id(),
            "00000000-0000-0000-0000-000000000002:1:7"
        );
        assert_eq!(ChangeMessage::decode(&message.encode()).unwrap(), message);
    }

    #[test]
    fn a_removal_has_no_item_key_at_all() {
        let mut message = upsert();
        message.operation = Operation::Remove;
        message.item = None;
        let body: Value = serde_json::from_slice(&message.encode()).unwrap();
        assert!(body.get("item").is_none(), "{body}");
        assert_eq!(body["operation"], "remove");
    }

    fn validator() -> jsonschema::Validator {
        jsonschema::options()
            .should_validate_formats(true)
            .build(&serde_json::from_str(SCHEMA).unwrap())
            .expect("the shipped schema compiles")
    }

    fn errors(validator: &jsonschema::Validator, body: &Value) -> Vec<String> {
        validator
            .iter_errors(body)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect()
    }

    #[test]
    fn what_encode_writes_satisfies_the_shipped_schema() {
        let validator = validator();
        let mut removal = upsert();
        removal.operation = Operation::Remove;
        removal.item = None;
        let mut reload = upsert();
        reload.event_id = None;
        reload.reload_generation = Some(4);
        reload.sequence = None;
        reload.item_kind = None;
        let mut begin = upsert();
        begin.epoch = 1_796_000_000_000;
        begin.change_seq = 1;
        begin.operation = Operation::SnapshotBegin;
        begin.subject = String::new();
        begin.item_kind = None;
        begin.sequence = None;
        begin.event_id = None;
        begin.snapshot = true;
        begin.item = None;
        let mut in_snapshot = upsert();
        in_snapshot.event_id = None;
        in_snapshot.snapshot = true;
        let mut end = begin.clone();
        end.operation = Operation::SnapshotEnd;
        end.change_seq = 3;
        for message in [upsert(), removal, reload, begin, in_snapshot, end] {
            assert_eq!(ChangeMessage::decode(&message.encode()).unwrap(), message);
            let body: Value = serde_json::from_slice(&message.encode()).unwrap();
            assert_eq!(errors(&validator, &body), Vec::<String>::new(), "{body}");
        }
    }

    #[test]
    fn the_schema_refuses_what_the_contract_forbids() {
        let validator = validator();
        let good: Value = serde_json::from_slice(&upsert().encode()).unwrap();
        let mut cases = Vec::new();
        let mut no_item = good.clone();
        no_item.as_object_mut().unwrap().remove("item");
        cases.push(("an upsert without item", no_item));
        let mut removal_with_item = good.clone();
        removal_with_item["operation"] = json!("remove");
        cases.push(("a removal with an item", removal_with_item));
        let mut both_causes = good.clone();
        both_causes["reload_generation"] = json!(2);
        cases.push(("both causes", both_causes));
        let mut zero = good.clone();
        zero["change_seq"] = json!(0);
        cases.push(("change_seq 0", zero));
        let mut extra = good.clone();
        extra["surprise"] = json!(true);
        cases.push(("an unknown field", extra));
        let mut v2 = good.clone();
        v2["v"] = json!(2);
        cases.push(("version 2", v2));
        let mut snapshot_and_event = good.clone();
        snapshot_and_event["snapshot"] = json!(true);
        cases.push(("a snapshot's upsert with an event", snapshot_and_event));
        let mut marker = good.clone();
        marker["operation"] = json!("snapshot_begin");
        marker.as_object_mut().unwrap().remove("item");
        marker["subject"] = json!("");
        cases.push(("a marker outside a snapshot", marker));
        let mut no_epoch = good.clone();
        no_epoch.as_object_mut().unwrap().remove("epoch");
        cases.push(("no epoch", no_epoch));
        let mut empty_subject = good;
        empty_subject["subject"] = json!("");
        cases.push(("an upsert of no subject", empty_subject));
        for (what, body) in cases {
            assert!(!validator.is_valid(&body), "{what} passed: {body}");
        }
    }

    #[test]
    fn other_versions_and_contradictions_are_refused() {
        let mut body: Value = serde_json::from_slice(&upsert().encode()).unwrap();
        body["v"] = json!(2);
        assert!(matches!(
            ChangeMessage::decode(body.to_string().as_bytes()),
            Err(DecodeError::Version(2))
        ));
        let mut both = upsert();
        both.reload_generation = Some(3);
        let mut snapshot_and_event = upsert();
        snapshot_and_event.snapshot = true;
        let mut marker = upsert();
        marker.operation = Operation::SnapshotEnd;
        marker.item = None;
        for bad in [both, snapshot_and_event, marker] {
            assert!(
                matches!(
                    ChangeMessage::decode(&bad.encode()),
                    Err(DecodeError::Inconsistent(..))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_message_sent_before_epochs_is_of_the_first() {
        let mut body: Value = serde_json::from_slice(&upsert().encode()).unwrap();
        let object = body.as_object_mut().unwrap();
        object.remove("epoch");
        object.remove("snapshot");
        let message = ChangeMessage::decode(body.to_string().as_bytes()).unwrap();
        assert_eq!((message.epoch, message.snapshot), (FIRST_EPOCH, false));
    }

    fn saved() -> StoryMessage {
        StoryMessage {
            v: 1,
            kind: StoryKind::Story,
            tenant_id: Uuid::from_u128(1),
            webhook_endpoint_id: Uuid::from_u128(2),
            epoch: 1,
            change_seq: 9,
            operation: StoryOperation::Saved,
            story_id: "st_7101".into(),
            ticker: Some("ALFA B".into()),
            version: 3,
            story: Some(json!({"id": "st_7101", "ticker": "ALFA B", "version": 3,
                               "headline": "h", "articles": [{"id": "ar_1", "story_id": "st_7101"}]})),
            merged_into: None,
            event_id: Some("evt_5c1b0a2f9d7e4c3a".into()),
            reload_round: None,
            snapshot: false,
            changed_at: OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap(),
        }
    }

    /// One story message of each operation and cause, each consistent.
    fn story_messages() -> Vec<StoryMessage> {
        let mut reloaded = saved();
        reloaded.event_id = None;
        reloaded.reload_round = Some(4);
        let mut merged = saved();
        merged.operation = StoryOperation::Closed;
        merged.story = None;
        merged.version = 5;
        merged.merged_into = Some("st_7102".into());
        let mut gone = merged.clone();
        gone.merged_into = None;
        gone.version = 0;
        gone.ticker = None;
        gone.event_id = None;
        gone.reload_round = Some(2);
        let mut dropped = saved();
        dropped.operation = StoryOperation::Dropped;
        dropped.story = None;
        dropped.event_id = None;
        dropped.reload_round = Some(3);
        let mut notified = saved();
        notified.kind = StoryKind::Notification;
        notified.operation = StoryOperation::Notified;
        let mut in_snapshot = saved();
        in_snapshot.event_id = None;
        in_snapshot.snapshot = true;
        let mut closed_in_snapshot = gone.clone();
        closed_in_snapshot.reload_round = None;
        closed_in_snapshot.snapshot = true;
        vec![
            saved(),
            reloaded,
            merged,
            gone,
            dropped,
            notified,
            in_snapshot,
            closed_in_snapshot,
        ]
    }

    fn story_validator() -> jsonschema::Validator {
        jsonschema::options()
            .should_validate_formats(true)
            .build(&serde_json::from_str(STORY_SCHEMA).unwrap())
            .expect("the shipped story schema compiles")
    }

    #[test]
    fn a_story_message_round_trips_names_itself_and_satisfies_its_schema() {
        let validator = story_validator();
        assert_eq!(
            saved().message_id(),
            "00000000-0000-0000-0000-000000000002:1:9"
        );
        for message in story_messages() {
            assert_eq!(message.contradiction(), None, "{message:?}");
            let body = message.encode();
            assert_eq!(StoryMessage::decode(&body).unwrap(), message);
            assert_eq!(
                Delivered::decode(&body).unwrap(),
                Delivered::Story(message.clone())
            );
            let value: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(errors(&validator, &value), Vec::<String>::new(), "{value}");
            // Story and merged_into are absent, not null, where they do not belong.
            let object = value.as_object().unwrap();
            assert_eq!(object.contains_key("story"), message.operation.has_story());
            assert_eq!(
                object.contains_key("merged_into"),
                message.merged_into.is_some()
            );
            assert_eq!(value["kind"], message.kind.as_str());
            assert_eq!(value["operation"], message.operation.as_str());
        }
    }

    #[test]
    fn the_story_schema_and_decode_refuse_contradictions() {
        let validator = story_validator();
        let good: Value = serde_json::from_slice(&saved().encode()).unwrap();
        let closed: Value = serde_json::from_slice(&story_messages()[2].encode()).unwrap();
        let dropped: Value = serde_json::from_slice(&story_messages()[4].encode()).unwrap();
        let edit = |base: &Value, f: &dyn Fn(&mut serde_json::Map<String, Value>)| {
            let mut body = base.clone();
            f(body.as_object_mut().unwrap());
            body
        };
        let cases = [
            (
                "a save without its story",
                edit(&good, &|o| {
                    o.remove("story");
                }),
            ),
            (
                "a close with a story",
                edit(&closed, &|o| {
                    o.insert("story".into(), json!({"id": "st_7101"}));
                }),
            ),
            (
                "a null story on a save",
                edit(&good, &|o| {
                    o.insert("story".into(), Value::Null);
                }),
            ),
            (
                "merged_into on a save",
                edit(&good, &|o| {
                    o.insert("merged_into".into(), json!("st_2"));
                }),
            ),
            (
                "merged_into on a drop",
                edit(&dropped, &|o| {
                    o.insert("merged_into".into(), json!("st_2"));
                }),
            ),
            (
                "both causes",
                edit(&good, &|o| {
                    o.insert("reload_round".into(), json!(2));
                }),
            ),
            (
                "a snapshot's row with an event",
                edit(&good, &|o| {
                    o.insert("snapshot".into(), json!(true));
                }),
            ),
            (
                "a drop in a snapshot",
                edit(&dropped, &|o| {
                    o.insert("reload_round".into(), Value::Null);
                    o.insert("snapshot".into(), json!(true));
                }),
            ),
            (
                "no cause",
                edit(&good, &|o| {
                    o.insert("event_id".into(), Value::Null);
                }),
            ),
            (
                "a drop an event caused",
                edit(&dropped, &|o| {
                    o.insert("event_id".into(), json!("evt_1"));
                    o.insert("reload_round".into(), Value::Null);
                }),
            ),
            (
                "a notification a round caused",
                edit(&good, &|o| {
                    o.insert("kind".into(), json!("notification"));
                    o.insert("operation".into(), json!("notified"));
                    o.insert("event_id".into(), Value::Null);
                    o.insert("reload_round".into(), json!(1));
                }),
            ),
            (
                "kind story, operation notified",
                edit(&good, &|o| {
                    o.insert("operation".into(), json!("notified"));
                }),
            ),
            (
                "kind notification, operation saved",
                edit(&good, &|o| {
                    o.insert("kind".into(), json!("notification"));
                }),
            ),
            (
                "a feed operation",
                edit(&good, &|o| {
                    o.insert("operation".into(), json!("upsert"));
                }),
            ),
            (
                "change_seq 0",
                edit(&good, &|o| {
                    o.insert("change_seq".into(), json!(0));
                }),
            ),
            (
                "reload_round 0",
                edit(&dropped, &|o| {
                    o.insert("reload_round".into(), json!(0));
                }),
            ),
            (
                "a negative version",
                edit(&good, &|o| {
                    o.insert("version".into(), json!(-1));
                }),
            ),
            (
                "an empty story_id",
                edit(&closed, &|o| {
                    o.insert("story_id".into(), json!(""));
                }),
            ),
            (
                "an unknown field",
                edit(&good, &|o| {
                    o.insert("subject".into(), json!("st_7101"));
                }),
            ),
            (
                "no epoch",
                edit(&good, &|o| {
                    o.remove("epoch");
                }),
            ),
            (
                "version 2",
                edit(&good, &|o| {
                    o.insert("v".into(), json!(2));
                }),
            ),
        ];
        for (what, body) in cases {
            assert!(
                !validator.is_valid(&body),
                "the schema passed {what}: {body}"
            );
            assert!(
                Delivered::decode(body.to_string().as_bytes()).is_err(),
                "decode passed {what}: {body}"
            );
        }
        // Beyond the schema: the snapshot names the message's story.
        let other = edit(&good, &|o| {
            o.insert("story".into(), json!({"id": "st_9"}));
        });
        assert!(validator.is_valid(&other));
        assert!(matches!(
            StoryMessage::decode(other.to_string().as_bytes()),
            Err(DecodeError::Inconsistent(..))
        ));
    }

    #[test]
    fn bodies_are_told_apart_by_kind_and_a_feed_message_decodes_as_before() {
        let feed = upsert().encode();
        assert_eq!(Delivered::decode(&feed).unwrap(), Delivered::Item(upsert()));
        assert_eq!(
            Delivered::decode(&feed).unwrap().encode(),
            feed,
            "a feed message is sent and printed byte for byte as before"
        );
        // The feed's body is unchanged: the same keys in the same order, no `kind`.
        let text = String::from_utf8(feed).unwrap();
        assert!(text.starts_with(
            r#"{"v":1,"tenant_id":"00000000-0000-0000-0000-000000000001","webhook_endpoint_id":"#
        ), "{text}");
        assert!(!text.contains("\"kind\""), "{text}");
        let mut other_kind: Value = serde_json::from_slice(&saved().encode()).unwrap();
        other_kind["kind"] = json!("item");
        assert!(matches!(
            Delivered::decode(other_kind.to_string().as_bytes()),
            Err(DecodeError::Kind(kind)) if kind == "item"
        ));
        let mut v2: Value = serde_json::from_slice(&saved().encode()).unwrap();
        v2["v"] = json!(2);
        assert!(matches!(
            Delivered::decode(v2.to_string().as_bytes()),
            Err(DecodeError::Version(2))
        ));
        // A story body is no feed message, nor a feed body a story message.
        assert!(ChangeMessage::decode(&saved().encode()).is_err());
        assert!(StoryMessage::decode(&upsert().encode()).is_err());
    }

    #[test]
    fn the_outbound_message_is_sent_with_its_operation_as_type() {
        let raw = |m: &StoryMessage| -> StoryMessage<Box<RawValue>> {
            serde_json::from_slice(&m.encode()).unwrap()
        };
        for message in story_messages() {
            let outbound = Outbound::Story(raw(&message));
            assert_eq!(outbound.amqp_type(), message.operation.as_str());
            assert_eq!(outbound.message_id(), message.message_id());
            assert_eq!(outbound.encode(), message.encode());
            assert_eq!(
                (outbound.endpoint(), outbound.change_seq()),
                (message.webhook_endpoint_id, message.change_seq)
            );
        }
        let feed: ChangeMessage<Box<RawValue>> =
            serde_json::from_slice(&upsert().encode()).unwrap();
        let outbound = Outbound::Item(feed);
        assert_eq!(outbound.amqp_type(), "upsert");
        assert_eq!(outbound.encode(), upsert().encode());
    }
}
