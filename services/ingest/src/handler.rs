//! `POST /webhooks/{webhook_endpoint_id}`.
//!
//! The checks run in this order, and each refusal stores nothing:
//! 1. a declared Content-Length over the limit: 413, without reading the body;
//! 2. the endpoint: 404 when unknown (and the connection closed after the answer: a client
//!    whose requests name no endpoint has no reason to keep one), 410 when paused (the upstream
//!    then holds its messages until the endpoint is resumed);
//! 3. the body, read up to the limit as it arrives: 413 once it passes it, 408 when it does not
//!    arrive within the listener's body read timeout, 503 with Retry-After when it does not fit
//!    in the process's body budget or its client's share (relay-listener's `BodyBudget`);
//! 4. the signature over the raw bytes with the endpoint's secrets, then the timestamp: 401 (also
//!    for a signed header that is missing or not ASCII text);
//! 5. a webhook-id header of 1 to 256 bytes, and a body that does not name another endpoint in
//!    its `webhook_endpoint_id`: 400;
//! 6. the tenant's quota of messages per second ([`crate::rates`]): 429 with Retry-After past
//!    it, which the upstream honours; only verified messages count against it;
//! 7. stored, committed: 202 (or 200 for a webhook-id stored before).
//!
//! A verified body that is not a v1 message this relay reads (not JSON, a field of v1 in a shape
//! v1 does not have, an unknown `data.type`, a control character in an id) is still stored, as
//! received and with no track, and answered 202 (outcome `accepted_unparsed`): the signature
//! proves the upstream sent it, and refusing it would only make the upstream resend it for a
//! day while the endpoint's stream waits behind it. The sequencer, which reads every stored
//! body again, sets it aside and reloads the endpoint's feed.
//!
//! A stories endpoint's body is one stories event (seed 000), which names no endpoint: the URL's
//! id does. It is verified and stored the same way; one that is not a stories event is stored
//! and answered 202 as above, and the sequencer sets it aside (catch-up reads the event again).
//!
//! If the message cannot be committed within the answer deadline (Postgres down or slow), the
//! answer is 503 with Retry-After: never a 2xx for anything not committed. A 503 says only that
//! the relay is unavailable; what went wrong is logged, never answered.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use relay_store::endpoints::EndpointStatus;
use relay_store::messages::{IncomingMessage, StoreOutcome, MAX_WEBHOOK_ID_BYTES};
use relay_wire::{Message, SignatureHeaders, StoryEvent, VerifyError};
use serde_json::json;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::clock::Clock;
use crate::config::IngestConfig;
use crate::endpoint_cache::EndpointCache;
use crate::metrics::{IngestMetrics, Outcome};
use crate::rates::{TenantRates, Throttled};
use crate::writer::BatchWriter;
use relay_listener::{BodyBudgetSpent, BodyReadTimeout};

pub struct AppState {
    pub config: IngestConfig,
    pub cache: EndpointCache,
    pub writer: BatchWriter,
    pub metrics: Arc<IngestMetrics>,
    pub clock: Arc<dyn Clock>,
    pub rates: TenantRates,
}

/// What a 503 answers, whatever the cause (which goes to the log).
const UNAVAILABLE_DETAIL: &str = "the relay cannot store messages right now; retry later";

/// How a request was answered.
#[derive(Debug)]
enum Answer {
    Accepted,
    /// Verified and stored, but not a v1 message this relay reads.
    /// Why the body is not what the endpoint's source reads.
    AcceptedUnparsed(String),
    Duplicate,
    TooLarge {
        limit: usize,
    },
    UnknownEndpoint,
    Paused,
    BadSignature(VerifyError),
    StaleTimestamp {
        skew_s: i64,
    },
    Malformed(String),
    BodyTimeout(String),
    /// The body did not fit in the body budget (the listener's).
    BodyBudgetSpent,
    /// Past the tenant's quota of messages per second.
    RateLimited(Throttled),
    EndpointMismatch {
        named: Uuid,
    },
    /// The cause is for the log only.
    Unavailable(String),
}

