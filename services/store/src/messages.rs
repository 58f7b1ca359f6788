//! Stored webhook messages.
//!
//! The front tier writes messages in batches: many requests' messages go into one statement,
//! because one commit per message cannot keep up with the upstream on a small machine. Every
//! decision (is this webhook-id new? is the endpoint active? which arrival number?) is taken by
//! that statement itself, so any number of front-tier replicas can write at once.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use bytes::Bytes;
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::{EndpointId, StoreError, TenantId};

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
    /// How many events it holds, when the front tier could read it (1 for a stories webhook).
    pub events: Option<i32>,
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

/// Stores a batch and says, for each message in order, what happened.
///
/// The whole batch is one statement, and so one transaction and one round trip: it locks the
/// endpoints' counter rows in endpoint order (so concurrent batches from any number of
/// replicas queue rather than deadlock), takes arrival numbers from them, inserts the messages
/// that are new, and reports on every message. Within a batch an endpoint's messages are
/// numbered in the order given; a webhook-id repeated within the batch is a duplicate of its
/// first occurrence.
///
/// Runs on a pool or on one connection (the front tier's writers keep theirs between batches).
pub async fn store_batch<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    batch: &[IncomingMessage],
) -> Result<Vec<StoreOutcome>, StoreError> {
    // First occurrence of each (endpoint, webhook-id) in the batch; later ones repeat it.
    let mut first_of: HashMap<(Uuid, &str), usize> = HashMap::with_capacity(batch.len());
    let mut unique: Vec<usize> = Vec::with_capacity(batch.len());
    let mut repeat_of: Vec<Option<usize>> = Vec::with_capacity(batch.len());
    for (i, m) in batch.iter().enumerate() {
        match first_of.entry((m.endpoint_id, m.webhook_id.as_str())) {
            Entry::Occupied(first) => repeat_of.push(Some(*first.get())),
            Entry::Vacant(slot) => {
                slot.insert(i);
                unique.push(i);
                repeat_of.push(None);
            }
        }
    }

    let fresh: Vec<&IncomingMessage> = unique.iter().map(|&i| &batch[i]).collect();
    // How many times each unique message repeats later in this batch (counted as duplicates
    // of it, as a repeat in a later batch is).
    let mut repeats: Vec<i32> = vec![0; unique.len()];
    let position_in_unique: HashMap<usize, usize> =
        unique.iter().enumerate().map(|(u, &i)| (i, u)).collect();
    for first in repeat_of.iter().flatten() {
        repeats[position_in_unique[first]] += 1;
    }
    let mut endpoint_ids: Vec<Uuid> = column(&fresh, |m| m.endpoint_id);
    endpoint_ids.sort_unstable();
    endpoint_ids.dedup();

    // One row per unique message, in batch order: (ord, arrival_seq, reserved, status).
    let rows: Vec<(i64, Option<i64>, bool, Option<String>)> = sqlx::query_as(
        "WITH batch AS MATERIALIZED (
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::timestamptz[],
                                  $5::int4[], $6::timestamptz[], $7::text[], $8::int8[],
                                  $9::bytea[], $11::int4[], $12::int4[])
                 WITH ORDINALITY
                 AS b(endpoint_id, tenant_id, webhook_id, signed_at, attempt, received_at,
                      track, generation, body, repeats, events, ord)
         ),
         counts AS (
             SELECT endpoint_id, count(*) AS count FROM batch GROUP BY endpoint_id
         ),
         -- Rows are locked as the sort hands them out, so always in endpoint order. The
         -- lookups below are by primary key so the plan, made once, never scans a table.
         locked AS MATERIALIZED (
             SELECT c.endpoint_id FROM endpoint_arrival_counters c
             WHERE c.endpoint_id = ANY($10::uuid[])
             ORDER BY c.endpoint_id
             FOR NO KEY UPDATE
         ),
         -- Numbers are reserved only for endpoints that exist and are active.
         reserved AS (
             UPDATE endpoint_arrival_counters c
             SET last_arrival_seq = c.last_arrival_seq + n.count
             FROM locked l
             JOIN counts n ON n.endpoint_id = l.endpoint_id
             WHERE c.endpoint_id = l.endpoint_id
               AND (SELECT e.status FROM webhook_endpoints e WHERE e.id = l.endpoint_id)
                   = 'active'
             RETURNING c.endpoint_id, c.last_arrival_seq - n.count AS base
         ),
         inserted AS (
             INSERT INTO messages (endpoint_id, arrival_seq, tenant_id, webhook_id, signed_at,
                                   attempt, received_at, track, generation, body, duplicates,
                                   last_duplicate_at, events)
             SELECT b.endpoint_id,
                    r.base + row_number() OVER (PARTITION BY b.endpoint_id ORDER BY b.ord),
                    b.tenant_id, b.webhook_id, b.signed_at, b.attempt, b.received_at, b.track,
                    b.generation, b.body, b.repeats,
                    CASE WHEN b.repeats > 0 THEN b.received_at END, b.events
             FROM batch b JOIN reserved r ON r.endpoint_id = b.endpoint_id
             ORDER BY b.ord
             ON CONFLICT (endpoint_id, webhook_id) DO NOTHING
             RETURNING endpoint_id, webhook_id, arrival_seq
         ),
         -- A message stored before: counted once more (and its repeats in this batch), on
         -- its row. One stored by a batch committed after this statement began is not in its
         -- snapshot, so not counted: the count is for support, its answer (200) stands.
         duplicated AS (
             UPDATE messages m
             SET duplicates = m.duplicates + 1 + b.repeats, last_duplicate_at = b.received_at
             FROM batch b JOIN reserved r ON r.endpoint_id = b.endpoint_id
             WHERE m.endpoint_id = b.endpoint_id AND m.webhook_id = b.webhook_id
               AND NOT EXISTS (SELECT 1 FROM inserted i
                               WHERE i.endpoint_id = b.endpoint_id
                                 AND i.webhook_id = b.webhook_id)
         )
         SELECT b.ord, i.arrival_seq, r.endpoint_id IS NOT NULL,
                (SELECT e.status FROM webhook_endpoints e WHERE e.id = b.endpoint_id)
         FROM batch b
         LEFT JOIN inserted i ON i.endpoint_id = b.endpoint_id AND i.webhook_id = b.webhook_id
         LEFT JOIN reserved r ON r.endpoint_id = b.endpoint_id
         ORDER BY b.ord",
    )
    .bind(column(&fresh, |m| m.endpoint_id))
    .bind(column(&fresh, |m| m.tenant_id))
    .bind(column(&fresh, |m| m.webhook_id.as_str()))
    .bind(column(&fresh, |m| m.signed_at))
    .bind(column(&fresh, |m| m.attempt))
    .bind(column(&fresh, |m| m.received_at))
    .bind(column(&fresh, |m| m.track.as_deref()))
    .bind(column(&fresh, |m| m.generation))
    .bind(column(&fresh, |m| &m.body[..]))
    .bind(&endpoint_ids)
    .bind(&repeats)
    .bind(column(&fresh, |m| m.events))
    .fetch_all(executor)
    .await?;
    if rows.len() != unique.len() {
        return Err(StoreError::Invalid(format!(
            "the batch insert reported on {} of {} messages",
            rows.len(),
            unique.len()
        )));
    }

    let mut by_position = vec![StoreOutcome::EndpointUnknown; batch.len()];
    for ((_, arrival_seq, reserved, status), &i) in rows.into_iter().zip(&unique) {
        by_position[i] = match (arrival_seq, reserved, status.as_deref()) {
            (Some(arrival_seq), _, _) => StoreOutcome::Stored { arrival_seq },
            // The endpoint's numbers were reserved, so the only thing that can have stopped the
            // insert is a committed row with the same webhook-id: a duplicate.
            (None, true, _) => StoreOutcome::Duplicate,
            (None, false, Some("paused")) => StoreOutcome::EndpointPaused,
            // Being deleted is gone, as far as the upstream is concerned.
            (None, false, None | Some("deleting")) => StoreOutcome::EndpointUnknown,
            (None, false, Some(_)) => {
                // Active yet nothing reserved: its counter row is missing. Refuse rather than
                // claim the message was stored.
                return Err(StoreError::Invalid(format!(
                    "endpoint {} is active but has no arrival counter",
                    batch[i].endpoint_id
                )));
            }
        };
    }
    for (i, first) in repeat_of.iter().enumerate() {
        if let Some(first) = *first {
            // A repeat within the batch: a duplicate when its first occurrence was stored (or
            // was itself a duplicate); otherwise it shares that occurrence's refusal.
            by_position[i] = match by_position[first] {
                StoreOutcome::Stored { .. } | StoreOutcome::Duplicate => StoreOutcome::Duplicate,
                refusal => refusal,
            };
        }
    }
    Ok(by_position)
}

