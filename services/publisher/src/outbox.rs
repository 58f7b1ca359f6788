//! The outbox's changes as the publisher sends them: each unpublished row relay-store reads
//! ([`relay_store::changes`]) checked and made a change message, its item kept as the JSON text
//! the outbox holds.

use relay_store::changes::Unpublished;
use relay_store::StoreError;
use serde_json::value::RawValue;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::message::{ChangeMessage, Operation, PartsDiff, VERSION};

/// One unpublished change, ready to send: its item is the outbox's JSON text, unparsed.
#[derive(Debug, Clone)]
pub struct OutboxChange {
    pub message: ChangeMessage<Box<RawValue>>,
    pub created_at: OffsetDateTime,
}

impl OutboxChange {
    pub fn key(&self) -> (Uuid, i64) {
        (self.message.webhook_endpoint_id, self.message.change_seq)
    }

    /// The tenant's outbox row as a message: its operation, item and parts diff checked (the
    /// item only to be JSON: a scan, no tree built, then sent as it is).
    pub(crate) fn from_row(tenant: Uuid, row: Unpublished) -> Result<Self, OutboxError> {
        let endpoint = row.endpoint.as_uuid();
        let epoch = u64::try_from(row.epoch).unwrap_or(0);
        let id = crate::message::message_id(endpoint, epoch, row.change_seq);
        let bad = |what: String| OutboxError::Malformed(id.clone(), what);
        if epoch < crate::message::FIRST_EPOCH {
            return Err(bad(format!("epoch {}", row.epoch)));
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
            message,
            created_at: row.created_at,
        })
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
