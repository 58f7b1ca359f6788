//! The API's one error type, what each becomes on the wire, and the JSON body extractor that
//! names the field a bad request got wrong.
//!
//! Only a code, the field and a short detail reach a client. Internal errors are logged here with
//! their `Display` (never `Debug`: a Postgres error's debug form carries the row's values, and a
//! unique violation on `endpoint_secrets` would print the secret).

use axum::extract::{FromRequest, Request};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// What went wrong with a request.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400: a field of the request (body, path or query) is not acceptable: its shape, its
    /// value, a control character or its length (every text field is checked before it reaches
    /// Postgres).
    #[error("{field}: {detail}")]
    Invalid { field: String, detail: String },
    /// 401: no token, or one that does not verify, has expired or is for another audience.
    #[error("unauthorized: {0}")]
    Unauthorized(&'static str),
    /// 403: a valid token of the wrong kind (operator where a tenant's is required, or the
    /// reverse).
    #[error("forbidden: {0}")]
    Forbidden(&'static str),
    /// 404: no such resource for this caller. Another tenant's resource is "no such resource":
    /// the detail never names it.
    #[error("no such {0}")]
    NotFound(&'static str),
    /// 409: the request conflicts with what is stored.
    #[error("{detail}")]
    Conflict {
        field: Option<String>,
        detail: String,
    },
    /// 429: the caller has as many requests of this kind in flight as it may (its share of the
    /// control plane); nothing was done. Answered with Retry-After, and the connection closed
    /// so that a refused caller holds none of the listener's connections.
    #[error("too many requests: {detail}")]
    TooManyRequests {
        detail: String,
        retry_after: std::time::Duration,
    },
    /// 502: the upstream's API failed or answered something version 1 does not describe.
    #[error("upstream: {0}")]
    Upstream(String),
    /// 503: Postgres is unreachable or too slow.
    #[error("database unavailable: {0}")]
    Unavailable(#[source] sqlx::Error),
    /// 503: the relay's broker (its management API, or its name) failed the request.
    #[error("broker unavailable: {0}")]
    BrokerUnavailable(String),
    /// 500: anything else.
    #[error("internal: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn invalid(field: impl Into<String>, detail: impl Into<String>) -> Self {
        ApiError::Invalid {
            field: field.into(),
            detail: detail.into(),
        }
    }

    pub fn conflict(field: Option<&str>, detail: impl Into<String>) -> Self {
        ApiError::Conflict {
            field: field.map(str::to_owned),
            detail: detail.into(),
        }
    }

    fn status_and_code(&self) -> (StatusCode, ErrorCode) {
        match self {
            ApiError::Invalid { .. } => (StatusCode::BAD_REQUEST, ErrorCode::InvalidRequest),
            ApiError::Unauthorized(_) => (StatusCode::UNAUTHORIZED, ErrorCode::Unauthorized),
            ApiError::Forbidden(_) => (StatusCode::FORBIDDEN, ErrorCode::Forbidden),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, ErrorCode::NotFound),
            ApiError::Conflict { .. } => (StatusCode::CONFLICT, ErrorCode::Conflict),
            ApiError::TooManyRequests { .. } => {
                (StatusCode::TOO_MANY_REQUESTS, ErrorCode::TooManyRequests)
            }
            ApiError::Upstream(_) => (StatusCode::BAD_GATEWAY, ErrorCode::UpstreamFailed),
            ApiError::Unavailable(_) | ApiError::BrokerUnavailable(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, ErrorCode::Unavailable)
            }
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, ErrorCode::Internal),
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        match error {
            ref lost if relay_store::connection_lost(lost) => ApiError::Unavailable(error),
            // query_canceled: the statement_timeout ended it. Postgres is too slow, not wrong.
            sqlx::Error::Database(ref db) if db.code().as_deref() == Some("57014") => {
                ApiError::Unavailable(error)
            }
            // Display only: see the module's comment.
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl From<relay_store::StoreError> for ApiError {
    fn from(error: relay_store::StoreError) -> Self {
        match error {
            relay_store::StoreError::Database(e) => e.into(),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

/// What kind of error an answer is. From the routes: `invalid_request` (400: a field is not
/// acceptable; `field` names it), `unauthorized` (401), `forbidden` (403), `not_found` (404),
/// `conflict` (409), `too_many_requests` (429, with Retry-After), `upstream_failed` (502),
/// `unavailable` (503: Postgres or the relay's broker), `internal` (500). From the listener,
/// before any route (see the API's description): `body_timeout` (408), `too_many_connections`
/// (503) and `body_budget_spent` (503).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    InvalidRequest,
    Unauthorized,
    Forbidden,
    NotFound,
    Conflict,
    TooManyRequests,
    UpstreamFailed,
    Unavailable,
    Internal,
    BodyTimeout,
    TooManyConnections,
    BodyBudgetSpent,
}

/// The body of every error answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorCode,
    /// The request field at fault (`secrets[1]`, `upstream_base_url`, `limit`, ...), when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    pub detail: String,
}

/// How long a 503 of the database or the broker asks the caller to wait: a restart or a
/// failover takes seconds.
const UNAVAILABLE_RETRY_AFTER_S: u64 = 1;

/// Marks an answer given because the request's database connection was lost: a read may be
/// asked again on a fresh connection (`crate::retry`).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLost;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, error) = self.status_and_code();
        let (field, detail) = match &self {
            ApiError::Invalid { field, detail } => (Some(field.clone()), detail.clone()),
            ApiError::Conflict { field, detail } => (field.clone(), detail.clone()),
            ApiError::TooManyRequests { detail, .. } => (None, detail.clone()),
            ApiError::Unauthorized(d) | ApiError::Forbidden(d) => (None, (*d).to_owned()),
            ApiError::NotFound(what) => (None, format!("no such {what}")),
            ApiError::Upstream(detail) => (None, detail.clone()),
            ApiError::Unavailable(e) => {
                tracing::warn!(error = %e, "database unavailable");
                (None, "the database is unavailable; try again".to_owned())
            }
            ApiError::BrokerUnavailable(e) => {
                tracing::warn!(error = %e, "broker unavailable");
                (
                    None,
                    "the relay's broker is unavailable; try again".to_owned(),
                )
            }
            ApiError::Internal(e) => {
                tracing::error!(error = %e, "internal error");
                (None, "internal error".to_owned())
            }
        };
        let mut response = (
            status,
            Json(ErrorBody {
                error,
                field,
                detail,
            }),
        )
            .into_response();
        let headers = response.headers_mut();
        if status == StatusCode::UNAUTHORIZED {
            headers.insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        if matches!(
            self,
            ApiError::Unavailable(_) | ApiError::BrokerUnavailable(_)
        ) {
            headers.insert(
                header::RETRY_AFTER,
                header::HeaderValue::from(UNAVAILABLE_RETRY_AFTER_S),
            );
        }
        if let ApiError::TooManyRequests { retry_after, .. } = &self {
            // Whole seconds, rounded up: sooner would only be refused again.
            let seconds = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
            headers.insert(
                header::RETRY_AFTER,
                header::HeaderValue::from(seconds.max(1)),
            );
            headers.insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
        }
        if matches!(&self, ApiError::Unavailable(error) if relay_store::connection_lost(error)) {
            response.extensions_mut().insert(ConnectionLost);
        }
        response
    }
}

/// A JSON body whose errors name the field: `secrets[1]: expected a string`. Unknown fields are
/// refused by the request types themselves (`deny_unknown_fields`), so a misspelt field is an
/// error rather than silently ignored.
pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|e| ApiError::invalid("body", e.body_text()))?;
        // An empty body is an empty object: routes whose fields are all optional (`expire`,
        // `tokens`) can then be called with no body at all.
        let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
            b"{}"
        } else {
            &bytes
        };
        parse_json(bytes).map(JsonBody)
    }
}

