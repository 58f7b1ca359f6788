//! After the database is restored from a backup (`docs/restore.md`): each endpoint's restore
//! held until its rewind is answered (`endpoint_restores`), and the new epoch of its change
//! stream that the restore begins (`endpoint_change_counters.epoch`, opened by a snapshot of the
//! copy in `changes`).
//!
//! [`mark`] is what `relay restored` runs for each endpoint, before any tier starts on the
//! restored database; [`resync`] begins a new epoch the same way while the tiers run, for a
//! consumer that lost its state. [`answered`] is what the control plane's rewind runs once the upstream
//! answered (or, with no call, once it decided to read the feed again), with relay-rules'
//! [`answer_rewind`](relay_rules::answer_rewind) deciding under the track row's lock.

use relay_rules::{EndpointTrack, PendingRestore, RewindAnswered};
use sqlx::{PgConnection, PgPool};
use time::OffsetDateTime;

use crate::endpoints::Source;
use crate::tracks::{self, FEED_TRACK};
use crate::{EndpointId, StoreError, TenantId};

/// An endpoint's restore, held until its rewind is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restore {
    /// What the backup kept of the feed track.
    pub held: PendingRestore,
    /// When `relay restored` marked it: the event ids applied from then on are forgotten when the
    /// rewind is answered (see [`RewindAnswered::release_restore`]).
    pub restored_at: OffsetDateTime,
}

/// The endpoint's restore still waiting for its rewind's answer, if any.
pub async fn pending<'e>(
    db: impl sqlx::PgExecutor<'e>,
    endpoint: EndpointId,
) -> Result<Option<Restore>, StoreError> {
    let row: Option<(Option<String>, bool, OffsetDateTime)> = sqlx::query_as(
        "SELECT through, last_was_reset, restored_at FROM endpoint_restores
         WHERE endpoint_id = $1",
    )
    .bind(endpoint)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|(through, last_was_reset, restored_at)| Restore {
        held: PendingRestore {
            through,
            last_was_reset,
        },
        restored_at,
    }))
}

/// One endpoint as [`mark`] left it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marked {
    pub endpoint: EndpointId,
    pub tenant: TenantId,
    /// The restore held for the rewind: the backup's track (or, when the endpoint was marked
    /// before and its rewind not yet answered, that first mark's, which is no later). `None` for
    /// a stories endpoint: it has no feed track to rewind, and catches up from the cursor the
    /// backup kept as soon as its worker starts.
    pub restore: Option<Restore>,
    /// The new epoch of the endpoint's change stream.
    pub epoch: i64,
    /// How many items the snapshot that opens it holds.
    pub snapshot_items: i64,
}

/// Every endpoint's id, in id order: what `relay restored` marks.
pub async fn endpoints(pool: &PgPool) -> Result<Vec<EndpointId>, StoreError> {
    Ok(
        sqlx::query_scalar("SELECT id FROM webhook_endpoints ORDER BY id")
            .fetch_all(pool)
            .await?,
    )
}

