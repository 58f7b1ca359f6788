//! `POST /webhooks/{webhook_endpoint_id}`.
//!
//! The checks run in this order, and each refusal stores nothing:
//! 1. a declared Content-Length over the limit: 413, without reading the body;
//! 2. the endpoint: 404 when unknown, 410 when paused (the upstream then holds its messages
//!    until the endpoint is resumed);
//! 3. the body, read up to the limit: 413 once it passes it;
//! 4. the signature over the raw bytes with the endpoint's secrets, then the timestamp: 401;
//! 5. the body is a v1 message naming this same endpoint: 400;
//! 6. stored, committed: 202 (or 200 for a webhook-id stored before).
//!
//! If the message cannot be committed within the answer deadline (Postgres down or slow), the
//! answer is 503 with Retry-After: never a 2xx for anything not committed.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use relay_store::endpoints::EndpointStatus;
use relay_store::messages::{IncomingMessage, StoreOutcome};
use relay_wire::{Message, SignatureHeaders, VerifyError};
use serde_json::json;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::clock::Clock;
use crate::config::IngestConfig;
use crate::endpoint_cache::EndpointCache;
use crate::metrics::{IngestMetrics, Outcome};
use crate::writer::BatchWriter;

/// The longest webhook-id stored; the upstream's are `msg_` and 32 hex digits.
const MAX_WEBHOOK_ID_LEN: usize = 256;

pub struct AppState {
    pub config: IngestConfig,
    pub cache: EndpointCache,
    pub writer: BatchWriter,
    pub metrics: Arc<IngestMetrics>,
    pub clock: Arc<dyn Clock>,
}

/// How a request was answered.
#[derive(Debug)]
enum Answer {
    Accepted,
    Duplicate,
    TooLarge { limit: usize },
    UnknownEndpoint,
    Paused,
    BadSignature(VerifyError),
    StaleTimestamp { skew_s: i64 },
    Malformed(String),
    EndpointMismatch { named: Uuid },
    Unavailable(String),
}

impl Answer {
    fn outcome(&self) -> Outcome {
        match self {
            Answer::Accepted => Outcome::Accepted,
            Answer::Duplicate => Outcome::Duplicate,
            Answer::TooLarge { .. } => Outcome::TooLarge,
            Answer::UnknownEndpoint => Outcome::UnknownEndpoint,
            Answer::Paused => Outcome::Paused,
            Answer::BadSignature(_) => Outcome::BadSignature,
            Answer::StaleTimestamp { .. } => Outcome::StaleTimestamp,
            Answer::Malformed(_) => Outcome::Malformed,
            Answer::EndpointMismatch { .. } => Outcome::EndpointMismatch,
            Answer::Unavailable(_) => Outcome::Unavailable,
        }
    }

    fn into_response(self, retry_after_s: u64) -> Response {
        let outcome = self.outcome().label();
        let (status, detail) = match self {
            Answer::Accepted => {
                return (StatusCode::ACCEPTED, Json(json!({"status": outcome}))).into_response()
            }
            Answer::Duplicate => {
                return (StatusCode::OK, Json(json!({"status": outcome}))).into_response()
            }
            Answer::TooLarge { limit } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is larger than {limit} bytes"),
            ),
            Answer::UnknownEndpoint => (
                StatusCode::NOT_FOUND,
                "no webhook endpoint with this id is registered with the relay".to_owned(),
            ),
            Answer::Paused => (
                StatusCode::GONE,
                "this webhook endpoint is paused; resume it to receive messages".to_owned(),
            ),
            Answer::BadSignature(error) => (StatusCode::UNAUTHORIZED, error.to_string()),
            Answer::StaleTimestamp { skew_s } => (
                StatusCode::UNAUTHORIZED,
                VerifyError::TimestampOutsideTolerance { skew_s }.to_string(),
            ),
            Answer::Malformed(detail) => (StatusCode::BAD_REQUEST, detail),
            Answer::EndpointMismatch { named } => (
                StatusCode::BAD_REQUEST,
                format!("the body names webhook endpoint {named}, not the one in the URL"),
            ),
            Answer::Unavailable(detail) => {
                let mut response = (
                    StatusCode::SERVICE_UNAVAILABLE,
                    Json(json!({"error": outcome, "detail": detail})),
                )
                    .into_response();
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
                return response;
            }
        };
        (status, Json(json!({"error": outcome, "detail": detail}))).into_response()
    }
}

