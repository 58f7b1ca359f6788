//! One owner per endpoint at a time.
//!
//! Two mechanisms, each for what it is good at:
//! - **Redis** decides who works on an endpoint: `SET key value NX PX lease` takes the lock, a
//!   script renews it only while the value is still ours, another deletes it only while it is
//!   ours. A worker that stops renewing (it crashed, or stalled) loses the endpoint when the
//!   lease runs out, and another worker takes it over.
//! - **Postgres** makes a lost lock harmless. Each acquisition claims a fencing token, one
//!   higher than the last, in the same database as the copy; every apply transaction first
//!   checks, holding a share lock on the token's row, that the token is still its own
//!   ([`check_fence`]). A worker that stalled past its lease therefore cannot write after
//!   another took over: its check fails. And a new owner's claim waits for the old owner's
//!   transaction in flight, so their writes never interleave.
//!
//! A process may hold thousands of endpoints, most of them idle between messages (an endpoint
//! is kept while it may get more, so its next message costs no lock, no token and no reads):
//! their leases are renewed together, a few round trips to Redis every third of a lease
//! whatever their number ([`Held`]), not one each.
//!
//! The token lives in Postgres, not in a Redis counter, because Redis here keeps nothing on
//! disk: after a restart a counter would start again below the tokens already handed out, and
//! every new owner would be fenced out.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;
use redis::Script;
use relay_store::{fences, EndpointId, StoreError, TenantId};
use sqlx::{PgConnection, PgPool};
use tokio::sync::watch;
use uuid::Uuid;

#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("postgres: {0}")]
    Store(#[from] StoreError),
}

/// Whose fencing tokens an owner claims (relay-store's [`fences`]): what the owned keys are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// Endpoints (`endpoint_fences`): the sequencer's workers.
    Endpoint,
    /// Tenants (`publisher_fences`): the publisher's tasks.
    Tenant,
}

/// What is owned: the Redis key under which its locks live, and whose fencing tokens its owners
/// claim in Postgres. The sequencer owns endpoints; the publisher owns tenants with the same
/// mechanism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owned {
    pub lock_name: &'static str,
    pub fence: Fence,
}

/// The sequencer's: one owner per endpoint.
const ENDPOINTS: Owned = Owned {
    lock_name: "lock",
    fence: Fence::Endpoint,
};

/// How ownership behaves.
#[derive(Debug, Clone)]
pub struct OwnershipConfig {
    /// Every Redis key starts with this (so several relays, or tests, can share one Redis).
    pub key_prefix: String,
    /// How long a lock lasts without renewal. Renew well inside it (a third is usual).
    pub lease: Duration,
    pub owned: Owned,
    /// The roots a `rediss://` connection trusts.
    pub trust: relay_netguard::TrustRoots,
}

impl Default for OwnershipConfig {
    fn default() -> Self {
        Self {
            key_prefix: crate::DEFAULT_KEY_PREFIX.to_owned(),
            lease: Duration::from_secs(10),
            owned: ENDPOINTS,
            trust: relay_netguard::TrustRoots::platform(),
        }
    }
}

/// One worker's hold on one owned thing (an endpoint, a tenant).
#[derive(Debug)]
pub struct Lease {
    /// What is held: the endpoint's id, or the tenant's.
    pub key: Uuid,
    /// The fencing token: every apply transaction checks it with [`check_fence`].
    pub token: i64,
    /// This acquisition's value in Redis: renewals and the release act only while it is there.
    value: String,
    /// Until when the lock is certainly ours, by our own clock (measured from before the
    /// request that took or renewed it, so a slow answer only shortens it).
    valid_until: Instant,
}

impl Lease {
    /// Whether the lock is still certainly ours. Past this, stop applying: another worker may
    /// have taken over (and the fence would refuse our writes anyway).
    pub fn is_valid(&self, now: Instant) -> bool {
        now < self.valid_until
    }
}

