//! Tenant isolation on the broker side, against the real RabbitMQ (and its management API):
//! a tenant's own-exchange destination cannot reach the relay's own broker (refused by the
//! control plane, and by the publisher for a row that bypassed it), nor a private address
//! unless the operator allows it; each tenant's broker credentials open its own queue and
//! nothing else, as the broker itself decides; rotating them ends the old password; and a tenant
//! whose broker hangs does not hold up another tenant's changes.
//!
//! Each test has its own database, vhost and Redis prefix; the RabbitMQ users a test makes are
//! deleted at its end (through the API, and by a guard if the test fails first).

use std::time::Duration;

use relay_api::BrokerAccess;
use relay_publisher::lapin::message::Delivery;
use relay_publisher::lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use relay_publisher::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use relay_publisher::lapin::{BasicProperties, Connection, Consumer};
use relay_publisher::{tenant_queue, PublisherConfig};
use relay_rules::DestinationPolicy;
use relay_tests::{amqp_addr, PgProxy, ProxyMode, TestDb};
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use crate::publisher::{
    change_count_of, declare_passive, drain, feeds_of, put_back, set_own_exchange, unpublished,
    wait_published, wait_until, write, Env,
};
use crate::stack::{metric, relay_broker, Api};

/// The control plane with the relay's broker at `relay_amqp_url` and `policy`.
async fn start_api(pool: PgPool, relay_amqp_url: &str, policy: DestinationPolicy) -> Api {
    Api::serve(pool, |config| {
        config.broker = relay_broker(relay_amqp_url, policy);
    })
    .await
}

/// `tenant` sets its destination to `destination`: the status and JSON of the answer.
async fn put_destination(api: &Api, tenant: Uuid, destination: Value) -> (u16, Value) {
    api.call_as(tenant, "PUT", "/v1/destination", Some(&destination))
        .await
}

/// `tenant`'s PUT of `destination` is refused: a 400 naming `amqp_url`, whose detail says
/// `why`.
async fn assert_amqp_url_refused(api: &Api, tenant: Uuid, destination: Value, why: &str) {
    let url = destination["amqp_url"].as_str().unwrap().to_owned();
    let (status, answer) = put_destination(api, tenant, destination).await;
    assert_eq!(
        (status, answer["field"].as_str()),
        (400, Some("amqp_url")),
        "{url}: {answer}"
    );
    assert!(
        answer["detail"].as_str().unwrap().contains(why),
        "{url}: {answer}"
    );
}

fn own_exchange(amqp_url: &str, exchange: &str, routing_key: &str) -> Value {
    json!({"kind": "own_exchange", "amqp_url": amqp_url, "exchange": exchange,
           "routing_key": routing_key})
}

fn loopback_allowed() -> DestinationPolicy {
    DestinationPolicy {
        allow_private: true,
        ..DestinationPolicy::default()
    }
}

