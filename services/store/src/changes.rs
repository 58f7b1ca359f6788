//! Publishing the outbox (`changes`, appended by [`copy`](crate::copy)): which tenants and
//! endpoints have unpublished changes, an endpoint's next ones, marking confirmed ones published
//! (under the tenant's fence, `publisher_fences`), and the backlog's size.
//!
//! What is published is one number per endpoint, its publish cursor (`endpoint_publish_cursors`):
//! the publisher sends an endpoint's changes in order and marks a change only once it and every
//! earlier one of its endpoint were confirmed, so what is marked is always a prefix. An endpoint's backlog is its change counter
//! (`endpoint_change_counters`) minus its cursor; its changes are read by their primary key from
//! the cursor on.

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::{EndpointId, StoreError, TenantId};

/// The tenants that have at least one unpublished change, at most `limit`: every endpoint's
/// change counter against its publish cursor (one row each per endpoint).
pub async fn tenants_with_backlog(pool: &PgPool, limit: i64) -> Result<Vec<TenantId>, StoreError> {
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

/// The tenant's endpoints that have at least one unpublished change, in id order, at most
/// `limit`, each with its last change_seq (its change counter): the holder asks only for what
/// follows what it already holds. For the publisher holding the tenant's publishing `token`;
/// `None` when that is no longer the tenant's token: another publisher claimed the tenant, or a
/// resync or a replay moved its stream under the holder (`restores::resync`, [`replay`]), whose
/// memory of what it read is then wrong. A holder with nothing to mark learns it here, at its
/// next sweep.
pub async fn endpoints_with_backlog(
    pool: &PgPool,
    tenant: TenantId,
    token: i64,
    limit: i64,
) -> Result<Option<Vec<(EndpointId, i64)>>, StoreError> {
    type Found = (Option<bool>, Vec<uuid::Uuid>, Vec<i64>);
    let (ours, endpoints, lasts): Found = sqlx::query_as(
        "WITH behind AS (
             SELECT k.endpoint_id, k.last
             FROM endpoint_change_counters k
             LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = k.endpoint_id
             WHERE k.tenant_id = $1 AND k.last > COALESCE(p.published_through, 0)
             ORDER BY k.endpoint_id
             LIMIT $2
         )
         SELECT (SELECT token = $3 FROM publisher_fences WHERE tenant_id = $1),
                ARRAY(SELECT endpoint_id FROM behind ORDER BY endpoint_id),
                ARRAY(SELECT last FROM behind ORDER BY endpoint_id)",
    )
    .bind(tenant)
    .bind(limit)
    .bind(token)
    .fetch_one(pool)
    .await?;
    Ok((ours == Some(true)).then(|| endpoints.into_iter().map(EndpointId).zip(lasts).collect()))
}

/// One unpublished change as the outbox holds it, its columns unparsed: the item and the parts
/// diff are the JSON texts Postgres returns, to be checked and sent by the publisher.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Unpublished {
    #[sqlx(rename = "endpoint_id")]
    pub endpoint: EndpointId,
    /// The epoch of the endpoint's change stream (see `restores`): every change the outbox holds
    /// is of the current one.
    pub epoch: i64,
    pub change_seq: i64,
    /// Which message the row becomes: `item` (the feed's), `story` or `notification` (a stories
    /// endpoint's).
    pub kind: String,
    /// `upsert`, `remove`, `snapshot_begin` or `snapshot_end` (kind `item`); `saved`, `closed`
    /// or `dropped` (kind `story`); `notified` (kind `notification`).
    pub operation: String,
    /// The feed item's subject; a story's id.
    pub subject: String,
    pub item_kind: Option<String>,
    pub generation: i64,
    /// Null for the removals of a reload's drop.
    pub sequence: Option<String>,
    pub event_id: Option<String>,
    /// The feed's reload generation; a stories endpoint's round (a reload in full, a ticker's
    /// load or removal).
    pub reload_generation: Option<i64>,
    /// Part of the snapshot that opens the epoch: its markers and its upserts.
    pub snapshot: bool,
    /// The item stored, on upsert; the story's snapshot on saved and notified: JSON text.
    pub item: Option<String>,
    /// JSON text.
    pub parts_diff: String,
    pub created_at: OffsetDateTime,
    /// A story or notification row's version after its write; null on the feed's rows.
    pub story_version: Option<i64>,
    /// A story or notification row's ticker; null on the feed's rows.
    pub ticker: Option<String>,
    /// The surviving story's id, on a close by merge.
    pub merged_into: Option<String>,
}

