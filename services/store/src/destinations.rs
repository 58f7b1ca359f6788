//! Where each tenant's changes go (`tenant_destinations`): set, read and reset by the control
//! plane, read by the publisher, which records there why it refuses a destination. No row: the
//! relay's own queue for the tenant. The broker URL holds credentials: only the publisher reads
//! it; the control plane learns whether one is stored.

use relay_seal::{Keyring, Sealed, SecretText};
use sqlx::PgPool;
use time::OffsetDateTime;

use crate::sealing::BROKER_URLS;
use crate::{StoreError, TenantId};

/// Where a tenant's changes go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// The default: a durable quorum queue `relay.tenant.<tenant_id>` on the relay's broker,
    /// declared by the publisher.
    RelayQueue,
    /// The tenant's own broker, exchange and routing key. The publisher declares nothing there.
    OwnExchange {
        amqp_url: SecretText,
        exchange: String,
        routing_key: String,
    },
}

/// A tenant's destination row as the control plane shows it: the broker URL's presence, never
/// the URL.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredDestination {
    /// `relay_queue` or `own_exchange`.
    pub kind: String,
    pub exchange: Option<String>,
    pub routing_key: Option<String>,
    pub amqp_url_set: bool,
    pub updated_at: OffsetDateTime,
    pub refused_reason: Option<String>,
    pub refused_at: Option<OffsetDateTime>,
}

/// The columns a [`StoredDestination`] is read from.
const STORED_COLUMNS: &str =
    "kind, exchange, routing_key, amqp_url_sealed IS NOT NULL AS amqp_url_set, \
                              updated_at, refused_reason, refused_at";

/// The tenant's destination row, `None` when it has none (the relay's queue).
pub async fn get(pool: &PgPool, tenant: TenantId) -> Result<Option<StoredDestination>, StoreError> {
    Ok(sqlx::query_as(&format!(
        "SELECT {STORED_COLUMNS} FROM tenant_destinations WHERE tenant_id = $1"
    ))
    .bind(tenant)
    .fetch_optional(pool)
    .await?)
}

/// Sets the tenant's destination, clearing any refusal the publisher recorded for the one it
/// replaces. [`StoreError::NotFound`] when the tenant does not exist (decided in the statement).
pub async fn set(
    pool: &PgPool,
    keys: &Keyring,
    tenant: TenantId,
    destination: &Destination,
) -> Result<StoredDestination, StoreError> {
    let (kind, url, exchange, routing_key) = match destination {
        Destination::RelayQueue => ("relay_queue", None, None, None),
        Destination::OwnExchange {
            amqp_url,
            exchange,
            routing_key,
        } => (
            "own_exchange",
            Some(keys.seal(
                amqp_url.expose().as_bytes(),
                BROKER_URLS.field(tenant.as_uuid()),
            )),
            Some(exchange.as_str()),
            Some(routing_key.as_str()),
        ),
    };
    let (url, url_key_id) = match url {
        Some(Sealed { key_id, bytes }) => (Some(bytes), Some(key_id)),
        None => (None, None),
    };
    let row: Option<StoredDestination> = sqlx::query_as(&format!(
        "INSERT INTO tenant_destinations (tenant_id, kind, amqp_url_sealed, amqp_url_key_id,
                                          exchange, routing_key)
         SELECT t.id, $2, $3, $6, $4, $5 FROM tenants t WHERE t.id = $1
         ON CONFLICT (tenant_id) DO UPDATE
         SET kind = excluded.kind, amqp_url_sealed = excluded.amqp_url_sealed,
             amqp_url_key_id = excluded.amqp_url_key_id, amqp_url = NULL,
             exchange = excluded.exchange, routing_key = excluded.routing_key, updated_at = now(),
             refused_reason = NULL, refused_at = NULL
         RETURNING {STORED_COLUMNS}"
    ))
    .bind(tenant)
    .bind(kind)
    .bind(url)
    .bind(exchange)
    .bind(routing_key)
    .bind(url_key_id)
    .fetch_optional(pool)
    .await?;
    row.ok_or_else(|| StoreError::NotFound {
        what: "tenant",
        id: tenant.to_string(),
    })
}

/// Forgets the tenant's destination: its changes go to the relay's queue again.
pub async fn delete(pool: &PgPool, tenant: TenantId) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM tenant_destinations WHERE tenant_id = $1")
        .bind(tenant)
        .execute(pool)
        .await?;
    Ok(())
}

/// The tenant's destination as the publisher sends to it, broker URL unsealed (no row: the
/// relay's queue).
pub async fn for_publishing(
    pool: &PgPool,
    keys: &Keyring,
    tenant: TenantId,
) -> Result<Destination, StoreError> {
    type DestinationRow = (
        String,
        Option<Vec<u8>>,
        Option<String>,
        Option<String>,
        Option<String>,
    );
    let row: Option<DestinationRow> = sqlx::query_as(
        "SELECT kind, amqp_url_sealed, amqp_url_key_id, exchange, routing_key
         FROM tenant_destinations WHERE tenant_id = $1",
    )
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    match row {
        None => Ok(Destination::RelayQueue),
        Some((kind, ..)) if kind == "relay_queue" => Ok(Destination::RelayQueue),
        Some((kind, Some(bytes), Some(key_id), Some(exchange), Some(routing_key)))
            if kind == "own_exchange" =>
        {
            let amqp_url = keys
                .unseal_text(
                    &Sealed { key_id, bytes },
                    BROKER_URLS.field(tenant.as_uuid()),
                )
                .map_err(|error| {
                    StoreError::Invalid(format!(
                        "tenant_destinations {tenant}: the broker URL does not open: {error}"
                    ))
                })?;
            Ok(Destination::OwnExchange {
                amqp_url,
                exchange,
                routing_key,
            })
        }
        Some((kind, ..)) => Err(StoreError::Invalid(format!(
            "tenant_destinations {tenant} is malformed: kind {kind} without its url, exchange \
             and routing key"
        ))),
    }
}

/// Records why the publisher refused the tenant's destination (`None`: it was not refused, and
/// an earlier reason is cleared). Written only when it changes anything.
pub async fn record_refusal(
    pool: &PgPool,
    tenant: TenantId,
    reason: Option<&str>,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE tenant_destinations
         SET refused_reason = $2, refused_at = CASE WHEN $2 IS NULL THEN NULL ELSE now() END
         WHERE tenant_id = $1 AND refused_reason IS DISTINCT FROM $2",
    )
    .bind(tenant)
    .bind(reason)
    .execute(pool)
    .await?;
    Ok(())
}
