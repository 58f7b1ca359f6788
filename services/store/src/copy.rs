//! Each endpoint's copy of the feed (`copy_items`), the event ids applied to it
//! (`applied_events`), and its outbox of changes (`changes`): relay-rules' plans carried out.
//!
//! Nothing here decides what to write: the rules do ([`relay_rules::decide_run`],
//! [`relay_rules::decide_merge`]). Every write still checks, in its own `where`, that its
//! position wins over the row as it is at that moment (the rules' precedence), so a plan made
//! from a stale view can never write an older position over a newer one: Postgres refuses the
//! row, no change is appended, and the caller sees the count fall short.
//!
//! Every change to a copy's items appends one `changes` row numbered from the endpoint's counter
//! row in the statement that wrote it, so the outbox is gapless and in commit order per
//! endpoint, and replaying it in order onto an empty map rebuilds the copy's items.

use std::collections::BTreeMap;

use relay_rules::{Decision, Held, HeldContent, HeldRow, Merge, PartsDiff, PlannedRow};
use relay_wire::{ItemKind, PartRef, Sequence};
use serde_json::{json, Value};
use sqlx::postgres::PgArguments;
use sqlx::{PgConnection, Postgres};
use uuid::Uuid;

use crate::tracks::{self, TrackClaim};
use crate::{EndpointId, StoreError, TenantId};

/// Deletes up to `batch` applied event ids recorded before `now() - older_than`; returns how
/// many it deleted (fewer than `batch`: none older are left). The retention bound is argued
/// with the table (migration 0002): an id is needed only while its event may come again, and
/// one forgotten too early costs a repeated read, never a wrong copy, because every write is
/// conditional on position. Batches keep each delete's locks and WAL small.
pub async fn forget_applied_events<'e>(
    db: impl sqlx::PgExecutor<'e>,
    older_than: std::time::Duration,
    batch: i64,
) -> Result<u64, StoreError> {
    let deleted = sqlx::query(
        "DELETE FROM applied_events WHERE ctid = ANY (ARRAY(
             SELECT ctid FROM applied_events
             WHERE applied_at < now() - make_interval(secs => $1)
             LIMIT $2
         ))",
    )
    .bind(older_than.as_secs_f64())
    .bind(batch)
    .execute(db)
    .await?
    .rows_affected();
    Ok(deleted)
}

/// Every row of the endpoint's copy with the reload round it was written in: what a merge is
/// decided against (read under the endpoint's writer lock, see [`merge`]).
async fn held_rows(
    conn: &mut PgConnection,
    endpoint: Uuid,
) -> Result<BTreeMap<String, HeldRow>, StoreError> {
    // A row's columns as `held_from_row` takes them, and its round.
    type Columns = (String, i64, String, bool, String, Option<String>, i64);
    let rows: Vec<Columns> = sqlx::query_as(
        "SELECT subject, generation, sequence, tombstone, parts::text, item::text, round
         FROM copy_items WHERE endpoint_id = $1",
    )
    .bind(endpoint)
    .fetch_all(conn)
    .await?;
    rows.into_iter()
        .map(|(subject, g, seq, tomb, parts, item, round)| {
            let (subject, held) = held_from_row((subject, g, seq, tomb, parts, item))?;
            Ok((
                subject,
                HeldRow {
                    held,
                    round: to_u64(round)?,
                },
            ))
        })
        .collect()
}

/// How a merge ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Merged {
    /// Carried out: the plan's counts.
    Merged { written: usize, removed: usize },
    /// The reload is no longer the track's, or the pass must be read again: nothing written.
    NotMerged(relay_rules::MergePlan),
    /// The fence moved on: another worker owns the endpoint.
    Fenced,
}

/// Rule "Then merge the read into the copy under the reset's generation ... Then remove
/// everything held from an older generation" for one pass of `reload`, in one transaction: the
/// endpoint held ([`tracks::open`]), the track and every row read under that hold, the merge
/// decided by relay-rules' [`relay_rules::decide_merge`], and its [`Merge`] carried out in its
/// order, each statement still deciding (a row only where its position wins; a drop only below
/// the generation; a withdrawal only of an item still at that generation from before the
/// reload). A count that falls short of the plan rolls the transaction back.
pub async fn merge(
    pool: &sqlx::PgPool,
    claim: TrackClaim,
    reload: &relay_rules::Reload,
    pass: &relay_rules::Pass,
) -> Result<Merged, StoreError> {
    let (tenant, endpoint) = (claim.tenant, claim.endpoint);
    let mut tx = pool.begin().await?;
    let Some(track) = tracks::open(&mut tx, claim).await? else {
        return Ok(Merged::Fenced);
    };
    let held = held_rows(&mut tx, endpoint.0).await?;
    let merge = match relay_rules::decide_merge(&track, reload, pass, &held) {
        relay_rules::MergePlan::Merge(merge) => *merge,
        other => return Ok(Merged::NotMerged(other)),
    };
    let written = write_merge(&mut tx, (tenant.0, endpoint.0), &merge, reload.round).await?;
    tracks::save(&mut tx, tenant, endpoint, &merge.track).await?;
    tx.commit().await?;
    Ok(Merged::Merged {
        written,
        removed: merge.dropped.iter().filter(|(_, item)| *item).count() + merge.withdrawn.len(),
    })
}

