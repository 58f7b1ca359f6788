//! An endpoint's copy of the feed, the event ids applied to it, and its outbox of changes.
//!
//! The rules crate (`relay-rules`) decides; this module carries the decision out. The caller (the
//! sequencer) opens a transaction, takes [`lock_endpoint`], reads the subject's row with
//! [`load_held`] (`for update`), asks the rules for a [`Decision`], and hands it to [`apply`],
//! which writes it as one statement whose `where` repeats the rules' [`precedence`] comparison
//! on the row as it is at that moment. So a caller whose view is stale (a row changed since it
//! was read, by anyone) can never write an older position over a newer one: Postgres refuses the
//! write and no change is appended.
//!
//! Every change to a copy's items appends one `changes` row numbered from the endpoint's counter
//! row in the same statement, so the outbox is gapless and in commit order per endpoint, and
//! replaying it in order onto an empty map rebuilds the copy's items.
//!
//! [`precedence`]: relay_rules::precedence()

use std::collections::{BTreeMap, HashSet};

use relay_rules::{merge_item, Decision, Held, HeldContent, PartsDiff, ReadItem};
use relay_wire::{ItemKind, PartRef, Sequence};
use serde_json::{json, Value};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// What caused a write: recorded on its `changes` row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause<'a> {
    /// An event (a refetch's answer included: the refetch is an event of its own), by its id.
    Event(&'a str),
    /// A reload's merge, by the reload's generation.
    Reload(u64),
}

/// What [`apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The decision writes nothing (`Ignore`), or nothing here (`Refetch`: the caller reads).
    Nothing,
    /// The row's `where` refused the write: what the copy holds now wins over the decision's
    /// position (the decision was made from a stale view). Nothing written, no change appended.
    Refused,
    /// The row was written; `change_seq` is the change appended, when the decision is a change.
    Written { change_seq: Option<i64> },
}

impl Applied {
    pub fn written(self) -> bool {
        matches!(self, Applied::Written { .. })
    }
}

/// One row of the outbox, as the publisher and tests read it.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub change_seq: i64,
    pub operation: Operation,
    pub subject: String,
    pub item_kind: Option<String>,
    pub generation: u64,
    /// Null for the removals of a reload's drop.
    pub sequence: Option<Sequence>,
    pub event_id: Option<String>,
    pub reload_generation: Option<u64>,
    /// The item stored, on upsert.
    pub item: Option<Value>,
    pub parts_diff: PartsDiff,
    pub published: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Upsert,
    Remove,
}

/// Creates the endpoint's change counter if needed and holds it locked until the transaction
/// ends. Call it first in every transaction that writes one endpoint's copy: writers of an
/// endpoint then queue here rather than meet in the middle (two transactions each holding a
/// subject row the other wants, and one of them the counter, would deadlock). [`apply`] and
/// [`drop_older_generations`] take the same lock anyway when they append a change.
pub async fn lock_endpoint(
    conn: &mut PgConnection,
    tenant: Uuid,
    endpoint: Uuid,
) -> Result<(), StoreError> {
    // `do update` locks the row whether it was there or not, in one statement.
    sqlx::query(
        "INSERT INTO endpoint_change_counters AS c (endpoint_id, tenant_id) VALUES ($1, $2)
         ON CONFLICT (endpoint_id) DO UPDATE SET last = c.last",
    )
    .bind(endpoint)
    .bind(tenant)
    .execute(conn)
    .await?;
    Ok(())
}

/// What the copy holds of `subject`, locked (`for update`) until the transaction ends, so the
/// decision made from it stays true until it is written.
pub async fn load_held(
    conn: &mut PgConnection,
    endpoint: Uuid,
    subject: &str,
) -> Result<Option<Held>, StoreError> {
    let row: Option<HeldRow> = sqlx::query_as(
        "SELECT subject, generation, sequence, tombstone, parts::text, item::text
         FROM copy_items WHERE endpoint_id = $1 AND subject = $2
         FOR UPDATE",
    )
    .bind(endpoint)
    .bind(subject)
    .fetch_optional(conn)
    .await?;
    row.map(|r| held_from_row(r).map(|(_, held)| held))
        .transpose()
}

/// Every row of the endpoint's copy, items and tombstones, by subject.
pub async fn copy_rows<'e>(
    db: impl sqlx::PgExecutor<'e>,
    endpoint: Uuid,
) -> Result<BTreeMap<String, Held>, StoreError> {
    let rows: Vec<HeldRow> = sqlx::query_as(
        "SELECT subject, generation, sequence, tombstone, parts::text, item::text
         FROM copy_items WHERE endpoint_id = $1 ORDER BY subject",
    )
    .bind(endpoint)
    .fetch_all(db)
    .await?;
    rows.into_iter().map(held_from_row).collect()
}

