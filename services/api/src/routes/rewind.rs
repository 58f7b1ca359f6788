//! Rewinding a track after the copy was restored from a backup.
//!
//! Rule "Keep, with the copy, the through of the last message of events applied on each track":
//! rewind the track to the kept `through`, or, when the last message the copy took was a reset,
//! read /v1/feed again. A refusal `before_reset` or `cursor_not_in_epoch` also means read
//! /v1/feed again; `cursor_ahead` and `reset_pending` need nothing. relay-rules decides all of
//! that ([`restore_plan`], [`decide_rewind`]); this handler reads the track's row, makes the call
//! and carries the decision out.
//!
//! "Read /v1/feed again" is the sequencer's work: this handler only sets the track's `reload`
//! (as [`EndpointTrack::read_feed_again`] says), and the sequencer runs every reload it finds set.

use axum::extract::{Path, State};
use axum::Json;
use relay_rules::{
    decide_rewind, restore_plan, EndpointTrack, Reload, ReloadCause, RestorePlan, RewindAnswer,
    RewindOutcome, RewindRefusal,
};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;
use uuid::Uuid;

use super::{parse_uuid, AppState};
use crate::auth::TenantId;
use crate::error::{ApiError, ErrorBody};
use crate::upstream;

#[derive(Debug, Serialize, ToSchema)]
pub struct UpstreamAnswerView {
    /// 202 or 409.
    pub status: u16,
    /// The generation the track resends under, on 202.
    pub generation: Option<u64>,
    /// The refusal, on 409: before_reset, cursor_not_in_epoch, cursor_ahead, reset_pending.
    pub refusal: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RewindView {
    pub track: String,
    /// `rewind` (the upstream was asked to resend from `since`) or `read_feed_again` (the last
    /// message the copy took was a reset, or none of events was: no call).
    pub plan: String,
    pub since: Option<String>,
    /// The upstream's answer, when it was asked.
    pub upstream: Option<UpstreamAnswerView>,
    /// `nothing` (the messages that follow bring the copy up to date), `reload_begun`, or
    /// `reload_already_running` (a running reload reads everything again already).
    pub outcome: String,
    /// The track's running reload after this call.
    #[schema(value_type = Option<Object>)]
    pub reload: Option<Value>,
}

type TrackRow = (
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<bool>,
    Option<i64>,
    Option<String>,
);

/// A track name goes into the upstream's path: only plain names.
fn valid_track(track: &str) -> Result<(), ApiError> {
    let plain = !track.is_empty()
        && track.len() <= 64
        && track
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if !plain {
        return Err(ApiError::invalid(
            "track",
            "a track name such as `feed` (a-z, 0-9, _)",
        ));
    }
    Ok(())
}

fn unsigned(value: Option<i64>) -> Option<u64> {
    value.and_then(|v| u64::try_from(v).ok())
}

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/tracks/{track}/rewind", tag = "endpoints",
    security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path), ("track" = String, Path, description = "feed")),
    responses(
        (status = 200, body = RewindView, description = "What was asked of the upstream, its \
            answer, and what the relay does about it"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The endpoint has no upstream URL or key, \
            or its upstream_base_url (or an address its name resolves to) is one the operator's \
            policy refuses (field `upstream_base_url`): nothing was sent"),
        (status = 502, body = ErrorBody, description = "The upstream failed, or answered a \
            redirect (never followed): nothing changed"),
    )
)]
pub async fn rewind_track(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path((endpoint_id, track)): Path<(String, String)>,
) -> Result<Json<RewindView>, ApiError> {
    let id = parse_uuid("endpoint_id", &endpoint_id)?;
    valid_track(&track)?;
    let row: Option<TrackRow> = sqlx::query_as(
        "SELECT e.upstream_base_url, e.upstream_api_key, t.generation, t.access_version,
                t.through, t.last_was_reset, t.last_reset_generation, t.reload::text
         FROM webhook_endpoints e
         LEFT JOIN endpoint_tracks t ON t.endpoint_id = e.id AND t.track = $3
         WHERE e.id = $1 AND e.tenant_id = $2",
    )
    .bind(id)
    .bind(tenant)
    .bind(&track)
    .fetch_optional(&state.pool)
    .await?;
    let (
        base_url,
        api_key,
        generation,
        access_version,
        through,
        last_was_reset,
        last_reset,
        reload,
    ) = row.ok_or(ApiError::NotFound("webhook endpoint"))?;
    let held = EndpointTrack {
        generation: unsigned(generation),
        access_version,
        // Only whether a reload runs matters here (a running one is left alone), and the
        // write below checks that again on the row itself; a stored reload this build cannot
        // read still counts as running.
        reload: reload.as_deref().map(|text| {
            serde_json::from_str::<Reload>(text).unwrap_or(Reload {
                generation: unsigned(generation).unwrap_or(0),
                access_version: None,
                cause: ReloadCause::ReadAgain,
                read_again: 0,
            })
        }),
        through,
        last_was_reset: last_was_reset.unwrap_or(false),
        last_reset_generation: unsigned(last_reset),
    };

    let plan = restore_plan(&held);
    let (since, answer) = match &plan {
        RestorePlan::Rewind { since } => {
            let (Some(base_url), Some(api_key)) = (base_url.as_deref(), api_key.as_deref()) else {
                return Err(ApiError::conflict(
                    Some("upstream_base_url"),
                    "a rewind calls the upstream: set the endpoint's upstream_base_url and \
                     upstream_api_key first",
                ));
            };
            let answer = upstream::rewind(&state.http, base_url, api_key, id, &track, since)
                .await
                .map_err(|e| {
                    state
                        .metrics
                        .rewinds
                        .with_label_values(&["upstream_failed"])
                        .inc();
                    tracing::warn!(%tenant, endpoint = %id, track, kind = e.kind(), error = %e,
                                   "rewind failed");
                    match e {
                        upstream::UpstreamError::Refused(refusal) => ApiError::conflict(
                            Some("upstream_base_url"),
                            format!("the stored upstream_base_url is refused: {refusal}"),
                        ),
                        e => ApiError::Upstream(e.to_string()),
                    }
                })?;
            (Some(since.clone()), Some(answer))
        }
        RestorePlan::Reload => (None, None),
    };
    let outcome = match &answer {
        Some(answer) => decide_rewind(answer),
        None => RewindOutcome::Reload,
    };

    let (outcome_text, reload) = match outcome {
        RewindOutcome::Nothing => ("nothing", held_reload_json(&held)?),
        RewindOutcome::Reload => begin_reload(&state, tenant, id, &track, &held).await?,
    };
    state
        .metrics
        .rewinds
        .with_label_values(&[outcome_text])
        .inc();
    tracing::info!(%tenant, endpoint = %id, track, plan = ?plan, answer = ?answer,
                   outcome = outcome_text, "rewind after restore");
    Ok(Json(RewindView {
        track,
        plan: match plan {
            RestorePlan::Rewind { .. } => "rewind",
            RestorePlan::Reload => "read_feed_again",
        }
        .to_owned(),
        since,
        upstream: answer.map(|a| match a {
            RewindAnswer::Accepted { generation } => UpstreamAnswerView {
                status: 202,
                generation: Some(generation),
                refusal: None,
            },
            RewindAnswer::Refused(refusal) => UpstreamAnswerView {
                status: 409,
                generation: None,
                refusal: Some(refusal_code(&refusal)),
            },
        }),
        outcome: outcome_text.to_owned(),
        reload,
    }))
}

