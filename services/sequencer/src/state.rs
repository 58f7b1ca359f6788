//! What the sequencer keeps with each endpoint's copy (migration `..._sequencer_state.sql`): the
//! track row of relay-rules' [`EndpointTrack`], the apply cursor over the stored messages, and a
//! note of how each message was applied. Every write here runs in the caller's apply transaction,
//! beside the copy's own writes.

use relay_rules::{EndpointTrack, Reload};
use sqlx::{PgConnection, PgPool};
use time::OffsetDateTime;
use uuid::Uuid;

/// The one track version 1 names.
pub const FEED_TRACK: &str = "feed";

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("postgres: {0}")]
    Database(#[from] sqlx::Error),
    #[error("stored sequencer state is invalid: {0}")]
    Invalid(String),
}

type TrackRow = (
    Option<i64>,
    Option<String>,
    Option<String>,
    bool,
    Option<i64>,
    Option<serde_json::Value>,
);

fn track_from_row(row: TrackRow) -> Result<EndpointTrack, StateError> {
    let (generation, access_version, through, last_was_reset, last_reset_generation, reload) = row;
    let unsigned = |v: i64| {
        u64::try_from(v).map_err(|_| StateError::Invalid(format!("negative generation {v}")))
    };
    Ok(EndpointTrack {
        generation: generation.map(unsigned).transpose()?,
        access_version,
        through,
        last_was_reset,
        last_reset_generation: last_reset_generation.map(unsigned).transpose()?,
        reload: reload
            .map(serde_json::from_value::<Reload>)
            .transpose()
            .map_err(|e| StateError::Invalid(format!("reload: {e}")))?,
    })
}

const TRACK_COLUMNS: &str =
    "generation, access_version, through, last_was_reset, last_reset_generation, reload";

/// Opens a transaction's hold on the endpoint in one statement (one round trip): checks that
/// `token` is still the endpoint's fencing token (the fence row share-locked, so no new owner
/// can claim it until this transaction ends), takes the endpoint's writer lock (its change
/// counter row: see `relay_store::copy::lock_endpoint`), and reads the track row locked, in that
/// order, the order every writer of the endpoint takes them in. `None`: the fence moved on, and
/// nothing was locked past the fence row. [`open_tracks`] for one endpoint.
pub async fn open_track(
    conn: &mut PgConnection,
    tenant: Uuid,
    endpoint: Uuid,
    token: i64,
    track: &str,
) -> Result<Option<EndpointTrack>, StateError> {
    let claim = TrackClaim {
        endpoint,
        tenant,
        token,
    };
    Ok(open_tracks(conn, &[claim], track).await?.pop().flatten())
}

/// Creates the track row if it is missing, so that [`open_track`] always has a row to lock: a
/// writer outside the sequencer (the control plane beginning a reload) and an apply transaction
/// then queue on it rather than both believing the row absent.
pub async fn ensure_track(
    pool: &PgPool,
    tenant: Uuid,
    endpoint: Uuid,
    track: &str,
) -> Result<(), StateError> {
    sqlx::query(
        "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id) VALUES ($1, $2, $3)
         ON CONFLICT (endpoint_id, track) DO NOTHING",
    )
    .bind(endpoint)
    .bind(track)
    .bind(tenant)
    .execute(pool)
    .await?;
    Ok(())
}

/// The track row without a lock: for a reload deciding whether it was superseded meanwhile.
pub async fn peek_track(
    pool: &PgPool,
    endpoint: Uuid,
    track: &str,
) -> Result<EndpointTrack, StateError> {
    let row: Option<TrackRow> = sqlx::query_as(&format!(
        "SELECT {TRACK_COLUMNS} FROM endpoint_tracks WHERE endpoint_id = $1 AND track = $2"
    ))
    .bind(endpoint)
    .bind(track)
    .fetch_optional(pool)
    .await?;
    row.map(track_from_row)
        .transpose()
        .map(Option::unwrap_or_default)
}

