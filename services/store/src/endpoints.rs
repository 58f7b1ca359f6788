//! Webhook endpoints, their status and their signing secrets.

use std::time::Duration;

use relay_wire::SigningSecret;
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::StoreError;

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

/// What registering an endpoint needs.
#[derive(Debug, Clone)]
pub struct NewEndpoint {
    /// The upstream's webhook_endpoint_id.
    pub id: Uuid,
    pub tenant_id: Uuid,
    pub secret: SigningSecret,
    pub upstream_base_url: Option<String>,
    pub upstream_api_key: Option<String>,
}

/// Registers an endpoint with its first secret and its arrival counter, all or nothing.
pub async fn create(pool: &PgPool, new: &NewEndpoint) -> Result<(), StoreError> {
    let mut tx = pool.begin().await?;
    let inserted = sqlx::query(
        "INSERT INTO webhook_endpoints (id, tenant_id, upstream_base_url, upstream_api_key)
         SELECT $1, t.id, $3, $4 FROM tenants t WHERE t.id = $2
         ON CONFLICT (id) DO NOTHING",
    )
    .bind(new.id)
    .bind(new.tenant_id)
    .bind(&new.upstream_base_url)
    .bind(&new.upstream_api_key)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if inserted == 0 {
        // Nothing was written: say which of the two conditions stopped it.
        let tenant_exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM tenants WHERE id = $1)")
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
    sqlx::query(
        "INSERT INTO endpoint_secrets (tenant_id, endpoint_id, secret) VALUES ($1, $2, $3)",
    )
    .bind(new.tenant_id)
    .bind(new.id)
    .bind(new.secret.to_whsec())
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Pauses or resumes an endpoint. Returns the status it had before.
pub async fn set_status(
    pool: &PgPool,
    id: Uuid,
    status: EndpointStatus,
) -> Result<EndpointStatus, StoreError> {
    // The old value comes from the row lock the UPDATE itself takes, not from a separate read.
    let previous: Option<String> = sqlx::query_scalar(
        "UPDATE webhook_endpoints e SET status = $2, updated_at = now()
         FROM (SELECT id, status FROM webhook_endpoints WHERE id = $1 FOR UPDATE) old
         WHERE e.id = old.id
         RETURNING old.status",
    )
    .bind(id)
    .bind(status.as_str())
    .fetch_optional(pool)
    .await?;
    previous
        .map(|s| EndpointStatus::from_db(&s))
        .ok_or_else(|| StoreError::NotFound {
            what: "webhook endpoint",
            id: id.to_string(),
        })
}

/// The result of a rotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rotation {
    /// When the secrets held before the rotation stop verifying.
    pub old_secrets_expire_at: OffsetDateTime,
    /// How many secrets were given that expiry (secrets that already expired sooner keep theirs).
    pub old_secrets: u64,
}

