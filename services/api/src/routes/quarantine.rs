//! An endpoint's quarantined messages: stored messages the sequencer set aside because they can
//! never be applied (a body that is not a v1 message, or one whose apply kept failing), while the
//! endpoint went on and a reload brought its copy up to date without them. The tenant lists
//! them, and retries or discards each.
//!
//! A retry stores the message again as a new arrival at the end of the endpoint's order (see
//! [`relay_store::quarantine::retry`] for why applying it late is safe under the reading rules);
//! if it still cannot be applied it is quarantined again, under its new number. A discard keeps
//! the message and its quarantine row for audit, marked discarded: the relay answered 2xx for
//! it, so it is never deleted.
//!
//! Every query names the tenant: another tenant's endpoint or message is a 404.

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::Json;
use relay_store::quarantine::{self, Quarantined, Resolution};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use utoipa::ToSchema;

use super::enums::{spelling, stored};
use super::{next_cursor, owned_endpoint, parse_endpoint_id, AppState, QueryArgs};
use crate::auth::TenantId;
use crate::error::{ApiError, ErrorBody, JsonBody};

/// Where a quarantined message stands: `quarantined` (waiting for a retry or a discard),
/// `retried` (stored again as a new arrival, `retried_as`) or `discarded` (kept for audit,
/// never applied).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum QuarantineStatus {
    Quarantined,
    Retried,
    Discarded,
}

/// Which quarantined messages a page lists: those in one status (`quarantined`, the default;
/// `retried`; `discarded`), or `all`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum QuarantineStatusFilter {
    Quarantined,
    Retried,
    Discarded,
    All,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct QuarantinedView {
    /// The arrival number it was quarantined under.
    pub arrival_seq: i64,
    pub webhook_id: Option<String>,
    /// Why it cannot be applied: the parse error, or the last failure of its apply.
    pub reason: String,
    /// How many times its apply was tried.
    pub attempts: i32,
    #[serde(with = "time::serde::rfc3339")]
    pub quarantined_at: OffsetDateTime,
    pub status: QuarantineStatus,
    #[serde(with = "time::serde::rfc3339::option")]
    pub resolved_at: Option<OffsetDateTime>,
    /// A retried message's new arrival number (its messages listing shows how it applied).
    pub retried_as: Option<i64>,
}

impl TryFrom<Quarantined> for QuarantinedView {
    type Error = ApiError;

    /// The stored row; a status the API names no value for is an internal error.
    fn try_from(q: Quarantined) -> Result<Self, ApiError> {
        Ok(Self {
            arrival_seq: q.arrival_seq,
            webhook_id: q.webhook_id,
            reason: q.reason,
            attempts: q.attempts,
            quarantined_at: q.quarantined_at,
            status: stored("quarantine status", &q.status)?,
            resolved_at: q.resolved_at,
            retried_as: q.retried_as,
        })
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct QuarantinePage {
    pub data: Vec<QuarantinedView>,
    /// Pass as `after` for the next page; absent on the last.
    pub next_cursor: Option<String>,
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/quarantine", tag = "quarantine",
    security(("bearer" = [])),
    params(
        ("endpoint_id" = Uuid, Path),
        ("status" = Option<QuarantineStatusFilter>, Query,
         description = "quarantined (default), retried, discarded or all"),
        ("after" = Option<i64>, Query, description = "The next_cursor of the previous page"),
        ("limit" = Option<i64>, Query, description = "1 to 200, default 50"),
    ),
    responses(
        (status = 200, body = QuarantinePage, description = "By arrival number"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn list_quarantine(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<QuarantinePage>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    let query = QueryArgs::new(query, &["status", "after", "limit"])?;
    let status = match query
        .one_of::<QuarantineStatusFilter>("status", "quarantined, retried, discarded or all")?
        .unwrap_or(QuarantineStatusFilter::Quarantined)
    {
        QuarantineStatusFilter::Quarantined => Some(QuarantineStatus::Quarantined),
        QuarantineStatusFilter::Retried => Some(QuarantineStatus::Retried),
        QuarantineStatusFilter::Discarded => Some(QuarantineStatus::Discarded),
        QuarantineStatusFilter::All => None,
    }
    .map(|status| spelling(&status));
    let after = query.parsed::<i64>("after", "a cursor from a previous page")?;
    let limit = query.limit(50, 200)?;
    owned_endpoint(&state.pool, tenant, id).await?;
    let rows = quarantine::list(&state.pool, tenant, id, status.as_deref(), after, limit).await?;
    let next_cursor = next_cursor(&rows, limit, |q| q.arrival_seq.to_string());
    Ok(Json(QuarantinePage {
        data: rows
            .into_iter()
            .map(QuarantinedView::try_from)
            .collect::<Result<_, _>>()?,
        next_cursor,
    }))
}

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/quarantine/{arrival_seq}/retry",
    tag = "quarantine", security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path), ("arrival_seq" = i64, Path)),
    responses(
        (status = 200, body = QuarantinedView,
         description = "Stored again as a new arrival (`retried_as`); the sequencer applies it"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "No such quarantined message"),
        (status = 409, body = ErrorBody, description = "Already retried or discarded"),
    )
)]
pub async fn retry_quarantined(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path((endpoint_id, arrival_seq)): Path<(String, String)>,
) -> Result<Json<QuarantinedView>, ApiError> {
    let (id, seq) = message_key(&endpoint_id, &arrival_seq)?;
    resolved(quarantine::retry(&state.pool, tenant, id, seq).await?)
}

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/quarantine/{arrival_seq}/discard",
    tag = "quarantine", security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path), ("arrival_seq" = i64, Path)),
    responses(
        (status = 200, body = QuarantinedView,
         description = "Marked discarded: kept for audit, never applied"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "No such quarantined message"),
        (status = 409, body = ErrorBody, description = "Already retried or discarded"),
    )
)]
pub async fn discard_quarantined(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path((endpoint_id, arrival_seq)): Path<(String, String)>,
) -> Result<Json<QuarantinedView>, ApiError> {
    let (id, seq) = message_key(&endpoint_id, &arrival_seq)?;
    resolved(quarantine::discard(&state.pool, tenant, id, seq).await?)
}

