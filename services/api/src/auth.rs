//! JWT bearer auth: HS256 tokens for operators (who manage tenants) and for tenants (who manage
//! their own resources), and the extractors that let a handler run only for the right kind.
//!
//! A tenant handler takes [`TenantId`] and passes it to every query it runs: no handler can read
//! a row without naming its tenant, and a row of another tenant is simply not found.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
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
    previous: Option<PreviousKey>,
}

/// The key signing before a rotation, and when the rotation began.
#[derive(Clone)]
struct PreviousKey {
    key: Vec<u8>,
    rotation: Rotation,
}

/// A key rotation: when the new key began signing, and how long the previous key keeps
/// verifying after that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    pub started_at: OffsetDateTime,
    pub overlap: Duration,
}

impl Rotation {
    /// When the previous key stops verifying altogether.
    pub fn ends_at(&self) -> OffsetDateTime {
        self.started_at + self.overlap
    }

    /// Whether a token the previous key signed, issued at `iat` (Unix seconds), is taken at
    /// `now`: only one issued before the rotation began, and only until the overlap ends.
    ///
    /// `iat` is the token's own word: whoever holds the previous key (a leaked key is the
    /// usual reason to rotate) can write any `iat` into a token it signs, back-dated to before
    /// the rotation. The `iat` check stops the relay's own tools that still sign with the old
    /// key by mistake; only the end of the overlap stops a holder of a leaked key, so keep the
    /// overlap as short as the tokens handed out allow.
    pub fn accepts(&self, iat: i64, now: OffsetDateTime) -> Result<(), &'static str> {
        if now >= self.ends_at() {
            return Err("the token is signed with the previous key, which no longer verifies");
        }
        if iat >= self.started_at.unix_timestamp() {
            return Err(
                "the token is signed with the previous key but issued after the key rotation \
                 began",
            );
        }
        Ok(())
    }
}

impl std::fmt::Debug for JwtKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtKeys")
            .field("previous", &self.previous.as_ref().map(|p| p.rotation))
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

    /// Also accepts tokens signed with `previous` and issued before `rotation` began, until
    /// its overlap ends ([`Rotation::accepts`]), so tokens handed out before a key rotation
    /// keep working for a while. The relay never signs with it.
    pub fn with_previous(
        mut self,
        previous: impl Into<Vec<u8>>,
        rotation: Rotation,
    ) -> Result<Self, KeyError> {
        self.previous = Some(PreviousKey {
            key: checked(previous.into())?,
            rotation,
        });
        Ok(self)
    }

    /// The rotation under way, when a previous key is held.
    pub fn rotation(&self) -> Option<Rotation> {
        self.previous.as_ref().map(|p| p.rotation)
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

    /// The claims of a valid token, now: [`Verifier::verify_at`] by the system's clock.
    pub fn verify(&self, token: &str) -> Result<Claims, &'static str> {
        self.verify_at(token, OffsetDateTime::now_utc())
    }

    /// The claims of a valid token at `now`: unexpired, for this audience, and signed by the
    /// signing key, or by the previous one while [`Rotation::accepts`] it. The error is what
    /// a 401 says.
    pub fn verify_at(&self, token: &str, now: OffsetDateTime) -> Result<Claims, &'static str> {
        match self.decode(token, &self.keys.signing) {
            // Another key may have signed it.
            Err(Failure::Signature) => {}
            other => return other.map_err(Failure::detail),
        }
        let Some(previous) = &self.keys.previous else {
            return Err(Failure::Signature.detail());
        };
        if now >= previous.rotation.ends_at() {
            // The overlap is over: the previous key verifies nothing.
            return Err(Failure::Signature.detail());
        }
        let claims = self.decode(token, &previous.key).map_err(Failure::detail)?;
        previous.rotation.accepts(claims.iat, now)?;
        Ok(claims)
    }

    fn decode(&self, token: &str, key: &[u8]) -> Result<Claims, Failure> {
        jsonwebtoken::decode::<Claims>(token, &DecodingKey::from_secret(key), &self.validation)
            .map(|data| data.claims)
            .map_err(|e| match e.kind() {
                ErrorKind::InvalidSignature => Failure::Signature,
                ErrorKind::ExpiredSignature => Failure::Expired,
                ErrorKind::InvalidAudience => Failure::Audience,
                _ => Failure::Invalid,
            })
    }
}