/// The longest text any field of a request takes, in bytes. Fields with a shorter bound of their
/// own (names, URLs, keys) check it too; this one keeps every value well under what a Postgres
/// index row holds, whatever the field.
pub const MAX_TEXT_BYTES: usize = 4096;

/// Refuses text no field of the API takes: control characters (NUL, which Postgres cannot
/// store in a text column; line breaks and ESC, which would forge or colour log lines) and more
/// than `max_bytes`. The error names `field`, never the value.
pub fn check_text(field: &str, text: &str, max_bytes: usize) -> Result<(), ApiError> {
    if text.len() > max_bytes {
        return Err(ApiError::invalid(
            field,
            format!("at most {max_bytes} bytes"),
        ));
    }
    if text.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            field,
            "no control characters (NUL, line breaks, escapes)",
        ));
    }
    Ok(())
}

/// [`check_text`] on every string of a JSON value, naming each by its path as
/// `serde_path_to_error` does (`secrets[1]`, `a.b`).
fn check_strings(value: &serde_json::Value, path: &str) -> Result<(), ApiError> {
    use serde_json::Value;
    let field = |path: &str| {
        if path.is_empty() {
            "body".to_owned()
        } else {
            path.to_owned()
        }
    };
    match value {
        Value::String(text) => check_text(&field(path), text, MAX_TEXT_BYTES),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, item)| check_strings(item, &format!("{path}[{i}]"))),
        Value::Object(fields) => fields.iter().try_for_each(|(name, item)| {
            // A name is echoed as the field of an "unknown field" error: it must be as clean
            // as a value.
            check_text(&field(path), name, 200)?;
            let path = if path.is_empty() {
                name.clone()
            } else {
                format!("{path}.{name}")
            };
            check_strings(item, &path)
        }),
        Value::Null | Value::Bool(_) | Value::Number(_) => Ok(()),
    }
}