/// Rule "De-duplicate events by id, for each endpoint": records that `event_id` is applied to the
/// endpoint's copy, in the caller's transaction. True the first time; false when it was recorded
/// before (the event is a duplicate: decide `Ignore(Duplicate)`). The insert itself decides, so
/// two transactions racing on one id cannot both see "first".
pub async fn record_event_id(
    conn: &mut PgConnection,
    tenant: Uuid,
    endpoint: Uuid,
    event_id: &str,
) -> Result<bool, StoreError> {
    let first: Option<bool> = sqlx::query_scalar(
        "INSERT INTO applied_events (endpoint_id, event_id, tenant_id) VALUES ($1, $2, $3)
         ON CONFLICT (endpoint_id, event_id) DO NOTHING
         RETURNING true",
    )
    .bind(endpoint)
    .bind(event_id)
    .bind(tenant)
    .fetch_optional(conn)
    .await?;
    Ok(first.is_some())
}

// The tail shared by the item and tombstone writes: when the row was written (`written` returned
// it) and the decision is a change ($10), advance the endpoint's counter and append the change
// under the number it returns. All in the one statement that wrote the row.
macro_rules! append_change {
    () => {
        "counter AS (
             INSERT INTO endpoint_change_counters AS c (endpoint_id, tenant_id, last)
             SELECT $1, $2, 1 FROM written WHERE $10
             ON CONFLICT (endpoint_id) DO UPDATE SET last = c.last + 1
             RETURNING last
         ),
         change AS (
             INSERT INTO changes (endpoint_id, change_seq, tenant_id, operation, subject,
                                  item_kind, generation, sequence, event_id, reload_generation,
                                  item, parts_diff)
             SELECT $1, counter.last, $2, $11, $3, $6, $4, $5, $12, $13, $9::json, $14::jsonb
             FROM counter
             RETURNING change_seq
         )
         SELECT EXISTS (SELECT 1 FROM written), (SELECT change_seq FROM change)"
    };
}

/// Store: an update wins over the held row when its generation is newer, or its sequence is
/// above the held one's within the generation (relay-rules' `precedence` with `is_removal`
/// false; also the merge rule's condition for a read item, see `merge_read_item` there).
const STORE: &str = concat!(
    "WITH written AS (
         INSERT INTO copy_items AS held (endpoint_id, subject, tenant_id, generation, sequence,
                                         tombstone, item_kind, company_id, parts, item)
         VALUES ($1, $3, $2, $4, $5, false, $6, $7, $8::jsonb, $9::json)
         ON CONFLICT (endpoint_id, subject) DO UPDATE
         SET generation = excluded.generation, sequence = excluded.sequence, tombstone = false,
             item_kind = excluded.item_kind, company_id = excluded.company_id,
             parts = excluded.parts, item = excluded.item, updated_at = now()
         WHERE excluded.generation > held.generation
            OR (excluded.generation = held.generation AND excluded.sequence > held.sequence)
         RETURNING 1
     ),
     ",
    append_change!()
);

/// Tombstone: a removal wins at an equal sequence too; but a tombstone already at exactly this
/// position is the removal carried out before (`Ignore(AlreadyRemoved)` in the rules), so it is
/// not written again and appends no second change.
const TOMBSTONE: &str = concat!(
    "WITH written AS (
         INSERT INTO copy_items AS held (endpoint_id, subject, tenant_id, generation, sequence,
                                         tombstone, item_kind, company_id, parts, item)
         VALUES ($1, $3, $2, $4, $5, true, $6, $7, $8::jsonb, $9::json)
         ON CONFLICT (endpoint_id, subject) DO UPDATE
         SET generation = excluded.generation, sequence = excluded.sequence, tombstone = true,
             item_kind = coalesce(excluded.item_kind, held.item_kind), company_id = NULL,
             parts = '[]', item = NULL, updated_at = now()
         WHERE excluded.generation > held.generation
            OR (excluded.generation = held.generation
                AND (excluded.sequence > held.sequence
                     OR (excluded.sequence = held.sequence AND NOT held.tombstone)))
         RETURNING 1
     ),
     ",
    append_change!()
);

