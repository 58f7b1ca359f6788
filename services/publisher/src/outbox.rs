//! The outbox's changes as the publisher sends them: each unpublished row relay-store reads
//! ([`relay_store::changes`]) checked and made a change message by its kind (the feed's
//! [`ChangeMessage`], or a stories endpoint's [`StoryMessage`]), its item or snapshot kept as the
//! JSON text the outbox holds.

use relay_store::changes::Unpublished;
use relay_store::StoreError;
use serde_json::value::RawValue;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::message::{
    ChangeMessage, Operation, Outbound, PartsDiff, StoryKind, StoryMessage, StoryOperation, VERSION,
};

/// One unpublished change, ready to send: its item (or snapshot) is the outbox's JSON text,
/// unparsed.
#[derive(Debug, Clone)]
pub struct OutboxChange {
    pub message: Outbound,
    pub created_at: OffsetDateTime,
}

impl OutboxChange {
    pub fn key(&self) -> (Uuid, i64) {
        (self.message.endpoint(), self.message.change_seq())
    }

    /// The tenant's outbox row as a message of its kind: its operation, item (or snapshot) and
    /// parts diff checked (the item only to be JSON: a scan, no tree built, then sent as it is).
    pub(crate) fn from_row(tenant: Uuid, row: Unpublished) -> Result<Self, OutboxError> {
        let endpoint = row.endpoint.as_uuid();
        let epoch = u64::try_from(row.epoch).unwrap_or(0);
        let id = crate::message::message_id(endpoint, epoch, row.change_seq);
        let bad = |what: String| OutboxError::Malformed(id.clone(), what);
        if epoch < crate::message::FIRST_EPOCH {
            return Err(bad(format!("epoch {}", row.epoch)));
        }
        let created_at = row.created_at;
        if row.kind != "item" {
            let message = story_message(tenant, epoch, row).map_err(bad)?;
            return Ok(OutboxChange {
                message: Outbound::Story(message),
                created_at,
            });
        }
        let operation = Operation::parse(&row.operation)
            .ok_or_else(|| bad(format!("operation {}", row.operation)))?;
        let item = row
            .item
            .map(RawValue::from_string)
            .transpose()
            .map_err(|e| bad(format!("item: {e}")))?;
        let parts_diff: PartsDiff =
            serde_json::from_str(&row.parts_diff).map_err(|e| bad(format!("parts_diff: {e}")))?;
        let unsigned =
            |v: i64| u64::try_from(v).map_err(|_| bad(format!("negative generation {v}")));
        let message = ChangeMessage {
            v: VERSION,
            tenant_id: tenant,
            webhook_endpoint_id: endpoint,
            epoch,
            change_seq: row.change_seq,
            operation,
            subject: row.subject,
            item_kind: row.item_kind,
            generation: unsigned(row.generation)?,
            sequence: row.sequence,
            event_id: row.event_id,
            reload_generation: row.reload_generation.map(unsigned).transpose()?,
            snapshot: row.snapshot,
            item,
            parts_diff,
            changed_at: row.created_at,
        };
        Ok(OutboxChange {
            message: Outbound::Item(message),
            created_at,
        })
    }
}

/// A `story` or `notification` row as its message, checked as the story message's schema
/// says (bar the snapshot's content, which is only scanned to be JSON). `Err`: what is wrong.
fn story_message(
    tenant: Uuid,
    epoch: u64,
    row: Unpublished,
) -> Result<StoryMessage<Box<RawValue>>, String> {
    let kind = StoryKind::parse(&row.kind).ok_or_else(|| format!("kind {}", row.kind))?;
    let operation = StoryOperation::parse(&row.operation)
        .ok_or_else(|| format!("operation {} of kind {}", row.operation, row.kind))?;
    let version = row
        .story_version
        .ok_or_else(|| "no story_version".to_owned())?;
    let version = u64::try_from(version).map_err(|_| format!("story_version {version}"))?;
    let reload_round = row
        .reload_generation
        .map(|round| u64::try_from(round).map_err(|_| format!("round {round}")))
        .transpose()?;
    let story = row
        .item
        .map(RawValue::from_string)
        .transpose()
        .map_err(|e| format!("story: {e}"))?;
    let message = StoryMessage {
        v: VERSION,
        kind,
        tenant_id: tenant,
        webhook_endpoint_id: row.endpoint.as_uuid(),
        epoch,
        change_seq: row.change_seq,
        operation,
        story_id: row.subject,
        ticker: row.ticker,
        version,
        story,
        merged_into: row.merged_into,
        event_id: row.event_id,
        reload_round,
        snapshot: row.snapshot,
        changed_at: row.created_at,
    };
    match message.contradiction() {
        Some(why) => Err(why.to_owned()),
        None => Ok(message),
    }
}

