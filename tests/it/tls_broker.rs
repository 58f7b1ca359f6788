//! TLS to the relay's brokers, Redis and Postgres, against the real servers: RabbitMQ and Redis
//! behind a TLS-terminating proxy whose certificate a CA of the test's own signed (given to the
//! relay as the operator gives `RELAY_TLS_CA_FILE`), and this machine's PostgreSQL with its own
//! `ssl = on`.
//!
//! - The publisher publishes over `amqps://`, confirmed, to the relay's broker and to a
//!   tenant's own exchange; what it published is read back (over TLS, and over plain AMQP).
//! - A broker whose certificate another CA signed is refused: nothing is published, and the
//!   refusal names the failed check (stored in the destination's `refused_reason` for a
//!   tenant's broker, and in what the publisher logs).
//! - A wake-up goes over `rediss://` and is heard over `rediss://`.
//! - `sslmode=require` gives a TLS connection; `sslmode=verify-full` to a server whose
//!   certificate fails the checks is refused, saying which check failed.
//!
//! Each test has its own database, vhost, Redis prefix and CA.

use std::net::SocketAddr;
use std::time::Duration;

use relay_netguard::{CertificateFailure, TrustRoots};
use relay_publisher::lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use relay_publisher::lapin::types::FieldTable;
use relay_publisher::lapin::{Connection, ExchangeKind};
use relay_publisher::{tenant_queue, ChangeMessage, ReferenceConsumer};
use relay_store::PoolOptions;
use relay_tests::{amqp_addr, redis_url, rows_of, RedisPrefix, TestDb};
use sqlx::PgPool;
use tokio::sync::{mpsc, watch};
use uuid::Uuid;

use crate::publisher::{
    bind_queue, change_count_of, drain, feeds_of, set_own_exchange, unpublished, wait_published,
    wait_until, write, Delivered, Env,
};
use crate::stack::metric;
use crate::tls_support::{TestCa, TlsProxy};

