//! Offboarding: deleting an endpoint, or a tenant with all its endpoints.
//!
//! Two steps, so that a delete is answered at once and survives a crash half way:
//! 1. **Mark** ([`mark_endpoint`], [`mark_tenant`]): one statement sets the endpoint's status
//!    to `deleting` (a tenant's `deleting_since`, and every endpoint of it). From its commit on,
//!    the front tier's batch insert takes no message for it (it reserves arrival numbers only
//!    for `active` endpoints, deciding in the statement), its auth lookup finds nothing (404),
//!    the sequencer's sweep skips it and no worker can claim its fence
//!    ([`fences::claim_endpoint`](crate::fences::claim_endpoint)), a worker that held it lets
//!    go when the change notification makes it read the registration again, and the control
//!    plane no longer shows it.
//! 2. **Purge** ([`purge_rows`] in batches, then [`finish_endpoint`]): the bulky rows go a
//!    batch at a time (short transactions, no long lock), then one transaction takes the
//!    endpoint's arrival counter and fence rows `FOR UPDATE` (waiting for any batch insert or
//!    apply transaction still in flight, which therefore cannot write after it), deletes what
//!    is left in every table and the endpoint's row. A tenant's row goes last
//!    ([`finish_tenant`]), once it has no endpoint left.
//!
//! Whoever runs the purge (the control plane) finds the work in Postgres
//! ([`deleting_endpoints`], [`deleting_tenants`]): a restart after a crash finishes it, and two
//! purgers at once delete nothing twice.
//!
//! This module deletes from every table keyed by endpoint: it is the one place that knows them
//! all ([`ENDPOINT_TABLES`]).

use sqlx::PgPool;
use uuid::Uuid;

use crate::{EndpointId, StoreError, TenantId};

/// Every table with rows of an endpoint, keyed by `endpoint_id`, in the order the purge
/// empties them, those that grow with traffic first. `webhook_endpoints` itself goes last, in
/// [`finish_endpoint`].
pub const ENDPOINT_TABLES: [&str; 22] = [
    "messages",
    "message_applications",
    "applied_events",
    "copy_items",
    "stories",
    "changes",
    "claimed",
    "stories_sync",
    "story_reads_owed",
    "quarantined_messages",
    "endpoint_tracks",
    "endpoint_apply_cursors",
    "endpoint_publish_cursors",
    "endpoint_change_counters",
    "endpoint_upstream_status",
    "reload_slot_waits",
    "endpoint_restores",
    "endpoint_lag_samples",
    "endpoint_activity_samples",
    "endpoint_secrets",
    "endpoint_fences",
    "endpoint_arrival_counters",
];

/// How many of [`ENDPOINT_TABLES`], from the first, are the tables whose rows [`purge_rows`]
/// deletes in batches: the ones that grow with traffic.
const BULKY_TABLES: usize = 6;

/// What marking an endpoint found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marked {
    /// Marked now.
    Marked,
    /// It was being deleted already.
    AlreadyDeleting,
}

/// Marks the tenant's endpoint `deleting`; `None` when the tenant has no such endpoint.
pub async fn mark_endpoint(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<Option<Marked>, StoreError> {
    // `before` is the row as the statement began: whether this statement is what marked it.
    let was: Option<String> = sqlx::query_scalar(
        "WITH before AS (
             SELECT status FROM webhook_endpoints WHERE id = $2 AND tenant_id = $1
         ),
         marked AS (
             UPDATE webhook_endpoints SET status = 'deleting', updated_at = now()
             WHERE id = $2 AND tenant_id = $1 AND status <> 'deleting'
             RETURNING id
         )
         SELECT status FROM before",
    )
    .bind(tenant)
    .bind(endpoint)
    .fetch_optional(pool)
    .await?;
    Ok(was.map(|status| {
        if status == "deleting" {
            Marked::AlreadyDeleting
        } else {
            Marked::Marked
        }
    }))
}

/// Marks the tenant deleting, and every endpoint of it; `None` when there is no such tenant.
pub async fn mark_tenant(pool: &PgPool, tenant: TenantId) -> Result<Option<Marked>, StoreError> {
    let was: Option<bool> = sqlx::query_scalar(
        "WITH before AS (
             SELECT deleting_since IS NOT NULL AS deleting FROM tenants WHERE id = $1
         ),
         tenant AS (
             UPDATE tenants SET deleting_since = now()
             WHERE id = $1 AND deleting_since IS NULL
             RETURNING id
         ),
         endpoints AS (
             UPDATE webhook_endpoints SET status = 'deleting', updated_at = now()
             WHERE tenant_id = $1 AND status <> 'deleting'
             RETURNING id
         )
         SELECT deleting FROM before",
    )
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    Ok(was.map(|deleting| {
        if deleting {
            Marked::AlreadyDeleting
        } else {
            Marked::Marked
        }
    }))
}

