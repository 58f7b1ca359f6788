//! Standard Webhooks signatures, as the wire file's `signature` section describes them.
//!
//! The signed content is `{webhook-id}.{webhook-timestamp}.{body}` over the body's raw bytes as
//! received: parsing and serialising the JSON again would change the bytes. The
//! `webhook-signature` header holds one or more space-separated `v1,<base64 HMAC-SHA256>` entries,
//! one for each secret that signs (several during a rotation); a message is genuine when any entry
//! matches any of the endpoint's secrets. The timestamp must lie within
//! [`TIMESTAMP_TOLERANCE_S`] of the receiver's clock, in either direction.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::limits::TIMESTAMP_TOLERANCE_S;

type HmacSha256 = Hmac<Sha256>;

/// The only signature scheme version 1 of the wire names.
pub const SIGNATURE_VERSION: &str = "v1";
const SECRET_PREFIX: &str = "whsec_";

/// An endpoint's signing secret: the bytes that `whsec_<base64>` decodes to.
///
/// Its `Debug` form never shows the key, so a secret can sit in a struct that gets logged; its
/// memory is wiped when it is dropped (a cache letting an endpoint go leaves no key behind).
#[derive(Clone, PartialEq, Eq, zeroize::ZeroizeOnDrop)]
pub struct SigningSecret {
    key: Vec<u8>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    #[error("a signing secret starts with `whsec_`")]
    MissingPrefix,
    #[error("the part after `whsec_` is not valid base64")]
    NotBase64,
    #[error("a signing secret decodes to at least 16 bytes (this one has {0})")]
    TooShort(usize),
}

impl SigningSecret {
    /// Parses the `whsec_<base64>` form the upstream shows when it creates or rotates a secret.
    pub fn parse(text: &str) -> Result<Self, SecretError> {
        let encoded = text
            .trim()
            .strip_prefix(SECRET_PREFIX)
            .ok_or(SecretError::MissingPrefix)?;
        let key = BASE64.decode(encoded).map_err(|_| SecretError::NotBase64)?;
        Self::from_bytes(key)
    }

    /// Wraps raw key bytes (at least 16: shorter keys are too easy to guess).
    pub fn from_bytes(key: Vec<u8>) -> Result<Self, SecretError> {
        if key.len() < 16 {
            return Err(SecretError::TooShort(key.len()));
        }
        Ok(Self { key })
    }

    /// The key itself, for sealing it at rest.
    pub fn as_bytes(&self) -> &[u8] {
        &self.key
    }

    /// The `whsec_<base64>` form, for showing the secret once.
    pub fn to_whsec(&self) -> String {
        format!("{SECRET_PREFIX}{}", BASE64.encode(&self.key))
    }

    fn mac_over(&self, webhook_id: &str, timestamp: &str, body: &[u8]) -> HmacSha256 {
        let mut mac =
            HmacSha256::new_from_slice(&self.key).expect("HMAC-SHA256 takes a key of any length");
        mac.update(webhook_id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }
}

impl std::fmt::Debug for SigningSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SigningSecret(<redacted>)")
    }
}

/// The three signed headers of a message, as received (header values, not yet checked). A header
/// that is present but not text (visible ASCII) is the caller's to refuse, as
/// [`VerifyError::NotAscii`], before it gets here: it is not missing.
#[derive(Debug, Clone, Copy)]
pub struct SignatureHeaders<'a> {
    pub webhook_id: Option<&'a str>,
    pub webhook_timestamp: Option<&'a str>,
    pub webhook_signature: Option<&'a str>,
}

/// Why a message failed verification. Every variant means: refuse it and store nothing.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VerifyError {
    #[error("the {0} header is missing")]
    MissingHeader(&'static str),
    #[error("the {0} header is not ASCII text")]
    NotAscii(&'static str),
    #[error("the webhook-timestamp header is not a Unix time in seconds")]
    MalformedTimestamp,
    #[error(
        "no v1 signature in the webhook-signature header matches any of the endpoint's secrets"
    )]
    NoMatchingSignature,
    #[error("the endpoint has no active signing secret")]
    NoSecrets,
    #[error("the signature is genuine but its timestamp is {skew_s} s from now, more than the {TIMESTAMP_TOLERANCE_S} s allowed")]
    TimestampOutsideTolerance { skew_s: i64 },
}

/// Verifies a message's signature over its raw body bytes against any of `secrets`, then checks
/// that its timestamp lies within the tolerance of `now_unix_s`.
///
/// The signature is checked before the timestamp so that a stale-timestamp refusal always means
/// "a genuine message, replayed or sent with a skewed clock", which is what an operator needs to
/// know; a forgery is always reported as [`VerifyError::NoMatchingSignature`]. Comparisons are
/// constant-time ([`Mac::verify_slice`]).
///
/// Returns the timestamp (Unix seconds) on success.
///
/// Rules: R-VERIFY, R-VERIFY-RAW (services/rules/RULES.md).
pub fn verify<'s>(
    headers: SignatureHeaders<'_>,
    body: &[u8],
    secrets: impl IntoIterator<Item = &'s SigningSecret>,
    now_unix_s: i64,
) -> Result<i64, VerifyError> {
    let webhook_id = headers
        .webhook_id
        .ok_or(VerifyError::MissingHeader("webhook-id"))?;
    let timestamp_text = headers
        .webhook_timestamp
        .ok_or(VerifyError::MissingHeader("webhook-timestamp"))?;
    let signatures = headers
        .webhook_signature
        .ok_or(VerifyError::MissingHeader("webhook-signature"))?;
    let timestamp = parse_timestamp(timestamp_text)?;
    let mut secrets = secrets.into_iter().peekable();
    if secrets.peek().is_none() {
        return Err(VerifyError::NoSecrets);
    }

    let candidates: Vec<Vec<u8>> = signatures
        .split(' ')
        .filter_map(|entry| entry.split_once(','))
        .filter(|(version, _)| *version == SIGNATURE_VERSION)
        .filter_map(|(_, encoded)| BASE64.decode(encoded).ok())
        .collect();

    let genuine = secrets.any(|secret| {
        let mac = secret.mac_over(webhook_id, timestamp_text, body);
        // Every candidate is checked (no early exit inside one secret) so the time taken does
        // not tell which entry came closest.
        candidates.iter().fold(false, |found, candidate| {
            mac.clone().verify_slice(candidate).is_ok() | found
        })
    });
    if !genuine {
        return Err(VerifyError::NoMatchingSignature);
    }

    let skew_s = now_unix_s.saturating_sub(timestamp);
    if skew_s.abs() > TIMESTAMP_TOLERANCE_S {
        return Err(VerifyError::TimestampOutsideTolerance { skew_s });
    }
    Ok(timestamp)
}

