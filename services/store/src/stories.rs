//! A stories endpoint's copy (seed 000's `stories` table), its claimed notifications
//! (`claimed`), its catch-up and reload state (`stories_sync`), its reads owed
//! (`story_reads_owed`), and the outbox rows its writes append.
//!
//! Every write runs in a [`StoriesWriter`]: one transaction that checked the endpoint's fence and
//! holds its writer lock (the change counter's row), so a run of webhooks, a catch-up page and a
//! reload's batch of one endpoint never interleave. A plan (relay-rules' `StoriesPlan`, decided
//! by `decide_stories_run` for events or `plan_writes` for a round) is carried out whole by
//! [`StoriesWriter::write_plan`] in one statement however many writes it has: the writes as arrays,
//! each still seed 000's statement deciding in itself against the row as the plan's earlier
//! writes left it (the save's `where not closed and version < excluded.version`, the close's
//! `greatest`), each change appended in plan order only when its write changed the row, each
//! claim as `insert ... on conflict do nothing returning key`. The plan says what it expects each
//! write to do; a write that does otherwise was raced, and the transaction is rolled back
//! ([`StoreError::Refused`]).

use std::collections::HashMap;

use relay_rules::{HeldStory, StoriesPlan, StoryChange, StoryWrite};
use sqlx::{Postgres, Transaction};
use time::OffsetDateTime;

use crate::{fences, EndpointId, StoreError, TenantId};

/// What caused a plan's writes, named by their changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanCause {
    /// Each write's own event (a webhook's or a catch-up page's), as the plan names it.
    Events,
    /// A round of the endpoint's (a reload in full, a ticker's first load, owed reads paid).
    Round(i64),
}

/// What [`StoriesWriter::write_plan`] did, as its statement counted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlanWritten {
    /// Saves that wrote their snapshot, and saves the row refused (closed, or as new).
    pub saved: u64,
    pub unchanged: u64,
    /// Closes that closed the row or raised its version, and closes that found it closed at
    /// that version or later.
    pub closed: u64,
    pub already_closed: u64,
    /// Claims whose key came back, notifying or silently, and claims whose key was taken before.
    pub notified: u64,
    pub claimed_silently: u64,
    pub claimed_before: u64,
    /// Changes appended to the outbox.
    pub changes: u64,
}

/// One transaction over a stories endpoint: fence checked, writer lock held. Opened inside
/// another transaction it is a savepoint of it, so several endpoints' writers can share one
/// commit and each still rolls back alone.
pub struct StoriesWriter<'c> {
    tx: Transaction<'c, Postgres>,
    tenant: TenantId,
    endpoint: EndpointId,
    appended: u64,
}

/// Opens the endpoint's write transaction on `conn` (a pool, or a transaction to nest in):
/// `None` when `token` is no longer its fencing token (another worker owns it now; nothing was
/// written).
pub async fn open<'c>(
    conn: impl sqlx::Acquire<'c, Database = Postgres>,
    tenant: TenantId,
    endpoint: EndpointId,
    token: i64,
) -> Result<Option<StoriesWriter<'c>>, StoreError> {
    let mut tx = conn.begin().await?;
    if !fences::check_endpoint(&mut tx, endpoint, token).await? {
        return Ok(None);
    }
    // The writer lock every writer of the endpoint takes after its fence: the counter's row.
    sqlx::query(
        "INSERT INTO endpoint_change_counters AS c (endpoint_id, tenant_id) VALUES ($1, $2)
         ON CONFLICT (endpoint_id) DO UPDATE SET last = c.last",
    )
    .bind(endpoint)
    .bind(tenant)
    .execute(&mut *tx)
    .await?;
    Ok(Some(StoriesWriter {
        tx,
        tenant,
        endpoint,
        appended: 0,
    }))
}

