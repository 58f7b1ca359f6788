//! Reads of a stories endpoint's copy (seed 000's rows: open stories with their snapshot, closed
//! ones kept as closed) and of the notifications it claimed. As every read, each names the
//! tenant as well as the endpoint, and runs only once the endpoint is found to be the tenant's.

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::Json;
use relay_store::stories;
use serde::Serialize;
use serde_json::Value;
use time::OffsetDateTime;
use utoipa::ToSchema;

use super::{next_cursor, owned_endpoint, parse_endpoint_id, AppState, QueryArgs};
use crate::auth::TenantId;
use crate::error::{check_text, ApiError, ErrorBody};

/// The longest story id or ticker a path or query takes, in bytes.
const MAX_ID_BYTES: usize = 200;

#[derive(Debug, Serialize, ToSchema)]
pub struct StoryView {
    pub id: String,
    /// Null for a story the copy only knows closed.
    pub ticker: Option<String>,
    /// The version of the snapshot held; for a closed story, the greatest closing version
    /// known (0 when all the relay knows is that the API answered 404).
    pub version: i64,
    /// Closed for good: kept so that a late event cannot bring it back.
    pub closed: bool,
    /// The story it merged into, as the `closed` message said; null unless closed by a merge.
    pub merged_into: Option<String>,
    /// The snapshot; absent once closed.
    #[schema(value_type = Option<Object>)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub story: Option<Value>,
}

impl From<stories::CopiedStory> for StoryView {
    fn from(row: stories::CopiedStory) -> Self {
        Self {
            id: row.id,
            ticker: row.ticker,
            version: row.version,
            closed: row.closed,
            merged_into: row.merged_into,
            story: row.story,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct StoryPage {
    pub data: Vec<StoryView>,
    /// Pass as `after` for the next page; absent on the last.
    pub next_cursor: Option<String>,
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/stories", tag = "reads", security(("bearer" = [])),
    params(
        ("endpoint_id" = Uuid, Path),
        ("after" = Option<String>, Query, description = "The last id of the previous page"),
        ("limit" = Option<i64>, Query, description = "1 to 500, default 100"),
        ("ticker" = Option<String>, Query),
        ("include_closed" = Option<bool>, Query, description = "Default false"),
    ),
    responses(
        (status = 200, body = StoryPage, description = "A stories endpoint's copy, by story id \
            (empty for a feed endpoint)"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn list_stories(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<StoryPage>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    let query = QueryArgs::new(query, &["after", "limit", "ticker", "include_closed"])?;
    let limit = query.limit(100, 500)?;
    let include_closed = query.flag("include_closed")?;
    let ticker = query.text("ticker");
    if let Some(ticker) = ticker {
        check_text("ticker", ticker, MAX_ID_BYTES)?;
    }
    owned_endpoint(&state.pool, tenant, id).await?;
    let rows = stories::list(
        &state.pool,
        tenant,
        id,
        (ticker, include_closed),
        query.text("after"),
        limit,
    )
    .await?;
    let data: Vec<StoryView> = rows.into_iter().map(StoryView::from).collect();
    let next_cursor = next_cursor(&data, limit, |s| s.id.clone());
    Ok(Json(StoryPage { data, next_cursor }))
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/stories/{story_id}", tag = "reads",
    security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path), ("story_id" = String, Path)),
    responses(
        (status = 200, body = StoryView, description = "The story, open or closed"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn get_story(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path((endpoint_id, story_id)): Path<(String, String)>,
) -> Result<Json<StoryView>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    check_text("story_id", &story_id, MAX_ID_BYTES)?;
    owned_endpoint(&state.pool, tenant, id).await?;
    let row = stories::find(&state.pool, tenant, id, &story_id).await?;
    Ok(Json(row.ok_or(ApiError::NotFound("story"))?.into()))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct NotificationView {
    /// `strong:<story id>`: claimed once, whatever arrives after.
    pub key: String,
    pub story_id: String,
    /// The story's ticker when claimed; null for a story with none.
    pub ticker: Option<String>,
    /// The id of the event that claimed it; null only for a claim made before the relay kept
    /// it whose message was forgotten since.
    pub event_id: Option<String>,
    /// When it was claimed (and appended to the tenant's stream, in the same transaction).
    #[serde(with = "time::serde::rfc3339")]
    pub claimed_at: OffsetDateTime,
    /// Whether the notification was sent to the tenant's queue. False for a story that became
    /// strong before the endpoint was registered: claimed, so never notified later, but not sent
    /// (docs/stories.md, "What a new endpoint notifies").
    pub notified: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct NotificationPage {
    pub data: Vec<NotificationView>,
    /// Pass as `after` for the next page; absent on the last.
    pub next_cursor: Option<String>,
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/notifications", tag = "reads",
    security(("bearer" = [])),
    params(
        ("endpoint_id" = Uuid, Path),
        ("after" = Option<String>, Query, description = "The last key of the previous page"),
        ("limit" = Option<i64>, Query, description = "1 to 500, default 100"),
    ),
    responses(
        (status = 200, body = NotificationPage, description = "The notifications a stories \
            endpoint claimed, by key: each was appended once to the tenant's stream"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn list_notifications(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<NotificationPage>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    let query = QueryArgs::new(query, &["after", "limit"])?;
    let limit = query.limit(100, 500)?;
    owned_endpoint(&state.pool, tenant, id).await?;
    let data: Vec<NotificationView> =
        stories::claims(&state.pool, tenant, id, query.text("after"), limit)
            .await?
            .into_iter()
            .map(|claim| NotificationView {
                key: claim.key,
                story_id: claim.story_id,
                ticker: claim.ticker,
                event_id: claim.event_id,
                claimed_at: claim.claimed_at,
                notified: claim.notified,
            })
            .collect();
    let next_cursor = next_cursor(&data, limit, |n| n.key.clone());
    Ok(Json(NotificationPage { data, next_cursor }))
}