/// Takes, renews and releases endpoints for one worker.
#[derive(Clone)]
pub struct Owners {
    redis: ConnectionManager,
    pool: PgPool,
    config: OwnershipConfig,
    /// The leases of every [`Held`] taken through these owners (and their clones).
    renewals: Arc<Renewals>,
}

/// The leases of the [`Held`]s of one [`Owners`], renewed together by one task.
#[derive(Default)]
struct Renewals {
    held: std::sync::Mutex<HashMap<u64, Renewing>>,
    next_id: AtomicU64,
    /// Started with the first lease held.
    renewer: std::sync::OnceLock<tokio::task::JoinHandle<()>>,
}

/// One lease kept renewed.
struct Renewing {
    key: Uuid,
    lock_key: String,
    /// This acquisition's value in Redis: renewals and the release act only while it is there.
    value: String,
    /// Until when the lock is certainly ours; `None` once it is lost.
    valid_until: watch::Sender<Option<Instant>>,
}

impl Drop for Renewals {
    fn drop(&mut self) {
        if let Some(renewer) = self.renewer.get() {
            renewer.abort();
        }
    }
}

impl Renewals {
    /// Stops renewing `id`'s lease: its lock and value, when it was still kept.
    fn forget(&self, id: u64) -> Option<(String, String)> {
        let renewing = self.held.lock().expect("not poisoned").remove(&id)?;
        Some((renewing.lock_key, renewing.value))
    }
}

/// Leases renewed in one round trip at most (a Redis script blocks the server while it runs:
/// a few hundred keys take well under a millisecond).
const RENEWALS_PER_CALL: usize = 500;

const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0";

/// [`RENEW`] for many keys at once: KEYS the locks, ARGV each one's value and then the lease;
/// one result per key (1: renewed, 0: not ours any more).
const RENEW_MANY: &str = r"
local lease = ARGV[#KEYS + 1]
local renewed = {}
for i, key in ipairs(KEYS) do
    if redis.call('GET', key) == ARGV[i] then
        renewed[i] = redis.call('PEXPIRE', key, lease)
    else
        renewed[i] = 0
    end
end
return renewed";

static RENEW_MANY_SCRIPT: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(RENEW_MANY));

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0";

impl Owners {
    pub async fn connect(
        redis_url: &str,
        pool: PgPool,
        config: OwnershipConfig,
    ) -> Result<Self, OwnershipError> {
        let client = crate::redis_client::open_redis(redis_url, &config.trust)?;
        // Bounded waits: a Redis that stopped answering must not hold a worker longer than its
        // lease would last anyway.
        let timeout = (config.lease / 3).max(Duration::from_millis(100));
        let redis = crate::redis_client::connection_manager(client, timeout).await?;
        Ok(Self {
            redis,
            pool,
            config,
            renewals: Arc::default(),
        })
    }

    fn lock_key(&self, key: Uuid) -> String {
        format!(
            "{}{}:{key}",
            self.config.key_prefix, self.config.owned.lock_name
        )
    }

    /// Takes the endpoint (tenant) if nobody holds it: `None` when another worker does.
    pub async fn try_acquire(&self, key: Uuid) -> Result<Option<Lease>, OwnershipError> {
        let value = format!("{:032x}", rand::random::<u128>());
        let started = Instant::now();
        let taken: Option<String> = redis::cmd("SET")
            .arg(self.lock_key(key))
            .arg(&value)
            .arg("NX")
            .arg("PX")
            .arg(self.config.lease.as_millis() as u64)
            .query_async(&mut self.redis.clone())
            .await?;
        if taken.is_none() {
            return Ok(None);
        }
        let mut lease = Lease {
            key,
            token: 0,
            value,
            valid_until: started + self.config.lease,
        };
        match claim_fence(&self.pool, self.config.owned.fence, key).await {
            Ok(token) => {
                lease.token = token;
                Ok(Some(lease))
            }
            Err(error) => {
                // Without a token the lock is useless; give it back rather than sit on it.
                let _ = self.release(lease).await;
                Err(error.into())
            }
        }
    }

