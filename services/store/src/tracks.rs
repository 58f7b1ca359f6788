//! The track row of each endpoint (`endpoint_tracks`): relay-rules' [`EndpointTrack`], kept with
//! the copy. Every write of it is here: the sequencer's (inside its apply and merge
//! transactions, see [`crate::runs`] and [`crate::copy::merge`]), and the control plane's
//! ([`transition`]).

use std::sync::LazyLock;

use relay_rules::{EndpointTrack, Reload};
use sqlx::postgres::PgArguments;
use sqlx::{PgConnection, PgPool};

use crate::copy::add;
use uuid::Uuid;

use crate::{EndpointId, StoreError, TenantId};

/// The one track version 1 names.
pub const FEED_TRACK: &str = "feed";

pub(crate) type TrackRow = (
    Option<i64>,
    Option<String>,
    Option<String>,
    bool,
    Option<i64>,
    Option<serde_json::Value>,
    i64,
);

pub(crate) fn track_from_row(row: TrackRow) -> Result<EndpointTrack, StoreError> {
    let (generation, access_version, through, last_was_reset, last_reset_generation, reload, begun) =
        row;
    let unsigned = |v: i64| {
        u64::try_from(v).map_err(|_| StoreError::Invalid(format!("negative generation {v}")))
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
            .map_err(|e| StoreError::Invalid(format!("reload: {e}")))?,
        reloads_begun: unsigned(begun)?,
    })
}

pub(crate) const TRACK_COLUMNS: &str = "generation, access_version, through, last_was_reset, \
     last_reset_generation, reload, reloads_begun";

/// One endpoint's claim on its track: the fencing token its worker holds.
#[derive(Debug, Clone, Copy)]
pub struct TrackClaim {
    pub endpoint: EndpointId,
    pub tenant: TenantId,
    pub token: i64,
}

/// Opens a transaction's hold on the endpoint in one statement: checks that the claim's token is
/// still the endpoint's fencing token (the fence row share-locked, so no new owner can claim it
/// until this transaction ends), takes the endpoint's writer lock (its change counter row), and
/// reads the track row locked, in that order, the order every writer of the endpoint takes them
/// in (see [`crate::runs::open_runs`]). `None`: the fence moved on, and nothing was locked past
/// the fence row.
pub async fn open(
    conn: &mut PgConnection,
    claim: TrackClaim,
) -> Result<Option<EndpointTrack>, StoreError> {
    type Row = (
        bool,
        Option<i64>,
        Option<String>,
        Option<String>,
        Option<bool>,
        Option<i64>,
        Option<serde_json::Value>,
        Option<i64>,
    );
    let row: Row = sqlx::query_as(&OPEN)
        .bind(vec![claim.endpoint])
        .bind(vec![claim.tenant])
        .bind(vec![claim.token])
        .bind(FEED_TRACK)
        .fetch_one(conn)
        .await?;
    let (owned, generation, access_version, through, last_was_reset, last_reset, reload, begun) =
        row;
    Ok(match (owned, last_was_reset) {
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
            begun.unwrap_or(0),
        ))?),
    })
}

static OPEN: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {claims}
         SELECT w.endpoint_id IS NOT NULL, {TRACK_COLUMNS}
         FROM input i
         LEFT JOIN writer w ON w.endpoint_id = i.endpoint_id
         LEFT JOIN LATERAL (
             SELECT {TRACK_COLUMNS} FROM endpoint_tracks
             WHERE endpoint_id = w.endpoint_id AND track = $4
             FOR UPDATE
         ) t ON true",
        claims = claim_ctes(1)
    )
});

/// Creates the track row if it is missing, so that [`open`] always has a row to lock: a writer
/// outside the sequencer (the control plane beginning a reload) and an apply transaction then
/// queue on it rather than both believing the row absent.
pub async fn ensure(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id) VALUES ($1, $2, $3)
         ON CONFLICT (endpoint_id, track) DO NOTHING",
    )
    .bind(endpoint)
    .bind(FEED_TRACK)
    .bind(tenant)
    .execute(pool)
    .await?;
    Ok(())
}

/// The track row without a lock: for a reload deciding whether it is still the running one.
pub async fn peek<'e>(
    db: impl sqlx::PgExecutor<'e>,
    endpoint: EndpointId,
) -> Result<EndpointTrack, StoreError> {
    let row: Option<TrackRow> = sqlx::query_as(&format!(
        "SELECT {TRACK_COLUMNS} FROM endpoint_tracks WHERE endpoint_id = $1 AND track = $2"
    ))
    .bind(endpoint)
    .bind(FEED_TRACK)
    .fetch_optional(db)
    .await?;
    row.map(track_from_row)
        .transpose()
        .map(Option::unwrap_or_default)
}

