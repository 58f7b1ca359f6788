//! Webhook endpoints, their status and their signing secrets.

use relay_seal::{Keyring, Sealed, SecretText};
use relay_wire::SigningSecret;
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use relay_rules::StoriesMode;

use crate::sealing::{SIGNING_SECRETS, UPSTREAM_API_KEYS};
use crate::{quotas, EndpointId, StoreError, TenantId};

/// A signing secret as it is written: sealed for its endpoint, and its fingerprint, which
/// tells whether the endpoint holds it already.
struct SealedSecret {
    sealed: Sealed,
    fingerprint: Vec<u8>,
}

impl SealedSecret {
    fn of(keys: &Keyring, endpoint: Uuid, secret: &SigningSecret) -> Self {
        let field = SIGNING_SECRETS.field(endpoint);
        Self {
            sealed: keys.seal(secret.as_bytes(), field),
            fingerprint: Keyring::fingerprint(secret.as_bytes(), field).to_vec(),
        }
    }
}

/// An upstream API key sealed for its endpoint: the bytes and the key id to bind.
fn seal_api_key(
    keys: &Keyring,
    endpoint: Uuid,
    key: Option<&SecretText>,
) -> (Option<Vec<u8>>, Option<String>) {
    match key {
        None => (None, None),
        Some(key) => {
            let sealed = keys.seal(key.expose().as_bytes(), UPSTREAM_API_KEYS.field(endpoint));
            (Some(sealed.bytes), Some(sealed.key_id))
        }
    }
}

/// The Postgres channel on which every change to an endpoint's row or its secrets is announced
/// (by the triggers of the first migration), its id as the payload: the front tier drops its
/// cached copy, the sequencer's worker that owns the endpoint reads the registration again.
pub const CHANGED_CHANNEL: &str = "relay_endpoint_changed";

/// Whether the front tier takes an endpoint's messages. A paused endpoint answers 410, which
/// the upstream takes as "paused until you resume it".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointStatus {
    Active,
    Paused,
}

impl EndpointStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            EndpointStatus::Active => "active",
            EndpointStatus::Paused => "paused",
        }
    }

    fn from_db(text: &str) -> Self {
        match text {
            "paused" => EndpointStatus::Paused,
            _ => EndpointStatus::Active,
        }
    }
}

/// Which of the upstream's products an endpoint receives: the feed (the wire file's messages of
/// events on tracks) or the stories API's events (seed 000). Fixed when it is registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Feed,
    Stories(StoriesSettings),
}

/// A stories endpoint's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoriesSettings {
    pub mode: StoriesMode,
    /// The tickers the endpoint's copy holds, each once, in the order registered.
    pub tickers: Vec<String>,
}

impl Source {
    pub fn kind(&self) -> &'static str {
        match self {
            Source::Feed => "feed",
            Source::Stories(_) => "stories",
        }
    }

    fn from_db(
        source: &str,
        mode: Option<&str>,
        tickers: Option<Vec<String>>,
    ) -> Result<Self, StoreError> {
        match (source, mode, tickers) {
            ("feed", ..) => Ok(Source::Feed),
            ("stories", Some(mode), Some(tickers)) => Ok(Source::Stories(StoriesSettings {
                mode: StoriesMode::parse(mode)
                    .ok_or_else(|| StoreError::Invalid(format!("stories mode {mode:?}")))?,
                tickers,
            })),
            (other, ..) => Err(StoreError::Invalid(format!("endpoint source {other:?}"))),
        }
    }

    fn stories_columns(&self) -> (Option<&'static str>, Option<&[String]>) {
        match self {
            Source::Feed => (None, None),
            Source::Stories(settings) => (Some(settings.mode.as_str()), Some(&settings.tickers)),
        }
    }
}

/// What registering an endpoint needs.
#[derive(Debug, Clone)]
pub struct NewEndpoint {
    /// The upstream's webhook_endpoint_id.
    pub id: Uuid,
    pub tenant_id: Uuid,
    pub secret: SigningSecret,
    pub upstream_base_url: Option<String>,
    pub upstream_api_key: Option<SecretText>,
}