/// The attack of the issue: tenant A's destination at the relay's own broker, default
/// exchange, routing key B's queue. Refused with 400 naming `amqp_url` however the relay's
/// broker is named (an address of its host, a loopback alias, a name that resolves to it, the
/// default port), even where the operator allows loopback destinations; nothing is stored.
/// Without that setting, loopback and private addresses are refused too; with it, another port
/// on this machine is taken. An allow-list of hosts refuses every other host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destinations_at_the_relays_broker_or_private_addresses_are_refused_by_the_api() {
    let db = TestDb::new().await;
    let (a, b) = (db.tenant().await, db.tenant().await);
    let relay = "amqp://guest:guest@127.0.0.1:5672/relay";
    let b_queue = tenant_queue(b);
    let stored = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM tenant_destinations")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };

    let api = start_api(db.pool.clone(), relay, loopback_allowed()).await;
    for url in [
        "amqp://guest:guest@127.0.0.1:5672/relay",
        "amqp://guest:guest@127.0.0.1/%2f",
        "amqp://guest:guest@127.1.2.3:5672/other",
        "amqp://guest:guest@localhost:5672/relay",
        "amqp://guest:guest@LocalHost/relay",
        "amqp://guest:guest@0.0.0.0:5672/relay",
        "amqp://guest:guest@[::1]:5672/relay",
        "amqp://guest:guest@[::ffff:127.0.0.1]:5672/relay",
        "amqp://guest:guest@2130706433:5672/relay",
    ] {
        assert_amqp_url_refused(
            &api,
            a,
            own_exchange(url, "", &b_queue),
            "relay's own broker",
        )
        .await;
    }
    assert_eq!(stored().await, 0);
    // Another listener on this machine is someone else's broker, once the operator allows it.
    let (status, answer) = put_destination(
        &api,
        a,
        own_exchange("amqp://u:p@127.0.0.1:5673/%2f", "x", "k"),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["refused_reason"], Value::Null);
    api.stop().await;

    // The default policy: no loopback, private or link-local address at all.
    sqlx::query("DELETE FROM tenant_destinations")
        .execute(&db.pool)
        .await
        .unwrap();
    let api = start_api(db.pool.clone(), relay, DestinationPolicy::default()).await;
    for url in [
        "amqp://u:p@127.0.0.1:5673/%2f",
        "amqp://u:p@localhost:5673/%2f",
        "amqp://u:p@10.0.0.1/%2f",
        "amqp://u:p@169.254.169.254/%2f",
        "amqp://u:p@[fd00::1]/%2f",
        "amqp://u:p@0x7f000001:5673/%2f",
    ] {
        assert_amqp_url_refused(&api, a, own_exchange(url, "x", "k"), "not a public address").await;
    }
    assert_eq!(stored().await, 0);
    api.stop().await;

    // An allow-list: its hosts, nothing else.
    let listed = DestinationPolicy {
        allowed_hosts: vec!["*.brokers.example".into()],
        allow_private: false,
    };
    let api = start_api(db.pool.clone(), relay, listed).await;
    let (status, answer) = put_destination(
        &api,
        a,
        own_exchange("amqp://u:p@evil.example/%2f", "x", "k"),
    )
    .await;
    assert_eq!(
        (status, answer["field"].as_str()),
        (400, Some("amqp_url")),
        "{answer}"
    );
    assert_eq!(stored().await, 0);
    api.stop().await;
}

/// The relay's broker as a cluster (RELAY_AMQP_URL naming several nodes): a destination at any
/// node is the relay's own broker, refused; another port on this machine is still taken, and a
/// tenant's own cluster too, each of its nodes checked (at most 7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_at_any_node_of_the_relays_cluster_is_refused() {
    let db = TestDb::new().await;
    let a = db.tenant().await;
    let relay = "amqp://guest:guest@127.0.0.1:5672/relay, amqp://guest:guest@127.0.0.1:5682/relay";
    let api = start_api(db.pool.clone(), relay, loopback_allowed()).await;
    for url in [
        "amqp://u:p@127.0.0.1:5672/%2f",
        "amqp://u:p@127.0.0.1:5682/%2f",
        "amqp://u:p@localhost:5682/relay",
    ] {
        assert_amqp_url_refused(&api, a, own_exchange(url, "x", "k"), "relay's own broker").await;
    }
    // A tenant's own cluster: every node checked, one refused refuses it.
    let own_cluster = "amqp://u:p@127.0.0.1:5692/%2f,amqp://u:p@127.0.0.1:5693/%2f";
    let (status, answer) = put_destination(&api, a, own_exchange(own_cluster, "x", "k")).await;
    assert_eq!(status, 200, "{answer}");
    let stored = relay_store::destinations::for_publishing(
        &db.pool,
        &relay_tests::keys(),
        relay_store::TenantId(a),
    )
    .await
    .unwrap();
    let relay_store::destinations::Destination::OwnExchange { amqp_url, .. } = stored else {
        panic!("an own exchange is stored: {stored:?}");
    };
    assert_eq!(amqp_url.expose(), own_cluster);
    assert_amqp_url_refused(
        &api,
        a,
        own_exchange(
            "amqp://u:p@127.0.0.1:5692/%2f,amqp://u:p@127.0.0.1:5682/%2f",
            "x",
            "k",
        ),
        "relay's own broker",
    )
    .await;
    let too_many = ["amqp://u:p@127.0.0.1:5692/%2f"; 8].join(",");
    let (status, answer) = put_destination(&api, a, own_exchange(&too_many, "x", "k")).await;
    assert_eq!(
        (status, answer["field"].as_str()),
        (400, Some("amqp_url")),
        "{answer}"
    );
    api.stop().await;
}

