//! The routes, one module per resource, and what they share: the state, the OpenAPI document,
//! and parsing of path and query values with errors that name the field.

use std::collections::HashMap;
use std::sync::Arc;

use axum::routing::get;
use axum::{Json, Router};
use relay_store::quotas::QuotaDefaults;
use sqlx::PgPool;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use crate::auth::{HasVerifier, Verifier};
use crate::broker::BrokerAccess;
use crate::envelope::Envelope;
use crate::error::{check_text, ApiError};
use crate::metrics::ApiMetrics;

pub mod activity;
pub mod broker;
pub mod destinations;
pub mod endpoints;
pub mod enums;
pub mod keys;
pub mod message_detail;
pub mod quarantine;
pub mod quotas;
pub mod reads;
pub mod rewind;
pub mod stories;
pub mod stream;
pub mod tenants;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    /// Seals the secrets, keys and broker URLs tenants give; opens an upstream key for a rewind.
    pub sealing: relay_store::Keyring,
    pub verifier: Arc<Verifier>,
    /// Requests to tenants' upstreams (rewinds): every one checked against the operator's
    /// policy.
    pub http: relay_netguard::GuardedClient,
    /// Requests to the relay's own broker's management API (tenants' users).
    pub management: reqwest::Client,
    pub metrics: Arc<ApiMetrics>,
    /// The relay's own broker: destinations are checked against it; tenants' users live there.
    pub broker: Arc<BrokerAccess>,
    /// Wakes the purge that finishes a delete.
    pub purge: Arc<tokio::sync::Notify>,
    /// Each caller's share of the control plane: its requests and rewinds in flight.
    pub envelope: Arc<Envelope>,
    /// The operator's default quotas.
    pub quotas: QuotaDefaults,
}

impl HasVerifier for AppState {
    fn verifier(&self) -> &Arc<Verifier> {
        &self.verifier
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "relay control plane",
        description = "Tenants, their webhook endpoints, secrets and destination, and reads of \
                       each endpoint's copy of the feed. Every route but /openapi.json takes a \
                       bearer JWT: an operator's for /v1/tenants, a tenant's for the rest. \
                       Any route may also answer 408 `body_timeout` (the body did not arrive \
                       within RELAY_API_BODY_READ_TIMEOUT_MS; the connection is closed) and \
                       503 `too_many_connections` with Retry-After, the connection closed (the \
                       listener serves as many connections as it allows, or this client holds \
                       RELAY_API_MAX_CONNECTIONS_PER_CLIENT connections, or as many that have \
                       not sent a request head as RELAY_API_MAX_HEADLESS_PER_ADDRESS), and 503 \
                       `body_budget_spent` with Retry-After, the connection closed (the body \
                       does not fit in the process's RELAY_BODY_BYTES_IN_FLIGHT, or this \
                       client's RELAY_BODY_BYTES_PER_CLIENT; nothing of it was read or done); \
                       behind a proxy naming clients by X-Forwarded-For, 429 \
                       `too_many_requests` when this client has \
                       RELAY_API_MAX_CONNECTIONS_PER_CLIENT requests in flight. A request head \
                       that does not arrive within RELAY_API_HEADER_READ_TIMEOUT_MS, or a \
                       kept-alive connection idle for RELAY_API_IDLE_TIMEOUT_MS, has its \
                       connection closed unanswered. \
                       Any route taking a valid token may answer 429 `too_many_requests` with \
                       Retry-After, before anything is done, the connection then closed: the \
                       caller (a tenant, or the operators together) has \
                       RELAY_API_MAX_REQUESTS_PER_TENANT requests in flight already. \
                       Every answer, errors included, carries `Cache-Control: no-store`: some \
                       show a secret, a password or a token once, every read is the caller's \
                       alone, and an error may echo what was sent."
    ),
    modifiers(&BearerAuth),
    // The enums only query parameters name: the schemas of bodies are collected from the routes.
    components(schemas(
        crate::error::ErrorBody,
        reads::MessageOrder,
        activity::ActivityWindow,
        reads::MessageStatusFilter,
        quarantine::QuarantineStatusFilter
    ))
)]
struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .build(),
            ),
        );
    }
}

