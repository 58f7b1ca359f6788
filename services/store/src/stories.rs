//! A stories endpoint's copy (seed 000's `stories` table), its claimed notifications
//! (`claimed`), its catch-up and reload state (`stories_sync`), its reads owed
//! (`story_reads_owed`), and the outbox rows its writes append.
//!
//! Every write runs in a [`StoriesWriter`]: one transaction that checked the endpoint's fence and
//! holds its writer lock (the change counter's row), so a run of webhooks, a catch-up page and a
//! reload's batch of one endpoint never interleave. Each write is still seed 000's statement,
//! deciding in itself, and appends its change in the same statement only when the row changed:
//! the save's `where` passed, the close made an open (or absent) row closed or raised a closed
//! row's version, the claim's insert returned its key. The sequencer's plan (relay-rules'
//! `decide_stories_run`) says what it expects each write to do; a write that does otherwise was
//! raced, and the transaction is rolled back ([`StoreError::Refused`]).

use std::collections::HashMap;

use relay_rules::HeldStory;
use sqlx::{Postgres, Transaction};
use time::OffsetDateTime;

use crate::{fences, EndpointId, StoreError, TenantId};

/// What caused a write, named by its change: an event (a webhook's or a catch-up page's), or a
/// round of the endpoint's (a reload in full, a ticker's first load or its removal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause<'a> {
    Event(&'a str),
    Round(i64),
}

impl Cause<'_> {
    fn event_id(self) -> Option<String> {
        match self {
            Cause::Event(id) => Some(id.to_owned()),
            Cause::Round(_) => None,
        }
    }

    fn round(self) -> Option<i64> {
        match self {
            Cause::Event(_) => None,
            Cause::Round(round) => Some(round),
        }
    }
}

/// A story as the writes take it: its id, ticker, version and the snapshot's JSON text.
#[derive(Debug, Clone, Copy)]
pub struct StoryRow<'a> {
    pub id: &'a str,
    pub ticker: Option<&'a str>,
    pub version: i64,
    pub snapshot: &'a serde_json::Value,
}

/// One transaction over a stories endpoint: fence checked, writer lock held.
pub struct StoriesWriter {
    tx: Transaction<'static, Postgres>,
    tenant: TenantId,
    endpoint: EndpointId,
    appended: u64,
}

/// Opens the endpoint's write transaction: `None` when `token` is no longer its fencing token
/// (another worker owns it now; nothing was written).
pub async fn open(
    pool: &sqlx::PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    token: i64,
) -> Result<Option<StoriesWriter>, StoreError> {
    let mut tx = pool.begin().await?;
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

/// Saves a snapshot (seed 000's first write), appending a `saved` change when it wrote.
const SAVE: &str = "WITH saved AS (
         insert into stories (endpoint_id, tenant_id, id, ticker, version, closed, story)
         values ($1, $2, $3, $4, $5, false, $6)
         on conflict (endpoint_id, id) do update
           set ticker = excluded.ticker, version = excluded.version,
             story = excluded.story
           where not stories.closed and stories.version < excluded.version
         returning id, ticker, version, story
     ),
     counter AS (
         UPDATE endpoint_change_counters SET last = last + 1
         WHERE endpoint_id = $1 AND EXISTS (SELECT 1 FROM saved)
         RETURNING last
     )
     INSERT INTO changes (endpoint_id, change_seq, tenant_id, kind, operation, subject, ticker,
                          generation, event_id, reload_generation, item, parts_diff,
                          story_version)
     SELECT $1, counter.last, $2, 'story', 'saved', saved.id, saved.ticker, 0, $7, $8,
            saved.story::json, '{}', saved.version
     FROM saved, counter
     RETURNING change_seq";

/// Closes a story for good (seed 000's second write), appending a `closed` change when the row
/// was absent or open, or closed with a smaller version. `prior` is read in the statement's own
/// snapshot, so it is the row as this transaction left it before the write. The row keeps the
/// `merged_into` of the close that appended its change, so a read says what the queue said.
const CLOSE: &str = "WITH prior AS (
         SELECT version, closed FROM stories WHERE endpoint_id = $1 AND id = $3
     ),
     closed AS (
         insert into stories (endpoint_id, tenant_id, id, version, closed, story, merged_into)
         values ($1, $2, $3, $4, true, null, $5)
         on conflict (endpoint_id, id) do update
           set closed = true, story = null,
             version = greatest(stories.version, excluded.version),
             merged_into = CASE WHEN stories.closed AND stories.version >= excluded.version
                                THEN stories.merged_into ELSE excluded.merged_into END
         returning id, ticker, version
     ),
     counter AS (
         UPDATE endpoint_change_counters SET last = last + 1
         WHERE endpoint_id = $1 AND EXISTS (
             SELECT 1 FROM closed c
             WHERE NOT coalesce((SELECT p.closed AND p.version >= c.version FROM prior p), false))
         RETURNING last
     )
     INSERT INTO changes (endpoint_id, change_seq, tenant_id, kind, operation, subject, ticker,
                          generation, event_id, reload_generation, parts_diff, story_version,
                          merged_into)
     SELECT $1, counter.last, $2, 'story', 'closed', closed.id, closed.ticker, 0, $6, $7, '{}',
            closed.version, $5
     FROM closed, counter
     RETURNING change_seq";