/// One field of every message, as an array parameter for `unnest`.
fn column<'a, T>(
    messages: &[&'a IncomingMessage],
    field: impl Fn(&'a IncomingMessage) -> T,
) -> Vec<T> {
    messages.iter().map(|m| field(m)).collect()
}

/// The longest webhook-id stored, in bytes; the upstream's are `msg_` and 32 hex digits.
pub const MAX_WEBHOOK_ID_BYTES: usize = 256;

/// A stored message with how it was applied, as its tenant reads it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct MessageRecord {
    pub arrival_seq: i64,
    pub webhook_id: String,
    pub signed_at: OffsetDateTime,
    pub attempt: Option<i32>,
    pub received_at: OffsetDateTime,
    pub track: Option<String>,
    pub generation: Option<i64>,
    pub body_bytes: i32,
    /// Only when asked for.
    pub body: Option<Vec<u8>>,
    /// Its row in message_applications, when it has one; `applied` with its event count for a
    /// message the cursor passed with none (the common outcome, which needs no row), unless it
    /// was stored without a count (before counts were kept): then nothing is known.
    pub outcome: Option<String>,
    pub events_applied: Option<i32>,
    pub events_ignored: Option<i32>,
    pub applied_at: Option<OffsetDateTime>,
    /// The apply cursor passed it (with no outcome row: applied).
    pub passed: bool,
    /// Why it is quarantined, when it is.
    pub reason: Option<String>,
    /// What became of it, in a word: one of [`MESSAGE_STATUSES`].
    pub status: String,
    /// How many times it came again (each answered 200, not stored again), and when last.
    pub duplicates: i32,
    pub last_duplicate_at: Option<OffsetDateTime>,
}

