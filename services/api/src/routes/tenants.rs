//! Tenants: created and listed by operators, who also mint a tenant's tokens; a tenant reads its
//! own row, with its quotas in force and its usage (operators set quotas: `quotas`).

use std::collections::HashMap;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use relay_store::{tenants, StoreError};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use utoipa::ToSchema;
use uuid::Uuid;

use super::{next_cursor, parse_tenant_id, parse_uuid, AppState, QueryArgs};
use crate::auth::{self, IssuedToken, Operator, Subject, TenantId};
use crate::error::{ApiError, ErrorBody, JsonBody};

#[derive(Debug, Serialize, ToSchema)]
pub struct TenantView {
    pub id: Uuid,
    pub name: String,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
}

impl From<tenants::Tenant> for TenantView {
    fn from(tenant: tenants::Tenant) -> Self {
        Self {
            id: tenant.id,
            name: tenant.name,
            created_at: tenant.created_at,
        }
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewTenant {
    /// 1 to 200 characters.
    pub name: String,
    /// Chosen by the caller (to make creation safe to retry); a random one when absent.
    #[serde(default)]
    pub id: Option<Uuid>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TenantPage {
    pub data: Vec<TenantView>,
    /// Pass as `after` for the next page; absent on the last.
    pub next_cursor: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewToken {
    /// Seconds the token lives: 1 to 31622400 (366 days). Default 86400.
    #[serde(default)]
    pub ttl_s: Option<u64>,
}

#[utoipa::path(
    post, path = "/v1/tenants", tag = "tenants", security(("bearer" = [])),
    request_body = NewTenant,
    responses(
        (status = 201, body = TenantView),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 409, body = ErrorBody),
    )
)]
pub async fn create_tenant(
    State(state): State<AppState>,
    operator: Operator,
    JsonBody(body): JsonBody<NewTenant>,
) -> Result<(StatusCode, Json<TenantView>), ApiError> {
    let name = body.name.trim();
    if name.is_empty() || name.chars().count() > 200 {
        return Err(ApiError::invalid("name", "1 to 200 characters"));
    }
    let id = body.id.unwrap_or_else(Uuid::new_v4);
    let tenant = tenants::create(&state.pool, id, name)
        .await
        .map_err(|error| match error {
            StoreError::AlreadyExists { .. } => {
                ApiError::conflict(Some("id"), "a tenant with this id exists")
            }
            other => other.into(),
        })?;
    tracing::info!(tenant = %tenant.id, by = %operator.subject, "tenant created");
    Ok((StatusCode::CREATED, Json(tenant.into())))
}

#[utoipa::path(
    get, path = "/v1/tenants", tag = "tenants", security(("bearer" = [])),
    params(
        ("after" = Option<Uuid>, Query, description = "The last id of the previous page"),
        ("limit" = Option<i64>, Query, description = "1 to 500, default 100"),
    ),
    responses(
        (status = 200, body = TenantPage),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
    )
)]
pub async fn list_tenants(
    State(state): State<AppState>,
    _operator: Operator,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<TenantPage>, ApiError> {
    let query = QueryArgs::new(query, &["after", "limit"])?;
    let after = query
        .text("after")
        .map(|t| parse_uuid("after", t).map(relay_store::TenantId))
        .transpose()?;
    let limit = query.limit(100, 500)?;
    let data: Vec<TenantView> = tenants::list(&state.pool, after, limit)
        .await?
        .into_iter()
        .map(TenantView::from)
        .collect();
    let next_cursor = next_cursor(&data, limit, |t| t.id.to_string());
    Ok(Json(TenantPage { data, next_cursor }))
}

async fn load_tenant(state: &AppState, id: relay_store::TenantId) -> Result<TenantView, ApiError> {
    tenants::get(&state.pool, id)
        .await?
        .map(TenantView::from)
        .ok_or(ApiError::NotFound("tenant"))
}

#[utoipa::path(
    get, path = "/v1/tenants/{tenant_id}", tag = "tenants", security(("bearer" = [])),
    params(("tenant_id" = Uuid, Path)),
    responses(
        (status = 200, body = TenantView),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn get_tenant(
    State(state): State<AppState>,
    _operator: Operator,
    Path(tenant_id): Path<String>,
) -> Result<Json<TenantView>, ApiError> {
    let id = parse_tenant_id(&tenant_id)?;
    Ok(Json(load_tenant(&state, id).await?))
}

#[utoipa::path(
    delete, path = "/v1/tenants/{tenant_id}", tag = "tenants", security(("bearer" = [])),
    params(("tenant_id" = Uuid, Path)),
    responses(
        (status = 202, body = super::endpoints::DeletionView, description = "Deleting: every \
            endpoint of the tenant as `DELETE /v1/endpoints/{id}` deletes one, then its queues \
            and broker user on the relay's broker, its destination, and the tenant itself \
            (its tokens then find nothing). Asked again while it is being deleted, the same \
            answer"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "No such tenant (or deleted already)"),
    )
)]
pub async fn delete_tenant(
    State(state): State<AppState>,
    operator: Operator,
    Path(tenant_id): Path<String>,
) -> Result<(StatusCode, Json<super::endpoints::DeletionView>), ApiError> {
    let id = parse_tenant_id(&tenant_id)?;
    let marked = relay_store::offboard::mark_tenant(&state.pool, id)
        .await?
        .ok_or(ApiError::NotFound("tenant"))?;
    tracing::info!(tenant = %id, by = %operator.subject, ?marked, "tenant deleting");
    state.purge.notify_one();
    Ok((
        StatusCode::ACCEPTED,
        Json(super::endpoints::DeletionView {
            id: id.0,
            status: super::endpoints::DeletionStatus::Deleting,
        }),
    ))
}

