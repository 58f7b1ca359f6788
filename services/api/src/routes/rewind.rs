//! Rewinding a track after the copy was restored from a backup.
//!
//! Rule "Keep, with the copy, the through of the last message of events applied on each track":
//! rewind the track to the kept `through`, or, when the last message the copy took was a reset,
//! read /v1/feed again. A refusal `before_reset` or `cursor_not_in_epoch` also means read
//! /v1/feed again; `cursor_ahead` and `reset_pending` need nothing. relay-rules decides all of
//! that ([`restore_plan`], [`answer_rewind`]); this handler reads the track's row and the
//! restore held for it (`relay restored`, relay-store's `restores`), makes the call and carries
//! the answer out.
//!
//! The restore held is what the plan starts from: messages taken since the restart move the
//! track's own `through`, and a rewind from there would never resend what the old relay applied
//! after the backup. It is let go once the upstream answered (a failed call keeps it, for the
//! next try).
//!
//! "Read /v1/feed again" is the sequencer's work: this handler only sets the track's `reload`
//! (as [`answer_rewind`] says, through relay-store's `restores::answered`), and the sequencer
//! runs every reload it finds set.

use axum::extract::{Path, State};
use axum::Json;
use relay_rules::{
    answer_rewind, restore_plan, EndpointTrack, RestorePlan, RewindAnswer, RewindRefusal,
};
use relay_store::tracks::{self, FEED_TRACK};
use relay_store::{restores, SecretText};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::enums::spelling;
use super::reads::RestoreView;
use super::{parse_endpoint_id, AppState, ENDPOINT_NOT_FOUND};
use crate::auth::TenantId;
use crate::error::{ApiError, ErrorBody};
use crate::upstream;

#[derive(Debug, Serialize, ToSchema)]
pub struct UpstreamAnswerView {
    /// 202 or 409.
    pub status: u16,
    /// The generation the track resends under, on 202.
    pub generation: Option<u64>,
    /// The refusal's code, on 409: `before_reset` or `cursor_not_in_epoch` (the feed is read
    /// again), `cursor_ahead` or `reset_pending` (nothing needed), or a code version 1 does not
    /// name, passed on as the upstream sent it (the feed is read again).
    pub refusal: Option<String>,
}

/// What the relay asked for: `rewind` (the upstream was asked to resend from `since`) or
/// `read_feed_again` (the last message the copy took was a reset, or none of events was: no
/// call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RewindPlan {
    Rewind,
    ReadFeedAgain,
}

