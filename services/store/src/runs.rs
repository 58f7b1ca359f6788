//! The apply transaction's two statements, for several endpoints' runs at once: [`open_runs`]
//! (fences, writer locks, track rows, the event ids applied before, the copy's rows of the runs'
//! subjects) and [`write_runs`] (relay-rules' [`RunPlan`] carried out: rows, changes, track,
//! event ids, outcomes, messages set aside, cursors), and [`quarantine_next`] for a message whose
//! apply keeps failing. The copy's, the tracks' and the quarantine's parts of these statements
//! are their modules' CTEs; only this crate splices them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::LazyLock;

use relay_rules::{Decision, EndpointTrack, Held, Outcome, RunPlan};
use sqlx::postgres::PgArguments;
use sqlx::PgConnection;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::changes::Unpublished;
use crate::copy::{self, add, RowArrays};
use crate::tracks::{self, TrackClaim, FEED_TRACK, TRACK_COLUMNS};
use crate::{quarantine, EndpointId, StoreError, TenantId};

/// One endpoint's claim in [`open_runs`], and the keys of its run: its event ids and the
/// subjects its events touch (relay-rules' `event_ids` and `subjects`).
#[derive(Debug, Clone, Copy)]
pub struct RunClaim<'a> {
    pub claim: TrackClaim,
    pub event_ids: &'a [&'a str],
    pub subjects: &'a [&'a str],
}

/// What [`open_runs`] found for an endpoint it holds: its track row (locked), its run's event
/// ids applied before, and what its copy holds of the run's subjects (locked): the inputs of
/// relay-rules' `decide_run`.
#[derive(Debug, Clone, Default)]
pub struct OpenedRun {
    pub track: EndpointTrack,
    pub seen: HashSet<String>,
    pub held: BTreeMap<String, Held>,
    /// Another writer of the endpoint (a reload's merge) appended changes that committed after
    /// the statement's snapshot was taken, while it waited for the writer lock: rows that writer
    /// inserted are missing from `held`, so nothing may be decided from it. Roll back and open
    /// again (a new statement sees them).
    pub stale: bool,
}