/// Writes the track row decided from [`open_track`]'s (the caller holds its lock).
/// `reload_begun_at` moves only when the running reload changes.
pub async fn save_track(
    conn: &mut PgConnection,
    tenant: Uuid,
    endpoint: Uuid,
    track: &str,
    state: &EndpointTrack,
) -> Result<(), StateError> {
    let (generation, last_reset_generation, reload) = track_values(state)?;
    sqlx::query(
        "INSERT INTO endpoint_tracks AS t (endpoint_id, track, tenant_id, generation,
             access_version, through, last_was_reset, last_reset_generation, reload,
             reload_begun_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, CASE WHEN $9 IS NULL THEN NULL ELSE now() END)
         ON CONFLICT (endpoint_id, track) DO UPDATE
         SET generation = excluded.generation, access_version = excluded.access_version,
             through = excluded.through, last_was_reset = excluded.last_was_reset,
             last_reset_generation = excluded.last_reset_generation, reload = excluded.reload,
             reload_begun_at = CASE
                 WHEN excluded.reload IS NULL THEN NULL
                 WHEN t.reload IS NOT DISTINCT FROM excluded.reload THEN t.reload_begun_at
                 ELSE now() END,
             updated_at = now()",
    )
    .bind(endpoint)
    .bind(track)
    .bind(tenant)
    .bind(generation)
    .bind(&state.access_version)
    .bind(&state.through)
    .bind(state.last_was_reset)
    .bind(last_reset_generation)
    .bind(reload)
    .execute(conn)
    .await?;
    Ok(())
}

/// A track's generations as Postgres keeps them, and its running reload as JSON.
type TrackValues = (Option<i64>, Option<i64>, Option<serde_json::Value>);

fn track_values(state: &EndpointTrack) -> Result<TrackValues, StateError> {
    let signed = |v: u64| {
        i64::try_from(v).map_err(|_| StateError::Invalid(format!("generation {v} too large")))
    };
    let reload = state
        .reload
        .as_ref()
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| StateError::Invalid(format!("reload: {e}")))?;
    Ok((
        state.generation.map(signed).transpose()?,
        state.last_reset_generation.map(signed).transpose()?,
        reload,
    ))
}

/// The CTEs that open [`open_tracks`]' and [`open_runs`]' statements, so that both take an
/// endpoint's locks the same way: `input` (the claims: endpoints, tenants and tokens from
/// `$first`, `$first + 1` and `$first + 2`, in endpoint order), `fence` (the fence rows
/// share-locked, in id order) and `writer` (the writer lock, the change counter row, taken only
/// where the token still matches; its rows are the endpoints still owned).
fn claim_ctes(first: u32) -> String {
    let (endpoints, tenants, tokens) = (first, first + 1, first + 2);
    format!(
        "input AS MATERIALIZED (
             SELECT * FROM unnest(${endpoints}::uuid[], ${tenants}::uuid[], ${tokens}::int8[])
                 WITH ORDINALITY AS i(endpoint_id, tenant_id, token, ord)
         ),
         fence AS MATERIALIZED (
             SELECT f.endpoint_id, f.token FROM endpoint_fences f
             WHERE f.endpoint_id = ANY(${endpoints}::uuid[])
             ORDER BY f.endpoint_id
             FOR SHARE
         ),
         writer AS MATERIALIZED (
             INSERT INTO endpoint_change_counters AS c (endpoint_id, tenant_id)
             SELECT i.endpoint_id, i.tenant_id
             FROM input i JOIN fence f ON f.endpoint_id = i.endpoint_id AND f.token = i.token
             ORDER BY i.endpoint_id
             ON CONFLICT (endpoint_id) DO UPDATE SET last = c.last
             RETURNING endpoint_id
         )"
    )
}

/// One endpoint's claim in [`open_tracks`]: the fencing token its worker holds.
#[derive(Debug, Clone, Copy)]
pub struct TrackClaim {
    pub endpoint: Uuid,
    pub tenant: Uuid,
    pub token: i64,
}

