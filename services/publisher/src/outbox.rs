//! The publisher's Postgres queries: which tenants and endpoints have unpublished changes, an
//! endpoint's next ones, marking confirmed ones published (under the tenant's fence), the backlog's size, and the
//! tenant's destination.
//!
//! What is published is one number per endpoint, its publish cursor (`endpoint_publish_cursors`):
//! the publisher sends an endpoint's changes in order, one at a time, so what the broker
//! confirmed is always a prefix. An endpoint's backlog is its change counter minus its cursor;
//! its changes are read by their primary key from the cursor on.

use serde_json::value::RawValue;
use sqlx::PgPool;
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
}

#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    #[error("postgres: {0}")]
    Database(#[from] sqlx::Error),
    #[error("outbox row {0} is malformed: {1}")]
    Malformed(String, String),
    #[error("the mark did not finish: {0}")]
    Interrupted(String),
}

/// The tenants that have at least one unpublished change, at most `limit`: every endpoint's
/// change counter against its publish cursor (one row each per endpoint).
pub async fn tenants_with_backlog(pool: &PgPool, limit: i64) -> Result<Vec<Uuid>, OutboxError> {
    let tenants = sqlx::query_scalar(
        "SELECT DISTINCT k.tenant_id
         FROM endpoint_change_counters k
         LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = k.endpoint_id
         WHERE k.last > COALESCE(p.published_through, 0)
         LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(tenants)
}

type Row = (
    Uuid,
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
    OffsetDateTime,
);

/// The tenant's endpoints that have at least one unpublished change, in id order, at most
/// `limit`.
pub async fn endpoints_with_backlog(
    pool: &PgPool,
    tenant: Uuid,
    limit: i64,
) -> Result<Vec<Uuid>, OutboxError> {
    let endpoints = sqlx::query_scalar(
        "SELECT k.endpoint_id
         FROM endpoint_change_counters k
         LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = k.endpoint_id
         WHERE k.tenant_id = $1 AND k.last > COALESCE(p.published_through, 0)
         ORDER BY k.endpoint_id
         LIMIT $2",
    )
    .bind(tenant)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(endpoints)
}

/// For each `(endpoint, through, room)`: the endpoint's unpublished changes after change_seq
/// `through` (and after its publish cursor), in change_seq order, at most `room` of them; one
/// range read of the primary key per endpoint. Ordered by endpoint, then change_seq.
pub async fn next_changes(
    pool: &PgPool,
    tenant: Uuid,
    plan: &[(Uuid, i64, i64)],
) -> Result<Vec<OutboxChange>, OutboxError> {
    let mut endpoints = Vec::with_capacity(plan.len());
    let mut throughs = Vec::with_capacity(plan.len());
    let mut rooms = Vec::with_capacity(plan.len());
    for (endpoint, through, room) in plan {
        endpoints.push(*endpoint);
        throughs.push(*through);
        rooms.push(*room);
    }
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT c.endpoint_id, c.change_seq, c.operation, c.subject, c.item_kind, c.generation,
                c.sequence, c.event_id, c.reload_generation, c.item::text, c.parts_diff::text,
                c.created_at
         FROM unnest($2::uuid[], $3::int8[], $4::int8[]) AS w (endpoint_id, through, room)
         CROSS JOIN LATERAL (
             SELECT * FROM changes c
             WHERE c.tenant_id = $1 AND c.endpoint_id = w.endpoint_id
               AND c.change_seq > GREATEST(w.through, COALESCE(
                   (SELECT p.published_through FROM endpoint_publish_cursors p
                    WHERE p.endpoint_id = w.endpoint_id), 0))
             ORDER BY c.change_seq
             LIMIT w.room
         ) c
         ORDER BY c.endpoint_id, c.change_seq",
    )
    .bind(tenant)
    .bind(&endpoints)
    .bind(&throughs)
    .bind(&rooms)
    .fetch_all(pool)
    .await?;
    rows.into_iter().map(|row| to_change(tenant, row)).collect()
}