/// Unchanged: the held item is the one the event carries, so only the position rises, under the
/// same condition as a store. An update, not an upsert: there is no item to insert, and with no
/// row held the rules never decide `Unchanged`. A tombstone is never "the same item".
const UNCHANGED: &str = "UPDATE copy_items AS held
     SET generation = $3, sequence = $4, updated_at = now()
     WHERE held.endpoint_id = $1 AND held.subject = $2 AND NOT held.tombstone
       AND ($3 > held.generation
            OR ($3 = held.generation AND $4::text COLLATE \"C\" > held.sequence))";

/// Carries out a decision of the rules on the endpoint's copy, in the caller's transaction.
///
/// `Store`, `Unchanged` and `Tombstone` are each one statement that compares the decision's
/// position with the row as it is now and writes only when the decision wins (so a decision made
/// from a stale view is [`Applied::Refused`], not written over a newer row). When the row was
/// written and the decision is a change ([`Decision::is_change`]), the same statement appends the
/// change: `upsert` with the item and the decision's parts diff, or `remove` for a tombstone that
/// removed an item. `Refetch` and `Ignore` write nothing.
///
/// The decision's parts diff and `removed_item` are what the caller's view said: take that view
/// with [`load_held`] in the same transaction, so that it is the row the statement writes over.
/// (`Unchanged` names no item: made from a stale view, it would raise the position of whatever
/// item is held now. Under `load_held`'s lock it cannot be stale.)
pub async fn apply(
    conn: &mut PgConnection,
    tenant: Uuid,
    endpoint: Uuid,
    decision: &Decision,
    cause: Cause<'_>,
) -> Result<Applied, StoreError> {
    let (event_id, reload_generation) = match cause {
        Cause::Event(id) => (Some(id), None),
        Cause::Reload(g) => (None, Some(to_i64(g)?)),
    };
    let row: (bool, Option<i64>) = match decision {
        Decision::Store {
            subject,
            generation,
            sequence,
            item,
            diff,
        } => {
            sqlx::query_as(STORE)
                .bind(endpoint)
                .bind(tenant)
                .bind(subject)
                .bind(to_i64(*generation)?)
                .bind(sequence.as_str())
                .bind(item.item_kind.as_str())
                .bind(item.company_id)
                .bind(parts_json(&item.parts))
                .bind(item.raw.to_string())
                .bind(decision.is_change())
                .bind("upsert")
                .bind(event_id)
                .bind(reload_generation)
                .bind(diff_json(diff))
                .fetch_one(conn)
                .await?
        }
        Decision::Tombstone {
            subject,
            generation,
            sequence,
            ..
        } => {
            sqlx::query_as(TOMBSTONE)
                .bind(endpoint)
                .bind(tenant)
                .bind(subject)
                .bind(to_i64(*generation)?)
                .bind(sequence.as_str())
                .bind(kind_of_subject(subject))
                .bind(None::<i64>)
                .bind("[]")
                .bind(None::<String>)
                .bind(decision.is_change())
                .bind("remove")
                .bind(event_id)
                .bind(reload_generation)
                // A removal takes the item whole: its diff names no parts.
                .bind(diff_json(&PartsDiff::default()))
                .fetch_one(conn)
                .await?
        }
        Decision::Unchanged {
            subject,
            generation,
            sequence,
        } => {
            let updated = sqlx::query(UNCHANGED)
                .bind(endpoint)
                .bind(subject)
                .bind(to_i64(*generation)?)
                .bind(sequence.as_str())
                .execute(conn)
                .await?
                .rows_affected();
            (updated == 1, None)
        }
        Decision::Refetch { .. } | Decision::Ignore(_) => return Ok(Applied::Nothing),
    };
    Ok(match row {
        (true, change_seq) => Applied::Written { change_seq },
        (false, _) => Applied::Refused,
    })
}

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

/// Rule "De-duplicate events by id, for each endpoint", for many events at once: records the ids
/// and returns those recorded for the first time now (the rest were applied before). The insert
/// decides, as in [`record_event_id`].
pub async fn record_event_ids(
    conn: &mut PgConnection,
    tenant: Uuid,
    endpoint: Uuid,
    event_ids: &[&str],
) -> Result<HashSet<String>, StoreError> {
    if event_ids.is_empty() {
        return Ok(HashSet::new());
    }
    let first: Vec<String> = sqlx::query_scalar(
        "INSERT INTO applied_events (endpoint_id, event_id, tenant_id)
         SELECT $1, id, $3 FROM unnest($2::text[]) AS ids(id)
         ON CONFLICT (endpoint_id, event_id) DO NOTHING
         RETURNING event_id",
    )
    .bind(endpoint)
    .bind(event_ids)
    .bind(tenant)
    .fetch_all(conn)
    .await?;
    Ok(first.into_iter().collect())
}

/// A row as held, with what the copy keeps beside it for reads (kind, company).
#[derive(Debug, Clone, PartialEq)]
pub struct HeldEntry {
    pub held: Held,
    pub item_kind: Option<String>,
    pub company_id: Option<i64>,
}

/// What the copy holds of `subjects`, locked (`for update`) until the transaction ends.
pub async fn load_held_many(
    conn: &mut PgConnection,
    endpoint: Uuid,
    subjects: &[&str],
) -> Result<BTreeMap<String, HeldEntry>, StoreError> {
    if subjects.is_empty() {
        return Ok(BTreeMap::new());
    }
    let rows: Vec<HeldEntryRow> = sqlx::query_as(
        "SELECT subject, generation, sequence, tombstone, parts::text, item::text, item_kind,
                company_id
         FROM copy_items WHERE endpoint_id = $1 AND subject = ANY($2)
         ORDER BY subject COLLATE \"C\"
         FOR UPDATE",
    )
    .bind(endpoint)
    .bind(subjects)
    .fetch_all(conn)
    .await?;
    rows.into_iter().map(held_entry_from_row).collect()
}

/// One endpoint's part of [`RECORD_AND_LOAD_CTES`]: the ids of its run's events, and the
/// subjects they touch.
#[derive(Debug, Clone, Copy)]
pub struct RunKeys<'a> {
    pub endpoint: Uuid,
    pub tenant: Uuid,
    pub event_ids: &'a [&'a str],
    pub subjects: &'a [&'a str],
}