/// [`open_track`] for several endpoints in one statement: for each claim in the order given,
/// its track row locked, or `None` when the fence moved on. Each step depends on the one before
/// (the writer's insert joins the fences read, the track's read joins the writers' rows), so
/// each endpoint's locks are taken in the order every writer takes them (fence, writer lock,
/// track), and the endpoints in id order, so two such statements never wait on each other in a
/// cycle.
pub async fn open_tracks(
    conn: &mut PgConnection,
    claims: &[TrackClaim],
    track: &str,
) -> Result<Vec<Option<EndpointTrack>>, StateError> {
    type Row = (
        Uuid,
        bool,
        Option<i64>,
        Option<String>,
        Option<String>,
        Option<bool>,
        Option<i64>,
        Option<serde_json::Value>,
    );
    let mut sorted: Vec<&TrackClaim> = claims.iter().collect();
    sorted.sort_by_key(|c| c.endpoint);
    let rows: Vec<Row> = sqlx::query_as(&format!(
        "WITH {claims}
         SELECT i.endpoint_id, w.endpoint_id IS NOT NULL, {TRACK_COLUMNS}
         FROM input i
         LEFT JOIN writer w ON w.endpoint_id = i.endpoint_id
         LEFT JOIN LATERAL (
             SELECT {TRACK_COLUMNS} FROM endpoint_tracks
             WHERE endpoint_id = w.endpoint_id AND track = $4
             FOR UPDATE
         ) t ON true
         ORDER BY i.ord",
        claims = claim_ctes(1)
    ))
    .bind(sorted.iter().map(|c| c.endpoint).collect::<Vec<_>>())
    .bind(sorted.iter().map(|c| c.tenant).collect::<Vec<_>>())
    .bind(sorted.iter().map(|c| c.token).collect::<Vec<_>>())
    .bind(track)
    .fetch_all(conn)
    .await?;
    let mut opened: std::collections::HashMap<Uuid, Option<EndpointTrack>> =
        std::collections::HashMap::with_capacity(rows.len());
    for (
        endpoint,
        owned,
        generation,
        access_version,
        through,
        last_was_reset,
        last_reset,
        reload,
    ) in rows
    {
        let track = match (owned, last_was_reset) {
            (false, _) => None,
            // A track never written: nothing held yet.
            (true, None) => Some(EndpointTrack::default()),
            (true, Some(last_was_reset)) => Some(track_from_row((
                generation,
                access_version,
                through,
                last_was_reset,
                last_reset,
                reload,
            ))?),
        };
        opened.insert(endpoint, track);
    }
    Ok(claims
        .iter()
        .map(|c| opened.remove(&c.endpoint).flatten())
        .collect())
}

/// One endpoint's claim in [`open_runs`], and the keys of its run: every event id of its
/// messages and the subjects they touch.
#[derive(Debug, Clone, Copy)]
pub struct RunClaim<'a> {
    pub claim: TrackClaim,
    pub keys: relay_store::copy::RunKeys<'a>,
}

/// What [`open_runs`] found for an endpoint it holds: its track row, and its run's event ids
/// not applied before (now recorded) and rows (locked).
#[derive(Debug, Clone)]
pub struct OpenedRun {
    pub track: EndpointTrack,
    pub held: relay_store::copy::RunHeld,
}