#[utoipa::path(
    post, path = "/v1/tenants/{tenant_id}/tokens", tag = "tenants", security(("bearer" = [])),
    params(("tenant_id" = Uuid, Path)),
    request_body = NewToken,
    responses(
        (status = 201, body = IssuedToken, description = "A token for the tenant: shown once"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn mint_tenant_token(
    State(state): State<AppState>,
    operator: Operator,
    Path(tenant_id): Path<String>,
    JsonBody(body): JsonBody<NewToken>,
) -> Result<(StatusCode, Json<IssuedToken>), ApiError> {
    let id = parse_tenant_id(&tenant_id)?;
    let ttl = Duration::from_secs(body.ttl_s.unwrap_or(86_400));
    if ttl.is_zero() || ttl > auth::MAX_TTL {
        return Err(ApiError::invalid(
            "ttl_s",
            format!("1 to {} seconds", auth::MAX_TTL.as_secs()),
        ));
    }
    load_tenant(&state, id).await?;
    let issued = auth::mint(
        state.verifier.keys(),
        state.verifier.audience(),
        &Subject::Tenant(id.0),
        ttl,
        OffsetDateTime::now_utc(),
    )
    .map_err(|e| ApiError::Internal(e.to_string()))?;
    tracing::info!(tenant = %id, by = %operator.subject, ttl_s = ttl.as_secs(), "tenant token minted");
    Ok((StatusCode::CREATED, Json(issued)))
}

/// A tenant's limits in force.
#[derive(Debug, Serialize, ToSchema)]
pub struct OwnQuotasView {
    /// Endpoints registered at once (those being deleted do not count); one more is refused
    /// 409.
    pub max_endpoints: u32,
    /// Messages per second the front tier takes for the tenant's endpoints together.
    pub max_messages_per_second: u32,
    /// Events in one webhook message: the wire format's `max_events`, the same for every
    /// tenant (not a quota an operator sets).
    pub max_events_per_message: u32,
}

/// The caller's own tenant, its quotas in force and what it uses of them.
#[derive(Debug, Serialize, ToSchema)]
pub struct OwnTenantView {
    pub id: Uuid,
    pub name: String,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    pub quotas: OwnQuotasView,
    pub usage: super::quotas::UsageView,
}

#[utoipa::path(
    get, path = "/v1/tenant", tag = "tenants", security(("bearer" = [])),
    responses(
        (status = 200, body = OwnTenantView, description = "The caller's own tenant, its \
            quotas in force and its usage"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn own_tenant(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
) -> Result<Json<OwnTenantView>, ApiError> {
    let view = load_tenant(&state, tenant).await?;
    let quotas = relay_store::quotas::effective(&state.pool, tenant, &state.quotas).await?;
    Ok(Json(OwnTenantView {
        id: view.id,
        name: view.name,
        created_at: view.created_at,
        quotas: OwnQuotasView {
            max_endpoints: quotas.max_endpoints,
            max_messages_per_second: quotas.messages_per_second,
            max_events_per_message: relay_wire::limits::MAX_EVENTS as u32,
        },
        usage: super::quotas::usage(&state, tenant).await?,
    }))
}
