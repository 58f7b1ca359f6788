//! One publisher per tenant at a time, as the sequencer owns endpoints: a Redis lease decides
//! who publishes a tenant's changes, and a fencing token in Postgres (`publisher_fences`), checked
//! by the statement that marks changes published, makes a lost lease harmless.
//!
//! Why per tenant rather than per endpoint: a tenant's changes all go to one destination, so one
//! owner holds one channel (and, for a tenant's own broker, one connection) per tenant rather
//! than per endpoint, a round publishes many of the tenant's endpoints at once, and a tenant
//! whose broker is unreachable ties up exactly one task. Order is per endpoint, and every
//! endpoint of the tenant is published by that one owner. The cost is that one tenant's
//! changes cannot be spread over several publisher processes.
//!
//! What a stale owner (one that stalled past its lease while another took over) can still do is
//! publish the change it had in flight, or start one more round: each of its endpoints' streams
//! starts right after a change that was confirmed and marked, and goes on in order, so what the
//! queue receives twice is only a repeat of a change_seq already sent, which consumers drop.

use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;
use sqlx::PgPool;
use uuid::Uuid;

use crate::outbox::claim_fence;

#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("postgres: {0}")]
    Database(#[from] sqlx::Error),
}

/// One publisher's hold on one tenant.
#[derive(Debug)]
pub struct TenantLease {
    pub tenant_id: Uuid,
    /// The fencing token [`crate::outbox::mark_published`] checks.
    pub token: i64,
    value: String,
    /// Until when the lease is certainly ours, by our clock, measured from before the request
    /// that took or renewed it.
    valid_until: Instant,
}

impl TenantLease {
    pub fn is_valid(&self, now: Instant) -> bool {
        now < self.valid_until
    }
}

const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0";

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0";

/// Takes, renews and releases tenants for one publisher process.
#[derive(Clone)]
pub struct TenantOwners {
    redis: ConnectionManager,
    pool: PgPool,
    key_prefix: String,
    lease: Duration,
}

impl TenantOwners {
    pub async fn connect(
        redis_url: &str,
        pool: PgPool,
        key_prefix: String,
        lease: Duration,
    ) -> Result<Self, OwnershipError> {
        let client = redis::Client::open(redis_url)?;
        // Bounded waits: a Redis that stopped answering must not hold a tenant task longer
        // than its lease would last anyway.
        let timeout = (lease / 3).max(Duration::from_millis(100));
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(timeout)
            .set_response_timeout(timeout);
        let redis = ConnectionManager::new_with_config(client, config).await?;
        Ok(Self {
            redis,
            pool,
            key_prefix,
            lease,
        })
    }

    fn key(&self, tenant: Uuid) -> String {
        format!("{}publisher:tenant:{tenant}", self.key_prefix)
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Takes the tenant if nobody holds it: `None` when another publisher does.
    pub async fn try_acquire(&self, tenant: Uuid) -> Result<Option<TenantLease>, OwnershipError> {
        let value = format!("{:032x}", rand::random::<u128>());
        let started = Instant::now();
        let taken: Option<String> = redis::cmd("SET")
            .arg(self.key(tenant))
            .arg(&value)
            .arg("NX")
            .arg("PX")
            .arg(self.lease.as_millis() as u64)
            .query_async(&mut self.redis.clone())
            .await?;
        if taken.is_none() {
            return Ok(None);
        }
        let mut lease = TenantLease {
            tenant_id: tenant,
            token: 0,
            value,
            valid_until: started + self.lease,
        };
        match claim_fence(&self.pool, tenant).await {
            Ok(token) => {
                lease.token = token;
                Ok(Some(lease))
            }
            Err(error) => {
                // Without a token the lease is useless; give it back rather than sit on it.
                let _ = self.release(lease).await;
                Err(error.into())
            }
        }
    }

    /// Extends the lease; `false` when it is no longer ours (stop publishing the tenant).
    pub async fn renew(&self, lease: &mut TenantLease) -> Result<bool, OwnershipError> {
        let started = Instant::now();
        let renewed: i64 = Script::new(RENEW)
            .key(self.key(lease.tenant_id))
            .arg(&lease.value)
            .arg(self.lease.as_millis() as u64)
            .invoke_async(&mut self.redis.clone())
            .await?;
        if renewed == 1 {
            lease.valid_until = started + self.lease;
            Ok(true)
        } else {
            lease.valid_until = started;
            Ok(false)
        }
    }

    /// Gives the tenant up; `false` when it was no longer ours anyway.
    pub async fn release(&self, lease: TenantLease) -> Result<bool, OwnershipError> {
        let released: i64 = Script::new(RELEASE)
            .key(self.key(lease.tenant_id))
            .arg(&lease.value)
            .invoke_async(&mut self.redis.clone())
            .await?;
        Ok(released == 1)
    }
}