/// What the relay does after a rewind: `nothing` (the messages that follow bring the copy up
/// to date), `reload_begun` (the feed is read again), or `reload_already_running` (a running
/// reload reads everything again already).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RewindOutcome {
    Nothing,
    ReloadBegun,
    ReloadAlreadyRunning,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RewindView {
    pub track: String,
    pub plan: RewindPlan,
    /// The restore (`relay restored`) the plan was made from, now let go; null when none was
    /// held, and the plan was made from the track as it is.
    pub restore: Option<RestoreView>,
    pub since: Option<String>,
    /// The upstream's answer, when it was asked.
    pub upstream: Option<UpstreamAnswerView>,
    pub outcome: RewindOutcome,
    /// The track's running reload after this call.
    #[schema(value_type = Option<Object>)]
    pub reload: Option<Value>,
}

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

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/tracks/{track}/rewind", tag = "endpoints",
    security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path), ("track" = String, Path, description = "feed")),
    responses(
        (status = 200, body = RewindView, description = "What was asked of the upstream, its \
            answer, and what the relay does about it"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The endpoint is a stories endpoint \
            (field `source`: it catches up by itself), has no upstream URL or key, \
            or its upstream_base_url (or an address its name resolves to) is one the operator's \
            policy refuses (field `upstream_base_url`): nothing was sent"),
        (status = 429, body = ErrorBody, description = "The tenant has \
            RELAY_API_MAX_REWINDS_PER_TENANT rewinds in flight already (or \
            RELAY_API_MAX_REQUESTS_PER_TENANT requests), or all tenants together \
            RELAY_API_MAX_REWINDS: nothing was asked; retry after the Retry-After seconds"),
        (status = 502, body = ErrorBody, description = "The upstream failed, answered a \
            redirect (never followed), did not answer within RELAY_API_REWIND_TIMEOUT_S \
            (`timed out`), or answered what the relay does not take: a body past the largest \
            an answer of one object may be, or past RELAY_UPSTREAM_MAX_ANSWER_BYTES \
            (`too_large`), or JSON it refuses to keep (`invalid`). The detail starts with the \
            failure's kind. Nothing changed"),
    )
)]
pub async fn rewind_track(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path((endpoint_id, track)): Path<(String, String)>,
) -> Result<Json<RewindView>, ApiError> {
    // A rewind waits on the tenant's own upstream: its share of rewinds, and a deadline, keep
    // a slow upstream from holding the connections every tenant shares.
    let deadline = state.envelope.rewind_deadline;
    let _rewinding = state.envelope.rewinds.try_enter(tenant).ok_or_else(|| {
        state
            .metrics
            .throttled
            .with_label_values(&["rewinds"])
            .inc();
        ApiError::TooManyRequests {
            detail: format!(
                "this tenant has {} rewinds in flight already, the most allowed \
                 (RELAY_API_MAX_REWINDS_PER_TENANT); each ends within {} s",
                state.envelope.rewinds.limit(),
                deadline.as_secs_f64()
            ),
            retry_after: deadline,
        }
    })?;
    let _one_of_all = state.envelope.all_rewinds.try_enter(()).ok_or_else(|| {
        state
            .metrics
            .throttled
            .with_label_values(&["all_rewinds"])
            .inc();
        ApiError::TooManyRequests {
            detail: format!(
                "the relay has {} rewinds in flight already, the most it allows at once \
                 (RELAY_API_MAX_REWINDS); each ends within {} s",
                state.envelope.all_rewinds.limit(),
                deadline.as_secs_f64()
            ),
            retry_after: deadline,
        }
    })?;
    let ends_at = tokio::time::Instant::now() + deadline;
    let id = parse_endpoint_id(&endpoint_id)?;
    valid_track(&track)?;
    if track != FEED_TRACK {
        // Version 1 names one track; no row of another is ever kept.
        return Err(ApiError::NotFound("track"));
    }
    let registration = relay_store::endpoints::load_registration(&state.pool, &state.sealing, id)
        .await?
        .filter(|r| r.tenant_id == tenant)
        .ok_or(ENDPOINT_NOT_FOUND)?;
    if registration.source != relay_store::endpoints::Source::Feed {
        return Err(ApiError::conflict(
            Some("source"),
            "a stories endpoint has no feed track to rewind: after a restore it catches up from \
             the cursor the backup kept (GET /v1/events) as soon as its worker starts",
        ));
    }
    let (base_url, api_key) = (
        registration.upstream_base_url,
        registration.upstream_api_key,
    );
    let held = tracks::peek(&state.pool, id).await?;
    let restore = restores::pending(&state.pool, id).await?;

    let plan = restore_plan(&held, restore.as_ref().map(|r| &r.held));
    let (since, answer) = match &plan {
        RestorePlan::Rewind { since } => {
            let (Some(base_url), Some(api_key)) = (
                base_url.as_deref(),
                api_key.as_ref().map(SecretText::expose),
            ) else {
                return Err(ApiError::conflict(
                    Some("upstream_base_url"),
                    "a rewind calls the upstream: set the endpoint's upstream_base_url and \
                     upstream_api_key first",
                ));
            };
            let call = upstream::rewind(&state.http, base_url, api_key, id, &track, since);
            let answer = tokio::time::timeout_at(ends_at, call)
                .await
                .unwrap_or_else(|_| {
                    Err(upstream::UpstreamError::Unreachable {
                        kind: "timeout",
                        detail: format!(
                            "no answer within the rewind's {} s (RELAY_API_REWIND_TIMEOUT_S): \
                             timed out",
                            deadline.as_secs_f64()
                        ),
                    })
                })
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
                        // The kind first (`too_large`, `invalid`, `timeout`, ...), as the
                        // endpoint's state names a failure.
                        e => ApiError::Upstream(format!("{}: {e}", e.kind())),
                    }
                })?;
            (Some(since.clone()), Some(answer))
        }
        RestorePlan::Reload => (None, None),
    };

    // Decided again on the row locked as it is then: a reload that began meanwhile (a reset
    // the sequencer applied since the row was peeked) is left alone rather than replaced.
    let (after, answered) = restores::answered(
        &state.pool,
        tenant,
        id,
        restore.as_ref().map(|r| r.restored_at),
        |track| answer_rewind(track, answer.as_ref(), restore.is_some()),
    )
    .await?;
    let outcome = match (answered.outcome, &answered.track) {
        (relay_rules::RewindOutcome::Nothing, _) => RewindOutcome::Nothing,
        (relay_rules::RewindOutcome::Reload, Some(_)) => RewindOutcome::ReloadBegun,
        (relay_rules::RewindOutcome::Reload, None) => RewindOutcome::ReloadAlreadyRunning,
    };
    let outcome_text = spelling(&outcome);
    state
        .metrics
        .rewinds
        .with_label_values(&[&outcome_text])
        .inc();
    tracing::info!(%tenant, endpoint = %id, track, plan = ?plan, answer = ?answer,
                   restored = restore.is_some(), outcome = outcome_text, "rewind after restore");
    Ok(Json(RewindView {
        track,
        plan: match plan {
            RestorePlan::Rewind { .. } => RewindPlan::Rewind,
            RestorePlan::Reload => RewindPlan::ReadFeedAgain,
        },
        restore: restore.map(RestoreView::from),
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
        outcome,
        reload: reload_json(&after)?,
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

fn reload_json(track: &EndpointTrack) -> Result<Option<Value>, ApiError> {
    track
        .reload
        .as_ref()
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| ApiError::Internal(e.to_string()))
}
