//! Where each tenant's changes go (`tenant_destinations`): set, read and reset by the control
//! plane, read by the publisher, which records there why it refuses a destination. No row: the
//! relay's own queue for the tenant. The broker URL holds credentials: only the publisher reads
//! it; the control plane learns whether one is stored.

use sqlx::PgPool;

use crate::{StoreError, TenantId};

/// Where a tenant's changes go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// The default: a durable quorum queue `relay.tenant.<tenant_id>` on the relay's broker,
    /// declared by the publisher.
    RelayQueue,
    /// The tenant's own broker, exchange and routing key. The publisher declares nothing there.
    OwnExchange {
        amqp_url: String,
        exchange: String,
        routing_key: String,
    },
}

/// The tenant's destination as the publisher sends to it, broker URL included (no row: the
/// relay's queue).
pub async fn for_publishing(pool: &PgPool, tenant: TenantId) -> Result<Destination, StoreError> {
    type DestinationRow = (String, Option<String>, Option<String>, Option<String>);
    let row: Option<DestinationRow> = sqlx::query_as(
        "SELECT kind, amqp_url, exchange, routing_key FROM tenant_destinations
         WHERE tenant_id = $1",
    )
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    match row {
        None => Ok(Destination::RelayQueue),
        Some((kind, _, _, _)) if kind == "relay_queue" => Ok(Destination::RelayQueue),
        Some((kind, Some(amqp_url), Some(exchange), Some(routing_key)))
            if kind == "own_exchange" =>
        {
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
