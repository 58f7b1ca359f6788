//! Tenants' users on the relay's broker: which tenant has one, by what name, since when. The
//! user itself (its password hash and permissions) lives in RabbitMQ.

use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::{StoreError, TenantId};

#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct BrokerUser {
    pub tenant_id: Uuid,
    pub username: String,
    pub created_at: OffsetDateTime,
    pub rotated_at: OffsetDateTime,
}

const COLUMNS: &str = "tenant_id, username, created_at, rotated_at";

pub async fn get(pool: &PgPool, tenant: TenantId) -> Result<Option<BrokerUser>, StoreError> {
    Ok(sqlx::query_as::<_, BrokerUser>(&format!(
        "SELECT {COLUMNS} FROM tenant_broker_users WHERE tenant_id = $1"
    ))
    .bind(tenant)
    .fetch_optional(pool)
    .await?)
}

/// Records that the tenant's user was made or its password set anew (`rotated_at` now).
/// `None` when the tenant does not exist.
pub async fn record(
    pool: &PgPool,
    tenant: TenantId,
    username: &str,
) -> Result<Option<BrokerUser>, StoreError> {
    Ok(sqlx::query_as::<_, BrokerUser>(&format!(
        "INSERT INTO tenant_broker_users (tenant_id, username)
         SELECT t.id, $2 FROM tenants t WHERE t.id = $1
         ON CONFLICT (tenant_id) DO UPDATE SET username = excluded.username, rotated_at = now()
         RETURNING {COLUMNS}"
    ))
    .bind(tenant)
    .bind(username)
    .fetch_optional(pool)
    .await?)
}

/// Every tenant that has a user.
pub async fn tenants(pool: &PgPool) -> Result<Vec<TenantId>, StoreError> {
    let ids: Vec<Uuid> = sqlx::query_scalar("SELECT tenant_id FROM tenant_broker_users")
        .fetch_all(pool)
        .await?;
    Ok(ids.into_iter().map(TenantId).collect())
}

/// Forgets the tenant's user; whether there was one.
pub async fn delete(pool: &PgPool, tenant: TenantId) -> Result<bool, StoreError> {
    let done = sqlx::query("DELETE FROM tenant_broker_users WHERE tenant_id = $1")
        .bind(tenant)
        .execute(pool)
        .await?;
    Ok(done.rows_affected() > 0)
}