/// Items per statement of a merge's writes: big enough that round trips do not dominate, small
/// enough that one statement's arrays stay a few MB.
const MERGE_CHUNK: usize = 1000;

async fn write_merge(
    conn: &mut PgConnection,
    (tenant, endpoint): (Uuid, Uuid),
    merge: &Merge,
    reload_round: u64,
) -> Result<usize, StoreError> {
    let g = to_i64(merge.generation)?;
    let round = to_i64(merge.round)?;
    let mut written = 0;
    for chunk in merge.writes.chunks(MERGE_CHUNK) {
        let mut rows = RowArrays::default();
        let mut changes = ChangeArrays::default();
        let mut raised: (Vec<&str>, Vec<&str>) = (Vec::new(), Vec::new());
        for decision in chunk {
            match decision {
                Decision::Store {
                    subject,
                    sequence,
                    item,
                    ..
                } => {
                    let text = item.raw.to_string();
                    rows.push_item(
                        (endpoint, tenant, subject),
                        (g, sequence, round),
                        Some((item.item_kind, item.company_id)),
                        (parts_json(&item.parts), text.clone()),
                    );
                    let cause = Cause::Reload(merge.generation);
                    changes.push(endpoint, tenant, decision, cause, Some(&text))?;
                }
                // The held item, at the read's position: nothing of it is sent again.
                Decision::Unchanged {
                    subject, sequence, ..
                } => {
                    raised.0.push(subject);
                    raised.1.push(sequence.as_str());
                }
                _ => continue,
            }
        }
        let expected = rows.len();
        let mut args = PgArguments::default();
        rows.add_to(&mut args)?;
        changes.add_to(&mut args)?;
        let n: i64 = sqlx::query_scalar_with(&WRITE_ROWS, args)
            .fetch_one(&mut *conn)
            .await?;
        if n as usize != expected {
            return Err(refused(endpoint, n, expected));
        }
        let expected_raised = raised.0.len();
        let n = sqlx::query(RAISE)
            .bind(endpoint)
            .bind(g)
            .bind(round)
            .bind(raised.0)
            .bind(raised.1)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        if n as usize != expected_raised {
            return Err(refused(endpoint, n as i64, expected_raised));
        }
        written += expected + expected_raised;
    }
    let dropped = merge.dropped.len();
    let n: i64 = sqlx::query_scalar(DROP_OLDER)
        .bind(endpoint)
        .bind(tenant)
        .bind(g)
        .bind(diff_json(&PartsDiff::default()))
        .fetch_one(&mut *conn)
        .await?;
    if n as usize != dropped {
        return Err(refused(endpoint, n, dropped));
    }
    if !merge.withdrawn.is_empty() {
        let subjects: Vec<&str> = merge.withdrawn.iter().map(|(s, _)| s.as_str()).collect();
        let n: i64 = sqlx::query_scalar(WITHDRAW)
            .bind(endpoint)
            .bind(tenant)
            .bind(g)
            .bind(&subjects)
            .bind(round)
            .bind(to_i64(reload_round)?)
            .bind(diff_json(&PartsDiff::default()))
            .fetch_one(&mut *conn)
            .await?;
        if n as usize != subjects.len() {
            return Err(refused(endpoint, n, subjects.len()));
        }
    }
    Ok(written)
}

fn refused(endpoint: Uuid, n: i64, planned: usize) -> StoreError {
    StoreError::Refused(format!(
        "endpoint {endpoint}: {n} rows of {planned} planned were written"
    ))
}

/// The rows of a merge chunk and their changes: [`write_rows_cte`] and [`append_changes_ctes`]
/// with a count of the rows written.
static WRITE_ROWS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH {rows}, {changes} SELECT count(*) FROM written",
        rows = write_rows_cte(1),
        changes = append_changes_ctes(1 + RowArrays::WIDTH, "written"),
    )
});

