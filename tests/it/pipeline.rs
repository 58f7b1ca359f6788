//! The whole pipeline end to end, onboarded through the control plane only: the simulated
//! upstream (every fault on) sends signed webhooks over real HTTP to the real front tier; an
//! in-process sequencer applies them into Postgres (real Redis locks and wake-ups); the
//! publisher sends the outbox to each tenant's RabbitMQ queue through a TCP proxy that takes the
//! broker away mid-run, and is killed (aborted) once and replaced. At quiescence:
//! - every endpoint's copy read back through the API equals the simulator's oracle;
//! - each tenant's queue, rebuilt by the reference consumer, equals the oracle per endpoint, with
//!   no change sequence missing, nothing of another tenant, and any repeat only of the same
//!   message_id (and the same message);
//! - tenant B's token on tenant A's endpoint gets a 404.
//!
//! Seeded: every run prints its seed; `RELAY_TEST_SEED=<seed>` replays one.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_api::auth::{mint, JwtKeys, Subject};
use relay_api::{ApiConfig, ApiServer};
use relay_ingest::SystemClock;
use relay_netguard::OutboundPolicy;
use relay_publisher::lapin::options::QueueDeclareOptions;
use relay_publisher::lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use relay_publisher::lapin::types::FieldTable;
use relay_publisher::lapin::Connection;
use relay_publisher::{
    tenant_queue, ChangeMessage, Publisher, PublisherConfig, PublisherHandle, ReferenceConsumer,
};
use relay_sequencer::{Sequencer, SequencerConfig, SequencerMetrics, Waker};
use relay_simulator::cli::{prepare, SimulateArgs};
use relay_simulator::{Faults, Simulation};
use relay_store::copy;
use relay_store::PoolOptions;
use relay_tests::{
    amqp_addr, redis_url, seed, test_config, PgProxy, ProxyMode, RedisPrefix, TestApp, Vhost,
};
use serde_json::{json, Value};
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

/// Changes the broker has not confirmed: past their endpoint's publish cursor.
const UNPUBLISHED: &str = "SELECT count(*) FROM changes c
     LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = c.endpoint_id
     WHERE c.change_seq > COALESCE(p.published_through, 0)";

// ---- The control plane ----

const KEY: &[u8] = b"test-signing-key-of-the-pipeline-control-plane";

/// The control plane in-process on port 0, and a client for it.
struct Api {
    server: ApiServer,
    base_url: String,
    client: reqwest::Client,
}

struct Answer {
    status: u16,
    text: String,
    json: Value,
}

impl Api {
    async fn start(database_url: &str) -> Self {
        let pool = relay_store::connect(database_url, &PoolOptions::default()).unwrap();
        let mut config = ApiConfig::new(JwtKeys::new(KEY).unwrap());
        config.upstream_timeout = Duration::from_secs(5);
        config.outbound = OutboundPolicy::ANY;
        let server = ApiServer::start(pool, config).await.unwrap();
        let base_url = format!("http://{}", server.address);
        Self {
            server,
            base_url,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
        }
    }

    /// An operator's token, minted with the API's signing key (as `relay token issue` does).
    fn operator_token() -> String {
        mint(
            &JwtKeys::new(KEY).unwrap(),
            "relay",
            &Subject::Operator {
                name: "pipeline-test".into(),
            },
            Duration::from_secs(3600),
            OffsetDateTime::now_utc(),
        )
        .unwrap()
        .token
    }

    async fn call(&self, method: &str, path: &str, token: &str, body: Option<&Value>) -> Answer {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut request = self
            .client
            .request(method, format!("{}{path}", self.base_url))
            .bearer_auth(token);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await.expect("the API answers");
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        let json = serde_json::from_str(&text).unwrap_or(Value::Null);
        Answer { status, text, json }
    }

    /// A call that must answer `expect`; its JSON.
    async fn ok(
        &self,
        expect: u16,
        method: &str,
        path: &str,
        token: &str,
        body: Option<&Value>,
    ) -> Value {
        let answer = self.call(method, path, token, body).await;
        assert_eq!(answer.status, expect, "{method} {path}: {}", answer.text);
        answer.json
    }