/// What became of a stored message, as the listing says it and filters by it: `waiting` (not
/// applied yet), `applied` (its events applied, or the reload it asked for begun),
/// `ignored` (read and set aside by the reading rules: another track, an older generation, a
/// reload superseded, a test message), `quarantined` (never applicable: kept for the tenant to
/// retry or discard).
pub const MESSAGE_STATUSES: [&str; 4] = ["waiting", "applied", "ignored", "quarantined"];

/// Which of an endpoint's messages a page lists.
pub struct MessageQuery {
    /// Newest first, or in arrival order.
    pub newest_first: bool,
    /// The last arrival_seq of the previous page.
    pub cursor: Option<i64>,
    pub limit: i64,
    pub include_body: bool,
    /// Only messages in this status (one of [`MESSAGE_STATUSES`]).
    pub status: Option<String>,
    /// Only messages that came more than once.
    pub duplicated: bool,
    /// Only messages received at or after this.
    pub received_from: Option<OffsetDateTime>,
    /// Only messages received before this.
    pub received_before: Option<OffsetDateTime>,
    /// Only messages whose body holds these bytes (case as given); a page reads at most
    /// [`SEARCH_SCAN`] messages.
    pub contains: Option<String>,
}

/// The columns of a [`MessageRecord`] and the joins they need, over `source` (rows of
/// `messages` as `m`) and filtered by `filter`: one statement's text for every read of
/// messages with their outcomes. `$5` says whether the body is read. The status is computed
/// once, in the lateral subquery, for the answer and the filter.
fn with_outcomes(source: &str, filter: &str) -> String {
    format!(
        "SELECT m.arrival_seq, m.webhook_id, m.signed_at, m.attempt, m.received_at, m.track,
                m.generation, octet_length(m.body) AS body_bytes,
                CASE WHEN $5 THEN m.body END AS body,
                coalesce(a.outcome, CASE WHEN s.passed AND m.events IS NOT NULL
                                         THEN 'applied' END) AS outcome,
                coalesce(a.events_applied, CASE WHEN s.passed THEN m.events END)
                    AS events_applied,
                coalesce(a.events_ignored, CASE WHEN s.passed AND m.events IS NOT NULL
                                                THEN 0 END) AS events_ignored,
                a.applied_at,
                s.passed, q.reason, s.status, m.duplicates, m.last_duplicate_at
         FROM {source}
         LEFT JOIN message_applications a
           ON a.endpoint_id = m.endpoint_id AND a.arrival_seq = m.arrival_seq
         LEFT JOIN quarantined_messages q
           ON q.endpoint_id = m.endpoint_id AND q.arrival_seq = m.arrival_seq
         LEFT JOIN endpoint_apply_cursors c ON c.endpoint_id = m.endpoint_id
         CROSS JOIN LATERAL (
             SELECT p.passed,
                    CASE WHEN NOT p.passed THEN 'waiting'
                         WHEN a.outcome IN ('quarantined', 'malformed') THEN 'quarantined'
                         WHEN a.outcome IN ('ignored_track', 'older_generation',
                                            'reload_superseded', 'test', 'ignored_type')
                              THEN 'ignored'
                         ELSE 'applied' END AS status
             FROM (SELECT a.outcome IS NOT NULL
                          OR m.arrival_seq <= COALESCE(c.applied_arrival_seq, 0) AS passed) p
         ) s
         WHERE m.endpoint_id = $1 AND m.tenant_id = $2 AND {filter}"
    )
}