/// Marks the endpoint restored, in one transaction; `None` when it does not exist.
///
/// 1. Takes the endpoint's fencing token and its tenant's publishing token: a sequencer or
///    publisher still running on this database (the procedure says to start none before) is
///    fenced out, and its successor reads everything afresh.
/// 2. Holds the restore: the feed track's `through` and `last_was_reset` as the backup kept them
///    (none when no message was ever taken: then the rewind reads the feed again). A restore
///    already held is kept: it is no later than this one.
/// 3. Begins a new epoch of the change stream: the counter row (the endpoint's writer lock) takes
///    the greater of one more than its epoch and the time in milliseconds (so two restores of
///    one backup never share an epoch), the old epoch's changes are deleted, and the new stream
///    opens with a snapshot of the copy: change 1 `snapshot_begin`, one `upsert` per item in
///    subject order, then `snapshot_end`, each with `snapshot` set; the publish cursor goes back
///    to 0. Live changes follow the snapshot.
///
/// Running it again for an endpoint begins another epoch with another snapshot: consumers
/// rebuild once more, nothing is lost.
pub async fn mark(pool: &PgPool, endpoint: EndpointId) -> Result<Option<Marked>, StoreError> {
    let mut tx = pool.begin().await?;
    let Some((tenant, source)) = sqlx::query_as::<_, (TenantId, String)>(
        "SELECT tenant_id, source FROM webhook_endpoints WHERE id = $1 FOR SHARE",
    )
    .bind(endpoint)
    .fetch_optional(&mut *tx)
    .await?
    else {
        return Ok(None);
    };
    // In the order every writer takes them: fence, then the counter (a sequencer's apply holds
    // its fence shared, then the counter; a publisher's mark its tenant's fence, then the
    // cursors).
    sqlx::query(
        "WITH endpoint_fence AS (
             UPDATE endpoint_fences SET token = token + 1, claimed_at = now()
             WHERE endpoint_id = $1
         )
         UPDATE publisher_fences SET token = token + 1, claimed_at = now()
         WHERE tenant_id = $2",
    )
    .bind(endpoint)
    .bind(tenant)
    .execute(&mut *tx)
    .await?;
    let epoch = next_epoch(&mut tx, endpoint, tenant).await?;
    let restore = if source == Source::Feed.kind() {
        Some(hold(&mut tx, endpoint, tenant).await?)
    } else {
        None
    };
    let snapshot_items = crate::copy::open_epoch(&mut tx, endpoint, tenant).await?;
    tx.commit().await?;
    Ok(Some(Marked {
        endpoint,
        tenant,
        restore,
        epoch,
        snapshot_items,
    }))
}

/// Holds the feed track's restore: its `through` and `last_was_reset` as the backup kept them,
/// or the restore already held, which is no later.
async fn hold(
    conn: &mut PgConnection,
    endpoint: EndpointId,
    tenant: TenantId,
) -> Result<Restore, StoreError> {
    let (through, last_was_reset, restored_at): (Option<String>, bool, OffsetDateTime) =
        sqlx::query_as(
            "WITH held AS (
                 INSERT INTO endpoint_restores
                     (endpoint_id, tenant_id, through, last_was_reset, restored_at)
                 SELECT $1, $2, t.through, COALESCE(t.last_was_reset, false), now()
                 FROM (SELECT 1) AS one
                 LEFT JOIN endpoint_tracks t ON t.endpoint_id = $1 AND t.track = $3
                 ON CONFLICT (endpoint_id) DO NOTHING
                 RETURNING through, last_was_reset, restored_at
             )
             SELECT through, last_was_reset, restored_at FROM held
             UNION ALL
             SELECT through, last_was_reset, restored_at FROM endpoint_restores
             WHERE endpoint_id = $1 AND NOT EXISTS (SELECT 1 FROM held)",
        )
        .bind(endpoint)
        .bind(tenant)
        .bind(FEED_TRACK)
        .fetch_one(conn)
        .await?;
    Ok(Restore {
        held: PendingRestore {
            through,
            last_was_reset,
        },
        restored_at,
    })
}

/// Begins the endpoint's next epoch on its change counter (the endpoint's writer lock, held to
/// the transaction's end): the greater of one more than its epoch and the time in milliseconds,
/// so two epochs begun from one backup never share a number; the stream starts again at 0.
async fn next_epoch(
    conn: &mut PgConnection,
    endpoint: EndpointId,
    tenant: TenantId,
) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        "INSERT INTO endpoint_change_counters AS c (endpoint_id, tenant_id, last, epoch)
         VALUES ($1, $2, 0, (extract(epoch FROM clock_timestamp()) * 1000)::int8)
         ON CONFLICT (endpoint_id) DO UPDATE
             SET epoch = GREATEST(c.epoch + 1, excluded.epoch), last = 0
         RETURNING epoch",
    )
    .bind(endpoint)
    .bind(tenant)
    .fetch_one(conn)
    .await?)
}

/// What [`resync`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resync {
    /// A new epoch began, opened by a snapshot of this many items.
    Begun { epoch: i64, snapshot_items: i64 },
    /// The current epoch's snapshot is not all sent yet: nothing done (a consumer gets the
    /// copy from that one, and a tenant asking again and again cannot make the relay write its
    /// whole copy again each time).
    SnapshotUnsent { epoch: i64 },
}