/// [`StoriesWriter::write_plan`]'s statement. `$1` endpoint, `$2` tenant, `$3` the round (null
/// for events); the writes in plan order `$4`–`$11` (close or save, story id, ticker, version,
/// snapshot, merged_into, event id, and the row's version after the write when the plan says it
/// changes the row, null when not); the claims `$12`–`$18` (key, story id, ticker, event id,
/// snapshot, version, notify).
///
/// `fold` is each story's row as this transaction holds it (step 0, locked by
/// [`StoriesWriter::held`]), then as each of its writes leaves it, in plan order: seed 000's two
/// statements, each deciding against the row as the write before left it. A story several writes
/// touch (save v2, save v3, close) is written once, as its last step left it, guarded by the row
/// being still what the fold began from; each write that changed it appends its own change, in
/// plan order, only when the row was written. The claims' notifications follow the writes'
/// changes, numbered on from the endpoint's counter. The statement returns the writes whose
/// change is not the plan's (1-based), the rows to write and written, and its counts.
const WRITE_PLAN: &str = "WITH RECURSIVE
     planned AS MATERIALIZED (
         SELECT w.*, row_number() OVER (PARTITION BY w.id ORDER BY w.ord) AS step
         FROM unnest($4::bool[], $5::text[], $6::text[], $7::int8[], $8::jsonb[], $9::text[],
                     $10::text[], $11::int8[])
             WITH ORDINALITY AS w(is_close, id, ticker, version, story, merged_into, event_id,
                                  planned, ord)
     ),
     fold AS (
         SELECT p.id, 0::int8 AS step, r.id IS NOT NULL AS present, r.ticker, r.version,
                coalesce(r.closed, false) AS closed, r.story, r.merged_into, false AS changed
         FROM (SELECT DISTINCT id FROM planned) p
         LEFT JOIN stories r ON r.endpoint_id = $1 AND r.id = p.id
         UNION ALL
         SELECT f.id, w.step, true,
                CASE WHEN d.changed AND NOT w.is_close THEN w.ticker ELSE f.ticker END,
                CASE WHEN w.is_close THEN greatest(f.version, w.version)
                     WHEN d.changed THEN w.version ELSE f.version END,
                f.closed OR w.is_close,
                CASE WHEN w.is_close THEN NULL WHEN d.changed THEN w.story ELSE f.story END,
                CASE WHEN w.is_close AND d.changed THEN w.merged_into ELSE f.merged_into END,
                d.changed
         FROM fold f
         JOIN planned w ON w.id = f.id AND w.step = f.step + 1
         -- The save: `where not stories.closed and stories.version < excluded.version` (or no
         -- row). The close: a change unless the row is closed at its version or later.
         CROSS JOIN LATERAL (
             SELECT CASE WHEN w.is_close
                         THEN NOT (f.present AND f.closed AND f.version >= w.version)
                         ELSE NOT f.present OR (NOT f.closed AND f.version < w.version)
                    END AS changed
         ) d
     ),
     decided AS MATERIALIZED (
         SELECT w.ord, w.id, w.is_close, w.merged_into, w.event_id, w.planned, f.changed,
                f.ticker, f.version, f.story
         FROM planned w JOIN fold f ON f.id = w.id AND f.step = w.step
     ),
     was AS (SELECT * FROM fold WHERE step = 0),
     last AS MATERIALIZED (
         SELECT DISTINCT ON (f.id) f.* FROM fold f
         WHERE f.id IN (SELECT id FROM decided WHERE changed)
         ORDER BY f.id, f.step DESC
     ),
     updated AS (
         UPDATE stories s
         SET ticker = l.ticker, version = l.version, closed = l.closed, story = l.story,
             merged_into = l.merged_into
         FROM last l JOIN was b ON b.id = l.id
         WHERE s.endpoint_id = $1 AND s.id = l.id AND b.present
           AND s.version = b.version AND s.closed = b.closed
         RETURNING s.id
     ),
     inserted AS (
         INSERT INTO stories (endpoint_id, tenant_id, id, ticker, version, closed, story,
                              merged_into)
         SELECT $1, $2, l.id, l.ticker, l.version, l.closed, l.story, l.merged_into
         FROM last l JOIN was b ON b.id = l.id
         WHERE NOT b.present
         ON CONFLICT (endpoint_id, id) DO NOTHING
         RETURNING id
     ),
     written AS (SELECT id FROM updated UNION ALL SELECT id FROM inserted),
     claims AS MATERIALIZED (
         SELECT * FROM unnest($12::text[], $13::text[], $14::text[], $15::text[], $16::jsonb[],
                              $17::int8[], $18::bool[])
             WITH ORDINALITY AS c(key, story_id, ticker, event_id, item, version, notify, ord)
     ),
     claim AS (
         INSERT INTO claimed (endpoint_id, tenant_id, key, story_id, ticker, event_id, notified)
         SELECT $1, $2, key, story_id, ticker, event_id, notify FROM claims ORDER BY ord
         ON CONFLICT DO NOTHING
         RETURNING key
     ),
     appended AS MATERIALIZED (
         SELECT row_number() OVER (ORDER BY a.part, a.ord) AS n, a.*
         FROM (
             SELECT 0 AS part, d.ord, 'story' AS kind,
                    CASE WHEN d.is_close THEN 'closed' ELSE 'saved' END AS operation,
                    d.id AS subject, d.ticker, d.event_id, $3::int8 AS reload_generation,
                    d.story::json AS item, d.version AS story_version,
                    CASE WHEN d.is_close THEN d.merged_into END AS merged_into
             FROM decided d
             WHERE d.changed AND d.id IN (SELECT id FROM written)
             UNION ALL
             SELECT 1, c.ord, 'notification', 'notified', c.story_id, c.ticker, c.event_id,
                    NULL, c.item::json, c.version, NULL
             FROM claims c
             WHERE c.notify AND c.key IN (SELECT key FROM claim)
         ) a
     ),
     counter AS (
         UPDATE endpoint_change_counters SET last = last + (SELECT count(*) FROM appended)
         WHERE endpoint_id = $1 AND EXISTS (SELECT 1 FROM appended)
         RETURNING last - (SELECT count(*) FROM appended) AS base
     ),
     change AS (
         INSERT INTO changes (endpoint_id, change_seq, tenant_id, kind, operation, subject,
                              ticker, generation, event_id, reload_generation, item,
                              parts_diff, story_version, merged_into)
         SELECT $1, counter.base + a.n, $2, a.kind, a.operation, a.subject, a.ticker, 0,
                a.event_id, a.reload_generation, a.item, '{}', a.story_version, a.merged_into
         FROM appended a, counter
         RETURNING 1
     )
     SELECT ARRAY(SELECT ord FROM decided
                  WHERE CASE WHEN changed THEN version END IS DISTINCT FROM planned
                  ORDER BY ord) AS refused,
            (SELECT count(*) FROM last) AS rows_to_write,
            (SELECT count(*) FROM written) AS rows_written,
            (SELECT count(*) FILTER (WHERE NOT is_close AND changed) FROM decided) AS saved,
            (SELECT count(*) FILTER (WHERE NOT is_close AND NOT changed) FROM decided)
                AS unchanged,
            (SELECT count(*) FILTER (WHERE is_close AND changed) FROM decided) AS closed,
            (SELECT count(*) FILTER (WHERE is_close AND NOT changed) FROM decided)
                AS already_closed,
            (SELECT count(*) FROM claims WHERE notify AND key IN (SELECT key FROM claim))
                AS notified,
            (SELECT count(*) FROM claims WHERE NOT notify AND key IN (SELECT key FROM claim))
                AS claimed_silently,
            (SELECT count(*) FROM claims WHERE key NOT IN (SELECT key FROM claim))
                AS claimed_before,
            (SELECT count(*) FROM change) AS changes";