    /// The endpoint's copy read through the API, page by page (tombstones left out).
    async fn copy(&self, token: &str, endpoint: Uuid) -> Items {
        let mut items = Items::new();
        let mut after: Option<String> = None;
        loop {
            let path = match &after {
                Some(subject) => format!("/v1/endpoints/{endpoint}/copy?limit=7&after={subject}"),
                None => format!("/v1/endpoints/{endpoint}/copy?limit=7"),
            };
            let page = self.ok(200, "GET", &path, token, None).await;
            for row in page["data"].as_array().unwrap() {
                assert_eq!(row["tombstone"], false, "{row}");
                let subject = row["subject"].as_str().unwrap().to_owned();
                let sequence = row["sequence"].as_str().unwrap().to_owned();
                let previous = items.insert(subject, (sequence, row["item"].clone()));
                assert!(previous.is_none(), "a subject on two pages: {row}");
            }
            match page["next_cursor"].as_str() {
                Some(cursor) => after = Some(cursor.to_owned()),
                None => return items,
            }
        }
    }
}

// ---- The copy, the oracle, the backlog ----

/// What a copy holds of its items: subject → (sequence, item).
type Items = BTreeMap<String, (String, Value)>;

fn oracle(sim: &Simulation, endpoint: Uuid) -> Items {
    sim.lock()
        .expected_copy(endpoint)
        .into_iter()
        .map(|(subject, (sequence, item))| (subject, (sequence.as_str().to_owned(), item)))
        .collect()
}

fn without_positions(items: &Items) -> BTreeMap<String, Value> {
    items
        .iter()
        .map(|(s, (_, item))| (s.clone(), item.clone()))
        .collect()
}

/// The copy in Postgres (for the wait; the checks read it through the API).
async fn copy_items(pool: &PgPool, endpoint: Uuid) -> Items {
    copy::copy_rows(pool, endpoint)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|(subject, held)| match held.content {
            relay_rules::HeldContent::Item { item, .. } => {
                Some((subject, (held.sequence.as_str().to_owned(), item)))
            }
            relay_rules::HeldContent::Tombstone => None,
        })
        .collect()
}

/// What is left to do, over all endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Backlog {
    /// Messages stored and not applied.
    waiting: i64,
    /// Reloads not merged.
    reloading: i64,
    /// Changes not published.
    unpublished: i64,
}

async fn backlog(pool: &PgPool) -> Backlog {
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM messages m
         LEFT JOIN endpoint_apply_cursors c ON c.endpoint_id = m.endpoint_id
         WHERE m.arrival_seq > coalesce(c.applied_arrival_seq, 0)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let reloading: i64 =
        sqlx::query_scalar("SELECT count(*) FROM endpoint_tracks WHERE reload IS NOT NULL")
            .fetch_one(pool)
            .await
            .unwrap();
    let unpublished: i64 = sqlx::query_scalar(UNPUBLISHED)
        .fetch_one(pool)
        .await
        .unwrap();
    Backlog {
        waiting,
        reloading,
        unpublished,
    }
}

async fn change_count(pool: &PgPool, endpoint: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM changes WHERE endpoint_id = $1")
        .bind(endpoint)
        .fetch_one(pool)
        .await
        .unwrap()
}

fn describe_difference(copy: &Items, oracle: &Items) -> String {
    let mut lines = Vec::new();
    for (subject, (sequence, item)) in oracle {
        match copy.get(subject) {
            None => lines.push(format!("missing {subject} at {sequence}")),
            Some((s, _)) if s != sequence => {
                lines.push(format!("{subject}: copy at {s}, oracle at {sequence}"))
            }
            Some((_, i)) if i != item => lines.push(format!("{subject}: item differs")),
            _ => {}
        }
    }
    for subject in copy.keys().filter(|s| !oracle.contains_key(*s)) {
        lines.push(format!("extra {subject}"));
    }
    lines.truncate(10);
    lines.join("; ")
}

// ---- The publisher and the queues ----

fn publisher_config(amqp_url: String, key_prefix: &str) -> PublisherConfig {
    PublisherConfig {
        amqp_url,
        redis_url: redis_url(),
        key_prefix: key_prefix.to_owned(),
        poll_interval: Duration::from_millis(20),
        // Above connect_timeout + confirm_timeout, as the config asks.
        lease: Duration::from_millis(3_500),
        connect_timeout: Duration::from_millis(1_000),
        // A silent broker is given up on soon.
        confirm_timeout: Duration::from_secs(2),
        retry_min: Duration::from_millis(20),
        retry_max: Duration::from_millis(300),
        idle_release: Duration::from_millis(500),
        metrics_interval: Duration::from_millis(100),
        destination_refresh: Duration::from_millis(300),
        ..PublisherConfig::default()
    }
}

