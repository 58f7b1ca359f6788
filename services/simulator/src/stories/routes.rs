//! The stories API over axum: handlers only parse, lock the [`Stories`](super::Stories), call
//! it, sleep where a fault says so (never holding the lock), and map the answer to a status.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use super::reads::{StoriesApiError, StoryRead};
use crate::api::{bearer, limit_from, maybe_slow};
use crate::driver::Simulation;

/// GET /v1/events, /v1/stories and /v1/stories/{id}, merged into [`crate::api::router`].
pub(crate) fn routes() -> Router<Arc<Simulation>> {
    Router::new()
        .route("/v1/events", get(events))
        .route("/v1/stories", get(stories))
        .route("/v1/stories/{id}", get(story))
}

impl IntoResponse for StoriesApiError {
    fn into_response(self) -> Response {
        match self {
            StoriesApiError::Api(error) => error.into_response(),
            StoriesApiError::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({"error": "unavailable"})),
            )
                .into_response(),
        }
    }
}

async fn events(
    State(sim): State<Arc<Simulation>>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, StoriesApiError> {
    let token = bearer(&headers)?;
    let limit = limit_from(&query)?;
    maybe_slow(&sim).await;
    let now_ms = sim.clock.now_ms();
    let page = sim.stories().events_page(
        &token,
        query.get("cursor").map(String::as_str),
        limit,
        now_ms,
    )?;
    Ok(Json(page))
}

async fn stories(
    State(sim): State<Arc<Simulation>>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, StoriesApiError> {
    let token = bearer(&headers)?;
    let limit = limit_from(&query)?;
    maybe_slow(&sim).await;
    let page = sim.stories().stories_page(
        &token,
        query.get("ticker").map(String::as_str),
        query.get("cursor").map(String::as_str),
        limit,
    )?;
    Ok(Json(page))
}

async fn story(
    State(sim): State<Arc<Simulation>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, StoriesApiError> {
    let token = bearer(&headers)?;
    maybe_slow(&sim).await;
    let now_ms = sim.clock.now_ms();
    let read = sim.stories().story_read(&token, &id, now_ms)?;
    Ok(match read {
        StoryRead::Found(story) => (StatusCode::OK, Json(story)).into_response(),
        StoryRead::Stale { story, delay_ms } => {
            // Read before whatever changes while it is on its way.
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            (StatusCode::OK, Json(story)).into_response()
        }
        StoryRead::NotFound => {
            (StatusCode::NOT_FOUND, Json(json!({"error": "not_found"}))).into_response()
        }
        StoryRead::LoadBalancer404 => (
            StatusCode::NOT_FOUND,
            [(header::CONTENT_TYPE, "text/plain")],
            "404 Not Found",
        )
            .into_response(),
    })
}