/// Registers an endpoint with its first secret and its arrival counter, all or nothing. For the
/// operator's own tools (`relay simulate --register`, benchmarks, tests): no quota bounds it.
/// A tenant registers through the control plane, which calls [`register_within_quota`].
pub async fn create(pool: &PgPool, keys: &Keyring, new: &NewEndpoint) -> Result<(), StoreError> {
    let (api_key, api_key_id) = seal_api_key(keys, new.id, new.upstream_api_key.as_ref());
    let mut tx = pool.begin().await?;
    let inserted = sqlx::query(
        "INSERT INTO webhook_endpoints (id, tenant_id, upstream_base_url,
                                        upstream_api_key_sealed, upstream_api_key_key_id)
         SELECT $1, t.id, $3, $4, $5 FROM tenants t WHERE t.id = $2 AND t.deleting_since IS NULL
         ON CONFLICT (id) DO NOTHING",
    )
    .bind(new.id)
    .bind(new.tenant_id)
    .bind(&new.upstream_base_url)
    .bind(api_key)
    .bind(api_key_id)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if inserted == 0 {
        // Nothing was written: say which of the two conditions stopped it.
        let tenant_exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM tenants WHERE id = $1 AND deleting_since IS NULL)",
        )
        .bind(new.tenant_id)
        .fetch_one(&mut *tx)
        .await?;
        return Err(if tenant_exists {
            StoreError::AlreadyExists {
                what: "webhook endpoint",
                id: new.id.to_string(),
            }
        } else {
            StoreError::NotFound {
                what: "tenant",
                id: new.tenant_id.to_string(),
            }
        });
    }
    sqlx::query("INSERT INTO endpoint_arrival_counters (endpoint_id) VALUES ($1)")
        .bind(new.id)
        .execute(&mut *tx)
        .await?;
    let secret = SealedSecret::of(keys, new.id, &new.secret);
    sqlx::query(
        "INSERT INTO endpoint_secrets (tenant_id, endpoint_id, secret_sealed, secret_key_id,
                                       secret_fingerprint)
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(new.tenant_id)
    .bind(new.id)
    .bind(&secret.sealed.bytes)
    .bind(&secret.sealed.key_id)
    .bind(&secret.fingerprint)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The result of a rotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rotation {
    /// When the secrets held before the rotation stop verifying.
    pub old_secrets_expire_at: OffsetDateTime,
    /// How many secrets were given that expiry (secrets that already expired sooner keep theirs).
    pub old_secrets: u64,
}

/// A secret as the front tier holds it.
#[derive(Debug, Clone)]
pub struct HeldSecret {
    pub secret: SigningSecret,
    pub expires_at: Option<OffsetDateTime>,
}

/// What the front tier needs to take an endpoint's messages.
#[derive(Debug, Clone)]
pub struct EndpointAuth {
    pub id: Uuid,
    pub tenant_id: Uuid,
    pub status: EndpointStatus,
    /// Whether its bodies are stories events (seed 000) rather than feed messages.
    pub stories: bool,
    /// Every secret not yet expired when loaded; callers filter by their own `now` again.
    pub secrets: Vec<HeldSecret>,
}

impl EndpointAuth {
    /// The secrets that verify at `now`.
    pub fn secrets_at(&self, now: OffsetDateTime) -> impl Iterator<Item = &SigningSecret> {
        self.secrets
            .iter()
            .filter(move |s| s.expires_at.is_none_or(|at| at > now))
            .map(|s| &s.secret)
    }
}

#[derive(sqlx::FromRow)]
struct AuthRow {
    tenant_id: Uuid,
    status: String,
    source: String,
    secret_sealed: Option<Vec<u8>>,
    secret_key_id: Option<String>,
    expires_at: Option<OffsetDateTime>,
}

