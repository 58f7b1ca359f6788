//! The change message, version 1: what a tenant's destination receives for each row of the
//! outbox. Documented for users in `docs/change-message.v1.schema.json` (the JSON body, [`SCHEMA`])
//! and `docs/asyncapi.yaml` (the queues and the AMQP properties).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use time::OffsetDateTime;
use uuid::Uuid;

/// The JSON Schema of the message body, as shipped in `docs/`.
pub const SCHEMA: &str = include_str!("../../../docs/change-message.v1.schema.json");

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
/// or the JSON text itself ([`RawValue`](serde_json::value::RawValue)) for the publisher, which sends the item as the
/// outbox holds it rather than parsing it only to write it out again.
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
}
