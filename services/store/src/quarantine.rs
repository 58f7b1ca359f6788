//! Stored messages the sequencer set aside because they can never be applied (migration
//! `..._quarantine.sql`): recorded by the sequencer in the transaction that moves the apply
//! cursor past them and begins the reload that replaces them; listed, retried and discarded by
//! the control plane for their tenant.
//!
//! A quarantined message keeps its `messages` row (its body, its webhook-id): the upstream sent
//! it and the relay answered 2xx for it, so it is never deleted here.

use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::{EndpointId, StoreError, TenantId};

/// The most characters of a reason kept (a parse error can quote a long value).
pub const REASON_MAX_CHARS: usize = 1000;

/// A reason as it is kept: NUL, which a Postgres text value cannot hold, replaced by U+FFFD, and
/// at most [`REASON_MAX_CHARS`] characters.
pub fn reason_text(reason: &str) -> String {
    reason
        .chars()
        .take(REASON_MAX_CHARS)
        .map(|c| if c == '\0' { '\u{FFFD}' } else { c })
        .collect()
}

/// The CTE `quarantined` (for a statement's `WITH`): records the messages set aside, from five
/// arrays from `$first` on: endpoint, tenant, arrival_seq, reason (through [`reason_text`]) and
/// attempts. A message is set aside once: a retry gives it a new arrival number.
pub fn record_cte(first: u32) -> String {
    let [endpoint, tenant, seq, reason, attempts] = [0, 1, 2, 3, 4].map(|i| first + i);
    format!(
        "quarantined AS (
             INSERT INTO quarantined_messages (endpoint_id, tenant_id, arrival_seq, reason,
                 attempts)
             SELECT * FROM unnest(${endpoint}::uuid[], ${tenant}::uuid[], ${seq}::int8[],
                                  ${reason}::text[], ${attempts}::int4[])
             ON CONFLICT (endpoint_id, arrival_seq) DO NOTHING
         )"
    )
}

/// A quarantined message as the control plane shows it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Quarantined {
    pub endpoint_id: Uuid,
    pub arrival_seq: i64,
    pub webhook_id: Option<String>,
    pub reason: String,
    pub attempts: i32,
    pub quarantined_at: OffsetDateTime,
    /// quarantined, retried or discarded.
    pub status: String,
    pub resolved_at: Option<OffsetDateTime>,
    /// A retried message's new arrival number.
    pub retried_as: Option<i64>,
}

const COLUMNS: &str = "q.endpoint_id, q.arrival_seq, m.webhook_id, q.reason, q.attempts,
     q.quarantined_at, q.status, q.resolved_at, q.retried_as";

/// The message's row joined by where it is now (a retried one moved to `retried_as`).
const FROM: &str = "quarantined_messages q
     LEFT JOIN messages m ON m.endpoint_id = q.endpoint_id
         AND m.arrival_seq = COALESCE(q.retried_as, q.arrival_seq)";

/// The tenant's endpoint's quarantined messages by arrival number, after `after`, at most
/// `limit`; only those of `status` when given.
pub async fn list(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    status: Option<&str>,
    after: Option<i64>,
    limit: i64,
) -> Result<Vec<Quarantined>, StoreError> {
    Ok(sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM {FROM}
         WHERE q.endpoint_id = $1 AND q.tenant_id = $2
           AND ($3::text IS NULL OR q.status = $3)
           AND ($4::bigint IS NULL OR q.arrival_seq > $4)
         ORDER BY q.arrival_seq LIMIT $5"
    ))
    .bind(endpoint)
    .bind(tenant)
    .bind(status)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// The tenant's endpoint's quarantine row of the message at `arrival_seq`, when it has one.
pub async fn get<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
    arrival_seq: i64,
) -> Result<Option<Quarantined>, StoreError> {
    Ok(sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM {FROM}
         WHERE q.endpoint_id = $1 AND q.tenant_id = $2 AND q.arrival_seq = $3"
    ))
    .bind(endpoint)
    .bind(tenant)
    .bind(arrival_seq)
    .fetch_optional(db)
    .await?)
}

/// How many of the endpoint's messages wait in quarantine, and the reason of the latest.
pub async fn summary<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<(i64, Option<String>), StoreError> {
    Ok(sqlx::query_as(
        "SELECT count(*),
                (array_agg(reason ORDER BY quarantined_at DESC, arrival_seq DESC))[1]
         FROM quarantined_messages
         WHERE endpoint_id = $1 AND tenant_id = $2 AND status = 'quarantined'",
    )
    .bind(endpoint)
    .bind(tenant)
    .fetch_one(db)
    .await?)
}