/// How many of an endpoint's messages one page of a search by text ([`MessageQuery::contains`])
/// reads at most, whatever it finds: the bound on a search's work per request.
pub const SEARCH_SCAN: i64 = 2_000;

/// A page of the tenant's endpoint's stored messages with their outcomes (empty when it is not
/// the tenant's), and where the next page starts (`None` after the last).
///
/// A page searching by text reads at most [`SEARCH_SCAN`] messages from the cursor, so it may
/// hold fewer than `limit` rows, none even, and still have a next page: its cursor is the last
/// message read. The rows and that cursor are read in one snapshot.
pub async fn list_with_outcomes(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    query: &MessageQuery,
) -> Result<(Vec<MessageRecord>, Option<i64>), StoreError> {
    let (condition, order) = if query.newest_first {
        ("($3::bigint IS NULL OR m.arrival_seq < $3)", "DESC")
    } else {
        ("($3::bigint IS NULL OR m.arrival_seq > $3)", "ASC")
    };
    let filter = format!(
        "{condition}
           AND ($6::text IS NULL OR s.status = $6)
           AND (NOT $9 OR m.duplicates > 0)
           AND ($7::timestamptz IS NULL OR m.received_at >= $7)
           AND ($8::timestamptz IS NULL OR m.received_at < $8)"
    );
    let Some(text) = &query.contains else {
        let rows: Vec<MessageRecord> = sqlx::query_as(&format!(
            "{} ORDER BY m.arrival_seq {order} LIMIT $4",
            with_outcomes("messages m", &filter)
        ))
        .bind(endpoint)
        .bind(tenant)
        .bind(query.cursor)
        .bind(query.limit)
        .bind(query.include_body)
        .bind(&query.status)
        .bind(query.received_from)
        .bind(query.received_before)
        .bind(query.duplicated)
        .fetch_all(pool)
        .await?;
        let next = full_page_cursor(&rows, query.limit);
        return Ok((rows, next));
    };
    // The window read: the next SEARCH_SCAN messages from the cursor, in the page's order.
    let window = |bound: &str| {
        format!(
            "SELECT * FROM messages m WHERE m.endpoint_id = $1 AND m.tenant_id = $2
             AND {condition} ORDER BY m.arrival_seq {order} LIMIT {bound}"
        )
    };
    let source = format!("({}) m", window("$10"));
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    let rows: Vec<MessageRecord> = sqlx::query_as(&format!(
        "{} AND position(convert_to($11, 'UTF8') in m.body) > 0
         ORDER BY m.arrival_seq {order} LIMIT $4",
        with_outcomes(&source, &filter)
    ))
    .bind(endpoint)
    .bind(tenant)
    .bind(query.cursor)
    .bind(query.limit)
    .bind(query.include_body)
    .bind(&query.status)
    .bind(query.received_from)
    .bind(query.received_before)
    .bind(query.duplicated)
    .bind(SEARCH_SCAN)
    .bind(text)
    .fetch_all(&mut *tx)
    .await?;
    // A full page goes on from its last row; a shorter one from the last message read, when
    // the read stopped at its bound rather than at the end.
    let next = match full_page_cursor(&rows, query.limit) {
        Some(last) => Some(last),
        None => {
            let (read, last): (i64, Option<i64>) = sqlx::query_as(&format!(
                "SELECT count(*), {} FROM ({}) w",
                if query.newest_first {
                    "min(w.arrival_seq)"
                } else {
                    "max(w.arrival_seq)"
                },
                window("$4")
            ))
            .bind(endpoint)
            .bind(tenant)
            .bind(query.cursor)
            .bind(SEARCH_SCAN)
            .fetch_one(&mut *tx)
            .await?;
            last.filter(|_| read == SEARCH_SCAN)
        }
    };
    tx.commit().await?;
    Ok((rows, next))
}

