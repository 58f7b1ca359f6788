//! Each tenant's quotas (migration `..._tenant_quotas.sql`): the operator's defaults are settings
//! every tier reads (`RELAY_QUOTA_*`, [`QuotaDefaults`]); a tenant's row holds the overrides the
//! operator set for it, each NULL column meaning "the default". What is in force is the two
//! together ([`effective`]), read when it is needed, so a changed default or override takes
//! effect at the next decision that reads it.
//!
//! The endpoints quota is decided by the statement that registers an endpoint (relay-store's
//! `endpoints::register_within_quota`), under the tenant's row lock; the messages-per-second
//! quota is the front tier's to apply.

use sqlx::PgPool;

use crate::{StoreError, TenantId};

/// The operator's default for endpoints registered at once per tenant.
pub const DEFAULT_MAX_ENDPOINTS: u32 = 1000;
/// The operator's default for messages per second per tenant, taken by the front tier.
pub const DEFAULT_MESSAGES_PER_SECOND: u32 = 1000;
/// The largest value any quota takes (the table's CHECK says the same): far past any tenant's
/// need, and well inside a Postgres integer.
pub const MAX_QUOTA: u32 = 1_000_000;

/// The operator's defaults (the settings); a tenant's override replaces each that it sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaDefaults {
    pub max_endpoints: u32,
    pub messages_per_second: u32,
}

impl Default for QuotaDefaults {
    fn default() -> Self {
        Self {
            max_endpoints: DEFAULT_MAX_ENDPOINTS,
            messages_per_second: DEFAULT_MESSAGES_PER_SECOND,
        }
    }
}

/// A tenant's quotas in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantQuotas {
    pub max_endpoints: u32,
    pub messages_per_second: u32,
}

/// The quotas the operator set for one tenant; `None` is the operator's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QuotaOverrides {
    pub max_endpoints: Option<u32>,
    pub messages_per_second: Option<u32>,
}

impl QuotaOverrides {
    /// What is in force: each override where set, the default elsewhere.
    pub fn over(&self, defaults: &QuotaDefaults) -> TenantQuotas {
        TenantQuotas {
            max_endpoints: self.max_endpoints.unwrap_or(defaults.max_endpoints),
            messages_per_second: self
                .messages_per_second
                .unwrap_or(defaults.messages_per_second),
        }
    }

    fn is_empty(&self) -> bool {
        self.max_endpoints.is_none() && self.messages_per_second.is_none()
    }

    fn check(&self) -> Result<(), StoreError> {
        for (field, value) in [
            ("max_endpoints", self.max_endpoints),
            ("max_messages_per_second", self.messages_per_second),
        ] {
            if value.is_some_and(|v| !(1..=MAX_QUOTA).contains(&v)) {
                return Err(StoreError::Invalid(format!(
                    "{field} is 1 to {MAX_QUOTA}, or none for the operator's default"
                )));
            }
        }
        Ok(())
    }
}

/// A stored override, which the table's CHECK keeps positive.
fn quota(value: Option<i32>) -> Option<u32> {
    value.and_then(|v| u32::try_from(v).ok())
}

/// The overrides the operator set for `tenant` (none for a tenant with no row, or no tenant).
pub async fn overrides<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
) -> Result<QuotaOverrides, StoreError> {
    let row: Option<(Option<i32>, Option<i32>)> = sqlx::query_as(
        "SELECT max_endpoints, max_messages_per_second FROM tenant_quotas WHERE tenant_id = $1",
    )
    .bind(tenant)
    .fetch_optional(db)
    .await?;
    Ok(row
        .map(|(endpoints, messages)| QuotaOverrides {
            max_endpoints: quota(endpoints),
            messages_per_second: quota(messages),
        })
        .unwrap_or_default())
}

/// `tenant`'s quotas in force: its overrides over `defaults`.
pub async fn effective<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    defaults: &QuotaDefaults,
) -> Result<TenantQuotas, StoreError> {
    Ok(overrides(db, tenant).await?.over(defaults))
}

/// Replaces `tenant`'s overrides with `overrides` (all `None`: the defaults again). `false` when
/// the tenant does not exist or is being deleted; nothing is written then.
pub async fn set_overrides(
    pool: &PgPool,
    tenant: TenantId,
    overrides: &QuotaOverrides,
) -> Result<bool, StoreError> {
    overrides.check()?;
    if overrides.is_empty() {
        // No row is the same as a row of NULLs: keep the table to tenants with an override.
        let found: bool = sqlx::query_scalar(
            "WITH t AS (SELECT id FROM tenants WHERE id = $1 AND deleting_since IS NULL),
                  cleared AS (DELETE FROM tenant_quotas q USING t WHERE q.tenant_id = t.id)
             SELECT EXISTS (SELECT 1 FROM t)",
        )
        .bind(tenant)
        .fetch_one(pool)
        .await?;
        return Ok(found);
    }
    let written: Option<TenantId> = sqlx::query_scalar(
        "INSERT INTO tenant_quotas (tenant_id, max_endpoints, max_messages_per_second)
         SELECT t.id, $2, $3 FROM tenants t WHERE t.id = $1 AND t.deleting_since IS NULL
         ON CONFLICT (tenant_id) DO UPDATE
         SET max_endpoints = excluded.max_endpoints,
             max_messages_per_second = excluded.max_messages_per_second,
             updated_at = now()
         RETURNING tenant_id",
    )
    .bind(tenant)
    .bind(overrides.max_endpoints.map(|v| v as i32))
    .bind(overrides.messages_per_second.map(|v| v as i32))
    .fetch_optional(pool)
    .await?;
    Ok(written.is_some())
}

/// The endpoints that count against `tenant`'s endpoints quota: every one registered but those
/// being deleted (a tenant that deletes one may register another at once).
pub async fn endpoints_in_use<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
) -> Result<u32, StoreError> {
    let count: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_endpoints WHERE tenant_id = $1 AND status <> 'deleting'",
    )
    .bind(tenant)
    .fetch_one(db)
    .await?;
    Ok(u32::try_from(count).unwrap_or(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_override_replaces_its_default_and_only_its_own() {
        let defaults = QuotaDefaults {
            max_endpoints: 10,
            messages_per_second: 50,
        };
        assert_eq!(
            QuotaOverrides::default().over(&defaults),
            TenantQuotas {
                max_endpoints: 10,
                messages_per_second: 50
            }
        );
        let endpoints_only = QuotaOverrides {
            max_endpoints: Some(3),
            messages_per_second: None,
        };
        assert_eq!(
            endpoints_only.over(&defaults),
            TenantQuotas {
                max_endpoints: 3,
                messages_per_second: 50
            }
        );
    }

    #[test]
    fn overrides_out_of_range_are_refused_by_field() {
        for (overrides, field) in [
            (
                QuotaOverrides {
                    max_endpoints: Some(0),
                    messages_per_second: None,
                },
                "max_endpoints",
            ),
            (
                QuotaOverrides {
                    max_endpoints: None,
                    messages_per_second: Some(MAX_QUOTA + 1),
                },
                "max_messages_per_second",
            ),
        ] {
            match overrides.check() {
                Err(StoreError::Invalid(detail)) => assert!(detail.starts_with(field), "{detail}"),
                other => panic!("{other:?}"),
            }
        }
        assert!(QuotaOverrides {
            max_endpoints: Some(MAX_QUOTA),
            messages_per_second: Some(1)
        }
        .check()
        .is_ok());
    }
}