/// Loads an endpoint's status and its unexpired secrets, unsealed, or `None` for an unknown
/// endpoint.
pub async fn load_auth(
    pool: &PgPool,
    keys: &Keyring,
    id: Uuid,
) -> Result<Option<EndpointAuth>, StoreError> {
    let rows: Vec<AuthRow> = sqlx::query_as(
        "SELECT e.tenant_id, e.status, e.source, s.secret_sealed, s.secret_key_id, s.expires_at
         FROM webhook_endpoints e
         LEFT JOIN endpoint_secrets s
           ON s.endpoint_id = e.id AND (s.expires_at IS NULL OR s.expires_at > now())
         WHERE e.id = $1 AND e.status <> 'deleting'
         ORDER BY s.id",
    )
    .bind(id)
    .fetch_all(pool)
    .await?;
    let Some(first) = rows.first() else {
        return Ok(None);
    };
    let (tenant_id, status) = (first.tenant_id, EndpointStatus::from_db(&first.status));
    let stories = first.source == "stories";
    let mut secrets = Vec::with_capacity(rows.len());
    for row in rows {
        if let (Some(bytes), Some(key_id)) = (row.secret_sealed, row.secret_key_id) {
            let opened = keys
                .unseal(&Sealed { key_id, bytes }, SIGNING_SECRETS.field(id))
                .map_err(|error| error.to_string())
                .and_then(|key| {
                    SigningSecret::from_bytes(key.to_vec()).map_err(|error| error.to_string())
                });
            match opened {
                Ok(secret) => secrets.push(HeldSecret {
                    secret,
                    expires_at: row.expires_at,
                }),
                // A value that does not open is skipped and reported rather than taking the
                // endpoint down (start-up checked that every key in use opens).
                Err(error) => tracing::error!(endpoint = %id, %error, "unreadable stored secret"),
            }
        }
    }
    Ok(Some(EndpointAuth {
        id,
        tenant_id,
        status,
        stories,
        secrets,
    }))
}

/// What the sequencer needs of an endpoint's registration.
#[derive(Debug, Clone)]
pub struct EndpointRegistration {
    pub id: EndpointId,
    pub tenant_id: TenantId,
    pub upstream_base_url: Option<String>,
    pub upstream_api_key: Option<SecretText>,
    pub source: Source,
    /// When the endpoint was registered (`webhook_endpoints.created_at`): a stories endpoint
    /// notifies only of events created since.
    pub created_at: OffsetDateTime,
}

/// Loads what the sequencer needs of an endpoint, its upstream API key unsealed (`None` for an
/// unknown endpoint).
pub async fn load_registration(
    pool: &PgPool,
    keys: &Keyring,
    endpoint: EndpointId,
) -> Result<Option<EndpointRegistration>, StoreError> {
    type Row = (
        TenantId,
        Option<String>,
        Option<Vec<u8>>,
        Option<String>,
        String,
        Option<String>,
        Option<Vec<String>>,
        OffsetDateTime,
    );
    let row: Option<Row> = sqlx::query_as(
        "SELECT tenant_id, upstream_base_url, upstream_api_key_sealed, upstream_api_key_key_id,
                source, stories_mode, tickers, created_at
         FROM webhook_endpoints
         WHERE id = $1 AND status <> 'deleting'",
    )
    .bind(endpoint)
    .fetch_optional(pool)
    .await?;
    row.map(|(tenant_id, url, key, key_id, source, mode, tickers, created_at)| {
        let upstream_api_key = match (key, key_id) {
            (Some(bytes), Some(key_id)) => {
                let field = UPSTREAM_API_KEYS.field(endpoint.as_uuid());
                match keys.unseal_text(&Sealed { key_id, bytes }, field) {
                    Ok(key) => Some(key),
                    // As if no key were set: the endpoint's state says its upstream needs
                    // settings, and the log why (start-up checked every key in use opens).
                    Err(error) => {
                        tracing::error!(%endpoint, %error, "unreadable stored upstream API key");
                        None
                    }
                }
            }
            _ => None,
        };
        Ok(EndpointRegistration {
            id: endpoint,
            tenant_id,
            upstream_base_url: url,
            upstream_api_key,
            source: Source::from_db(&source, mode.as_deref(), tickers)?,
            created_at,
        })
    })
    .transpose()
}

// The control plane's reads and writes: each names the tenant as well as the endpoint, so
// another tenant's endpoint is not found, never read or written.

/// An endpoint as its tenant reads it: whether an upstream API key is set, never the key.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct EndpointInfo {
    pub id: EndpointId,
    /// What its tenant calls it.
    pub name: Option<String>,
    pub lang: Option<String>,
    pub status: String,
    pub upstream_base_url: Option<String>,
    pub upstream_api_key_set: bool,
    /// `feed` or `stories`.
    pub source: String,
    /// A stories endpoint's mode and tickers (null for the feed's).
    pub stories_mode: Option<String>,
    pub tickers: Option<Vec<String>>,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
}

const INFO_COLUMNS: &str = "id, name, lang, status, upstream_base_url,
     upstream_api_key_sealed IS NOT NULL AS upstream_api_key_set, source, stories_mode, tickers,
     created_at, updated_at";