/// What [`RECORD_AND_LOAD_CTES`] found for one endpoint: the ids not applied before (now
/// recorded), and what the copy holds of the subjects asked for (locked).
#[derive(Debug, Clone, Default)]
pub struct RunHeld {
    pub first_seen: HashSet<String>,
    pub held: BTreeMap<String, HeldEntry>,
}

impl RunHeld {
    /// Adds a row `held` returned (its columns in the order the CTE names them).
    #[allow(clippy::too_many_arguments)]
    pub fn add_held(
        &mut self,
        subject: String,
        generation: i64,
        sequence: String,
        tombstone: bool,
        parts: String,
        item: Option<String>,
        item_kind: Option<String>,
        company_id: Option<i64>,
    ) -> Result<(), StoreError> {
        let (subject, entry) = held_entry_from_row((
            subject, generation, sequence, tombstone, parts, item, item_kind, company_id,
        ))?;
        self.held.insert(subject, entry);
        Ok(())
    }
}

/// Several endpoints' [`RunKeys`] as the arrays `$1`–`$5` of [`RECORD_AND_LOAD_CTES`].
#[derive(Debug, Default)]
pub struct RunKeyArrays<'a> {
    e_endpoint: Vec<Uuid>,
    e_id: Vec<&'a str>,
    e_tenant: Vec<Uuid>,
    s_endpoint: Vec<Uuid>,
    s_subject: Vec<&'a str>,
}

impl<'a> RunKeyArrays<'a> {
    pub fn new(runs: &[RunKeys<'a>]) -> Self {
        let mut arrays = Self::default();
        let mut keys: Vec<(Uuid, &str)> = Vec::new();
        for run in runs {
            for id in run.event_ids {
                arrays.e_endpoint.push(run.endpoint);
                arrays.e_tenant.push(run.tenant);
                arrays.e_id.push(id);
            }
            keys.extend(run.subjects.iter().map(|subject| (run.endpoint, *subject)));
        }
        // Rows are locked in the order given (each read by its key, whatever the table's
        // statistics): endpoint, then subject in byte order, as `load_held_many` locks them.
        keys.sort_unstable();
        keys.dedup();
        (arrays.s_endpoint, arrays.s_subject) = keys.into_iter().unzip();
        arrays
    }

    /// Binds `$1`–`$5`.
    pub fn bind<'q, O>(
        self,
        query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>
    where
        'a: 'q,
    {
        query
            .bind(self.e_endpoint)
            .bind(self.e_id)
            .bind(self.e_tenant)
            .bind(self.s_endpoint)
            .bind(self.s_subject)
    }
}

/// [`record_event_ids`] and [`load_held_many`] for several endpoints' runs, as CTEs of a
/// statement that takes the endpoints' writer locks itself (see [`lock_endpoint`]) in a CTE
/// `writer (endpoint_id)` before these: only the endpoints it returns are recorded and read,
/// each after its lock (both join it). `recorded (endpoint_id, event_id)` is every id not
/// applied before, now recorded; `held (endpoint_id, subject, generation, sequence, tombstone,
/// parts, item, item_kind, company_id)` is what the copy holds of the subjects, locked
/// (`for update`). The arrays are `$1`–`$5` ([`RunKeyArrays`]); the caller numbers its own from
/// `$6` and writes the final `SELECT`.
pub const RECORD_AND_LOAD_CTES: &str = "recorded AS (
         INSERT INTO applied_events (endpoint_id, event_id, tenant_id)
         SELECT ids.endpoint_id, ids.event_id, ids.tenant_id
         FROM unnest($1::uuid[], $2::text[], $3::uuid[]) AS ids(endpoint_id, event_id, tenant_id)
         JOIN writer w ON w.endpoint_id = ids.endpoint_id
         ON CONFLICT (endpoint_id, event_id) DO NOTHING
         RETURNING endpoint_id, event_id
     ),
     held AS (
         SELECT h.*
         FROM unnest($4::uuid[], $5::text[]) AS s(endpoint_id, subject)
         JOIN writer w ON w.endpoint_id = s.endpoint_id
         CROSS JOIN LATERAL (
             SELECT c.endpoint_id, c.subject, c.generation, c.sequence, c.tombstone,
                    c.parts::text AS parts, c.item::text AS item, c.item_kind, c.company_id
             FROM copy_items c
             -- By the writer's row, not the input's: no plan can lock a row of an endpoint
             -- before (or without) its writer lock.
             WHERE c.endpoint_id = w.endpoint_id AND c.subject = s.subject
             FOR UPDATE
         ) h
     )";

type HeldEntryRow = (
    String,
    i64,
    String,
    bool,
    String,
    Option<String>,
    Option<String>,
    Option<i64>,
);

