//! Stored webhook messages.
//!
//! The front tier writes messages in batches: many requests' messages go into one transaction,
//! because one commit per message cannot keep up with the upstream on a small machine. Every
//! decision (is this webhook-id new? is the endpoint active? which arrival number?) is taken by
//! the statements themselves, so any number of front-tier replicas can write at once.

use std::collections::HashMap;

use bytes::Bytes;
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::StoreError;

/// A verified message, ready to store.
#[derive(Debug, Clone)]
pub struct IncomingMessage {
    pub endpoint_id: Uuid,
    pub tenant_id: Uuid,
    pub webhook_id: String,
    /// The webhook-timestamp header.
    pub signed_at: OffsetDateTime,
    /// The quanor-webhook-attempt header, when present and a number (it is not signed).
    pub attempt: Option<i32>,
    /// When the relay began receiving it.
    pub received_at: OffsetDateTime,
    pub track: Option<String>,
    pub generation: Option<i64>,
    /// The raw body bytes, exactly as received.
    pub body: Bytes,
}

/// What happened to one message of a batch. Only meaningful once the batch committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOutcome {
    /// Newly stored, with its arrival number (increasing per endpoint, in commit order).
    Stored { arrival_seq: i64 },
    /// A message with this webhook-id was stored for this endpoint before.
    Duplicate,
    /// The endpoint was paused after the message was verified; nothing stored.
    EndpointPaused,
    /// The endpoint no longer exists; nothing stored.
    EndpointUnknown,
}