/// A signing secret as its tenant reads it: its id and expiry, never its value.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct SecretInfo {
    pub id: i64,
    pub created_at: OffsetDateTime,
    pub expires_at: Option<OffsetDateTime>,
    /// Verifies now, by the database's clock.
    pub active: bool,
}

const SECRET_COLUMNS: &str =
    "id, created_at, expires_at, (expires_at IS NULL OR expires_at > now()) AS active";

/// Whether the endpoint is the tenant's (an unknown endpoint is not).
pub async fn owned(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<bool, StoreError> {
    let found: Option<i32> = sqlx::query_scalar(
        "SELECT 1 FROM webhook_endpoints WHERE id = $1 AND tenant_id = $2 AND status <> 'deleting'",
    )
    .bind(endpoint)
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    Ok(found.is_some())
}

/// What a tenant registers.
pub struct Registration {
    pub id: EndpointId,
    pub name: Option<String>,
    pub source: Source,
    /// The feed's language; `None` for a stories endpoint.
    pub lang: Option<String>,
    pub upstream_base_url: Option<String>,
    pub upstream_api_key: Option<SecretText>,
    pub secrets: Vec<SigningSecret>,
}

/// Registers the tenant's endpoint with its arrival counter and its secrets, all or nothing: an
/// endpoint without them would take no message. The statements decide: `AlreadyExists` for
/// the endpoint when its id is taken (by any tenant: the id is the upstream's), `NotFound` for
/// an unknown tenant, and `AlreadyExists` for a `"secret"` whose `id` is its index in
/// `secrets` when it repeats an earlier one (the table's unique key).
///
/// Not bounded by the tenant's endpoints quota: the operator's own tools (benchmarks) register
/// through it. A tenant's registration goes through [`register_within_quota`].
pub async fn register(
    pool: &PgPool,
    keys: &Keyring,
    tenant: TenantId,
    new: &Registration,
) -> Result<(), StoreError> {
    register_in(pool, keys, tenant, new, None).await
}

/// [`register`], while the tenant has fewer endpoints than its `max_endpoints` quota in force
/// (its override, or `defaults`'): `OverQuota` otherwise, with nothing written. Endpoints being
/// deleted do not count ([`quotas::endpoints_in_use`]).
///
/// The tenant's row is locked first, so two registrations of one tenant racing at its limit
/// decide one after the other, the second counting the first's endpoint: the insert's own
/// statement counts and compares, on a snapshot taken once the lock was granted.
pub async fn register_within_quota(
    pool: &PgPool,
    keys: &Keyring,
    tenant: TenantId,
    new: &Registration,
    defaults: &quotas::QuotaDefaults,
) -> Result<(), StoreError> {
    register_in(pool, keys, tenant, new, Some(defaults)).await
}

async fn register_in(
    pool: &PgPool,
    keys: &Keyring,
    tenant: TenantId,
    new: &Registration,
    quota: Option<&quotas::QuotaDefaults>,
) -> Result<(), StoreError> {
    let (api_key, api_key_id) = seal_api_key(keys, new.id.as_uuid(), new.upstream_api_key.as_ref());
    let mut tx = pool.begin().await?;
    if quota.is_some() {
        // FOR NO KEY UPDATE: registrations of this tenant wait for each other, while the
        // foreign-key checks of other writes naming the tenant (FOR KEY SHARE) do not.
        let live: Option<bool> = sqlx::query_scalar(
            "SELECT deleting_since IS NULL FROM tenants WHERE id = $1 FOR NO KEY UPDATE",
        )
        .bind(tenant)
        .fetch_optional(&mut *tx)
        .await?;
        if live != Some(true) {
            return Err(StoreError::NotFound {
                what: "tenant",
                id: tenant.to_string(),
            });
        }
    }
    let (stories_mode, tickers) = new.source.stories_columns();
    // $9 NULL: no quota. The count is quotas::endpoints_in_use's.
    let inserted: Option<EndpointId> = sqlx::query_scalar(
        "INSERT INTO webhook_endpoints (id, tenant_id, lang, upstream_base_url,
                                        upstream_api_key_sealed, upstream_api_key_key_id,
                                        source, stories_mode, tickers, name)
         SELECT $1, t.id, $3, $4, $5, $10, $6, $7, $8, $11 FROM tenants t
         WHERE t.id = $2 AND t.deleting_since IS NULL
           AND ($9::int4 IS NULL
                OR (SELECT count(*) FROM webhook_endpoints e
                    WHERE e.tenant_id = t.id AND e.status <> 'deleting')
                   < COALESCE((SELECT q.max_endpoints FROM tenant_quotas q
                               WHERE q.tenant_id = t.id), $9))
         ON CONFLICT (id) DO NOTHING
         RETURNING id",
    )
    .bind(new.id)
    .bind(tenant)
    .bind(&new.lang)
    .bind(&new.upstream_base_url)
    .bind(api_key)
    .bind(new.source.kind())
    .bind(stories_mode)
    .bind(tickers)
    .bind(quota.map(|q| q.max_endpoints as i32))
    .bind(api_key_id)
    .bind(&new.name)
    .fetch_optional(&mut *tx)
    .await?;
    if inserted.is_none() {
        // Nothing was written: say which condition stopped it.
        let (tenant_exists, id_taken): (bool, bool) = sqlx::query_as(
            "SELECT EXISTS (SELECT 1 FROM tenants WHERE id = $1 AND deleting_since IS NULL),
                    EXISTS (SELECT 1 FROM webhook_endpoints WHERE id = $2)",
        )
        .bind(tenant)
        .bind(new.id)
        .fetch_one(&mut *tx)
        .await?;
        return Err(match (tenant_exists, id_taken, quota) {
            (false, ..) => StoreError::NotFound {
                what: "tenant",
                id: tenant.to_string(),
            },
            (true, false, Some(defaults)) => StoreError::OverQuota {
                quota: "max_endpoints",
                limit: quotas::effective(&mut *tx, tenant, defaults)
                    .await?
                    .max_endpoints,
            },
            (true, ..) => StoreError::AlreadyExists {
                what: "webhook endpoint",
                id: new.id.to_string(),
            },
        });
    }
    sqlx::query("INSERT INTO endpoint_arrival_counters (endpoint_id) VALUES ($1)")
        .bind(new.id)
        .execute(&mut *tx)
        .await?;
    for (i, secret) in new.secrets.iter().enumerate() {
        let secret = SealedSecret::of(keys, new.id.as_uuid(), secret);
        let written = sqlx::query(
            "INSERT INTO endpoint_secrets (tenant_id, endpoint_id, secret_sealed, secret_key_id,
                                           secret_fingerprint)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(tenant)
        .bind(new.id)
        .bind(&secret.sealed.bytes)
        .bind(&secret.sealed.key_id)
        .bind(&secret.fingerprint)
        .execute(&mut *tx)
        .await;
        match written {
            Ok(_) => {}
            // Returning drops the transaction, which rolls back the endpoint and the secrets
            // written before.
            Err(sqlx::Error::Database(db))
                if db.constraint() == Some("endpoint_secrets_fingerprint") =>
            {
                return Err(StoreError::AlreadyExists {
                    what: "secret",
                    id: i.to_string(),
                });
            }
            Err(e) => return Err(e.into()),
        }
    }
    tx.commit().await?;
    Ok(())
}

