//! Tenants' quotas, as operators read and set them: the operator's defaults (settings every tier
//! reads: RELAY_QUOTA_MAX_ENDPOINTS, RELAY_QUOTA_MESSAGES_PER_SECOND), each tenant's overrides,
//! and what is in force. relay-store's `quotas` keeps them; a tenant reads its own in
//! `GET /v1/tenant`.

use axum::extract::{Path, State};
use axum::Json;
use relay_store::quotas::{self, QuotaDefaults, QuotaOverrides, TenantQuotas, MAX_QUOTA};
use relay_store::TenantId;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::{parse_tenant_id, AppState};
use crate::auth::Operator;
use crate::error::{ApiError, ErrorBody, JsonBody};

/// Quotas with a value each.
#[derive(Debug, Serialize, ToSchema)]
pub struct QuotaValues {
    /// Endpoints registered at once (those being deleted do not count).
    pub max_endpoints: u32,
    /// Messages per second the front tier takes for the tenant's endpoints together.
    pub max_messages_per_second: u32,
}

impl From<TenantQuotas> for QuotaValues {
    fn from(quotas: TenantQuotas) -> Self {
        Self {
            max_endpoints: quotas.max_endpoints,
            max_messages_per_second: quotas.messages_per_second,
        }
    }
}

impl From<QuotaDefaults> for QuotaValues {
    fn from(defaults: QuotaDefaults) -> Self {
        Self {
            max_endpoints: defaults.max_endpoints,
            max_messages_per_second: defaults.messages_per_second,
        }
    }
}

/// The quotas the operator set for one tenant; null: the operator's default.
#[derive(Debug, Serialize, ToSchema)]
pub struct QuotaOverridesView {
    pub max_endpoints: Option<u32>,
    pub max_messages_per_second: Option<u32>,
}

/// What a tenant uses of its quotas now.
#[derive(Debug, Serialize, ToSchema)]
pub struct UsageView {
    /// Endpoints registered (those being deleted do not count).
    pub endpoints: u32,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TenantQuotasView {
    pub tenant_id: Uuid,
    /// What the operator set for this tenant.
    pub overrides: QuotaOverridesView,
    /// The operator's defaults (RELAY_QUOTA_MAX_ENDPOINTS, RELAY_QUOTA_MESSAGES_PER_SECOND).
    pub defaults: QuotaValues,
    /// What is in force: each override where set, the default elsewhere.
    pub in_force: QuotaValues,
    pub usage: UsageView,
}

/// A tenant's overrides, all of them: a field absent or null is no override (the operator's
/// default applies).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct QuotaOverridesBody {
    /// 1 to 1000000, or null.
    #[serde(default)]
    pub max_endpoints: Option<i64>,
    /// 1 to 1000000, or null.
    #[serde(default)]
    pub max_messages_per_second: Option<i64>,
}

fn quota(field: &str, value: Option<i64>) -> Result<Option<u32>, ApiError> {
    value
        .map(|v| {
            u32::try_from(v)
                .ok()
                .filter(|v| (1..=MAX_QUOTA).contains(v))
                .ok_or_else(|| {
                    ApiError::invalid(
                        field,
                        format!(
                            "a whole number from 1 to {MAX_QUOTA}, or null for the operator's \
                             default"
                        ),
                    )
                })
        })
        .transpose()
}

/// What a tenant uses now: the endpoints that count against its quota.
pub async fn usage(state: &AppState, tenant: TenantId) -> Result<UsageView, ApiError> {
    Ok(UsageView {
        endpoints: quotas::endpoints_in_use(&state.pool, tenant).await?,
    })
}

async fn view(state: &AppState, tenant: TenantId) -> Result<TenantQuotasView, ApiError> {
    let overrides = quotas::overrides(&state.pool, tenant).await?;
    Ok(TenantQuotasView {
        tenant_id: tenant.0,
        overrides: QuotaOverridesView {
            max_endpoints: overrides.max_endpoints,
            max_messages_per_second: overrides.messages_per_second,
        },
        defaults: state.quotas.into(),
        in_force: overrides.over(&state.quotas).into(),
        usage: usage(state, tenant).await?,
    })
}

async fn existing(state: &AppState, tenant_id: &str) -> Result<TenantId, ApiError> {
    let id = parse_tenant_id(tenant_id)?;
    relay_store::tenants::get(&state.pool, id)
        .await?
        .ok_or(ApiError::NotFound("tenant"))?;
    Ok(id)
}

#[utoipa::path(
    get, path = "/v1/tenants/{tenant_id}/quotas", tag = "tenants", security(("bearer" = [])),
    params(("tenant_id" = Uuid, Path)),
    responses(
        (status = 200, body = TenantQuotasView, description = "The tenant's overrides, the \
            operator's defaults, what is in force, and what the tenant uses"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn get_quotas(
    State(state): State<AppState>,
    _operator: Operator,
    Path(tenant_id): Path<String>,
) -> Result<Json<TenantQuotasView>, ApiError> {
    let id = existing(&state, &tenant_id).await?;
    Ok(Json(view(&state, id).await?))
}

#[utoipa::path(
    put, path = "/v1/tenants/{tenant_id}/quotas", tag = "tenants", security(("bearer" = [])),
    params(("tenant_id" = Uuid, Path)),
    request_body = QuotaOverridesBody,
    responses(
        (status = 200, body = TenantQuotasView, description = "The overrides replaced (a field \
            absent or null: the default again), in force at once. A quota lowered below what \
            the tenant uses removes nothing: it refuses more"),
        (status = 400, body = ErrorBody, description = "A value that is not a whole number \
            from 1 to 1000000 (the field named): nothing changed"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn put_quotas(
    State(state): State<AppState>,
    operator: Operator,
    Path(tenant_id): Path<String>,
    JsonBody(body): JsonBody<QuotaOverridesBody>,
) -> Result<Json<TenantQuotasView>, ApiError> {
    let id = parse_tenant_id(&tenant_id)?;
    let overrides = QuotaOverrides {
        max_endpoints: quota("max_endpoints", body.max_endpoints)?,
        messages_per_second: quota("max_messages_per_second", body.max_messages_per_second)?,
    };
    if !quotas::set_overrides(&state.pool, id, &overrides).await? {
        return Err(ApiError::NotFound("tenant"));
    }
    tracing::info!(tenant = %id, by = %operator.subject, ?overrides, "tenant quotas set");
    Ok(Json(view(&state, id).await?))
}