/// [`open_tracks`] and the copy's [`RECORD_AND_LOAD_CTES`] for several endpoints' runs in one
/// statement (one round trip): for each claim in the order given, `None` when its fence moved
/// on (nothing of it recorded or locked past the fence row); else its track row locked, its
/// run's event ids not applied before, now recorded, and what its copy holds of the run's
/// subjects, locked. Each endpoint's locks come in the order every writer takes them: fence,
/// writer lock, track, then its ids and rows (each part joins the one before).
///
/// Which of a run's messages apply their events depends on the track, which this statement
/// reads: so it records the ids of every event of the run, and the caller forgets, in the same
/// transaction, those of messages that turn out not to apply ([`RunEnd::forget`]).
///
/// [`RECORD_AND_LOAD_CTES`]: relay_store::copy::RECORD_AND_LOAD_CTES
pub async fn open_runs(
    conn: &mut PgConnection,
    runs: &[RunClaim<'_>],
    track: &str,
) -> Result<Vec<Option<OpenedRun>>, StateError> {
    let mut sorted: Vec<&RunClaim> = runs.iter().collect();
    sorted.sort_by_key(|r| r.claim.endpoint);
    let keys: Vec<relay_store::copy::RunKeys> = sorted.iter().map(|r| r.keys).collect();
    let query = sqlx::query_as::<_, OpenRow>(&OPEN_RUNS);
    let rows: Vec<OpenRow> = relay_store::copy::RunKeyArrays::new(&keys)
        .bind(query)
        .bind(sorted.iter().map(|r| r.claim.endpoint).collect::<Vec<_>>())
        .bind(sorted.iter().map(|r| r.claim.tenant).collect::<Vec<_>>())
        .bind(sorted.iter().map(|r| r.claim.token).collect::<Vec<_>>())
        .bind(track)
        .fetch_all(conn)
        .await?;
    let (track_rows, other_rows): (Vec<OpenRow>, Vec<OpenRow>) =
        rows.into_iter().partition(|row| row.kind == OPENED_TRACK);
    let mut opened: std::collections::HashMap<Uuid, OpenedRun> = std::collections::HashMap::new();
    for row in track_rows.into_iter().chain(other_rows) {
        match row.kind {
            OPENED_TRACK => {
                if !row.owned {
                    continue;
                }
                let track = match row.last_was_reset {
                    // A track never written: nothing held yet.
                    None => EndpointTrack::default(),
                    Some(last_was_reset) => track_from_row((
                        row.generation,
                        row.access_version,
                        row.through,
                        last_was_reset,
                        row.last_reset_generation,
                        row.reload,
                    ))?,
                };
                opened.insert(
                    row.endpoint_id,
                    OpenedRun {
                        track,
                        held: relay_store::copy::RunHeld::default(),
                    },
                );
            }
            // Taken after the track rows: every id and copy row belongs to an endpoint opened.
            kind => {
                let run = opened.get_mut(&row.endpoint_id).ok_or_else(|| {
                    StateError::Invalid(format!("{kind} row for an endpoint not opened"))
                })?;
                let key = row
                    .key
                    .ok_or_else(|| StateError::Invalid("open row without its key".into()))?;
                if kind == OPENED_EVENT_ID {
                    run.held.first_seen.insert(key);
                    continue;
                }
                let (Some(generation), Some(sequence), Some(tombstone), Some(parts)) =
                    (row.generation, row.sequence, row.tombstone, row.parts)
                else {
                    return Err(StateError::Invalid(format!("copy row {key} is incomplete")));
                };
                run.held
                    .add_held(
                        key,
                        generation,
                        sequence,
                        tombstone,
                        parts,
                        row.item,
                        row.item_kind,
                        row.company_id,
                    )
                    .map_err(|e| StateError::Invalid(e.to_string()))?;
            }
        }
    }
    Ok(runs
        .iter()
        .map(|r| opened.remove(&r.claim.endpoint))
        .collect())
}

/// The kinds of row [`OPEN_RUNS`] returns, in the order it returns them.
const OPENED_TRACK: i16 = 0;
const OPENED_EVENT_ID: i16 = 1;
const OPENED_COPY_ROW: i16 = 2;

/// One row of [`OPEN_RUNS`]: an endpoint's track (`owned` false: its fence moved on), one of its
/// ids recorded (`key` the event id), or one of its copy's rows (`key` the subject).
#[derive(sqlx::FromRow)]
struct OpenRow {
    kind: i16,
    endpoint_id: Uuid,
    owned: bool,
    key: Option<String>,
    generation: Option<i64>,
    access_version: Option<String>,
    through: Option<String>,
    last_was_reset: Option<bool>,
    last_reset_generation: Option<i64>,
    reload: Option<serde_json::Value>,
    sequence: Option<String>,
    tombstone: Option<bool>,
    parts: Option<String>,
    item: Option<String>,
    item_kind: Option<String>,
    company_id: Option<i64>,
}

/// [`open_runs`]' statement: the copy's CTEs take `$1`–`$5`; the claims are `$6`–`$8`
/// (endpoint, tenant, token, in endpoint order), the track's name `$9`.
static OPEN_RUNS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH {claims},
         opened AS MATERIALIZED (
             SELECT w.endpoint_id, t.*
             FROM writer w
             LEFT JOIN LATERAL (
                 SELECT {TRACK_COLUMNS} FROM endpoint_tracks
                 WHERE endpoint_id = w.endpoint_id AND track = $9
                 FOR UPDATE
             ) t ON true
         ),
         {copy_ctes}
         SELECT {OPENED_TRACK}::int2 AS kind, i.endpoint_id, o.endpoint_id IS NOT NULL AS owned,
                NULL::text AS key, o.generation, o.access_version, o.through, o.last_was_reset,
                o.last_reset_generation, o.reload, NULL::text AS sequence,
                NULL::bool AS tombstone, NULL::text AS parts, NULL::text AS item,
                NULL::text AS item_kind, NULL::int8 AS company_id
         FROM input i LEFT JOIN opened o ON o.endpoint_id = i.endpoint_id
         UNION ALL
         SELECT {OPENED_EVENT_ID}::int2, endpoint_id, true, event_id, NULL, NULL, NULL, NULL,
                NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
         FROM recorded
         UNION ALL
         SELECT {OPENED_COPY_ROW}::int2, endpoint_id, true, subject, generation, NULL, NULL,
                NULL, NULL, NULL, sequence, tombstone, parts, item, item_kind, company_id
         FROM held",
        claims = claim_ctes(6),
        copy_ctes = relay_store::copy::RECORD_AND_LOAD_CTES
    )
});

