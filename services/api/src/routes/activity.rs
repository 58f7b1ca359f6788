//! An endpoint's last hour, minute by minute: the messages the front tier stored, the changes
//! the apply wrote, and the apply lag, what the console's chart draws. The first two are counted
//! from the rows themselves (`messages.received_at`, `changes.created_at`), so nothing is
//! written per message to keep them; each read scans at most [`ACTIVITY_ROWS`] of the
//! endpoint's latest rows of each table, and says when that bound cut the hour short. The lag
//! is the sequencers' samples (relay-store's `lag_samples`).

use axum::extract::{Path, State};
use axum::Json;
use relay_store::{changes, lag_samples, messages};
use serde::Serialize;
use time::{Duration, OffsetDateTime};
use utoipa::ToSchema;

use super::{owned_endpoint, parse_endpoint_id, AppState};
use crate::auth::TenantId;
use crate::error::{ApiError, ErrorBody};

/// The window the activity covers, in minutes.
const ACTIVITY_MINUTES: i64 = 60;
/// The most rows of each table one read of the activity scans: an hour at about 14 messages a
/// second. An endpoint busier than that has its earliest minutes cut (`received_cut`,
/// `written_cut`).
const ACTIVITY_ROWS: i64 = 50_000;

#[derive(Debug, Serialize, ToSchema)]
pub struct ActivityView {
    /// The window's first minute; `minutes` holds every minute from it to the current one.
    pub since: OffsetDateTime,
    pub minutes: Vec<MinuteView>,
    /// The endpoint's latest messages the read may scan do not reach back to `since`: the
    /// earlier minutes' `received` are undercounted.
    pub received_cut: bool,
    /// As `received_cut`, for `written`.
    pub written_cut: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MinuteView {
    /// The minute's start.
    pub at: OffsetDateTime,
    /// Messages stored in it (duplicates of a stored message are not stored again).
    pub received: i64,
    /// Changes the apply wrote to the endpoint's stream in it (of its current epoch).
    pub written: i64,
    /// The greatest apply lag sampled in it, in seconds: how long the oldest stored message
    /// not yet applied had waited; 0 when nothing was waiting when sampled.
    pub apply_lag_s: f64,
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/activity", tag = "reads",
    security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    responses(
        (status = 200, body = ActivityView, description = "The endpoint's messages received, \
            changes written and greatest apply lag in each minute of the last hour"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn endpoint_activity(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
) -> Result<Json<ActivityView>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    owned_endpoint(&state.pool, tenant, id).await?;
    let now = OffsetDateTime::now_utc();
    let this_minute = now.replace_second(0).and_then(|t| t.replace_nanosecond(0));
    let this_minute = this_minute.unwrap_or(now);
    let since = this_minute - Duration::minutes(ACTIVITY_MINUTES - 1);
    let (received, received_cut) =
        messages::arrivals_by_minute(&state.pool, id, since, ACTIVITY_ROWS).await?;
    let (written, written_cut) =
        changes::written_by_minute(&state.pool, id, since, ACTIVITY_ROWS).await?;
    let lags = lag_samples::by_minute(&state.pool, id, since).await?;
    let count_at = |counts: &[(OffsetDateTime, i64)], at: OffsetDateTime| {
        counts.iter().find(|(m, _)| *m == at).map_or(0, |(_, n)| *n)
    };
    let minutes = (0..ACTIVITY_MINUTES)
        .map(|i| {
            let at = since + Duration::minutes(i);
            MinuteView {
                at,
                received: count_at(&received, at),
                written: count_at(&written, at),
                apply_lag_s: lags
                    .iter()
                    .find(|(m, _)| *m == at)
                    .map_or(0.0, |(_, lag)| *lag),
            }
        })
        .collect();
    Ok(Json(ActivityView {
        since,
        minutes,
        received_cut,
        written_cut,
    }))
}