/// Claims a notification (seed 000's single insert), appending a `notified` change only when
/// the insert returned its key and `$8` (notify) holds: a silent claim takes the key all the
/// same, so no later event of the story notifies. Whether the key came back, and whether a
/// change was appended.
const CLAIM: &str = "WITH claim AS (
         insert into claimed (endpoint_id, tenant_id, key, story_id, ticker, event_id, notified)
         values ($1, $2, 'strong:' || $3, $3, $4, $5, $8)
         on conflict do nothing
         returning key
     ),
     counter AS (
         UPDATE endpoint_change_counters SET last = last + 1
         WHERE endpoint_id = $1 AND $8 AND EXISTS (SELECT 1 FROM claim)
         RETURNING last
     ),
     notified AS (
         INSERT INTO changes (endpoint_id, change_seq, tenant_id, kind, operation, subject,
                              ticker, generation, event_id, item, parts_diff, story_version)
         SELECT $1, counter.last, $2, 'notification', 'notified', $3, $4, 0, $5, $6::json, '{}',
                $7
         FROM claim, counter
         RETURNING change_seq
     )
     SELECT EXISTS (SELECT 1 FROM claim), EXISTS (SELECT 1 FROM notified)";

/// What [`StoriesWriter::claim_strong`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimed {
    /// The key was claimed and the notification appended.
    Notified,
    /// The key was claimed and nothing sent (the caller said not to notify).
    Silently,
    /// The key was claimed before: nothing done.
    Already,
}

impl StoriesWriter {
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

    /// The save; whether it wrote (and appended its change). `expected`: what the plan said it
    /// would do; a save that does otherwise was raced.
    pub async fn save(
        &mut self,
        story: StoryRow<'_>,
        cause: Cause<'_>,
        expected: bool,
    ) -> Result<bool, StoreError> {
        let seq: Option<i64> = sqlx::query_scalar(SAVE)
            .bind(self.endpoint)
            .bind(self.tenant)
            .bind(story.id)
            .bind(story.ticker)
            .bind(story.version)
            .bind(story.snapshot)
            .bind(cause.event_id())
            .bind(cause.round())
            .fetch_optional(&mut *self.tx)
            .await?;
        self.check("save", story.id, seq.is_some(), expected)
    }

    /// The close; whether it changed the row (and appended its change).
    pub async fn close(
        &mut self,
        (id, version, merged_into): (&str, i64, Option<&str>),
        cause: Cause<'_>,
        expected: bool,
    ) -> Result<bool, StoreError> {
        let seq: Option<i64> = sqlx::query_scalar(CLOSE)
            .bind(self.endpoint)
            .bind(self.tenant)
            .bind(id)
            .bind(version)
            .bind(merged_into)
            .bind(cause.event_id())
            .bind(cause.round())
            .fetch_optional(&mut *self.tx)
            .await?;
        self.check("close", id, seq.is_some(), expected)
    }

    /// Claims `strong:<story id>`, and when this call claimed it and `notify` holds appends
    /// the notification, with the snapshot of the event that claimed it.
    pub async fn claim_strong(
        &mut self,
        story: StoryRow<'_>,
        event_id: &str,
        notify: bool,
    ) -> Result<Claimed, StoreError> {
        let (claimed, notified): (bool, bool) = sqlx::query_as(CLAIM)
            .bind(self.endpoint)
            .bind(self.tenant)
            .bind(story.id)
            .bind(story.ticker)
            .bind(event_id)
            .bind(story.snapshot)
            .bind(story.version)
            .bind(notify)
            .fetch_one(&mut *self.tx)
            .await?;
        Ok(match (claimed, notified) {
            (true, true) => {
                self.appended += 1;
                Claimed::Notified
            }
            (true, false) => Claimed::Silently,
            (false, _) => Claimed::Already,
        })
    }

    fn check(
        &mut self,
        what: &str,
        id: &str,
        wrote: bool,
        expected: bool,
    ) -> Result<bool, StoreError> {
        if wrote != expected {
            return Err(StoreError::Refused(format!(
                "the {what} of story {id:?} {} a change the plan {}",
                if wrote { "made" } else { "did not make" },
                if expected {
                    "expected"
                } else {
                    "did not expect"
                }
            )));
        }
        if wrote {
            self.appended += 1;
        }
        Ok(wrote)
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

    /// Commits; the number of changes appended.
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

/// An owed read that failed again: tried next after `first` doubled per attempt before this
/// one, at most `max`, plus a random part of itself (as `RetryPolicy`'s pauses).
pub async fn owed_read_failed(
    pool: &sqlx::PgPool,
    endpoint: EndpointId,
    story_id: &str,
    error: &str,
    (first, max): (std::time::Duration, std::time::Duration),
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE story_reads_owed
         SET attempts = attempts + 1, last_error = $3,
             next_attempt_at = now() + make_interval(
                 secs => least($5, $4 * power(2, least(attempts, 30))) * (1 + random()))
         WHERE endpoint_id = $1 AND story_id = $2",
    )
    .bind(endpoint)
    .bind(story_id)
    .bind(error)
    .bind(first.as_secs_f64())
    .bind(max.as_secs_f64())
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
           AND e.upstream_base_url IS NOT NULL AND e.upstream_api_key IS NOT NULL
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