fn to_change(tenant: Uuid, row: Row) -> Result<OutboxChange, OutboxError> {
    let (
        endpoint,
        change_seq,
        operation,
        subject,
        item_kind,
        generation,
        sequence,
        event_id,
        reload_generation,
        item,
        parts_diff,
        created_at,
    ) = row;
    let id = crate::message::message_id(endpoint, change_seq);
    let bad = |what: String| OutboxError::Malformed(id.clone(), what);
    let operation =
        Operation::parse(&operation).ok_or_else(|| bad(format!("operation {operation}")))?;
    // Checked to be JSON (a scan, no tree built), then sent as it is.
    let item = item
        .map(RawValue::from_string)
        .transpose()
        .map_err(|e| bad(format!("item: {e}")))?;
    let parts_diff: PartsDiff =
        serde_json::from_str(&parts_diff).map_err(|e| bad(format!("parts_diff: {e}")))?;
    let unsigned = |v: i64| u64::try_from(v).map_err(|_| bad(format!("negative generation {v}")));
    let message = ChangeMessage {
        v: VERSION,
        tenant_id: tenant,
        webhook_endpoint_id: endpoint,
        change_seq,
        operation,
        subject,
        item_kind,
        generation: unsigned(generation)?,
        sequence,
        event_id,
        reload_generation: reload_generation.map(unsigned).transpose()?,
        item,
        parts_diff,
        changed_at: created_at,
    };
    Ok(OutboxChange {
        message,
        created_at,
    })
}

/// What [`mark_published`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marked {
    /// The fence is ours; the publish cursors moved forward over this many changes (fewer than
    /// asked when some were marked already, by an earlier owner that had them confirmed too).
    Marked(u64),
    /// Another publisher claimed the tenant since we did: nothing marked. Stop publishing.
    FencedOut,
}

/// Marks the given changes of the tenant published: each endpoint's publish cursor moves to the
/// highest change_seq given for it, in one statement that first checks, under a share lock on
/// the fence row, that `token` is still the tenant's: so no new owner can claim the tenant while
/// the mark runs, and a stale owner marks nothing. A cursor only moves forward (the statement's
/// own `where`), so a late or repeated mark changes nothing.
///
/// Call it only with changes the broker confirmed, and only once every earlier change of the
/// same endpoint was confirmed too (the publisher sends an endpoint's changes one at a time, in
/// order): the cursor says "everything up to here". Marking is what keeps a change from being
/// sent again; a confirmed change left unmarked (a crash before this) is sent again, under the
/// same message id.
pub async fn mark_published(
    pool: &PgPool,
    tenant: Uuid,
    token: i64,
    keys: &[(Uuid, i64)],
) -> Result<Marked, OutboxError> {
    let mut through: Vec<(Uuid, i64)> = keys.to_vec();
    through.sort_unstable();
    // The highest change_seq of each endpoint: sorted, so the last of each run of one endpoint.
    through.reverse();
    through.dedup_by_key(|(endpoint, _)| *endpoint);
    // Endpoint id order, the same for every mark: two marks never wait on each other crosswise.
    through.reverse();
    let (endpoints, seqs): (Vec<Uuid>, Vec<i64>) = through.into_iter().unzip();
    // One statement, so one transaction of its own and one round trip (an explicit
    // transaction took four: begin, the setting, the statement, commit).
    //
    // Not waiting for the WAL flush (`synchronous_commit` off for this transaction alone,
    // set by the statement itself): a mark lost to a Postgres crash is a change sent again
    // under the same message_id, which the contract allows (it is what a publisher crash
    // between confirm and mark does too), and the flush would otherwise be most of a round.
    //
    // A cursor is only made or moved for an endpoint of this tenant, and never past the
    // endpoint's last change (its change counter, read by key: joined as a whole, the plan read
    // every counter of the tenant on each mark). `before` reads the cursors as
    // the statement began (every part of one statement sees the same snapshot), so the count
    // is what this mark moved.
    let (ours, marked): (Option<bool>, i64) = sqlx::query_as(
        "WITH no_flush AS MATERIALIZED (
             SELECT set_config('synchronous_commit', 'off', true)
         ),
         fence AS (
             SELECT token = $2 AS ours FROM publisher_fences, no_flush
             WHERE tenant_id = $1 FOR SHARE OF publisher_fences
         ),
         moved AS (
             INSERT INTO endpoint_publish_cursors AS p
                 (endpoint_id, tenant_id, published_through, published_at)
             SELECT k.endpoint_id, $1, k.through, now()
             FROM unnest($3::uuid[], $4::int8[]) AS k (endpoint_id, through)
             CROSS JOIN LATERAL (
                 SELECT n.last FROM endpoint_change_counters n
                 WHERE n.endpoint_id = k.endpoint_id AND n.tenant_id = $1
                 OFFSET 0
             ) n
             WHERE (SELECT ours FROM fence) AND k.through <= n.last
             ON CONFLICT (endpoint_id) DO UPDATE
                 SET published_through = excluded.published_through,
                     published_at = excluded.published_at
                 WHERE p.tenant_id = excluded.tenant_id
                   AND p.published_through < excluded.published_through
             RETURNING p.endpoint_id, p.published_through
         ),
         before AS (
             SELECT endpoint_id, published_through FROM endpoint_publish_cursors
             WHERE endpoint_id = ANY($3)
         )
         SELECT (SELECT ours FROM fence),
                (SELECT COALESCE(sum(m.published_through - COALESCE(b.published_through, 0)), 0)
                 FROM moved m LEFT JOIN before b ON b.endpoint_id = m.endpoint_id)::int8",
    )
    .bind(tenant)
    .bind(token)
    .bind(&endpoints)
    .bind(&seqs)
    .fetch_one(pool)
    .await?;
    Ok(if ours == Some(true) {
        Marked::Marked(marked as u64)
    } else {
        Marked::FencedOut
    })
}

