//! One publisher per tenant at a time, as the sequencer owns endpoints: a Redis lease decides
//! who publishes a tenant's changes, and a fencing token in Postgres (`publisher_fences`), checked
//! by the statement that marks changes published, makes a lost lease harmless.
//!
//! Why per tenant rather than per endpoint: a tenant's changes all go to one destination, so one
//! owner holds one channel (and, for a tenant's own broker, one connection) per tenant rather
//! than per endpoint, many of the tenant's endpoints publish at once on it, and a tenant
//! whose broker is unreachable ties up exactly one task. Order is per endpoint, and every
//! endpoint of the tenant is published by that one owner. The cost is that one tenant's
//! changes cannot be spread over several publisher processes.
//!
//! What a stale owner (one that stalled past its lease while another took over) can still do is
//! publish what it was about to publish when it stalled: it checks its lease before every
//! publish, so that is at most the change it was sending. Its successor starts each endpoint
//! right after the last change marked, so what the queue receives twice is only a repeat of a
//! change_seq already sent, which consumers drop.

use std::time::Duration;

use relay_coord::{Fence, Owned, OwnershipConfig};
use sqlx::PgPool;

pub use relay_coord::{Held as TenantHeld, Owners as TenantOwners, OwnershipError};

/// The publisher's: one owner per tenant, fenced by `publisher_fences`.
pub const TENANTS: Owned = Owned {
    lock_name: "publisher:tenant",
    fence: Fence::Tenant,
};

/// The ownership mechanism the sequencer's endpoints use (Redis lease, Postgres fencing token),
/// over tenants.
pub async fn connect(
    redis_url: &str,
    trust: &relay_netguard::TrustRoots,
    pool: PgPool,
    key_prefix: String,
    lease: Duration,
) -> Result<TenantOwners, OwnershipError> {
    TenantOwners::connect(
        redis_url,
        pool,
        OwnershipConfig {
            key_prefix,
            lease,
            owned: TENANTS,
            trust: trust.clone(),
        },
    )
    .await
}