/// One row of [`WRITE_PLAN`]'s answer.
#[derive(sqlx::FromRow)]
struct PlanAnswer {
    refused: Vec<i64>,
    rows_to_write: i64,
    rows_written: i64,
    saved: i64,
    unchanged: i64,
    closed: i64,
    already_closed: i64,
    notified: i64,
    claimed_silently: i64,
    claimed_before: i64,
    changes: i64,
}

impl StoriesWriter<'_> {
    /// What the copy holds of `ids`, locked until the transaction ends.
    pub async fn held(&mut self, ids: &[String]) -> Result<HashMap<String, HeldStory>, StoreError> {
        let rows: Vec<(String, i64, bool)> = sqlx::query_as(
            "SELECT id, version, closed FROM stories
             WHERE endpoint_id = $1 AND id = ANY($2) ORDER BY id FOR UPDATE",
        )
        .bind(self.endpoint)
        .bind(ids)
        .fetch_all(&mut *self.tx)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, version, closed)| (id, HeldStory { version, closed }))
            .collect())
    }

    /// Carries out `plan` whole, in one statement ([`WRITE_PLAN`]): its writes in order, each as
    /// seed 000's statement deciding against the row as the plan's earlier writes left it, each
    /// change appended in order; then its claims, each notification appended when its key came
    /// back and the claim notifies. The rows the plan writes must have been read with
    /// [`held`](Self::held) in this transaction. [`StoreError::Refused`] when a write did other
    /// than the plan says (another writer changed a row the plan read): roll back.
    pub async fn write_plan(
        &mut self,
        plan: &StoriesPlan,
        cause: PlanCause,
    ) -> Result<PlanWritten, StoreError> {
        if plan.writes.is_empty() && plan.claims.is_empty() {
            return Ok(PlanWritten::default());
        }
        let n = plan.writes.len();
        let mut is_close = Vec::with_capacity(n);
        let mut id = Vec::with_capacity(n);
        let mut ticker = Vec::with_capacity(n);
        let mut version = Vec::with_capacity(n);
        let mut story = Vec::with_capacity(n);
        let mut merged_into = Vec::with_capacity(n);
        let mut event_id = Vec::with_capacity(n);
        let mut planned = Vec::with_capacity(n);
        for write in &plan.writes {
            match &write.write {
                StoryWrite::Save(saved) => {
                    is_close.push(false);
                    ticker.push(saved.ticker.as_deref());
                    version.push(saved.version);
                    story.push(Some(saved.snapshot.to_string()));
                    merged_into.push(None);
                }
                StoryWrite::Close {
                    version: closing,
                    merged_into: into,
                    ..
                } => {
                    is_close.push(true);
                    ticker.push(None);
                    version.push(*closing);
                    story.push(None);
                    merged_into.push(into.as_deref());
                }
            }
            id.push(write.write.story_id());
            event_id.push(match cause {
                PlanCause::Events => write.event_id.as_deref(),
                PlanCause::Round(_) => None,
            });
            planned.push(write.change.as_ref().map(StoryChange::version));
        }
        let claims = &plan.claims;
        let answer: PlanAnswer = sqlx::query_as(WRITE_PLAN)
            .bind(self.endpoint)
            .bind(self.tenant)
            .bind(match cause {
                PlanCause::Events => None,
                PlanCause::Round(round) => Some(round),
            })
            .bind(is_close)
            .bind(id)
            .bind(ticker)
            .bind(version)
            .bind(story)
            .bind(merged_into)
            .bind(event_id)
            .bind(planned)
            .bind(claims.iter().map(|c| c.key.as_str()).collect::<Vec<_>>())
            .bind(
                claims
                    .iter()
                    .map(|c| c.story.id.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                claims
                    .iter()
                    .map(|c| c.story.ticker.as_deref())
                    .collect::<Vec<_>>(),
            )
            .bind(
                claims
                    .iter()
                    .map(|c| c.event_id.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                claims
                    .iter()
                    .map(|c| c.story.snapshot.to_string())
                    .collect::<Vec<_>>(),
            )
            .bind(claims.iter().map(|c| c.story.version).collect::<Vec<_>>())
            .bind(claims.iter().map(|c| c.notify).collect::<Vec<_>>())
            .fetch_one(&mut *self.tx)
            .await?;
        if !answer.refused.is_empty() || answer.rows_written != answer.rows_to_write {
            let stories: Vec<&str> = answer
                .refused
                .iter()
                .filter_map(|ord| usize::try_from(*ord - 1).ok())
                .filter_map(|index| plan.writes.get(index))
                .map(|write| write.write.story_id())
                .collect();
            return Err(StoreError::Refused(format!(
                "the plan's writes of {stories:?} did other than it said, and {} of the {} rows \
                 it changed were written",
                answer.rows_written, answer.rows_to_write
            )));
        }
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        let written = PlanWritten {
            saved: count(answer.saved),
            unchanged: count(answer.unchanged),
            closed: count(answer.closed),
            already_closed: count(answer.already_closed),
            notified: count(answer.notified),
            claimed_silently: count(answer.claimed_silently),
            claimed_before: count(answer.claimed_before),
            changes: count(answer.changes),
        };
        self.appended += written.changes;
        Ok(written)
    }

    /// Takes the open stories of `tickers` out of the copy (their ticker was removed from the
    /// endpoint), each with a `dropped` change caused by `round`. Closed rows stay: they keep a
    /// late event from saving a story that closed, should the ticker be added again.
    pub async fn drop_tickers(
        &mut self,
        tickers: &[String],
        round: i64,
    ) -> Result<u64, StoreError> {
        let dropped: i64 = sqlx::query_scalar(
            "WITH dropped AS (
                 DELETE FROM stories
                 WHERE endpoint_id = $1 AND NOT closed AND ticker = ANY($3)
                 RETURNING id, ticker, version
             ),
             numbered AS (
                 SELECT id, ticker, version, row_number() OVER (ORDER BY id) AS n FROM dropped
             ),
             counter AS (
                 UPDATE endpoint_change_counters SET last = last + (SELECT count(*) FROM dropped)
                 WHERE endpoint_id = $1
                 RETURNING last - (SELECT count(*) FROM dropped) AS base
             ),
             appended AS (
                 INSERT INTO changes (endpoint_id, change_seq, tenant_id, kind, operation,
                                      subject, ticker, generation, reload_generation,
                                      parts_diff, story_version)
                 SELECT $1, counter.base + numbered.n, $2, 'story', 'dropped', numbered.id,
                        numbered.ticker, 0, $4, '{}', numbered.version
                 FROM numbered, counter
                 RETURNING 1
             )
             SELECT count(*) FROM appended",
        )
        .bind(self.endpoint)
        .bind(self.tenant)
        .bind(tickers)
        .bind(round)
        .fetch_one(&mut *self.tx)
        .await?;
        let dropped = u64::try_from(dropped).unwrap_or(0);
        self.appended += dropped;
        Ok(dropped)
    }

    /// Moves the catch-up cursor from `from` to `to`, only if it is still at `from` (a page is
    /// applied once). `false`: it moved under this writer; roll back.
    ///
    /// Rules: S-CURSOR-AFTER-PAGE (services/rules/RULES.md).
    pub async fn move_cursor(
        &mut self,
        from: Option<&str>,
        to: Option<&str>,
        caught_up: bool,
    ) -> Result<bool, StoreError> {
        let moved = sqlx::query(
            "UPDATE stories_sync
             SET cursor = $3, updated_at = now(),
                 caught_up_at = CASE WHEN $4 THEN now() ELSE caught_up_at END
             WHERE endpoint_id = $1 AND cursor IS NOT DISTINCT FROM $2",
        )
        .bind(self.endpoint)
        .bind(from)
        .bind(to)
        .bind(caught_up)
        .execute(&mut *self.tx)
        .await?
        .rows_affected();
        Ok(moved == 1)
    }

    /// Notes the tickers now loaded (after their first load's writes, in the same
    /// transaction), and those removed.
    pub async fn set_loaded_tickers(&mut self, tickers: &[String]) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE stories_sync SET loaded_tickers = $2, updated_at = now() WHERE endpoint_id = $1",
        )
        .bind(self.endpoint)
        .bind(tickers)
        .execute(&mut *self.tx)
        .await?;
        Ok(())
    }

    /// A reload's last step: the cursor cleared (catch-up starts again from the window's start)
    /// and the reload no longer needed, only if no newer need was set since `round` began.
    pub async fn finish_reload(&mut self, round: i64) -> Result<bool, StoreError> {
        let finished = sqlx::query(
            "UPDATE stories_sync
             SET cursor = NULL, reload_needed = false, reload_round = NULL, reloaded_at = now(),
                 updated_at = now()
             WHERE endpoint_id = $1 AND rounds = $2",
        )
        .bind(self.endpoint)
        .bind(round)
        .execute(&mut *self.tx)
        .await?
        .rows_affected();
        Ok(finished == 1)
    }

    /// The stored messages `(from, to]` applied: the apply cursor moved only from `from`, and
    /// each message's outcome noted. `false`: the cursor moved under this writer; roll back.
    pub async fn messages_applied(
        &mut self,
        (from, to): (i64, i64),
        last_received_at: Option<OffsetDateTime>,
        outcomes: &[(i64, &str, i32)],
    ) -> Result<bool, StoreError> {
        if !crate::cursors::advance_cursor(
            &mut self.tx,
            self.tenant,
            self.endpoint,
            from,
            to,
            last_received_at,
        )
        .await?
        {
            return Ok(false);
        }
        let seqs: Vec<i64> = outcomes.iter().map(|o| o.0).collect();
        let names: Vec<&str> = outcomes.iter().map(|o| o.1).collect();
        let applied: Vec<i32> = outcomes.iter().map(|o| o.2).collect();
        sqlx::query(
            "INSERT INTO message_applications (endpoint_id, arrival_seq, tenant_id, outcome,
                 events_applied, events_ignored)
             SELECT $1, seq, $2, outcome, applied, 1 - applied
             FROM unnest($3::int8[], $4::text[], $5::int4[]) AS o(seq, outcome, applied)
             ON CONFLICT (endpoint_id, arrival_seq) DO NOTHING",
        )
        .bind(self.endpoint)
        .bind(self.tenant)
        .bind(&seqs)
        .bind(&names)
        .bind(&applied)
        .execute(&mut *self.tx)
        .await?;
        Ok(true)
    }

    /// Records `stories` as reads owed (their fetch-on-notify reads failed), in the transaction
    /// that moves the cursor past the events that asked for them. A story owed already keeps its
    /// first `owed_since` and its backoff, and counts one more recording (so a retry that read it
    /// before this one does not pay it).
    pub async fn owe_reads(&mut self, stories: &[String], error: &str) -> Result<(), StoreError> {
        if stories.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO story_reads_owed AS o (endpoint_id, story_id, tenant_id, last_error)
             SELECT $1, unnest($3::text[]), $2, $4
             ON CONFLICT (endpoint_id, story_id) DO UPDATE
               SET recorded = o.recorded + 1, last_error = excluded.last_error,
                   owed_since = least(o.owed_since, excluded.owed_since)",
        )
        .bind(self.endpoint)
        .bind(self.tenant)
        .bind(stories)
        .bind(error)
        .execute(&mut *self.tx)
        .await?;
        Ok(())
    }

    /// An owed read made: its row deleted only if no failed read recorded the story again since
    /// `recorded` was read (that one may have been for a newer change). Whether it was deleted.
    pub async fn pay_read(&mut self, owed: &OwedRead) -> Result<bool, StoreError> {
        let deleted = sqlx::query(
            "DELETE FROM story_reads_owed
             WHERE endpoint_id = $1 AND story_id = $2 AND recorded = $3",
        )
        .bind(self.endpoint)
        .bind(&owed.story_id)
        .bind(owed.recorded)
        .execute(&mut *self.tx)
        .await?
        .rows_affected();
        Ok(deleted == 1)
    }

    /// Commits (releases its savepoint, when nested); the number of changes appended.
    pub async fn commit(self) -> Result<u64, StoreError> {
        self.tx.commit().await?;
        Ok(self.appended)
    }
}

