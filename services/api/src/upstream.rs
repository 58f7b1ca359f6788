//! The one call the control plane makes to the upstream's API: a track's rewind
//! (`shared/upstream-api.md`). The answer is turned into relay-rules' [`RewindAnswer`]; what it
//! means is the rules' decision, not this module's.
//!
//! The API key goes only into the request's header. Errors carry the status or the kind of
//! failure, never the URL's query or a header, so none can leak the key into a log or an answer.
//!
//! The answer is bounded and checked as the sequencer's reads are: its body read up to the
//! wire file's largest body (and never past `RELAY_UPSTREAM_MAX_ANSWER_BYTES`), parsed against
//! a memory budget, its generation within a bigint and its refusal code free of control
//! characters (relay-wire's `answer` module).

use relay_netguard::{BodyError, GuardedClient};
use relay_rules::{RewindAnswer, RewindRefusal};
use relay_wire::answer::{self, AnswerError};
use reqwest::Method;

/// The rewind call failed: no answer version 1 describes.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No answer: `kind` names why (`certificate_unknown_issuer`, `connect`, `timeout`, ...),
    /// `detail` is the whole chain of causes.
    #[error("the upstream could not be reached ({kind}): {detail}")]
    Unreachable { kind: &'static str, detail: String },
    #[error("the upstream answered {status}")]
    Status { status: u16 },
    #[error("the upstream answered {status} with a body that is not {expected}")]
    Body { status: u16, expected: &'static str },
    /// The answer is larger than the relay reads: nothing of it is taken.
    #[error("the upstream answered {status} with too much: {detail}")]
    TooLarge { status: u16, detail: String },
    /// JSON the relay refuses to keep (a generation past a bigint, a control character in the
    /// refusal's code), naming the field.
    #[error("the upstream answered {status} with {detail}")]
    Invalid { status: u16, detail: String },
    /// The endpoint's upstream URL, or what its name resolves to, is not where the operator
    /// lets the relay send requests.
    #[error("{0}")]
    Refused(relay_netguard::Refusal),
}

impl UpstreamError {
    /// The failure's name for users and logs: `certificate_<check>`, `connect`, `timeout`,
    /// `request`, `status`, `body`, `too_large`, `invalid`, `refused`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Unreachable { kind, .. } => kind,
            Self::Status { .. } => "status",
            Self::Body { .. } => "body",
            Self::TooLarge { .. } => "too_large",
            Self::Invalid { .. } => "invalid",
            Self::Refused(_) => "refused",
        }
    }
}

/// The most of a rewind's answer read: as every answer of one object, the wire file's largest
/// body (its one field needs far less).
const MAX_REWIND_ANSWER_BYTES: u64 = relay_wire::limits::MAX_BODY_BYTES as u64;

fn unreachable(error: &reqwest::Error) -> UpstreamError {
    let kind = match relay_netguard::certificate_failure(error) {
        Some(failure) => failure.kind(),
        None if error.is_timeout() => "timeout",
        None if error.is_connect() => "connect",
        None => "request",
    };
    UpstreamError::Unreachable {
        kind,
        detail: relay_netguard::error_chain(error),
    }
}

/// What an answer refused by relay-wire's checks is, as this call's failure.
fn refused(status: u16, expected: &'static str, error: AnswerError) -> UpstreamError {
    match error.kind() {
        "body" => UpstreamError::Body { status, expected },
        "too_large" => UpstreamError::TooLarge {
            status,
            detail: error.to_string(),
        },
        _ => UpstreamError::Invalid {
            status,
            detail: error.to_string(),
        },
    }
}

/// `POST {base_url}/v1/webhook-endpoints/{endpoint}/tracks/{track}/rewind` with `{"since"}`.
/// `track` must already be a plain name (checked by the caller): it goes into the path.
pub async fn rewind(
    client: &GuardedClient,
    base_url: &str,
    api_key: &str,
    endpoint: relay_store::EndpointId,
    track: &str,
    since: &str,
) -> Result<RewindAnswer, UpstreamError> {
    let url = format!(
        "{}/v1/webhook-endpoints/{endpoint}/tracks/{track}/rewind",
        base_url.trim_end_matches('/')
    );
    let response = client
        .request(Method::POST, &url)
        .map_err(UpstreamError::Refused)?
        .bearer_auth(api_key)
        .json(&serde_json::json!({ "since": since }))
        .send()
        .await
        .map_err(|e| match relay_netguard::refusal_in(&e) {
            Some(refusal) => UpstreamError::Refused(refusal.clone()),
            // without_url: the error's text then names the failure, not where it happened.
            None => unreachable(&e.without_url()),
        })?;
    let status = response.status().as_u16();
    let expected = match status {
        202 => "{\"generation\": N}",
        409 => "{\"error\": E}",
        _ => return Err(UpstreamError::Status { status }),
    };
    let body = client
        .read_body_within(response, MAX_REWIND_ANSWER_BYTES)
        .await
        .map_err(|error| match error {
            BodyError::TooLarge { .. } => UpstreamError::TooLarge {
                status,
                detail: error.to_string(),
            },
            BodyError::Read(cause) => unreachable(&cause.without_url()),
        })?;
    let json = answer::parse(&body, 2 * MAX_REWIND_ANSWER_BYTES)
        .map_err(|error| refused(status, expected, error))?
        .value;
    if status == 202 {
        let generation =
            answer::rewind_generation(&json).map_err(|e| refused(status, expected, e))?;
        Ok(RewindAnswer::Accepted { generation })
    } else {
        let code = answer::rewind_refusal(&json).map_err(|e| refused(status, expected, e))?;
        Ok(RewindAnswer::Refused(RewindRefusal::parse(&code)))
    }
}