/// Stores a batch in one transaction and says, for each message in order, what happened.
///
/// Arrival numbers come from each endpoint's counter row, locked in endpoint order (so two
/// batches never deadlock) and advanced in the same transaction; within a batch, an endpoint's
/// messages are numbered in the order given. A webhook-id repeated within the batch is a
/// duplicate of its first occurrence.
pub async fn store_batch(
    pool: &PgPool,
    batch: &[IncomingMessage],
) -> Result<Vec<StoreOutcome>, StoreError> {
    // First occurrence of each (endpoint, webhook-id) in the batch; later ones point to it.
    let mut first_of: HashMap<(Uuid, &str), usize> = HashMap::with_capacity(batch.len());
    let mut unique: Vec<usize> = Vec::with_capacity(batch.len());
    let mut repeat_of: Vec<Option<usize>> = Vec::with_capacity(batch.len());
    for (i, m) in batch.iter().enumerate() {
        match first_of.entry((m.endpoint_id, m.webhook_id.as_str())) {
            std::collections::hash_map::Entry::Occupied(first) => {
                repeat_of.push(Some(*first.get()))
            }
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(i);
                unique.push(i);
                repeat_of.push(None);
            }
        }
    }

    let mut endpoint_ids: Vec<Uuid> = unique.iter().map(|&i| batch[i].endpoint_id).collect();
    endpoint_ids.sort_unstable();
    endpoint_ids.dedup();

    let mut tx = pool.begin().await?;
    // Take the counter locks in one fixed order before the insert takes them in whatever order
    // its plan visits rows: concurrent batches then queue instead of deadlocking.
    sqlx::query(
        "SELECT endpoint_id FROM endpoint_arrival_counters
         WHERE endpoint_id = ANY($1) ORDER BY endpoint_id FOR NO KEY UPDATE",
    )
    .bind(&endpoint_ids)
    .execute(&mut *tx)
    .await?;

    let rows: Vec<(Uuid, String, i64)> = sqlx::query_as(
        "WITH batch AS (
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::timestamptz[],
                                  $5::int4[], $6::timestamptz[], $7::text[], $8::int8[],
                                  $9::bytea[])
                 WITH ORDINALITY
                 AS b(endpoint_id, tenant_id, webhook_id, signed_at, attempt, received_at,
                      track, generation, body, ord)
         ),
         reserved AS (
             UPDATE endpoint_arrival_counters c
             SET last_arrival_seq = c.last_arrival_seq + n.count
             FROM (SELECT endpoint_id, count(*) AS count FROM batch GROUP BY endpoint_id) n,
                  webhook_endpoints e
             WHERE c.endpoint_id = n.endpoint_id
               AND e.id = c.endpoint_id AND e.status = 'active'
             RETURNING c.endpoint_id, c.last_arrival_seq - n.count AS base
         )
         INSERT INTO messages (endpoint_id, arrival_seq, tenant_id, webhook_id, signed_at,
                               attempt, received_at, track, generation, body)
         SELECT b.endpoint_id,
                r.base + row_number() OVER (PARTITION BY b.endpoint_id ORDER BY b.ord),
                b.tenant_id, b.webhook_id, b.signed_at, b.attempt, b.received_at, b.track,
                b.generation, b.body
         FROM batch b JOIN reserved r USING (endpoint_id)
         ORDER BY b.ord
         ON CONFLICT (endpoint_id, webhook_id) DO NOTHING
         RETURNING endpoint_id, webhook_id, arrival_seq",
    )
    .bind(
        unique
            .iter()
            .map(|&i| batch[i].endpoint_id)
            .collect::<Vec<_>>(),
    )
    .bind(
        unique
            .iter()
            .map(|&i| batch[i].tenant_id)
            .collect::<Vec<_>>(),
    )
    .bind(
        unique
            .iter()
            .map(|&i| batch[i].webhook_id.as_str())
            .collect::<Vec<_>>(),
    )
    .bind(
        unique
            .iter()
            .map(|&i| batch[i].signed_at)
            .collect::<Vec<_>>(),
    )
    .bind(unique.iter().map(|&i| batch[i].attempt).collect::<Vec<_>>())
    .bind(
        unique
            .iter()
            .map(|&i| batch[i].received_at)
            .collect::<Vec<_>>(),
    )
    .bind(
        unique
            .iter()
            .map(|&i| batch[i].track.as_deref())
            .collect::<Vec<_>>(),
    )
    .bind(
        unique
            .iter()
            .map(|&i| batch[i].generation)
            .collect::<Vec<_>>(),
    )
    .bind(
        unique
            .iter()
            .map(|&i| &batch[i].body[..])
            .collect::<Vec<&[u8]>>(),
    )
    .fetch_all(&mut *tx)
    .await?;

    let mut stored: HashMap<(Uuid, String), i64> = rows
        .into_iter()
        .map(|(endpoint, webhook_id, seq)| ((endpoint, webhook_id), seq))
        .collect();

    // Whatever was not inserted is a duplicate, or its endpoint was paused or removed since it
    // was verified. Ask which, inside the same transaction (rare: one extra query per batch).
    let missing: Vec<usize> = unique
        .iter()
        .copied()
        .filter(|&i| !stored.contains_key(&(batch[i].endpoint_id, batch[i].webhook_id.clone())))
        .collect();
    let mut not_inserted: HashMap<(Uuid, String), StoreOutcome> = HashMap::new();
    if !missing.is_empty() {
        let rows: Vec<(Uuid, String, bool, Option<String>)> = sqlx::query_as(
            "SELECT b.endpoint_id, b.webhook_id, m.arrival_seq IS NOT NULL, e.status
             FROM unnest($1::uuid[], $2::text[]) AS b(endpoint_id, webhook_id)
             LEFT JOIN messages m
               ON m.endpoint_id = b.endpoint_id AND m.webhook_id = b.webhook_id
             LEFT JOIN webhook_endpoints e ON e.id = b.endpoint_id",
        )
        .bind(
            missing
                .iter()
                .map(|&i| batch[i].endpoint_id)
                .collect::<Vec<_>>(),
        )
        .bind(
            missing
                .iter()
                .map(|&i| batch[i].webhook_id.as_str())
                .collect::<Vec<_>>(),
        )
        .fetch_all(&mut *tx)
        .await?;
        for (endpoint, webhook_id, already_stored, status) in rows {
            let outcome = match (already_stored, status.as_deref()) {
                (true, _) => StoreOutcome::Duplicate,
                (false, Some("paused")) => StoreOutcome::EndpointPaused,
                (false, Some(_)) => {
                    // Active, yet neither inserted nor stored: cannot happen while the counter
                    // row exists. Refuse rather than claim it was stored.
                    return Err(StoreError::Invalid(format!(
                        "message {webhook_id} for endpoint {endpoint} was neither stored nor a duplicate"
                    )));
                }
                (false, None) => StoreOutcome::EndpointUnknown,
            };
            not_inserted.insert((endpoint, webhook_id), outcome);
        }
    }
    tx.commit().await?;

    let mut outcomes = Vec::with_capacity(batch.len());
    for (i, m) in batch.iter().enumerate() {
        let key = (m.endpoint_id, m.webhook_id.clone());
        let outcome = match repeat_of[i] {
            // A repeat within the batch: a duplicate if its first occurrence was stored or was
            // itself a duplicate; otherwise it shares the first occurrence's refusal.
            Some(_) => match not_inserted.get(&key) {
                Some(StoreOutcome::EndpointPaused) => StoreOutcome::EndpointPaused,
                Some(StoreOutcome::EndpointUnknown) => StoreOutcome::EndpointUnknown,
                _ => StoreOutcome::Duplicate,
            },
            None => match stored.remove(&key) {
                Some(arrival_seq) => StoreOutcome::Stored { arrival_seq },
                None => not_inserted
                    .get(&key)
                    .copied()
                    .unwrap_or(StoreOutcome::EndpointUnknown),
            },
        };
        outcomes.push(outcome);
    }
    Ok(outcomes)
}

/// A stored message as support and tests read it back.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredMessage {
    pub endpoint_id: Uuid,
    pub arrival_seq: i64,
    pub tenant_id: Uuid,
    pub webhook_id: String,
    pub signed_at: OffsetDateTime,
    pub attempt: Option<i32>,
    pub received_at: OffsetDateTime,
    pub track: Option<String>,
    pub generation: Option<i64>,
    pub body: Vec<u8>,
}

/// An endpoint's stored messages in arrival order.
pub async fn list_for_endpoint(
    pool: &PgPool,
    endpoint_id: Uuid,
) -> Result<Vec<StoredMessage>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT endpoint_id, arrival_seq, tenant_id, webhook_id, signed_at, attempt,
                received_at, track, generation, body
         FROM messages WHERE endpoint_id = $1 ORDER BY arrival_seq",
    )
    .bind(endpoint_id)
    .fetch_all(pool)
    .await?)
}