/// A destination row written straight into Postgres (as if the DNS answer the API checked had
/// changed since): A1's at the relay's own broker with B's queue as routing key, A2's at a
/// loopback broker the operator did not allow. The publisher refuses both at connect and says
/// why in their destinations (what `GET /v1/destination` shows), while B's changes reach B's
/// queue, and only B's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publisher_refuses_a_destination_at_the_relays_broker_that_bypassed_the_api() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let (a1, a2, b) = (
        env.db.tenant().await,
        env.db.tenant().await,
        env.db.tenant().await,
    );
    let other_broker = PgProxy::start(amqp_addr()).await;
    for (tenant, url) in [
        (a1, env.vhost.url()),
        (a2, env.vhost.url_via(other_broker.address)),
    ] {
        set_own_exchange(pool, tenant, &url, "", &tenant_queue(b)).await;
    }
    let mut feeds = feeds_of(&env.db, [a1, a2, b, b]).await;
    let config = PublisherConfig {
        destination_policy: DestinationPolicy::default(),
        ..env.config(env.vhost.url())
    };
    let (publisher, registry) = env.start(config).await;
    write(pool, &mut feeds, &mut rng, 80).await;
    wait_published(pool, &[b], seed).await;

    let api = start_api(pool.clone(), &env.vhost.url(), DestinationPolicy::default()).await;
    for (tenant, why) in [(a1, "relay's own broker"), (a2, "not a public address")] {
        let api = &api;
        wait_until(
            &format!("{tenant}'s destination refused because {why} (seed {seed})"),
            Duration::from_secs(60),
            || async move {
                let (status, answer) = api.call_as(tenant, "GET", "/v1/destination", None).await;
                assert_eq!(status, 200, "{answer}");
                answer["refused_reason"]
                    .as_str()
                    .is_some_and(|reason| reason.contains(why))
                    && answer["refused_at"].is_string()
            },
        )
        .await;
    }
    assert!(metric(&registry, "relay_publisher_broker_errors_total") >= 2.0);
    // More of B's changes while A's are refused: still published.
    write(pool, &mut feeds[2..], &mut rng, 20).await;
    wait_published(pool, &[b], seed).await;
    publisher.stop().await;
    api.stop().await;
    for tenant in [a1, a2] {
        assert_eq!(
            unpublished(pool, &[tenant]).await,
            change_count_of(pool, tenant).await,
            "seed {seed}"
        );
    }
    let broker = env.broker().await;
    let delivered = drain(&broker, &tenant_queue(b), true).await;
    assert_eq!(
        delivered.len() as i64,
        change_count_of(pool, b).await,
        "seed {seed}"
    );
    for message in &delivered {
        let body: Value = serde_json::from_slice(&message.body).unwrap();
        assert_eq!(body["tenant_id"], json!(b), "seed {seed}: {body}");
    }
}

/// Deletes the given RabbitMQ users when dropped: a test that fails before it deletes them
/// through the API leaves nothing behind either.
pub(crate) struct UsersGuard(Vec<String>);

impl UsersGuard {
    /// The guard of the broker users the API makes for `tenants`.
    pub(crate) fn of_tenants(tenants: &[Uuid]) -> Self {
        let user = |&tenant| BrokerAccess::username(relay_store::TenantId(tenant));
        Self(tenants.iter().map(user).collect())
    }
}