/// What a retry or a discard found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// Done: the message as it is now.
    Done(Quarantined),
    /// Retried or discarded before: the message as it is.
    AlreadyResolved(Quarantined),
    /// No such quarantined message of this tenant's endpoint.
    NotFound,
}

/// Gives the quarantined message its resolution `status` (`retried` or `discarded`), unless it
/// has one already: whether this call is the one that resolved it.
async fn resolve<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
    arrival_seq: i64,
    status: &str,
) -> Result<bool, StoreError> {
    let resolved = sqlx::query(
        "UPDATE quarantined_messages SET status = $4, resolved_at = now()
         WHERE endpoint_id = $1 AND tenant_id = $2 AND arrival_seq = $3
           AND status = 'quarantined'",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(arrival_seq)
    .bind(status)
    .execute(db)
    .await?
    .rows_affected();
    Ok(resolved == 1)
}

/// Stores the quarantined message again as a new arrival, at the end of the endpoint's order:
/// its `messages` row takes the endpoint's next arrival number (the counter row locked and
/// moved in this transaction, as the front tier takes numbers, so numbers still follow commit
/// order) and keeps its webhook-id, so a redelivery of it is still a duplicate. The sequencer
/// then applies it by the usual rules.
///
/// Applying it late is safe under the reading rules: its events that the reload (begun when it
/// was quarantined) or later messages already brought are duplicates by id or older by
/// position ("De-duplicate events by id", "compare by sequence"), a message of an older
/// generation than the one held is skipped whole, and whatever it holds that is newer is what
/// the copy should have had. It can never move the copy back.
pub async fn retry(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    arrival_seq: i64,
) -> Result<Resolution, StoreError> {
    let mut tx = pool.begin().await?;
    // Decides, under the row's lock, that this call is the one resolving it.
    if !resolve(&mut *tx, tenant, endpoint, arrival_seq, "retried").await? {
        drop(tx);
        return Ok(match get(pool, tenant, endpoint, arrival_seq).await? {
            Some(found) => Resolution::AlreadyResolved(found),
            None => Resolution::NotFound,
        });
    }
    let moved: Option<i64> = sqlx::query_scalar(
        "WITH counter AS (
             UPDATE endpoint_arrival_counters SET last_arrival_seq = last_arrival_seq + 1
             WHERE endpoint_id = $1
             RETURNING last_arrival_seq AS seq
         ),
         moved AS (
             UPDATE messages m SET arrival_seq = counter.seq
             FROM counter
             WHERE m.endpoint_id = $1 AND m.tenant_id = $2 AND m.arrival_seq = $3
             RETURNING m.arrival_seq
         ),
         -- How the old number was applied (quarantined) describes a number no message holds now.
         forgotten AS (
             DELETE FROM message_applications
             WHERE endpoint_id = $1 AND arrival_seq = $3 AND EXISTS (SELECT 1 FROM moved)
         )
         UPDATE quarantined_messages q SET retried_as = moved.arrival_seq
         FROM moved
         WHERE q.endpoint_id = $1 AND q.arrival_seq = $3
         RETURNING q.retried_as",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(arrival_seq)
    .fetch_optional(&mut *tx)
    .await?;
    if moved.is_none() {
        return Err(StoreError::Invalid(format!(
            "quarantined message {endpoint}/{arrival_seq} has no stored message or counter"
        )));
    }
    tx.commit().await?;
    let found = get(pool, tenant, endpoint, arrival_seq).await?;
    Ok(found.map_or(Resolution::NotFound, Resolution::Done))
}

/// Marks the quarantined message discarded: it is never applied, and its `messages` row and
/// quarantine row stay for audit (the relay answered 2xx for it).
pub async fn discard(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    arrival_seq: i64,
) -> Result<Resolution, StoreError> {
    let resolved = resolve(pool, tenant, endpoint, arrival_seq, "discarded").await?;
    Ok(match get(pool, tenant, endpoint, arrival_seq).await? {
        Some(found) if resolved => Resolution::Done(found),
        Some(found) => Resolution::AlreadyResolved(found),
        None => Resolution::NotFound,
    })
}