/// Opens several endpoints' runs in one statement (one round trip): for each claim in the order
/// given, `None` when its fence moved on (nothing of it locked past the fence row); else its
/// track row, ids and rows ([`OpenedRun`]). Each endpoint's locks come in the order every writer
/// takes them (fence, writer lock, track, rows; each part joins the one before), and the
/// endpoints in id order, so two such statements never wait on each other in a cycle.
///
/// The statement's snapshot is taken before it waits for a writer lock: rows another writer
/// inserted while it waited (a reload's merge) are not seen here. Every such row comes with a
/// change that writer appended, so the endpoint's change counter as locked is past the one the
/// snapshot shows: the run is marked [`OpenedRun::stale`], and the caller rolls back and opens
/// again. (Rows it updated or deleted are read as they are now: the rows are read locked.)
pub async fn open_runs(
    conn: &mut PgConnection,
    runs: &[RunClaim<'_>],
) -> Result<Vec<Option<OpenedRun>>, StoreError> {
    let mut sorted: Vec<&RunClaim> = runs.iter().collect();
    sorted.sort_by_key(|r| r.claim.endpoint);
    let mut e_endpoint = Vec::new();
    let mut e_id = Vec::new();
    let mut keys: Vec<(Uuid, &str)> = Vec::new();
    for run in &sorted {
        for id in run.event_ids {
            e_endpoint.push(run.claim.endpoint);
            e_id.push(*id);
        }
        keys.extend(run.subjects.iter().map(|s| (run.claim.endpoint.0, *s)));
    }
    // Rows are locked in the order given: endpoint, then subject in byte order.
    keys.sort_unstable();
    keys.dedup();
    let (s_endpoint, s_subject): (Vec<Uuid>, Vec<&str>) = keys.into_iter().unzip();
    let rows: Vec<OpenRow> = sqlx::query_as(&OPEN_RUNS)
        .bind(e_endpoint)
        .bind(e_id)
        .bind(s_endpoint)
        .bind(s_subject)
        .bind(sorted.iter().map(|r| r.claim.endpoint).collect::<Vec<_>>())
        .bind(sorted.iter().map(|r| r.claim.tenant).collect::<Vec<_>>())
        .bind(sorted.iter().map(|r| r.claim.token).collect::<Vec<_>>())
        .bind(FEED_TRACK)
        .fetch_all(conn)
        .await?;
    let mut opened: HashMap<Uuid, OpenedRun> = HashMap::new();
    let (track_rows, other_rows): (Vec<OpenRow>, Vec<OpenRow>) =
        rows.into_iter().partition(|row| row.kind == OPENED_TRACK);
    for row in track_rows {
        if !row.owned {
            continue;
        }
        let track = match row.last_was_reset {
            // A track never written: nothing held yet.
            None => EndpointTrack::default(),
            Some(last_was_reset) => tracks::track_from_row((
                row.generation,
                row.access_version,
                row.through,
                last_was_reset,
                row.last_reset_generation,
                row.reload,
                row.reloads_begun.unwrap_or(0),
            ))?,
        };
        let run = OpenedRun {
            track,
            stale: row.stale.unwrap_or(false),
            ..OpenedRun::default()
        };
        opened.insert(row.endpoint_id, run);
    }
    // Every id and copy row belongs to an endpoint opened (each joins its writer lock).
    for row in other_rows {
        let run = opened.get_mut(&row.endpoint_id).ok_or_else(|| {
            StoreError::Invalid(format!("{} row for an endpoint not opened", row.kind))
        })?;
        let key = row
            .key
            .ok_or_else(|| StoreError::Invalid("open row without its key".into()))?;
        if row.kind == OPENED_EVENT_ID {
            run.seen.insert(key);
            continue;
        }
        let (Some(generation), Some(sequence), Some(tombstone), Some(parts)) =
            (row.generation, row.sequence, row.tombstone, row.parts)
        else {
            return Err(StoreError::Invalid(format!("copy row {key} is incomplete")));
        };
        let (subject, held) =
            copy::held_from_row((key, generation, sequence, tombstone, parts, row.item))?;
        run.held.insert(subject, held);
    }
    Ok(runs
        .iter()
        .map(|r| opened.remove(&r.claim.endpoint.0))
        .collect())
}

/// The kinds of row [`OPEN_RUNS`] returns.
const OPENED_TRACK: i16 = 0;
const OPENED_EVENT_ID: i16 = 1;
const OPENED_COPY_ROW: i16 = 2;

/// One row of [`OPEN_RUNS`]: an endpoint's track (`owned` false: its fence moved on; `stale`:
/// see [`OpenedRun::stale`]), one of its ids applied before (`key` the event id), or one of its
/// copy's rows (`key` the subject).
#[derive(sqlx::FromRow)]
struct OpenRow {
    kind: i16,
    endpoint_id: Uuid,
    owned: bool,
    stale: Option<bool>,
    key: Option<String>,
    generation: Option<i64>,
    access_version: Option<String>,
    through: Option<String>,
    last_was_reset: Option<bool>,
    last_reset_generation: Option<i64>,
    reload: Option<serde_json::Value>,
    reloads_begun: Option<i64>,
    sequence: Option<String>,
    tombstone: Option<bool>,
    parts: Option<String>,
    item: Option<String>,
}

/// [`open_runs`]' statement: the ids `$1`–`$2` (endpoint, event id), the subjects `$3`–`$4`
/// (endpoint, subject, sorted), the claims `$5`–`$7` (endpoint, tenant, token, in endpoint
/// order), the track's name `$8`.
static OPEN_RUNS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {claims},
         opened AS MATERIALIZED (
             SELECT w.endpoint_id, w.last AS locked_last, t.*
             FROM writer w
             LEFT JOIN LATERAL (
                 SELECT {TRACK_COLUMNS} FROM endpoint_tracks
                 WHERE endpoint_id = w.endpoint_id AND track = $8
                 FOR UPDATE
             ) t ON true
         ),
         seen AS (
             SELECT a.endpoint_id, a.event_id
             FROM unnest($1::uuid[], $2::text[]) AS ids(endpoint_id, event_id)
             JOIN opened o ON o.endpoint_id = ids.endpoint_id
             JOIN applied_events a
                 ON a.endpoint_id = o.endpoint_id AND a.event_id = ids.event_id
         ),
         {held}
         -- The counter as the snapshot shows it (this statement's own write of it is not
         -- seen): behind the one locked when a writer committed changes after the snapshot.
         SELECT {OPENED_TRACK}::int2 AS kind, i.endpoint_id, o.endpoint_id IS NOT NULL AS owned,
                o.endpoint_id IS NOT NULL AND o.locked_last IS DISTINCT FROM coalesce(
                    (SELECT k.last FROM endpoint_change_counters k
                     WHERE k.endpoint_id = o.endpoint_id), 0) AS stale,
                NULL::text AS key, o.generation, o.access_version, o.through, o.last_was_reset,
                o.last_reset_generation, o.reload, o.reloads_begun, NULL::text AS sequence,
                NULL::bool AS tombstone, NULL::text AS parts, NULL::text AS item
         FROM input i LEFT JOIN opened o ON o.endpoint_id = i.endpoint_id
         UNION ALL
         SELECT {OPENED_EVENT_ID}::int2, endpoint_id, true, NULL, event_id, NULL, NULL, NULL,
                NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
         FROM seen
         UNION ALL
         SELECT {OPENED_COPY_ROW}::int2, endpoint_id, true, NULL, subject, generation, NULL,
                NULL, NULL, NULL, NULL, NULL, sequence, tombstone, parts, item
         FROM held",
        claims = tracks::claim_ctes(5),
        held = copy::HELD_CTE,
    )
});