    /// Extends the lease. `false` when the lock is no longer ours (it expired and may have been
    /// taken): stop working on the endpoint.
    pub async fn renew(&self, lease: &mut Lease) -> Result<bool, OwnershipError> {
        let started = Instant::now();
        let renewed: i64 = Script::new(RENEW)
            .key(self.lock_key(lease.key))
            .arg(&lease.value)
            .arg(self.config.lease.as_millis() as u64)
            .invoke_async(&mut self.redis.clone())
            .await?;
        if renewed == 1 {
            lease.valid_until = started + self.config.lease;
            Ok(true)
        } else {
            lease.valid_until = started;
            Ok(false)
        }
    }

    /// Takes the endpoint (tenant) if nobody holds it, and keeps it renewed: `None` when another
    /// worker holds it.
    pub async fn hold(&self, key: Uuid) -> Result<Option<Held>, OwnershipError> {
        let Some(lease) = self.try_acquire(key).await? else {
            return Ok(None);
        };
        let (valid_sender, valid_until) = watch::channel(Some(lease.valid_until));
        let id = self.renewals.next_id.fetch_add(1, Ordering::Relaxed);
        self.renewals.held.lock().expect("not poisoned").insert(
            id,
            Renewing {
                key,
                lock_key: self.lock_key(key),
                value: lease.value,
                valid_until: valid_sender,
            },
        );
        self.renewals.renewer.get_or_init(|| {
            tokio::spawn(renew_held(
                self.redis.clone(),
                self.config.lease,
                Arc::downgrade(&self.renewals),
            ))
        });
        Ok(Some(Held {
            key,
            token: lease.token,
            valid_until,
            id,
            owners: self.clone(),
        }))
    }

    /// Gives the endpoint up. `false` when it was no longer ours anyway.
    pub async fn release(&self, lease: Lease) -> Result<bool, OwnershipError> {
        let released: i64 = Script::new(RELEASE)
            .key(self.lock_key(lease.key))
            .arg(&lease.value)
            .invoke_async(&mut self.redis.clone())
            .await?;
        Ok(released == 1)
    }
}

/// One owned thing (an endpoint, a tenant) held for as long as its owner works on it: taken with
/// [`Owners::hold`], renewed every third of the lease together with every other lease of the
/// same owners, given back with [`Held::release`]. The owner asks [`Held::is_lost`] before each
/// step that writes or sends (or waits on [`Held::lost`]) and stops once it is: not renewed in
/// time by its own clock, or taken. Its writes carry [`Held::token`], which the fence checks, so
/// a loss noticed late is harmless. Dropped without a release, its renewal stops and the lock
/// expires within a lease.
pub struct Held {
    key: Uuid,
    token: i64,
    /// Until when the lock is certainly ours; `None` once it is lost.
    valid_until: watch::Receiver<Option<Instant>>,
    /// Its place among the owners' renewals.
    id: u64,
    owners: Owners,
}

impl Held {
    /// What is held: the endpoint's id, or the tenant's.
    pub fn key(&self) -> Uuid {
        self.key
    }

    /// The fencing token every write of this owner checks.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// Whether the lock may no longer be ours: stop working on what it held.
    pub fn is_lost(&self) -> bool {
        self.valid_until
            .borrow()
            .is_none_or(|until| Instant::now() >= until)
    }

    /// Completes once the lock may no longer be ours (never, while it is renewed in time).
    pub async fn lost(&self) {
        let mut valid_until = self.valid_until.clone();
        loop {
            let Some(until) = *valid_until.borrow_and_update() else {
                return;
            };
            tokio::select! {
                () = tokio::time::sleep_until(until.into()) => {
                    if self.is_lost() {
                        return;
                    }
                }
                changed = valid_until.changed() => {
                    // Its renewal was dropped: it is only once the lock is lost.
                    if changed.is_err() {
                        return;
                    }
                }
            }
        }
    }