fn held_entry_from_row(
    (subject, g, seq, tomb, parts, item, item_kind, company_id): HeldEntryRow,
) -> Result<(String, HeldEntry), StoreError> {
    let (subject, held) = held_from_row((subject, g, seq, tomb, parts, item))?;
    Ok((
        subject,
        HeldEntry {
            held,
            item_kind,
            company_id,
        },
    ))
}

/// One decided change to append, and the event that caused it.
#[derive(Debug, Clone, Copy)]
pub struct DecidedChange<'a> {
    pub decision: &'a Decision,
    pub event_id: &'a str,
    /// The stored item's JSON text, when the caller has it already (it is the row's too).
    pub item_text: Option<&'a str>,
}

/// The rows that several endpoints' runs of decisions left, and the changes to append, as the
/// arrays `$1`–`$20` of [`WRITE_DECIDED_CTES`]. Each run's rows are its subjects once each, as
/// the rules' reference copy holds them after carrying the decisions out in order, decided under
/// the endpoint's writer lock and the rows' locks ([`RECORD_AND_LOAD_CTES`]). The
/// caller appends CTEs of its own (numbered from `$21`), so what else its transaction writes
/// goes in the same round trip.
#[derive(Debug, Default)]
pub struct DecidedWrites {
    r_endpoint: Vec<Uuid>,
    r_tenant: Vec<Uuid>,
    subjects: Vec<String>,
    generations: Vec<i64>,
    sequences: Vec<String>,
    tombstones: Vec<bool>,
    item_kinds: Vec<Option<String>>,
    company_ids: Vec<Option<i64>>,
    parts: Vec<String>,
    items: Vec<Option<String>>,
    c_endpoint: Vec<Uuid>,
    c_tenant: Vec<Uuid>,
    c_op: Vec<&'static str>,
    c_subject: Vec<String>,
    c_kind: Vec<Option<String>>,
    c_generation: Vec<i64>,
    c_sequence: Vec<String>,
    c_event: Vec<String>,
    c_item: Vec<Option<String>>,
    c_diff: Vec<String>,
}

impl DecidedWrites {
    /// Adds one endpoint's run: its rows (subject, row, the row item's text when the caller has
    /// it) and its changes, in the order they are to be numbered.
    pub fn push(
        &mut self,
        endpoint: Uuid,
        tenant: Uuid,
        rows: &[(&str, &HeldEntry, Option<&str>)],
        changes: &[DecidedChange<'_>],
    ) -> Result<(), StoreError> {
        for (subject, row, text) in rows {
            self.r_endpoint.push(endpoint);
            self.r_tenant.push(tenant);
            self.subjects.push((*subject).to_owned());
            self.generations.push(to_i64(row.held.generation)?);
            self.sequences.push(row.held.sequence.as_str().to_owned());
            self.item_kinds.push(row.item_kind.clone());
            self.company_ids.push(row.company_id);
            match &row.held.content {
                HeldContent::Item { parts, item } => {
                    self.tombstones.push(false);
                    self.parts.push(parts_json(parts));
                    self.items
                        .push(Some(text.map_or_else(|| item.to_string(), str::to_owned)));
                }
                HeldContent::Tombstone => {
                    self.tombstones.push(true);
                    self.parts.push("[]".to_owned());
                    self.items.push(None);
                }
            }
        }
        for change in changes {
            match change.decision {
                Decision::Store {
                    subject,
                    generation,
                    sequence,
                    item,
                    diff,
                } => {
                    self.c_op.push("upsert");
                    self.c_subject.push(subject.clone());
                    self.c_kind.push(Some(item.item_kind.as_str().to_owned()));
                    self.c_generation.push(to_i64(*generation)?);
                    self.c_sequence.push(sequence.as_str().to_owned());
                    self.c_item.push(Some(
                        change
                            .item_text
                            .map_or_else(|| item.raw.to_string(), str::to_owned),
                    ));
                    self.c_diff.push(diff_json(diff));
                }
                Decision::Tombstone {
                    subject,
                    generation,
                    sequence,
                    removed_item: true,
                } => {
                    self.c_op.push("remove");
                    self.c_subject.push(subject.clone());
                    self.c_kind
                        .push(kind_of_subject(subject).map(str::to_owned));
                    self.c_generation.push(to_i64(*generation)?);
                    self.c_sequence.push(sequence.as_str().to_owned());
                    self.c_item.push(None);
                    self.c_diff.push(diff_json(&PartsDiff::default()));
                }
                _ => continue,
            }
            self.c_endpoint.push(endpoint);
            self.c_tenant.push(tenant);
            self.c_event.push(change.event_id.to_owned());
        }
        Ok(())
    }

    /// Binds `$1`–`$20`.
    pub fn bind<'q, O>(
        self,
        query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
        query
            .bind(self.r_endpoint)
            .bind(self.r_tenant)
            .bind(self.subjects)
            .bind(self.generations)
            .bind(self.sequences)
            .bind(self.tombstones)
            .bind(self.item_kinds)
            .bind(self.company_ids)
            .bind(self.parts)
            .bind(self.items)
            .bind(self.c_endpoint)
            .bind(self.c_tenant)
            .bind(self.c_op)
            .bind(self.c_subject)
            .bind(self.c_kind)
            .bind(self.c_generation)
            .bind(self.c_sequence)
            .bind(self.c_event)
            .bind(self.c_item)
            .bind(self.c_diff)
    }
}

