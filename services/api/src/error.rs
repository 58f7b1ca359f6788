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
use serde::Serialize;
use utoipa::ToSchema;

/// What went wrong with a request.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400: a field of the request (body, path or query) is not acceptable.
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

    fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::Invalid { .. } => (StatusCode::BAD_REQUEST, "invalid_request"),
            ApiError::Unauthorized(_) => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ApiError::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::Conflict { .. } => (StatusCode::CONFLICT, "conflict"),
            ApiError::Upstream(_) => (StatusCode::BAD_GATEWAY, "upstream_failed"),
            ApiError::Unavailable(_) | ApiError::BrokerUnavailable(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
            }
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        match error {
            sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::PoolClosed => {
                ApiError::Unavailable(error)
            }
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

/// The body of every error answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// invalid_request, unauthorized, forbidden, not_found, conflict, upstream_failed,
    /// unavailable or internal.
    pub error: &'static str,
    /// The request field at fault (`secrets[1]`, `upstream_base_url`, `limit`, ...), when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    pub detail: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, error) = self.status_and_code();
        let (field, detail) = match &self {
            ApiError::Invalid { field, detail } => (Some(field.clone()), detail.clone()),
            ApiError::Conflict { field, detail } => (field.clone(), detail.clone()),
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
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
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

/// Parses `bytes` as `T`, naming the field at fault.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let deserializer = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(deserializer).map_err(|error| {
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
}