/// A merge's `Unchanged` items: the item held is the one read, so only its position rises (to
/// the merge's generation and the read's sequence, under the same condition as a store), and
/// its round. An update, not an upsert: it names no item, and the rules decide `Unchanged`
/// only over a held item.
const RAISE: &str = "UPDATE copy_items AS held
     SET generation = $2, sequence = u.sequence, round = $3, updated_at = now()
     FROM unnest($4::text[], $5::text[]) AS u(subject, sequence)
     WHERE held.endpoint_id = $1 AND held.subject = u.subject AND NOT held.tombstone
       AND ($2 > held.generation
            OR ($2 = held.generation AND u.sequence COLLATE \"C\" > held.sequence))";

/// Rule "Then remove everything held from an older generation": items and tombstones alike, a
/// `remove` change appended for each item deleted (a tombstone's removal was reported when it
/// was made), numbered in subject order. Returns how many rows it deleted.
const DROP_OLDER: &str = "WITH dropped AS (
         DELETE FROM copy_items WHERE endpoint_id = $1 AND generation < $3
         RETURNING subject, tombstone, item_kind
     ),
     removed AS (
         SELECT subject, item_kind, row_number() OVER (ORDER BY subject COLLATE \"C\") AS n
         FROM dropped WHERE NOT tombstone
     ),
     counter AS (
         INSERT INTO endpoint_change_counters AS c (endpoint_id, tenant_id, last)
         SELECT $1, $2, count(*) FROM removed HAVING count(*) > 0
         ON CONFLICT (endpoint_id) DO UPDATE SET last = c.last + excluded.last
         RETURNING last
     ),
     change AS (
         INSERT INTO changes (endpoint_id, change_seq, tenant_id, operation, subject, item_kind,
                              generation, sequence, event_id, reload_generation, item, parts_diff)
         SELECT $1, counter.last - (SELECT count(*) FROM removed) + removed.n, $2, 'remove',
                removed.subject, removed.item_kind, $3, NULL, NULL, $3, NULL, $4::jsonb
         FROM removed CROSS JOIN counter
     )
     SELECT count(*) FROM dropped";

/// Rule R-MERGE-SAME-GENERATION: each item still held at the merge's generation from before the
/// reload began (`round` below the reload's, `$6`) becomes a tombstone at its own position, kept
/// with the merge's round, and a `remove` change is appended for it, in subject order. Returns
/// how many it withdrew.
const WITHDRAW: &str = "WITH withdrawn AS (
         UPDATE copy_items AS held
         SET tombstone = true, parts = '[]', item = NULL, company_id = NULL, round = $5,
             updated_at = now()
         WHERE held.endpoint_id = $1 AND held.subject = ANY($4::text[]) AND held.generation = $3
           AND held.round < $6 AND NOT held.tombstone
         RETURNING held.subject, held.sequence, held.item_kind
     ),
     removed AS (
         SELECT subject, sequence, item_kind,
                row_number() OVER (ORDER BY subject COLLATE \"C\") AS n
         FROM withdrawn
     ),
     counter AS (
         INSERT INTO endpoint_change_counters AS c (endpoint_id, tenant_id, last)
         SELECT $1, $2, count(*) FROM removed HAVING count(*) > 0
         ON CONFLICT (endpoint_id) DO UPDATE SET last = c.last + excluded.last
         RETURNING last
     ),
     change AS (
         INSERT INTO changes (endpoint_id, change_seq, tenant_id, operation, subject, item_kind,
                              generation, sequence, event_id, reload_generation, item, parts_diff)
         SELECT $1, counter.last - (SELECT count(*) FROM removed) + removed.n, $2, 'remove',
                removed.subject, removed.item_kind, $3, removed.sequence, NULL, $3, NULL,
                $7::jsonb
         FROM removed CROSS JOIN counter
     )
     SELECT count(*) FROM withdrawn";

/// Opens the endpoint's new change-stream epoch (see [`crate::restores::mark`], which holds the
/// counter row, the endpoint's writer lock, and set the epoch): the old epoch's changes go, the
/// snapshot of the copy is appended from change 1 (`snapshot_begin`, one `upsert` per item in
/// subject order at the item's own position, or for a stories endpoint one `saved` or `closed`
/// per story in id order, `snapshot_end`; the markers at the generation the track holds), the
/// counter is set past it and the publish cursor back to 0. A stories endpoint's notifications
/// the old epoch had not yet published follow `snapshot_end` in their order: a story is
/// notified once, by the claim, so one dropped with its epoch would never be sent (one sent
/// but not yet marked published comes again, as any change may: consumers key notifications by
/// story). Returns how many items the snapshot holds.
pub(crate) async fn open_epoch(
    conn: &mut PgConnection,
    endpoint: EndpointId,
    tenant: TenantId,
) -> Result<i64, StoreError> {
    let unsent: Vec<UnsentNotification> = sqlx::query_as(
        "WITH gone AS (DELETE FROM changes WHERE endpoint_id = $1 RETURNING *)
         SELECT subject, ticker, event_id, item, story_version FROM gone
         WHERE operation = 'notified'
           AND change_seq > COALESCE((SELECT published_through FROM endpoint_publish_cursors
                                      WHERE endpoint_id = $1), 0)
         ORDER BY change_seq",
    )
    .bind(endpoint)
    .fetch_all(&mut *conn)
    .await?;
    let items: i64 = sqlx::query_scalar(OPEN_EPOCH)
        .bind(endpoint)
        .bind(tenant)
        .bind(tracks::FEED_TRACK)
        .bind(diff_json(&PartsDiff::default()))
        .bind(
            unsent
                .iter()
                .map(|n| n.subject.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(
            unsent
                .iter()
                .map(|n| n.ticker.as_deref())
                .collect::<Vec<_>>(),
        )
        .bind(
            unsent
                .iter()
                .map(|n| n.event_id.as_deref())
                .collect::<Vec<_>>(),
        )
        .bind(unsent.iter().map(|n| n.item.as_ref()).collect::<Vec<_>>())
        .bind(unsent.iter().map(|n| n.story_version).collect::<Vec<_>>())
        .fetch_one(&mut *conn)
        .await?;
    sqlx::query(
        "INSERT INTO endpoint_publish_cursors AS p
             (endpoint_id, tenant_id, published_through, published_at)
         VALUES ($1, $2, 0, now())
         ON CONFLICT (endpoint_id) DO UPDATE SET published_through = 0, published_at = now()",
    )
    .bind(endpoint)
    .bind(tenant)
    .execute(&mut *conn)
    .await?;
    Ok(items)
}

/// A notification of the old epoch not yet published, carried into the new one.
#[derive(sqlx::FromRow)]
struct UnsentNotification {
    subject: String,
    ticker: Option<String>,
    event_id: Option<String>,
    item: Option<Value>,
    story_version: Option<i64>,
}

/// See [`open_epoch`]: `$1` endpoint, `$2` tenant, `$3` the track's name, `$4` an empty parts
/// diff, `$5`–`$9` the unsent notifications (story, ticker, event id, item, version) in order.
/// Returns the snapshot's item count.
const OPEN_EPOCH: &str = "WITH rows AS (
         SELECT 'item' AS kind, 'upsert' AS operation, subject, item_kind, generation, sequence,
                item, NULL::int8 AS story_version, NULL::text AS ticker,
                NULL::text AS merged_into
         FROM copy_items WHERE endpoint_id = $1 AND NOT tombstone
         UNION ALL
         -- A stories endpoint's copy: every row, closed ones too, so that the consumer's copy
         -- holds what the relay's does, a story merged away with the story it merged into.
         SELECT 'story', CASE WHEN closed THEN 'closed' ELSE 'saved' END, id, NULL, 0, NULL,
                story::json, version, ticker, merged_into
         FROM stories WHERE endpoint_id = $1
     ),
     items AS (
         SELECT *, row_number() OVER (ORDER BY kind, subject COLLATE \"C\") AS n FROM rows
     ),
     marker AS (
         SELECT COALESCE((SELECT generation FROM endpoint_tracks
                          WHERE endpoint_id = $1 AND track = $3), 0) AS generation
     ),
     snapshot AS (
         SELECT 1::int8 AS change_seq, 'item' AS kind, 'snapshot_begin' AS operation,
                '' AS subject, NULL::text AS item_kind, marker.generation, NULL::text AS sequence,
                NULL::json AS item, NULL::int8 AS story_version, NULL::text AS ticker,
                NULL::text AS merged_into, NULL::text AS event_id, true AS snapshot
         FROM marker
         UNION ALL
         SELECT n + 1, kind, operation, subject, item_kind, generation, sequence, item,
                story_version, ticker, merged_into, NULL, true
         FROM items
         UNION ALL
         SELECT (SELECT count(*) FROM items) + 2, 'item', 'snapshot_end', '', NULL,
                marker.generation, NULL, NULL, NULL, NULL, NULL, NULL, true
         FROM marker
         UNION ALL
         SELECT (SELECT count(*) FROM items) + 2 + u.ord, 'notification', 'notified', u.subject,
                NULL, 0, NULL, u.item::json, u.story_version, u.ticker, NULL, u.event_id, false
         FROM unnest($5::text[], $6::text[], $7::text[], $8::jsonb[], $9::int8[])
              WITH ORDINALITY AS u(subject, ticker, event_id, item, story_version, ord)
     ),
     appended AS (
         INSERT INTO changes (endpoint_id, change_seq, tenant_id, kind, operation, subject,
                              item_kind, generation, sequence, event_id, reload_generation, item,
                              parts_diff, snapshot, story_version, ticker, merged_into)
         SELECT $1, change_seq, $2, kind, operation, subject, item_kind, generation, sequence,
                event_id, NULL, item, $4::jsonb, snapshot, story_version, ticker, merged_into
         FROM snapshot
         RETURNING 1
     ),
     counter AS (
         UPDATE endpoint_change_counters SET last = (SELECT count(*) FROM appended)
         WHERE endpoint_id = $1
         RETURNING last
     )
     SELECT (SELECT count(*) FROM items) FROM counter";

/// The CTE `held` of an open statement (see `runs::open_runs`): what the copy holds of the
/// subjects in `$3`–`$4` (endpoint, subject, sorted), locked, each only after its endpoint's
/// writer lock (`writer`).
pub(crate) const HELD_CTE: &str = "held AS (
         SELECT h.*
         FROM unnest($3::uuid[], $4::text[]) AS s(endpoint_id, subject)
         JOIN writer w ON w.endpoint_id = s.endpoint_id
         CROSS JOIN LATERAL (
             SELECT c.endpoint_id, c.subject, c.generation, c.sequence, c.tombstone,
                    c.parts::text AS parts, c.item::text AS item
             FROM copy_items c
             -- By the writer's row, not the input's: no plan can lock a row of an endpoint
             -- before (or without) its writer lock.
             WHERE c.endpoint_id = w.endpoint_id AND c.subject = s.subject
             FOR UPDATE
         ) h
     )";

/// Rows to write, as the arrays of [`write_rows_cte`] ([`RowArrays::WIDTH`] parameters).
#[derive(Debug, Default)]
pub(crate) struct RowArrays {
    endpoint: Vec<Uuid>,
    tenant: Vec<Uuid>,
    subject: Vec<String>,
    generation: Vec<i64>,
    sequence: Vec<String>,
    tombstone: Vec<bool>,
    item_kind: Vec<Option<String>>,
    company_id: Vec<Option<i64>>,
    parts: Vec<Option<String>>,
    item: Vec<Option<String>>,
    round: Vec<i64>,
}

impl RowArrays {
    pub(crate) const WIDTH: u32 = 11;

    fn len(&self) -> usize {
        self.subject.len()
    }

    /// A run's row: `text` is its item's JSON when the caller has it already.
    pub(crate) fn push(
        &mut self,
        endpoint: Uuid,
        tenant: Uuid,
        row: &PlannedRow,
        text: Option<&str>,
    ) -> Result<(), StoreError> {
        let g = to_i64(row.held.generation)?;
        let round = to_i64(row.round)?;
        let key = (endpoint, tenant, row.subject.as_str());
        match &row.held.content {
            HeldContent::Item { parts, item } => {
                self.push_item(
                    key,
                    (g, &row.held.sequence, round),
                    row.facts,
                    (
                        parts_json(parts),
                        text.map_or_else(|| item.to_string(), str::to_owned),
                    ),
                );
                Ok(())
            }
            HeldContent::Tombstone => {
                self.push_key(key, (g, &row.held.sequence, round));
                self.tombstone.push(true);
                self.item_kind
                    .push(kind_of_subject(&row.subject).map(str::to_owned));
                self.company_id.push(None);
                self.parts.push(Some("[]".to_owned()));
                self.item.push(None);
                Ok(())
            }
        }
    }

    /// An item row, with its parts and item JSON; `facts` `None` keeps the kind and company
    /// the row holds (the item is the one held: a raised position).
    fn push_item(
        &mut self,
        key: (Uuid, Uuid, &str),
        position: (i64, &Sequence, i64),
        facts: Option<(ItemKind, Option<i64>)>,
        (parts, item): (String, String),
    ) {
        self.push_key(key, position);
        self.tombstone.push(false);
        self.item_kind
            .push(facts.map(|(kind, _)| kind.as_str().to_owned()));
        self.company_id.push(facts.and_then(|(_, company)| company));
        self.parts.push(Some(parts));
        self.item.push(Some(item));
    }

    fn push_key(
        &mut self,
        (endpoint, tenant, subject): (Uuid, Uuid, &str),
        (g, seq, round): (i64, &Sequence, i64),
    ) {
        self.endpoint.push(endpoint);
        self.tenant.push(tenant);
        self.subject.push(subject.to_owned());
        self.generation.push(g);
        self.sequence.push(seq.as_str().to_owned());
        self.round.push(round);
    }

    /// Adds the arrays to `args`, in [`write_rows_cte`]'s order.
    pub(crate) fn add_to(self, args: &mut PgArguments) -> Result<(), StoreError> {
        add(args, self.endpoint)?;
        add(args, self.tenant)?;
        add(args, self.subject)?;
        add(args, self.generation)?;
        add(args, self.sequence)?;
        add(args, self.tombstone)?;
        add(args, self.item_kind)?;
        add(args, self.company_id)?;
        add(args, self.parts)?;
        add(args, self.item)?;
        add(args, self.round)
    }
}

/// The CTEs `rows` and `written`: writes [`RowArrays`] bound from `$first`, each row only where
/// its position wins over the row as it is now (the precedence of the last decision that wrote
/// it: newer generation, higher sequence, or a removal at the same sequence over an item).
/// `written` returns (endpoint_id, subject) of each row written. A row whose kind is null keeps
/// the held kind and company (its item is the one held: a position raised).
pub(crate) fn write_rows_cte(first: u32) -> String {
    let [e, t, s, g, q, tb, k, c, p, i, r] = std::array::from_fn(|n| first + n as u32);
    format!(
        "rows AS MATERIALIZED (
             SELECT * FROM unnest(${e}::uuid[], ${t}::uuid[], ${s}::text[], ${g}::int8[],
                                  ${q}::text[], ${tb}::bool[], ${k}::text[], ${c}::int8[],
                                  ${p}::text[], ${i}::text[], ${r}::int8[])
                 AS r(endpoint_id, tenant_id, subject, generation, sequence, tombstone,
                      item_kind, company_id, parts, item, round)
         ),
         written AS (
             INSERT INTO copy_items AS held (endpoint_id, subject, tenant_id, generation,
                                             sequence, tombstone, item_kind, company_id, parts,
                                             item, round)
             SELECT endpoint_id, subject, tenant_id, generation, sequence, tombstone, item_kind,
                    company_id, coalesce(parts, '[]')::jsonb, item::json, round
             FROM rows
             ON CONFLICT (endpoint_id, subject) DO UPDATE
             SET generation = excluded.generation, sequence = excluded.sequence,
                 tombstone = excluded.tombstone,
                 item_kind = coalesce(excluded.item_kind, held.item_kind),
                 company_id = CASE WHEN excluded.tombstone THEN NULL
                                   WHEN excluded.item_kind IS NULL THEN held.company_id
                                   ELSE excluded.company_id END,
                 parts = excluded.parts, item = excluded.item,
                 round = excluded.round, updated_at = now()
             WHERE excluded.generation > held.generation
                OR (excluded.generation = held.generation
                    AND (excluded.sequence > held.sequence
                         OR (excluded.sequence = held.sequence
                             AND excluded.tombstone AND NOT held.tombstone)))
             RETURNING endpoint_id, subject
         )"
    )
}

/// What caused a change: recorded on its `changes` row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause<'a> {
    /// An event (a refetch's answer included: the refetch is an event of its own), by its id.
    Event(&'a str),
    /// A reload's merge, by the generation it merged under.
    Reload(u64),
}

/// Changes to append, as the arrays of [`append_changes_ctes`] ([`ChangeArrays::WIDTH`]
/// parameters).
#[derive(Debug, Default)]
pub(crate) struct ChangeArrays {
    endpoint: Vec<Uuid>,
    tenant: Vec<Uuid>,
    operation: Vec<&'static str>,
    subject: Vec<String>,
    item_kind: Vec<Option<String>>,
    generation: Vec<i64>,
    sequence: Vec<String>,
    event_id: Vec<Option<String>>,
    reload_generation: Vec<Option<i64>>,
    item: Vec<Option<String>>,
    diff: Vec<String>,
}

impl ChangeArrays {
    pub(crate) const WIDTH: u32 = 11;

    /// The change a `Store` (an upsert) or a `Tombstone` that removed an item (a removal) makes;
    /// nothing for any other decision. `text` is the stored item's JSON when the caller has it.
    pub(crate) fn push(
        &mut self,
        endpoint: Uuid,
        tenant: Uuid,
        decision: &Decision,
        cause: Cause<'_>,
        text: Option<&str>,
    ) -> Result<(), StoreError> {
        let (operation, subject, generation, sequence, kind, item, diff) = match decision {
            Decision::Store {
                subject,
                generation,
                sequence,
                item,
                diff,
            } => (
                "upsert",
                subject,
                generation,
                sequence,
                Some(item.item_kind.as_str()),
                Some(text.map_or_else(|| item.raw.to_string(), str::to_owned)),
                diff_json(diff),
            ),
            Decision::Tombstone {
                subject,
                generation,
                sequence,
                removed_item: true,
            } => (
                "remove",
                subject,
                generation,
                sequence,
                kind_of_subject(subject),
                None,
                // A removal takes the item whole: its diff names no parts.
                diff_json(&PartsDiff::default()),
            ),
            _ => return Ok(()),
        };
        self.endpoint.push(endpoint);
        self.tenant.push(tenant);
        self.operation.push(operation);
        self.subject.push(subject.clone());
        self.item_kind.push(kind.map(str::to_owned));
        self.generation.push(to_i64(*generation)?);
        self.sequence.push(sequence.as_str().to_owned());
        let (event_id, reload_generation) = match cause {
            Cause::Event(id) => (Some(id.to_owned()), None),
            Cause::Reload(g) => (None, Some(to_i64(g)?)),
        };
        self.event_id.push(event_id);
        self.reload_generation.push(reload_generation);
        self.item.push(item);
        self.diff.push(diff);
        Ok(())
    }

    /// How many changes the arrays hold.
    pub(crate) fn len(&self) -> usize {
        self.subject.len()
    }

    /// The changes `range` of the arrays as the outbox holds them once appended, numbered
    /// from `first_seq` in `epoch` and made at `at` (the appending transaction's time).
    pub(crate) fn appended(
        &self,
        range: std::ops::Range<usize>,
        (epoch, first_seq, at): (i64, i64, time::OffsetDateTime),
    ) -> Vec<crate::changes::Unpublished> {
        range
            .zip(first_seq..)
            .map(|(i, change_seq)| crate::changes::Unpublished {
                endpoint: crate::EndpointId(self.endpoint[i]),
                epoch,
                change_seq,
                kind: "item".to_owned(),
                operation: self.operation[i].to_owned(),
                subject: self.subject[i].clone(),
                item_kind: self.item_kind[i].clone(),
                generation: self.generation[i],
                sequence: Some(self.sequence[i].clone()),
                event_id: self.event_id[i].clone(),
                reload_generation: self.reload_generation[i],
                snapshot: false,
                item: self.item[i].clone(),
                parts_diff: self.diff[i].clone(),
                created_at: at,
                story_version: None,
                ticker: None,
                merged_into: None,
            })
            .collect()
    }

    /// Adds the arrays to `args`, in [`append_changes_ctes`]' order.
    pub(crate) fn add_to(self, args: &mut PgArguments) -> Result<(), StoreError> {
        add(args, self.endpoint)?;
        add(args, self.tenant)?;
        add(args, self.operation)?;
        add(args, self.subject)?;
        add(args, self.item_kind)?;
        add(args, self.generation)?;
        add(args, self.sequence)?;
        add(args, self.event_id)?;
        add(args, self.reload_generation)?;
        add(args, self.item)?;
        add(args, self.diff)
    }
}

/// Adds one bound value to a statement's arguments.
pub(crate) fn add<'q, T>(args: &mut PgArguments, value: T) -> Result<(), StoreError>
where
    T: sqlx::Encode<'q, Postgres> + sqlx::Type<Postgres> + Send + 'q,
{
    sqlx::Arguments::add(args, value)
        .map_err(|e| StoreError::Invalid(format!("a bound value: {e}")))
}

/// The CTEs `pending`, `numbered`, `counter` and `change`: appends the changes of
/// [`ChangeArrays`] bound from `$first`, only those whose subject the CTE `written_cte` wrote
/// (its rows are (endpoint_id, subject)), each endpoint's numbered from its change counter in
/// the order given. `change` returns the endpoint of each change appended.
pub(crate) fn append_changes_ctes(first: u32, written_cte: &str) -> String {
    let [e, t, o, s, k, g, q, ev, rg, i, d] = std::array::from_fn(|n| first + n as u32);
    format!(
        "pending AS MATERIALIZED (
             SELECT * FROM unnest(${e}::uuid[], ${t}::uuid[], ${o}::text[], ${s}::text[],
                                  ${k}::text[], ${g}::int8[], ${q}::text[], ${ev}::text[],
                                  ${rg}::int8[], ${i}::text[], ${d}::text[])
                 WITH ORDINALITY AS c(endpoint_id, tenant_id, operation, subject, item_kind,
                                      generation, sequence, event_id, reload_generation, item,
                                      diff, ord)
         ),
         numbered AS MATERIALIZED (
             SELECT p.*,
                    row_number() OVER (PARTITION BY p.endpoint_id ORDER BY p.ord) AS n,
                    count(*) OVER (PARTITION BY p.endpoint_id) AS total
             FROM pending p
             WHERE (p.endpoint_id, p.subject) IN (SELECT endpoint_id, subject FROM {written_cte})
         ),
         counter AS (
             INSERT INTO endpoint_change_counters AS c (endpoint_id, tenant_id, last)
             SELECT endpoint_id, tenant_id, count(*) FROM numbered
             GROUP BY endpoint_id, tenant_id
             ORDER BY endpoint_id
             ON CONFLICT (endpoint_id) DO UPDATE SET last = c.last + excluded.last
             RETURNING endpoint_id, last, epoch
         ),
         change AS (
             INSERT INTO changes (endpoint_id, change_seq, tenant_id, operation, subject,
                                  item_kind, generation, sequence, event_id, reload_generation,
                                  item, parts_diff)
             SELECT k.endpoint_id, counter.last - k.total + k.n, k.tenant_id, k.operation,
                    k.subject, k.item_kind, k.generation, k.sequence, k.event_id,
                    k.reload_generation, k.item::json, k.diff::jsonb
             FROM numbered k JOIN counter ON counter.endpoint_id = k.endpoint_id
             RETURNING endpoint_id
         )"
    )
}

type HeldColumns = (String, i64, String, bool, String, Option<String>);

pub(crate) fn held_from_row(
    (subject, generation, sequence, tombstone, parts, item): HeldColumns,
) -> Result<(String, Held), StoreError> {
    let content = if tombstone {
        HeldContent::Tombstone
    } else {
        let item = item.ok_or_else(|| invalid(format!("item row {subject} has no item")))?;
        HeldContent::Item {
            parts: parts_from_json(&parse_json(&parts)?)?,
            item: parse_json(&item)?,
        }
    };
    let held = Held {
        generation: to_u64(generation)?,
        sequence: Sequence::new(sequence),
        content,
    };
    Ok((subject, held))
}

/// The item kind a subject names (`announcement:88001`), for a tombstone's row.
fn kind_of_subject(subject: &str) -> Option<&'static str> {
    let (kind, _) = subject.split_once(':')?;
    ItemKind::parse(kind).map(ItemKind::as_str)
}