/// The CTEs that write [`DecidedWrites`] (the caller adds its own and the final `SELECT`).
///
/// They still decide: a row is written only where its position wins over the row as it is now
/// (the precedence of the last decision that wrote it: newer generation, higher sequence, or a
/// removal at the same sequence over an item), and an endpoint's changes are appended only for
/// its subjects written, numbered from its change counter in the order given. `written` returns
/// (endpoint, subject) for each row written, `change` the endpoint of each change appended.
pub const WRITE_DECIDED_CTES: &str = "WITH input AS MATERIALIZED (
         SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::int8[], $5::text[],
                              $6::bool[], $7::text[], $8::int8[], $9::text[], $10::text[])
             AS r(endpoint_id, tenant_id, subject, generation, sequence, tombstone, item_kind,
                  company_id, parts, item)
     ),
     written AS (
         INSERT INTO copy_items AS held (endpoint_id, subject, tenant_id, generation, sequence,
                                         tombstone, item_kind, company_id, parts, item)
         SELECT endpoint_id, subject, tenant_id, generation, sequence, tombstone, item_kind,
                company_id, parts::jsonb, item::json
         FROM input
         ON CONFLICT (endpoint_id, subject) DO UPDATE
         SET generation = excluded.generation, sequence = excluded.sequence,
             tombstone = excluded.tombstone,
             item_kind = coalesce(excluded.item_kind, held.item_kind),
             company_id = excluded.company_id, parts = excluded.parts, item = excluded.item,
             updated_at = now()
         WHERE excluded.generation > held.generation
            OR (excluded.generation = held.generation
                AND (excluded.sequence > held.sequence
                     OR (excluded.sequence = held.sequence
                         AND excluded.tombstone AND NOT held.tombstone)))
         RETURNING endpoint_id, subject
     ),
     pending AS MATERIALIZED (
         SELECT * FROM unnest($11::uuid[], $12::uuid[], $13::text[], $14::text[], $15::text[],
                              $16::int8[], $17::text[], $18::text[], $19::text[], $20::text[])
             WITH ORDINALITY AS c(endpoint_id, tenant_id, operation, subject, item_kind,
                                  generation, sequence, event_id, item, diff, ord)
     ),
     kept AS MATERIALIZED (
         SELECT p.*,
                row_number() OVER (PARTITION BY p.endpoint_id ORDER BY p.ord) AS n,
                count(*) OVER (PARTITION BY p.endpoint_id) AS total
         FROM pending p
         WHERE (p.endpoint_id, p.subject) IN (SELECT endpoint_id, subject FROM written)
     ),
     counter AS (
         INSERT INTO endpoint_change_counters AS c (endpoint_id, tenant_id, last)
         SELECT endpoint_id, tenant_id, count(*) FROM kept
         GROUP BY endpoint_id, tenant_id
         ORDER BY endpoint_id
         ON CONFLICT (endpoint_id) DO UPDATE SET last = c.last + excluded.last
         RETURNING endpoint_id, last
     ),
     change AS (
         INSERT INTO changes (endpoint_id, change_seq, tenant_id, operation, subject, item_kind,
                              generation, sequence, event_id, reload_generation, item, parts_diff)
         SELECT k.endpoint_id, counter.last - k.total + k.n, k.tenant_id, k.operation,
                k.subject, k.item_kind, k.generation, k.sequence, k.event_id, NULL,
                k.item::json, k.diff::jsonb
         FROM kept k JOIN counter ON counter.endpoint_id = k.endpoint_id
         RETURNING endpoint_id
     )";

/// Rule "Then merge the read into the copy under the reset's generation", for one item read:
/// keep what the copy holds of its subject at that generation at the same sequence or a later
/// one, or at a newer generation; otherwise store the item read at (`generation`, its sequence).
///
/// Decided by relay-rules' [`merge_item`] against the row read with [`load_held`] (so the parts
/// diff is against the item held), and written by [`apply`] with [`Cause::Reload`]: the merge
/// condition is the update's precedence at (`generation`, read sequence), so `apply`'s one
/// conditional upsert is the merge's. A change row is appended when the item changed (`Store`);
/// `Unchanged` only raises the row's position, which keeps it from the drop that follows.
pub async fn merge_read_item(
    conn: &mut PgConnection,
    tenant: Uuid,
    endpoint: Uuid,
    generation: u64,
    read: &ReadItem,
) -> Result<(Decision, Applied), StoreError> {
    let held = load_held(conn, endpoint, &read.subject).await?;
    let decision = merge_item(held.as_ref(), generation, read);
    let applied = apply(conn, tenant, endpoint, &decision, Cause::Reload(generation)).await?;
    Ok((decision, applied))
}

