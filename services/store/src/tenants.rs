//! Tenants: the teams that use the relay.

use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::{StoreError, TenantId};

#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Tenant {
    pub id: Uuid,
    pub name: String,
    pub created_at: OffsetDateTime,
}

pub async fn create(pool: &PgPool, id: Uuid, name: &str) -> Result<Tenant, StoreError> {
    let name = name.trim();
    if name.is_empty() || name.chars().count() > 200 {
        return Err(StoreError::Invalid(
            "a tenant's name is 1 to 200 characters".into(),
        ));
    }
    sqlx::query_as::<_, Tenant>(
        "INSERT INTO tenants (id, name) VALUES ($1, $2)
         ON CONFLICT (id) DO NOTHING
         RETURNING id, name, created_at",
    )
    .bind(id)
    .bind(name)
    .fetch_optional(pool)
    .await?
    .ok_or_else(|| StoreError::AlreadyExists {
        what: "tenant",
        id: id.to_string(),
    })
}

pub async fn get(pool: &PgPool, id: TenantId) -> Result<Option<Tenant>, StoreError> {
    Ok(sqlx::query_as::<_, Tenant>(
        "SELECT id, name, created_at FROM tenants WHERE id = $1 AND deleting_since IS NULL",
    )
    .bind(id)
    .fetch_optional(pool)
    .await?)
}

/// A page of tenants by id, after `after`.
pub async fn list(
    pool: &PgPool,
    after: Option<TenantId>,
    limit: i64,
) -> Result<Vec<Tenant>, StoreError> {
    Ok(sqlx::query_as::<_, Tenant>(
        "SELECT id, name, created_at FROM tenants
         WHERE ($1::uuid IS NULL OR id > $1) AND deleting_since IS NULL
         ORDER BY id LIMIT $2",
    )
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await?)
}