/// How one endpoint's run of messages ends, beside the copy's writes: the track row (when the
/// run changed it), how each message was applied, the messages set aside, the event ids [`open_runs`] recorded for
/// messages that did not apply (forgotten again), and the apply cursor moved from `from` to
/// `to`.
pub struct RunEnd<'a> {
    pub endpoint: Uuid,
    pub tenant: Uuid,
    pub track: Option<&'a EndpointTrack>,
    pub outcomes: &'a [(i64, MessageOutcome, i32, i32)],
    /// The messages set aside: (arrival_seq, reason).
    pub quarantined: &'a [(i64, String)],
    pub forget: Vec<&'a str>,
    pub from: i64,
    pub to: i64,
    pub last_received_at: Option<OffsetDateTime>,
}

/// What [`write_runs`] wrote for one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunWritten {
    /// Copy rows written (each decided row whose position still won).
    pub rows: i64,
    /// Changes appended to the outbox.
    pub changes: i64,
    /// False when the cursor was not at `from`: someone else applied these messages.
    pub cursor_moved: bool,
}

/// The end of an apply transaction for several endpoints in one statement (one round trip):
/// the copy's rows and changes ([`copy::WRITE_DECIDED_CTES`]), then each endpoint's track row,
/// outcomes and cursor, each write still deciding in its own `where` (the rows' precedence, the
/// cursor's position). Returns what was written for each run, in the order given.
///
/// [`copy::WRITE_DECIDED_CTES`]: relay_store::copy::WRITE_DECIDED_CTES
pub async fn write_runs(
    conn: &mut PgConnection,
    decided: relay_store::copy::DecidedWrites,
    ends: &[RunEnd<'_>],
) -> Result<Vec<RunWritten>, StateError> {
    let mut t_endpoint = Vec::new();
    let mut t_tenant = Vec::new();
    let mut t_generation = Vec::new();
    let mut t_access_version = Vec::new();
    let mut t_through = Vec::new();
    let mut t_last_was_reset = Vec::new();
    let mut t_last_reset_generation = Vec::new();
    let mut t_reload: Vec<Option<String>> = Vec::new();
    for end in ends {
        let Some(track) = end.track else { continue };
        let (generation, last_reset_generation, reload) = track_values(track)?;
        t_endpoint.push(end.endpoint);
        t_tenant.push(end.tenant);
        t_generation.push(generation);
        t_access_version.push(track.access_version.as_deref());
        t_through.push(track.through.as_deref());
        t_last_was_reset.push(track.last_was_reset);
        t_last_reset_generation.push(last_reset_generation);
        t_reload.push(reload.map(|r| r.to_string()));
    }
    let mut o_endpoint = Vec::new();
    let mut o_tenant = Vec::new();
    let mut o_seq = Vec::new();
    let mut o_outcome = Vec::new();
    let mut o_applied = Vec::new();
    let mut o_ignored = Vec::new();
    for end in ends {
        for (seq, outcome, applied, ignored) in end.outcomes {
            o_endpoint.push(end.endpoint);
            o_tenant.push(end.tenant);
            o_seq.push(*seq);
            o_outcome.push(outcome.as_str());
            o_applied.push(*applied);
            o_ignored.push(*ignored);
        }
    }
    let mut f_endpoint = Vec::new();
    let mut f_event = Vec::new();
    for end in ends {
        for id in &end.forget {
            f_endpoint.push(end.endpoint);
            f_event.push(*id);
        }
    }
    let mut q_endpoint = Vec::new();
    let mut q_tenant = Vec::new();
    let mut q_seq = Vec::new();
    let mut q_reason = Vec::new();
    for end in ends {
        for (seq, reason) in end.quarantined {
            q_endpoint.push(end.endpoint);
            q_tenant.push(end.tenant);
            q_seq.push(*seq);
            q_reason.push(relay_store::quarantine::reason_text(reason));
        }
    }
    // A body that does not parse is set aside at its first look.
    let q_attempts = vec![1i32; q_seq.len()];
    let query = sqlx::query_as(&WRITE_RUNS);
    let rows: Vec<(Uuid, i64, i64, i64)> = decided
        .bind(query)
        .bind(FEED_TRACK)
        .bind(t_endpoint)
        .bind(t_tenant)
        .bind(t_generation)
        .bind(t_access_version)
        .bind(t_through)
        .bind(t_last_was_reset)
        .bind(t_last_reset_generation)
        .bind(t_reload)
        .bind(o_endpoint)
        .bind(o_tenant)
        .bind(o_seq)
        .bind(o_outcome)
        .bind(o_applied)
        .bind(o_ignored)
        .bind(ends.iter().map(|e| e.endpoint).collect::<Vec<_>>())
        .bind(ends.iter().map(|e| e.tenant).collect::<Vec<_>>())
        .bind(ends.iter().map(|e| e.from).collect::<Vec<_>>())
        .bind(ends.iter().map(|e| e.to).collect::<Vec<_>>())
        .bind(ends.iter().map(|e| e.last_received_at).collect::<Vec<_>>())
        .bind(f_endpoint)
        .bind(f_event)
        .bind(q_endpoint)
        .bind(q_tenant)
        .bind(q_seq)
        .bind(q_reason)
        .bind(q_attempts)
        .fetch_all(conn)
        .await?;
    let mut written: std::collections::HashMap<Uuid, RunWritten> = rows
        .into_iter()
        .map(|(endpoint, rows, changes, moved)| {
            (
                endpoint,
                RunWritten {
                    rows,
                    changes,
                    cursor_moved: moved == 1,
                },
            )
        })
        .collect();
    Ok(ends
        .iter()
        .map(|e| written.remove(&e.endpoint).unwrap_or_default())
        .collect())
}

/// [`write_runs`]' statement: the copy's CTEs (`$1`–`$20`), then the tracks that changed
/// (`$21` the track's name, `$22`–`$29`), the outcomes (`$30`–`$35`), the cursors (`$36`–`$40`:
/// endpoint, tenant, from, to, the last message's receipt time), the event ids to forget
/// (`$41`–`$42`: endpoint, event id) and the messages set aside (`$43`–`$47`, see
/// [`relay_store::quarantine::record_cte`]). A cursor moves only from where the run read it: updated
/// where it is at `from`, or created when the run read none (`from` 0) and there is still none.
static WRITE_RUNS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{ctes},
         saved_track AS (
             INSERT INTO endpoint_tracks AS t (endpoint_id, track, tenant_id, generation,
                 access_version, through, last_was_reset, last_reset_generation, reload,
                 reload_begun_at)
             SELECT endpoint_id, $21, tenant_id, generation, access_version, through,
                    last_was_reset, last_reset_generation, reload::jsonb,
                    CASE WHEN reload IS NULL THEN NULL ELSE now() END
             FROM unnest($22::uuid[], $23::uuid[], $24::int8[], $25::text[], $26::text[],
                         $27::bool[], $28::int8[], $29::text[])
                 AS s(endpoint_id, tenant_id, generation, access_version, through,
                      last_was_reset, last_reset_generation, reload)
             ON CONFLICT (endpoint_id, track) DO UPDATE
             SET generation = excluded.generation, access_version = excluded.access_version,
                 through = excluded.through, last_was_reset = excluded.last_was_reset,
                 last_reset_generation = excluded.last_reset_generation,
                 reload = excluded.reload,
                 reload_begun_at = CASE
                     WHEN excluded.reload IS NULL THEN NULL
                     WHEN t.reload IS NOT DISTINCT FROM excluded.reload THEN t.reload_begun_at
                     ELSE now() END,
                 updated_at = now()
         ),
         noted AS (
             INSERT INTO message_applications (endpoint_id, arrival_seq, tenant_id, outcome,
                 events_applied, events_ignored)
             SELECT endpoint_id, seq, tenant_id, outcome, applied, ignored
             FROM unnest($30::uuid[], $31::uuid[], $32::int8[], $33::text[], $34::int4[],
                         $35::int4[])
                 AS o(endpoint_id, tenant_id, seq, outcome, applied, ignored)
             ON CONFLICT (endpoint_id, arrival_seq) DO NOTHING
         ),
         runs AS MATERIALIZED (
             SELECT * FROM unnest($36::uuid[], $37::uuid[], $38::int8[], $39::int8[],
                                  $40::timestamptz[])
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
             WHERE c.endpoint_id = ANY($36::uuid[])
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
         forgotten AS (
             DELETE FROM applied_events a
             USING unnest($41::uuid[], $42::text[]) AS f(endpoint_id, event_id)
             -- Checked once, before the join: with nothing to forget (nearly always) no plan
             -- reads the table at all.
             WHERE cardinality($41::uuid[]) > 0
               AND a.endpoint_id = f.endpoint_id AND a.event_id = f.event_id
         ),
         {quarantined}
         SELECT k.endpoint_id, coalesce(w.n, 0), coalesce(c.n, 0),
                coalesce(m.n, 0) + coalesce(n.n, 0)
         FROM runs k
         LEFT JOIN (SELECT endpoint_id, count(*) AS n FROM written GROUP BY 1) w
             ON w.endpoint_id = k.endpoint_id
         LEFT JOIN (SELECT endpoint_id, count(*) AS n FROM change GROUP BY 1) c
             ON c.endpoint_id = k.endpoint_id
         LEFT JOIN (SELECT endpoint_id, count(*) AS n FROM moved GROUP BY 1) m
             ON m.endpoint_id = k.endpoint_id
         LEFT JOIN (SELECT endpoint_id, count(*) AS n FROM created GROUP BY 1) n
             ON n.endpoint_id = k.endpoint_id",
        ctes = relay_store::copy::WRITE_DECIDED_CTES,
        quarantined = relay_store::quarantine::record_cte(43),
    )
});