/// The last row's arrival number, when the page is full.
fn full_page_cursor(rows: &[MessageRecord], limit: i64) -> Option<i64> {
    (rows.len() as i64 == limit)
        .then(|| rows.last().map(|m| m.arrival_seq))
        .flatten()
}

/// Which stored message to read.
#[derive(Debug, Clone, Copy)]
pub enum MessageKey<'a> {
    ArrivalSeq(i64),
    /// The `webhook-id` it was sent with (unique in its endpoint).
    WebhookId(&'a str),
}

/// The tenant's endpoint's message with its outcome and its body; `None` when there is none
/// (or the endpoint is not the tenant's).
pub async fn find_with_outcome(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    key: MessageKey<'_>,
) -> Result<Option<MessageRecord>, StoreError> {
    // Each key is its own statement, so that each plan reads its index; the other key's
    // parameter is null.
    let (filter, seq, webhook_id) = match key {
        MessageKey::ArrivalSeq(seq) => ("m.arrival_seq = $3 AND $4::text IS NULL", Some(seq), None),
        MessageKey::WebhookId(id) => ("m.webhook_id = $4 AND $3::bigint IS NULL", None, Some(id)),
    };
    Ok(sqlx::query_as(&with_outcomes("messages m", filter))
        .bind(endpoint)
        .bind(tenant)
        .bind(seq)
        .bind(webhook_id)
        .bind(true)
        .fetch_optional(pool)
        .await?)
}