fn parts_json(parts: &[PartRef]) -> String {
    Value::Array(
        parts
            .iter()
            .map(|p| json!({"part_id": p.part_id, "part_version": p.part_version}))
            .collect(),
    )
    .to_string()
}

fn parts_from_json(value: &Value) -> Result<Vec<PartRef>, StoreError> {
    let bad = || invalid(format!("parts {value} are not [{{part_id, part_version}}]"));
    value
        .as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|p| {
            Ok(PartRef {
                part_id: p["part_id"].as_str().ok_or_else(bad)?.to_owned(),
                part_version: p["part_version"].as_i64().ok_or_else(bad)?,
            })
        })
        .collect()
}

fn diff_json(diff: &PartsDiff) -> String {
    json!({"added": diff.added, "changed": diff.changed, "removed": diff.removed}).to_string()
}

fn parse_json(text: &str) -> Result<Value, StoreError> {
    serde_json::from_str(text).map_err(|e| invalid(format!("stored JSON: {e}")))
}

fn to_i64(generation: u64) -> Result<i64, StoreError> {
    i64::try_from(generation).map_err(|_| invalid(format!("generation {generation} is too large")))
}

fn to_u64(generation: i64) -> Result<u64, StoreError> {
    u64::try_from(generation).map_err(|_| invalid(format!("generation {generation} is negative")))
}

