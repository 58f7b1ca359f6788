//! The one call the control plane makes to the upstream's API: a track's rewind
//! (`shared/upstream-api.md`). The answer is turned into relay-rules' [`RewindAnswer`]; what it
//! means is the rules' decision, not this module's.
//!
//! The API key goes only into the request's header. Errors carry the status or the kind of
//! failure, never the URL's query or a header, so none can leak the key into a log or an answer.

use relay_netguard::GuardedClient;
use relay_rules::{RewindAnswer, RewindRefusal};
use reqwest::Method;
use serde::Deserialize;

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
    /// The endpoint's upstream URL, or what its name resolves to, is not where the operator
    /// lets the relay send requests.
    #[error("{0}")]
    Refused(relay_netguard::Refusal),
}

impl UpstreamError {
    /// The failure's name for users and logs: `certificate_<check>`, `connect`, `timeout`,
    /// `request`, `status`, `body`, `refused`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Unreachable { kind, .. } => kind,
            Self::Status { .. } => "status",
            Self::Body { .. } => "body",
            Self::Refused(_) => "refused",
        }
    }
}

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

#[derive(Deserialize)]
struct Accepted {
    generation: u64,
}

#[derive(Deserialize)]
struct Refused {
    error: String,
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
    match status {
        202 => {
            let body: Accepted = response.json().await.map_err(|_| UpstreamError::Body {
                status,
                expected: "{\"generation\": N}",
            })?;
            Ok(RewindAnswer::Accepted {
                generation: body.generation,
            })
        }
        409 => {
            let body: Refused = response.json().await.map_err(|_| UpstreamError::Body {
                status,
                expected: "{\"error\": E}",
            })?;
            Ok(RewindAnswer::Refused(RewindRefusal::parse(&body.error)))
        }
        _ => Err(UpstreamError::Status { status }),
    }
}