fn refusal_code(refusal: &RewindRefusal) -> String {
    match refusal {
        RewindRefusal::BeforeReset => "before_reset",
        RewindRefusal::CursorNotInEpoch => "cursor_not_in_epoch",
        RewindRefusal::CursorAhead => "cursor_ahead",
        RewindRefusal::ResetPending => "reset_pending",
        RewindRefusal::Other(other) => other,
    }
    .to_owned()
}

fn held_reload_json(held: &EndpointTrack) -> Result<Option<Value>, ApiError> {
    held.reload
        .as_ref()
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| ApiError::Internal(e.to_string()))
}

/// Begins "read /v1/feed again" on the track as [`EndpointTrack::read_feed_again`] says: one
/// conditional statement, so a reload that began meanwhile (a reset the sequencer applied since
/// the row was read) is left alone rather than replaced.
async fn begin_reload(
    state: &AppState,
    tenant: Uuid,
    endpoint: Uuid,
    track: &str,
    held: &EndpointTrack,
) -> Result<(&'static str, Option<Value>), ApiError> {
    // A running reload is left alone (`reload_already_running`, the documented answer), where
    // relay-rules' `read_feed_again` would begin it again: that is for a refetch whose change
    // the running pass may have missed, and a rewind's refusal names no change.
    if held.reload.is_some() {
        return Ok(("reload_already_running", held_reload_json(held)?));
    }
    let (next, _) = held.read_feed_again();
    let reload = next
        .reload
        .as_ref()
        .map(serde_json::to_string)
        .transpose()
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .ok_or_else(|| ApiError::Internal("read_feed_again began no reload".into()))?;
    // The rules begin the reload "under the held generation": the statement takes the
    // generation the row holds when it writes, not the one read above, in case the sequencer
    // applied a newer message in between. A missing row is the track of a copy that took no
    // message yet: it is created holding only the reload.
    let written: Option<String> = sqlx::query_scalar(
        "INSERT INTO endpoint_tracks AS t (endpoint_id, track, tenant_id, reload, reload_begun_at)
         VALUES ($1, $2, $3, $4::jsonb, now())
         ON CONFLICT (endpoint_id, track) DO UPDATE
         SET reload = jsonb_set(excluded.reload, '{generation}', to_jsonb(COALESCE(t.generation, 0))),
             reload_begun_at = now(), updated_at = now()
         WHERE t.reload IS NULL
         RETURNING reload::text",
    )
    .bind(endpoint)
    .bind(track)
    .bind(tenant)
    .bind(&reload)
    .fetch_optional(&state.pool)
    .await?;
    match written {
        Some(text) => Ok((
            "reload_begun",
            Some(serde_json::from_str(&text).map_err(|e| ApiError::Internal(e.to_string()))?),
        )),
        None => {
            let running: Option<String> = sqlx::query_scalar(
                "SELECT reload::text FROM endpoint_tracks
                 WHERE endpoint_id = $1 AND track = $2 AND tenant_id = $3",
            )
            .bind(endpoint)
            .bind(track)
            .bind(tenant)
            .fetch_optional(&state.pool)
            .await?
            .flatten();
            let running = running
                .as_deref()
                .map(serde_json::from_str)
                .transpose()
                .map_err(|e| ApiError::Internal(e.to_string()))?;
            Ok(("reload_already_running", running))
        }
    }
}