/// A read or a mark of the outbox failed.
#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    #[error("postgres: {0}")]
    Store(#[from] StoreError),
    #[error("outbox row {0} is malformed: {1}")]
    Malformed(String, String),
    #[error("the mark did not finish: {0}")]
    Interrupted(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{Delivered, STORY_SCHEMA};
    use relay_store::EndpointId;
    use serde_json::{json, Value};

    fn row(kind: &str, operation: &str) -> Unpublished {
        Unpublished {
            endpoint: EndpointId(Uuid::from_u128(2)),
            epoch: 1,
            change_seq: 5,
            kind: kind.into(),
            operation: operation.into(),
            subject: "st_1".into(),
            item_kind: None,
            generation: 0,
            sequence: None,
            event_id: Some("evt_1".into()),
            reload_generation: None,
            snapshot: false,
            item: Some(r#"{"id": "st_1", "ticker": "ALFA B", "version": 2}"#.into()),
            parts_diff: "{}".into(),
            created_at: OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap(),
            story_version: Some(2),
            ticker: Some("ALFA B".into()),
            merged_into: None,
        }
    }

    #[test]
    fn story_rows_become_story_messages_that_satisfy_their_schema() {
        let validator = jsonschema::options()
            .should_validate_formats(true)
            .build(&serde_json::from_str(STORY_SCHEMA).unwrap())
            .unwrap();
        let mut closed = row("story", "closed");
        closed.item = None;
        closed.merged_into = Some("st_2".into());
        let mut dropped = row("story", "dropped");
        dropped.item = None;
        dropped.event_id = None;
        dropped.reload_generation = Some(3);
        let tenant = Uuid::from_u128(1);
        for (row, amqp_type) in [
            (row("story", "saved"), "saved"),
            (closed, "closed"),
            (dropped, "dropped"),
            (row("notification", "notified"), "notified"),
        ] {
            let change = OutboxChange::from_row(tenant, row).unwrap();
            assert_eq!(change.key(), (Uuid::from_u128(2), 5));
            assert_eq!(change.message.amqp_type(), amqp_type);
            let body = change.message.encode();
            let Delivered::Story(message) = Delivered::decode(&body).unwrap() else {
                panic!("not a story message");
            };
            assert_eq!(message.operation.as_str(), amqp_type);
            assert_eq!(message.version, 2);
            let value: Value = serde_json::from_slice(&body).unwrap();
            assert!(validator.is_valid(&value), "{value}");
        }
    }

    #[test]
    fn contradictory_story_rows_are_refused_as_malformed() {
        let tenant = Uuid::from_u128(1);
        let mut no_version = row("story", "saved");
        no_version.story_version = None;
        let mut wrong_kind = row("notification", "saved");
        wrong_kind.kind = "notification".into();
        let mut merged_save = row("story", "saved");
        merged_save.merged_into = Some("st_2".into());
        let mut two_causes = row("story", "saved");
        two_causes.reload_generation = Some(1);
        let mut unknown = row("ticker", "saved");
        unknown.kind = "ticker".into();
        let mut not_json = row("story", "saved");
        not_json.item = Some("{".into());
        for bad in [
            no_version,
            wrong_kind,
            merged_save,
            two_causes,
            unknown,
            not_json,
        ] {
            let what = format!("{bad:?}");
            assert!(
                matches!(
                    OutboxChange::from_row(tenant, bad),
                    Err(OutboxError::Malformed(..))
                ),
                "{what}"
            );
        }
    }

    #[test]
    fn a_feed_row_is_sent_as_before() {
        let mut upsert = row("item", "upsert");
        upsert.subject = "announcement:1".into();
        upsert.item_kind = Some("announcement".into());
        upsert.generation = 3;
        upsert.sequence = Some("3.1".into());
        upsert.item = Some(r#"{"feed_item_id": "announcement:1"}"#.into());
        upsert.parts_diff = r#"{"added": ["flash:1"], "changed": [], "removed": []}"#.into();
        upsert.story_version = None;
        upsert.ticker = None;
        let change = OutboxChange::from_row(Uuid::from_u128(1), upsert).unwrap();
        assert_eq!(change.message.amqp_type(), "upsert");
        let body: Value = serde_json::from_slice(&change.message.encode()).unwrap();
        assert_eq!(
            body,
            json!({"v": 1, "tenant_id": "00000000-0000-0000-0000-000000000001",
                   "webhook_endpoint_id": "00000000-0000-0000-0000-000000000002", "epoch": 1,
                   "change_seq": 5, "operation": "upsert", "subject": "announcement:1",
                   "item_kind": "announcement", "generation": 3, "sequence": "3.1",
                   "event_id": "evt_1", "reload_generation": null, "snapshot": false,
                   "item": {"feed_item_id": "announcement:1"},
                   "parts_diff": {"added": ["flash:1"], "changed": [], "removed": []},
                   "changed_at": "2027-01-15T08:00:00Z"})
        );
    }
}
