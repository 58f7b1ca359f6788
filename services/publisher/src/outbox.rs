//! The publisher's Postgres queries: which tenants and endpoints have unpublished changes, an
//! endpoint's next ones, marking confirmed ones published (under the tenant's fence), the backlog's size, and the
//! tenant's destination.
//!
//! Every query over the backlog reads the partial index `changes_unpublished_tenant` (only
//! unpublished rows), so its cost follows the backlog, not the history.

use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::message::{ChangeMessage, Operation, PartsDiff, VERSION};

/// One unpublished change, ready to send.
#[derive(Debug, Clone)]
pub struct OutboxChange {
    pub message: ChangeMessage,
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
}

/// The tenants that have at least one unpublished change, at most `limit`: a loose index scan,
/// one probe of the partial index per tenant.
pub async fn tenants_with_backlog(pool: &PgPool, limit: i64) -> Result<Vec<Uuid>, OutboxError> {
    let tenants = sqlx::query_scalar(
        "WITH RECURSIVE t (tenant_id) AS (
             (SELECT tenant_id FROM changes WHERE published_at IS NULL
              ORDER BY tenant_id LIMIT 1)
             UNION ALL
             SELECT (SELECT c.tenant_id FROM changes c
                     WHERE c.published_at IS NULL AND c.tenant_id > t.tenant_id
                     ORDER BY c.tenant_id LIMIT 1)
             FROM t WHERE t.tenant_id IS NOT NULL
         )
         SELECT tenant_id FROM t WHERE tenant_id IS NOT NULL LIMIT $1",
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
/// `limit`: a loose index scan, one probe of the partial index per endpoint.
pub async fn endpoints_with_backlog(
    pool: &PgPool,
    tenant: Uuid,
    limit: i64,
) -> Result<Vec<Uuid>, OutboxError> {
    let endpoints = sqlx::query_scalar(
        "WITH RECURSIVE e (endpoint_id) AS (
             (SELECT endpoint_id FROM changes
              WHERE tenant_id = $1 AND published_at IS NULL
              ORDER BY endpoint_id LIMIT 1)
             UNION ALL
             SELECT (SELECT c.endpoint_id FROM changes c
                     WHERE c.tenant_id = $1 AND c.published_at IS NULL
                       AND c.endpoint_id > e.endpoint_id
                     ORDER BY c.endpoint_id LIMIT 1)
             FROM e WHERE e.endpoint_id IS NOT NULL
         )
         SELECT endpoint_id FROM e WHERE endpoint_id IS NOT NULL LIMIT $2",
    )
    .bind(tenant)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(endpoints)
}

/// For each `(endpoint, through, room)`: the endpoint's unpublished changes after change_seq
/// `through`, in change_seq order, at most `room` of them; one probe of the partial index per
/// endpoint. Ordered by endpoint, then change_seq.
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
               AND c.published_at IS NULL AND c.change_seq > w.through
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
    let item = item
        .map(|text| serde_json::from_str(&text))
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
    /// The fence is ours; this many rows were marked (fewer than asked when some were marked
    /// already, by an earlier owner that had them confirmed too).
    Marked(u64),
    /// Another publisher claimed the tenant since we did: nothing marked. Stop publishing.
    FencedOut,
}

/// Marks the given changes of the tenant published, in one statement that first checks, under a
/// share lock on the fence row, that `token` is still the tenant's: so no new owner can claim
/// the tenant while the mark runs, and a stale owner marks nothing.
///
/// Call it only with changes the broker confirmed. Marking is what keeps a change from being
/// sent again; a confirmed change left unmarked (a crash before this) is sent again, under the
/// same message id.
pub async fn mark_published(
    pool: &PgPool,
    tenant: Uuid,
    token: i64,
    keys: &[(Uuid, i64)],
) -> Result<Marked, OutboxError> {
    let (endpoints, seqs): (Vec<Uuid>, Vec<i64>) = keys.iter().copied().unzip();
    // Each key is looked up by itself (the lateral read, kept apart from the update by `offset
    // 0`), so the plan is a point read per key whatever the statistics say. Written as a join
    // on the keys, the planner chose, on statistics taken while the backlog was small, to scan
    // every unpublished change of the tenant on each mark: seconds per mark once the backlog
    // was in the tens of thousands, which kept it growing. A row updated between the read and
    // the update (only a fenced-out owner's mark could) no longer matches its row id and stays
    // unmarked: it is sent again, which the contract allows.
    let mut tx = pool.begin().await?;
    // Not waiting for the WAL flush: a mark lost to a Postgres crash is a change sent again
    // under the same message_id, which the contract allows (it is what a publisher crash
    // between confirm and mark does too), and the flush would otherwise be most of a round.
    sqlx::query("SET LOCAL synchronous_commit = off")
        .execute(&mut *tx)
        .await?;
    let (ours, marked): (Option<bool>, i64) = sqlx::query_as(
        "WITH fence AS (
             SELECT token = $2 AS ours FROM publisher_fences WHERE tenant_id = $1 FOR SHARE
         ),
         marked AS (
             UPDATE changes c SET published_at = now()
             FROM unnest($3::uuid[], $4::int8[]) AS k (endpoint_id, change_seq)
             CROSS JOIN LATERAL (
                 SELECT x.ctid AS row_id FROM changes x
                 WHERE x.endpoint_id = k.endpoint_id AND x.change_seq = k.change_seq
                   AND x.tenant_id = $1 AND x.published_at IS NULL
                 OFFSET 0
             ) found
             WHERE c.ctid = found.row_id AND (SELECT ours FROM fence)
             RETURNING 1
         )
         SELECT (SELECT ours FROM fence), (SELECT count(*) FROM marked)",
    )
    .bind(tenant)
    .bind(token)
    .bind(&endpoints)
    .bind(&seqs)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(if ours == Some(true) {
        Marked::Marked(marked as u64)
    } else {
        Marked::FencedOut
    })
}

/// How many of the tenant's changes are unpublished, and when the oldest of them was made.
pub async fn backlog(
    pool: &PgPool,
    tenant: Uuid,
) -> Result<(i64, Option<OffsetDateTime>), OutboxError> {
    let row = sqlx::query_as(
        "SELECT count(*), min(created_at) FROM changes
         WHERE tenant_id = $1 AND published_at IS NULL",
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
