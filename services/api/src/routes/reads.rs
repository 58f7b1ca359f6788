//! Reads for the tenant and for support: the endpoint's copy of the feed, one item of it, the
//! endpoint's state (a feed endpoint's tracks or a stories endpoint's sync, apply progress,
//! outbox backlog), and the stored messages with how each was answered and applied.
//!
//! Every query names the tenant as well as the endpoint, and runs only after the endpoint is
//! found to be the tenant's, so another tenant's endpoint is a 404 and never an empty page.

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::Json;
use relay_store::stories::{ReloadStatus, SyncView};
use relay_store::{copy, cursors, endpoints, messages, stories, tracks};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use time::OffsetDateTime;
use utoipa::ToSchema;
use uuid::Uuid;

use super::enums::{spelling, stored, EndpointSource, EndpointStatus};
use super::{
    next_cursor, owned_endpoint, parse_endpoint_id, AppState, QueryArgs, ENDPOINT_NOT_FOUND,
};
use crate::auth::TenantId;
use crate::error::{check_text, ApiError, ErrorBody};

/// What a feed item is: `announcement` or `pre_earnings_analysis` (the first half of its
/// subject, and of its events' type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ItemKind {
    Announcement,
    PreEarningsAnalysis,
}

impl From<ItemKind> for relay_wire::ItemKind {
    fn from(kind: ItemKind) -> Self {
        match kind {
            ItemKind::Announcement => relay_wire::ItemKind::Announcement,
            ItemKind::PreEarningsAnalysis => relay_wire::ItemKind::PreEarningsAnalysis,
        }
    }
}