/// Parses `bytes` as `T`, naming the field at fault: first every string is checked
/// ([`check_text`]), then the shape.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|error| ApiError::invalid("body", scrub(&error.to_string())))?;
    check_strings(&value, "")?;
    serde_path_to_error::deserialize(value).map_err(|error| {
        let path = error.path().to_string();
        let message = error.into_inner().to_string();
        // "." is the root; "?" a place the parser never reached a field of (broken JSON).
        let field = if path == "." || path == "?" {
            // Missing and unknown fields are reported at the object that lacks or has them.
            quoted_name(&message)
                .map(str::to_owned)
                .unwrap_or_else(|| "body".to_owned())
        } else {
            path
        };
        ApiError::invalid(field, scrub(&message))
    })
}

/// The field name serde quotes in "missing field `x`" and "unknown field `x`".
fn quoted_name(message: &str) -> Option<&str> {
    if !(message.starts_with("missing field") || message.starts_with("unknown field")) {
        return None;
    }
    let start = message.find('`')? + 1;
    let len = message[start..].find('`')?;
    Some(&message[start..start + len])
}

/// serde's "invalid type: string \"whsec_...\", expected ..." repeats the value it was given,
/// which may be a secret sent in the wrong place: keep only what was expected, and drop the
/// position (the field already says where).
fn scrub(message: &str) -> String {
    let message = match message.find(" at line ") {
        Some(at) => &message[..at],
        None => message,
    };
    if message.starts_with("invalid type") || message.starts_with("invalid value") {
        if let Some(at) = message.find(", expected ") {
            return format!("expected {}", &message[at + ", expected ".len()..]);
        }
        return "invalid value".to_owned();
    }
    if message.starts_with("unknown variant") {
        if let Some(at) = message.find(", expected ") {
            return format!(
                "unknown value, expected {}",
                &message[at + ", expected ".len()..]
            );
        }
    }
    message.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Body {
        name: String,
        secrets: Vec<String>,
    }

    fn field_of(json: &str) -> (String, String) {
        match parse_json::<Body>(json.as_bytes()) {
            Err(ApiError::Invalid { field, detail }) => (field, detail),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn errors_name_the_field_and_never_repeat_the_value() {
        assert_eq!(field_of(r#"{"secrets": []}"#).0, "name");
        assert_eq!(field_of(r#"{"name": "a", "secrets": [], "x": 1}"#).0, "x");
        let (field, detail) = field_of(r#"{"name": "a", "secrets": ["ok", 5]}"#);
        assert_eq!(field, "secrets[1]");
        assert!(detail.contains("expected a string"), "{detail}");
        let (field, detail) = field_of(r#"{"name": "a", "secrets": "whsec_c2VjcmV0"}"#);
        assert_eq!(field, "secrets");
        assert!(!detail.contains("whsec_"), "{detail}");
        assert_eq!(field_of("{").0, "body");
    }

    #[test]
    fn control_characters_and_oversized_text_are_refused_by_field() {
        let (field, detail) = field_of("{\"name\": \"a\\u0000b\", \"secrets\": []}");
        assert_eq!(field, "name");
        assert!(detail.contains("control"), "{detail}");
        let (field, _) = field_of("{\"name\": \"a\", \"secrets\": [\"ok\", \"x\\u001b[31m\"]}");
        assert_eq!(field, "secrets[1]");
        let (field, _) = field_of("{\"name\": \"a\\nforged\", \"secrets\": []}");
        assert_eq!(field, "name");
        let long = "s".repeat(MAX_TEXT_BYTES + 1);
        let (field, detail) = field_of(&format!(r#"{{"name": "a", "secrets": ["{long}"]}}"#));
        assert_eq!(field, "secrets[0]");
        assert!(detail.contains("at most"), "{detail}");
        assert!(!detail.contains(&long[..10]), "{detail}");
        let (field, _) = field_of("{\"na\\u0000me\": \"a\", \"secrets\": []}");
        assert_eq!(field, "body");
    }
}