impl Answer {
    fn outcome(&self) -> Outcome {
        match self {
            Answer::Accepted => Outcome::Accepted,
            Answer::AcceptedUnparsed(_) => Outcome::AcceptedUnparsed,
            Answer::Duplicate => Outcome::Duplicate,
            Answer::TooLarge { .. } => Outcome::TooLarge,
            Answer::UnknownEndpoint => Outcome::UnknownEndpoint,
            Answer::Paused => Outcome::Paused,
            Answer::BadSignature(_) => Outcome::BadSignature,
            Answer::StaleTimestamp { .. } => Outcome::StaleTimestamp,
            Answer::Malformed(_) => Outcome::Malformed,
            Answer::BodyTimeout(_) => Outcome::BodyTimeout,
            Answer::BodyBudgetSpent => Outcome::BodyBudgetSpent,
            Answer::RateLimited(_) => Outcome::RateLimited,
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
            Answer::AcceptedUnparsed(error) => {
                let detail = format!("stored, but not a v1 message this relay reads: {error}");
                return (
                    StatusCode::ACCEPTED,
                    Json(json!({"status": outcome, "detail": detail})),
                )
                    .into_response();
            }
            Answer::Duplicate => {
                return (StatusCode::OK, Json(json!({"status": outcome}))).into_response()
            }
            Answer::TooLarge { limit } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is larger than {limit} bytes"),
            ),
            Answer::UnknownEndpoint => {
                let mut response = (
                    StatusCode::NOT_FOUND,
                    Json(json!({"error": outcome,
                        "detail": "no webhook endpoint with this id is registered with the relay"})),
                )
                    .into_response();
                // Nothing this connection sends can be for an endpoint: it goes, and its slot
                // with it.
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                return response;
            }
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
            Answer::BodyTimeout(detail) => (StatusCode::REQUEST_TIMEOUT, detail),
            Answer::EndpointMismatch { named } => (
                StatusCode::BAD_REQUEST,
                format!("the body names webhook endpoint {named}, not the one in the URL"),
            ),
            Answer::BodyBudgetSpent => {
                return retry_later(
                    StatusCode::SERVICE_UNAVAILABLE,
                    outcome,
                    format!("{BodyBudgetSpent}; retry later"),
                    retry_after_s,
                )
            }
            Answer::RateLimited(throttled) => {
                return retry_later(
                    StatusCode::TOO_MANY_REQUESTS,
                    outcome,
                    format!(
                        "this endpoint's tenant may send {} messages a second; send it again \
                         after Retry-After",
                        throttled.messages_per_second
                    ),
                    throttled.retry_after.as_secs_f64().ceil().max(1.0) as u64,
                )
            }
            Answer::Unavailable(_) => {
                let mut response = (
                    StatusCode::SERVICE_UNAVAILABLE,
                    Json(json!({"error": outcome, "detail": UNAVAILABLE_DETAIL})),
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

/// Rules: R-VERIFY, R-STORE (services/rules/RULES.md).
pub async fn receive(
    State(state): State<Arc<AppState>>,
    Path(endpoint_text): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + state.config.answer_deadline;
    let endpoint_id = Uuid::parse_str(&endpoint_text).ok();
    let answer = match tokio::time::timeout_at(
        deadline,
        take_message(&state, endpoint_id, &headers, body, deadline),
    )
    .await
    {
        Ok(answer) => answer,
        Err(_) => Answer::Unavailable("the message could not be stored in time".into()),
    };
    let outcome = answer.outcome();
    let endpoint = LoggedEndpoint {
        id: endpoint_id,
        text: &endpoint_text,
    };
    match &answer {
        Answer::Accepted | Answer::Duplicate => {
            tracing::debug!(%endpoint, outcome = outcome.label(), "answered")
        }
        Answer::AcceptedUnparsed(error) => {
            tracing::warn!(%endpoint, %error, "stored a verified body that is not a v1 message")
        }
        Answer::Unavailable(cause) => {
            tracing::warn!(%endpoint, %cause, "answered 503")
        }
        other => tracing::info!(%endpoint, answer = ?other, "refused"),
    }
    state
        .metrics
        .answered(outcome, started.elapsed().as_secs_f64());
    answer.into_response(state.config.retry_after.as_secs().max(1))
}

/// An error answer the client may try again after `retry_after_s`.
fn retry_later(status: StatusCode, outcome: &str, detail: String, retry_after_s: u64) -> Response {
    let mut response = (status, Json(json!({"error": outcome, "detail": detail}))).into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
    response
}

/// The URL's endpoint id as logs show it: the UUID when it is one; otherwise the decoded text,
/// escaped and cut short, since a path can hold line breaks and terminal escapes (`%0a`,
/// `%1b`) that would forge or garble log lines.
struct LoggedEndpoint<'a> {
    id: Option<Uuid>,
    text: &'a str,
}

impl std::fmt::Display for LoggedEndpoint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const SHOWN_CHARS: usize = 64;
        match self.id {
            Some(id) => write!(f, "{id}"),
            None => {
                let shown: String = self.text.chars().take(SHOWN_CHARS).collect();
                write!(f, "{shown:?}")?;
                if self.text.chars().nth(SHOWN_CHARS).is_some() {
                    f.write_str("...")?;
                }
                Ok(())
            }
        }
    }
}

async fn take_message(
    state: &AppState,
    endpoint_id: Option<Uuid>,
    headers: &HeaderMap,
    body: Body,
    deadline: tokio::time::Instant,
) -> Answer {
    let received_at = state.clock.now();
    let limit = state.config.max_body_bytes;
    // hyper answered 400 to a Content-Length that is not digits (ASCII or not) before this: one
    // here is a number.
    let declared_length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared_length.is_some_and(|len| len > limit as u64) {
        return Answer::TooLarge { limit };
    }

    let Some(endpoint_id) = endpoint_id else {
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
        Err(error) if BodyReadTimeout::is_cause_of(&*error) => {
            return Answer::BodyTimeout(error.to_string())
        }
        Err(error) if BodyBudgetSpent::is_cause_of(&*error) => return Answer::BodyBudgetSpent,
        Err(error) => return Answer::Malformed(format!("the body could not be read: {error}")),
    };
    state.metrics.body_read(body.len());
    // From here to the writer's queue takes the verification's microseconds: a batch being
    // gathered may wait for it (the count ends with this guard, whatever the answer).
    let coming = state.writer.coming();

    let signature_headers = match signature_headers(headers) {
        Ok(signature_headers) => signature_headers,
        Err(error) => return Answer::BadSignature(error),
    };
    let secrets = endpoint.secrets_at(received_at);
    let signed_at = match relay_wire::verify(
        signature_headers,
        &body,
        secrets,
        received_at.unix_timestamp(),
    ) {
        Ok(timestamp) => timestamp,
        Err(VerifyError::TimestampOutsideTolerance { skew_s }) => {
            return Answer::StaleTimestamp { skew_s }
        }
        Err(error) => return Answer::BadSignature(error),
    };
    let webhook_id = signature_headers.webhook_id.unwrap_or_default().to_owned();
    if webhook_id.is_empty() || webhook_id.len() > MAX_WEBHOOK_ID_BYTES {
        return Answer::Malformed(format!("a webhook-id is 1 to {MAX_WEBHOOK_ID_BYTES} bytes"));
    }

    let (track, generation, events, unparsed) = if endpoint.stories {
        // One event per body (seed 000); it names no endpoint: the URL's id does.
        match StoryEvent::parse(&body) {
            Ok(_) => (None, None, Some(1), None),
            Err(error) => (None, None, None, Some(error.to_string())),
        }
    } else {
        match Message::parse(&body) {
            Ok(message) if message.webhook_endpoint_id != endpoint_id => {
                return Answer::EndpointMismatch {
                    named: message.webhook_endpoint_id,
                }
            }
            Ok(message) => (
                message.track.as_ref().map(|t| t.as_str().to_owned()),
                message.generation.map(|g| {
                    i64::try_from(g).expect("Message::parse keeps generations within a bigint")
                }),
                // At most the wire file's max_events (Message::parse refuses more).
                i32::try_from(message.events.len()).ok(),
                None,
            ),
            Err(error) => match named_endpoint(&body) {
                Some(named) if named != endpoint_id => return Answer::EndpointMismatch { named },
                _ => (None, None, None, Some(error.to_string())),
            },
        }
    };

    if let Err(throttled) = state
        .rates
        .admit(relay_store::TenantId(endpoint.tenant_id))
        .await
    {
        return Answer::RateLimited(throttled);
    }

    let incoming = IncomingMessage {
        endpoint_id,
        tenant_id: endpoint.tenant_id,
        webhook_id,
        signed_at: OffsetDateTime::from_unix_timestamp(signed_at).unwrap_or(received_at),
        // For the tenant's listing only: a value that is not a number, ASCII or not, is none.
        attempt: headers
            .get("quanor-webhook-attempt")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok()),
        received_at,
        track,
        generation,
        events,
        body,
    };
    match state.writer.store(incoming, deadline, coming).await {
        Ok(StoreOutcome::Stored { .. }) => match unparsed {
            None => Answer::Accepted,
            Some(error) => Answer::AcceptedUnparsed(error),
        },
        Ok(StoreOutcome::Duplicate) => Answer::Duplicate,
        Ok(StoreOutcome::EndpointPaused) => Answer::Paused,
        Ok(StoreOutcome::EndpointUnknown) => Answer::UnknownEndpoint,
        Err(error) => Answer::Unavailable(error.to_string()),
    }
}

