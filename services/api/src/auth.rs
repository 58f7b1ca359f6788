//! JWT bearer auth: HS256 tokens for operators (who manage tenants) and for tenants (who manage
//! their own resources), and the extractors that let a handler run only for the right kind.
//!
//! A tenant handler takes [`TenantId`] and passes it to every query it runs: no handler can read
//! a row without naming its tenant, and a row of another tenant is simply not found.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::ApiError;

/// The shortest signing key taken: HS256 with a key shorter than its 256-bit output is weaker
/// than the algorithm.
pub const MIN_KEY_BYTES: usize = 32;

/// The longest a minted token lives: a tenant's token is a credential, and a shorter life
/// bounds what a leaked one can do.
pub const MAX_TTL: Duration = Duration::from_secs(366 * 86_400);

/// Who a token is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Operator,
    Tenant,
}

/// The token's claims.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// `operator:<name>` or `tenant:<id>`: for logs.
    pub sub: String,
    pub aud: String,
    /// Unix seconds.
    pub exp: i64,
    pub iat: i64,
    pub role: Role,
    /// The tenant a tenant token manages; absent on operator tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<Uuid>,
}

/// Whom to mint a token for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    Operator { name: String },
    Tenant(Uuid),
}

/// The signing key and, during a key rotation, the previous one (verified, never signed with).
#[derive(Clone)]
pub struct JwtKeys {
    signing: Vec<u8>,
    previous: Option<Vec<u8>>,
}

impl std::fmt::Debug for JwtKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtKeys")
            .field("previous", &self.previous.is_some())
            .finish_non_exhaustive()
    }
}

/// A key that cannot sign or verify.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("a JWT signing key is at least {MIN_KEY_BYTES} bytes (this one has {0})")]
    TooShort(usize),
}

impl JwtKeys {
    pub fn new(signing: impl Into<Vec<u8>>) -> Result<Self, KeyError> {
        Ok(Self {
            signing: checked(signing.into())?,
            previous: None,
        })
    }

    /// Also accepts tokens signed with `previous`, so tokens minted before a key rotation keep
    /// working until they expire.
    pub fn with_previous(mut self, previous: impl Into<Vec<u8>>) -> Result<Self, KeyError> {
        self.previous = Some(checked(previous.into())?);
        Ok(self)
    }
}

fn checked(key: Vec<u8>) -> Result<Vec<u8>, KeyError> {
    if key.len() < MIN_KEY_BYTES {
        return Err(KeyError::TooShort(key.len()));
    }
    Ok(key)
}

/// Why a token could not be minted.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("a token's lifetime is 1 s to {} s", MAX_TTL.as_secs())]
    Ttl,
    #[error("an operator's name is 1 to 200 characters")]
    OperatorName,
    #[error("signing the token: {0}")]
    Sign(#[from] jsonwebtoken::errors::Error),
}

/// A minted token and when it expires.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct IssuedToken {
    pub token: String,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: OffsetDateTime,
}

/// Mints a token for `subject` that `audience` accepts until `now + ttl`. Pure but for the
/// signature: the caller owns the clock.
pub fn mint(
    keys: &JwtKeys,
    audience: &str,
    subject: &Subject,
    ttl: Duration,
    now: OffsetDateTime,
) -> Result<IssuedToken, TokenError> {
    if ttl.is_zero() || ttl > MAX_TTL {
        return Err(TokenError::Ttl);
    }
    let (sub, role, tenant) = match subject {
        Subject::Operator { name } => {
            let name = name.trim();
            if name.is_empty() || name.chars().count() > 200 {
                return Err(TokenError::OperatorName);
            }
            (format!("operator:{name}"), Role::Operator, None)
        }
        Subject::Tenant(id) => (format!("tenant:{id}"), Role::Tenant, Some(*id)),
    };
    let expires_at = now + ttl;
    let claims = Claims {
        sub,
        aud: audience.to_owned(),
        exp: expires_at.unix_timestamp(),
        iat: now.unix_timestamp(),
        role,
        tenant,
    };
    let token = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(&keys.signing),
    )?;
    Ok(IssuedToken { token, expires_at })
}

/// Verifies tokens for one audience.
pub struct Verifier {
    keys: JwtKeys,
    audience: String,
    validation: Validation,
}

impl Verifier {
    pub fn new(keys: JwtKeys, audience: &str) -> Self {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_audience(&[audience]);
        validation.set_required_spec_claims(&["exp", "aud"]);
        // Tokens are minted by this service's own clock (or an operator's beside it): a few
        // seconds cover the skew, and an expired token stops working almost at once.
        validation.leeway = 5;
        Self {
            keys,
            audience: audience.to_owned(),
            validation,
        }
    }

    pub fn keys(&self) -> &JwtKeys {
        &self.keys
    }

    pub fn audience(&self) -> &str {
        &self.audience
    }

