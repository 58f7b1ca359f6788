//! The fencing tokens of relay-coord's ownership: one row per owned thing whose token rises by
//! one each time an owner takes it: an endpoint's (`endpoint_fences`, the sequencer's workers)
//! and a tenant's (`publisher_fences`, the publisher's tasks).
//!
//! An owner's writes check, under a share lock on the row, that the token is still its own: an
//! endpoint's apply transaction with [`check_endpoint`], the publisher's mark in its own
//! statement ([`changes::mark_published`](crate::changes::mark_published)). A claim therefore
//! waits for the previous owner's write in flight, and a stale owner writes nothing.

use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::{EndpointId, StoreError, TenantId};

/// One kind of fenced thing: its fence table, keyed by `key`, and the rows that may be claimed
/// (`live`: registered and not being deleted).
struct Fence {
    table: &'static str,
    key: &'static str,
    /// The owned things' table and the condition that leaves one claimable.
    owners: &'static str,
    live: &'static str,
    what: &'static str,
    /// Rows the claim makes sure exist beside the token's (a data-modifying `WITH` clause
    /// reading `claimed`), or nothing.
    beside: &'static str,
}

const ENDPOINT: Fence = Fence {
    table: "endpoint_fences",
    key: "endpoint_id",
    owners: "webhook_endpoints",
    live: "status <> 'deleting'",
    what: "webhook endpoint",
    // The change counter row, whose lock is an apply transaction's writer lock
    // (`tracks::claim_ctes`): made here, a writer's lock has a row to wait on even when two
    // writers of one token race to the endpoint's first change.
    beside: ", counter AS (
                 INSERT INTO endpoint_change_counters (endpoint_id, tenant_id)
                 SELECT e.id, e.tenant_id FROM webhook_endpoints e JOIN claimed c ON e.id = c.id
                 ON CONFLICT (endpoint_id) DO NOTHING
             )",
};

const TENANT: Fence = Fence {
    table: "publisher_fences",
    key: "tenant_id",
    owners: "tenants",
    live: "deleting_since IS NULL",
    what: "tenant",
    beside: "",
};

impl Fence {
    /// Claims `id`'s next token: one more than the last, whoever held it; `NotFound` when it is
    /// not claimable.
    async fn claim(&self, pool: &PgPool, id: Uuid) -> Result<i64, StoreError> {
        let Fence {
            table,
            key,
            owners,
            live,
            what,
            beside,
        } = *self;
        let token: Option<i64> = sqlx::query_scalar(&format!(
            "WITH claimed AS (
                 INSERT INTO {table} ({key}, token)
                 SELECT id, 1 FROM {owners} WHERE id = $1 AND {live}
                 ON CONFLICT ({key})
                 DO UPDATE SET token = {table}.token + 1, claimed_at = now()
                 RETURNING {key} AS id, token
             ){beside}
             SELECT token FROM claimed"
        ))
        .bind(id)
        .fetch_optional(pool)
        .await?;
        token.ok_or_else(|| StoreError::NotFound {
            what,
            id: id.to_string(),
        })
    }
}

/// Claims the endpoint's next fencing token: one more than the last, whoever held it. Waits
/// while another owner's apply transaction holds the token's row (see [`check_endpoint`]).
/// `NotFound` for an endpoint that is not registered or is being deleted: nothing may write
/// for it any more.
pub async fn claim_endpoint(pool: &PgPool, endpoint: EndpointId) -> Result<i64, StoreError> {
    ENDPOINT.claim(pool, endpoint.0).await
}

/// Claims the tenant's next publishing token: one more than the last, whoever held it. Waits
/// while another owner's mark holds the token's row.
/// `NotFound` for a tenant that does not exist or is being deleted.
pub async fn claim_tenant(pool: &PgPool, tenant: TenantId) -> Result<i64, StoreError> {
    TENANT.claim(pool, tenant.0).await
}

/// In an apply transaction, before any write: whether `token` is still the endpoint's current
/// fencing token. Holds a share lock on the token's row until the transaction ends, so no new
/// owner can claim the endpoint in between. Roll back when it answers `false`.
pub async fn check_endpoint(
    conn: &mut PgConnection,
    endpoint: EndpointId,
    token: i64,
) -> Result<bool, StoreError> {
    let current: Option<i64> =
        sqlx::query_scalar("SELECT token FROM endpoint_fences WHERE endpoint_id = $1 FOR SHARE")
            .bind(endpoint)
            .fetch_optional(conn)
            .await?;
    Ok(current == Some(token))
}