/// The tenant's endpoint, or `None` when it is not the tenant's.
pub async fn find(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<Option<EndpointInfo>, StoreError> {
    Ok(sqlx::query_as(&format!(
        "SELECT {INFO_COLUMNS} FROM webhook_endpoints WHERE id = $1 AND tenant_id = $2
         AND status <> 'deleting'"
    ))
    .bind(endpoint)
    .bind(tenant)
    .fetch_optional(pool)
    .await?)
}

/// A page of the tenant's endpoints by id, after `after`.
pub async fn list(
    pool: &PgPool,
    tenant: TenantId,
    after: Option<EndpointId>,
    limit: i64,
) -> Result<Vec<EndpointInfo>, StoreError> {
    Ok(sqlx::query_as(&format!(
        "SELECT {INFO_COLUMNS} FROM webhook_endpoints
         WHERE tenant_id = $1 AND status <> 'deleting' AND ($2::uuid IS NULL OR id > $2)
         ORDER BY id LIMIT $3"
    ))
    .bind(tenant)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await?)
}

/// A change of an endpoint's settings; `None` keeps the value stored.
pub struct SettingsChange {
    /// `Some(None)` takes the name away.
    pub name: Option<Option<String>>,
    pub lang: Option<String>,
    pub upstream_base_url: Option<String>,
    pub upstream_api_key: Option<SecretText>,
    /// A stories endpoint's; a feed endpoint has none to change (the statement leaves them
    /// null there, which its CHECK requires).
    pub stories_mode: Option<StoriesMode>,
    pub tickers: Option<Vec<String>>,
}

/// Changes the tenant's endpoint's settings. `false`: it is not the tenant's.
pub async fn change_settings(
    pool: &PgPool,
    keys: &Keyring,
    tenant: TenantId,
    endpoint: EndpointId,
    change: &SettingsChange,
) -> Result<bool, StoreError> {
    let (api_key, api_key_id) =
        seal_api_key(keys, endpoint.as_uuid(), change.upstream_api_key.as_ref());
    let updated: Option<EndpointId> = sqlx::query_scalar(
        "UPDATE webhook_endpoints
         SET name = CASE WHEN $9 THEN $10 ELSE name END,
             lang = COALESCE($3, lang),
             upstream_base_url = COALESCE($4, upstream_base_url),
             upstream_api_key_sealed = COALESCE($5, upstream_api_key_sealed),
             upstream_api_key_key_id = COALESCE($8, upstream_api_key_key_id),
             stories_mode = CASE WHEN source = 'stories' THEN COALESCE($6, stories_mode) END,
             tickers = CASE WHEN source = 'stories' THEN COALESCE($7, tickers) END,
             updated_at = now()
         WHERE id = $1 AND tenant_id = $2 AND status <> 'deleting'
         RETURNING id",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(&change.lang)
    .bind(&change.upstream_base_url)
    .bind(api_key)
    .bind(change.stories_mode.map(StoriesMode::as_str))
    .bind(&change.tickers)
    .bind(api_key_id)
    .bind(change.name.is_some())
    .bind(change.name.as_ref().and_then(Option::as_ref))
    .fetch_optional(pool)
    .await?;
    Ok(updated.is_some())
}

/// Pauses or resumes the tenant's endpoint. `false`: it is not the tenant's. The front tier
/// hears of it through the table's NOTIFY trigger ([`CHANGED_CHANNEL`]).
pub async fn change_status(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    status: EndpointStatus,
) -> Result<bool, StoreError> {
    let updated: Option<EndpointId> = sqlx::query_scalar(
        "UPDATE webhook_endpoints SET status = $3, updated_at = now()
         WHERE id = $1 AND tenant_id = $2 AND status <> 'deleting'
         RETURNING id",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(status.as_str())
    .fetch_optional(pool)
    .await?;
    Ok(updated.is_some())
}

/// The endpoint's secrets by id (none when it is not the tenant's).
pub async fn secrets(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<Vec<SecretInfo>, StoreError> {
    Ok(sqlx::query_as(&format!(
        "SELECT {SECRET_COLUMNS}
         FROM endpoint_secrets WHERE endpoint_id = $1 AND tenant_id = $2 ORDER BY id"
    ))
    .bind(endpoint)
    .bind(tenant)
    .fetch_all(pool)
    .await?)
}

/// Inserts a secret for the tenant's endpoint, expiring `expires_in_s` from now (never, when
/// `None`); `None` when nothing was written (not the tenant's endpoint, or it holds the secret).
async fn insert_secret<'e>(
    db: impl sqlx::PgExecutor<'e>,
    keys: &Keyring,
    tenant: TenantId,
    endpoint: EndpointId,
    secret: &SigningSecret,
    expires_in_s: Option<f64>,
) -> Result<Option<SecretInfo>, StoreError> {
    let secret = SealedSecret::of(keys, endpoint.as_uuid(), secret);
    Ok(sqlx::query_as(&format!(
        "INSERT INTO endpoint_secrets (tenant_id, endpoint_id, secret_sealed, secret_key_id,
                                       secret_fingerprint, expires_at)
         SELECT e.tenant_id, e.id, $3, $5, $6, now() + make_interval(secs => $4)
         FROM webhook_endpoints e WHERE e.id = $1 AND e.tenant_id = $2
           AND e.status <> 'deleting'
         ON CONFLICT (endpoint_id, secret_fingerprint) DO NOTHING
         RETURNING {SECRET_COLUMNS}"
    ))
    .bind(endpoint)
    .bind(tenant)
    .bind(&secret.sealed.bytes)
    .bind(expires_in_s)
    .bind(&secret.sealed.key_id)
    .bind(&secret.fingerprint)
    .fetch_optional(db)
    .await?)
}

/// Why [`insert_secret`] wrote nothing: `NotFound` when the endpoint is not the tenant's,
/// `AlreadyExists` when it holds the secret already.
async fn secret_not_added(pool: &PgPool, tenant: TenantId, endpoint: EndpointId) -> StoreError {
    match owned(pool, tenant, endpoint).await {
        Ok(true) => StoreError::AlreadyExists {
            what: "secret on webhook endpoint",
            id: endpoint.to_string(),
        },
        Ok(false) => StoreError::NotFound {
            what: "webhook endpoint",
            id: endpoint.to_string(),
        },
        Err(e) => e,
    }
}

/// Adds a secret to the tenant's endpoint, expiring `expires_in_s` from now (never, when
/// `None`). The insert decides: `NotFound` when the endpoint is not the tenant's,
/// `AlreadyExists` when it holds the secret already.
pub async fn add_secret(
    pool: &PgPool,
    keys: &Keyring,
    tenant: TenantId,
    endpoint: EndpointId,
    secret: &SigningSecret,
    expires_in_s: Option<f64>,
) -> Result<SecretInfo, StoreError> {
    match insert_secret(pool, keys, tenant, endpoint, secret, expires_in_s).await? {
        Some(added) => Ok(added),
        None => Err(secret_not_added(pool, tenant, endpoint).await),
    }
}

/// Rotates as the upstream does: adds `secret` to the tenant's endpoint and lets every secret
/// it held expire `overlap_s` from now, by the database's clock (or sooner, if one was due
/// sooner). One transaction, so no moment has the old ones expiring without the new one.
/// Errors as [`add_secret`]'s.
pub async fn rotate_secrets(
    pool: &PgPool,
    keys: &Keyring,
    tenant: TenantId,
    endpoint: EndpointId,
    secret: &SigningSecret,
    overlap_s: f64,
) -> Result<(SecretInfo, Rotation), StoreError> {
    let mut tx = pool.begin().await?;
    let Some(added) = insert_secret(&mut *tx, keys, tenant, endpoint, secret, None).await? else {
        drop(tx);
        return Err(secret_not_added(pool, tenant, endpoint).await);
    };
    let (old_secrets, expire_at): (i64, OffsetDateTime) = sqlx::query_as(
        "WITH expiring AS (
             UPDATE endpoint_secrets
             SET expires_at = LEAST(COALESCE(expires_at, 'infinity'), now() + make_interval(secs => $4))
             WHERE endpoint_id = $1 AND tenant_id = $2 AND id <> $3
               AND (expires_at IS NULL OR expires_at > now())
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM expiring), now() + make_interval(secs => $4)",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(added.id)
    .bind(overlap_s)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((
        added,
        Rotation {
            old_secrets_expire_at: expire_at,
            old_secrets: old_secrets.max(0) as u64,
        },
    ))
}

/// Lets one of the tenant's endpoint's secrets expire `after_s` from now, or keeps its expiry
/// if that is sooner. `None`: no such secret on the tenant's endpoint.
pub async fn expire_secret(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    secret_id: i64,
    after_s: f64,
) -> Result<Option<SecretInfo>, StoreError> {
    Ok(sqlx::query_as(&format!(
        "UPDATE endpoint_secrets
         SET expires_at = LEAST(COALESCE(expires_at, 'infinity'), now() + make_interval(secs => $4))
         WHERE id = $3 AND endpoint_id = $1 AND tenant_id = $2
         RETURNING {SECRET_COLUMNS}"
    ))
    .bind(endpoint)
    .bind(tenant)
    .bind(secret_id)
    .bind(after_s)
    .fetch_optional(pool)
    .await?)
}

/// The endpoint's status and whether both upstream settings are set, or `None` when it is not
/// the tenant's: for the endpoint's state, read in its snapshot.
pub async fn status_and_settings<'e>(
    db: impl sqlx::PgExecutor<'e>,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<Option<(String, bool)>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT status,
                COALESCE(upstream_base_url, '') <> '' AND upstream_api_key_sealed IS NOT NULL
         FROM webhook_endpoints WHERE id = $1 AND tenant_id = $2 AND status <> 'deleting'",
    )
    .bind(endpoint)
    .bind(tenant)
    .fetch_optional(db)
    .await?)
}