/// Endpoints marked `deleting` (with their tenants). Also marks the endpoints of tenants being
/// deleted that a registration racing the tenant's mark left active.
pub async fn deleting_endpoints(
    pool: &PgPool,
    limit: i64,
) -> Result<Vec<(TenantId, EndpointId)>, StoreError> {
    sqlx::query(
        "UPDATE webhook_endpoints e SET status = 'deleting', updated_at = now()
         FROM tenants t
         WHERE t.id = e.tenant_id AND t.deleting_since IS NOT NULL AND e.status <> 'deleting'",
    )
    .execute(pool)
    .await?;
    let rows: Vec<(Uuid, Uuid)> = sqlx::query_as(
        "SELECT tenant_id, id FROM webhook_endpoints WHERE status = 'deleting'
         ORDER BY id LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(tenant, endpoint)| (TenantId(tenant), EndpointId(endpoint)))
        .collect())
}

/// Deletes up to `batch` rows of each bulky table of the `deleting` endpoint, each table in a
/// statement of its own; how many went. Call until it answers 0, then [`finish_endpoint`].
pub async fn purge_rows(
    pool: &PgPool,
    endpoint: EndpointId,
    batch: i64,
) -> Result<u64, StoreError> {
    let mut deleted = 0;
    for table in &ENDPOINT_TABLES[..BULKY_TABLES] {
        // Only while the endpoint is still marked: a purger that lost a race to a finished
        // delete and a new registration of the id deletes nothing of the new one.
        let done = sqlx::query(&format!(
            "DELETE FROM {table} WHERE ctid = ANY (ARRAY (
                 SELECT ctid FROM {table} WHERE endpoint_id = $1
                   AND EXISTS (SELECT 1 FROM webhook_endpoints
                               WHERE id = $1 AND status = 'deleting')
                 LIMIT $2))"
        ))
        .bind(endpoint)
        .bind(batch)
        .execute(pool)
        .await?;
        deleted += done.rows_affected();
    }
    Ok(deleted)
}

/// Deletes whatever is left of the `deleting` endpoint and its row, in one transaction that
/// first takes its arrival counter and fence rows `FOR UPDATE`: a batch insert or an apply
/// transaction in flight finishes first, and none can write after. `false` when the endpoint
/// is not (or no longer) marked.
pub async fn finish_endpoint(pool: &PgPool, endpoint: EndpointId) -> Result<bool, StoreError> {
    let marked: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM webhook_endpoints WHERE id = $1 AND status = 'deleting')",
    )
    .bind(endpoint)
    .fetch_one(pool)
    .await?;
    if !marked {
        // Nothing turns a `deleting` endpoint back: one not marked now is not ours to delete.
        return Ok(false);
    }
    let mut tx = pool.begin().await?;
    // The writers' lock order: the counter (the front tier's batch insert), then the fence
    // (the sequencer's apply transaction).
    sqlx::query("SELECT 1 FROM endpoint_arrival_counters WHERE endpoint_id = $1 FOR UPDATE")
        .bind(endpoint)
        .execute(&mut *tx)
        .await?;
    sqlx::query("SELECT 1 FROM endpoint_fences WHERE endpoint_id = $1 FOR UPDATE")
        .bind(endpoint)
        .execute(&mut *tx)
        .await?;
    // Then the change counter (the sequencer's writer lock, which the publisher's mark shares):
    // a mark in flight commits its cursor before the rows go, or finds the counter gone and
    // writes none; without it, a mark's insert could bring a publish cursor back after its
    // delete.
    sqlx::query("SELECT 1 FROM endpoint_change_counters WHERE endpoint_id = $1 FOR UPDATE")
        .bind(endpoint)
        .execute(&mut *tx)
        .await?;
    for table in ENDPOINT_TABLES {
        sqlx::query(&format!("DELETE FROM {table} WHERE endpoint_id = $1"))
            .bind(endpoint)
            .execute(&mut *tx)
            .await?;
    }
    let deleted =
        sqlx::query("DELETE FROM webhook_endpoints WHERE id = $1 AND status = 'deleting'")
            .bind(endpoint)
            .execute(&mut *tx)
            .await?;
    tx.commit().await?;
    Ok(deleted.rows_affected() > 0)
}

/// Tenants being deleted, and whether each has no endpoint left (then its broker objects can
/// be removed and [`finish_tenant`] called).
pub async fn deleting_tenants(pool: &PgPool) -> Result<Vec<(TenantId, bool)>, StoreError> {
    let rows: Vec<(Uuid, bool)> = sqlx::query_as(
        "SELECT t.id, NOT EXISTS (SELECT 1 FROM webhook_endpoints e WHERE e.tenant_id = t.id)
         FROM tenants t WHERE t.deleting_since IS NOT NULL ORDER BY t.id",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(tenant, empty)| (TenantId(tenant), empty))
        .collect())
}

/// Deletes the tenant being deleted once it has no endpoint: its row, and with it its
/// destination, broker user record and publishing fence (taken `FOR UPDATE` first, so a
/// publisher's mark in flight finishes before). `false` when it is not marked or still has an
/// endpoint.
pub async fn finish_tenant(pool: &PgPool, tenant: TenantId) -> Result<bool, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT 1 FROM publisher_fences WHERE tenant_id = $1 FOR UPDATE")
        .bind(tenant)
        .execute(&mut *tx)
        .await?;
    let deleted = sqlx::query(
        "DELETE FROM tenants t WHERE t.id = $1 AND t.deleting_since IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM webhook_endpoints e WHERE e.tenant_id = t.id)",
    )
    .bind(tenant)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(deleted.rows_affected() > 0)
}
