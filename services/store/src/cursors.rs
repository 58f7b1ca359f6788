//! Each endpoint's apply cursor over its stored messages (`endpoint_apply_cursors`), the reads
//! of what lies past it, and the backlog of its outbox (its change counter against its publish
//! cursor).

use sqlx::{PgConnection, PgPool};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::{EndpointId, StoreError, TenantId};

/// How far the endpoint's messages are applied (0: none yet).
pub async fn applied_through<'e>(
    db: impl sqlx::PgExecutor<'e>,
    endpoint: EndpointId,
) -> Result<i64, StoreError> {
    let applied: Option<i64> = sqlx::query_scalar(
        "SELECT applied_arrival_seq FROM endpoint_apply_cursors WHERE endpoint_id = $1",
    )
    .bind(endpoint)
    .fetch_optional(db)
    .await?;
    Ok(applied.unwrap_or(0))
}

/// Moves the apply cursor from `from` to `to`, only if it is still at `from`: the statement
/// itself decides that this transaction is the one applying those messages. `false` means
/// someone else applied them (roll back). A cursor with no row yet is at 0, which is what
/// [`applied_through`] reads for it, so the first insert needs no condition.
pub async fn advance_cursor(
    conn: &mut PgConnection,
    tenant: TenantId,
    endpoint: EndpointId,
    from: i64,
    to: i64,
    last_received_at: Option<OffsetDateTime>,
) -> Result<bool, StoreError> {
    let advanced = sqlx::query(
        "INSERT INTO endpoint_apply_cursors AS c (endpoint_id, tenant_id, applied_arrival_seq,
             last_received_at, last_applied_at)
         VALUES ($1, $2, $4, $5, now())
         ON CONFLICT (endpoint_id) DO UPDATE
         SET applied_arrival_seq = excluded.applied_arrival_seq,
             last_received_at = coalesce(excluded.last_received_at, c.last_received_at),
             last_applied_at = now()
         WHERE c.applied_arrival_seq = $3",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(from)
    .bind(to)
    .bind(last_received_at)
    .execute(conn)
    .await?
    .rows_affected();
    Ok(advanced == 1)
}

/// One stored message, as the sequencer reads it.
#[derive(Debug, Clone)]
pub struct PendingMessage {
    pub arrival_seq: i64,
    pub received_at: OffsetDateTime,
    pub body: Vec<u8>,
}

/// The endpoint's messages after `applied`, in arrival order, at most `limit`, and the arrival
/// counter they were read under. Numbers are taken in commit order, so every message numbered
/// at or below the counter has committed; duplicates leave gaps, which the caller skips by
/// moving the cursor to the counter when nothing is left below it.
pub async fn pending_messages(
    pool: &PgPool,
    endpoint: EndpointId,
    applied: i64,
    limit: i64,
) -> Result<(i64, Vec<PendingMessage>), StoreError> {
    // One statement, so one snapshot: the counter bounds exactly what the message read sees.
    // No messages: one row with the counter and nulls.
    type Row = (i64, Option<i64>, Option<OffsetDateTime>, Option<Vec<u8>>);
    let rows: Vec<Row> = sqlx::query_as(
        "WITH counter AS (
             SELECT coalesce((SELECT last_arrival_seq FROM endpoint_arrival_counters
                              WHERE endpoint_id = $1), 0) AS last
         )
         SELECT counter.last, m.arrival_seq, m.received_at, m.body
         FROM counter LEFT JOIN LATERAL (
             SELECT arrival_seq, received_at, body FROM messages
             WHERE endpoint_id = $1 AND arrival_seq > $2 AND arrival_seq <= counter.last
             ORDER BY arrival_seq LIMIT $3
         ) m ON true
         ORDER BY m.arrival_seq",
    )
    .bind(endpoint)
    .bind(applied)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    let counter = rows.first().map_or(0, |row| row.0);
    let pending = rows
        .into_iter()
        .filter_map(|(_, arrival_seq, received_at, body)| {
            Some(PendingMessage {
                arrival_seq: arrival_seq?,
                received_at: received_at?,
                body: body?,
            })
        })
        .collect();
    Ok((counter, pending))
}