pub async fn receive(
    State(state): State<Arc<AppState>>,
    Path(endpoint_text): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + state.config.answer_deadline;
    let answer = match tokio::time::timeout_at(
        deadline,
        take_message(&state, &endpoint_text, &headers, body, deadline),
    )
    .await
    {
        Ok(answer) => answer,
        Err(_) => Answer::Unavailable("the message could not be stored in time".into()),
    };
    let outcome = answer.outcome();
    match &answer {
        Answer::Accepted | Answer::Duplicate => {
            tracing::debug!(endpoint = %endpoint_text, outcome = outcome.label(), "answered")
        }
        Answer::Unavailable(detail) => {
            tracing::warn!(endpoint = %endpoint_text, %detail, "answered 503")
        }
        other => tracing::info!(endpoint = %endpoint_text, answer = ?other, "refused"),
    }
    state
        .metrics
        .answered(outcome, started.elapsed().as_secs_f64());
    answer.into_response(state.config.retry_after.as_secs().max(1))
}

async fn take_message(
    state: &AppState,
    endpoint_text: &str,
    headers: &HeaderMap,
    body: Body,
    deadline: tokio::time::Instant,
) -> Answer {
    let received_at = state.clock.now();
    let limit = state.config.max_body_bytes;
    let declared_length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared_length.is_some_and(|len| len > limit as u64) {
        return Answer::TooLarge { limit };
    }

    let Ok(endpoint_id) = Uuid::parse_str(endpoint_text) else {
        return Answer::UnknownEndpoint;
    };
    let endpoint = match state.cache.get(endpoint_id).await {
        Ok(Some(endpoint)) => endpoint,
        Ok(None) => return Answer::UnknownEndpoint,
        Err(error) => {
            return Answer::Unavailable(format!("the endpoint could not be looked up: {error}"))
        }
    };
    if endpoint.status == EndpointStatus::Paused {
        return Answer::Paused;
    }

    let body = match Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<LengthLimitError>() => return Answer::TooLarge { limit },
        Err(error) => return Answer::Malformed(format!("the body could not be read: {error}")),
    };
    state.metrics.body_read(body.len());

    let header_text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let signature_headers = SignatureHeaders {
        webhook_id: header_text("webhook-id"),
        webhook_timestamp: header_text("webhook-timestamp"),
        webhook_signature: header_text("webhook-signature"),
    };
    let secrets = endpoint.secrets_at(received_at);
    let signed_at = match relay_wire::verify(
        signature_headers,
        &body,
        &secrets,
        received_at.unix_timestamp(),
    ) {
        Ok(timestamp) => timestamp,
        Err(VerifyError::TimestampOutsideTolerance { skew_s }) => {
            return Answer::StaleTimestamp { skew_s }
        }
        Err(error) => return Answer::BadSignature(error),
    };
    let webhook_id = signature_headers.webhook_id.unwrap_or_default().to_owned();
    if webhook_id.is_empty() || webhook_id.len() > MAX_WEBHOOK_ID_LEN {
        return Answer::Malformed(format!("a webhook-id is 1 to {MAX_WEBHOOK_ID_LEN} bytes"));
    }

    let message = match Message::parse(&body) {
        Ok(message) => message,
        Err(error) => return Answer::Malformed(format!("not a v1 webhook message: {error}")),
    };
    if message.webhook_endpoint_id != endpoint_id {
        return Answer::EndpointMismatch {
            named: message.webhook_endpoint_id,
        };
    }
    let Some(generation) = message.generation.map(i64::try_from).transpose().ok() else {
        return Answer::Malformed("generation is out of range".into());
    };

    let incoming = IncomingMessage {
        endpoint_id,
        tenant_id: endpoint.tenant_id,
        webhook_id,
        signed_at: OffsetDateTime::from_unix_timestamp(signed_at).unwrap_or(received_at),
        attempt: header_text("quanor-webhook-attempt").and_then(|v| v.parse().ok()),
        received_at,
        track: message.track.as_ref().map(|t| t.as_str().to_owned()),
        generation,
        body,
    };
    match state.writer.store(incoming, deadline).await {
        Ok(StoreOutcome::Stored { .. }) => Answer::Accepted,
        Ok(StoreOutcome::Duplicate) => Answer::Duplicate,
        Ok(StoreOutcome::EndpointPaused) => Answer::Paused,
        Ok(StoreOutcome::EndpointUnknown) => Answer::UnknownEndpoint,
        Err(error) => Answer::Unavailable(error.to_string()),
    }
}
