//! Where a tenant's changes go: the relay's own queue for the tenant (the default), or the
//! tenant's own AMQP broker, exchange and routing key. The broker URL holds credentials: it is
//! write-only, like secrets.

use std::time::Duration;

use axum::extract::State;
use axum::Json;
use relay_publisher::broker_urls;
use relay_rules::Refusal;
use relay_store::destinations::{self, Destination, StoredDestination};
use relay_store::StoreError;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use utoipa::ToSchema;

use super::enums::{self, stored};
use super::AppState;
use crate::auth::TenantId;
use crate::broker::{resolve, BrokerAccess};
use crate::error::{ApiError, ErrorBody, JsonBody};

#[derive(Debug, Serialize, ToSchema)]
pub struct DestinationView {
    pub kind: DestinationKind,
    /// True when nothing was set: the relay's queue for the tenant.
    pub default: bool,
    pub exchange: Option<String>,
    pub routing_key: Option<String>,
    /// Whether a broker URL is stored. The URL itself is never returned.
    pub amqp_url_set: bool,
    #[serde(with = "time::serde::rfc3339::option")]
    pub updated_at: Option<OffsetDateTime>,
    /// Why the publisher refuses to send to this destination (it resolved to the relay's own
    /// broker, or to an address the operator does not allow), when it does. Nothing is sent
    /// until the destination is changed or its host resolves elsewhere.
    pub refused_reason: Option<String>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub refused_at: Option<OffsetDateTime>,
}

/// `{"kind": "relay_queue"}`, or `{"kind": "own_exchange", "amqp_url": ..., "exchange": ...,
/// "routing_key": ...}`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DestinationUpdate {
    #[serde(deserialize_with = "enums::from_string")]
    pub kind: DestinationKind,
    /// `amqp://` or `amqps://`, with credentials; or a cluster's nodes, at most 7 such URLs
    /// separated by commas, which the publisher tries in turn. Write-only.
    #[serde(default)]
    pub amqp_url: Option<String>,
    #[serde(default)]
    pub exchange: Option<String>,
    #[serde(default)]
    pub routing_key: Option<String>,
}

/// Where a tenant's changes go: `relay_queue` (the relay's own queue for the tenant, the
/// default) or `own_exchange` (the tenant's own AMQP broker, exchange and routing key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DestinationKind {
    RelayQueue,
    OwnExchange,
}

/// The destination as stored, or the default; a kind the API names no value for is an internal
/// error.
fn view(row: Option<StoredDestination>) -> Result<DestinationView, ApiError> {
    Ok(match row {
        Some(StoredDestination {
            kind,
            exchange,
            routing_key,
            amqp_url_set,
            updated_at,
            refused_reason,
            refused_at,
        }) => DestinationView {
            kind: stored("destination kind", &kind)?,
            default: false,
            exchange,
            routing_key,
            amqp_url_set,
            updated_at: Some(updated_at),
            refused_reason,
            refused_at,
        },
        None => DestinationView {
            kind: DestinationKind::RelayQueue,
            default: true,
            exchange: None,
            routing_key: None,
            amqp_url_set: false,
            updated_at: None,
            refused_reason: None,
            refused_at: None,
        },
    })
}

