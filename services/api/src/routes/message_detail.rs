//! One stored message as its tenant looks into it: found by its arrival number or by the
//! `webhook-id` it was sent with, with its body, the headers the relay kept, how it was
//! applied, its quarantine row, and the changes its events made. Every query names the tenant:
//! another tenant's message is a 404.

use axum::extract::{Path, State};
use axum::Json;
use relay_store::{changes, endpoints, messages, quarantine};
use serde::Serialize;
use time::OffsetDateTime;
use utoipa::ToSchema;

use super::enums::{stored, EndpointSource};
use super::quarantine::QuarantinedView;
use super::reads::{message_view, MessageView};
use super::{parse_endpoint_id, AppState, ENDPOINT_NOT_FOUND};
use crate::auth::TenantId;
use crate::error::{check_text, ApiError, ErrorBody};

/// The most changes one message's detail lists: a message holds at most the upstream's events
/// per message, each of which writes one change.
const MAX_CHANGES: i64 = relay_wire::limits::MAX_EVENTS as i64;

#[derive(Debug, Serialize, ToSchema)]
pub struct MessageDetail {
    pub message: MessageView,
    /// The delivery headers the relay kept (the signature itself is not kept).
    pub headers: DeliveryHeaders,
    /// The body as received, as text (bytes that are not UTF-8 are replaced).
    pub body: String,
    /// Its quarantine row, when it was ever quarantined under this arrival number.
    pub quarantine: Option<QuarantinedView>,
    /// The changes its events wrote to the endpoint's stream (current epoch, still kept), in
    /// change_seq order. A reload the message asked for writes changes of its own, not listed.
    pub changes: Vec<ChangeView>,
    /// The search for its changes went back through the endpoint's latest changes only (a
    /// bound on the read) and stopped before the message arrived: older changes of it may
    /// exist.
    pub changes_cut: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DeliveryHeaders {
    #[serde(rename = "webhook-id")]
    #[schema(rename = "webhook-id")]
    pub webhook_id: String,
    /// Unix seconds, as signed.
    #[serde(rename = "webhook-timestamp")]
    #[schema(rename = "webhook-timestamp")]
    pub webhook_timestamp: String,
    #[serde(rename = "webhook-attempt")]
    #[schema(rename = "webhook-attempt")]
    pub webhook_attempt: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChangeView {
    /// Its number in the endpoint's stream (the current epoch's).
    pub change_seq: i64,
    /// `item` (the feed's), `story` or `notification`.
    pub kind: String,
    pub operation: String,
    /// The feed item's subject; a story's id.
    pub subject: String,
    pub item_kind: Option<String>,
    pub generation: i64,
    pub sequence: Option<String>,
    pub event_id: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
}

impl From<changes::ChangeSummary> for ChangeView {
    fn from(c: changes::ChangeSummary) -> Self {
        Self {
            change_seq: c.change_seq,
            kind: c.kind,
            operation: c.operation,
            subject: c.subject,
            item_kind: c.item_kind,
            generation: c.generation,
            sequence: c.sequence,
            event_id: c.event_id,
            created_at: c.created_at,
        }
    }
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/messages/{arrival_seq}", tag = "reads",
    security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path), ("arrival_seq" = i64, Path)),
    responses(
        (status = 200, body = MessageDetail),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "No such endpoint, or no such message"),
    )
)]
pub async fn get_message(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path((endpoint_id, arrival_seq)): Path<(String, String)>,
) -> Result<Json<MessageDetail>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    let seq = arrival_seq
        .parse::<i64>()
        .ok()
        .filter(|n| *n >= 1)
        .ok_or_else(|| ApiError::invalid("arrival_seq", "a whole number of 1 or more"))?;
    detail(&state, tenant, id, messages::MessageKey::ArrivalSeq(seq)).await
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/messages/by-webhook-id/{webhook_id}", tag = "reads",
    security(("bearer" = [])),
    params(("endpoint_id" = Uuid, Path),
           ("webhook_id" = String, Path, description = "The webhook-id it was sent with")),
    responses(
        (status = 200, body = MessageDetail),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "No such endpoint, or no such message"),
    )
)]
pub async fn get_message_by_webhook_id(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path((endpoint_id, webhook_id)): Path<(String, String)>,
) -> Result<Json<MessageDetail>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    if webhook_id.is_empty() {
        return Err(ApiError::invalid("webhook_id", "1 or more bytes"));
    }
    check_text("webhook_id", &webhook_id, messages::MAX_WEBHOOK_ID_BYTES)?;
    detail(
        &state,
        tenant,
        id,
        messages::MessageKey::WebhookId(&webhook_id),
    )
    .await
}

async fn detail(
    state: &AppState,
    tenant: relay_store::TenantId,
    id: relay_store::EndpointId,
    key: messages::MessageKey<'_>,
) -> Result<Json<MessageDetail>, ApiError> {
    let endpoint = endpoints::find(&state.pool, tenant, id)
        .await?
        .ok_or(ENDPOINT_NOT_FOUND)?;
    let record = messages::find_with_outcome(&state.pool, tenant, id, key)
        .await?
        .ok_or(ApiError::NotFound("message"))?;
    let bytes = record.body.clone().unwrap_or_default();
    let stories =
        stored::<EndpointSource>("endpoint source", &endpoint.source)? == EndpointSource::Stories;
    let event_ids = event_ids(stories, &bytes);
    let (made, changes_cut) = changes::made_by_events(
        &state.pool,
        tenant,
        id,
        &event_ids,
        record.received_at,
        MAX_CHANGES,
    )
    .await?;
    let quarantined = quarantine::get(&state.pool, tenant, id, record.arrival_seq)
        .await?
        .map(QuarantinedView::try_from)
        .transpose()?;
    let headers = DeliveryHeaders {
        webhook_id: record.webhook_id.clone(),
        webhook_timestamp: record.signed_at.unix_timestamp().to_string(),
        webhook_attempt: record.attempt.map(|a| a.to_string()),
    };
    let mut message = message_view(record)?;
    message.body = None;
    Ok(Json(MessageDetail {
        message,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
        quarantine: quarantined,
        changes: made.into_iter().map(ChangeView::from).collect(),
        changes_cut,
    }))
}

/// The ids of the events a body carries, as the sequencer reads them (none for a body it
/// cannot read: such a message wrote nothing).
fn event_ids(stories: bool, body: &[u8]) -> Vec<String> {
    if stories {
        relay_wire::StoryEvent::parse(body)
            .map(|event| vec![event.event_id])
            .unwrap_or_default()
    } else {
        relay_wire::Message::parse(body)
            .map(|message| message.events.into_iter().map(|e| e.id).collect())
            .unwrap_or_default()
    }
}