/// Sets aside the endpoint's next message (`arrival_seq`, the first after the cursor at `from`),
/// whose apply kept failing, in one statement: moves the cursor past it (only from `from`: the
/// statement decides that this transaction is the one moving it), notes its outcome and records
/// it with `reason` and `attempts`. `false`: the cursor was not at `from` (roll back). The
/// caller holds the endpoint (fence, writer lock, track row: [`open_track`]) and writes the
/// track's reload in the same transaction.
pub async fn quarantine_next(
    conn: &mut PgConnection,
    tenant: Uuid,
    endpoint: Uuid,
    (from, arrival_seq): (i64, i64),
    reason: &str,
    attempts: i32,
) -> Result<bool, StateError> {
    let moved: i64 = sqlx::query_scalar(&QUARANTINE_NEXT)
        .bind(endpoint)
        .bind(tenant)
        .bind(from)
        .bind(arrival_seq)
        .bind(MessageOutcome::Quarantined.as_str())
        .bind(vec![endpoint])
        .bind(vec![tenant])
        .bind(vec![arrival_seq])
        .bind(vec![relay_store::quarantine::reason_text(reason)])
        .bind(vec![attempts])
        .fetch_one(conn)
        .await?;
    Ok(moved == 1)
}

static QUARANTINE_NEXT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
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
         {quarantined}
         SELECT count(*) FROM moved",
        quarantined = relay_store::quarantine::record_cte(6),
    )
});