/// [`pending_messages`] for several endpoints in one statement: for each (endpoint, cursor),
/// its arrival counter and its messages after the cursor up to the counter, at most `limit`
/// each. One statement, so one snapshot: each counter bounds exactly what its read sees.
pub async fn pending_messages_many(
    conn: &mut PgConnection,
    cursors: &[(Uuid, i64)],
    limit: i64,
) -> Result<std::collections::HashMap<Uuid, (i64, Vec<PendingMessage>)>, StoreError> {
    type Row = (
        Uuid,
        i64,
        Option<i64>,
        Option<OffsetDateTime>,
        Option<Vec<u8>>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT i.endpoint_id, counter.last, m.arrival_seq, m.received_at, m.body
         FROM unnest($1::uuid[], $2::int8[]) AS i(endpoint_id, applied)
         CROSS JOIN LATERAL (
             SELECT coalesce((SELECT last_arrival_seq FROM endpoint_arrival_counters
                              WHERE endpoint_id = i.endpoint_id), 0) AS last
         ) counter
         LEFT JOIN LATERAL (
             SELECT arrival_seq, received_at, body FROM messages
             WHERE endpoint_id = i.endpoint_id AND arrival_seq > i.applied
               AND arrival_seq <= counter.last
             ORDER BY arrival_seq LIMIT $3
         ) m ON true
         ORDER BY i.endpoint_id, m.arrival_seq",
    )
    .bind(cursors.iter().map(|c| c.0).collect::<Vec<_>>())
    .bind(cursors.iter().map(|c| c.1).collect::<Vec<_>>())
    .bind(limit)
    .fetch_all(conn)
    .await?;
    let mut found: std::collections::HashMap<Uuid, (i64, Vec<PendingMessage>)> =
        std::collections::HashMap::with_capacity(cursors.len());
    for (endpoint, counter, arrival_seq, received_at, body) in rows {
        let entry = found
            .entry(endpoint)
            .or_insert_with(|| (counter, Vec::new()));
        if let (Some(arrival_seq), Some(received_at), Some(body)) = (arrival_seq, received_at, body)
        {
            entry.1.push(PendingMessage {
                arrival_seq,
                received_at,
                body,
            });
        }
    }
    Ok(found)
}

/// Endpoints with work (`only`: of that endpoint alone): messages stored past their cursor, or
/// a reload begun and not merged. The periodic sweep's query (the Redis wake-up is only the
/// fast path), and the check after a registration change.
pub async fn endpoints_with_work(
    pool: &PgPool,
    only: Option<Uuid>,
    limit: i64,
) -> Result<Vec<Uuid>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT a.endpoint_id FROM endpoint_arrival_counters a
         LEFT JOIN endpoint_apply_cursors c ON c.endpoint_id = a.endpoint_id
         WHERE a.last_arrival_seq > coalesce(c.applied_arrival_seq, 0)
           AND ($2::uuid IS NULL OR a.endpoint_id = $2)
           -- An endpoint being deleted has no more work: its rows are being purged.
           AND NOT EXISTS (SELECT 1 FROM webhook_endpoints e
                           WHERE e.id = a.endpoint_id AND e.status = 'deleting')
         UNION
         -- A reload without upstream settings waits for them with no worker: the registration
         -- change that gives them wakes the endpoint.
         SELECT t.endpoint_id FROM endpoint_tracks t
         JOIN webhook_endpoints e ON e.id = t.endpoint_id
         WHERE t.reload IS NOT NULL AND e.status <> 'deleting'
           AND e.upstream_base_url IS NOT NULL AND e.upstream_api_key_sealed IS NOT NULL
           AND ($2::uuid IS NULL OR t.endpoint_id = $2)
         LIMIT $1",
    )
    .bind(limit)
    .bind(only)
    .fetch_all(pool)
    .await?)
}

