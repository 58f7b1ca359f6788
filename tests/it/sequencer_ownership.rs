//! One owner per endpoint: the Redis lock and the Postgres fencing token, against the real
//! servers. Each test uses a key prefix of its own and a database of its own.

use std::time::{Duration, Instant};

use relay_coord::{check_fence, Owners, OwnershipConfig};
use relay_tests::{random_secret, redis_url, PgProxy, ProxyMode, TestDb};
use uuid::Uuid;

struct Setup {
    db: TestDb,
    endpoint: Uuid,
    prefix: String,
}

async fn setup() -> Setup {
    let db = TestDb::new().await;
    let tenant = db.tenant().await;
    let endpoint = Uuid::new_v4();
    db.endpoint(tenant, endpoint, &random_secret()).await;
    Setup {
        db,
        endpoint,
        prefix: format!("relay-test:{}:", Uuid::new_v4().simple()),
    }
}

impl Setup {
    /// Whether an apply transaction under `token` passes the endpoint's fence (read in a
    /// transaction of its own, then rolled back).
    async fn fence_admits(&self, token: i64) -> bool {
        let mut tx = self.db.pool.begin().await.unwrap();
        let admitted = check_fence(&mut tx, relay_store::EndpointId(self.endpoint), token)
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        admitted
    }
}

async fn owners(setup: &Setup, lease: Duration) -> Owners {
    Owners::connect(
        &redis_url(),
        setup.db.pool.clone(),
        OwnershipConfig {
            key_prefix: setup.prefix.clone(),
            lease,
            ..OwnershipConfig::default()
        },
    )
    .await
    .expect("the tests need Redis on 127.0.0.1:6379")
}

#[tokio::test]
async fn one_owner_at_a_time_and_each_acquisition_takes_a_higher_token() {
    let setup = setup().await;
    let (a, b) = (
        owners(&setup, Duration::from_secs(10)).await,
        owners(&setup, Duration::from_secs(10)).await,
    );
    let first = a.try_acquire(setup.endpoint).await.unwrap().expect("free");
    assert!(b.try_acquire(setup.endpoint).await.unwrap().is_none());
    assert!(a.release(first).await.unwrap());
    let second = b
        .try_acquire(setup.endpoint)
        .await
        .unwrap()
        .expect("released");
    assert_eq!(second.token, 2);
    assert!(b.release(second).await.unwrap());
}

#[tokio::test]
async fn a_worker_stalled_past_its_lease_is_fenced_out_of_the_copy() {
    let setup = setup().await;
    let lease = Duration::from_millis(1_000);
    let (a, b) = (owners(&setup, lease).await, owners(&setup, lease).await);
    let mut stalled = a.try_acquire(setup.endpoint).await.unwrap().expect("free");
    assert!(stalled.is_valid(Instant::now()));

    // A stops renewing (a long pause); its lock runs out and B takes the endpoint over.
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    assert!(!stalled.is_valid(Instant::now()));
    let mut current = b
        .try_acquire(setup.endpoint)
        .await
        .unwrap()
        .expect("expired");
    assert!(current.token > stalled.token);

    // A wakes up: renewing tells it the lock is gone, and its apply transaction is refused.
    assert!(!a.renew(&mut stalled).await.unwrap());
    assert!(!setup.fence_admits(stalled.token).await);
    assert!(setup.fence_admits(current.token).await);
    assert!(b.renew(&mut current).await.unwrap());

    // A's release cannot take B's lock away.
    assert!(!a.release(stalled).await.unwrap());
    assert!(b.try_acquire(setup.endpoint).await.unwrap().is_none());
    assert!(b.release(current).await.unwrap());
}