/// The most messages one bulk retry or discard names: each is a statement of its own.
const MAX_BULK: usize = 100;

/// Quarantined messages to retry or discard at once.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BulkQuarantineAction {
    /// The arrival numbers they were quarantined under: 1 to 100, each once.
    pub arrival_seqs: Vec<i64>,
}

/// What became of one message of a bulk action.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BulkResult {
    /// Retried or discarded now.
    Done,
    /// It had been retried or discarded already: left as it was (`quarantined` says how).
    AlreadyResolved,
    /// No such quarantined message of this endpoint.
    NotFound,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct BulkOutcome {
    pub arrival_seq: i64,
    pub result: BulkResult,
    /// The message's quarantine row after the action; null when not found.
    pub quarantined: Option<QuarantinedView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct BulkAnswer {
    /// One per arrival number, in the order given.
    pub results: Vec<BulkOutcome>,
}

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/quarantine/retry", tag = "quarantine",
    security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    request_body = BulkQuarantineAction,
    responses(
        (status = 200, body = BulkAnswer, description = "Each message retried as the single \
            retry does it, one after another; what became of each, in the order given"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn retry_many(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
    JsonBody(body): JsonBody<BulkQuarantineAction>,
) -> Result<Json<BulkAnswer>, ApiError> {
    bulk(&state, tenant, &endpoint_id, &body, Action::Retry).await
}

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/quarantine/discard", tag = "quarantine",
    security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    request_body = BulkQuarantineAction,
    responses(
        (status = 200, body = BulkAnswer, description = "Each message discarded as the single \
            discard does it; what became of each, in the order given"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn discard_many(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
    JsonBody(body): JsonBody<BulkQuarantineAction>,
) -> Result<Json<BulkAnswer>, ApiError> {
    bulk(&state, tenant, &endpoint_id, &body, Action::Discard).await
}

#[derive(Clone, Copy)]
enum Action {
    Retry,
    Discard,
}

/// Each message's own statement (the single action's), in turn: one that fails to resolve
/// says so in its result and leaves the others as they went.
async fn bulk(
    state: &AppState,
    tenant: relay_store::TenantId,
    endpoint_id: &str,
    body: &BulkQuarantineAction,
    action: Action,
) -> Result<Json<BulkAnswer>, ApiError> {
    let id = parse_endpoint_id(endpoint_id)?;
    let seqs = &body.arrival_seqs;
    if seqs.is_empty() || seqs.len() > MAX_BULK {
        return Err(ApiError::invalid(
            "arrival_seqs",
            format!("1 to {MAX_BULK} arrival numbers"),
        ));
    }
    for (i, seq) in seqs.iter().enumerate() {
        if seqs[..i].contains(seq) {
            return Err(ApiError::invalid(
                format!("arrival_seqs[{i}]"),
                "named twice",
            ));
        }
    }
    owned_endpoint(&state.pool, tenant, id).await?;
    let mut results = Vec::with_capacity(seqs.len());
    for &seq in seqs {
        let resolution = match action {
            Action::Retry => quarantine::retry(&state.pool, tenant, id, seq).await?,
            Action::Discard => quarantine::discard(&state.pool, tenant, id, seq).await?,
        };
        let (result, row) = match resolution {
            Resolution::Done(q) => (BulkResult::Done, Some(q)),
            Resolution::AlreadyResolved(q) => (BulkResult::AlreadyResolved, Some(q)),
            Resolution::NotFound => (BulkResult::NotFound, None),
        };
        results.push(BulkOutcome {
            arrival_seq: seq,
            result,
            quarantined: row.map(QuarantinedView::try_from).transpose()?,
        });
    }
    Ok(Json(BulkAnswer { results }))
}

fn message_key(
    endpoint_id: &str,
    arrival_seq: &str,
) -> Result<(relay_store::EndpointId, i64), ApiError> {
    let id = parse_endpoint_id(endpoint_id)?;
    let seq = arrival_seq
        .parse::<i64>()
        .map_err(|_| ApiError::invalid("arrival_seq", "not a whole number"))?;
    Ok((id, seq))
}

fn resolved(resolution: Resolution) -> Result<Json<QuarantinedView>, ApiError> {
    match resolution {
        Resolution::Done(q) => Ok(Json(q.try_into()?)),
        Resolution::AlreadyResolved(q) => {
            let status: QuarantineStatus = stored("quarantine status", &q.status)?;
            Err(ApiError::conflict(
                Some("arrival_seq"),
                format!("already {}", spelling(&status)),
            ))
        }
        Resolution::NotFound => Err(ApiError::NotFound("quarantined message")),
    }
}