/// Why the publisher refused the tenant's destination, if it did.
async fn refused_reason(pool: &PgPool, tenant: Uuid) -> Option<String> {
    sqlx::query_scalar("SELECT refused_reason FROM tenant_destinations WHERE tenant_id = $1")
        .bind(tenant)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The vhost's URL over TLS through `proxy`, by the name its certificate carries.
fn amqps_url(env: &Env, proxy: &TlsProxy) -> String {
    format!(
        "amqps://guest:guest@localhost:{}/{}",
        proxy.address.port(),
        env.vhost.name
    )
}

/// A connection to the vhost over TLS, trusting `trust`, as a consumer of the tenant's would.
async fn consumer_over_tls(url: &str, trust: &TrustRoots) -> Connection {
    relay_publisher::connect(url, "tls test consumer", Duration::from_secs(10), trust)
        .await
        .expect("a TLS connection to the broker through the proxy")
}

/// Every change of `tenant` is in `messages` once, in order per endpoint, and the reference
/// consumer rebuilds from them as many changes per endpoint as the outbox holds.
async fn assert_every_change_once(pool: &PgPool, tenant: Uuid, messages: &[Delivered], seed: u64) {
    let mut consumer = ReferenceConsumer::new(tenant);
    for delivered in messages {
        let message = ChangeMessage::decode(&delivered.body)
            .unwrap_or_else(|e| panic!("seed {seed}: an undecodable message: {e}"));
        assert_eq!(delivered.message_id, message.message_id(), "seed {seed}");
        consumer.receive(&message);
    }
    let stats = consumer.stats();
    assert_eq!(stats.waiting, 0, "seed {seed}: {stats:?}");
    assert_eq!(stats.duplicates, 0, "seed {seed}: {stats:?}");
    assert_eq!(stats.other_tenant, 0, "seed {seed}: {stats:?}");
    let endpoints: Vec<(Uuid, i64)> = rows_of(
        pool,
        "SELECT endpoint_id, count(*) FROM changes WHERE tenant_id = $1 GROUP BY endpoint_id",
        tenant,
    )
    .await;
    assert!(!endpoints.is_empty(), "seed {seed}: nothing was written");
    for (endpoint, count) in endpoints {
        assert_eq!(
            consumer.position(endpoint),
            (relay_publisher::FIRST_EPOCH, count),
            "seed {seed}: endpoint {endpoint}"
        );
    }
    assert_eq!(
        messages.len() as i64,
        change_count_of(pool, tenant).await,
        "seed {seed}"
    );
}

/// The publisher counted every change of `tenant` as confirmed by the broker.
async fn assert_every_change_confirmed(
    registry: &prometheus::Registry,
    pool: &PgPool,
    tenant: Uuid,
    seed: u64,
) {
    let total = change_count_of(pool, tenant).await;
    assert_eq!(
        metric(registry, "relay_publisher_messages_confirmed_total"),
        total as f64,
        "seed {seed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_broker_over_tls_gets_every_change_confirmed_and_a_tls_consumer_reads_them() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let ca = TestCa::new("relay broker");
    let proxy = TlsProxy::start(&ca.issue(&["localhost"]), amqp_addr()).await;
    let url = amqps_url(&env, &proxy);

    let tenant = env.db.tenant().await;
    let mut feeds = feeds_of(&env.db, [tenant; 3]).await;
    write(pool, &mut feeds, &mut rng, 60).await;
    let mut config = env.config(url.clone());
    config.trust = ca.trust();
    let (publisher, registry) = env.start(config).await;
    write(pool, &mut feeds, &mut rng, 30).await;
    wait_published(pool, &[tenant], seed).await;
    publisher.stop().await;

    // Marked only once confirmed: every change was confirmed over the TLS connection.
    assert_every_change_confirmed(&registry, pool, tenant, seed).await;
    assert_eq!(
        metric(&registry, "relay_publisher_broker_errors_total"),
        0.0,
        "seed {seed}"
    );
    let consumer = consumer_over_tls(&url, &ca.trust()).await;
    let messages = drain(&consumer, &tenant_queue(tenant), true).await;
    assert_every_change_once(pool, tenant, &messages, seed).await;
    let _ = consumer.close(200, "bye").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_own_exchange_over_amqps_gets_every_change_confirmed() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let ca = TestCa::new("tenant broker");
    // The tenant's broker: the test's vhost behind TLS, at an address that is not the relay's.
    let proxy = TlsProxy::start(&ca.issue(&["localhost"]), amqp_addr()).await;
    let broker = env.broker().await;
    let channel = broker.create_channel().await.unwrap();
    channel
        .exchange_declare(
            "tls-own",
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    bind_queue(
        &channel,
        "tls-own-changes",
        QueueDeclareOptions::default(),
        FieldTable::default(),
        "tls-own",
        "changes",
    )
    .await;
    let tenant = env.db.tenant().await;
    set_own_exchange(pool, tenant, &amqps_url(&env, &proxy), "tls-own", "changes").await;

    let mut feeds = feeds_of(&env.db, [tenant; 3]).await;
    write(pool, &mut feeds, &mut rng, 60).await;
    // The relay's own broker stays plain; the operator's CA file reaches the tenant's.
    let mut config = env.config(env.vhost.url());
    config.trust = ca.trust();
    let (publisher, registry) = env.start(config).await;
    wait_published(pool, &[tenant], seed).await;
    publisher.stop().await;

    assert_every_change_confirmed(&registry, pool, tenant, seed).await;
    assert_eq!(refused_reason(pool, tenant).await, None, "seed {seed}");
    // Read back over plain AMQP: what went over TLS arrived whole.
    let messages = drain(&broker, "tls-own-changes", true).await;
    assert_every_change_once(pool, tenant, &messages, seed).await;
    let _ = channel
        .queue_delete("tls-own-changes", Default::default())
        .await;
    let _ = channel.exchange_delete("tls-own", Default::default()).await;
    let _ = broker.close(200, "bye").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_certificate_from_another_ca_is_refused_and_the_refusal_says_why() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let trusted = TestCa::new("trusted");
    let stranger = TestCa::new("stranger");
    let proxy = TlsProxy::start(&stranger.issue(&["localhost"]), amqp_addr()).await;
    let url = amqps_url(&env, &proxy);

    // A tenant's own broker behind it: refused, and the tenant reads why in its destination.
    let tenant = env.db.tenant().await;
    set_own_exchange(pool, tenant, &url, "amq.direct", "changes").await;
    let mut feeds = feeds_of(&env.db, [tenant; 2]).await;
    write(pool, &mut feeds, &mut rng, 30).await;
    let mut config = env.config(env.vhost.url());
    config.trust = trusted.trust();
    let (publisher, registry) = env.start(config).await;
    wait_until(
        &format!("the tenant's broker refused (seed {seed})"),
        Duration::from_secs(60),
        || async { refused_reason(pool, tenant).await.is_some() },
    )
    .await;
    let reason = refused_reason(pool, tenant).await.unwrap();
    publisher.stop().await;
    assert!(
        reason.contains("unknown_issuer") && reason.contains("not a trusted CA"),
        "seed {seed}: {reason}"
    );
    assert!(metric(&registry, "relay_publisher_broker_errors_total") >= 1.0);
    assert_eq!(
        metric(&registry, "relay_publisher_messages_published_total"),
        0.0,
        "seed {seed}"
    );
    assert_eq!(
        unpublished(pool, &[tenant]).await,
        change_count_of(pool, tenant).await,
        "seed {seed}"
    );

    // Connects as the publisher does fail the same way, and what it logs (`describe`) names
    // the check, with the cause under it; a certificate of the trusted CA fails for its name,
    // or its date, as well.
    let misnamed = TlsProxy::start(&trusted.issue(&["broker.example"]), amqp_addr()).await;
    let expired = TlsProxy::start(&trusted.issue_expired(&["localhost"]), amqp_addr()).await;
    for (url, failure) in [
        (url.clone(), CertificateFailure::UnknownIssuer),
        (amqps_url(&env, &misnamed), CertificateFailure::NameMismatch),
        (amqps_url(&env, &expired), CertificateFailure::Expired),
    ] {
        let refused =
            relay_publisher::connect(&url, "tls test", Duration::from_secs(10), &trusted.trust())
                .await
                .expect_err(failure.as_str());
        let said = refused.describe();
        assert_eq!(refused.certificate_failure(), Some(failure), "{said}");
        assert!(said.contains(failure.as_str()), "{said}");
    }
}

/// Redis behind a TLS proxy, as `rediss://` by the name the certificate carries.
async fn redis_over_tls(ca: &TestCa) -> (TlsProxy, String) {
    let plain: SocketAddr = redis_url()
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .parse()
        .expect("RELAY_TEST_REDIS_URL is redis://host:port");
    let proxy = TlsProxy::start(&ca.issue(&["localhost"]), plain).await;
    let url = format!("rediss://localhost:{}", proxy.address.port());
    (proxy, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_up_goes_over_rediss_and_is_heard_over_rediss() {
    let ca = TestCa::new("redis");
    let (_proxy, url) = redis_over_tls(&ca).await;
    let trust = ca.trust();
    let prefix = RedisPrefix(format!("relay-test:{}:", Uuid::new_v4().simple()));
    let (wakes, mut heard) = mpsc::unbounded_channel();
    let (stop, stopped) = watch::channel(false);
    let listener = tokio::spawn(relay_coord::listen(
        url.clone(),
        trust.clone(),
        relay_coord::wake_channel(&prefix.0),
        wakes,
        stopped,
    ));
    let waker = relay_coord::Waker::connect(&url, &trust, &prefix.0)
        .await
        .expect("a waker over rediss://");
    let endpoint = Uuid::new_v4();
    // Pub/sub keeps nothing for a listener not subscribed yet: wake until one is heard.
    let got = loop {
        waker.wake(&[endpoint]).await.expect("published over TLS");
        if let Ok(Some(got)) = tokio::time::timeout(Duration::from_millis(100), heard.recv()).await
        {
            break got;
        }
    };
    assert_eq!(got, endpoint);
    stop.send_replace(true);
    listener.await.unwrap();

    // Without the operator's CA, the proxy's certificate is refused, and the error says so.
    let refused = relay_coord::open_redis(&url, &TrustRoots::platform())
        .expect("a well-formed URL")
        .get_multiplexed_async_connection()
        .await
        .expect_err("a certificate of an unknown CA");
    let said = relay_netguard::error_chain(&refused);
    assert_eq!(
        relay_netguard::certificate_failure(&refused),
        Some(CertificateFailure::UnknownIssuer),
        "{said}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sslmode_require_is_tls_and_verify_full_refuses_a_certificate_failing_its_checks()
{
    let db = TestDb::new().await;
    let ssl: String = sqlx::query_scalar("SHOW ssl")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    if ssl != "on" {
        eprintln!("skipped: this PostgreSQL has ssl = {ssl}, so there is no TLS to test");
        return;
    }
    let ca = TestCa::new("postgres");
    let with = |mode: &str| {
        let separator = if db.url.contains('?') { '&' } else { '?' };
        format!("{}{separator}sslmode={mode}", db.url)
    };
    let options = PoolOptions {
        max_connections: 1,
        ca_file: Some(ca.pem_file()),
        ..PoolOptions::default()
    };

    let pool = relay_store::connect(&with("require"), &options).unwrap();
    let over_tls: bool =
        sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(over_tls);
    pool.close().await;

    // The server's certificate (Debian's snakeoil, for `localhost`) is checked: against the
    // platform's roots and the test's CA for its issuer (this machine's store may hold the
    // snakeoil certificate itself), and for the name connected to, 127.0.0.1, which it does
    // not carry. Either check refuses it, and the error names the one that did.
    let pool = relay_store::connect(&with("verify-full"), &options).unwrap();
    let refused = sqlx::query_scalar::<_, i32>("SELECT 1")
        .fetch_one(&pool)
        .await
        .expect_err("a certificate not for 127.0.0.1");
    let said = relay_netguard::error_chain(&refused);
    let failure = relay_netguard::certificate_failure(&refused);
    assert!(
        matches!(
            failure,
            Some(CertificateFailure::UnknownIssuer | CertificateFailure::NameMismatch)
        ),
        "{said}"
    );
    assert!(said.contains("invalid peer certificate"), "{said}");
    pool.close().await;
}