/// One endpoint's run to write: its plan, and where its apply cursor moves (from `from`, where
/// the run read it, to `to`).
pub struct RunWrite<'a> {
    pub endpoint: EndpointId,
    pub tenant: TenantId,
    pub plan: &'a RunPlan,
    pub from: i64,
    pub to: i64,
    /// The arrival numbers of the run's messages, in the plan's order.
    pub arrival_seqs: &'a [i64],
    pub last_received_at: Option<OffsetDateTime>,
}

/// What [`write_runs`] wrote for one endpoint.
#[derive(Debug, Clone, Default)]
pub struct RunWritten {
    /// Copy rows written (each planned row whose position still won).
    pub rows: i64,
    /// Changes appended to the outbox.
    pub changes: i64,
    /// False when the cursor was not at `from`: someone else applied these messages.
    pub cursor_moved: bool,
    /// The changes appended, as the outbox holds them (what the publisher would read back),
    /// once the transaction commits; empty when they are not all the plan's (a row refused:
    /// the caller rolls back).
    pub appended: Vec<Unpublished>,
}

/// Carries out several endpoints' [`RunPlan`]s in one statement (one round trip), in the plan's
/// order: the rows (each written only where its position wins over the row as it is now), the
/// changes of the rows written (numbered from each endpoint's counter), the track rows that
/// changed, the event ids kept, the outcomes, the messages set aside, and each cursor (moved
/// only from where its run read it). Returns what was written for each run, in the order given.
pub async fn write_runs(
    conn: &mut PgConnection,
    runs: &[RunWrite<'_>],
) -> Result<Vec<RunWritten>, StoreError> {
    let mut rows = RowArrays::default();
    let mut changes = copy::ChangeArrays::default();
    let mut t = tracks::TrackArrays::default();
    let (mut k_endpoint, mut k_tenant, mut k_event) = (Vec::new(), Vec::new(), Vec::new());
    let mut o_endpoint = Vec::new();
    let mut o_tenant = Vec::new();
    let mut o_seq = Vec::new();
    let mut o_outcome = Vec::new();
    let mut o_applied = Vec::new();
    let mut o_ignored = Vec::new();
    let mut q_endpoint = Vec::new();
    let mut q_tenant = Vec::new();
    let mut q_seq = Vec::new();
    let mut q_reason = Vec::new();
    // Each run's changes in the arrays, by position.
    let mut ranges = Vec::with_capacity(runs.len());
    for run in runs {
        let plan = run.plan;
        // Each stored item serialised once: for its change and, when it is the row's, its row.
        let texts: Vec<Option<String>> = plan
            .changes
            .iter()
            .map(|c| match &c.decision {
                Decision::Store { item, .. } => Some(item.raw.to_string()),
                _ => None,
            })
            .collect();
        for row in &plan.rows {
            let text = row.change.and_then(|i| texts[i].as_deref());
            rows.push(run.endpoint.0, run.tenant.0, row, text)?;
        }
        let first = changes.len();
        for (change, text) in plan.changes.iter().zip(&texts) {
            let cause = copy::Cause::Event(&change.event_id);
            changes.push(
                run.endpoint.0,
                run.tenant.0,
                &change.decision,
                cause,
                text.as_deref(),
            )?;
        }
        ranges.push(first..changes.len());
        if let Some(track) = &plan.track {
            t.push(run.endpoint, run.tenant, track)?;
        }
        for id in &plan.keep {
            k_endpoint.push(run.endpoint.0);
            k_tenant.push(run.tenant.0);
            k_event.push(id.as_str());
        }
        for (message, seq) in plan.messages.iter().zip(run.arrival_seqs) {
            if !message.is_exception() {
                continue;
            }
            o_endpoint.push(run.endpoint.0);
            o_tenant.push(run.tenant.0);
            o_seq.push(*seq);
            o_outcome.push(message.outcome.as_str());
            o_applied.push(i32::try_from(message.events_applied).unwrap_or(i32::MAX));
            o_ignored.push(i32::try_from(message.events_ignored).unwrap_or(i32::MAX));
            if let Some(why) = &message.quarantined {
                q_endpoint.push(run.endpoint);
                q_tenant.push(run.tenant);
                q_seq.push(*seq);
                q_reason.push(quarantine::reason_text(&why.to_string()));
            }
        }
    }
    // A body that does not parse is set aside at its first look.
    let q_attempts = vec![1i32; q_seq.len()];
    // Taken before the arrays are bound, numbered once the statement has said from where.
    let appended: Vec<Vec<Unpublished>> = ranges
        .iter()
        .map(|range| changes.appended(range.clone(), (0, 0, OffsetDateTime::UNIX_EPOCH)))
        .collect();
    let mut args = PgArguments::default();
    rows.add_to(&mut args)?;
    changes.add_to(&mut args)?;
    t.add_to(&mut args)?;
    add(&mut args, k_endpoint)?;
    add(&mut args, k_tenant)?;
    add(&mut args, k_event)?;
    add(&mut args, o_endpoint)?;
    add(&mut args, o_tenant)?;
    add(&mut args, o_seq)?;
    add(&mut args, o_outcome)?;
    add(&mut args, o_applied)?;
    add(&mut args, o_ignored)?;
    add(
        &mut args,
        runs.iter().map(|r| r.endpoint).collect::<Vec<_>>(),
    )?;
    add(&mut args, runs.iter().map(|r| r.tenant).collect::<Vec<_>>())?;
    add(&mut args, runs.iter().map(|r| r.from).collect::<Vec<_>>())?;
    add(&mut args, runs.iter().map(|r| r.to).collect::<Vec<_>>())?;
    add(
        &mut args,
        runs.iter().map(|r| r.last_received_at).collect::<Vec<_>>(),
    )?;
    add(&mut args, q_endpoint)?;
    add(&mut args, q_tenant)?;
    add(&mut args, q_seq)?;
    add(&mut args, q_reason)?;
    add(&mut args, q_attempts)?;
    let found: Vec<WrittenRow> = sqlx::query_as_with(&WRITE_RUNS, args)
        .fetch_all(conn)
        .await?;
    let mut found: HashMap<Uuid, WrittenRow> = found
        .into_iter()
        .map(|row| (row.endpoint_id, row))
        .collect();
    Ok(runs
        .iter()
        .zip(appended)
        .map(|(r, mut appended)| {
            let Some(row) = found.remove(&r.endpoint.0) else {
                return RunWritten::default();
            };
            let mut written = RunWritten {
                rows: row.rows,
                changes: row.changes,
                cursor_moved: row.moved == 1,
                appended: Vec::new(),
            };
            if let (Some(last), Some(epoch)) = (row.last_change_seq, row.epoch) {
                if written.changes == appended.len() as i64 {
                    let first = last - written.changes + 1;
                    for (change, seq) in appended.iter_mut().zip(first..) {
                        change.epoch = epoch;
                        change.change_seq = seq;
                        change.created_at = row.at;
                    }
                    written.appended = appended;
                }
            }
            written
        })
        .collect())
}

/// One endpoint's row of [`WRITE_RUNS`]: what it wrote, and where its change counter ended (in
/// which epoch), at the transaction's time.
#[derive(sqlx::FromRow)]
struct WrittenRow {
    endpoint_id: Uuid,
    rows: i64,
    changes: i64,
    moved: i64,
    last_change_seq: Option<i64>,
    epoch: Option<i64>,
    at: OffsetDateTime,
}

/// [`write_runs`]' statement: the rows and changes (the copy's CTEs), the tracks that changed,
/// the ids kept, the outcomes, the cursors (endpoint, tenant, from, to, the last message's
/// receipt time) and the messages set aside, each numbered from the end of the one before, in
/// the order [`write_runs`] binds them. A cursor moves only from where the run read it: updated
/// where it is at `from`, or created when the run read none (`from` 0) and there is still none.
static WRITE_RUNS: LazyLock<String> = LazyLock::new(|| {
    let rows = 1;
    let changes = rows + RowArrays::WIDTH;
    let track = changes + copy::ChangeArrays::WIDTH;
    let kept = track + tracks::TrackArrays::WIDTH;
    let outcomes = kept + 3;
    let cursors = outcomes + 6;
    let q = cursors + 5;
    format!(
        "WITH {written},
         {changes},
         {saved_track},
         kept AS (
             INSERT INTO applied_events (endpoint_id, tenant_id, event_id)
             SELECT * FROM unnest(${k}::uuid[], ${k1}::uuid[], ${k2}::text[])
             ON CONFLICT (endpoint_id, event_id) DO NOTHING
         ),
         noted AS (
             INSERT INTO message_applications (endpoint_id, arrival_seq, tenant_id, outcome,
                 events_applied, events_ignored)
             SELECT endpoint_id, seq, tenant_id, outcome, applied, ignored
             FROM unnest(${o}::uuid[], ${o1}::uuid[], ${o2}::int8[], ${o3}::text[], ${o4}::int4[],
                         ${o5}::int4[])
                 AS o(endpoint_id, tenant_id, seq, outcome, applied, ignored)
             ON CONFLICT (endpoint_id, arrival_seq) DO NOTHING
         ),
         runs AS MATERIALIZED (
             SELECT * FROM unnest(${c}::uuid[], ${c1}::uuid[], ${c2}::int8[], ${c3}::int8[],
                                  ${c4}::timestamptz[])
                 AS k(endpoint_id, tenant_id, from_seq, to_seq, received_at)
         ),
         moved AS (
             UPDATE endpoint_apply_cursors AS c
             SET applied_arrival_seq = k.to_seq,
                 last_received_at = coalesce(k.received_at, c.last_received_at),
                 last_applied_at = now()
             FROM runs k
             -- `= ANY` as well as the join: without statistics the planner joins the few
             -- runs against a scan of every cursor; this makes it read the runs' by key.
             WHERE c.endpoint_id = ANY(${c}::uuid[])
               AND c.endpoint_id = k.endpoint_id AND c.applied_arrival_seq = k.from_seq
             RETURNING c.endpoint_id
         ),
         created AS (
             INSERT INTO endpoint_apply_cursors (endpoint_id, tenant_id, applied_arrival_seq,
                 last_received_at, last_applied_at)
             SELECT endpoint_id, tenant_id, to_seq, received_at, now() FROM runs
             WHERE from_seq = 0
             ON CONFLICT (endpoint_id) DO NOTHING
             RETURNING endpoint_id
         ),
         {quarantined}
         SELECT k.endpoint_id, coalesce(w.n, 0) AS rows, coalesce(c.n, 0) AS changes,
                coalesce(m.n, 0) + coalesce(n.n, 0) AS moved, q.last AS last_change_seq,
                q.epoch, now() AS at
         FROM runs k
         LEFT JOIN counter q ON q.endpoint_id = k.endpoint_id
         LEFT JOIN (SELECT endpoint_id, count(*) AS n FROM written GROUP BY 1) w
             ON w.endpoint_id = k.endpoint_id
         LEFT JOIN (SELECT endpoint_id, count(*) AS n FROM change GROUP BY 1) c
             ON c.endpoint_id = k.endpoint_id
         LEFT JOIN (SELECT endpoint_id, count(*) AS n FROM moved GROUP BY 1) m
             ON m.endpoint_id = k.endpoint_id
         LEFT JOIN (SELECT endpoint_id, count(*) AS n FROM created GROUP BY 1) n
             ON n.endpoint_id = k.endpoint_id",
        written = copy::write_rows_cte(rows),
        changes = copy::append_changes_ctes(changes, "written"),
        saved_track = tracks::save_cte(track),
        quarantined = quarantine::record_cte(q),
        k = kept,
        k1 = kept + 1,
        k2 = kept + 2,
        o = outcomes,
        o1 = outcomes + 1,
        o2 = outcomes + 2,
        o3 = outcomes + 3,
        o4 = outcomes + 4,
        o5 = outcomes + 5,
        c = cursors,
        c1 = cursors + 1,
        c2 = cursors + 2,
        c3 = cursors + 3,
        c4 = cursors + 4,
    )
});

/// Sets aside the endpoint's next message (`arrival_seq`, the first after the cursor at `from`),
/// whose apply kept failing, in one statement: moves the cursor past it (only from `from`: the
/// statement decides that this transaction is the one moving it), notes its outcome, records it
/// with `reason` and `attempts`, and, for a feed endpoint, writes the track row `track` (the
/// rules' quarantine began its reload). `false`: the cursor was not at `from` (roll back). The
/// caller holds the endpoint (a feed's [`tracks::open`], or its fence checked).
pub async fn quarantine_next(
    conn: &mut PgConnection,
    (tenant, endpoint): (TenantId, EndpointId),
    (from, arrival_seq): (i64, i64),
    (reason, attempts): (&str, i32),
    track: Option<&EndpointTrack>,
) -> Result<bool, StoreError> {
    let mut args = PgArguments::default();
    add(&mut args, endpoint)?;
    add(&mut args, tenant)?;
    add(&mut args, from)?;
    add(&mut args, arrival_seq)?;
    add(&mut args, Outcome::Quarantined.as_str())?;
    add(&mut args, vec![endpoint])?;
    add(&mut args, vec![tenant])?;
    add(&mut args, vec![arrival_seq])?;
    add(&mut args, vec![quarantine::reason_text(reason)])?;
    add(&mut args, vec![attempts])?;
    let statement = match track {
        Some(track) => {
            let mut t = tracks::TrackArrays::default();
            t.push(endpoint, tenant, track)?;
            t.add_to(&mut args)?;
            &QUARANTINE_NEXT_WITH_TRACK
        }
        None => &QUARANTINE_NEXT,
    };
    let moved: i64 = sqlx::query_scalar_with(statement, args)
        .fetch_one(conn)
        .await?;
    Ok(moved == 1)
}

/// [`quarantine_next`]'s statement: the cursor moved, the outcome noted, the message recorded;
/// `track_cte` adds the track's row.
fn quarantine_next_statement(track_cte: &str) -> String {
    format!(
        "WITH moved AS (
             INSERT INTO endpoint_apply_cursors AS c (endpoint_id, tenant_id,
                 applied_arrival_seq, last_applied_at)
             VALUES ($1, $2, $4, now())
             ON CONFLICT (endpoint_id) DO UPDATE
             SET applied_arrival_seq = excluded.applied_arrival_seq, last_applied_at = now()
             WHERE c.applied_arrival_seq = $3
             RETURNING endpoint_id
         ),
         noted AS (
             INSERT INTO message_applications (endpoint_id, arrival_seq, tenant_id, outcome)
             SELECT endpoint_id, $4, $2, $5 FROM moved
             ON CONFLICT (endpoint_id, arrival_seq) DO NOTHING
         ),
         {quarantined}{track_cte}
         SELECT count(*) FROM moved",
        quarantined = quarantine::record_cte(6),
    )
}

static QUARANTINE_NEXT: LazyLock<String> = LazyLock::new(|| quarantine_next_statement(""));

static QUARANTINE_NEXT_WITH_TRACK: LazyLock<String> =
    LazyLock::new(|| quarantine_next_statement(&format!(",\n{}", tracks::save_cte(11))));
