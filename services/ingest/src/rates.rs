//! Each tenant's quota of accepted messages per second (relay-store's `quotas`), kept by a token
//! bucket per tenant in this process.
//!
//! Only verified messages take a token: a stranger posting to a tenant's endpoint ids with no
//! valid signature cannot spend the tenant's quota. A message past it is answered 429 with
//! Retry-After before anything is stored, which the upstream honours by sending it again at the
//! time stated (the wire file's answers table): nothing is lost, the tenant's stream is slowed.
//!
//! The quota in force is read from Postgres when a tenant is first seen and again once its
//! reading is [`QUOTA_REFRESH`] old, so an operator's change takes effect within that; while
//! Postgres cannot be read the last reading (or the operator's default) stands. The bucket holds
//! a second's worth of tokens. The quota is per front-tier process: with several replicas behind
//! a balancer, a tenant's messages are spread over them and each applies the whole quota.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use relay_store::quotas::{self, QuotaDefaults};
use relay_store::TenantId;
use sqlx::PgPool;

/// How long a tenant's quota, as read, is taken to be in force.
pub const QUOTA_REFRESH: Duration = Duration::from_secs(10);

/// A tenant's bucket is forgotten after this long unused (it is full again by then).
const IDLE_FORGET: Duration = Duration::from_secs(60);

/// One tenant's tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Bucket {
    /// Messages per second: also the most tokens held.
    rate: u32,
    read_at: Instant,
    tokens: f64,
    filled_at: Instant,
}

impl Bucket {
    fn full(rate: u32, now: Instant) -> Self {
        Self {
            rate,
            read_at: now,
            tokens: f64::from(rate),
            filled_at: now,
        }
    }

    /// Takes a token at `now`, or says how long until one is there.
    fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let rate = f64::from(self.rate.max(1));
        let elapsed = now.saturating_duration_since(self.filled_at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(rate);
        self.filled_at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Ok(());
        }
        Err(Duration::from_secs_f64((1.0 - self.tokens) / rate))
    }

    /// A new reading of the quota: the tokens held stay, up to the new rate.
    fn reread(&mut self, rate: u32, now: Instant) {
        self.rate = rate;
        self.read_at = now;
        self.tokens = self.tokens.min(f64::from(rate));
    }
}

/// A message past its tenant's quota: when a token is there again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttled {
    pub retry_after: Duration,
    /// The quota, for the answer's detail.
    pub messages_per_second: u32,
}

/// Every tenant's bucket in this process.
pub struct TenantRates {
    pool: PgPool,
    defaults: QuotaDefaults,
    buckets: Mutex<HashMap<TenantId, Bucket>>,
}

impl TenantRates {
    pub fn new(pool: PgPool, defaults: QuotaDefaults) -> Self {
        Self {
            pool,
            defaults,
            buckets: Mutex::default(),
        }
    }

    /// Takes a token of `tenant`'s for one verified message, or says when to send it again.
    pub async fn admit(&self, tenant: TenantId) -> Result<(), Throttled> {
        let now = Instant::now();
        let read = {
            let buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
            buckets
                .get(&tenant)
                .is_none_or(|b| now.duration_since(b.read_at) >= QUOTA_REFRESH)
        };
        let rate = if read {
            match quotas::effective(&self.pool, tenant, &self.defaults).await {
                Ok(quotas) => Some(quotas.messages_per_second),
                Err(error) => {
                    tracing::warn!(%tenant, %error, "reading the tenant's quota failed");
                    None
                }
            }
        } else {
            None
        };
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() > 1024 {
            buckets.retain(|_, b| now.duration_since(b.filled_at) < IDLE_FORGET);
        }
        let bucket = buckets.entry(tenant).or_insert_with(|| {
            Bucket::full(rate.unwrap_or(self.defaults.messages_per_second), now)
        });
        match rate {
            Some(rate) => bucket.reread(rate, now),
            // Unread (Postgres failed): try again at the next message, not at the next refresh.
            None if read => bucket.read_at = now - QUOTA_REFRESH,
            None => {}
        }
        bucket.take(now).map_err(|retry_after| Throttled {
            retry_after,
            messages_per_second: bucket.rate,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_holds_a_seconds_worth_and_refills_at_its_rate() {
        let start = Instant::now();
        let mut bucket = Bucket::full(10, start);
        for _ in 0..10 {
            assert_eq!(bucket.take(start), Ok(()));
        }
        let wait = bucket.take(start).unwrap_err();
        assert!(
            (wait.as_secs_f64() - 0.1).abs() < 1e-9,
            "one token takes a tenth of a second: {wait:?}"
        );
        assert_eq!(bucket.take(start + Duration::from_millis(100)), Ok(()));
        assert!(bucket.take(start + Duration::from_millis(100)).is_err());
        // Idle for long: full again, never more.
        let later = start + Duration::from_secs(60);
        for _ in 0..10 {
            assert_eq!(bucket.take(later), Ok(()));
        }
        assert!(bucket.take(later).is_err());
    }

    #[test]
    fn a_lower_quota_read_again_caps_the_tokens_held() {
        let start = Instant::now();
        let mut bucket = Bucket::full(100, start);
        bucket.reread(2, start);
        assert_eq!(bucket.take(start), Ok(()));
        assert_eq!(bucket.take(start), Ok(()));
        assert!(bucket.take(start).is_err());
    }
}