/// An AMQP name: the broker takes up to 255 bytes of UTF-8; control characters are refused.
fn amqp_name(field: &str, value: Option<&str>, allow_empty: bool) -> Result<String, ApiError> {
    let value = value.ok_or_else(|| ApiError::invalid(field, "required for own_exchange"))?;
    if value.len() > 255 || (!allow_empty && value.is_empty()) {
        return Err(ApiError::invalid(
            field,
            if allow_empty {
                "at most 255 bytes"
            } else {
                "1 to 255 bytes"
            },
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(ApiError::invalid(field, "no control characters"));
    }
    Ok(value.to_owned())
}

/// How long resolving a destination's host may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The most nodes a tenant's own broker URL may name.
const MAX_BROKER_NODES: usize = 7;

/// The broker URL (or the URLs of a cluster's nodes, separated by commas, which the publisher
/// tries in turn), each refused (naming the field) when it points where tenants may not send:
/// at the relay's own broker whatever the operator allows, or at a host or address the
/// operator's policy does not allow. A host that does not resolve now is taken: the publisher
/// checks again at every connect.
async fn amqp_url(value: Option<&str>, broker: &BrokerAccess) -> Result<String, ApiError> {
    const FIELD: &str = "amqp_url";
    let value = value.ok_or_else(|| ApiError::invalid(FIELD, "required for own_exchange"))?;
    let nodes = broker_urls(value);
    if nodes.is_empty() || nodes.len() > MAX_BROKER_NODES {
        return Err(ApiError::invalid(
            FIELD,
            format!("one to {MAX_BROKER_NODES} URLs, separated by commas"),
        ));
    }
    for node in &nodes {
        node_url(node, broker).await?;
    }
    Ok(nodes.join(","))
}

/// One node's URL of [`amqp_url`], checked.
async fn node_url(value: &str, broker: &BrokerAccess) -> Result<(), ApiError> {
    const FIELD: &str = "amqp_url";
    let url = reqwest::Url::parse(value.trim())
        .map_err(|_| ApiError::invalid(FIELD, "not an absolute URL"))?;
    let host = match url.host_str() {
        Some(host) if matches!(url.scheme(), "amqp" | "amqps") && !host.is_empty() => {
            host.trim_matches(['[', ']']).to_ascii_lowercase()
        }
        _ => {
            return Err(ApiError::invalid(
                FIELD,
                "an amqp:// or amqps:// URL with a host",
            ))
        }
    };
    let port = url
        .port()
        .unwrap_or(if url.scheme() == "amqps" { 5671 } else { 5672 });
    let policy = &broker.destination_policy;
    let refused = |refusal: Refusal| ApiError::invalid(FIELD, refusal.to_string());
    policy.check_host(&host).map_err(refused)?;
    if let Ok(resolved) = resolve(&host, port, RESOLVE_TIMEOUT).await {
        let relay = broker.addresses(RESOLVE_TIMEOUT).await?;
        policy.check(&host, &resolved, &relay).map_err(refused)?;
    }
    Ok(())
}

#[utoipa::path(
    get, path = "/v1/destination", tag = "destination", security(("bearer" = [])),
    responses(
        (status = 200, body = DestinationView),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
    )
)]
pub async fn get_destination(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
) -> Result<Json<DestinationView>, ApiError> {
    let row = destinations::get(&state.pool, tenant).await?;
    Ok(Json(view(row)?))
}

#[utoipa::path(
    put, path = "/v1/destination", tag = "destination", security(("bearer" = [])),
    request_body = DestinationUpdate,
    responses(
        (status = 200, body = DestinationView),
        (status = 400, body = ErrorBody,
         description = "A field is not acceptable; `amqp_url` when its host resolves to the \
                        relay's own broker, is not among the hosts the operator allows, or \
                        resolves to a loopback, private or link-local address the operator \
                        does not allow"),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn put_destination(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    JsonBody(body): JsonBody<DestinationUpdate>,
) -> Result<Json<DestinationView>, ApiError> {
    let destination = match body.kind {
        DestinationKind::RelayQueue => {
            for (field, given) in [
                ("amqp_url", body.amqp_url.is_some()),
                ("exchange", body.exchange.is_some()),
                ("routing_key", body.routing_key.is_some()),
            ] {
                if given {
                    return Err(ApiError::invalid(field, "only for own_exchange"));
                }
            }
            Destination::RelayQueue
        }
        DestinationKind::OwnExchange => Destination::OwnExchange {
            amqp_url: amqp_url(body.amqp_url.as_deref(), &state.broker)
                .await?
                .into(),
            // The default exchange is named "": allowed, with the routing key a queue's name.
            exchange: amqp_name("exchange", body.exchange.as_deref(), true)?,
            routing_key: amqp_name("routing_key", body.routing_key.as_deref(), true)?,
        },
    };
    let row = match destinations::set(&state.pool, &state.sealing, tenant, &destination).await {
        Ok(row) => row,
        Err(StoreError::NotFound { .. }) => return Err(ApiError::NotFound("tenant")),
        Err(error) => return Err(error.into()),
    };
    tracing::info!(%tenant, kind = %row.kind, "destination set");
    Ok(Json(view(Some(row))?))
}

#[utoipa::path(
    delete, path = "/v1/destination", tag = "destination", security(("bearer" = [])),
    responses(
        (status = 200, body = DestinationView, description = "Back to the default: the relay's queue"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
    )
)]
pub async fn delete_destination(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
) -> Result<Json<DestinationView>, ApiError> {
    destinations::delete(&state.pool, tenant).await?;
    tracing::info!(%tenant, "destination reset to the relay's queue");
    Ok(Json(view(None)?))
}