/// A stories endpoint's catch-up and reload state.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SyncState {
    pub cursor: Option<String>,
    pub rounds: i64,
    pub loaded_tickers: Vec<String>,
    pub reload_needed: bool,
    pub caught_up_at: Option<OffsetDateTime>,
    pub reloaded_at: Option<OffsetDateTime>,
}

/// The endpoint's state, its row made on first use (a new endpoint needs a reload in full: its
/// tickers' stories loaded, then catch-up from the window's start).
pub async fn sync_state(
    pool: &sqlx::PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<SyncState, StoreError> {
    Ok(sqlx::query_as(
        "WITH made AS (
             INSERT INTO stories_sync (endpoint_id, tenant_id) VALUES ($1, $2)
             ON CONFLICT (endpoint_id) DO NOTHING
             RETURNING cursor, rounds, loaded_tickers, reload_needed, caught_up_at, reloaded_at
         )
         SELECT * FROM made
         UNION ALL
         SELECT cursor, rounds, loaded_tickers, reload_needed, caught_up_at, reloaded_at
         FROM stories_sync WHERE endpoint_id = $1",
    )
    .bind(endpoint)
    .bind(tenant)
    .fetch_one(pool)
    .await?)
}

/// Begins a round (a reload in full, a ticker's load or removal): its number, which the round's
/// writes name as their cause. `reload`: the round is a reload in full, needed (and shown
/// running) from now on until [`StoriesWriter::finish_reload`] of this round clears it.
pub async fn begin_round(
    pool: &sqlx::PgPool,
    endpoint: EndpointId,
    reload: bool,
) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        "UPDATE stories_sync
         SET rounds = rounds + 1, reload_needed = reload_needed OR $2, updated_at = now(),
             reload_round = CASE WHEN $2 THEN rounds + 1 ELSE reload_round END
         WHERE endpoint_id = $1
         RETURNING rounds",
    )
    .bind(endpoint)
    .bind(reload)
    .fetch_one(pool)
    .await?)
}

