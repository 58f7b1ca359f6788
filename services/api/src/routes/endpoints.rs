//! A tenant's webhook endpoints: registration, the upstream settings, pause and resume, and the
//! signing secrets (add, rotate with an overlap, expire).
//!
//! Secrets and the upstream API key are write-only: no answer carries them (an endpoint says only
//! whether a key is set, and a secret is known by its id, age and expiry), no log line names
//! them, and no request type derives `Debug`, so none can be printed by accident.

use std::collections::HashMap;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use relay_store::endpoints as store;
use relay_store::{EndpointId, SecretText, StoreError};
use relay_wire::limits::{ROTATION_OVERLAP_MAX_S, ROTATION_OVERLAP_S};
use relay_wire::SigningSecret;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use time::OffsetDateTime;
use utoipa::ToSchema;
use uuid::Uuid;

use relay_netguard::{GuardedClient, GuardedResolver, ResolveError};

use super::enums::{self, stored, EndpointSource, EndpointStatus};
use super::{
    next_cursor, owned_endpoint, parse_endpoint_id, parse_uuid, AppState, QueryArgs,
    ENDPOINT_NOT_FOUND,
};
use crate::auth::TenantId;
use crate::error::{check_text, ApiError, ErrorBody, JsonBody};

/// The most secrets one request registers.
const MAX_SECRETS: usize = 10;
/// The longest expiry an added secret may be given (ten years): bounds the interval arithmetic.
const MAX_EXPIRY_S: u64 = 10 * 365 * 86_400;

/// How a stories endpoint gets the snapshots it saves: `snapshot` (the default: apply the
/// snapshot each event carries; no API calls) or `fetch_on_notify` (read each story an event
/// names from the upstream's API, and save what it answers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StoriesMode {
    Snapshot,
    FetchOnNotify,
}

impl From<StoriesMode> for relay_rules::StoriesMode {
    fn from(mode: StoriesMode) -> Self {
        match mode {
            StoriesMode::Snapshot => relay_rules::StoriesMode::Snapshot,
            StoriesMode::FetchOnNotify => relay_rules::StoriesMode::FetchOnNotify,
        }
    }
}

