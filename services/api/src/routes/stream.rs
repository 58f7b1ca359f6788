//! An endpoint's change stream sent again, for a tenant whose consumer lost messages or its
//! whole state:
//! - **replay** sends the endpoint's changes again from a `change_seq` of the current epoch,
//!   under their own message ids (`<endpoint>:<epoch>:<change_seq>`): a consumer that drops
//!   the ids it has seen is unaffected, one that lost them applies them again in order;
//! - **resync** begins a new epoch opened by a snapshot of the copy as it is now
//!   (`snapshot_begin`, one `upsert` per item, `snapshot_end`), after which the live changes
//!   carry on in order: a consumer that lost everything rebuilds the copy from its queue alone
//!   (on a greater epoch it starts over; on `snapshot_begin` it forgets what it held).
//!
//! Both are carried out by the publisher, which gives the tenant up and takes it again (within
//! its lease) to read from the new position.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use relay_store::changes::{self, Replay};
use relay_store::restores::Resync;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::{parse_endpoint_id, AppState, ENDPOINT_NOT_FOUND};
use crate::auth::TenantId;
use crate::error::{ApiError, ErrorBody, JsonBody};

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplayRequest {
    /// The first change to send again, a `change_seq` of the endpoint's current epoch (1 for
    /// all of it).
    pub from_change_seq: i64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReplayView {
    pub webhook_endpoint_id: Uuid,
    /// The epoch whose changes go out again.
    pub epoch: i64,
    pub from_change_seq: i64,
    /// The endpoint's last change when the replay was asked for; later ones follow as usual.
    pub through_change_seq: i64,
}

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/replay", tag = "stream", security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    request_body = ReplayRequest,
    responses(
        (status = 202, body = ReplayView, description = "The changes from `from_change_seq` on \
            go to the tenant's destination again, in order, with their own message ids"),
        (status = 400, body = ErrorBody, description = "`from_change_seq` below 1, past the \
            endpoint's last change, or before the oldest change kept"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn replay(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
    JsonBody(body): JsonBody<ReplayRequest>,
) -> Result<(StatusCode, Json<ReplayView>), ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    if body.from_change_seq < 1 {
        return Err(ApiError::invalid("from_change_seq", "1 or more"));
    }
    match changes::replay(&state.pool, tenant, id, body.from_change_seq).await? {
        None => Err(ENDPOINT_NOT_FOUND),
        Some(Replay::Ahead { epoch, through }) => Err(ApiError::invalid(
            "from_change_seq",
            format!("past the endpoint's last change, {through} of epoch {epoch}"),
        )),
        Some(Replay::Gone { epoch, oldest }) => Err(ApiError::invalid(
            "from_change_seq",
            format!(
                "before the oldest change kept, {oldest} of epoch {epoch} (older ones are \
                 deleted after RELAY_SEQUENCER_CHANGE_RETENTION_DAYS): replay from there, or \
                 resync"
            ),
        )),
        Some(Replay::Replaying {
            epoch,
            from,
            through,
        }) => {
            tracing::info!(%tenant, endpoint = %id, epoch, from, through, "replay asked for");
            Ok((
                StatusCode::ACCEPTED,
                Json(ReplayView {
                    webhook_endpoint_id: id.0,
                    epoch,
                    from_change_seq: from,
                    through_change_seq: through,
                }),
            ))
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ResyncView {
    pub webhook_endpoint_id: Uuid,
    /// The new epoch: its change 1 is `snapshot_begin`.
    pub epoch: i64,
    /// Upserts between `snapshot_begin` and `snapshot_end`: the copy's items.
    pub snapshot_items: i64,
}

#[utoipa::path(
    post, path = "/v1/endpoints/{endpoint_id}/resync", tag = "stream", security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    responses(
        (status = 202, body = ResyncView, description = "A new epoch, opened by a snapshot of \
            the copy, goes to the tenant's destination; the live changes follow it"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The last resync's (or restore's) \
            snapshot is still being sent"),
    )
)]
pub async fn resync(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
) -> Result<(StatusCode, Json<ResyncView>), ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    match relay_store::restores::resync(&state.pool, tenant, id).await? {
        None => Err(ENDPOINT_NOT_FOUND),
        Some(Resync::SnapshotUnsent { epoch }) => Err(ApiError::conflict(
            None,
            format!(
                "epoch {epoch}'s snapshot is still being sent: a consumer rebuilds from it; ask \
                 again once it is"
            ),
        )),
        Some(Resync::Begun {
            epoch,
            snapshot_items,
        }) => {
            tracing::info!(%tenant, endpoint = %id, epoch, items = snapshot_items, "resync begun");
            Ok((
                StatusCode::ACCEPTED,
                Json(ResyncView {
                    webhook_endpoint_id: id.0,
                    epoch,
                    snapshot_items,
                }),
            ))
        }
    }
}