fn invalid(what: String) -> StoreError {
    StoreError::Invalid(what)
}

/// Of `event_ids`, those applied to the endpoint's copy before (rule "De-duplicate events by
/// id"): the refetches a run need not read again.
pub async fn applied_among(
    pool: &sqlx::PgPool,
    endpoint: EndpointId,
    event_ids: &[&str],
) -> Result<std::collections::HashSet<String>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT event_id FROM applied_events WHERE endpoint_id = $1 AND event_id = ANY($2)",
    )
    .bind(endpoint)
    .bind(event_ids)
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect())
}

/// One row of an endpoint's copy as its tenant reads it; `parts` and `item` as JSON text.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct CopyItem {
    pub subject: String,
    pub item_kind: Option<String>,
    pub company_id: Option<i64>,
    pub generation: i64,
    pub sequence: String,
    pub tombstone: bool,
    pub parts: String,
    pub item: Option<String>,
    pub updated_at: time::OffsetDateTime,
}

const COPY_ITEM_COLUMNS: &str = "subject, item_kind, company_id, generation, sequence, tombstone,
     parts::text, item::text, updated_at";

/// Which of a copy's rows a page lists.
pub struct ItemFilter<'a> {
    /// The last subject of the previous page.
    pub after: Option<&'a str>,
    pub item_kind: Option<ItemKind>,
    pub company_id: Option<i64>,
    pub tombstones: bool,
}

