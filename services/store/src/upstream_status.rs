//! How each endpoint's calls to its upstream fare (migrations `..._upstream_status.sql` and
//! `..._upstream_failures.sql`): the sequencer records each failed read (counting the failures
//! in a row) and the success that ends a failing stretch; the control plane shows them in the
//! endpoint's state.
//!
//! A success writes only when the row says failing, so an endpoint whose upstream answers well
//! costs one statement that changes nothing.

use time::OffsetDateTime;

use crate::quarantine::reason_text;
use crate::{EndpointId, StoreError, TenantId};

/// An endpoint's upstream calls as last recorded.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct UpstreamStatus {
    pub last_error_kind: String,
    pub last_error: String,
    /// `None`: the last call answered well.
    pub failing_since: Option<OffsetDateTime>,
    pub last_failure_at: OffsetDateTime,
    pub last_success_at: Option<OffsetDateTime>,
    /// Calls failed in a row since the last that answered well (0 once one does).
    pub consecutive_failures: i32,
}

impl UpstreamStatus {
    pub fn failing(&self) -> bool {
        self.failing_since.is_some()
    }
}

/// A call to `endpoint`'s upstream failed: `kind` names the failure for users, `detail` says it
/// with its causes (kept as [`reason_text`] keeps a reason). A failing stretch keeps the time
/// it began. Returns the failures in a row, this one included.
pub async fn record_failure<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
    kind: &str,
    detail: &str,
) -> Result<i32, StoreError> {
    let failures: i32 = sqlx::query_scalar(
        "INSERT INTO endpoint_upstream_status AS s
             (endpoint_id, tenant_id, last_error_kind, last_error, failing_since, last_failure_at,
              consecutive_failures)
         VALUES ($1, $2, $3, $4, now(), now(), 1)
         ON CONFLICT (endpoint_id) DO UPDATE
         SET last_error_kind = excluded.last_error_kind, last_error = excluded.last_error,
             failing_since = COALESCE(s.failing_since, excluded.failing_since),
             last_failure_at = excluded.last_failure_at,
             consecutive_failures = CASE WHEN s.failing_since IS NULL THEN 1
                                         ELSE least(s.consecutive_failures, 2147483646) + 1 END
         RETURNING consecutive_failures",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(kind)
    .bind(reason_text(detail))
    .fetch_one(db)
    .await?;
    Ok(failures)
}

/// A call to `endpoint`'s upstream answered well: ends a failing stretch, if one runs (and
/// writes nothing otherwise).
pub async fn record_success<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE endpoint_upstream_status
         SET failing_since = NULL, last_success_at = now(), consecutive_failures = 0
         WHERE endpoint_id = $1 AND tenant_id = $2 AND failing_since IS NOT NULL",
    )
    .bind(endpoint)
    .bind(tenant)
    .execute(db)
    .await?;
    Ok(())
}

/// `endpoint`'s status, if a call of its ever failed.
pub async fn read<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<Option<UpstreamStatus>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT last_error_kind, last_error, failing_since, last_failure_at, last_success_at,
                consecutive_failures
         FROM endpoint_upstream_status WHERE endpoint_id = $1 AND tenant_id = $2",
    )
    .bind(endpoint)
    .bind(tenant)
    .fetch_optional(db)
    .await?)
}