/// Resyncs the tenant's endpoint while every tier runs: a new epoch of its change stream,
/// opened by a snapshot of the copy as it is now (as [`mark`] opens one), so that a consumer
/// that lost everything rebuilds the copy from its queue alone. `None` when the endpoint is
/// not the tenant's.
///
/// In one transaction, in the writers' lock order: the endpoint's fence row is locked (not
/// taken: the sequencer's apply transactions wait for this one and then go on, their next
/// changes following the snapshot in the new epoch), then the counter; the tenant's publishing
/// token is taken, so a publisher's mark in flight of an old change cannot move the new
/// epoch's cursor (its owner gives the tenant up at its next mark or sweep, and the next one
/// starts from the snapshot).
pub async fn resync(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<Option<Resync>, StoreError> {
    let mut tx = pool.begin().await?;
    let owned: Option<TenantId> = sqlx::query_scalar(
        "SELECT tenant_id FROM webhook_endpoints
         WHERE id = $1 AND tenant_id = $2 AND status <> 'deleting' FOR SHARE",
    )
    .bind(endpoint)
    .bind(tenant)
    .fetch_optional(&mut *tx)
    .await?;
    if owned.is_none() {
        return Ok(None);
    }
    sqlx::query("SELECT 1 FROM endpoint_fences WHERE endpoint_id = $1 FOR UPDATE")
        .bind(endpoint)
        .execute(&mut *tx)
        .await?;
    // The current epoch's `snapshot_end`, if it is still past the publish cursor.
    let unsent: Option<i64> = sqlx::query_scalar(
        "SELECT n.epoch FROM endpoint_change_counters n
         JOIN changes c ON c.endpoint_id = n.endpoint_id AND c.operation = 'snapshot_end'
         LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = n.endpoint_id
         WHERE n.endpoint_id = $1 AND c.change_seq > COALESCE(p.published_through, 0)
         LIMIT 1",
    )
    .bind(endpoint)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(epoch) = unsent {
        return Ok(Some(Resync::SnapshotUnsent { epoch }));
    }
    let epoch = next_epoch(&mut tx, endpoint, tenant).await?;
    sqlx::query(
        "UPDATE publisher_fences SET token = token + 1, claimed_at = now() WHERE tenant_id = $1",
    )
    .bind(tenant)
    .execute(&mut *tx)
    .await?;
    let snapshot_items = crate::copy::open_epoch(&mut tx, endpoint, tenant).await?;
    tx.commit().await?;
    Ok(Some(Resync::Begun {
        epoch,
        snapshot_items,
    }))
}

/// Carries out the answer to a restored track's plan, in one transaction under the track row's
/// lock (created when missing): `decide` (relay-rules' `answer_rewind`) is asked with the row as
/// it is then; the track it gives is written; when it releases the restore, the restore held
/// since `restored_at` is let go and the event ids applied to the copy since then are
/// forgotten. A restore marked again meanwhile (another `restored_at`) is left held. Returns the
/// track as it ends and the answer.
pub async fn answered(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    restored_at: Option<OffsetDateTime>,
    decide: impl FnOnce(&EndpointTrack) -> RewindAnswered,
) -> Result<(EndpointTrack, RewindAnswered), StoreError> {
    tracks::ensure(pool, tenant, endpoint).await?;
    let mut tx = pool.begin().await?;
    let held = tracks::lock(&mut tx, tenant, endpoint).await?;
    let answer = decide(&held);
    if let Some(next) = &answer.track {
        tracks::save(&mut tx, tenant, endpoint, next).await?;
    }
    if let (true, Some(restored_at)) = (answer.release_restore, restored_at) {
        release(&mut tx, endpoint, restored_at).await?;
    }
    tx.commit().await?;
    let track = answer.track.clone().unwrap_or(held);
    Ok((track, answer))
}

/// Lets go of the restore marked at `restored_at` and forgets the event ids applied since.
async fn release(
    conn: &mut PgConnection,
    endpoint: EndpointId,
    restored_at: OffsetDateTime,
) -> Result<(), StoreError> {
    sqlx::query(
        "WITH released AS (
             DELETE FROM endpoint_restores WHERE endpoint_id = $1 AND restored_at = $2
             RETURNING restored_at
         )
         DELETE FROM applied_events
         WHERE endpoint_id = $1 AND applied_at >= (SELECT restored_at FROM released)",
    )
    .bind(endpoint)
    .bind(restored_at)
    .execute(conn)
    .await?;
    Ok(())
}