/// Writes the track row decided from [`open`]'s (the caller holds its lock).
pub async fn save(
    conn: &mut PgConnection,
    tenant: TenantId,
    endpoint: EndpointId,
    track: &EndpointTrack,
) -> Result<(), StoreError> {
    let mut arrays = TrackArrays::default();
    arrays.push(endpoint, tenant, track)?;
    let mut args = PgArguments::default();
    arrays.add_to(&mut args)?;
    sqlx::query_with(&SAVE, args).execute(conn).await?;
    Ok(())
}

static SAVE: LazyLock<String> = LazyLock::new(|| format!("WITH {} SELECT 1::int8", save_cte(1)));

/// A change of the track row decided by the control plane, outside any fence (a rewind refused,
/// a restore): in one transaction, the row locked (created when missing), `decide` asked with it
/// as it is then, and its answer written when it gives one. Returns the row as it ends. The
/// transaction holds only the track row, which every writer of the endpoint takes after its
/// fence and writer lock, so it never waits on them in a cycle.
pub async fn transition(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    decide: impl FnOnce(&EndpointTrack) -> Option<EndpointTrack>,
) -> Result<(EndpointTrack, bool), StoreError> {
    ensure(pool, tenant, endpoint).await?;
    let mut tx = pool.begin().await?;
    let held = lock(&mut tx, tenant, endpoint).await?;
    let Some(next) = decide(&held) else {
        tx.rollback().await?;
        return Ok((held, false));
    };
    save(&mut tx, tenant, endpoint, &next).await?;
    tx.commit().await?;
    Ok((next, true))
}

/// The tenant's endpoint's track row, locked until the transaction ends (the caller made sure
/// it exists, with [`ensure`]).
pub(crate) async fn lock(
    conn: &mut PgConnection,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<EndpointTrack, StoreError> {
    let row: TrackRow = sqlx::query_as(&format!(
        "SELECT {TRACK_COLUMNS} FROM endpoint_tracks
         WHERE endpoint_id = $1 AND track = $2 AND tenant_id = $3
         FOR UPDATE"
    ))
    .bind(endpoint)
    .bind(FEED_TRACK)
    .bind(tenant)
    .fetch_optional(conn)
    .await?
    .ok_or_else(|| StoreError::NotFound {
        what: "track",
        id: endpoint.to_string(),
    })?;
    track_from_row(row)
}

/// Several endpoints' track rows to write, as the arrays of [`save_cte`]: the track's name and
/// nine arrays ([`TrackArrays::WIDTH`] parameters).
#[derive(Debug, Default)]
pub(crate) struct TrackArrays {
    endpoint: Vec<Uuid>,
    tenant: Vec<Uuid>,
    generation: Vec<Option<i64>>,
    access_version: Vec<Option<String>>,
    through: Vec<Option<String>>,
    last_was_reset: Vec<bool>,
    last_reset_generation: Vec<Option<i64>>,
    reload: Vec<Option<String>>,
    reloads_begun: Vec<i64>,
}

impl TrackArrays {
    pub(crate) const WIDTH: u32 = 10;

    pub(crate) fn push(
        &mut self,
        endpoint: EndpointId,
        tenant: TenantId,
        track: &EndpointTrack,
    ) -> Result<(), StoreError> {
        let (generation, last_reset_generation, reload) = track_values(track)?;
        self.endpoint.push(endpoint.0);
        self.tenant.push(tenant.0);
        self.generation.push(generation);
        self.access_version.push(track.access_version.clone());
        self.through.push(track.through.clone());
        self.last_was_reset.push(track.last_was_reset);
        self.last_reset_generation.push(last_reset_generation);
        self.reload.push(reload.map(|r| r.to_string()));
        self.reloads_begun.push(signed(track.reloads_begun)?);
        Ok(())
    }

    /// Adds the track's name and the arrays to `args`, in [`save_cte`]'s order.
    pub(crate) fn add_to(self, args: &mut PgArguments) -> Result<(), StoreError> {
        add(args, FEED_TRACK)?;
        add(args, self.endpoint)?;
        add(args, self.tenant)?;
        add(args, self.generation)?;
        add(args, self.access_version)?;
        add(args, self.through)?;
        add(args, self.last_was_reset)?;
        add(args, self.last_reset_generation)?;
        add(args, self.reload)?;
        add(args, self.reloads_begun)
    }
}

/// The CTE `saved_track`: writes the rows of [`TrackArrays`] bound from `$first`.
/// `reload_begun_at` moves only when the running reload changes.
pub(crate) fn save_cte(first: u32) -> String {
    let [name, e, t, g, av, th, lwr, lrg, rl, rb] = std::array::from_fn(|i| first + i as u32);
    format!(
        "saved_track AS (
             INSERT INTO endpoint_tracks AS t (endpoint_id, track, tenant_id, generation,
                 access_version, through, last_was_reset, last_reset_generation, reload,
                 reloads_begun, reload_begun_at)
             SELECT endpoint_id, ${name}, tenant_id, generation, access_version, through,
                    last_was_reset, last_reset_generation, reload::jsonb, reloads_begun,
                    CASE WHEN reload IS NULL THEN NULL ELSE now() END
             FROM unnest(${e}::uuid[], ${t}::uuid[], ${g}::int8[], ${av}::text[], ${th}::text[],
                         ${lwr}::bool[], ${lrg}::int8[], ${rl}::text[], ${rb}::int8[])
                 AS s(endpoint_id, tenant_id, generation, access_version, through,
                      last_was_reset, last_reset_generation, reload, reloads_begun)
             ON CONFLICT (endpoint_id, track) DO UPDATE
             SET generation = excluded.generation, access_version = excluded.access_version,
                 through = excluded.through, last_was_reset = excluded.last_was_reset,
                 last_reset_generation = excluded.last_reset_generation,
                 reload = excluded.reload, reloads_begun = excluded.reloads_begun,
                 reload_begun_at = CASE
                     WHEN excluded.reload IS NULL THEN NULL
                     WHEN t.reload IS NOT DISTINCT FROM excluded.reload THEN t.reload_begun_at
                     ELSE now() END,
                 updated_at = now()
             RETURNING endpoint_id
         )"
    )
}