#[tokio::test]
async fn a_new_claim_waits_for_the_old_owners_transaction_in_flight() {
    let setup = setup().await;
    let lease = Duration::from_secs(10);
    let (a, b) = (owners(&setup, lease).await, owners(&setup, lease).await);
    let old = a.try_acquire(setup.endpoint).await.unwrap().expect("free");
    let old_token = old.token;

    // The old owner is mid-transaction, past its fence check, when its lock goes (given back
    // here; run out, in life).
    let mut tx = setup.db.pool.begin().await.unwrap();
    assert!(
        check_fence(&mut tx, relay_store::EndpointId(setup.endpoint), old_token)
            .await
            .unwrap()
    );
    assert!(a.release(old).await.unwrap());

    let endpoint = setup.endpoint;
    let claiming = b.clone();
    let claim = tokio::spawn(async move {
        let lease = claiming
            .try_acquire(endpoint)
            .await
            .unwrap()
            .expect("released");
        (lease, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !claim.is_finished(),
        "the claim must wait for the transaction"
    );
    let committed_at = Instant::now();
    tx.commit().await.unwrap();

    let (new, claimed_at) = claim.await.unwrap();
    assert_eq!(new.token, old_token + 1);
    assert!(claimed_at >= committed_at);
    assert!(b.release(new).await.unwrap());
}

#[tokio::test]
async fn tokens_keep_rising_when_redis_forgets_every_lock() {
    let setup = setup().await;
    let a = owners(&setup, Duration::from_secs(30)).await;
    let first = a.try_acquire(setup.endpoint).await.unwrap().expect("free");

    // As after a Redis restart (it keeps nothing on disk): every key of ours is gone.
    let client = redis::Client::open(redis_url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}*", setup.prefix))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!keys.is_empty());
    let _: i64 = redis::cmd("DEL")
        .arg(&keys)
        .query_async(&mut conn)
        .await
        .unwrap();

    let b = owners(&setup, Duration::from_secs(30)).await;
    let second = b
        .try_acquire(setup.endpoint)
        .await
        .unwrap()
        .expect("forgotten");
    assert!(
        second.token > first.token,
        "{} after {}",
        second.token,
        first.token
    );
    assert!(!setup.fence_admits(first.token).await);
    assert!(b.release(second).await.unwrap());
}

/// The held lock the sequencer's workers and the publisher's tasks both use: renewed by its own
/// task for as long as it is held, given back by a release, and reported lost once another owner
/// took it.
#[tokio::test]
async fn a_held_lock_is_renewed_past_its_lease_and_reports_its_loss() {
    let setup = setup().await;
    let lease = Duration::from_millis(600);
    let (a, b) = (owners(&setup, lease).await, owners(&setup, lease).await);
    let held = a.hold(setup.endpoint).await.unwrap().expect("free");
    assert_eq!(held.key(), setup.endpoint);

    // Three leases later it is still A's: renewed by its own task.
    tokio::time::sleep(lease * 3).await;
    assert!(!held.is_lost(), "renewed in time");
    assert!(b.hold(setup.endpoint).await.unwrap().is_none());

    // Released, B takes it with a higher token.
    assert!(held.release().await);
    let taken = b.hold(setup.endpoint).await.unwrap().expect("released");
    assert!(taken.token() > 1);

    // The lock is taken from B behind its back (as when its lease ran out during a stall and a
    // successor took it): B's next renewal finds it gone, and B learns of the loss.
    let mut redis = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let key = format!("{}lock:{}", setup.prefix, setup.endpoint);
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("someone else")
        .query_async(&mut redis)
        .await
        .unwrap();
    tokio::time::timeout(lease * 10, taken.lost())
        .await
        .expect("the loss is reported within a few leases");
    assert!(taken.is_lost());
    // Its release leaves the successor's lock alone.
    assert!(!taken.release().await);
    let value: Option<String> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(value.as_deref(), Some("someone else"));
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut redis)
        .await
        .unwrap();
}

/// Redis unreachable for a few seconds (connections cut, new ones refused) and back: the owner
/// takes the endpoint again within moments, not after the minute the redis crate's default
/// reconnect pauses grow to (the fault campaign saw 92 s without applying).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_cut_off_from_redis_takes_endpoints_again_soon_after_it_is_back() {
    let setup = setup().await;
    let redis: std::net::SocketAddr = redis_url()
        .trim_start_matches("redis://")
        .parse()
        .expect("redis://host:port");
    let proxy = PgProxy::start(redis).await;
    let owners = Owners::connect(
        &format!("redis://{}", proxy.address),
        setup.db.pool.clone(),
        OwnershipConfig {
            key_prefix: setup.prefix.clone(),
            lease: Duration::from_secs(3),
            ..OwnershipConfig::default()
        },
    )
    .await
    .unwrap();
    owners
        .try_acquire(setup.endpoint)
        .await
        .unwrap()
        .expect("free");
    proxy.set(ProxyMode::Refuse);
    // Several failed reconnects, as under a real outage.
    for _ in 0..5 {
        assert!(owners.try_acquire(Uuid::new_v4()).await.is_err());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    proxy.set(ProxyMode::Pass);
    // The lease taken before (3 s) has lapsed by now, or does within moments.
    let healed = Instant::now();
    loop {
        if let Ok(Some(_)) = owners.try_acquire(setup.endpoint).await {
            break;
        }
        assert!(
            healed.elapsed() < Duration::from_secs(20),
            "the endpoint not taken again within 20 s of Redis coming back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("taken again {:?} after Redis came back", healed.elapsed());
}

/// Many endpoints held at once stay held, all renewed together, for several leases; one whose
/// lock is taken from under it (deleted, then taken by another owner) is lost by itself while
/// the others stay; one released is free again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_held_together_are_renewed_together_and_one_taken_away_is_lost_alone() {
    let setup = setup().await;
    let tenant = setup.db.tenant().await;
    let mut endpoints = vec![setup.endpoint];
    for _ in 0..1_199 {
        let endpoint = Uuid::new_v4();
        setup.db.endpoint(tenant, endpoint, &random_secret()).await;
        endpoints.push(endpoint);
    }
    let lease = Duration::from_millis(900);
    let (a, b) = (owners(&setup, lease).await, owners(&setup, lease).await);
    let mut held = Vec::new();
    for endpoint in &endpoints {
        held.push(a.hold(*endpoint).await.unwrap().expect("free"));
    }
    // Four leases' time: more than 1,000 leases need more than one round trip each renewal.
    tokio::time::sleep(lease * 4).await;
    assert!(held.iter().all(|h| !h.is_lost()), "a lease ran out");
    for endpoint in &endpoints[..5] {
        assert!(b.try_acquire(*endpoint).await.unwrap().is_none());
    }

    // Another owner takes one endpoint's lock from under A (its key deleted, as an expiry
    // would): A hears at its next renewal that it lost that one, and only that one.
    let mut redis = relay_coord::open_redis(&redis_url(), &relay_netguard::TrustRoots::platform())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let taken = endpoints[7];
    let _: i64 = redis::cmd("DEL")
        .arg(format!("{}lock:{taken}", setup.prefix))
        .query_async(&mut redis)
        .await
        .unwrap();
    let successor = b
        .try_acquire(taken)
        .await
        .unwrap()
        .expect("free once deleted");
    tokio::time::timeout(lease, held[7].lost())
        .await
        .expect("the lease taken away is lost within a lease");
    for (i, h) in held.iter().enumerate() {
        assert_eq!(h.is_lost(), i == 7, "endpoint {i}");
    }
    assert!(
        successor.token > held[7].token(),
        "the successor's token is higher"
    );

    // Released: free at once, and B holds it past A's next renewals.
    let released = held.remove(0);
    assert!(released.release().await);
    let mut next = b
        .try_acquire(setup.endpoint)
        .await
        .unwrap()
        .expect("free once released");
    tokio::time::sleep(lease / 2).await;
    assert!(b.renew(&mut next).await.unwrap(), "B keeps what A released");
    // (Endpoint 7 is at 6 now.)
    assert!(held.iter().enumerate().all(|(i, h)| i == 6 || !h.is_lost()));
}