impl From<relay_rules::StoriesMode> for StoriesMode {
    fn from(mode: relay_rules::StoriesMode) -> Self {
        match mode {
            relay_rules::StoriesMode::Snapshot => StoriesMode::Snapshot,
            relay_rules::StoriesMode::FetchOnNotify => StoriesMode::FetchOnNotify,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EndpointView {
    /// The upstream's webhook_endpoint_id.
    pub id: Uuid,
    /// What its tenant calls it; null when unnamed.
    pub name: Option<String>,
    pub source: EndpointSource,
    /// The language the endpoint reads the feed in (feed endpoints).
    pub lang: Option<String>,
    /// How a stories endpoint applies its events (stories endpoints).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stories_mode: Option<StoriesMode>,
    /// A stories endpoint's tickers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tickers: Option<Vec<String>>,
    pub status: EndpointStatus,
    pub upstream_base_url: Option<String>,
    /// Whether an upstream API key is stored. The key itself is never returned.
    pub upstream_api_key_set: bool,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
    /// The signing secrets, by id (never their value). Absent in lists.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secrets: Option<Vec<SecretView>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SecretView {
    pub id: i64,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When it stops verifying; absent for a secret that does not expire.
    #[serde(with = "time::serde::rfc3339::option")]
    pub expires_at: Option<OffsetDateTime>,
    /// Verifies now.
    pub active: bool,
}

impl TryFrom<store::EndpointInfo> for EndpointView {
    type Error = ApiError;

    /// The stored row; a source, mode or status the API names no value for is an internal error.
    fn try_from(endpoint: store::EndpointInfo) -> Result<Self, ApiError> {
        Ok(Self {
            id: endpoint.id.0,
            name: endpoint.name,
            source: stored("endpoint source", &endpoint.source)?,
            lang: endpoint.lang,
            stories_mode: endpoint
                .stories_mode
                .as_deref()
                .map(|mode| stored("stories mode", mode))
                .transpose()?,
            tickers: endpoint.tickers,
            status: stored("endpoint status", &endpoint.status)?,
            upstream_base_url: endpoint.upstream_base_url,
            upstream_api_key_set: endpoint.upstream_api_key_set,
            created_at: endpoint.created_at,
            updated_at: endpoint.updated_at,
            secrets: None,
        })
    }
}

impl From<store::SecretInfo> for SecretView {
    fn from(secret: store::SecretInfo) -> Self {
        Self {
            id: secret.id,
            created_at: secret.created_at,
            expires_at: secret.expires_at,
            active: secret.active,
        }
    }
}

/// Registers an endpoint.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewEndpoint {
    /// The upstream's webhook_endpoint_id (the path the upstream posts to).
    pub id: Uuid,
    /// What the tenant calls it (1 to 200 characters): the upstream knows it by its id only.
    #[serde(default)]
    pub name: Option<String>,
    /// `feed` when absent. Fixed once registered.
    #[serde(default, deserialize_with = "enums::from_optional_string")]
    pub source: Option<EndpointSource>,
    /// Feed endpoints (required there, refused for stories): the endpoint's language, as set
    /// at the upstream (`en`, `sv`, ...).
    #[serde(default)]
    pub lang: Option<String>,
    /// Stories endpoints (required there, refused for the feed): the tickers whose stories the
    /// copy holds, 1 to 100. Each is loaded once when registered (`GET /v1/stories?ticker=`).
    #[serde(default)]
    pub tickers: Option<Vec<String>>,
    /// Stories endpoints: `snapshot` when absent.
    #[serde(default, deserialize_with = "enums::from_optional_string")]
    pub stories_mode: Option<StoriesMode>,
    /// The upstream API's base URL, for reloads, refetches and rewinds: https, to a public
    /// address (http and non-public addresses only where the operator allows them). Without it
    /// and `upstream_api_key` the endpoint is registered and its messages are stored and
    /// applied, but nothing can read the upstream: the reload the first message asks for waits
    /// (the state's `upstream.status` says `needs_settings`) and starts as soon as a PATCH
    /// gives both.
    #[serde(default)]
    pub upstream_base_url: Option<String>,
    /// The API key for the upstream's API. Write-only.
    #[serde(default)]
    pub upstream_api_key: Option<String>,
    /// The signing secrets (`whsec_...`), as the upstream shows them: one, or two during a
    /// rotation. Write-only.
    pub secrets: Vec<String>,
}

/// Changes an endpoint's settings; absent fields keep their value. A change reaches the
/// sequencer's worker for the endpoint at once: a reload failing with the old URL or key reads
/// again with the new ones without waiting out its pause.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EndpointUpdate {
    /// 1 to 200 characters; an empty string takes the name away.
    #[serde(default)]
    pub name: Option<String>,
    /// Feed endpoints only.
    #[serde(default)]
    pub lang: Option<String>,
    #[serde(default)]
    pub upstream_base_url: Option<String>,
    /// Write-only.
    #[serde(default)]
    pub upstream_api_key: Option<String>,
    /// Stories endpoints only: the whole new list. An added ticker's stories are loaded once;
    /// a removed ticker's open stories are taken out of the copy (each a `dropped` change).
    #[serde(default)]
    pub tickers: Option<Vec<String>>,
    /// Stories endpoints only.
    #[serde(default, deserialize_with = "enums::from_optional_string")]
    pub stories_mode: Option<StoriesMode>,
}

/// The most tickers one stories endpoint holds.
const MAX_TICKERS: usize = 100;
/// The longest ticker taken (the upstream's are a few characters: `ALFA B`).
const MAX_TICKER_LEN: usize = 32;

/// A stories endpoint's tickers: 1 to [`MAX_TICKERS`], each 1 to [`MAX_TICKER_LEN`] bytes of
/// printable text with no leading or trailing space, none twice.
fn valid_tickers(field: &str, tickers: &[String]) -> Result<Vec<String>, ApiError> {
    if tickers.is_empty() || tickers.len() > MAX_TICKERS {
        return Err(ApiError::invalid(
            field,
            format!("1 to {MAX_TICKERS} tickers"),
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for (i, ticker) in tickers.iter().enumerate() {
        let printable = ticker.chars().all(|c| !c.is_control());
        if ticker.is_empty()
            || ticker.len() > MAX_TICKER_LEN
            || !printable
            || ticker.trim() != ticker
        {
            return Err(ApiError::invalid(
                format!("{field}[{i}]"),
                format!("a ticker of 1 to {MAX_TICKER_LEN} printable bytes, not padded"),
            ));
        }
        if !seen.insert(ticker.as_str()) {
            return Err(ApiError::invalid(
                format!("{field}[{i}]"),
                "a ticker named twice",
            ));
        }
    }
    Ok(tickers.to_vec())
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewSecret {
    /// `whsec_...`. Write-only.
    pub secret: String,
    /// Seconds until it stops verifying; never, when absent.
    #[serde(default)]
    pub expires_in_s: Option<u64>,
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretRotation {
    /// The new secret, `whsec_...`. Write-only.
    pub secret: String,
    /// How long the secrets held before keep verifying: at most 604800 (the upstream's
    /// longest overlap), default 86400.
    #[serde(default)]
    pub overlap_s: Option<u64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RotationView {
    pub secret: SecretView,
    /// When the secrets held before stop verifying.
    #[serde(with = "time::serde::rfc3339")]
    pub old_secrets_expire_at: OffsetDateTime,
    /// How many were given that expiry (one due to expire sooner keeps its own).
    pub old_secrets: u64,
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretExpiry {
    /// Seconds from now until it stops verifying: 0 (default) to 604800. A secret due to
    /// expire sooner keeps its expiry.
    #[serde(default)]
    pub after_s: Option<u64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EndpointPage {
    pub data: Vec<EndpointView>,
    /// Pass as `after` for the next page; absent on the last.
    pub next_cursor: Option<String>,
}

// ---- validation ------------------------------------------------------------------------------

/// An endpoint's name: 1 to 200 characters, no control characters, spaces at its ends dropped.
pub fn valid_name(field: &str, text: &str) -> Result<String, ApiError> {
    let name = text.trim();
    if name.is_empty() || name.chars().count() > 200 {
        return Err(ApiError::invalid(field, "1 to 200 characters"));
    }
    check_text(field, name, 800)?;
    Ok(name.to_owned())
}

/// A language tag as the upstream takes it: `en`, `sv`, `pt-BR`.
pub fn valid_lang(field: &str, text: &str) -> Result<String, ApiError> {
    let mut pieces = text.split('-');
    let primary = pieces.next().unwrap_or_default();
    let primary_ok =
        (2..=3).contains(&primary.len()) && primary.bytes().all(|b| b.is_ascii_lowercase());
    let rest_ok =
        pieces.all(|p| (1..=8).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_alphanumeric()));
    if !(primary_ok && rest_ok) {
        return Err(ApiError::invalid(
            field,
            "a language tag such as `en` or `sv`",
        ));
    }
    Ok(text.to_owned())
}

/// How long registering waits for a name's addresses before taking it unresolved.
const REGISTRATION_LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// A base URL the relay may send requests to: https (http only where the operator allows it),
/// a host that is no loopback, private, link-local or other non-public address in any spelling,
/// and nothing after the path. Credentials in the URL are refused: they belong in the API key,
/// which is never returned, while the URL is.
///
/// A name is resolved here too, so one that points at a refused address is told at once; a
/// name that does not resolve now (or within a moment) is taken: DNS may not be set up yet.
/// Every request resolves it again and checks again ([`relay_netguard::GuardedResolver`]):
/// this answer is no promise.
pub async fn valid_base_url(http: &GuardedClient, text: &str) -> Result<String, ApiError> {
    const FIELD: &str = "upstream_base_url";
    if text.len() > 2000 {
        return Err(ApiError::invalid(FIELD, "at most 2000 characters"));
    }
    let policy = http.policy();
    let url = policy
        .check_url(text)
        .map_err(|refusal| ApiError::invalid(FIELD, refusal.to_string()))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err(ApiError::invalid(
            FIELD,
            "no credentials in the URL: give the key as upstream_api_key",
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(ApiError::invalid(FIELD, "no query or fragment"));
    }
    if let (Some(name), false) = (url.domain(), policy.allow_private) {
        let resolver = GuardedResolver::new(policy.clone());
        let lookup = resolver.resolve_host(name);
        if let Ok(Err(ResolveError::Refused(refusal))) =
            tokio::time::timeout(REGISTRATION_LOOKUP_TIMEOUT, lookup).await
        {
            return Err(ApiError::invalid(FIELD, refusal.to_string()));
        }
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

/// An API key that can go in an `Authorization: Bearer` header.
fn valid_api_key(text: &str) -> Result<SecretText, ApiError> {
    const FIELD: &str = "upstream_api_key";
    if text.is_empty() || text.len() > 1000 {
        return Err(ApiError::invalid(FIELD, "1 to 1000 characters"));
    }
    if !text.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ApiError::invalid(
            FIELD,
            "printable ASCII without spaces (it is sent as a bearer token)",
        ));
    }
    Ok(SecretText::new(text))
}

/// The longest secret taken, in characters: the upstream's are 24 to 64 bytes of key, and
/// HMAC-SHA256 hashes a key over 64 bytes down to 32 anyway.
const MAX_SECRET_CHARS: usize = 200;

/// The secret, parsed. The error names the field, never the value.
fn valid_secret(field: &str, text: &str) -> Result<SigningSecret, ApiError> {
    if text.len() > MAX_SECRET_CHARS {
        return Err(ApiError::invalid(
            field,
            format!("at most {MAX_SECRET_CHARS} characters"),
        ));
    }
    SigningSecret::parse(text).map_err(|e| ApiError::invalid(field, e.to_string()))
}

fn seconds(field: &str, value: Option<u64>, default: u64, max: u64) -> Result<f64, ApiError> {
    let value = value.unwrap_or(default);
    if value > max {
        return Err(ApiError::invalid(field, format!("at most {max} seconds")));
    }
    Ok(value as f64)
}

// ---- reads shared by the handlers -------------------------------------------------------------

/// The endpoint with its secrets' metadata, or 404 when it is not the tenant's.
pub async fn load_endpoint(
    pool: &PgPool,
    tenant: relay_store::TenantId,
    id: EndpointId,
) -> Result<EndpointView, ApiError> {
    let mut view = EndpointView::try_from(
        store::find(pool, tenant, id)
            .await?
            .ok_or(ENDPOINT_NOT_FOUND)?,
    )?;
    view.secrets = Some(secrets_of(pool, tenant, id).await?);
    Ok(view)
}

async fn secrets_of(
    pool: &PgPool,
    tenant: relay_store::TenantId,
    id: EndpointId,
) -> Result<Vec<SecretView>, ApiError> {
    let secrets = store::secrets(pool, tenant, id).await?;
    Ok(secrets.into_iter().map(SecretView::from).collect())
}

// ---- handlers ---------------------------------------------------------------------------------

#[utoipa::path(
    post, path = "/v1/endpoints", tag = "endpoints", security(("bearer" = [])),
    request_body = NewEndpoint,
    responses(
        (status = 201, body = EndpointView),
        (status = 400, body = ErrorBody, description = "A field is not acceptable: nothing \
            created. Among them: an upstream_base_url that is not https, or that names (or \
            resolves to) a loopback, private, link-local or other non-public address, unless the \
            operator allows it; text with control characters (NUL, line breaks, ESC) or over its \
            length; a secret over 200 characters"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The id is registered already (field \
            `id`), or the tenant has as many endpoints as its `max_endpoints` quota allows (no \
            field; the detail names the quota and its value): nothing created"),
    )
)]
pub async fn create_endpoint(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    JsonBody(body): JsonBody<NewEndpoint>,
) -> Result<(StatusCode, Json<EndpointView>), ApiError> {
    let (source, lang) = match body.source.unwrap_or(EndpointSource::Feed) {
        EndpointSource::Feed => {
            if body.tickers.is_some() || body.stories_mode.is_some() {
                let field = if body.tickers.is_some() {
                    "tickers"
                } else {
                    "stories_mode"
                };
                return Err(ApiError::invalid(field, "belongs to stories endpoints"));
            }
            let lang = body
                .lang
                .as_deref()
                .ok_or_else(|| ApiError::invalid("lang", "required for a feed endpoint"))?;
            (store::Source::Feed, Some(valid_lang("lang", lang)?))
        }
        EndpointSource::Stories => {
            if body.lang.is_some() {
                return Err(ApiError::invalid("lang", "belongs to feed endpoints"));
            }
            let tickers = body
                .tickers
                .as_deref()
                .ok_or_else(|| ApiError::invalid("tickers", "required for a stories endpoint"))?;
            let settings = store::StoriesSettings {
                mode: body.stories_mode.map(Into::into).unwrap_or_default(),
                tickers: valid_tickers("tickers", tickers)?,
            };
            (store::Source::Stories(settings), None)
        }
    };
    let base_url = match body.upstream_base_url.as_deref() {
        Some(text) => Some(valid_base_url(&state.http, text).await?),
        None => None,
    };
    let api_key = body
        .upstream_api_key
        .as_deref()
        .map(valid_api_key)
        .transpose()?;
    if body.secrets.is_empty() || body.secrets.len() > MAX_SECRETS {
        return Err(ApiError::invalid(
            "secrets",
            format!("1 to {MAX_SECRETS} secrets"),
        ));
    }
    let secrets = body
        .secrets
        .iter()
        .enumerate()
        .map(|(i, s)| valid_secret(&format!("secrets[{i}]"), s))
        .collect::<Result<Vec<_>, _>>()?;

    let name = body
        .name
        .as_deref()
        .map(|n| valid_name("name", n))
        .transpose()?;
    let id = EndpointId(body.id);
    let registration = store::Registration {
        id,
        name,
        source,
        lang,
        upstream_base_url: base_url,
        upstream_api_key: api_key,
        secrets,
    };
    store::register_within_quota(
        &state.pool,
        &state.sealing,
        tenant,
        &registration,
        &state.quotas,
    )
    .await
    .map_err(|error| match error {
        StoreError::OverQuota { quota, limit } => {
            state
                .metrics
                .quota_refusals
                .with_label_values(&[quota])
                .inc();
            tracing::info!(%tenant, quota, limit, "endpoint refused by the tenant's quota");
            ApiError::conflict(
                None,
                format!(
                    "the tenant has reached its {quota} quota ({limit} endpoints): delete \
                         one or ask the operator for more; nothing was created"
                ),
            )
        }
        // The id is the upstream's and unique across tenants: say it is taken, and nothing
        // else about whose it is.
        StoreError::AlreadyExists {
            what: "webhook endpoint",
            ..
        } => ApiError::conflict(Some("id"), "this webhook endpoint is registered already"),
        StoreError::AlreadyExists { what: "secret", id } => ApiError::invalid(
            format!("secrets[{id}]"),
            "the same secret as an earlier one",
        ),
        StoreError::NotFound { what: "tenant", .. } => ApiError::NotFound("tenant"),
        other => other.into(),
    })?;
    tracing::info!(%tenant, endpoint = %id, secrets = registration.secrets.len(),
                   "endpoint registered");
    Ok((
        StatusCode::CREATED,
        Json(load_endpoint(&state.pool, tenant, id).await?),
    ))
}

#[utoipa::path(
    get, path = "/v1/endpoints", tag = "endpoints", security(("bearer" = [])),
    params(
        ("after" = Option<Uuid>, Query, description = "The last id of the previous page"),
        ("limit" = Option<i64>, Query, description = "1 to 500, default 100"),
    ),
    responses(
        (status = 200, body = EndpointPage),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
    )
)]
pub async fn list_endpoints(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<EndpointPage>, ApiError> {
    let query = QueryArgs::new(query, &["after", "limit"])?;
    let after = query
        .text("after")
        .map(|t| parse_uuid("after", t).map(EndpointId))
        .transpose()?;
    let limit = query.limit(100, 500)?;
    let data = store::list(&state.pool, tenant, after, limit)
        .await?
        .into_iter()
        .map(EndpointView::try_from)
        .collect::<Result<Vec<_>, _>>()?;
    let next_cursor = next_cursor(&data, limit, |e| e.id.to_string());
    Ok(Json(EndpointPage { data, next_cursor }))
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}", tag = "endpoints", security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    responses(
        (status = 200, body = EndpointView),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn get_endpoint(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
) -> Result<Json<EndpointView>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    Ok(Json(load_endpoint(&state.pool, tenant, id).await?))
}

#[utoipa::path(
    patch, path = "/v1/endpoints/{endpoint_id}", tag = "endpoints", security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    request_body = EndpointUpdate,
    responses(
        (status = 200, body = EndpointView),
        (status = 400, body = ErrorBody, description = "A field is not acceptable (as for \
            registering): nothing changed"),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn update_endpoint(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
    JsonBody(body): JsonBody<EndpointUpdate>,
) -> Result<Json<EndpointView>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    let current = store::find(&state.pool, tenant, id)
        .await?
        .ok_or(ENDPOINT_NOT_FOUND)?;
    let stories =
        stored::<EndpointSource>("endpoint source", &current.source)? == EndpointSource::Stories;
    if stories && body.lang.is_some() {
        return Err(ApiError::invalid("lang", "belongs to feed endpoints"));
    }
    if !stories && (body.tickers.is_some() || body.stories_mode.is_some()) {
        let field = if body.tickers.is_some() {
            "tickers"
        } else {
            "stories_mode"
        };
        return Err(ApiError::invalid(field, "belongs to stories endpoints"));
    }
    let tickers = body
        .tickers
        .as_deref()
        .map(|t| valid_tickers("tickers", t))
        .transpose()?;
    let stories_mode = body.stories_mode.map(relay_rules::StoriesMode::from);
    let lang = body
        .lang
        .as_deref()
        .map(|l| valid_lang("lang", l))
        .transpose()?;
    let base_url = match body.upstream_base_url.as_deref() {
        Some(text) => Some(valid_base_url(&state.http, text).await?),
        None => None,
    };
    let api_key = body
        .upstream_api_key
        .as_deref()
        .map(valid_api_key)
        .transpose()?;
    // An empty name takes it away.
    let name = body
        .name
        .as_deref()
        .map(|n| match n {
            "" => Ok(None),
            n => valid_name("name", n).map(Some),
        })
        .transpose()?;
    if name.is_none()
        && lang.is_none()
        && base_url.is_none()
        && api_key.is_none()
        && tickers.is_none()
        && stories_mode.is_none()
    {
        return Err(ApiError::invalid(
            "body",
            "name at least one of name, lang (feed), tickers and stories_mode (stories), \
             upstream_base_url, upstream_api_key",
        ));
    }
    let change = store::SettingsChange {
        name,
        lang,
        upstream_base_url: base_url,
        upstream_api_key: api_key,
        stories_mode,
        tickers,
    };
    if !store::change_settings(&state.pool, &state.sealing, tenant, id, &change).await? {
        return Err(ENDPOINT_NOT_FOUND);
    }
    tracing::info!(%tenant, endpoint = %id, lang = ?change.lang,
                   base_url_changed = change.upstream_base_url.is_some(),
                   api_key_changed = change.upstream_api_key.is_some(), "endpoint updated");
    Ok(Json(load_endpoint(&state.pool, tenant, id).await?))
}

async fn set_status(
    state: &AppState,
    tenant: relay_store::TenantId,
    endpoint_id: &str,
    status: store::EndpointStatus,
) -> Result<Json<EndpointView>, ApiError> {
    let id = parse_endpoint_id(endpoint_id)?;
    // The front tier hears of the change through the table's NOTIFY trigger and answers 410
    // (or takes messages again) at once, not when its cache entry expires.
    if !store::change_status(&state.pool, tenant, id, status).await? {
        return Err(ENDPOINT_NOT_FOUND);
    }
    tracing::info!(%tenant, endpoint = %id, status = status.as_str(), "endpoint status set");
    Ok(Json(load_endpoint(&state.pool, tenant, id).await?))
}

/// A delete accepted: the thing is gone from every read at once and its data is being purged.
#[derive(Debug, Serialize, ToSchema)]
pub struct DeletionView {
    pub id: Uuid,
    pub status: DeletionStatus,
}

/// Where a delete stands when accepted: always `deleting` (the purge finishes in the background,
/// and after a restart).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeletionStatus {
    Deleting,
}

#[utoipa::path(
    delete, path = "/v1/endpoints/{endpoint_id}", tag = "endpoints", security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    responses(
        (status = 202, body = DeletionView, description = "Deleting: from now on the front tier \
            answers 404 for it (the upstream stops sending after its retries) and no read shows \
            it; its stored messages, copy, changes, applied event ids and track go, then the \
            endpoint itself, after which its id can be registered again. Asked again while it \
            is being deleted, the same answer"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "Not the tenant's (or deleted already)"),
    )
)]
pub async fn delete_endpoint(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
) -> Result<(StatusCode, Json<DeletionView>), ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    let marked = relay_store::offboard::mark_endpoint(&state.pool, tenant, id)
        .await?
        .ok_or(ENDPOINT_NOT_FOUND)?;
    tracing::info!(%tenant, endpoint = %id, ?marked, "endpoint deleting");
    state.purge.notify_one();
    Ok((
        StatusCode::ACCEPTED,
        Json(DeletionView {
            id: id.0,
            status: DeletionStatus::Deleting,
        }),
    ))
}

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/pause", tag = "endpoints", security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    responses(
        (status = 200, body = EndpointView, description = "Paused: the front tier answers 410, \
            which the upstream takes as paused until the endpoint is resumed there"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn pause_endpoint(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
) -> Result<Json<EndpointView>, ApiError> {
    set_status(&state, tenant, &endpoint_id, store::EndpointStatus::Paused).await
}

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/resume", tag = "endpoints", security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    responses(
        (status = 200, body = EndpointView, description = "Active: the front tier takes messages \
            again (resume the endpoint at the upstream too)"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn resume_endpoint(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
) -> Result<Json<EndpointView>, ApiError> {
    set_status(&state, tenant, &endpoint_id, store::EndpointStatus::Active).await
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/secrets", tag = "secrets", security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    responses(
        (status = 200, body = Vec<SecretView>, description = "Each secret's id and expiry, never \
            its value"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn list_secrets(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
) -> Result<Json<Vec<SecretView>>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    owned_endpoint(&state.pool, tenant, id).await?;
    Ok(Json(secrets_of(&state.pool, tenant, id).await?))
}

/// Why a secret was not added: the endpoint is not the tenant's, or holds it already.
fn secret_not_added(error: StoreError) -> ApiError {
    match error {
        StoreError::NotFound { .. } => ENDPOINT_NOT_FOUND,
        StoreError::AlreadyExists { .. } => {
            ApiError::conflict(Some("secret"), "the endpoint holds this secret already")
        }
        other => other.into(),
    }
}

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/secrets", tag = "secrets", security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    request_body = NewSecret,
    responses(
        (status = 201, body = SecretView),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody),
    )
)]
pub async fn add_secret(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
    JsonBody(body): JsonBody<NewSecret>,
) -> Result<(StatusCode, Json<SecretView>), ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    let secret = valid_secret("secret", &body.secret)?;
    let expires_in = body
        .expires_in_s
        .map(|s| seconds("expires_in_s", Some(s), 0, MAX_EXPIRY_S))
        .transpose()?;
    let added = store::add_secret(&state.pool, &state.sealing, tenant, id, &secret, expires_in)
        .await
        .map_err(secret_not_added)?;
    tracing::info!(%tenant, endpoint = %id, secret_id = added.id, "secret added");
    Ok((StatusCode::CREATED, Json(added.into())))
}

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/secrets/rotate", tag = "secrets",
    security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    request_body = SecretRotation,
    responses(
        (status = 200, body = RotationView, description = "The new secret verifies now; those \
            held before keep verifying until the overlap ends"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody),
    )
)]
pub async fn rotate_secret(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
    JsonBody(body): JsonBody<SecretRotation>,
) -> Result<Json<RotationView>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    let secret = valid_secret("secret", &body.secret)?;
    let overlap = seconds(
        "overlap_s",
        body.overlap_s,
        ROTATION_OVERLAP_S,
        ROTATION_OVERLAP_MAX_S,
    )?;
    // As the upstream rotates: the new secret and every one held before verify during the
    // overlap.
    let (added, rotation) =
        store::rotate_secrets(&state.pool, &state.sealing, tenant, id, &secret, overlap)
            .await
            .map_err(secret_not_added)?;
    tracing::info!(%tenant, endpoint = %id, secret_id = added.id,
                   old_secrets = rotation.old_secrets, overlap_s = overlap, "secret rotated");
    Ok(Json(RotationView {
        secret: added.into(),
        old_secrets_expire_at: rotation.old_secrets_expire_at,
        old_secrets: rotation.old_secrets,
    }))
}

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/secrets/{secret_id}/expire", tag = "secrets",
    security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path), ("secret_id" = i64, Path)),
    request_body = SecretExpiry,
    responses(
        (status = 200, body = SecretView),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn expire_secret(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path((endpoint_id, secret_id)): Path<(String, String)>,
    JsonBody(body): JsonBody<SecretExpiry>,
) -> Result<Json<SecretView>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    let secret_id: i64 = secret_id
        .parse()
        .map_err(|_| ApiError::invalid("secret_id", "not a secret's id"))?;
    let after = seconds("after_s", body.after_s, 0, ROTATION_OVERLAP_MAX_S)?;
    let expired = store::expire_secret(&state.pool, tenant, id, secret_id, after)
        .await?
        .ok_or(ApiError::NotFound("secret"))?;
    tracing::info!(%tenant, endpoint = %id, secret_id, after_s = after, "secret expiry set");
    Ok(Json(expired.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routes::enums::parse_spelt;

    /// The refusal of `body`'s field, as a 400 names it.
    fn refusal(body: serde_json::Value) -> (String, String) {
        match crate::error::parse_json::<NewEndpoint>(body.to_string().as_bytes()) {
            Err(ApiError::Invalid { field, detail }) => (field, detail),
            Err(other) => panic!("{body}: {other}"),
            Ok(_) => panic!("{body}: taken"),
        }
    }

    #[test]
    fn enum_fields_take_their_values_spelt_as_strings_and_name_the_field_otherwise() {
        let id = Uuid::nil();
        let body = |extra: serde_json::Value| {
            let mut body = serde_json::json!({"id": id, "secrets": []});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            body
        };
        let taken = |json: serde_json::Value| {
            crate::error::parse_json::<NewEndpoint>(json.to_string().as_bytes())
                .unwrap_or_else(|e| panic!("{json}: {e}"))
        };
        let parsed = taken(body(
            serde_json::json!({"source": "stories", "stories_mode": "fetch_on_notify"}),
        ));
        assert_eq!(parsed.source, Some(EndpointSource::Stories));
        assert_eq!(parsed.stories_mode, Some(StoriesMode::FetchOnNotify));
        let parsed = taken(body(serde_json::json!({"source": null})));
        assert_eq!((parsed.source, parsed.stories_mode), (None, None));

        let (field, detail) = refusal(body(serde_json::json!({"source": "whsec_news"})));
        assert_eq!(field, "source");
        assert_eq!(detail, "unknown value, expected `feed` or `stories`");
        let (field, detail) = refusal(body(serde_json::json!({"stories_mode": "Snapshot"})));
        assert_eq!(field, "stories_mode");
        assert_eq!(
            detail,
            "unknown value, expected `snapshot` or `fetch_on_notify`"
        );
        // Serde's own form of an enum (`{"feed": null}`) is not a string: refused as one.
        for wrong in [serde_json::json!(5), serde_json::json!({"feed": null})] {
            let (field, detail) = refusal(body(serde_json::json!({"source": wrong})));
            assert_eq!(
                (field.as_str(), detail.as_str()),
                ("source", "expected a string")
            );
        }
    }

    #[test]
    fn stories_modes_are_spelt_as_the_rules_spell_them() {
        for mode in relay_rules::StoriesMode::ALL {
            let read: StoriesMode = parse_spelt(mode.as_str()).unwrap();
            assert_eq!(read, StoriesMode::from(mode));
            assert_eq!(relay_rules::StoriesMode::from(read), mode);
        }
    }
}