impl From<relay_wire::ItemKind> for ItemKind {
    fn from(kind: relay_wire::ItemKind) -> Self {
        match kind {
            relay_wire::ItemKind::Announcement => ItemKind::Announcement,
            relay_wire::ItemKind::PreEarningsAnalysis => ItemKind::PreEarningsAnalysis,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CopyItemView {
    pub subject: String,
    /// Null when the row does not say (a tombstone whose subject names no kind).
    pub item_kind: Option<ItemKind>,
    pub company_id: Option<i64>,
    /// The position that wrote the row: the event's (or reload read's) generation and sequence.
    pub generation: i64,
    pub sequence: String,
    /// A removed item, kept so that an older update arriving late cannot bring it back.
    pub tombstone: bool,
    /// `[{part_id, part_version}]`.
    #[schema(value_type = Object)]
    pub parts: Value,
    /// The item's JSON as received; absent for a tombstone.
    #[schema(value_type = Option<Object>)]
    pub item: Option<Value>,
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CopyPage {
    pub data: Vec<CopyItemView>,
    /// Pass as `after` for the next page; absent on the last.
    pub next_cursor: Option<String>,
}

fn copy_view(row: copy::CopyItem) -> Result<CopyItemView, ApiError> {
    let json = |text: &str| {
        serde_json::from_str(text).map_err(|e| ApiError::Internal(format!("stored JSON: {e}")))
    };
    Ok(CopyItemView {
        parts: json(&row.parts)?,
        item: row.item.as_deref().map(json).transpose()?,
        subject: row.subject,
        item_kind: row
            .item_kind
            .as_deref()
            .map(|kind| stored("item kind", kind))
            .transpose()?,
        company_id: row.company_id,
        generation: row.generation,
        sequence: row.sequence,
        tombstone: row.tombstone,
        updated_at: row.updated_at,
    })
}

/// The longest subject a copy item path takes, in bytes (subjects are `kind:id`).
const MAX_SUBJECT_BYTES: usize = 1000;

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/copy", tag = "reads", security(("bearer" = [])),
    params(
        ("endpoint_id" = Uuid, Path),
        ("after" = Option<String>, Query, description = "The last subject of the previous page"),
        ("limit" = Option<i64>, Query, description = "1 to 500, default 100"),
        ("item_kind" = Option<ItemKind>, Query, description = "Only items of this kind"),
        ("company_id" = Option<i64>, Query),
        ("include_tombstones" = Option<bool>, Query, description = "Default false"),
    ),
    responses(
        (status = 200, body = CopyPage, description = "By subject"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn list_copy(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<CopyPage>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    let query = QueryArgs::new(
        query,
        &[
            "after",
            "limit",
            "item_kind",
            "company_id",
            "include_tombstones",
        ],
    )?;
    let limit = query.limit(100, 500)?;
    let item_kind = query
        .one_of::<ItemKind>("item_kind", "announcement or pre_earnings_analysis")?
        .map(relay_wire::ItemKind::from);
    let company_id = query.parsed::<i64>("company_id", "a company id (a whole number)")?;
    let tombstones = query.flag("include_tombstones")?;
    let filter = copy::ItemFilter {
        after: query.text("after"),
        item_kind,
        company_id,
        tombstones,
    };
    owned_endpoint(&state.pool, tenant, id).await?;
    let rows = copy::list_items(&state.pool, tenant, id, &filter, limit).await?;
    let data = rows
        .into_iter()
        .map(copy_view)
        .collect::<Result<Vec<_>, _>>()?;
    let next_cursor = next_cursor(&data, limit, |i| i.subject.clone());
    Ok(Json(CopyPage { data, next_cursor }))
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/copy/{subject}", tag = "reads",
    security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path), ("subject" = String, Path, description = "e.g. announcement:88001")),
    responses(
        (status = 200, body = CopyItemView, description = "The item, or its tombstone"),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn get_copy_item(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path((endpoint_id, subject)): Path<(String, String)>,
) -> Result<Json<CopyItemView>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    check_text("subject", &subject, MAX_SUBJECT_BYTES)?;
    owned_endpoint(&state.pool, tenant, id).await?;
    let row = copy::find_item(&state.pool, tenant, id, &subject).await?;
    Ok(Json(copy_view(row.ok_or(ApiError::NotFound("item"))?)?))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TrackView {
    pub track: String,
    pub generation: Option<i64>,
    pub access_version: Option<String>,
    /// The `through` of the last message of events applied: where a rewind restarts.
    pub through: Option<String>,
    pub last_was_reset: bool,
    pub reload_running: bool,
    /// The running reload (`{generation, access_version, cause}`).
    #[schema(value_type = Option<Object>)]
    pub reload: Option<Value>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub reload_begun_at: Option<OffsetDateTime>,
}

/// How the relay's calls to an endpoint's upstream fare: `needs_settings` (no
/// upstream_base_url or upstream_api_key registered: no call is made), `failing` (the last call
/// failed: it is tried again after a pause that grows with each failure in a row, see
/// `consecutive_failures`), or `ok`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamStatus {
    NeedsSettings,
    Failing,
    Ok,
}

/// How the relay's calls to the endpoint's upstream fare (its reloads, refetches, and a stories
/// endpoint's syncs and reads).
#[derive(Debug, Serialize, ToSchema)]
pub struct UpstreamStateView {
    pub status: UpstreamStatus,
    /// The last failure's name: `certificate_unknown_issuer`, `certificate_name_mismatch`,
    /// `certificate_expired` (and other `certificate_*`), `connect`, `timeout`, `refused` (the
    /// operator's outbound policy), `status` (an unexpected HTTP status), `body` (not JSON),
    /// `too_large` (an answer past RELAY_UPSTREAM_MAX_ANSWER_BYTES, or a reload pass past
    /// RELAY_SEQUENCER_MAX_RELOAD_BYTES: read no further), `invalid` (JSON the relay refuses to
    /// keep: the wrong shape, or a value the checks of webhook messages refuse, such as a
    /// control character in a subject; `last_error` names the field), `store` (Postgres
    /// refused to keep what the upstream answered), `request`, `not_configured`.
    pub last_error_kind: Option<String>,
    /// The last failure with its causes.
    pub last_error: Option<String>,
    /// Calls failed in a row since the last that answered well; 0 when none failed since.
    pub consecutive_failures: i32,
    /// When the calls began failing; null when the last call answered well.
    #[serde(with = "time::serde::rfc3339::option")]
    pub failing_since: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_failure_at: Option<OffsetDateTime>,
    /// When the upstream last answered well after failing (calls that answer well while none
    /// failed are not recorded).
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_success_at: Option<OffsetDateTime>,
}

/// A restore held until the endpoint's rewind is answered: what the backup kept of the feed
/// track, which the rewind starts from whatever messages came since.
#[derive(Debug, Serialize, ToSchema)]
pub struct RestoreView {
    /// The `through` the rewind asks to resend from; null when the backup applied no message
    /// of events (then the feed is read again).
    pub through: Option<String>,
    /// The backup's last message was a reset: the feed is read again, nothing is asked.
    pub last_was_reset: bool,
    #[serde(with = "time::serde::rfc3339")]
    pub restored_at: OffsetDateTime,
}

impl From<relay_store::restores::Restore> for RestoreView {
    fn from(restore: relay_store::restores::Restore) -> Self {
        Self {
            through: restore.held.through,
            last_was_reset: restore.held.last_was_reset,
            restored_at: restore.restored_at,
        }
    }
}

/// Where a stories endpoint's reload in full stands: `running` (begun, not finished), `owed`
/// (needed: a new endpoint, an expired catch-up cursor, a resync; the next sync begins it) or
/// `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StoriesReloadStatus {
    Running,
    Owed,
    None,
}

/// A stories endpoint's reload in full (seed 000's: each ticker's stories listed and saved, the
/// open stories the listing missed read, then catch-up from the window's start).
#[derive(Debug, Serialize, ToSchema)]
pub struct StoriesReloadView {
    pub status: StoriesReloadStatus,
    /// The round of the running reload: its writes name it as their cause in the stream.
    pub round: Option<i64>,
    /// When the last reload in full finished; null: none has.
    #[serde(with = "time::serde::rfc3339::option")]
    pub reloaded_at: Option<OffsetDateTime>,
}

/// A stories endpoint's sync: how its copy was loaded and how far catch-up has read.
#[derive(Debug, Serialize, ToSchema)]
pub struct StoriesStateView {
    /// The copy holds every registered ticker's stories: no reload in full runs or is owed,
    /// and no ticker is loading.
    pub loaded: bool,
    /// The `GET /v1/events` cursor after the last page applied; null: the next catch-up reads
    /// from the window's start.
    pub catch_up_cursor: Option<String>,
    /// When catch-up last read to the end of `GET /v1/events`; null: never.
    #[serde(with = "time::serde::rfc3339::option")]
    pub caught_up_at: Option<OffsetDateTime>,
    pub reload: StoriesReloadView,
    /// Tickers registered whose stories are not loaded yet (the next sync loads them).
    pub tickers_loading: Vec<String>,
    /// Tickers no longer registered whose open stories are not dropped yet.
    pub tickers_dropping: Vec<String>,
    /// Reloads in full and ticker loads or removals begun.
    pub rounds: i64,
    /// Stories owed a read (a fetch-on-notify read that still failed after its tries: the
    /// endpoint's syncs read them again), and since when the oldest is owed.
    pub reads_owed: i64,
    #[serde(with = "time::serde::rfc3339::option")]
    pub reads_owed_since: Option<OffsetDateTime>,
}

impl From<SyncView> for StoriesStateView {
    fn from(sync: SyncView) -> Self {
        let (status, round) = match sync.reload() {
            Some(ReloadStatus::Running(round)) => (StoriesReloadStatus::Running, Some(round)),
            Some(ReloadStatus::Owed) => (StoriesReloadStatus::Owed, None),
            None => (StoriesReloadStatus::None, None),
        };
        Self {
            loaded: status == StoriesReloadStatus::None && sync.tickers_loading.is_empty(),
            catch_up_cursor: sync.cursor,
            caught_up_at: sync.caught_up_at,
            reload: StoriesReloadView {
                status,
                round,
                reloaded_at: sync.reloaded_at,
            },
            tickers_loading: sync.tickers_loading,
            tickers_dropping: sync.tickers_dropping,
            rounds: sync.rounds,
            reads_owed: sync.reads_owed,
            reads_owed_since: sync.reads_owed_since,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct StateView {
    pub endpoint_id: Uuid,
    pub status: EndpointStatus,
    /// Which of `tracks` and `stories` describes the endpoint.
    pub source: EndpointSource,
    /// A feed endpoint's tracks; null for a stories endpoint (it has none).
    pub tracks: Option<Vec<TrackView>>,
    /// A feed endpoint's: true when any track's reload runs; null for a stories endpoint (see
    /// `stories.reload`).
    pub reload_running: Option<bool>,
    /// A stories endpoint's sync; null for a feed endpoint.
    pub stories: Option<StoriesStateView>,
    /// When the endpoint's reload (a feed reload's pass, or a stories endpoint's sync) began
    /// waiting for one of the sequencer's reload slots: its tenant's share of them
    /// (RELAY_SEQUENCER_MAX_TENANT_SHARE of RELAY_SEQUENCER_MAX_CONCURRENT_RELOADS) is held by
    /// its other endpoints, or every slot is, or (while the tenant's upstream reads have been
    /// failing) the slots tenants with failing reads share. Null when it is not waiting (a
    /// reload pausing after a failure holds no slot and waits for none).
    #[serde(with = "time::serde::rfc3339::option")]
    pub reload_waiting_since: Option<OffsetDateTime>,
    /// How long it has waited, in seconds; 0 when it is not waiting.
    pub reload_wait_s: f64,
    /// The arrival number of the last message stored.
    pub last_arrival_seq: i64,
    /// Every message at or below it is applied.
    pub applied_arrival_seq: i64,
    /// Stored messages not yet applied.
    pub messages_waiting: i64,
    /// How long the oldest message waiting has waited, in seconds; 0 when none waits.
    pub apply_lag_s: f64,
    #[serde(with = "time::serde::rfc3339::option")]
    pub oldest_waiting_received_at: Option<OffsetDateTime>,
    /// When the last message applied was received, and when it was applied.
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_applied_received_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_applied_at: Option<OffsetDateTime>,
    /// Changes not yet published.
    pub outbox_backlog: i64,
    /// The epoch of the change stream (1 until a restore of the relay's database begins
    /// another) and the number of the last change appended in it.
    pub change_epoch: i64,
    pub last_change_seq: i64,
    /// The restore of the relay's database still waiting for this endpoint's rewind
    /// (`POST /v1/endpoints/{id}/tracks/feed/rewind`); null when none waits.
    pub restore: Option<RestoreView>,
    /// Messages set aside because they cannot be applied, waiting for a retry or a discard
    /// (`/v1/endpoints/{id}/quarantine`), and the reason of the latest.
    pub messages_quarantined: i64,
    pub last_quarantine_reason: Option<String>,
    pub upstream: UpstreamStateView,
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/state", tag = "reads", security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path)),
    responses(
        (status = 200, body = StateView),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
    )
)]
pub async fn endpoint_state(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
) -> Result<Json<StateView>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    // One snapshot for every figure, so they agree with each other.
    let mut tx = relay_store::read_snapshot(&state.pool).await?;
    let (status, upstream_configured) = endpoints::status_and_settings(&mut *tx, tenant, id)
        .await?
        .ok_or(ENDPOINT_NOT_FOUND)?;
    let stories = stories::sync_view(&mut *tx, tenant, id).await?;
    let tracks = tracks::states(&mut *tx, tenant, id)
        .await?
        .into_iter()
        .map(|row| {
            let reload = row
                .reload
                .as_deref()
                .map(serde_json::from_str::<Value>)
                .transpose()
                .map_err(|e| ApiError::Internal(format!("stored reload: {e}")))?;
            Ok(TrackView {
                track: row.track,
                generation: row.generation,
                access_version: row.access_version,
                through: row.through,
                last_was_reset: row.last_was_reset,
                reload_running: reload.is_some(),
                reload,
                reload_begun_at: row.reload_begun_at,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let progress = cursors::progress(&mut *tx, tenant, id).await?;
    let outbox = cursors::outbox_backlog(&mut *tx, tenant, id).await?;
    let restore = relay_store::restores::pending(&mut *tx, id).await?;
    let (quarantined, quarantine_reason) =
        relay_store::quarantine::summary(&mut *tx, tenant, id).await?;
    let upstream = relay_store::upstream_status::read(&mut *tx, tenant, id).await?;
    let reload_waiting_since =
        relay_store::reload_waits::waiting_since(&mut *tx, tenant, id).await?;
    tx.commit().await?;
    let upstream = UpstreamStateView {
        status: match &upstream {
            _ if !upstream_configured => UpstreamStatus::NeedsSettings,
            Some(recorded) if recorded.failing() => UpstreamStatus::Failing,
            _ => UpstreamStatus::Ok,
        },
        last_error_kind: upstream.as_ref().map(|u| u.last_error_kind.clone()),
        last_error: upstream.as_ref().map(|u| u.last_error.clone()),
        consecutive_failures: upstream.as_ref().map_or(0, |u| u.consecutive_failures),
        failing_since: upstream.as_ref().and_then(|u| u.failing_since),
        last_failure_at: upstream.as_ref().map(|u| u.last_failure_at),
        last_success_at: upstream.as_ref().and_then(|u| u.last_success_at),
    };
    // A stories endpoint has no tracks: its sync says what the feed's tracks would.
    let tracks = stories.is_none().then_some(tracks);
    Ok(Json(StateView {
        endpoint_id: id.0,
        status: stored("endpoint status", &status)?,
        source: if stories.is_some() {
            EndpointSource::Stories
        } else {
            EndpointSource::Feed
        },
        reload_running: tracks
            .as_ref()
            .map(|tracks| tracks.iter().any(|t| t.reload_running)),
        tracks,
        stories: stories.map(StoriesStateView::from),
        reload_waiting_since,
        reload_wait_s: reload_waiting_since.map_or(0.0, |since| {
            (OffsetDateTime::now_utc() - since)
                .as_seconds_f64()
                .max(0.0)
        }),
        last_arrival_seq: progress.last_arrival_seq,
        applied_arrival_seq: progress.applied_arrival_seq,
        messages_waiting: progress.waiting,
        apply_lag_s: progress.lag_s.max(0.0),
        oldest_waiting_received_at: progress.oldest_waiting_received_at,
        last_applied_received_at: progress.last_received_at,
        last_applied_at: progress.last_applied_at,
        outbox_backlog: outbox.backlog,
        change_epoch: outbox.epoch,
        last_change_seq: outbox.last_change_seq,
        restore: restore.map(RestoreView::from),
        messages_quarantined: quarantined,
        last_quarantine_reason: quarantine_reason,
        upstream,
    }))
}

/// How the sequencer took a message it applied. A feed message: `applied` (its events applied),
/// `test` (a test message: nothing to apply), `ignored_track` (a track version 1 does not read),
/// `older_generation` (older than the track's generation), `reload_begun` (a reset: the feed is
/// read again), `reload_superseded` (a reset a later one replaced), `quarantined` (set aside:
/// it can never be applied). A stories message: `applied`, `ignored_type` (an event type the
/// relay does not name), `malformed` (not a stories event: set aside as quarantined),
/// `read_owed` (applied, but a fetch-on-notify read of a story it names failed and is owed).
/// `unrecorded`: applied before outcomes were kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MessageOutcome {
    Applied,
    Test,
    IgnoredTrack,
    OlderGeneration,
    ReloadBegun,
    ReloadSuperseded,
    Quarantined,
    IgnoredType,
    Malformed,
    ReadOwed,
    Unrecorded,
}

impl From<relay_rules::Outcome> for MessageOutcome {
    fn from(outcome: relay_rules::Outcome) -> Self {
        use relay_rules::Outcome;
        match outcome {
            Outcome::Applied => Self::Applied,
            Outcome::Test => Self::Test,
            Outcome::IgnoredTrack => Self::IgnoredTrack,
            Outcome::OlderGeneration => Self::OlderGeneration,
            Outcome::ReloadBegun => Self::ReloadBegun,
            Outcome::ReloadSuperseded => Self::ReloadSuperseded,
            Outcome::Quarantined => Self::Quarantined,
        }
    }
}

impl From<&relay_rules::StoryOutcome> for MessageOutcome {
    fn from(outcome: &relay_rules::StoryOutcome) -> Self {
        use relay_rules::StoryOutcome;
        match outcome {
            StoryOutcome::Applied => Self::Applied,
            StoryOutcome::Ignored => Self::IgnoredType,
            StoryOutcome::Malformed(_) => Self::Malformed,
            StoryOutcome::ReadOwed(_) => Self::ReadOwed,
        }
    }
}

/// What became of a stored message: `waiting` (not applied yet), `applied` (its events applied,
/// or the reload it asked for begun), `ignored` (set aside by the reading rules: another track,
/// an older generation, a superseded reload, a test message, an event type the relay does not
/// name) or `quarantined` (it can never be applied: see the endpoint's quarantine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MessageStatus {
    Waiting,
    Applied,
    Ignored,
    Quarantined,
}

/// Which messages a page lists: those in one status (`waiting`, `applied`, `ignored`,
/// `quarantined`; see MessageStatus), or `duplicate`: those the upstream sent more than once
/// (a repeat of a stored message's webhook-id is answered 200 and counted on the stored
/// message, not stored again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MessageStatusFilter {
    Waiting,
    Applied,
    Ignored,
    Quarantined,
    Duplicate,
}

/// The order of a page of messages: `newest` first (the default) or in `arrival` order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MessageOrder {
    Newest,
    Arrival,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ApplicationView {
    pub outcome: MessageOutcome,
    /// Why a quarantined message cannot be applied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub events_applied: i32,
    pub events_ignored: i32,
    #[serde(with = "time::serde::rfc3339::option")]
    pub applied_at: Option<OffsetDateTime>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MessageView {
    pub arrival_seq: i64,
    pub webhook_id: String,
    #[serde(with = "time::serde::rfc3339")]
    pub signed_at: OffsetDateTime,
    pub attempt: Option<i32>,
    #[serde(with = "time::serde::rfc3339")]
    pub received_at: OffsetDateTime,
    pub track: Option<String>,
    pub generation: Option<i64>,
    pub body_bytes: i32,
    /// How the front tier answered: every stored message was answered 202 once committed (a
    /// repeat of its webhook-id was answered 200 and not stored again).
    pub answered: u16,
    pub status: MessageStatus,
    /// How many times the upstream sent it again after it was stored (each answered 200 and
    /// not stored again), and when last.
    pub duplicates: i32,
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_duplicate_at: Option<OffsetDateTime>,
    /// How the sequencer applied it; absent while it waits.
    pub applied: Option<ApplicationView>,
    /// The raw body, with `include_body=true` (as text; bytes that are not UTF-8 are replaced).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MessagePage {
    pub data: Vec<MessageView>,
    /// Pass as `cursor` for the next page; absent on the last. A search by text (`contains`)
    /// may have one after a page shorter than `limit`, even an empty one.
    pub next_cursor: Option<String>,
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/messages", tag = "reads", security(("bearer" = [])),
    params(
        ("endpoint_id" = Uuid, Path),
        ("order" = Option<MessageOrder>, Query, description = "newest (default) or arrival"),
        ("cursor" = Option<i64>, Query, description = "The next_cursor of the previous page"),
        ("limit" = Option<i64>, Query, description = "1 to 200, default 50"),
        ("include_body" = Option<bool>, Query, description = "Default false"),
        ("status" = Option<MessageStatusFilter>, Query,
         description = "Only messages in this status, or only those sent more than once"),
        ("received_from" = Option<String>, Query,
         description = "Only messages received at or after this time (RFC 3339)"),
        ("received_before" = Option<String>, Query,
         description = "Only messages received before this time (RFC 3339)"),
        ("contains" = Option<String>, Query,
         description = "Only messages whose body holds this text (1 to 200 bytes, case as \
                        given). A page reads at most 2,000 messages from its cursor, so it may \
                        hold fewer rows than `limit`, or none, and still have a next_cursor: \
                        page on while there is one"),
    ),
    responses(
        (status = 200, body = MessagePage),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn list_messages(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<MessagePage>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    let query = QueryArgs::new(
        query,
        &[
            "order",
            "cursor",
            "limit",
            "include_body",
            "status",
            "received_from",
            "received_before",
            "contains",
        ],
    )?;
    let contains = query.text("contains").map(str::to_owned);
    if contains
        .as_ref()
        .is_some_and(|text| text.len() > MAX_CONTAINS_BYTES)
    {
        return Err(ApiError::invalid(
            "contains",
            format!("at most {MAX_CONTAINS_BYTES} bytes"),
        ));
    }
    let status = query.one_of::<MessageStatusFilter>(
        "status",
        "waiting, applied, ignored, quarantined or duplicate",
    )?;
    let (status, duplicated) = match status {
        None => (None, false),
        Some(MessageStatusFilter::Duplicate) => (None, true),
        Some(MessageStatusFilter::Waiting) => (Some(MessageStatus::Waiting), false),
        Some(MessageStatusFilter::Applied) => (Some(MessageStatus::Applied), false),
        Some(MessageStatusFilter::Ignored) => (Some(MessageStatus::Ignored), false),
        Some(MessageStatusFilter::Quarantined) => (Some(MessageStatus::Quarantined), false),
    };
    let instant = |field: &str| {
        query
            .text(field)
            .map(|text| {
                OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
                    .map_err(|_| ApiError::invalid(field, "an RFC 3339 time"))
            })
            .transpose()
    };
    let (received_from, received_before) = (instant("received_from")?, instant("received_before")?);
    let newest_first = query
        .one_of::<MessageOrder>("order", "newest or arrival")?
        .unwrap_or(MessageOrder::Newest)
        == MessageOrder::Newest;
    let cursor = query.parsed::<i64>("cursor", "a cursor from a previous page")?;
    let limit = query.limit(50, 200)?;
    let include_body = query.flag("include_body")?;
    owned_endpoint(&state.pool, tenant, id).await?;
    // A message is applied when the cursor passed it; its row in message_applications says how
    // (a cursor past a message with no row: applied before outcomes were kept).
    let page = messages::MessageQuery {
        newest_first,
        cursor,
        limit,
        include_body,
        status: status.map(|s| spelling(&s)),
        duplicated,
        received_from,
        received_before,
        contains,
    };
    let (rows, next) = messages::list_with_outcomes(&state.pool, tenant, id, &page).await?;
    let next_cursor = next.map(|seq| seq.to_string());
    let data = rows
        .into_iter()
        .map(message_view)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Json(MessagePage { data, next_cursor }))
}

/// The longest text a search of messages' bodies takes.
const MAX_CONTAINS_BYTES: usize = 200;

/// A stored message as its tenant reads it; a status or outcome the API names no value for is
/// an internal error.
pub(super) fn message_view(m: messages::MessageRecord) -> Result<MessageView, ApiError> {
    // A message is applied when the cursor passed it; its outcome, when none was recorded,
    // is that it was applied before outcomes were kept.
    let applied = if m.passed {
        Some(ApplicationView {
            outcome: match m.outcome.as_deref() {
                Some(outcome) => stored("message outcome", outcome)?,
                None => MessageOutcome::Unrecorded,
            },
            reason: m.reason,
            events_applied: m.events_applied.unwrap_or(0),
            events_ignored: m.events_ignored.unwrap_or(0),
            applied_at: m.applied_at,
        })
    } else {
        None
    };
    Ok(MessageView {
        arrival_seq: m.arrival_seq,
        webhook_id: m.webhook_id,
        signed_at: m.signed_at,
        attempt: m.attempt,
        received_at: m.received_at,
        track: m.track,
        generation: m.generation,
        body_bytes: m.body_bytes,
        answered: 202,
        status: stored("message status", &m.status)?,
        duplicates: m.duplicates,
        last_duplicate_at: m.last_duplicate_at,
        applied,
        body: m.body.map(|b| String::from_utf8_lossy(&b).into_owned()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routes::enums::{parse_spelt, spelling};

    #[test]
    fn message_statuses_and_outcomes_are_spelt_as_the_store_and_the_sequencer_write_them() {
        let statuses: Vec<MessageStatus> = messages::MESSAGE_STATUSES
            .iter()
            .map(|text| stored("message status", text).unwrap())
            .collect();
        for (status, text) in statuses.iter().zip(messages::MESSAGE_STATUSES) {
            assert_eq!(spelling(status), text);
            let filter: MessageStatusFilter = parse_spelt(text).unwrap();
            assert_eq!(spelling(&filter), text);
        }
        for outcome in relay_rules::Outcome::ALL {
            let read: MessageOutcome = stored("message outcome", outcome.as_str()).unwrap();
            assert_eq!(read, MessageOutcome::from(outcome));
        }
        use relay_rules::StoryOutcome;
        for outcome in [
            StoryOutcome::Applied,
            StoryOutcome::Ignored,
            StoryOutcome::Malformed(String::new()),
            StoryOutcome::ReadOwed(String::new()),
        ] {
            let read: MessageOutcome = stored("message outcome", outcome.as_str()).unwrap();
            assert_eq!(read, MessageOutcome::from(&outcome));
        }
        assert!(matches!(
            stored::<MessageOutcome>("message outcome", "exploded"),
            Err(ApiError::Internal(_))
        ));
        for kind in relay_wire::ItemKind::ALL {
            let read: ItemKind = stored("item kind", kind.as_str()).unwrap();
            assert_eq!(relay_wire::ItemKind::from(read), kind);
        }
    }
}