/// [`merge_read_item`] for a whole pass, in few statements: what a 100,000-item reload needs.
///
/// The caller holds [`lock_endpoint`] (every writer of the endpoint's copy takes it first), so
/// the rows read here stay as read until the transaction ends. Each item read is decided by
/// relay-rules' [`merge_item`] against that row; a subject read twice (pages overlap while the
/// feed moves) keeps its later item. The writes go out in chunks, each one statement whose
/// `where` still carries the merge condition, appending a change for every item stored.
/// Returns how many items were stored or had their position raised.
pub async fn merge_read_items(
    conn: &mut PgConnection,
    tenant: Uuid,
    endpoint: Uuid,
    generation: u64,
    read: &[ReadItem],
) -> Result<usize, StoreError> {
    // The last read of each subject, by the read's sequence (later pages may carry newer ones).
    let mut winners: BTreeMap<&str, &ReadItem> = BTreeMap::new();
    for item in read {
        match winners.get(item.subject.as_str()) {
            Some(held) if held.sequence > item.sequence => {}
            _ => {
                winners.insert(item.subject.as_str(), item);
            }
        }
    }
    let held = copy_rows(&mut *conn, endpoint).await?;
    let mut stores: Vec<(&ReadItem, PartsDiff)> = Vec::new();
    let mut unchanged: Vec<&ReadItem> = Vec::new();
    for (subject, item) in &winners {
        match merge_item(held.get(*subject), generation, item) {
            Decision::Store { diff, .. } => stores.push((item, diff)),
            Decision::Unchanged { .. } => unchanged.push(item),
            _ => {}
        }
    }
    let g = to_i64(generation)?;
    let mut written = 0;
    for chunk in stores.chunks(MERGE_CHUNK) {
        let n: i64 = sqlx::query_scalar(MERGE_STORE)
            .bind(endpoint)
            .bind(tenant)
            .bind(g)
            .bind(
                chunk
                    .iter()
                    .map(|(i, _)| i.subject.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                chunk
                    .iter()
                    .map(|(i, _)| i.sequence.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                chunk
                    .iter()
                    .map(|(i, _)| i.item.item_kind.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                chunk
                    .iter()
                    .map(|(i, _)| i.item.company_id)
                    .collect::<Vec<_>>(),
            )
            .bind(
                chunk
                    .iter()
                    .map(|(i, _)| parts_json(&i.item.parts))
                    .collect::<Vec<_>>(),
            )
            .bind(
                chunk
                    .iter()
                    .map(|(i, _)| i.item.raw.to_string())
                    .collect::<Vec<_>>(),
            )
            .bind(chunk.iter().map(|(_, d)| diff_json(d)).collect::<Vec<_>>())
            .fetch_one(&mut *conn)
            .await?;
        written += n as usize;
    }
    for chunk in unchanged.chunks(MERGE_CHUNK) {
        written += sqlx::query(
            "UPDATE copy_items AS held SET generation = $2, sequence = u.sequence,
                 updated_at = now()
             FROM unnest($3::text[], $4::text[]) AS u(subject, sequence)
             WHERE held.endpoint_id = $1 AND held.subject = u.subject AND NOT held.tombstone
               AND ($2 > held.generation
                    OR ($2 = held.generation AND u.sequence COLLATE \"C\" > held.sequence))",
        )
        .bind(endpoint)
        .bind(g)
        .bind(chunk.iter().map(|i| i.subject.as_str()).collect::<Vec<_>>())
        .bind(
            chunk
                .iter()
                .map(|i| i.sequence.as_str())
                .collect::<Vec<_>>(),
        )
        .execute(&mut *conn)
        .await?
        .rows_affected() as usize;
    }
    Ok(written)
}

/// Items per statement of [`merge_read_items`]: big enough that round trips do not dominate,
/// small enough that one statement's arrays stay a few MB.
const MERGE_CHUNK: usize = 1000;

/// The merge's store for many subjects (each at most once): the same condition as [`STORE`]
/// (the merge rule is the update's precedence at the read's position), and a change appended,
/// numbered in subject order, for every row written.
const MERGE_STORE: &str = "WITH input AS MATERIALIZED (
         SELECT * FROM unnest($4::text[], $5::text[], $6::text[], $7::int8[], $8::text[],
                              $9::text[], $10::text[])
             WITH ORDINALITY AS i(subject, sequence, item_kind, company_id, parts, item, diff, ord)
     ),
     written AS (
         INSERT INTO copy_items AS held (endpoint_id, subject, tenant_id, generation, sequence,
                                         tombstone, item_kind, company_id, parts, item)
         SELECT $1, subject, $2, $3, sequence, false, item_kind, company_id, parts::jsonb,
                item::json
         FROM input ORDER BY ord
         ON CONFLICT (endpoint_id, subject) DO UPDATE
         SET generation = excluded.generation, sequence = excluded.sequence, tombstone = false,
             item_kind = excluded.item_kind, company_id = excluded.company_id,
             parts = excluded.parts, item = excluded.item, updated_at = now()
         WHERE excluded.generation > held.generation
            OR (excluded.generation = held.generation AND excluded.sequence > held.sequence)
         RETURNING subject
     ),
     numbered AS (
         SELECT i.*, row_number() OVER (ORDER BY i.ord) AS n
         FROM input i JOIN written w ON w.subject = i.subject
     ),
     counter AS (
         INSERT INTO endpoint_change_counters AS c (endpoint_id, tenant_id, last)
         SELECT $1, $2, count(*) FROM numbered HAVING count(*) > 0
         ON CONFLICT (endpoint_id) DO UPDATE SET last = c.last + excluded.last
         RETURNING last
     ),
     change AS (
         INSERT INTO changes (endpoint_id, change_seq, tenant_id, operation, subject, item_kind,
                              generation, sequence, event_id, reload_generation, item, parts_diff)
         SELECT $1, counter.last - (SELECT count(*) FROM numbered) + numbered.n, $2, 'upsert',
                numbered.subject, numbered.item_kind, $3, numbered.sequence, NULL, $3,
                numbered.item::json, numbered.diff::jsonb
         FROM numbered CROSS JOIN counter
         RETURNING 1
     )
     SELECT count(*) FROM written";

/// Rule "Then remove everything held from an older generation" (after a reload of `generation`
/// merged its read): one `delete ... where generation < $g`, items and tombstones alike, which in
/// the same statement appends a `remove` change for each item deleted (a tombstone's removal was
/// reported when it was made). Returns the subjects of the items removed, in change order.
pub async fn drop_older_generations(
    conn: &mut PgConnection,
    tenant: Uuid,
    endpoint: Uuid,
    generation: u64,
) -> Result<Vec<String>, StoreError> {
    let removed: Vec<String> = sqlx::query_scalar(
        "WITH dropped AS (
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
             INSERT INTO changes (endpoint_id, change_seq, tenant_id, operation, subject,
                                  item_kind, generation, sequence, event_id, reload_generation,
                                  item, parts_diff)
             SELECT $1, counter.last - (SELECT count(*) FROM removed) + removed.n, $2, 'remove',
                    removed.subject, removed.item_kind, $3, NULL, NULL, $3, NULL, $4::jsonb
             FROM removed CROSS JOIN counter
             RETURNING subject, change_seq
         )
         SELECT subject FROM change ORDER BY change_seq",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(to_i64(generation)?)
    .bind(diff_json(&PartsDiff::default()))
    .fetch_all(conn)
    .await?;
    Ok(removed)
}

/// The endpoint's changes in `change_seq` order.
pub async fn list_changes<'e>(
    db: impl sqlx::PgExecutor<'e>,
    endpoint: Uuid,
) -> Result<Vec<Change>, StoreError> {
    type Row = (
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
        bool,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT c.change_seq, c.operation, c.subject, c.item_kind, c.generation, c.sequence,
                c.event_id, c.reload_generation, c.item::text, c.parts_diff::text,
                c.change_seq <= COALESCE(p.published_through, 0)
         FROM changes c
         LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = c.endpoint_id
         WHERE c.endpoint_id = $1 ORDER BY c.change_seq",
    )
    .bind(endpoint)
    .fetch_all(db)
    .await?;
    rows.into_iter()
        .map(
            |(
                seq,
                op,
                subject,
                item_kind,
                generation,
                sequence,
                event_id,
                reload,
                item,
                diff,
                published,
            )| {
                Ok(Change {
                    change_seq: seq,
                    operation: match op.as_str() {
                        "upsert" => Operation::Upsert,
                        "remove" => Operation::Remove,
                        other => return Err(invalid(format!("change operation {other}"))),
                    },
                    subject,
                    item_kind,
                    generation: to_u64(generation)?,
                    sequence: sequence.map(Sequence::new),
                    event_id,
                    reload_generation: reload.map(to_u64).transpose()?,
                    item: item.map(|t| parse_json(&t)).transpose()?,
                    parts_diff: diff_from_json(&parse_json(&diff)?)?,
                    published,
                })
            },
        )
        .collect()
}

type HeldRow = (String, i64, String, bool, String, Option<String>);

fn held_from_row(
    (subject, generation, sequence, tombstone, parts, item): HeldRow,
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

fn diff_from_json(value: &Value) -> Result<PartsDiff, StoreError> {
    let list = |key: &str| -> Result<Vec<String>, StoreError> {
        value[key]
            .as_array()
            .ok_or_else(|| invalid(format!("parts diff {value} has no {key}")))?
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| invalid(format!("parts diff {value}")))
            })
            .collect()
    };
    Ok(PartsDiff {
        added: list("added")?,
        changed: list("changed")?,
        removed: list("removed")?,
    })
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
