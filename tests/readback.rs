//! What the store wrote, read back as tests check it: an endpoint's copy as relay-rules' `Held`
//! rows, and its outbox, each change with its item and parts diff parsed and whether the
//! publisher has passed it.

use std::collections::BTreeMap;

use relay_rules::{Held, HeldContent, PartsDiff};
use relay_wire::{PartRef, Sequence};
use serde_json::Value;
use uuid::Uuid;

type HeldRow = (String, i64, String, bool, String, Option<String>);

/// Every row of the endpoint's copy, items and tombstones, by subject.
pub async fn copy_rows<'e>(
    db: impl sqlx::PgExecutor<'e>,
    endpoint: Uuid,
) -> Result<BTreeMap<String, Held>, sqlx::Error> {
    let rows: Vec<HeldRow> = sqlx::query_as(
        "SELECT subject, generation, sequence, tombstone, parts::text, item::text
         FROM copy_items WHERE endpoint_id = $1 ORDER BY subject",
    )
    .bind(endpoint)
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(held_of).collect())
}

fn held_of((subject, generation, sequence, tombstone, parts, item): HeldRow) -> (String, Held) {
    let content = if tombstone {
        HeldContent::Tombstone
    } else {
        let parts: Value = serde_json::from_str(&parts).expect("stored parts");
        HeldContent::Item {
            parts: parts
                .as_array()
                .expect("parts are an array")
                .iter()
                .map(|p| PartRef {
                    part_id: p["part_id"].as_str().expect("a part id").to_owned(),
                    part_version: p["part_version"].as_i64().expect("a part version"),
                })
                .collect(),
            item: serde_json::from_str(&item.expect("an item row has its item")).expect("an item"),
        }
    };
    let held = Held {
        generation: u64::try_from(generation).expect("a generation"),
        sequence: Sequence::new(sequence),
        content,
    };
    (subject, held)
}

/// One row of the outbox.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub change_seq: i64,
    pub operation: Operation,
    pub subject: String,
    pub item_kind: Option<String>,
    pub generation: u64,
    /// Null for the removals of a reload's drop.
    pub sequence: Option<Sequence>,
    pub event_id: Option<String>,
    pub reload_generation: Option<u64>,
    /// The item stored, on upsert.
    pub item: Option<Value>,
    pub parts_diff: PartsDiff,
    pub published: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Upsert,
    Remove,
}

type Row = (
    i64,
    String,
    String,
    Option<String>,
    i64,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<String>,
    String,
    bool,
);

/// The endpoint's changes in `change_seq` order.
pub async fn list_changes<'e>(
    db: impl sqlx::PgExecutor<'e>,
    endpoint: Uuid,
) -> Result<Vec<Change>, sqlx::Error> {
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT c.change_seq, c.operation, c.subject, c.item_kind, c.generation, c.sequence,
                c.event_id, c.reload_generation, c.item::text, c.parts_diff::text,
                c.change_seq <= COALESCE(p.published_through, 0)
         FROM changes c
         LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = c.endpoint_id
         WHERE c.endpoint_id = $1 ORDER BY c.change_seq",
    )
    .bind(endpoint)
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(change_of).collect())
}

fn change_of(
    (seq, op, subject, item_kind, generation, sequence, event_id, reload, item, diff, published): Row,
) -> Change {
    let json = |text: &str| -> Value { serde_json::from_str(text).expect("stored JSON") };
    let diff = json(&diff);
    let list = |key: &str| -> Vec<String> {
        diff[key]
            .as_array()
            .unwrap_or_else(|| panic!("parts diff {diff} has no {key}"))
            .iter()
            .map(|v| v.as_str().expect("a part id").to_owned())
            .collect()
    };
    Change {
        change_seq: seq,
        operation: match op.as_str() {
            "upsert" => Operation::Upsert,
            "remove" => Operation::Remove,
            other => panic!("change operation {other}"),
        },
        subject,
        item_kind,
        generation: u64::try_from(generation).expect("a generation"),
        sequence: sequence.map(Sequence::new),
        event_id,
        reload_generation: reload.map(|g| u64::try_from(g).expect("a generation")),
        item: item.map(|t| json(&t)),
        parts_diff: PartsDiff {
            added: list("added"),
            changed: list("changed"),
            removed: list("removed"),
        },
        published,
    }
}

/// How each of the endpoint's stored messages was applied, in arrival order, read through the
/// store's own listing (as the control plane reads it): `(arrival_seq, outcome, events applied,
/// events ignored)`, the outcome `None` while a message waits.
pub async fn message_outcomes(
    pool: &sqlx::PgPool,
    endpoint: Uuid,
) -> Result<Vec<(i64, Option<String>, Option<i32>, Option<i32>)>, relay_store::StoreError> {
    let tenant: Uuid = sqlx::query_scalar("SELECT tenant_id FROM webhook_endpoints WHERE id = $1")
        .bind(endpoint)
        .fetch_one(pool)
        .await?;
    let query = relay_store::messages::MessageQuery {
        newest_first: false,
        cursor: None,
        limit: i64::MAX,
        include_body: false,
        status: None,
        duplicated: false,
        received_from: None,
        received_before: None,
        contains: None,
    };
    let (listed, _) = relay_store::messages::list_with_outcomes(
        pool,
        relay_store::TenantId(tenant),
        relay_store::EndpointId(endpoint),
        &query,
    )
    .await?;
    Ok(listed
        .into_iter()
        .map(|m| (m.arrival_seq, m.outcome, m.events_applied, m.events_ignored))
        .collect())
}