    /// The claims of a valid token: signed by the signing key or the previous one, unexpired,
    /// for this audience.
    pub fn verify(&self, token: &str) -> Result<Claims, ApiError> {
        let keys = std::iter::once(&self.keys.signing).chain(self.keys.previous.as_ref());
        let mut last = ApiError::Unauthorized("the token is not valid");
        for key in keys {
            match jsonwebtoken::decode::<Claims>(
                token,
                &DecodingKey::from_secret(key),
                &self.validation,
            ) {
                Ok(data) => return Ok(data.claims),
                // Another key may have signed it: try the next.
                Err(e) if *e.kind() == ErrorKind::InvalidSignature => {}
                Err(e) => {
                    last = match e.kind() {
                        ErrorKind::ExpiredSignature => {
                            ApiError::Unauthorized("the token has expired")
                        }
                        ErrorKind::InvalidAudience => {
                            ApiError::Unauthorized("the token is for another audience")
                        }
                        _ => ApiError::Unauthorized("the token is not valid"),
                    };
                    // Only the signature depends on the key: any other failure is final.
                    break;
                }
            }
        }
        Err(last)
    }
}

/// Anything whose state can verify tokens.
pub trait HasVerifier {
    fn verifier(&self) -> &Arc<Verifier>;
}

fn claims_of<S: HasVerifier>(parts: &Parts, state: &S) -> Result<Claims, ApiError> {
    let value = parts
        .headers
        .get(header::AUTHORIZATION)
        .ok_or(ApiError::Unauthorized(
            "an Authorization: Bearer <token> header is required",
        ))?;
    let token = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or(ApiError::Unauthorized(
            "the Authorization header is not `Bearer <token>`",
        ))?;
    state.verifier().verify(token)
}

/// The tenant a tenant token names. Operator tokens are refused (403): an operator manages
/// tenants, not their endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantId(pub relay_store::TenantId);

impl<S: HasVerifier + Send + Sync> FromRequestParts<S> for TenantId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let claims = claims_of(parts, state)?;
        match (claims.role, claims.tenant) {
            (Role::Tenant, Some(tenant)) => Ok(TenantId(relay_store::TenantId(tenant))),
            (Role::Tenant, None) => Err(ApiError::Unauthorized("the token names no tenant")),
            (Role::Operator, _) => Err(ApiError::Forbidden(
                "this route takes a tenant's token, not an operator's",
            )),
        }
    }
}

/// An operator. Tenant tokens are refused (403).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator {
    pub subject: String,
}

impl<S: HasVerifier + Send + Sync> FromRequestParts<S> for Operator {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let claims = claims_of(parts, state)?;
        match claims.role {
            Role::Operator => Ok(Operator {
                subject: claims.sub,
            }),
            Role::Tenant => Err(ApiError::Forbidden(
                "this route takes an operator's token, not a tenant's",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(byte: u8) -> JwtKeys {
        JwtKeys::new(vec![byte; 32]).unwrap()
    }

    #[test]
    fn a_token_verifies_for_its_audience_until_it_expires() {
        let now = OffsetDateTime::now_utc();
        let tenant = Uuid::new_v4();
        let verifier = Verifier::new(keys(1), "relay");
        let ok = mint(
            &keys(1),
            "relay",
            &Subject::Tenant(tenant),
            Duration::from_secs(60),
            now,
        )
        .unwrap();
        let claims = verifier.verify(&ok.token).unwrap();
        assert_eq!((claims.role, claims.tenant), (Role::Tenant, Some(tenant)));

        let expired = mint(
            &keys(1),
            "relay",
            &Subject::Tenant(tenant),
            Duration::from_secs(60),
            now - Duration::from_secs(3600),
        )
        .unwrap();
        assert!(verifier.verify(&expired.token).is_err());
        let other_audience = mint(
            &keys(1),
            "elsewhere",
            &Subject::Tenant(tenant),
            Duration::from_secs(60),
            now,
        )
        .unwrap();
        assert!(verifier.verify(&other_audience.token).is_err());
        let other_key = mint(
            &keys(2),
            "relay",
            &Subject::Tenant(tenant),
            Duration::from_secs(60),
            now,
        )
        .unwrap();
        assert!(verifier.verify(&other_key.token).is_err());
    }

    #[test]
    fn tokens_of_the_previous_key_verify_during_a_rotation() {
        let now = OffsetDateTime::now_utc();
        let old = mint(
            &keys(1),
            "relay",
            &Subject::Operator { name: "ops".into() },
            Duration::from_secs(60),
            now,
        )
        .unwrap();
        let rotated = Verifier::new(keys(2).with_previous(vec![1; 32]).unwrap(), "relay");
        assert_eq!(rotated.verify(&old.token).unwrap().role, Role::Operator);
        assert!(Verifier::new(keys(2), "relay").verify(&old.token).is_err());
    }

    #[test]
    fn short_keys_and_lifetimes_out_of_range_are_refused() {
        assert!(JwtKeys::new(vec![1; 31]).is_err());
        let now = OffsetDateTime::now_utc();
        let subject = Subject::Tenant(Uuid::new_v4());
        assert!(mint(&keys(1), "relay", &subject, Duration::ZERO, now).is_err());
        assert!(mint(&keys(1), "relay", &subject, MAX_TTL * 2, now).is_err());
    }
}
