//! Which endpoints' reloads wait for one of a sequencer's reload slots, and since when
//! (migration `..._reload_slot_waits.sql`): the sequencer records a wait when a reload cannot
//! take a slot at once and ends it when it takes one; the control plane shows it in the
//! endpoint's state.

use time::OffsetDateTime;

use crate::{EndpointId, StoreError, TenantId};

/// `endpoint`'s reload, run by the owner holding `token`, began waiting for a slot now.
pub async fn begin<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
    token: i64,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO reload_slot_waits (endpoint_id, tenant_id, token, waiting_since)
         VALUES ($1, $2, $3, now())
         ON CONFLICT (endpoint_id) DO UPDATE
         SET tenant_id = excluded.tenant_id, token = excluded.token,
             waiting_since = excluded.waiting_since",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(token)
    .execute(db)
    .await?;
    Ok(())
}

/// The wait [`begin`] recorded for `token` is over (a slot was taken, or the reload stopped).
/// A newer owner's wait is left alone.
pub async fn end<'e>(
    db: impl sqlx::PgExecutor<'e>,
    endpoint: EndpointId,
    token: i64,
) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM reload_slot_waits WHERE endpoint_id = $1 AND token <= $2")
        .bind(endpoint)
        .bind(token)
        .execute(db)
        .await?;
    Ok(())
}

/// Since when `endpoint`'s reload has waited for a slot; `None` when it does not wait (or the
/// owner that recorded the wait is gone: its token is no longer the endpoint's fence's).
pub async fn waiting_since<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<Option<OffsetDateTime>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT w.waiting_since FROM reload_slot_waits w
         JOIN endpoint_fences f ON f.endpoint_id = w.endpoint_id AND f.token = w.token
         WHERE w.endpoint_id = $1 AND w.tenant_id = $2",
    )
    .bind(endpoint)
    .bind(tenant)
    .fetch_optional(db)
    .await?)
}