/// A page of the tenant's endpoint's copy by subject (empty when it is not the tenant's). The
/// primary key (endpoint_id, subject) serves the order and the cursor: both compare subjects
/// under the column's own collation, so a page ends where the next one begins.
pub async fn list_items(
    pool: &sqlx::PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    filter: &ItemFilter<'_>,
    limit: i64,
) -> Result<Vec<CopyItem>, StoreError> {
    Ok(sqlx::query_as(&format!(
        "SELECT {COPY_ITEM_COLUMNS} FROM copy_items
         WHERE endpoint_id = $1 AND tenant_id = $2
           AND ($3::text IS NULL OR subject > $3)
           AND ($4::text IS NULL OR item_kind = $4)
           AND ($5::bigint IS NULL OR company_id = $5)
           AND ($6 OR NOT tombstone)
         ORDER BY subject LIMIT $7"
    ))
    .bind(endpoint)
    .bind(tenant)
    .bind(filter.after)
    .bind(filter.item_kind.map(ItemKind::as_str))
    .bind(filter.company_id)
    .bind(filter.tombstones)
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// One row of the tenant's endpoint's copy, item or tombstone.
pub async fn find_item(
    pool: &sqlx::PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    subject: &str,
) -> Result<Option<CopyItem>, StoreError> {
    Ok(sqlx::query_as(&format!(
        "SELECT {COPY_ITEM_COLUMNS} FROM copy_items
         WHERE endpoint_id = $1 AND tenant_id = $2 AND subject = $3"
    ))
    .bind(endpoint)
    .bind(tenant)
    .bind(subject)
    .fetch_optional(pool)
    .await?)
}