fn signed(v: u64) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| StoreError::Invalid(format!("{v} is too large")))
}

/// A track's generations as Postgres keeps them, and its running reload as JSON.
type TrackValues = (Option<i64>, Option<i64>, Option<serde_json::Value>);

fn track_values(state: &EndpointTrack) -> Result<TrackValues, StoreError> {
    let reload = state
        .reload
        .as_ref()
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| StoreError::Invalid(format!("reload: {e}")))?;
    Ok((
        state.generation.map(signed).transpose()?,
        state.last_reset_generation.map(signed).transpose()?,
        reload,
    ))
}

/// The CTEs that open every statement holding endpoints, so all take an endpoint's locks the same
/// way: `input` (the claims: endpoints, tenants and tokens from `$first`, `$first + 1` and
/// `$first + 2`, in endpoint order), `fence` (the fence rows share-locked, in id order) and
/// `writer` (the writer lock, the change counter row, taken only where the token still matches;
/// its rows are the endpoints still owned, each with its counter's `last` as locked: the latest
/// committed, which may be past the one the statement's snapshot shows).
///
/// The counter row is locked, not rewritten: locking it writes one small WAL record, where a
/// no-op update wrote a new version of the row (and a lock record before it), and the lock is as
/// strong as the counter's update later in the transaction needs, so that update takes no lock
/// of its own. The row is made when the endpoint's fence is claimed (`fences::claim_endpoint`),
/// so a second writer waits on it and then sees the first's count; one claimed before that was
/// so gets its row here (`made`), where a second writer racing the first to it would find the
/// endpoint not its own and try again later, as after losing a fence.
pub(crate) fn claim_ctes(first: u32) -> String {
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
         made AS MATERIALIZED (
             INSERT INTO endpoint_change_counters (endpoint_id, tenant_id)
             SELECT i.endpoint_id, i.tenant_id
             FROM input i JOIN fence f ON f.endpoint_id = i.endpoint_id AND f.token = i.token
             ORDER BY i.endpoint_id
             ON CONFLICT (endpoint_id) DO NOTHING
             RETURNING endpoint_id, last
         ),
         writer AS MATERIALIZED (
             SELECT l.endpoint_id, l.last FROM (
                 SELECT c.endpoint_id, c.last
                 FROM endpoint_change_counters c
                 JOIN input i ON i.endpoint_id = c.endpoint_id
                 JOIN fence f ON f.endpoint_id = i.endpoint_id AND f.token = i.token
                 WHERE c.endpoint_id = ANY(${endpoints}::uuid[])
                 ORDER BY c.endpoint_id
                 FOR UPDATE OF c
             ) l
             UNION ALL
             SELECT endpoint_id, last FROM made
         )"
    )
}

/// A track row as the endpoint's state shows it; `reload` as JSON text.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct TrackState {
    pub track: String,
    pub generation: Option<i64>,
    pub access_version: Option<String>,
    pub through: Option<String>,
    pub last_was_reset: bool,
    pub reload: Option<String>,
    pub reload_begun_at: Option<time::OffsetDateTime>,
}

/// The tenant's endpoint's track rows by track.
pub async fn states<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<Vec<TrackState>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT track, generation, access_version, through, last_was_reset, reload::text,
                reload_begun_at
         FROM endpoint_tracks WHERE endpoint_id = $1 AND tenant_id = $2 ORDER BY track",
    )
    .bind(endpoint)
    .bind(tenant)
    .fetch_all(db)
    .await?)
}