/// How far the endpoint's stored messages are applied, as its state shows it.
#[derive(Debug, Clone)]
pub struct ApplyProgress {
    /// The arrival number of the last message stored.
    pub last_arrival_seq: i64,
    pub applied_arrival_seq: i64,
    /// Stored messages above the cursor.
    pub waiting: i64,
    pub oldest_waiting_received_at: Option<OffsetDateTime>,
    pub last_received_at: Option<OffsetDateTime>,
    pub last_applied_at: Option<OffsetDateTime>,
    /// Seconds the oldest waiting message has waited, by the database's clock; 0 when none.
    pub lag_s: f64,
}

/// The tenant's endpoint's apply progress. The messages above the cursor are counted, not the
/// numbers subtracted: a number taken by a batch whose message turned out a duplicate leaves a
/// gap in arrival_seq.
pub async fn progress<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<ApplyProgress, StoreError> {
    type Row = (
        i64,
        i64,
        i64,
        Option<OffsetDateTime>,
        Option<OffsetDateTime>,
        Option<OffsetDateTime>,
        f64,
    );
    let (last_arrival_seq, applied, waiting, oldest, last_received, last_applied, lag): Row =
        sqlx::query_as(
            "WITH cursor AS (
                 SELECT COALESCE((SELECT applied_arrival_seq FROM endpoint_apply_cursors
                                  WHERE endpoint_id = $1 AND tenant_id = $2), 0) AS applied
             ),
             waiting AS (
                 SELECT count(*) AS n, min(received_at) AS oldest FROM messages, cursor
                 WHERE endpoint_id = $1 AND tenant_id = $2 AND arrival_seq > cursor.applied
             )
             SELECT COALESCE((SELECT last_arrival_seq FROM endpoint_arrival_counters
                              WHERE endpoint_id = $1), 0),
                    cursor.applied, waiting.n, waiting.oldest,
                    (SELECT last_received_at FROM endpoint_apply_cursors
                     WHERE endpoint_id = $1 AND tenant_id = $2),
                    (SELECT last_applied_at FROM endpoint_apply_cursors
                     WHERE endpoint_id = $1 AND tenant_id = $2),
                    COALESCE(EXTRACT(EPOCH FROM now() - waiting.oldest)::float8, 0)
             FROM cursor, waiting",
        )
        .bind(endpoint)
        .bind(tenant)
        .fetch_one(db)
        .await?;
    Ok(ApplyProgress {
        last_arrival_seq,
        applied_arrival_seq: applied,
        waiting,
        oldest_waiting_received_at: oldest,
        last_received_at: last_received,
        last_applied_at: last_applied,
        lag_s: lag,
    })
}

/// The tenant's endpoint's outbox: how many changes are not yet published, and the stream's
/// epoch and the number of its last change appended.
pub async fn outbox_backlog<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<OutboxPosition, StoreError> {
    let (backlog, epoch, last_change_seq) = sqlx::query_as(
        "WITH counter AS (
             SELECT COALESCE(k.last, 0) AS last, COALESCE(k.epoch, 1) AS epoch
             FROM (SELECT 1) AS one
             LEFT JOIN endpoint_change_counters k ON k.endpoint_id = $1 AND k.tenant_id = $2
         )
         SELECT GREATEST(counter.last - COALESCE((SELECT published_through
                                                  FROM endpoint_publish_cursors
                                                  WHERE endpoint_id = $1 AND tenant_id = $2), 0),
                         0),
                counter.epoch, counter.last
         FROM counter",
    )
    .bind(endpoint)
    .bind(tenant)
    .fetch_one(db)
    .await?;
    Ok(OutboxPosition {
        backlog,
        epoch,
        last_change_seq,
    })
}

/// See [`outbox_backlog`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboxPosition {
    /// Changes not yet published.
    pub backlog: i64,
    /// The change stream's epoch (1 until a restore begins another).
    pub epoch: i64,
    /// The last change appended in it (0: none yet).
    pub last_change_seq: i64,
}