/// Signs a message the way the upstream does: one `v1,` entry for each secret, space-separated,
/// in the order given. Returns the `webhook-signature` header value.
pub fn sign(
    webhook_id: &str,
    timestamp_unix_s: i64,
    body: &[u8],
    secrets: &[SigningSecret],
) -> String {
    let timestamp = timestamp_unix_s.to_string();
    secrets
        .iter()
        .map(|secret| {
            let tag = secret.mac_over(webhook_id, &timestamp, body).finalize();
            format!("{SIGNATURE_VERSION},{}", BASE64.encode(tag.into_bytes()))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn parse_timestamp(text: &str) -> Result<i64, VerifyError> {
    // Digits only: `+12`, ` 12` or `1.5` parse differently in different languages, and the
    // signed content uses the header text exactly, so accept only the one unambiguous form.
    if text.is_empty() || text.len() > 18 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(VerifyError::MalformedTimestamp);
    }
    text.parse().map_err(|_| VerifyError::MalformedTimestamp)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(byte: u8) -> SigningSecret {
        SigningSecret::from_bytes(vec![byte; 32]).unwrap()
    }

    fn headers<'a>(id: &'a str, ts: &'a str, sig: &'a str) -> SignatureHeaders<'a> {
        SignatureHeaders {
            webhook_id: Some(id),
            webhook_timestamp: Some(ts),
            webhook_signature: Some(sig),
        }
    }

    #[test]
    fn whsec_form_round_trips_and_rejects_bad_text() {
        let s = secret(7);
        assert_eq!(SigningSecret::parse(&s.to_whsec()).unwrap(), s);
        assert_eq!(
            SigningSecret::parse("d2ViaG9vay1leGFtcGxl"),
            Err(SecretError::MissingPrefix)
        );
        assert_eq!(
            SigningSecret::parse("whsec_!!!"),
            Err(SecretError::NotBase64)
        );
        assert_eq!(
            SigningSecret::parse("whsec_c2hvcnQ="),
            Err(SecretError::TooShort(5))
        );
    }

    #[test]
    fn debug_never_shows_the_key() {
        assert_eq!(format!("{:?}", secret(1)), "SigningSecret(<redacted>)");
    }

    #[test]
    fn signs_with_every_secret_and_verifies_with_any() {
        let body = br#"{"v":1}"#;
        let sig = sign("msg_1", 1000, body, &[secret(1), secret(2)]);
        assert_eq!(sig.split(' ').count(), 2);
        for held in [secret(1), secret(2)] {
            assert_eq!(
                verify(headers("msg_1", "1000", &sig), body, &[held], 1000),
                Ok(1000)
            );
        }
        assert_eq!(
            verify(headers("msg_1", "1000", &sig), body, &[secret(3)], 1000),
            Err(VerifyError::NoMatchingSignature)
        );
    }

    #[test]
    fn ignores_other_versions_and_garbage_entries() {
        let body = b"{}";
        let good = sign("msg_1", 50, body, &[secret(1)]);
        let b64 = good.strip_prefix("v1,").unwrap();
        let other_version = format!("v1a,{b64}");
        assert_eq!(
            verify(
                headers("msg_1", "50", &other_version),
                body,
                &[secret(1)],
                50
            ),
            Err(VerifyError::NoMatchingSignature)
        );
        let mixed = format!("garbage v2,xyz v1,%%% {good}");
        assert_eq!(
            verify(headers("msg_1", "50", &mixed), body, &[secret(1)], 50),
            Ok(50)
        );
    }

    #[test]
    fn refuses_missing_headers_and_odd_timestamps() {
        let h = SignatureHeaders {
            webhook_id: None,
            webhook_timestamp: Some("1"),
            webhook_signature: Some("v1,x"),
        };
        assert_eq!(
            verify(h, b"", &[secret(1)], 1),
            Err(VerifyError::MissingHeader("webhook-id"))
        );
        for ts in ["", "+5", " 5", "5.0", "-5", "99999999999999999999"] {
            assert_eq!(
                verify(headers("m", ts, "v1,x"), b"", &[secret(1)], 5),
                Err(VerifyError::MalformedTimestamp),
                "timestamp {ts:?}"
            );
        }
        assert_eq!(
            verify(headers("m", "5", "v1,x"), b"", &[], 5),
            Err(VerifyError::NoSecrets)
        );
    }
}