/// Marks the endpoint as needing a reload in full (a 410 from catch-up, an operator's resync).
pub async fn need_reload(pool: &sqlx::PgPool, endpoint: EndpointId) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE stories_sync SET reload_needed = true, updated_at = now() WHERE endpoint_id = $1",
    )
    .bind(endpoint)
    .execute(pool)
    .await?;
    Ok(())
}

/// A story owed a read (see [`StoriesWriter::owe_reads`]).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct OwedRead {
    pub story_id: String,
    /// The recordings so far: [`StoriesWriter::pay_read`] deletes the row only at this count.
    pub recorded: i64,
    pub attempts: i32,
}

/// The endpoint's owed reads whose time has come, the longest waiting first, at most `limit`.
pub async fn owed_reads_due(
    pool: &sqlx::PgPool,
    endpoint: EndpointId,
    limit: i64,
) -> Result<Vec<OwedRead>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT story_id, recorded, attempts FROM story_reads_owed
         WHERE endpoint_id = $1 AND next_attempt_at <= now()
         ORDER BY next_attempt_at, story_id LIMIT $2",
    )
    .bind(endpoint)
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// An owed read that failed again: tried next once `pause` (relay-rules' `owed_read_pause`)
/// has passed, its attempts counted; only while its attempts are still `attempts_seen`, so of
/// two workers that failed the same read only one moves it.
pub async fn owed_read_failed(
    pool: &sqlx::PgPool,
    endpoint: EndpointId,
    story_id: &str,
    error: &str,
    attempts_seen: i32,
    pause: std::time::Duration,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE story_reads_owed
         SET attempts = attempts + 1, last_error = $3,
             next_attempt_at = now() + make_interval(secs => $4)
         WHERE endpoint_id = $1 AND story_id = $2 AND attempts = $5",
    )
    .bind(endpoint)
    .bind(story_id)
    .bind(error)
    .bind(pause.as_secs_f64())
    .bind(attempts_seen)
    .execute(pool)
    .await?;
    Ok(())
}