/// How many of the tenant's changes are unpublished, and when the oldest of them was made (the
/// first unpublished change of each endpoint with a backlog, read by its key).
pub async fn backlog(
    pool: &PgPool,
    tenant: Uuid,
) -> Result<(i64, Option<OffsetDateTime>), OutboxError> {
    let row = sqlx::query_as(
        "WITH behind AS (
             SELECT k.endpoint_id, k.last, COALESCE(p.published_through, 0) AS through
             FROM endpoint_change_counters k
             LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = k.endpoint_id
             WHERE k.tenant_id = $1 AND k.last > COALESCE(p.published_through, 0)
         )
         SELECT COALESCE(sum(b.last - b.through), 0)::int8,
                min((SELECT c.created_at FROM changes c
                     WHERE c.endpoint_id = b.endpoint_id AND c.change_seq = b.through + 1))
         FROM behind b",
    )
    .bind(tenant)
    .fetch_one(pool)
    .await?;
    Ok(row)
}

/// Where a tenant's changes go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// The default: a durable quorum queue `relay.tenant.<tenant_id>` on the relay's broker,
    /// declared by the publisher.
    RelayQueue,
    /// The tenant's own broker, exchange and routing key. The publisher declares nothing there.
    OwnExchange {
        amqp_url: String,
        exchange: String,
        routing_key: String,
    },
}

/// The tenant's destination (no row: the relay's queue).
pub async fn destination(pool: &PgPool, tenant: Uuid) -> Result<Destination, OutboxError> {
    type DestinationRow = (String, Option<String>, Option<String>, Option<String>);
    let row: Option<DestinationRow> = sqlx::query_as(
        "SELECT kind, amqp_url, exchange, routing_key FROM tenant_destinations
         WHERE tenant_id = $1",
    )
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    match row {
        None => Ok(Destination::RelayQueue),
        Some((kind, _, _, _)) if kind == "relay_queue" => Ok(Destination::RelayQueue),
        Some((kind, Some(amqp_url), Some(exchange), Some(routing_key)))
            if kind == "own_exchange" =>
        {
            Ok(Destination::OwnExchange {
                amqp_url,
                exchange,
                routing_key,
            })
        }
        Some((kind, ..)) => Err(OutboxError::Malformed(
            format!("tenant_destinations {tenant}"),
            format!("kind {kind} without its url, exchange and routing key"),
        )),
    }
}

/// Records why the publisher refused the tenant's destination (`None`: it was not refused, and
/// an earlier reason is cleared). Written only when it changes anything.
pub async fn record_refusal(
    pool: &PgPool,
    tenant: Uuid,
    reason: Option<&str>,
) -> Result<(), OutboxError> {
    sqlx::query(
        "UPDATE tenant_destinations
         SET refused_reason = $2, refused_at = CASE WHEN $2 IS NULL THEN NULL ELSE now() END
         WHERE tenant_id = $1 AND refused_reason IS DISTINCT FROM $2",
    )
    .bind(tenant)
    .bind(reason)
    .execute(pool)
    .await?;
    Ok(())
}