/// Every documented route, collected with its annotation.
fn documented() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(tenants::create_tenant, tenants::list_tenants))
        .routes(routes!(tenants::get_tenant, tenants::delete_tenant))
        .routes(routes!(tenants::mint_tenant_token))
        .routes(routes!(quotas::get_quotas, quotas::put_quotas))
        .routes(routes!(keys::keys_state))
        .routes(routes!(tenants::own_tenant))
        .routes(routes!(
            endpoints::create_endpoint,
            endpoints::list_endpoints
        ))
        .routes(routes!(
            endpoints::get_endpoint,
            endpoints::update_endpoint,
            endpoints::delete_endpoint
        ))
        .routes(routes!(endpoints::pause_endpoint))
        .routes(routes!(endpoints::resume_endpoint))
        .routes(routes!(endpoints::add_secret, endpoints::list_secrets))
        .routes(routes!(endpoints::rotate_secret))
        .routes(routes!(endpoints::expire_secret))
        .routes(routes!(
            destinations::get_destination,
            destinations::put_destination,
            destinations::delete_destination
        ))
        .routes(routes!(
            broker::get_credentials,
            broker::create_credentials,
            broker::delete_credentials
        ))
        .routes(routes!(broker::rotate_credentials))
        .routes(routes!(rewind::rewind_track))
        .routes(routes!(stream::replay))
        .routes(routes!(stream::resync))
        .routes(routes!(reads::list_copy))
        .routes(routes!(reads::get_copy_item))
        .routes(routes!(reads::endpoint_state))
        .routes(routes!(activity::endpoint_activity))
        .routes(routes!(reads::list_messages))
        .routes(routes!(message_detail::get_message))
        .routes(routes!(message_detail::get_message_by_webhook_id))
        .routes(routes!(stories::list_stories))
        .routes(routes!(stories::get_story))
        .routes(routes!(stories::list_notifications))
        .routes(routes!(quarantine::list_quarantine))
        .routes(routes!(quarantine::retry_quarantined))
        .routes(routes!(quarantine::discard_quarantined))
        .routes(routes!(quarantine::retry_many))
        .routes(routes!(quarantine::discard_many))
}

/// The OpenAPI document, as `/openapi.json` serves it.
pub fn openapi() -> utoipa::openapi::OpenApi {
    documented().split_for_parts().1
}

/// The API's routes and the OpenAPI document describing them (collected from the handlers'
/// annotations, so the document cannot drift from the code).
pub fn router(state: AppState) -> Router {
    let (router, openapi) = documented().with_state(state).split_for_parts();
    let router = router.layer(crate::retry::RetryLostReads);
    let openapi = Arc::new(openapi);
    router.merge(crate::console::router()).route(
        "/openapi.json",
        get(move || {
            let openapi = openapi.clone();
            async move { Json(openapi.as_ref().clone()) }
        }),
    )
}

/// A UUID from a path or query value.
pub fn parse_uuid(field: &str, text: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(text).map_err(|_| ApiError::invalid(field, "not a UUID"))
}

/// The endpoint a path's `endpoint_id` names.
pub fn parse_endpoint_id(text: &str) -> Result<relay_store::EndpointId, ApiError> {
    parse_uuid("endpoint_id", text).map(relay_store::EndpointId)
}

/// The tenant a path's `tenant_id` names.
pub fn parse_tenant_id(text: &str) -> Result<relay_store::TenantId, ApiError> {
    parse_uuid("tenant_id", text).map(relay_store::TenantId)
}

/// The answer for an endpoint that is not the tenant's: another tenant's endpoint and an
/// unknown one are the same 404.
pub const ENDPOINT_NOT_FOUND: ApiError = ApiError::NotFound("webhook endpoint");

/// A query string's values, read one field at a time so each error names its field. Unknown
/// parameters are refused, as unknown body fields are.
/// The longest query value any route takes (cursors are the longest), in bytes.
const MAX_QUERY_VALUE_BYTES: usize = 1000;

pub struct QueryArgs(HashMap<String, String>);