/// The ids of the stories the copy holds open, of `tickers` (all when `None`), after `after`
/// in id order: a reload's second step pages through them.
pub async fn open_ids(
    pool: &sqlx::PgPool,
    endpoint: EndpointId,
    after: Option<&str>,
    limit: i64,
) -> Result<Vec<String>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT id FROM stories
         WHERE endpoint_id = $1 AND NOT closed AND ($2::text IS NULL OR id > $2)
         ORDER BY id LIMIT $3",
    )
    .bind(endpoint)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// A story as the tenant reads its copy.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct CopiedStory {
    pub id: String,
    pub ticker: Option<String>,
    pub version: i64,
    pub closed: bool,
    pub story: Option<serde_json::Value>,
    /// The story a merge closed it into; `None` for an open row or one closed otherwise
    /// (defaulted for queries that do not select it).
    #[sqlx(default)]
    pub merged_into: Option<String>,
}

/// A page of the tenant's endpoint's copy by story id, after `after`: open stories only unless
/// `include_closed`, of one ticker when given.
pub async fn list(
    pool: &sqlx::PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    (ticker, include_closed): (Option<&str>, bool),
    after: Option<&str>,
    limit: i64,
) -> Result<Vec<CopiedStory>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT id, ticker, version, closed, story, merged_into FROM stories
         WHERE endpoint_id = $1 AND tenant_id = $2
           AND ($3::text IS NULL OR ticker = $3) AND ($4 OR NOT closed)
           AND ($5::text IS NULL OR id > $5)
         ORDER BY id LIMIT $6",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(ticker)
    .bind(include_closed)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// One story of the tenant's endpoint's copy.