impl Drop for UsersGuard {
    fn drop(&mut self) {
        for user in &self.0 {
            let _ = std::process::Command::new("rabbitmqctl")
                .args(["delete_user", user])
                .output();
        }
    }
}

pub(crate) fn tenant_url(credentials: &Value, password: &str) -> String {
    let url = credentials["amqp_url"].as_str().unwrap();
    let (scheme, rest) = url.split_once("://").unwrap();
    let (user, rest) = rest.split_once('@').unwrap();
    format!("{scheme}://{user}:{password}@{rest}")
}

pub(crate) use crate::stack::try_connect_broker as connect;

fn quorum() -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    arguments
}

/// A consumer `tag` of `queue` on a channel of its own on `connection` (open while the consumer
/// lives); panics with `may` when the broker refuses it.
pub(crate) async fn consume(
    connection: &Connection,
    queue: &str,
    tag: &str,
    may: &str,
) -> Consumer {
    connection
        .create_channel()
        .await
        .unwrap()
        .basic_consume(
            queue,
            tag,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect(may)
}

/// The consumer's next delivery, within 30 s; panics with `what` when none comes.
pub(crate) async fn next_delivery(consumer: &mut Consumer, what: &str) -> Delivery {
    use futures::StreamExt as _;
    tokio::time::timeout(Duration::from_secs(30), consumer.next())
        .await
        .expect(what)
        .unwrap()
        .unwrap()
}

/// What the broker said to one operation on a fresh channel: `Ok` or its error text.
async fn attempt<F, Fut, T>(connection: &Connection, operation: F) -> Result<(), String>
where
    F: FnOnce(relay_publisher::lapin::Channel) -> Fut,
    Fut: std::future::Future<Output = Result<T, relay_publisher::lapin::Error>>,
{
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    operation(channel)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// What the broker said to a consumer `tag` of `queue` on a fresh channel: `Ok` or its error
/// text.
async fn attempt_consume(connection: &Connection, queue: &str, tag: &str) -> Result<(), String> {
    let queue = queue.to_owned();
    let tag = tag.to_owned();
    attempt(connection, |c| async move {
        c.basic_consume(
            &queue,
            &tag,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
    })
    .await
}

/// Publishes one message with confirms: `Ok` only when the broker acked it.
async fn publish(connection: &Connection, exchange: &str, routing_key: &str) -> Result<(), String> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let confirm = channel
        .basic_publish(
            exchange,
            routing_key,
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            b"{}",
            BasicProperties::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    match confirm.await.map(relay_publisher::classify) {
        Ok(relay_publisher::Outcome::Confirmed) => Ok(()),
        Ok(other) => Err(format!("not confirmed: {other:?}")),
        Err(error) => Err(error.to_string()),
    }
}

async fn message_count(connection: &Connection, queue: &str) -> u32 {
    let channel = connection.create_channel().await.unwrap();
    declare_passive(&channel, queue)
        .await
        .unwrap()
        .message_count()
}

/// With `tenant`'s credentials (`as_tenant`), the broker itself refuses everything on
/// `anothers_queue` (consume, declare, bind, publish to it through the default exchange or any
/// other) and everything else but reading `own_queue`: declaring a queue, publishing anywhere.
pub(crate) async fn assert_refused_but_own_queue(as_b: &Connection, a_queue: &str, b_queue: &str) {
    let a_queue = a_queue.to_owned();
    let refused: Vec<(&str, Result<(), String>)> = vec![
        (
            "consume A's queue",
            attempt_consume(as_b, &a_queue, "x").await,
        ),
        (
            "declare A's queue",
            attempt(as_b, |c| {
                let q = a_queue.clone();
                async move {
                    let durable = QueueDeclareOptions {
                        durable: true,
                        ..QueueDeclareOptions::default()
                    };
                    c.queue_declare(&q, durable, quorum()).await
                }
            })
            .await,
        ),
        (
            "bind A's queue",
            attempt(as_b, |c| {
                let q = a_queue.clone();
                async move {
                    c.queue_bind(
                        &q,
                        "amq.direct",
                        "b",
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                }
            })
            .await,
        ),
        (
            "declare a queue of its own",
            attempt(as_b, |c| async move {
                c.queue_declare(
                    "b-spy",
                    QueueDeclareOptions::default(),
                    FieldTable::default(),
                )
                .await
            })
            .await,
        ),
        ("publish to A's queue", publish(as_b, "", &a_queue).await),
        ("publish to its own queue", publish(as_b, "", b_queue).await),
        (
            "publish to amq.direct",
            publish(as_b, "amq.direct", &a_queue).await,
        ),
    ];
    for (what, result) in &refused {
        let error = result.as_ref().expect_err(what);
        assert!(
            error.contains("ACCESS_REFUSED") || error.contains("403"),
            "{what}: {error}"
        );
    }
}

/// Each tenant's credentials, made through the API: B's may consume B's queue, and the broker
/// itself refuses them on A's queue (consume, declare, bind, publish to it through the default
/// exchange or any other) and everything else but reading B's queue. The answers tell how to
/// connect; only the call that made (or rotated) the credentials holds the password. Rotating
/// ends the old password and the connections made with it. Deleting them deletes the user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_credentials_open_their_own_queue_and_nothing_else() {
    let env = Env::new().await;
    let (a, b) = (env.db.tenant().await, env.db.tenant().await);
    let _guard = UsersGuard::of_tenants(&[a, b]);
    let api = start_api(env.db.pool.clone(), &env.vhost.url(), loopback_allowed()).await;
    let (a_queue, b_queue) = (tenant_queue(a), tenant_queue(b));

    let (status, missing) = api.call_as(b, "GET", "/v1/broker/credentials", None).await;
    assert_eq!(status, 404, "{missing}");
    let (status, made_a) = api.call_as(a, "POST", "/v1/broker/credentials", None).await;
    assert_eq!(status, 201, "{made_a}");
    let (status, made) = api.call_as(b, "POST", "/v1/broker/credentials", None).await;
    assert_eq!(status, 201, "{made}");
    let password = made["password"].as_str().unwrap().to_owned();
    assert_eq!(made["queue"], json!(b_queue));
    assert_eq!(made["vhost"], json!(env.vhost.name));
    assert_eq!(
        made["username"],
        json!(BrokerAccess::username(relay_store::TenantId(b)))
    );
    let (status, again) = api.call_as(b, "POST", "/v1/broker/credentials", None).await;
    assert_eq!(status, 409, "{again}");
    let (status, shown) = api.call_as(b, "GET", "/v1/broker/credentials", None).await;
    assert_eq!(status, 200, "{shown}");
    assert_eq!(shown.get("password"), None, "{shown}");
    assert!(!shown.to_string().contains(&password));
    assert_eq!(shown["amqp_url"], made["amqp_url"]);

    // A message in each queue, put there by the relay's own user.
    let relay = env.broker().await;
    publish(&relay, "", &a_queue).await.unwrap();
    publish(&relay, "", &b_queue).await.unwrap();

    let b_url = tenant_url(&made, &password);
    let as_b = connect(&b_url).await.expect("B's credentials connect");
    // B's own queue: consumed.
    let mut consumer = consume(&as_b, &b_queue, "b", "B may consume its own queue").await;
    let delivery = next_delivery(&mut consumer, "B's message arrives").await;
    assert_eq!(delivery.data, b"{}");

    // A's queue, and everything else: refused by the broker.
    assert_refused_but_own_queue(&as_b, &a_queue, &b_queue).await;
    // A passive declare is the one thing RabbitMQ checks no permission for (3.10: it names
    // no resource to configure, write or read): B learns that a queue of that name exists and
    // its message and consumer counts, given A's tenant id, which no answer of the API tells
    // another tenant. No message, no binding, no publish. Pinned here, so a broker that
    // starts refusing it shows.
    let peeked = declare_passive(&as_b.create_channel().await.unwrap(), &a_queue)
        .await
        .expect("RabbitMQ checks no permission for a passive declare");
    assert_eq!(peeked.message_count(), 1);
    // A's queue holds what the relay put there, and nothing of B's.
    assert_eq!(message_count(&relay, &a_queue).await, 1);

    // Rotation: the old password no longer connects, its connection is closed, the new one
    // works.
    let (status, rotated) = api
        .call_as(b, "POST", "/v1/broker/credentials/rotate", None)
        .await;
    assert_eq!(status, 200, "{rotated}");
    let new_password = rotated["password"].as_str().unwrap().to_owned();
    assert_ne!(new_password, password);
    assert!(
        connect(&b_url).await.is_err(),
        "the old password still connects"
    );
    wait_until(
        "the old password's connection closed",
        Duration::from_secs(30),
        || async { !as_b.status().connected() },
    )
    .await;
    let as_b = connect(&tenant_url(&rotated, &new_password))
        .await
        .expect("the new password connects");
    consume(&as_b, &b_queue, "b2", "B consumes with its new password").await;
    let _ = as_b.close(200, "done").await;

    // Deleted: the users are gone from the broker, nothing is left behind.
    for tenant in [a, b] {
        let (status, answer) = api
            .call_as(tenant, "DELETE", "/v1/broker/credentials", None)
            .await;
        assert_eq!(status, 204, "{answer}");
        let (status, _) = api
            .call_as(tenant, "GET", "/v1/broker/credentials", None)
            .await;
        assert_eq!(status, 404);
    }
    let users = std::process::Command::new("rabbitmqctl")
        .args(["list_users", "--quiet"])
        .output()
        .unwrap();
    let users = String::from_utf8_lossy(&users.stdout);
    for tenant in [a, b] {
        assert!(
            !users.contains(&BrokerAccess::username(relay_store::TenantId(tenant))),
            "{users}"
        );
    }
    api.stop().await;
}

/// A message the tenant's consumer keeps returning (nack with requeue) comes back only up to
/// the delivery limit, then moves to the tenant's dead-letter queue, which the tenant's
/// credentials read, and the message behind it is delivered. Another tenant's credentials
/// cannot read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_returned_past_the_delivery_limit_moves_to_the_tenants_dead_letter_queue() {
    use relay_publisher::lapin::options::BasicAckOptions;

    let env = Env::new().await;
    let (a, b) = (env.db.tenant().await, env.db.tenant().await);
    let _guard = UsersGuard::of_tenants(&[a, b]);
    let limit = 3;
    let api = Api::serve(env.db.pool.clone(), |config| {
        config.broker = relay_broker(&env.vhost.url(), loopback_allowed());
        config.broker.dead_letters.delivery_limit = limit;
    })
    .await;
    let (status, made_a) = api.call_as(a, "POST", "/v1/broker/credentials", None).await;
    assert_eq!(status, 201, "{made_a}");
    let (status, made) = api.call_as(b, "POST", "/v1/broker/credentials", None).await;
    assert_eq!(status, 201, "{made}");
    let b_queue = tenant_queue(b);
    let b_dead = format!("{b_queue}.dead-letter");
    assert_eq!(made["dead_letter_queue"], json!(b_dead));

    // The poison message first, a good one behind it.
    let relay = env.broker().await;
    let channel = relay.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for body in [&b"poison"[..], b"good"] {
        channel
            .basic_publish(
                "",
                &b_queue,
                BasicPublishOptions::default(),
                body,
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    let as_b = connect(&tenant_url(&made, made["password"].as_str().unwrap()))
        .await
        .expect("B's credentials connect");
    let consuming = as_b.create_channel().await.unwrap();
    consuming.basic_qos(1, Default::default()).await.unwrap();
    let mut consumer = consuming
        .basic_consume(
            &b_queue,
            "b",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut poison_deliveries = 0;
    loop {
        let delivery = next_delivery(&mut consumer, "a delivery").await;
        if delivery.data == b"poison" {
            poison_deliveries += 1;
            assert!(
                poison_deliveries <= limit + 1,
                "delivered {poison_deliveries} times with a limit of {limit}"
            );
            put_back(&delivery).await;
        } else {
            assert_eq!(delivery.data, b"good");
            delivery.ack(BasicAckOptions::default()).await.unwrap();
            break;
        }
    }
    assert!(poison_deliveries >= limit, "{poison_deliveries}");

    // In B's dead-letter queue, for B to read.
    let mut dead_consumer =
        consume(&as_b, &b_dead, "b-dead", "B may read its dead-letter queue").await;
    let delivery = next_delivery(&mut dead_consumer, "the poison message is dead-lettered").await;
    assert_eq!(delivery.data, b"poison");
    delivery.ack(BasicAckOptions::default()).await.unwrap();

    // A's credentials: refused on B's dead-letter queue by the broker.
    let as_a = connect(&tenant_url(&made_a, made_a["password"].as_str().unwrap()))
        .await
        .unwrap();
    let refused = attempt_consume(&as_a, &b_dead, "a")
        .await
        .expect_err("A reads B's dead letters");
    assert!(refused.contains("ACCESS_REFUSED"), "{refused}");

    let _ = as_a.close(200, "done").await;
    let _ = as_b.close(200, "done").await;
    for tenant in [a, b] {
        let (status, _) = api
            .call_as(tenant, "DELETE", "/v1/broker/credentials", None)
            .await;
        assert_eq!(status, 204);
    }
    api.stop().await;
}

/// Tenant A's own broker accepts TCP connections and never answers; B's changes (on the
/// relay's queue) are confirmed meanwhile, again and again, through a publisher whose Postgres
/// pool is smaller than the tenants it runs: A's hanging connects hold nothing B needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_tenant_broker_does_not_stop_another_tenants_changes() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let hanging = PgProxy::start(amqp_addr()).await;
    hanging.set(ProxyMode::Blackhole);
    let hanging_tenants = [
        env.db.tenant().await,
        env.db.tenant().await,
        env.db.tenant().await,
    ];
    let b = env.db.tenant().await;
    for tenant in hanging_tenants {
        set_own_exchange(pool, tenant, &env.vhost.url_via(hanging.address), "x", "k").await;
    }
    let mut feeds = feeds_of(&env.db, hanging_tenants.iter().copied().chain([b, b])).await;
    write(pool, &mut feeds, &mut rng, 60).await;
    let small_pool = relay_store::connect(
        &env.db.url,
        &relay_store::PoolOptions {
            max_connections: 2,
            ..relay_store::PoolOptions::default()
        },
    )
    .unwrap();
    let registry = prometheus::Registry::new();
    let publisher = relay_publisher::Publisher::start(
        small_pool,
        env.config(env.vhost.url()),
        relay_tests::keys(),
        &registry,
    )
    .await
    .unwrap();
    wait_published(pool, &[b], seed).await;
    wait_until(
        &format!("the hanging brokers' connects timing out (seed {seed})"),
        Duration::from_secs(60),
        || async { metric(&registry, "relay_publisher_broker_errors_total") >= 3.0 },
    )
    .await;
    for _ in 0..3 {
        write(pool, &mut feeds[3..], &mut rng, 20).await;
        wait_published(pool, &[b], seed).await;
    }
    assert_eq!(
        unpublished(pool, &hanging_tenants).await,
        change_count_of(pool, hanging_tenants[0]).await
            + change_count_of(pool, hanging_tenants[1]).await
            + change_count_of(pool, hanging_tenants[2]).await,
        "seed {seed}"
    );
    publisher.stop().await;
}