/// How far the endpoint's messages are applied (0: none yet).
pub async fn applied_through<'e>(
    db: impl sqlx::PgExecutor<'e>,
    endpoint: Uuid,
) -> Result<i64, StateError> {
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
    tenant: Uuid,
    endpoint: Uuid,
    from: i64,
    to: i64,
    last_received_at: Option<OffsetDateTime>,
) -> Result<bool, StateError> {
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
    endpoint: Uuid,
    applied: i64,
    limit: i64,
) -> Result<(i64, Vec<PendingMessage>), StateError> {
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
) -> Result<std::collections::HashMap<Uuid, (i64, Vec<PendingMessage>)>, StateError> {
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

/// How a message was applied, for support reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageOutcome {
    Applied,
    Test,
    IgnoredTrack,
    OlderGeneration,
    ReloadBegun,
    ReloadSuperseded,
    /// Set aside: it can never be applied (see `relay_rules::quarantine`).
    Quarantined,
}

impl MessageOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            MessageOutcome::Applied => "applied",
            MessageOutcome::Test => "test",
            MessageOutcome::IgnoredTrack => "ignored_track",
            MessageOutcome::OlderGeneration => "older_generation",
            MessageOutcome::ReloadBegun => "reload_begun",
            MessageOutcome::ReloadSuperseded => "reload_superseded",
            MessageOutcome::Quarantined => "quarantined",
        }
    }

    pub const ALL: [MessageOutcome; 7] = [
        MessageOutcome::Applied,
        MessageOutcome::Test,
        MessageOutcome::IgnoredTrack,
        MessageOutcome::OlderGeneration,
        MessageOutcome::ReloadBegun,
        MessageOutcome::ReloadSuperseded,
        MessageOutcome::Quarantined,
    ];
}