/// The signed headers as text. One that is present but not visible ASCII (what
/// `HeaderValue::to_str` takes) is refused as such, [`VerifyError::NotAscii`], never taken for
/// missing: the upstream did send it.
fn signature_headers(headers: &HeaderMap) -> Result<SignatureHeaders<'_>, VerifyError> {
    let text = |name: &'static str| {
        headers
            .get(name)
            .map(|value| value.to_str().map_err(|_| VerifyError::NotAscii(name)))
            .transpose()
    };
    Ok(SignatureHeaders {
        webhook_id: text("webhook-id")?,
        webhook_timestamp: text("webhook-timestamp")?,
        webhook_signature: text("webhook-signature")?,
    })
}

/// The endpoint a body names in its `webhook_endpoint_id`, read leniently: from any body that is
/// a JSON object holding that field as a UUID, whether or not the rest is a v1 message. A body
/// signed with this endpoint's secret that names another endpoint was sent to the wrong place,
/// and storing it here would hand it to the wrong tenant's copy.
fn named_endpoint(body: &[u8]) -> Option<Uuid> {
    // Only bodies that fail to parse come here, so reading one whole costs the common path
    // nothing.
    let body: serde_json::Value = serde_json::from_slice(body).ok()?;
    Uuid::parse_str(body.get("webhook_endpoint_id")?.as_str()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logged(text: &str) -> String {
        LoggedEndpoint {
            id: Uuid::parse_str(text).ok(),
            text,
        }
        .to_string()
    }

    #[test]
    fn logged_endpoint_ids_cannot_break_or_colour_a_log_line() {
        let id = "8D2F0C39-2B63-4C55-9A8A-3F5B1D7C1E20";
        assert_eq!(logged(id), "8d2f0c39-2b63-4c55-9a8a-3f5b1d7c1e20");
        assert_eq!(
            logged("x\n2026-12-01T00:00:00Z INFO forged\u{1b}[31m"),
            r#""x\n2026-12-01T00:00:00Z INFO forged\u{1b}[31m""#
        );
        let long = "a".repeat(1000);
        assert_eq!(logged(&long), format!("\"{}\"...", "a".repeat(64)));
    }

    #[test]
    fn a_signed_header_that_is_not_ascii_is_refused_as_such_not_as_missing() {
        let mut headers = HeaderMap::new();
        headers.insert("webhook-id", HeaderValue::from_static("msg_1"));
        headers.insert(
            "webhook-signature",
            HeaderValue::from_bytes(b"v1,\xe9").unwrap(),
        );
        let error = signature_headers(&headers).unwrap_err();
        assert_eq!(error, VerifyError::NotAscii("webhook-signature"));
        assert_eq!(
            error.to_string(),
            "the webhook-signature header is not ASCII text"
        );
        headers.remove("webhook-signature");
        let text = signature_headers(&headers).unwrap();
        assert_eq!(text.webhook_id, Some("msg_1"));
        assert_eq!(text.webhook_signature, None);
    }

    #[test]
    fn the_endpoint_a_body_names_is_read_from_any_json_object() {
        let other = Uuid::new_v4();
        let named = |body: serde_json::Value| named_endpoint(body.to_string().as_bytes());
        assert_eq!(
            named(json!({"v": "?", "webhook_endpoint_id": other, "events": 3})),
            Some(other)
        );
        assert_eq!(named(json!({"webhook_endpoint_id": "abc"})), None);
        assert_eq!(named(json!({"webhook_endpoint_id": 5})), None);
        assert_eq!(named(json!([other])), None);
        assert_eq!(named_endpoint(b"{not json"), None);
    }
}