/// Why a key did not verify a token. Only the signature depends on the key: any other failure
/// is final.
enum Failure {
    Signature,
    Expired,
    Audience,
    Invalid,
}

impl Failure {
    fn detail(self) -> &'static str {
        match self {
            Failure::Expired => "the token has expired",
            Failure::Audience => "the token is for another audience",
            Failure::Signature | Failure::Invalid => "the token is not valid",
        }
    }
}

/// Anything whose state can verify tokens.
pub trait HasVerifier {
    fn verifier(&self) -> &Arc<Verifier>;
}

/// Who sent a request, found once per request by the control plane's first middleware and kept
/// in its extensions: the claims of its valid token, or what a 401 says about the token. The
/// extractors below read it rather than verify the token again.
#[derive(Debug, Clone)]
pub struct Authenticated(pub Result<Claims, &'static str>);

impl Authenticated {
    /// The bearer token of `headers`, verified.
    pub fn of(headers: &HeaderMap, verifier: &Verifier) -> Self {
        Self(bearer_token(headers).and_then(|token| verifier.verify(token)))
    }

    /// Whose share of the control plane the request takes, when its token is valid.
    pub fn caller(&self) -> Option<Caller> {
        let claims = self.0.as_ref().ok()?;
        match (claims.role, claims.tenant) {
            (Role::Tenant, Some(tenant)) => Some(Caller::Tenant(relay_store::TenantId(tenant))),
            (Role::Tenant, None) => None,
            (Role::Operator, _) => Some(Caller::Operators),
        }
    }
}

/// Whom a bound on requests in flight counts against: each tenant, and the operators together
/// (an operator's name is whatever the token's minter wrote, so counting each name apart would
/// let one key open as many shares as it mints names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Caller {
    Tenant(relay_store::TenantId),
    Operators,
}

fn bearer_token(headers: &HeaderMap) -> Result<&str, &'static str> {
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or("an Authorization: Bearer <token> header is required")?;
    value
        .to_str()
        .map_err(|_| "the Authorization header is not ASCII text")?
        .strip_prefix("Bearer ")
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or("the Authorization header is not `Bearer <token>`")
}