/// Notes how the message was applied, in its apply transaction.
pub async fn record_application(
    conn: &mut PgConnection,
    tenant: Uuid,
    endpoint: Uuid,
    arrival_seq: i64,
    outcome: MessageOutcome,
    events_applied: i32,
    events_ignored: i32,
) -> Result<(), StateError> {
    sqlx::query(
        "INSERT INTO message_applications (endpoint_id, arrival_seq, tenant_id, outcome,
             events_applied, events_ignored)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (endpoint_id, arrival_seq) DO NOTHING",
    )
    .bind(endpoint)
    .bind(arrival_seq)
    .bind(tenant)
    .bind(outcome.as_str())
    .bind(events_applied)
    .bind(events_ignored)
    .execute(conn)
    .await?;
    Ok(())
}

/// Notes how each message of a run was applied: (arrival_seq, outcome, events applied, events
/// ignored), in the run's transaction.
pub async fn record_applications(
    conn: &mut PgConnection,
    tenant: Uuid,
    endpoint: Uuid,
    outcomes: &[(i64, MessageOutcome, i32, i32)],
) -> Result<(), StateError> {
    sqlx::query(
        "INSERT INTO message_applications (endpoint_id, arrival_seq, tenant_id, outcome,
             events_applied, events_ignored)
         SELECT $1, seq, $2, outcome, applied, ignored
         FROM unnest($3::int8[], $4::text[], $5::int4[], $6::int4[])
             AS o(seq, outcome, applied, ignored)
         ON CONFLICT (endpoint_id, arrival_seq) DO NOTHING",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(outcomes.iter().map(|o| o.0).collect::<Vec<_>>())
    .bind(outcomes.iter().map(|o| o.1.as_str()).collect::<Vec<_>>())
    .bind(outcomes.iter().map(|o| o.2).collect::<Vec<_>>())
    .bind(outcomes.iter().map(|o| o.3).collect::<Vec<_>>())
    .execute(conn)
    .await?;
    Ok(())
}

/// Endpoints with work (`only`: of that endpoint alone): messages stored past their cursor, or
/// a reload begun and not merged. The periodic sweep's query (the Redis wake-up is only the
/// fast path), and the check after a registration change.
pub async fn endpoints_with_work(
    pool: &PgPool,
    only: Option<Uuid>,
    limit: i64,
) -> Result<Vec<Uuid>, StateError> {
    Ok(sqlx::query_scalar(
        "SELECT a.endpoint_id FROM endpoint_arrival_counters a
         LEFT JOIN endpoint_apply_cursors c ON c.endpoint_id = a.endpoint_id
         WHERE a.last_arrival_seq > coalesce(c.applied_arrival_seq, 0)
           AND ($2::uuid IS NULL OR a.endpoint_id = $2)
         UNION
         -- A reload without upstream settings waits for them with no worker: the registration
         -- change that gives them wakes the endpoint.
         SELECT t.endpoint_id FROM endpoint_tracks t
         JOIN webhook_endpoints e ON e.id = t.endpoint_id
         WHERE t.reload IS NOT NULL
           AND e.upstream_base_url IS NOT NULL AND e.upstream_api_key IS NOT NULL
           AND ($2::uuid IS NULL OR t.endpoint_id = $2)
         LIMIT $1",
    )
    .bind(limit)
    .bind(only)
    .fetch_all(pool)
    .await?)
}

/// What the sequencer needs of an endpoint's registration.
#[derive(Debug, Clone)]
pub struct EndpointRegistration {
    pub id: Uuid,
    pub tenant_id: Uuid,
    pub upstream_base_url: Option<String>,
    pub upstream_api_key: Option<String>,
}

pub async fn load_registration(
    pool: &PgPool,
    endpoint: Uuid,
) -> Result<Option<EndpointRegistration>, StateError> {
    let row: Option<(Uuid, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT tenant_id, upstream_base_url, upstream_api_key FROM webhook_endpoints
         WHERE id = $1",
    )
    .bind(endpoint)
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|(tenant_id, url, key)| EndpointRegistration {
        id: endpoint,
        tenant_id,
        upstream_base_url: url,
        upstream_api_key: key,
    }))
}