pub async fn find(
    pool: &sqlx::PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    id: &str,
) -> Result<Option<CopiedStory>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT id, ticker, version, closed, story, merged_into FROM stories
         WHERE endpoint_id = $1 AND tenant_id = $2 AND id = $3",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(id)
    .fetch_optional(pool)
    .await?)
}

/// A claimed notification as the tenant reads it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Claim {
    pub key: String,
    pub story_id: String,
    pub ticker: Option<String>,
    /// The event that claimed it; `None` only for a claim made before it was kept whose
    /// change was forgotten since.
    pub event_id: Option<String>,
    pub claimed_at: OffsetDateTime,
    /// Whether the claim appended its notification (false: claimed silently).
    pub notified: bool,
}

/// A page of the tenant's endpoint's claimed notifications by key, after `after`.
pub async fn claims(
    pool: &sqlx::PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    after: Option<&str>,
    limit: i64,
) -> Result<Vec<Claim>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT key, story_id, ticker, event_id, claimed_at, notified FROM claimed
         WHERE endpoint_id = $1 AND tenant_id = $2 AND ($3::text IS NULL OR key > $3)
         ORDER BY key LIMIT $4",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// Stories endpoints whose sync is due: never synced, a reload needed, tickers added or removed
/// since their last load, not caught up within `interval` or since `since` (the sequencer's
/// start: catch-up on start-up and after downtime), or an owed read's time come (so an idle
/// endpoint's debts are paid). Only active endpoints with upstream settings: a sync reads the
/// upstream.
pub async fn due(
    pool: &sqlx::PgPool,
    interval: std::time::Duration,
    since: OffsetDateTime,
    only: Option<EndpointId>,
    limit: i64,
) -> Result<Vec<uuid::Uuid>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT e.id FROM webhook_endpoints e
         LEFT JOIN stories_sync s ON s.endpoint_id = e.id
         WHERE e.source = 'stories' AND e.status = 'active'
           AND e.upstream_base_url IS NOT NULL AND e.upstream_api_key_sealed IS NOT NULL
           AND (s.endpoint_id IS NULL OR s.reload_needed OR s.caught_up_at IS NULL
                OR s.caught_up_at < greatest(now() - make_interval(secs => $1), $2)
                OR NOT (s.loaded_tickers @> e.tickers AND e.tickers @> s.loaded_tickers)
                OR EXISTS (SELECT 1 FROM story_reads_owed o
                           WHERE o.endpoint_id = e.id AND o.next_attempt_at <= now()))
           AND ($4::uuid IS NULL OR e.id = $4)
         LIMIT $3",
    )
    .bind(interval.as_secs_f64())
    .bind(since)
    .bind(limit)
    .bind(only)
    .fetch_all(pool)
    .await?)
}

/// A stories endpoint's sync as its state shows it: the sync's row beside the registration's
/// tickers. Before the sequencer first looks at the endpoint there is no row, and everything is
/// owed: a reload in full, every ticker's load, the first catch-up.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SyncView {
    pub cursor: Option<String>,
    pub caught_up_at: Option<OffsetDateTime>,
    pub rounds: i64,
    pub reload_needed: bool,
    /// The round of the reload in full begun and not finished.
    pub reload_round: Option<i64>,
    pub reloaded_at: Option<OffsetDateTime>,
    /// Registered and not loaded yet, in the registration's order.
    pub tickers_loading: Vec<String>,
    /// Loaded and no longer registered: their open stories not dropped yet.
    pub tickers_dropping: Vec<String>,
    /// Stories owed a read (`story_reads_owed`), and since when the oldest is.
    pub reads_owed: i64,
    pub reads_owed_since: Option<OffsetDateTime>,
}