/// Adds `secret` to the endpoint and lets every secret it held expire `overlap` after `now`
/// (or sooner, if one was due to expire sooner), as the upstream does when it rotates: both
/// verify during the overlap. The overlap is at most the wire file's rotation_overlap_max_s.
pub async fn rotate_secret(
    pool: &PgPool,
    id: Uuid,
    secret: &SigningSecret,
    overlap: Duration,
    now: OffsetDateTime,
) -> Result<Rotation, StoreError> {
    let max = Duration::from_secs(relay_wire::limits::ROTATION_OVERLAP_MAX_S);
    if overlap > max {
        return Err(StoreError::Invalid(format!(
            "a rotation overlap is at most {} s (the upstream's longest)",
            max.as_secs()
        )));
    }
    let expire_at = now + overlap;
    let mut tx = pool.begin().await?;
    let new_id: Option<i64> = sqlx::query_scalar(
        "INSERT INTO endpoint_secrets (tenant_id, endpoint_id, secret)
         SELECT e.tenant_id, e.id, $2 FROM webhook_endpoints e WHERE e.id = $1
         ON CONFLICT (endpoint_id, secret) DO NOTHING
         RETURNING id",
    )
    .bind(id)
    .bind(secret.to_whsec())
    .fetch_optional(&mut *tx)
    .await?;
    let Some(new_id) = new_id else {
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM webhook_endpoints WHERE id = $1)")
                .bind(id)
                .fetch_one(&mut *tx)
                .await?;
        return Err(if exists {
            StoreError::AlreadyExists {
                what: "that secret on webhook endpoint",
                id: id.to_string(),
            }
        } else {
            StoreError::NotFound {
                what: "webhook endpoint",
                id: id.to_string(),
            }
        });
    };
    let old_secrets = sqlx::query(
        "UPDATE endpoint_secrets
         SET expires_at = LEAST(COALESCE(expires_at, 'infinity'), $3)
         WHERE endpoint_id = $1 AND id <> $2 AND (expires_at IS NULL OR expires_at > $4)",
    )
    .bind(id)
    .bind(new_id)
    .bind(expire_at)
    .bind(now)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(Rotation {
        old_secrets_expire_at: expire_at,
        old_secrets,
    })
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
    /// Every secret not yet expired when loaded; callers filter by their own `now` again.
    pub secrets: Vec<HeldSecret>,
}

impl EndpointAuth {
    /// The secrets that verify at `now`.
    pub fn secrets_at(&self, now: OffsetDateTime) -> Vec<SigningSecret> {
        self.secrets
            .iter()
            .filter(|s| s.expires_at.is_none_or(|at| at > now))
            .map(|s| s.secret.clone())
            .collect()
    }
}

#[derive(sqlx::FromRow)]
struct AuthRow {
    tenant_id: Uuid,
    status: String,
    secret: Option<String>,
    expires_at: Option<OffsetDateTime>,
}

/// Loads an endpoint's status and its unexpired secrets, or `None` for an unknown endpoint.
pub async fn load_auth(pool: &PgPool, id: Uuid) -> Result<Option<EndpointAuth>, StoreError> {
    let rows: Vec<AuthRow> = sqlx::query_as(
        "SELECT e.tenant_id, e.status, s.secret, s.expires_at
         FROM webhook_endpoints e
         LEFT JOIN endpoint_secrets s
           ON s.endpoint_id = e.id AND (s.expires_at IS NULL OR s.expires_at > now())
         WHERE e.id = $1
         ORDER BY s.id",
    )
    .bind(id)
    .fetch_all(pool)
    .await?;
    let Some(first) = rows.first() else {
        return Ok(None);
    };
    let (tenant_id, status) = (first.tenant_id, EndpointStatus::from_db(&first.status));
    let mut secrets = Vec::with_capacity(rows.len());
    for row in rows {
        if let Some(text) = row.secret {
            match SigningSecret::parse(&text) {
                Ok(secret) => secrets.push(HeldSecret {
                    secret,
                    expires_at: row.expires_at,
                }),
                // The table's CHECK keeps the prefix; anything else unreadable is skipped and
                // reported rather than taking the endpoint down.
                Err(error) => tracing::error!(endpoint = %id, %error, "unreadable stored secret"),
            }
        }
    }
    Ok(Some(EndpointAuth {
        id,
        tenant_id,
        status,
        secrets,
    }))
}

/// What the sequencer needs of an endpoint's registration.
#[derive(Debug, Clone)]
pub struct EndpointRegistration {
    pub id: Uuid,
    pub tenant_id: Uuid,
    pub upstream_base_url: Option<String>,
    pub upstream_api_key: Option<String>,
}

pub async fn load_registration(
    pool: &PgPool,
    endpoint: Uuid,
) -> Result<Option<EndpointRegistration>, StoreError> {
    let row: Option<(Uuid, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT tenant_id, upstream_base_url, upstream_api_key FROM webhook_endpoints
         WHERE id = $1",
    )
    .bind(endpoint)
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|(tenant_id, url, key)| EndpointRegistration {
        id: endpoint,
        tenant_id,
        upstream_base_url: url,
        upstream_api_key: key,
    }))
}