async fn start_publisher(
    pool: &PgPool,
    config: PublisherConfig,
) -> (PublisherHandle, prometheus::Registry) {
    let registry = prometheus::Registry::new();
    let handle = Publisher::start(pool.clone(), config, &registry)
        .await
        .expect("the pipeline test needs Redis on 127.0.0.1:6379");
    (handle, registry)
}

/// Sum of every series of a counter family (0 when absent).
fn counter(registry: &prometheus::Registry, name: &str) -> f64 {
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().iter())
        .map(|m| m.get_counter().get_value())
        .sum()
}

/// One message as it came off a queue.
struct Delivered {
    message_id: String,
    kind: String,
    body: Vec<u8>,
}

/// Reads and acknowledges every message in the queue (the publisher is stopped, so the count is
/// final), in queue order.
async fn drain(broker: &Connection, queue: &str) -> Vec<Delivered> {
    let channel = broker.create_channel().await.unwrap();
    let count = channel
        .queue_declare(
            queue,
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("{queue} is declared: {e}"))
        .message_count() as usize;
    channel
        .basic_qos(500, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = channel
        .basic_consume(
            queue,
            "pipeline-drain",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("{queue}: {} of {count} messages came", out.len()))
            .expect("the consumer is open")
            .unwrap();
        let text = |s: &Option<relay_publisher::lapin::types::ShortString>| {
            s.as_ref().map(|s| s.to_string()).unwrap_or_default()
        };
        out.push(Delivered {
            message_id: text(delivery.properties.message_id()),
            kind: text(delivery.properties.kind()),
            body: delivery.data.clone(),
        });
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    let _ = channel.close(200, "drained").await;
    out
}

// ---- The run ----

/// What happens to the broker and the publisher while the workload runs, at seeded moments.
#[derive(Debug, Clone, Copy)]
enum Disruption {
    /// The proxy in front of the broker stops passing traffic.
    BrokerAway(ProxyMode),
    BrokerBack,
    /// The publisher is aborted (nothing finishes, no lease is released) and a new one started.
    KillPublisher,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn onboarded_through_the_api_each_tenants_queue_and_copy_equal_the_oracle() {
    let seed = seed();
    eprintln!("pipeline: seed {seed} (RELAY_TEST_SEED={seed} replays it)");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let endpoint_count = 4;
    let rate = 30.0;
    let duration = Duration::from_secs(6);

    // 1. A database, a vhost, a Redis key prefix; the front tier with its waker.
    let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
    let vhost = tokio::task::spawn_blocking(Vhost::create).await.unwrap();
    let waker = Waker::connect(&redis_url(), &prefix.0).await.unwrap();
    let app = TestApp::spawn_with(
        relay_ingest::IngestConfig {
            waker: Some(waker),
            ..test_config()
        },
        Arc::new(SystemClock),
        None,
    )
    .await;
    let pool = app.db.pool.clone();

    // 2. The control plane, a sequencer and the publisher (its broker behind a proxy).
    let api = Api::start(&app.db.url).await;
    let sequencer_pool = relay_store::connect(
        &app.db.url,
        &PoolOptions {
            max_connections: 8,
            acquire_timeout: Duration::from_secs(30),
            statement_timeout: Some(Duration::from_secs(60)),
            generic_plans: false,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let sequencer = Sequencer::start(
        sequencer_pool,
        SequencerConfig {
            redis_url: redis_url(),
            key_prefix: prefix.0.clone(),
            lease: Duration::from_millis(1500),
            max_concurrent_endpoints: 16,
            sweep_interval: Duration::from_millis(200),
            idle_linger: Duration::from_millis(100),
            upstream_timeout: Duration::from_secs(5),
            outbound: OutboundPolicy::ANY,
            // Reloads of several pages, so the faults between pages strike.
            feed_page_limit: 8,
            ..SequencerConfig::default()
        },
        SequencerMetrics::unregistered(),
    )
    .await
    .expect("the pipeline test needs Redis on 127.0.0.1:6379");
    let proxy = PgProxy::start(amqp_addr()).await;
    let amqp_url = vhost.url_via(proxy.address);
    let publisher_pool = relay_store::connect(&app.db.url, &PoolOptions::default()).unwrap();
    let (mut publisher, first_registry) = start_publisher(
        &publisher_pool,
        publisher_config(amqp_url.clone(), &prefix.0),
    )
    .await;

    // 3. Onboarding, through the API only.
    let sim_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_api = format!("http://{}", sim_listener.local_addr().unwrap());
    let args = SimulateArgs {
        receiver_url: app.base_url.clone(),
        endpoints: endpoint_count,
        keys: 2,
        seed,
        rate,
        duration_s: duration.as_secs(),
        faults: "none".into(),
        time_compression: 3600.0,
        listen: "127.0.0.1:0".into(),
        print_endpoints: false,
        quiet: true,
    };
    let (mut upstream, workload, infos) = prepare(&args).unwrap();
    upstream.set_faults(Faults::all());
    let keys: BTreeSet<&str> = infos.iter().map(|i| i.key_token.as_str()).collect();
    assert_eq!(
        keys.len(),
        2,
        "seed {seed}: the endpoints are over two keys"
    );

    let operator = Api::operator_token();
    // Simulator key → (tenant, the tenant's token).
    let mut tenant_of_key: BTreeMap<&str, (Uuid, String)> = BTreeMap::new();
    for (i, key) in keys.iter().enumerate() {
        let created = api
            .ok(
                201,
                "POST",
                "/v1/tenants",
                &operator,
                Some(&json!({"name": format!("pipeline tenant {i}")})),
            )
            .await;
        let tenant: Uuid = created["id"].as_str().unwrap().parse().unwrap();
        let minted = api
            .ok(
                201,
                "POST",
                &format!("/v1/tenants/{tenant}/tokens"),
                &operator,
                Some(&json!({"ttl_s": 3600})),
            )
            .await;
        let token = minted["token"].as_str().unwrap().to_owned();
        let own = api.ok(200, "GET", "/v1/tenant", &token, None).await;
        assert_eq!(own["id"], tenant.to_string());
        let destination = api
            .ok(
                200,
                "PUT",
                "/v1/destination",
                &token,
                Some(&json!({"kind": "relay_queue"})),
            )
            .await;
        assert_eq!(destination["kind"], "relay_queue", "{destination}");
        assert_eq!(destination["default"], false, "{destination}");
        tenant_of_key.insert(key, (tenant, token));
    }
    // Endpoint → (tenant, token).
    let mut owner: BTreeMap<Uuid, (Uuid, String)> = BTreeMap::new();
    for info in &infos {
        let (tenant, token) = tenant_of_key[info.key_token.as_str()].clone();
        let created = api
            .ok(
                201,
                "POST",
                "/v1/endpoints",
                &token,
                Some(&json!({
                    "id": info.id,
                    "lang": info.lang,
                    "upstream_base_url": upstream_api,
                    "upstream_api_key": info.key_token,
                    "secrets": info.secrets,
                })),
            )
            .await;
        assert_eq!(created["id"], info.id.to_string());
        assert_eq!(created["upstream_api_key_set"], true);
        owner.insert(info.id, (tenant, token));
    }
    let tenants: Vec<(Uuid, String)> = tenant_of_key.values().cloned().collect();

    // 4. The simulator: its API, a sender per endpoint, the workload; meanwhile the broker goes
    // away and comes back, and the publisher is killed and replaced, at seeded moments.
    let sim = Simulation::new(upstream, Duration::from_secs(2));
    relay_simulator::api::serve(sim_listener, sim.clone())
        .await
        .unwrap();
    let senders = sim.spawn_senders();
    // The broker goes away while the first publisher runs (so it is felt), and the publisher is
    // killed after it came back, before the workload ends.
    let away_at = rng.gen_range(1_000..2_000u64);
    let away_for = rng.gen_range(1_800..2_500u64);
    let away_mode = if rng.gen_bool(0.5) {
        ProxyMode::Refuse
    } else {
        ProxyMode::Blackhole
    };
    let kill_at = rng.gen_range(away_at + away_for + 200..5_800u64);
    let mut plan = vec![
        (away_at, Disruption::BrokerAway(away_mode)),
        (away_at + away_for, Disruption::BrokerBack),
        (kill_at, Disruption::KillPublisher),
    ];
    plan.sort_by_key(|(at, _)| *at);
    eprintln!("pipeline: seed {seed}: disruptions (ms after the start) {plan:?}");
    let started = Instant::now();
    let workload_task = tokio::spawn(sim.clone().run_workload(workload, rate, duration));
    for (at, disruption) in plan {
        tokio::time::sleep_until((started + Duration::from_millis(at)).into()).await;
        match disruption {
            Disruption::BrokerAway(mode) => proxy.set(mode),
            Disruption::BrokerBack => proxy.set(ProxyMode::Pass),
            Disruption::KillPublisher => {
                publisher.abort();
                (publisher, _) = start_publisher(
                    &publisher_pool,
                    publisher_config(amqp_url.clone(), &prefix.0),
                )
                .await;
            }
        }
    }
    let steps = workload_task.await.unwrap();
    proxy.set(ProxyMode::Pass);
    // The outage was felt: the first publisher's connection was cut or its confirms never came.
    let broker_errors = counter(&first_registry, "relay_publisher_broker_errors_total");
    assert!(
        broker_errors > 0.0,
        "seed {seed}: the broker outage went unnoticed by the publisher"
    );

    // 5. Quiescence: the faults stop (so no new reset is provoked), the upstream sends what is
    // left, the relay applies it, merges its reloads and publishes every change.
    sim.change(|upstream, _| upstream.set_faults(Faults::default()));
    let quiesce = Instant::now();
    let ids: Vec<Uuid> = infos.iter().map(|i| i.id).collect();
    let limit = Duration::from_secs(180);
    let mut stable_rounds = 0;
    loop {
        let idle = sim.wait_idle(Duration::from_millis(10)).await;
        let left = backlog(&pool).await;
        let mut equal = true;
        for &id in &ids {
            if copy_items(&pool, id).await != oracle(&sim, id) {
                equal = false;
                break;
            }
        }
        let done = Backlog {
            waiting: 0,
            reloading: 0,
            unpublished: 0,
        };
        if idle && left == done && equal {
            stable_rounds += 1;
            if stable_rounds >= 3 {
                break;
            }
        } else {
            stable_rounds = 0;
        }
        if quiesce.elapsed() > limit {
            let mut report = Vec::new();
            for &id in &ids {
                let (copy, truth) = (copy_items(&pool, id).await, oracle(&sim, id));
                if copy != truth {
                    report.push(format!(
                        "endpoint {id}: {} items, oracle {}: {}",
                        copy.len(),
                        truth.len(),
                        describe_difference(&copy, &truth)
                    ));
                }
            }
            panic!(
                "seed {seed}: not quiescent within {limit:?} (upstream idle {idle}, {left:?}): {}",
                report.join(" | ")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let quiesced_in = quiesce.elapsed();
    // The publisher is done: stop it, so the queues' counts are final.
    publisher.stop().await;

    // 6a. Each endpoint's copy, read through the API with its tenant's token, is the oracle's;
    // its state says nothing is left.
    let mut items_total = 0;
    for &id in &ids {
        let (_, token) = &owner[&id];
        let truth = oracle(&sim, id);
        let read = api.copy(token, id).await;
        assert!(
            read == truth,
            "seed {seed}: endpoint {id}'s copy through the API is not the oracle's ({} items, \
             oracle {}): {}",
            read.len(),
            truth.len(),
            describe_difference(&read, &truth)
        );
        items_total += read.len();
        let state = api
            .ok(
                200,
                "GET",
                &format!("/v1/endpoints/{id}/state"),
                token,
                None,
            )
            .await;
        assert_eq!(state["messages_waiting"], 0, "seed {seed}: {state}");
        assert_eq!(state["outbox_backlog"], 0, "seed {seed}: {state}");
        assert_eq!(state["reload_running"], false, "seed {seed}: {state}");
        assert_eq!(
            state["last_change_seq"].as_i64(),
            Some(change_count(&pool, id).await),
            "seed {seed}: {state}"
        );
    }

    // 6b. Each tenant's queue rebuilds each of its endpoints' copies: the oracle's items, every
    // change sequence once, none of another tenant, repeats only of the same message.
    let broker = relay_publisher::broker::connect(
        &vhost.url_via(amqp_addr()),
        "test",
        Duration::from_secs(10),
    )
    .await
    .expect("the pipeline test needs RabbitMQ on 127.0.0.1:5672");
    let mut messages_total = 0;
    let mut repeats_total = 0;
    for (tenant, _) in &tenants {
        let own: Vec<Uuid> = ids
            .iter()
            .copied()
            .filter(|id| owner[id].0 == *tenant)
            .collect();
        let mut tenant_changes = 0;
        for &id in &own {
            tenant_changes += change_count(&pool, id).await;
        }
        // The queue is declared with the tenant's first publish: an endpoint whose filter
        // selects nothing may have no change at all, and a tenant of only such endpoints no
        // queue.
        let messages = if tenant_changes > 0 {
            drain(&broker, &tenant_queue(*tenant)).await
        } else {
            Vec::new()
        };
        let mut consumer = ReferenceConsumer::new(*tenant);
        let mut bodies: HashMap<String, Value> = HashMap::new();
        for delivered in &messages {
            let message = ChangeMessage::decode(&delivered.body)
                .unwrap_or_else(|e| panic!("seed {seed}: an undecodable message: {e}"));
            assert_eq!(
                message.tenant_id, *tenant,
                "seed {seed}: another tenant's change in {tenant}'s queue"
            );
            assert!(
                own.contains(&message.webhook_endpoint_id),
                "seed {seed}: endpoint {} is not {tenant}'s",
                message.webhook_endpoint_id
            );
            assert_eq!(delivered.message_id, message.message_id(), "seed {seed}");
            assert_eq!(
                delivered.message_id,
                format!("{}:{}", message.webhook_endpoint_id, message.change_seq),
                "seed {seed}"
            );
            assert_eq!(delivered.kind, message.operation.as_str(), "seed {seed}");
            let body: Value = serde_json::from_slice(&delivered.body).unwrap();
            match bodies.get(&delivered.message_id) {
                Some(first) => {
                    assert_eq!(
                        first, &body,
                        "seed {seed}: message {} came twice with different content",
                        delivered.message_id
                    );
                    repeats_total += 1;
                }
                None => {
                    bodies.insert(delivered.message_id.clone(), body);
                }
            }
            consumer.receive(&message);
        }
        let stats = consumer.stats();
        assert_eq!(
            stats.gaps, 0,
            "seed {seed}: tenant {tenant}: changes missing or out of order: {stats:?}"
        );
        assert_eq!(stats.other_tenant, 0, "seed {seed}: {stats:?}");
        assert_eq!(stats.removals_of_nothing, 0, "seed {seed}: {stats:?}");
        assert_eq!(
            stats.duplicates as usize,
            messages.len() - bodies.len(),
            "seed {seed}: a repeat that is not of the same message_id: {stats:?}"
        );
        for &id in &own {
            let count = change_count(&pool, id).await;
            assert_eq!(
                consumer.last_change_seq(id),
                count,
                "seed {seed}: endpoint {id} has {count} changes"
            );
            let received: BTreeSet<i64> = bodies
                .values()
                .filter(|b| b["webhook_endpoint_id"] == id.to_string())
                .map(|b| b["change_seq"].as_i64().unwrap())
                .collect();
            assert_eq!(
                received,
                (1..=count).collect::<BTreeSet<i64>>(),
                "seed {seed}: endpoint {id}: a change sequence is missing"
            );
            let truth = oracle(&sim, id);
            let rebuilt = consumer.items(id);
            assert!(
                rebuilt == without_positions(&truth),
                "seed {seed}: endpoint {id}'s copy rebuilt from the queue ({} items) is not the \
                 oracle's ({} items)",
                rebuilt.len(),
                truth.len()
            );
        }
        messages_total += messages.len();
    }

    assert!(
        messages_total > 0,
        "seed {seed}: no change was published at all"
    );

    // 6c. A tenant's token on another tenant's endpoint: 404, never its data.
    for &id in &ids {
        let (tenant, _) = &owner[&id];
        for (other, token) in tenants.iter().filter(|(t, _)| t != tenant) {
            for path in [
                format!("/v1/endpoints/{id}/copy"),
                format!("/v1/endpoints/{id}/state"),
                format!("/v1/endpoints/{id}"),
            ] {
                let answer = api.call("GET", &path, token, None).await;
                assert_eq!(
                    answer.status, 404,
                    "seed {seed}: tenant {other} on {tenant}'s {path}: {}",
                    answer.text
                );
                assert!(
                    !answer.text.contains("\"data\""),
                    "seed {seed}: {}",
                    answer.text
                );
            }
        }
    }

    eprintln!(
        "pipeline: seed {seed} passed: {} endpoints, {steps} workload steps, {items_total} items, \
         {messages_total} messages ({repeats_total} repeats), {broker_errors} broker errors before \
         the kill, {:.1} s to quiesce",
        ids.len(),
        quiesced_in.as_secs_f64()
    );

    // 7. Clean up: the servers stop; the vhost, the Redis keys and the database go when their
    // guards drop.
    let _ = broker.close(200, "done").await;
    sim.shutdown();
    for sender in senders {
        let _ = sender.await;
    }
    sequencer.stop().await;
    api.server.stop().await.unwrap();
    app.stop().await;
    drop(proxy);
    drop(vhost);
    drop(prefix);
}