/// For each `(endpoint, through, room)`: the endpoint's unpublished changes after change_seq
/// `through` (and after its publish cursor), in change_seq order, at most `room` of them; one
/// range read of the primary key per endpoint. Ordered by endpoint, then change_seq.
pub async fn next_changes(
    pool: &PgPool,
    tenant: TenantId,
    plan: &[(EndpointId, i64, i64)],
) -> Result<Vec<Unpublished>, StoreError> {
    let mut endpoints = Vec::with_capacity(plan.len());
    let mut throughs = Vec::with_capacity(plan.len());
    let mut rooms = Vec::with_capacity(plan.len());
    for (endpoint, through, room) in plan {
        endpoints.push(endpoint.as_uuid());
        throughs.push(*through);
        rooms.push(*room);
    }
    Ok(sqlx::query_as(
        "SELECT c.endpoint_id, k.epoch, c.change_seq, c.kind, c.operation, c.subject,
                c.item_kind, c.generation, c.sequence, c.event_id, c.reload_generation,
                c.snapshot, c.item::text AS item, c.parts_diff::text AS parts_diff, c.created_at,
                c.story_version, c.ticker, c.merged_into
         FROM unnest($2::uuid[], $3::int8[], $4::int8[]) AS w (endpoint_id, through, room)
         JOIN endpoint_change_counters k ON k.endpoint_id = w.endpoint_id
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
    .await?)
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
/// same endpoint was confirmed too (the publisher's window, `stream.rs`, confirms in order): the
/// cursor says "everything up to here". Marking is what keeps a change from being
/// sent again; a confirmed change left unmarked (a crash before this) is sent again, under the
/// same message id.
pub async fn mark_published(
    pool: &PgPool,
    tenant: TenantId,
    token: i64,
    keys: &[(EndpointId, i64)],
) -> Result<Marked, StoreError> {
    let mut through: Vec<(EndpointId, i64)> = keys.to_vec();
    through.sort_unstable();
    // The highest change_seq of each endpoint: sorted, so the last of each run of one endpoint.
    through.reverse();
    through.dedup_by_key(|(endpoint, _)| *endpoint);
    // Endpoint id order, the same for every mark: two marks never wait on each other crosswise.
    through.reverse();
    let (endpoints, seqs): (Vec<_>, Vec<i64>) = through
        .into_iter()
        .map(|(endpoint, seq)| (endpoint.as_uuid(), seq))
        .unzip();
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
                 -- Shared with the sequencer's counter updates (no key changes); waits for an
                 -- endpoint's delete (offboard's finish), after which there is no row to mark.
                 FOR KEY SHARE
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
    tenant: TenantId,
) -> Result<(i64, Option<OffsetDateTime>), StoreError> {
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

/// What [`replay`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay {
    /// The publish cursor is before `from`: the changes `from..=through` of `epoch` go out
    /// again, under their own message ids.
    Replaying { epoch: i64, from: i64, through: i64 },
    /// `from` is past the endpoint's last change (`through`) in `epoch`: nothing to send again.
    Ahead { epoch: i64, through: i64 },
    /// `from` is before the oldest change kept (`oldest`): older ones were deleted after their
    /// retention.
    Gone { epoch: i64, oldest: i64 },
}

/// Sends the tenant's endpoint's changes again from change `from` of its current epoch: its
/// publish cursor goes back to just before it (never forward). `None` when the endpoint is not
/// the tenant's.
///
/// One transaction, in the mark's lock order: the tenant's publishing token is taken first
/// (its row locked, then raised), so no mark in flight can move the cursor past `from` again;
/// the publisher that held the tenant gives it up at its next mark or sweep
/// ([`endpoints_with_backlog`]), and the next one reads from the cursor.
pub async fn replay(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    from: i64,
) -> Result<Option<Replay>, StoreError> {
    let mut tx = pool.begin().await?;
    // The oldest change kept, by the primary key (none kept: the one after the last).
    let position: Option<(i64, i64, i64)> = sqlx::query_as(
        "SELECT COALESCE(n.epoch, 1), COALESCE(n.last, 0),
                COALESCE((SELECT min(c.change_seq) FROM changes c WHERE c.endpoint_id = e.id),
                         COALESCE(n.last, 0) + 1)
         FROM webhook_endpoints e
         LEFT JOIN endpoint_change_counters n ON n.endpoint_id = e.id
         WHERE e.id = $1 AND e.tenant_id = $2 AND e.status <> 'deleting'",
    )
    .bind(endpoint)
    .bind(tenant)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((epoch, through, oldest)) = position else {
        return Ok(None);
    };
    if from > through {
        return Ok(Some(Replay::Ahead { epoch, through }));
    }
    if from < oldest {
        return Ok(Some(Replay::Gone { epoch, oldest }));
    }
    sqlx::query(
        "UPDATE publisher_fences SET token = token + 1, claimed_at = now() WHERE tenant_id = $1",
    )
    .bind(tenant)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "UPDATE endpoint_publish_cursors SET published_through = $2 - 1, published_at = now()
         WHERE endpoint_id = $1 AND published_through >= $2",
    )
    .bind(endpoint)
    .bind(from)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Some(Replay::Replaying {
        epoch,
        from,
        through,
    }))
}