/// Where a stories endpoint's reload in full stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadStatus {
    /// Begun (in this round) and not finished.
    Running(i64),
    /// Needed and not begun: the next sync begins it.
    Owed,
}

impl SyncView {
    pub fn reload(&self) -> Option<ReloadStatus> {
        match (self.reload_round, self.reload_needed) {
            (Some(round), _) => Some(ReloadStatus::Running(round)),
            (None, true) => Some(ReloadStatus::Owed),
            (None, false) => None,
        }
    }
}

/// The tenant's stories endpoint's sync; `None` when the endpoint is not a stories endpoint
/// (or not the tenant's).
pub async fn sync_view<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<Option<SyncView>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT s.cursor, s.caught_up_at, coalesce(s.rounds, 0) AS rounds,
                coalesce(s.reload_needed, true) AS reload_needed, s.reload_round, s.reloaded_at,
                ARRAY(SELECT t FROM unnest(e.tickers) WITH ORDINALITY AS r(t, n)
                      WHERE t <> ALL(coalesce(s.loaded_tickers, '{}')) ORDER BY n)
                    AS tickers_loading,
                ARRAY(SELECT t FROM unnest(coalesce(s.loaded_tickers, '{}')) WITH ORDINALITY
                          AS r(t, n)
                      WHERE t <> ALL(e.tickers) ORDER BY n) AS tickers_dropping,
                o.reads_owed, o.reads_owed_since
         FROM webhook_endpoints e LEFT JOIN stories_sync s ON s.endpoint_id = e.id
         CROSS JOIN LATERAL (
             SELECT count(*) AS reads_owed, min(owed_since) AS reads_owed_since
             FROM story_reads_owed WHERE endpoint_id = e.id
         ) o
         WHERE e.id = $1 AND e.tenant_id = $2 AND e.source = 'stories'",
    )
    .bind(endpoint)
    .bind(tenant)
    .fetch_optional(db)
    .await?)
}

/// How long ago active stories endpoints last caught up, as the sequencer's gauge counts them:
/// each label with the age it reaches up to (seconds), the last for those never caught up.
pub const CATCH_UP_AGES: [(&str, Option<f64>); 5] = [
    ("within_1m", Some(60.0)),
    ("within_5m", Some(300.0)),
    ("within_1h", Some(3600.0)),
    ("older", None),
    ("never", None),
];

/// Every active stories endpoint's sync, counted: no endpoint named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SyncSummary {
    pub reloads_running: i64,
    pub reloads_owed: i64,
    /// Tickers registered and not loaded yet, over all endpoints.
    pub tickers_loading: i64,
    /// Endpoints per [`CATCH_UP_AGES`] label, in its order.
    pub catch_up_ages: [i64; 5],
    /// Stories owed a read, over all endpoints.
    pub reads_owed: i64,
}

/// Counts every active stories endpoint's sync, in one statement.
pub async fn sync_summary(pool: &sqlx::PgPool) -> Result<SyncSummary, StoreError> {
    let bounds: Vec<f64> = CATCH_UP_AGES.iter().filter_map(|(_, s)| *s).collect();
    let row: (i64, i64, i64, i64, i64, i64, i64, i64, i64) = sqlx::query_as(
        "WITH synced AS (
             SELECT s.reload_round, coalesce(s.reload_needed, true) AS reload_needed,
                    cardinality(ARRAY(SELECT unnest(e.tickers)
                                      EXCEPT SELECT unnest(coalesce(s.loaded_tickers, '{}'))))
                        AS loading,
                    extract(epoch FROM now() - s.caught_up_at) AS age,
                    (SELECT count(*) FROM story_reads_owed o WHERE o.endpoint_id = e.id) AS owed
             FROM webhook_endpoints e LEFT JOIN stories_sync s ON s.endpoint_id = e.id
             WHERE e.source = 'stories' AND e.status = 'active'
         )
         SELECT count(*) FILTER (WHERE reload_round IS NOT NULL),
                count(*) FILTER (WHERE reload_round IS NULL AND reload_needed),
                coalesce(sum(loading), 0)::int8,
                count(*) FILTER (WHERE age <= $1[1]),
                count(*) FILTER (WHERE age > $1[1] AND age <= $1[2]),
                count(*) FILTER (WHERE age > $1[2] AND age <= $1[3]),
                count(*) FILTER (WHERE age > $1[3]),
                count(*) FILTER (WHERE age IS NULL),
                coalesce(sum(owed), 0)::int8
         FROM synced",
    )
    .bind(&bounds)
    .fetch_one(pool)
    .await?;
    Ok(SyncSummary {
        reloads_running: row.0,
        reloads_owed: row.1,
        tickers_loading: row.2,
        catch_up_ages: [row.3, row.4, row.5, row.6, row.7],
        reads_owed: row.8,
    })
}