/// Deletes stored messages received before `cutoff` that are applied (at or below their
/// endpoint's apply cursor), with their `message_applications` rows, at most `per_endpoint` of
/// each of up to `endpoints` endpoints after `after` (endpoint id order); a message quarantined
/// and not yet acted on is kept, and with it its quarantine row. Returns how many messages went
/// and the last endpoint looked at (`None` once past the last: start again from the first).
///
/// Each endpoint's window is its first messages in arrival order, read by the primary key: its
/// arrival numbers follow the order the front tier committed them, so its oldest come first,
/// and the first window holding none old enough ends the endpoint's share of the round without
/// reading further.
pub async fn forget_applied(
    pool: &PgPool,
    cutoff: time::OffsetDateTime,
    after: Option<EndpointId>,
    endpoints: i64,
    per_endpoint: i64,
) -> Result<(u64, Option<EndpointId>), StoreError> {
    let page: Vec<Uuid> = sqlx::query_scalar(
        "SELECT endpoint_id FROM endpoint_apply_cursors
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
    let deleted: i64 = sqlx::query_scalar(
        "WITH window_ AS (
             SELECT w.endpoint_id, w.arrival_seq
             FROM endpoint_apply_cursors c
             CROSS JOIN LATERAL (
                 SELECT m.endpoint_id, m.arrival_seq, m.received_at FROM messages m
                 WHERE m.endpoint_id = c.endpoint_id
                   AND m.arrival_seq <= c.applied_arrival_seq
                   AND NOT EXISTS (SELECT 1 FROM quarantined_messages q
                                   WHERE q.endpoint_id = m.endpoint_id
                                     AND q.arrival_seq = m.arrival_seq
                                     AND q.status = 'quarantined')
                 ORDER BY m.arrival_seq LIMIT $3
             ) w
             WHERE c.endpoint_id = ANY($1) AND w.received_at < $2
         ),
         gone AS (
             DELETE FROM messages m USING window_ w
             WHERE m.endpoint_id = w.endpoint_id AND m.arrival_seq = w.arrival_seq
             RETURNING m.endpoint_id, m.arrival_seq
         ),
         applications AS (
             DELETE FROM message_applications a USING gone g
             WHERE a.endpoint_id = g.endpoint_id AND a.arrival_seq = g.arrival_seq
         ),
         resolved AS (
             DELETE FROM quarantined_messages q USING gone g
             WHERE q.endpoint_id = g.endpoint_id AND q.arrival_seq = g.arrival_seq
         )
         SELECT count(*) FROM gone",
    )
    .bind(&page)
    .bind(cutoff)
    .bind(per_endpoint)
    .fetch_one(pool)
    .await?;
    let next = (page.len() as i64 == endpoints).then_some(EndpointId(last));
    Ok((deleted as u64, next))
}

/// How many of the endpoint's messages arrived in each minute at or after `since`, read from
/// its latest `limit` messages at most (the bound on what one read scans, whatever the
/// endpoint's rate): the counts by minute, oldest first, and whether the bound cut the window
/// short (the oldest message read is still inside it).
pub async fn arrivals_by_minute(
    pool: &PgPool,
    endpoint: EndpointId,
    since: OffsetDateTime,
    limit: i64,
) -> Result<(Vec<(OffsetDateTime, i64)>, bool), StoreError> {
    let rows: Vec<(OffsetDateTime, i64, bool)> = sqlx::query_as(
        "WITH latest AS (
             SELECT received_at FROM messages WHERE endpoint_id = $1
             ORDER BY arrival_seq DESC LIMIT $3
         ),
         bounds AS (SELECT count(*) = $3 AND min(received_at) >= $2 AS cut FROM latest)
         SELECT date_trunc('minute', received_at) AS minute, count(*), (SELECT cut FROM bounds)
         FROM latest WHERE received_at >= $2
         GROUP BY 1 ORDER BY 1",
    )
    .bind(endpoint)
    .bind(since)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(crate::db::counts_by_minute(rows))
}