/// Deletes published changes (at or below their endpoint's publish cursor) made before
/// `cutoff`, at most `per_endpoint` of each of up to `endpoints` endpoints after `after`, as
/// [`crate::messages::forget_applied`] does for messages: each endpoint's oldest changes first,
/// by the primary key. Unpublished changes are never deleted. Returns how many went and the
/// last endpoint looked at (`None` once past the last).
pub async fn forget_published(
    pool: &PgPool,
    cutoff: OffsetDateTime,
    after: Option<EndpointId>,
    endpoints: i64,
    per_endpoint: i64,
) -> Result<(u64, Option<EndpointId>), StoreError> {
    let page: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT endpoint_id FROM endpoint_publish_cursors
         WHERE $1::uuid IS NULL OR endpoint_id > $1
         ORDER BY endpoint_id LIMIT $2",
    )
    .bind(after)
    .bind(endpoints)
    .fetch_all(pool)
    .await?;
    let Some(&last) = page.last() else {
        return Ok((0, None));
    };
    let deleted = sqlx::query(
        "DELETE FROM changes c USING (
             SELECT w.endpoint_id, w.change_seq
             FROM endpoint_publish_cursors p
             CROSS JOIN LATERAL (
                 SELECT ch.endpoint_id, ch.change_seq, ch.created_at FROM changes ch
                 WHERE ch.endpoint_id = p.endpoint_id AND ch.change_seq <= p.published_through
                 ORDER BY ch.change_seq LIMIT $3
             ) w
             WHERE p.endpoint_id = ANY($1) AND w.created_at < $2
         ) old
         WHERE c.endpoint_id = old.endpoint_id AND c.change_seq = old.change_seq",
    )
    .bind(&page)
    .bind(cutoff)
    .bind(per_endpoint)
    .execute(pool)
    .await?
    .rows_affected();
    let next = (page.len() as i64 == endpoints).then_some(EndpointId(last));
    Ok((deleted, next))
}

/// How many changes the endpoint's apply wrote in each minute at or after `since`, read from
/// its latest `limit` changes at most (as [`crate::messages::arrivals_by_minute`]): the counts
/// by minute, oldest first, and whether the bound cut the window short. A resync or restore
/// deletes the old epoch's changes, so the counts start again from the new epoch.
pub async fn written_by_minute(
    pool: &PgPool,
    endpoint: EndpointId,
    since: OffsetDateTime,
    limit: i64,
) -> Result<(Vec<(OffsetDateTime, i64)>, bool), StoreError> {
    let rows: Vec<(OffsetDateTime, i64, bool)> = sqlx::query_as(
        "WITH latest AS (
             SELECT created_at FROM changes WHERE endpoint_id = $1
             ORDER BY change_seq DESC LIMIT $3
         ),
         bounds AS (SELECT count(*) = $3 AND min(created_at) >= $2 AS cut FROM latest)
         SELECT date_trunc('minute', created_at) AS minute, count(*), (SELECT cut FROM bounds)
         FROM latest WHERE created_at >= $2
         GROUP BY 1 ORDER BY 1",
    )
    .bind(endpoint)
    .bind(since)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(crate::db::counts_by_minute(rows))
}

/// A change as the tenant's message detail lists it: what it wrote, not the item itself.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ChangeSummary {
    pub change_seq: i64,
    pub kind: String,
    pub operation: String,
    pub subject: String,
    pub item_kind: Option<String>,
    pub generation: i64,
    pub sequence: Option<String>,
    pub event_id: Option<String>,
    pub created_at: OffsetDateTime,
}

/// How many of an endpoint's latest changes one read of a message's changes looks through at
/// most ([`made_by_events`]).
pub const MADE_BY_SCAN: i64 = 50_000;

/// The changes of the tenant's endpoint's current epoch that the events `event_ids` made
/// (their `event_id`), written at or after `not_before` (the message's arrival: nothing it
/// caused is older), in change_seq order, at most `limit`. The read goes back from the
/// endpoint's latest change through at most [`MADE_BY_SCAN`] of them; the flag says it stopped
/// at that bound before reaching `not_before` (older changes of the message may exist). A
/// change no longer kept (published, past the changes' retention) is not found.
pub async fn made_by_events(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    event_ids: &[String],
    not_before: OffsetDateTime,
    limit: i64,
) -> Result<(Vec<ChangeSummary>, bool), StoreError> {
    if event_ids.is_empty() {
        return Ok((Vec::new(), false));
    }
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    let window = "SELECT * FROM changes w WHERE w.endpoint_id = $1 AND w.tenant_id = $2
                  ORDER BY w.change_seq DESC LIMIT $3";
    let rows: Vec<ChangeSummary> = sqlx::query_as(&format!(
        "SELECT c.change_seq, c.kind, c.operation, c.subject, c.item_kind, c.generation,
                c.sequence, c.event_id, c.created_at
         FROM ({window}) c
         WHERE c.event_id = ANY($4) AND c.created_at >= $5
         ORDER BY c.change_seq LIMIT $6"
    ))
    .bind(endpoint)
    .bind(tenant)
    .bind(MADE_BY_SCAN)
    .bind(event_ids)
    .bind(not_before)
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    let cut: bool = sqlx::query_scalar(&format!(
        "SELECT count(*) = $3 AND min(created_at) >= $4 FROM ({window}) w"
    ))
    .bind(endpoint)
    .bind(tenant)
    .bind(MADE_BY_SCAN)
    .bind(not_before)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((rows, cut))
}