fn claims_of<S: HasVerifier>(parts: &Parts, state: &S) -> Result<Claims, ApiError> {
    let result = match parts.extensions.get::<Authenticated>() {
        Some(Authenticated(result)) => result.clone(),
        // A router without the middleware (none serves today) still checks every token.
        None => Authenticated::of(&parts.headers, state.verifier()).0,
    };
    result.map_err(ApiError::Unauthorized)
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
        // A minute's token for the tenant, signed with key `key` for `audience` at `at`.
        let token = |key: u8, audience: &str, at: OffsetDateTime| {
            let subject = Subject::Tenant(tenant);
            mint(&keys(key), audience, &subject, Duration::from_secs(60), at)
                .unwrap()
                .token
        };
        let claims = verifier.verify(&token(1, "relay", now)).unwrap();
        assert_eq!((claims.role, claims.tenant), (Role::Tenant, Some(tenant)));

        let expired = token(1, "relay", now - Duration::from_secs(3600));
        assert!(verifier.verify(&expired).is_err());
        let other_audience = token(1, "elsewhere", now);
        assert!(verifier.verify(&other_audience).is_err());
        let other_key = token(2, "relay", now);
        assert!(verifier.verify(&other_key).is_err());
    }

    const HOUR: Duration = Duration::from_secs(3600);

    /// Key 2 signs since an hour ago; key 1, the previous one, verifies for two hours after
    /// that.
    fn rotated(now: OffsetDateTime) -> (Verifier, Rotation) {
        let rotation = Rotation {
            started_at: now - HOUR,
            overlap: 2 * HOUR,
        };
        let keys = keys(2).with_previous(vec![1; 32], rotation).unwrap();
        (Verifier::new(keys, "relay"), rotation)
    }

    /// A token of `subject` signed with key `byte`, issued at `iat`, expiring in an hour from
    /// the real clock's now (the library checks `exp` by it).
    fn token_at(byte: u8, subject: Subject, iat: OffsetDateTime) -> String {
        let ttl = OffsetDateTime::now_utc() + HOUR - iat;
        mint(&keys(byte), "relay", &subject, ttl.unsigned_abs(), iat)
            .unwrap()
            .token
    }

    fn operator() -> Subject {
        Subject::Operator { name: "ops".into() }
    }

    #[test]
    fn a_previous_key_token_issued_before_the_rotation_verifies_until_the_overlap_ends() {
        let now = OffsetDateTime::now_utc();
        let (verifier, rotation) = rotated(now);
        for subject in [operator(), Subject::Tenant(Uuid::new_v4())] {
            let old = token_at(1, subject, rotation.started_at - HOUR);
            assert!(verifier.verify_at(&old, now).is_ok());
            assert!(verifier
                .verify_at(&old, rotation.ends_at() - Duration::from_secs(1))
                .is_ok());
            assert_eq!(
                verifier.verify_at(&old, rotation.ends_at()).unwrap_err(),
                "the token is not valid",
                "the overlap is over: the previous key verifies nothing"
            );
            // Without the previous key, it never verified.
            assert!(Verifier::new(keys(2), "relay").verify(&old).is_err());
        }
    }

    #[test]
    fn a_previous_key_token_issued_after_the_rotation_began_is_refused() {
        let now = OffsetDateTime::now_utc();
        let (verifier, rotation) = rotated(now);
        for subject in [operator(), Subject::Tenant(Uuid::new_v4())] {
            for issued in [rotation.started_at, now] {
                let minted_since = token_at(1, subject.clone(), issued);
                let refusal = verifier.verify_at(&minted_since, now).unwrap_err();
                assert!(
                    refusal.contains("after the key rotation began"),
                    "{refusal}"
                );
            }
        }
        let verified = Verifier::new(keys(2), "relay");
        assert!(verified
            .verify(&token_at(1, operator(), rotation.started_at))
            .is_err());
    }

    #[test]
    fn the_signing_keys_tokens_always_verify_and_mint_signs_with_it_alone() {
        let now = OffsetDateTime::now_utc();
        let (verifier, rotation) = rotated(now);
        let tenant = Uuid::new_v4();
        for issued in [rotation.started_at - HOUR, rotation.started_at, now] {
            let token = token_at(2, Subject::Tenant(tenant), issued);
            for at in [now, rotation.ends_at(), rotation.ends_at() + 100 * HOUR] {
                assert_eq!(verifier.verify_at(&token, at).unwrap().tenant, Some(tenant));
            }
        }
        // Minting with the rotated keys signs with key 2: key 1 alone does not verify it.
        let minted = mint(
            verifier.keys(),
            "relay",
            &Subject::Tenant(tenant),
            HOUR,
            now,
        )
        .unwrap();
        assert!(Verifier::new(keys(2), "relay")
            .verify(&minted.token)
            .is_ok());
        assert!(Verifier::new(keys(1), "relay")
            .verify(&minted.token)
            .is_err());
    }

    #[test]
    fn short_keys_and_lifetimes_out_of_range_are_refused() {
        assert!(JwtKeys::new(vec![1; 31]).is_err());
        let now = OffsetDateTime::now_utc();
        let subject = Subject::Tenant(Uuid::new_v4());
        assert!(mint(&keys(1), "relay", &subject, Duration::ZERO, now).is_err());
        assert!(mint(&keys(1), "relay", &subject, MAX_TTL * 2, now).is_err());
    }

    #[test]
    fn an_authorization_header_that_is_not_ascii_is_refused_as_such() {
        let with = |value: &[u8]| {
            let mut headers = HeaderMap::new();
            headers.insert(
                header::AUTHORIZATION,
                axum::http::HeaderValue::from_bytes(value).unwrap(),
            );
            headers
        };
        assert_eq!(bearer_token(&with(b"Bearer abc ")), Ok("abc"));
        assert_eq!(
            bearer_token(&with(b"Bearer \xe9t\xe9")),
            Err("the Authorization header is not ASCII text")
        );
        assert_eq!(
            bearer_token(&with(b"Basic abc")),
            Err("the Authorization header is not `Bearer <token>`")
        );
        assert_eq!(
            bearer_token(&HeaderMap::new()),
            Err("an Authorization: Bearer <token> header is required")
        );
    }
}