impl QueryArgs {
    pub fn new(map: HashMap<String, String>, known: &[&str]) -> Result<Self, ApiError> {
        if let Some(unknown) = map.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(ApiError::invalid(
                unknown.clone(),
                format!("unknown query parameter; known: {}", known.join(", ")),
            ));
        }
        for (name, value) in &map {
            check_text(name, value, MAX_QUERY_VALUE_BYTES)?;
        }
        Ok(Self(map))
    }

    pub fn text(&self, field: &str) -> Option<&str> {
        self.0
            .get(field)
            .map(String::as_str)
            .filter(|t| !t.is_empty())
    }

    pub fn parsed<T: std::str::FromStr>(
        &self,
        field: &str,
        what: &str,
    ) -> Result<Option<T>, ApiError> {
        self.text(field)
            .map(|t| {
                t.parse::<T>()
                    .map_err(|_| ApiError::invalid(field, format!("not {what}")))
            })
            .transpose()
    }

    /// One of an enum's values, as its JSON spells it; `expected` (the values) is the detail
    /// of the error naming `field` when it is none of them.
    pub fn one_of<T: serde::de::DeserializeOwned>(
        &self,
        field: &str,
        expected: &str,
    ) -> Result<Option<T>, ApiError> {
        self.text(field)
            .map(|t| enums::parse_spelt(t).ok_or_else(|| ApiError::invalid(field, expected)))
            .transpose()
    }

    /// `limit`: 1 to `max`, `default` when absent.
    pub fn limit(&self, default: i64, max: i64) -> Result<i64, ApiError> {
        let limit = self
            .parsed::<i64>("limit", "a whole number")?
            .unwrap_or(default);
        if !(1..=max).contains(&limit) {
            return Err(ApiError::invalid("limit", format!("between 1 and {max}")));
        }
        Ok(limit)
    }

    pub fn flag(&self, field: &str) -> Result<bool, ApiError> {
        match self.text(field) {
            None | Some("false") => Ok(false),
            Some("true") => Ok(true),
            Some(_) => Err(ApiError::invalid(field, "true or false")),
        }
    }
}

/// The cursor of the page after `rows`: the key of its last row, when the page is full (`limit`
/// rows; a shorter one is the last).
pub fn next_cursor<T>(rows: &[T], limit: i64, key: impl FnOnce(&T) -> String) -> Option<String> {
    (rows.len() as i64 == limit)
        .then(|| rows.last().map(key))
        .flatten()
}

/// Checks the endpoint is the tenant's ([`ENDPOINT_NOT_FOUND`] when not).
pub async fn owned_endpoint(
    pool: &PgPool,
    tenant: relay_store::TenantId,
    endpoint: relay_store::EndpointId,
) -> Result<(), ApiError> {
    if relay_store::endpoints::owned(pool, tenant, endpoint).await? {
        Ok(())
    } else {
        Err(ENDPOINT_NOT_FOUND)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    #[test]
    fn every_operation_is_documented_with_its_auth_and_errors() {
        let doc = serde_json::to_value(super::openapi()).unwrap();
        let paths = doc["paths"].as_object().unwrap();
        assert!(paths.len() >= 15, "{:?}", paths.keys());
        for (path, item) in paths {
            assert!(path.starts_with("/v1/"), "{path}");
            for (method, operation) in item.as_object().unwrap() {
                assert_eq!(
                    operation["security"],
                    serde_json::json!([{"bearer": []}]),
                    "{method} {path}"
                );
                let responses = operation["responses"].as_object().unwrap();
                assert!(responses.contains_key("401"), "{method} {path}");
                assert!(responses.contains_key("403"), "{method} {path}");
                assert!(
                    responses.keys().any(|code| code.starts_with('2')),
                    "{method} {path}"
                );
            }
        }
        // Any route may answer 429: said once for all, and on the rewind, which has a bound
        // of its own.
        let description = doc["info"]["description"].as_str().unwrap();
        assert!(
            description.contains("429 `too_many_requests`"),
            "{description}"
        );
        assert!(
            description.contains("`Cache-Control: no-store`"),
            "{description}"
        );
        let rewind = &paths["/v1/endpoints/{endpoint_id}/tracks/{track}/rewind"]["post"];
        assert_ne!(rewind["responses"]["429"], Value::Null);
        let schemes = &doc["components"]["securitySchemes"]["bearer"];
        assert_eq!(schemes["scheme"], "bearer");
        // Every reference names a schema the document holds.
        fn refs<'v>(value: &'v Value, found: &mut Vec<&'v str>) {
            match value {
                Value::Object(fields) => {
                    if let Some(Value::String(target)) = fields.get("$ref") {
                        found.push(target);
                    }
                    fields.values().for_each(|v| refs(v, found));
                }
                Value::Array(items) => items.iter().for_each(|v| refs(v, found)),
                _ => {}
            }
        }
        let mut found = Vec::new();
        refs(&doc, &mut found);
        assert!(!found.is_empty());
        for target in found {
            let name = target.strip_prefix("#/components/schemas/").unwrap();
            assert_ne!(doc["components"]["schemas"][name], Value::Null, "{target}");
        }
        for schema in [
            "ErrorBody",
            "EndpointView",
            "CopyPage",
            "StateView",
            "RewindView",
            "TenantQuotasView",
            "OwnTenantView",
        ] {
            assert_ne!(
                doc["components"]["schemas"][schema],
                Value::Null,
                "{schema}"
            );
        }
    }
}
