//! A tenant's own credentials on the relay's broker: a RabbitMQ user that may consume the
//! tenant's queue (`relay.tenant.<tenant_id>`) and nothing else there (see [`crate::broker`]
//! for its permissions). Made and rotated through the broker's management API; the password is
//! in the answer of the call that made it and nowhere else.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use relay_publisher::tenant_queue;
use relay_store::broker_users::{self, BrokerUser};
use serde::Serialize;
use time::OffsetDateTime;
use utoipa::ToSchema;

use super::AppState;
use crate::auth::TenantId;
use crate::broker::BrokerAccess;
use crate::error::{ApiError, ErrorBody};

/// How to connect to the relay's broker and consume the tenant's queue.
#[derive(Debug, Serialize, ToSchema)]
pub struct BrokerCredentialsView {
    pub username: String,
    pub host: String,
    pub port: u16,
    pub vhost: String,
    /// The one queue these credentials may consume (and nothing else: no declare but a
    /// passive one, no bind, no publish).
    pub queue: String,
    /// Where the broker moves a message of `queue` that was delivered more times than the
    /// relay's delivery limit (a consumer that keeps returning it); readable with these
    /// credentials too.
    pub dead_letter_queue: String,
    /// `amqp://<username>@<host>:<port>/<vhost>`: the password goes after the username.
    pub amqp_url: String,
    /// Only in the answer of the call that made or rotated the credentials: it is not kept.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When the password was last set (made or rotated).
    #[serde(with = "time::serde::rfc3339")]
    pub rotated_at: OffsetDateTime,
}

/// A URL path segment, percent-encoded (a vhost may be `/`).
fn segment(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02x}"),
        })
        .collect()
}

fn view(
    broker: &BrokerAccess,
    tenant: relay_store::TenantId,
    user: BrokerUser,
    password: Option<String>,
) -> BrokerCredentialsView {
    let (host, port) = broker.address_for_tenants();
    let url_host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.clone()
    };
    BrokerCredentialsView {
        amqp_url: format!(
            "amqp://{}@{url_host}:{port}/{}",
            segment(&user.username),
            segment(&broker.vhost)
        ),
        username: user.username,
        host,
        port,
        vhost: broker.vhost.clone(),
        queue: tenant_queue(tenant.0),
        dead_letter_queue: crate::broker::dead_letter_queue(tenant),
        password,
        created_at: user.created_at,
        rotated_at: user.rotated_at,
    }
}

/// The tenant's broker user, or 404 when none was made.
async fn issued(state: &AppState, tenant: relay_store::TenantId) -> Result<BrokerUser, ApiError> {
    broker_users::get(&state.pool, tenant)
        .await?
        .ok_or(ApiError::NotFound("broker credentials"))
}

/// Gives the tenant's broker user `username` a new password and records it; the credentials
/// with the password, logged as `done`.
async fn issue(
    state: &AppState,
    tenant: relay_store::TenantId,
    username: &str,
    done: &str,
) -> Result<BrokerCredentialsView, ApiError> {
    let password = state.broker.issue(&state.management, tenant).await?;
    let user = broker_users::record(&state.pool, tenant, username)
        .await?
        .ok_or(ApiError::NotFound("tenant"))?;
    tracing::info!(%tenant, username = %user.username, "{done}");
    Ok(view(&state.broker, tenant, user, Some(password)))
}

#[utoipa::path(
    get, path = "/v1/broker/credentials", tag = "broker", security(("bearer" = [])),
    responses(
        (status = 200, body = BrokerCredentialsView, description = "How to connect (no password)"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "None made yet"),
    )
)]
pub async fn get_credentials(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
) -> Result<Json<BrokerCredentialsView>, ApiError> {
    let user = issued(&state, tenant).await?;
    Ok(Json(view(&state.broker, tenant, user, None)))
}

#[utoipa::path(
    post, path = "/v1/broker/credentials", tag = "broker", security(("bearer" = [])),
    responses(
        (status = 201, body = BrokerCredentialsView,
         description = "Made; the password is in this answer only"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "No such tenant"),
        (status = 409, body = ErrorBody, description = "Made already: rotate them instead"),
        (status = 503, body = ErrorBody, description = "The broker's management API failed"),
    )
)]
pub async fn create_credentials(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
) -> Result<(StatusCode, Json<BrokerCredentialsView>), ApiError> {
    if relay_store::tenants::get(&state.pool, tenant)
        .await?
        .is_none()
    {
        return Err(ApiError::NotFound("tenant"));
    }
    if broker_users::get(&state.pool, tenant).await?.is_some() {
        return Err(ApiError::conflict(
            None,
            "the tenant has broker credentials; rotate them for a new password",
        ));
    }
    let username = BrokerAccess::username(tenant);
    let made = issue(&state, tenant, &username, "broker credentials made").await?;
    Ok((StatusCode::CREATED, Json(made)))
}

#[utoipa::path(
    post, path = "/v1/broker/credentials/rotate", tag = "broker", security(("bearer" = [])),
    responses(
        (status = 200, body = BrokerCredentialsView,
         description = "A new password, in this answer only; the old one no longer works and \
                        connections made with it are closed"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "None made yet"),
        (status = 503, body = ErrorBody, description = "The broker's management API failed"),
    )
)]
pub async fn rotate_credentials(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
) -> Result<Json<BrokerCredentialsView>, ApiError> {
    let user = issued(&state, tenant).await?;
    let rotated = issue(&state, tenant, &user.username, "broker credentials rotated").await?;
    Ok(Json(rotated))
}

#[utoipa::path(
    delete, path = "/v1/broker/credentials", tag = "broker", security(("bearer" = [])),
    responses(
        (status = 204, description = "The user is deleted on the broker; its connections closed"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "None made"),
        (status = 503, body = ErrorBody, description = "The broker's management API failed"),
    )
)]
pub async fn delete_credentials(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
) -> Result<StatusCode, ApiError> {
    issued(&state, tenant).await?;
    state.broker.revoke(&state.management, tenant).await?;
    broker_users::delete(&state.pool, tenant).await?;
    tracing::info!(%tenant, "broker credentials deleted");
    Ok(StatusCode::NO_CONTENT)
}