    /// Gives the lock back. `false` when it was no longer ours anyway.
    pub async fn release(self) -> bool {
        let Some((lock_key, value)) = self.owners.renewals.forget(self.id) else {
            return false;
        };
        let released: Result<i64, _> = Script::new(RELEASE)
            .key(lock_key)
            .arg(value)
            .invoke_async(&mut self.owners.redis.clone())
            .await;
        match released {
            Ok(released) => released == 1,
            Err(error) => {
                // It expires by itself within a lease.
                tracing::debug!(key = %self.key, %error, "could not release the lock");
                false
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.owners.renewals.forget(self.id);
    }
}

/// Renews every lease held through one [`Owners`] every third of a lease, [`RENEWALS_PER_CALL`]
/// a round trip, until the owners are gone. A lease not ours any more, or not renewed before it
/// ran out (a failed renewal is tried again sooner meanwhile), is lost: its [`Held`] hears so and
/// it is renewed no more.
async fn renew_held(redis: ConnectionManager, lease: Duration, renewals: Weak<Renewals>) {
    let period = lease / 3;
    let retry = (lease / 10).max(Duration::from_millis(50));
    let mut wait = period;
    loop {
        tokio::time::sleep(wait).await;
        let Some(renewals) = renewals.upgrade() else {
            return;
        };
        let due: Vec<(u64, String, String)> = renewals
            .held
            .lock()
            .expect("not poisoned")
            .iter()
            .map(|(id, r)| (*id, r.lock_key.clone(), r.value.clone()))
            .collect();
        wait = period;
        for chunk in due.chunks(RENEWALS_PER_CALL) {
            let started = Instant::now();
            let mut script = RENEW_MANY_SCRIPT.prepare_invoke();
            for (_, lock_key, value) in chunk {
                script.key(lock_key).arg(value);
            }
            script.arg(lease.as_millis() as u64);
            let renewed: Result<Vec<i64>, _> = script.invoke_async(&mut redis.clone()).await;
            let mut held = renewals.held.lock().expect("not poisoned");
            match renewed {
                Ok(renewed) => {
                    for ((id, _, _), renewed) in chunk.iter().zip(renewed) {
                        let Some(renewing) = held.get(id) else {
                            // Released meanwhile.
                            continue;
                        };
                        if renewed == 1 {
                            renewing.valid_until.send_replace(Some(started + lease));
                        } else {
                            tracing::warn!(key = %renewing.key,
                                "the lock expired before its renewal: letting go");
                            renewing.valid_until.send_replace(None);
                            held.remove(id);
                        }
                    }
                }
                Err(error) => {
                    let now = Instant::now();
                    for (id, _, _) in chunk {
                        let Some(renewing) = held.get(id) else {
                            continue;
                        };
                        if renewing
                            .valid_until
                            .borrow()
                            .is_none_or(|until| now >= until)
                        {
                            tracing::warn!(key = %renewing.key,
                                error = %relay_netguard::error_chain(&error),
                                "could not renew the lock before it ran out: letting go");
                            renewing.valid_until.send_replace(None);
                            held.remove(id);
                        }
                    }
                    tracing::debug!(%error, "renewing locks failed; trying again soon");
                    wait = retry;
                }
            }
        }
    }
}

/// Claims the next fencing token of `key` (an endpoint's or a tenant's id, as `fence` says):
/// one more than the last, whoever held it. Waits while another owner's write holds the token's
/// row (see [`check_fence`]).
async fn claim_fence(pool: &PgPool, fence: Fence, key: Uuid) -> Result<i64, StoreError> {
    match fence {
        Fence::Endpoint => fences::claim_endpoint(pool, EndpointId(key)).await,
        Fence::Tenant => fences::claim_tenant(pool, TenantId(key)).await,
    }
}

/// In an apply transaction, before any write: whether `token` is still the endpoint's current
/// fencing token. Holds a share lock on the token's row until the transaction ends, so no new
/// owner can claim the endpoint in between. Roll back when it answers `false`.
pub async fn check_fence(
    conn: &mut PgConnection,
    endpoint: EndpointId,
    token: i64,
) -> Result<bool, StoreError> {
    fences::check_endpoint(conn, endpoint, token).await
}
