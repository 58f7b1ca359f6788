//! The publisher against real Postgres, Redis and RabbitMQ: changes written into the outbox by
//! the sequencer's own statements (relay-store's `runs` and `copy::merge`, through the stack's
//! `CopyWriter`) reach each tenant's
//! destination once confirmed and in order, and the copy rebuilt from each tenant's queue by the
//! reference consumer equals the copy in Postgres, through broker outages, deleted queues,
//! unreachable tenant brokers, several publishers and a publisher killed between confirm and
//! mark.
//!
//! Each test has a database, a RabbitMQ vhost (made and deleted with `rabbitmqctl`) and a Redis
//! key prefix of its own. Writes are random from a seed printed with every failure;
//! RELAY_TEST_SEED replays one.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use relay_publisher::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use relay_publisher::lapin::types::{AMQPValue, FieldTable};
use relay_publisher::lapin::{Channel, Connection, ExchangeKind, Queue};
use relay_publisher::{
    tenant_queue, BeforeMark, ChangeMessage, ConsumerStats, Publisher, PublisherConfig,
    PublisherHandle, ReferenceConsumer, TailArgs, TailOutput,
};
use relay_rules::{DestinationPolicy, HeldContent, Pass, ReadItem, StoredMessage};
use relay_store::copy::Merged;
use relay_tests::{
    amqp_addr, redis_url, rows_of, seed, PgProxy, ProxyMode, RedisPrefix, TestDb, Vhost,
};
use relay_wire::{FeedItem, Message, Sequence};
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use crate::stack::{connect_broker, metric, series, CopyWriter};

// ---- Environment: Redis, RabbitMQ, a vhost per test ----

/// Everything one test stands on.
pub(crate) struct Env {
    pub(crate) db: TestDb,
    pub(crate) vhost: Vhost,
    prefix: RedisPrefix,
    pub(crate) seed: u64,
}

impl Env {
    /// A test's environment and the random source of its seed.
    pub(crate) async fn seeded() -> (Self, StdRng) {
        let env = Self::new().await;
        let rng = StdRng::seed_from_u64(env.seed);
        (env, rng)
    }

    pub(crate) async fn new() -> Self {
        let seed = seed();
        eprintln!("publisher test seed: {seed} (RELAY_TEST_SEED replays it)");
        Self {
            db: TestDb::new().await,
            vhost: tokio::task::spawn_blocking(Vhost::create).await.unwrap(),
            prefix: RedisPrefix(format!("relay-test:{}:", Uuid::new_v4().simple())),
            seed,
        }
    }

    /// Settings for tests: short waits so failures are noticed and retried quickly.
    pub(crate) fn config(&self, amqp_url: String) -> PublisherConfig {
        PublisherConfig {
            amqp_url,
            redis_url: redis_url(),
            key_prefix: self.prefix.0.clone(),
            poll_interval: Duration::from_millis(20),
            lease: Duration::from_millis(1_500),
            connect_timeout: Duration::from_millis(1_000),
            confirm_timeout: Duration::from_secs(10),
            retry_min: Duration::from_millis(20),
            retry_max: Duration::from_millis(300),
            idle_release: Duration::from_millis(500),
            // Each mark as soon as the one before ended, so that a test's writes take several
            // rounds (the hooks count them).
            mark_interval: Duration::ZERO,
            metrics_interval: Duration::from_millis(100),
            destination_refresh: Duration::from_millis(300),
            // Every broker here is on 127.0.0.1; a tenant's "own" broker is the test's vhost
            // behind a proxy of its own (the relay's broker itself is refused).
            destination_policy: DestinationPolicy {
                allow_private: true,
                ..DestinationPolicy::default()
            },
            ..PublisherConfig::default()
        }
    }

    pub(crate) async fn start(
        &self,
        config: PublisherConfig,
    ) -> (PublisherHandle, prometheus::Registry) {
        let registry = prometheus::Registry::new();
        let handle = Publisher::start(self.db.pool.clone(), config, relay_tests::keys(), &registry)
            .await
            .expect("the tests need Redis on 127.0.0.1:6379");
        (handle, registry)
    }

    pub(crate) async fn broker(&self) -> Connection {
        connect_broker(&self.vhost.url(), "publisher").await
    }
}

/// Returns `delivery` to its queue (a nack with requeue), as a consumer that could not take it.
pub(crate) async fn put_back(delivery: &relay_publisher::lapin::message::Delivery) {
    delivery
        .nack(BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        })
        .await
        .unwrap();
}

/// Waits for `check` to hold, polling; panics with `what` after `timeout`.
pub(crate) async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Points `tenant`'s destination straight at its own exchange on the broker at `amqp_url` (the
/// store's write the control plane makes, URL sealed, without the control plane's checks).
pub(crate) async fn set_own_exchange(
    pool: &PgPool,
    tenant: Uuid,
    amqp_url: &str,
    exchange: &str,
    routing_key: &str,
) {
    relay_store::destinations::set(
        pool,
        &relay_tests::keys(),
        relay_store::TenantId(tenant),
        &relay_store::destinations::Destination::OwnExchange {
            amqp_url: amqp_url.into(),
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
        },
    )
    .await
    .unwrap();
}

pub(crate) async fn unpublished(pool: &PgPool, tenants: &[Uuid]) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM changes c LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = c.endpoint_id
         WHERE c.change_seq > COALESCE(p.published_through, 0) AND c.tenant_id = ANY($1)",
    )
    .bind(tenants)
    .fetch_one(pool)
    .await
    .unwrap()
}

pub(crate) async fn wait_published(pool: &PgPool, tenants: &[Uuid], seed: u64) {
    wait_until(
        &format!("every change of {tenants:?} published (seed {seed})"),
        Duration::from_secs(120),
        || async { unpublished(pool, tenants).await == 0 },
    )
    .await;
}

// ---- Realistic outbox rows: feed messages and reloads through the sequencer's statements ----

fn subject(s: u32) -> String {
    format!("announcement:{s}")
}

/// An item at (subject, n); two parts whose versions move with n.
fn item_json(s: u32, n: u64) -> Value {
    let v = (n / 2) as i64;
    let mut parts = vec![
        json!({"kind": "flash", "part_id": "flash:1", "part_version": v}),
        json!({"kind": "flash", "part_id": "flash:2", "part_version": 1}),
    ];
    if v % 2 == 0 {
        parts.pop();
    }
    json!({"type": "item", "feed_item_id": subject(s), "item_kind": "announcement",
           "seq": n, "first_seq": n, "op": "changed", "changes": [], "parts": parts,
           "company": {"company_id": 28, "name": "Alfa Group AB"}, "lang": "en",
           "head": {"title": format!("item {s} at {n}")}})
}

/// The access_version every feed's messages and pages carry.
const AV: &str = "b4d934cf";

/// A feed item's event at sequence `n`: an update of subject `s`, or its removal.
fn feed_event(id: &str, s: u32, n: u64, removal: bool) -> Value {
    let sequence = Sequence::from_parts(1, n);
    if removal {
        json!({"id": id, "type": "announcement.hidden", "subject": subject(s),
               "sequence": sequence.as_str(), "specversion": "1.0",
               "data": {"type": "hidden", "feed_item_id": subject(s), "seq": n}})
    } else {
        json!({"id": id, "type": "announcement.updated", "subject": subject(s),
               "sequence": sequence.as_str(), "specversion": "1.0", "data": item_json(s, n)})
    }
}

/// A v1 message of generation `g` holding `event`, parsed by relay_wire as the sequencer parses
/// what it stored.
fn feed_message(endpoint: Uuid, g: u64, event: &Value) -> StoredMessage {
    let through = event["sequence"].clone();
    let body = json!({"v": 1, "webhook_endpoint_id": endpoint, "track": "feed",
                      "generation": g, "access_version": AV, "since": "1.0",
                      "through": through, "complete": true, "events": [event]});
    Ok(Message::parse(body.to_string().as_bytes()).unwrap())
}

/// A reset to generation `g` (it begins a reload under `g`).
fn reset_message(endpoint: Uuid, g: u64) -> StoredMessage {
    let body = json!({"v": 1, "webhook_endpoint_id": endpoint, "track": "feed",
                      "generation": g, "access_version": AV,
                      "events": [{"id": format!("evt_{}_reset_{g}", endpoint.simple()),
                                  "type": "webhook_endpoint.reset", "specversion": "1.0",
                                  "data": {"access_version": AV, "generation": g,
                                           "reason": "behind", "track": "feed"}}]});
    Ok(Message::parse(body.to_string().as_bytes()).unwrap())
}

/// One endpoint's upstream, its messages and reloads written into the copy by the sequencer's
/// own statements ([`CopyWriter`]).
pub(crate) struct Feed {
    tenant: Uuid,
    endpoint: Uuid,
    writer: CopyWriter,
    generation: u64,
    n: u64,
    /// Every feed event sent, with its message's generation.
    sent: Vec<(u64, Value)>,
}

/// A feed for each of `tenants`, in order.
pub(crate) async fn feeds_of(db: &TestDb, tenants: impl IntoIterator<Item = Uuid>) -> Vec<Feed> {
    let mut feeds = Vec::new();
    for tenant in tenants {
        feeds.push(Feed::new(db, tenant).await);
    }
    feeds
}

impl Feed {
    /// A registered endpoint of `tenant` whose copy was read (empty) under generation 1: a reset
    /// and its reload's merge, so its messages apply without beginning another.
    pub(crate) async fn new(db: &TestDb, tenant: Uuid) -> Self {
        let endpoint = Uuid::new_v4();
        let mut feed = Self {
            tenant,
            endpoint,
            writer: CopyWriter::new(db, tenant, endpoint).await,
            generation: 1,
            n: 0,
            sent: Vec::new(),
        };
        feed.reload(&db.pool, BTreeSet::new()).await;
        feed
    }

    /// One random step, each write a transaction of its own: mostly updates, some removals, a
    /// duplicate or a late event of an older generation now and then, and an occasional reload
    /// of the next generation (a reset, then a merge of what it read and a drop of everything
    /// older).
    async fn step(&mut self, pool: &PgPool, rng: &mut StdRng) {
        let roll = rng.gen_range(0..100);
        if roll < 6 {
            // A reload of the next generation reads a few items.
            self.generation += 1;
            let mut read = BTreeSet::new();
            for _ in 0..rng.gen_range(0..5) {
                read.insert(rng.gen_range(1..=6u32));
            }
            self.reload(pool, read).await;
        } else if roll < 12 && !self.sent.is_empty() {
            // The upstream sends an event again (or an old generation's event arrives late).
            let (g, event) = self.sent[rng.gen_range(0..self.sent.len())].clone();
            let message = feed_message(self.endpoint, g, &event);
            self.writer.run(pool, &[message], &HashMap::new()).await;
        } else {
            self.n += 1;
            let removal = roll >= 85;
            let s = rng.gen_range(1..=6u32);
            let id = format!("evt_{}_{}", self.endpoint.simple(), self.n);
            let event = feed_event(&id, s, self.n, removal);
            let message = feed_message(self.endpoint, self.generation, &event);
            self.writer.run(pool, &[message], &HashMap::new()).await;
            self.sent.push((self.generation, event));
        }
    }

    /// `events` new events of the feed's generation (updates of any of 40 subjects, some
    /// removals), written in runs of 100 messages, each run one transaction: a burst of about as
    /// many changes.
    async fn burst(&mut self, pool: &PgPool, rng: &mut StdRng, events: usize) {
        let mut messages = Vec::new();
        for _ in 0..events {
            self.n += 1;
            let s = rng.gen_range(1..=40u32);
            let removal = rng.gen_range(0..100) < 10;
            let id = format!("evt_{}_{}", self.endpoint.simple(), self.n);
            let event = feed_event(&id, s, self.n, removal);
            messages.push(feed_message(self.endpoint, self.generation, &event));
            self.sent.push((self.generation, event));
            if messages.len() == 100 {
                self.writer.run(pool, &messages, &HashMap::new()).await;
                messages.clear();
            }
        }
        if !messages.is_empty() {
            self.writer.run(pool, &messages, &HashMap::new()).await;
        }
    }

    /// A reset to the feed's generation, and its reload's one pass, reading `read`.
    async fn reload(&mut self, pool: &PgPool, read: BTreeSet<u32>) {
        let g = self.generation;
        let plan = self
            .writer
            .run(pool, &[reset_message(self.endpoint, g)], &HashMap::new())
            .await;
        let reload = plan
            .track
            .and_then(|track| track.reload)
            .expect("a newer reset begins a reload");
        let mut items = Vec::new();
        for s in read {
            self.n += 1;
            items.push(ReadItem {
                subject: subject(s),
                sequence: Sequence::from_parts(1, self.n),
                item: FeedItem::from_value(item_json(s, self.n), "data[0].item").unwrap(),
            });
        }
        let pass = Pass {
            page_access_versions: vec![AV.to_owned()],
            items,
            upstream_generation: Some(g),
            read_again_at_start: 0,
        };
        let merged = self.writer.merge(pool, &reload, &pass).await;
        assert!(matches!(merged, Merged::Merged { .. }), "{merged:?}");
    }
}

/// Random steps over `feeds`, `steps` in all.
pub(crate) async fn write(pool: &PgPool, feeds: &mut [Feed], rng: &mut StdRng, steps: usize) {
    for _ in 0..steps {
        let i = rng.gen_range(0..feeds.len());
        feeds[i].step(pool, rng).await;
    }
}

pub(crate) async fn change_count_of(pool: &PgPool, tenant: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM changes WHERE tenant_id = $1")
        .bind(tenant)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn change_count(pool: &PgPool, endpoint: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM changes WHERE endpoint_id = $1")
        .bind(endpoint)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The items of the endpoint's copy in Postgres (tombstones left out: no message carries them).
async fn postgres_items(pool: &PgPool, endpoint: Uuid) -> BTreeMap<String, Value> {
    relay_tests::readback::copy_rows(pool, endpoint)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|(s, held)| match held.content {
            HeldContent::Item { item, .. } => Some((s, item)),
            HeldContent::Tombstone => None,
        })
        .collect()
}

// ---- Reading a queue ----

/// One message as it came off a queue.
#[derive(Debug, Clone)]
pub(crate) struct Delivered {
    pub(crate) message_id: String,
    pub(crate) kind: String,
    content_type: String,
    delivery_mode: u8,
    timestamp: u64,
    pub(crate) body: Vec<u8>,
}

impl Delivered {
    fn of(delivery: &relay_publisher::lapin::message::Delivery) -> Self {
        let p = &delivery.properties;
        let text = |s: &Option<relay_publisher::lapin::types::ShortString>| {
            s.as_ref().map(|s| s.to_string()).unwrap_or_default()
        };
        Self {
            message_id: text(p.message_id()),
            kind: text(p.kind()),
            content_type: text(p.content_type()),
            delivery_mode: p.delivery_mode().unwrap_or(0),
            timestamp: p.timestamp().unwrap_or(0),
            body: delivery.data.clone(),
        }
    }
}

/// A passive declare of `queue` on `channel`: the queue's message and consumer counts, or the
/// broker's error (no such queue).
pub(crate) async fn declare_passive(
    channel: &Channel,
    queue: &str,
) -> Result<Queue, relay_publisher::lapin::Error> {
    channel
        .queue_declare(
            queue,
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
}

/// Reads every message in the queue (the publishers are stopped, so the count is final), in
/// queue order. With `ack` they are removed; without, the broker puts them back when the
/// channel closes.
pub(crate) async fn drain(broker: &Connection, queue: &str, ack: bool) -> Vec<Delivered> {
    let channel = broker.create_channel().await.unwrap();
    let count = declare_passive(&channel, queue)
        .await
        .unwrap()
        .message_count() as usize;
    // No prefetch limit: without acks it would stop deliveries. Taking them off the queue is
    // the broker's own acknowledgement on delivery, not one ack each: a quorum queue settles
    // acks apart from the channel, so the acks of a consumer closed just after it acked may not
    // have been taken yet, and the queue puts those messages back (a second drain of the queue
    // would see them again). The count is final (nothing publishes), so nothing more comes that
    // would be taken off unread.
    channel
        .basic_qos(0, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = channel
        .basic_consume(
            queue,
            "drain",
            BasicConsumeOptions {
                no_ack: ack,
                ..BasicConsumeOptions::default()
            },
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
        out.push(Delivered::of(&delivery));
    }
    let _ = channel.close(200, "drained").await;
    out
}

/// A consumer reading (and acknowledging) the queue in the background while publishers run.
pub(crate) struct Collector {
    received: Arc<Mutex<Vec<Delivered>>>,
    /// Microseconds waited before acknowledging each delivery.
    pace: Arc<std::sync::atomic::AtomicU64>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Collector {
    pub(crate) async fn start(broker: &Connection, queue: &str) -> Self {
        Self::paced(broker, queue, 50, Duration::ZERO).await
    }

    /// A collector that takes at most `prefetch` deliveries at once and waits `pace` before
    /// acknowledging each (see [`Collector::set_pace`]): a slow consumer keeps a bounded queue
    /// about full.
    pub(crate) async fn paced(
        broker: &Connection,
        queue: &str,
        prefetch: u16,
        pace: Duration,
    ) -> Self {
        let pace = Arc::new(std::sync::atomic::AtomicU64::new(pace.as_micros() as u64));
        let channel = broker.create_channel().await.unwrap();
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .unwrap();
        let mut consumer = channel
            .basic_consume(
                queue,
                "collector",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let received = Arc::new(Mutex::new(Vec::new()));
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let into = received.clone();
        let paced = pace.clone();
        let task = tokio::spawn(async move {
            loop {
                let delivery = tokio::select! {
                    _ = stopped.changed() => break,
                    next = consumer.next() => match next {
                        Some(Ok(delivery)) => delivery,
                        _ => break,
                    },
                };
                into.lock().unwrap().push(Delivered::of(&delivery));
                let pace = paced.load(std::sync::atomic::Ordering::Relaxed);
                if pace > 0 {
                    tokio::time::sleep(Duration::from_micros(pace)).await;
                }
                delivery.ack(BasicAckOptions::default()).await.unwrap();
            }
            let _ = channel.close(200, "collected").await;
        });
        Self {
            received,
            pace,
            stop,
            task,
        }
    }

    /// From now on, waits `pace` before acknowledging each delivery.
    pub(crate) fn set_pace(&self, pace: Duration) {
        self.pace.store(
            pace.as_micros() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    fn distinct(&self) -> usize {
        let received = self.received.lock().unwrap();
        received
            .iter()
            .map(|d| d.message_id.as_str())
            .collect::<BTreeSet<_>>()
            .len()
    }

    /// What came so far, in order.
    pub(crate) fn received(&self) -> Vec<Delivered> {
        self.received.lock().unwrap().clone()
    }

    pub(crate) async fn finish(self) -> Vec<Delivered> {
        self.stop.send_replace(true);
        self.task.await.unwrap();
        let received = self.received.lock().unwrap();
        received.clone()
    }
}

/// `relay tail` over `tenant`'s queue on the test's vhost, acknowledging what it reads, until the
/// queue is idle for 3 s: its stats and what it printed.
/// `relay tail` over the tenant's queue, acknowledging, resuming `after` these positions.
async fn tail(
    env: &Env,
    tenant: Uuid,
    output: TailOutput,
    after: Vec<(Uuid, u64, i64)>,
) -> (ConsumerStats, Vec<u8>) {
    let mut out = Vec::new();
    let stats = relay_publisher::tail_until(
        &TailArgs {
            tenant,
            amqp_url: env.vhost.url(),
            queue: None,
            ack: true,
            idle_exit_ms: 3_000,
            output,
            after,
        },
        &relay_netguard::TrustRoots::platform(),
        &mut out,
        std::future::pending(),
    )
    .await
    .unwrap();
    (stats, out)
}

/// Declares `queue` with `options` and `arguments` and binds it to `exchange` under
/// `routing_key`.
pub(crate) async fn bind_queue(
    channel: &Channel,
    queue: &str,
    options: QueueDeclareOptions,
    arguments: FieldTable,
    exchange: &str,
    routing_key: &str,
) {
    channel
        .queue_declare(queue, options, arguments)
        .await
        .unwrap();
    channel
        .queue_bind(
            queue,
            exchange,
            routing_key,
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
}

fn schema() -> jsonschema::Validator {
    jsonschema::options()
        .should_validate_formats(true)
        .build(&serde_json::from_str(relay_publisher::SCHEMA).unwrap())
        .unwrap()
}

/// Checks every message (schema, properties, tenant) and rebuilds the tenant's copies; returns
/// the consumer and how often each message_id came.
fn rebuild(
    tenant: Uuid,
    messages: &[Delivered],
    seed: u64,
) -> (ReferenceConsumer, HashMap<String, usize>) {
    let schema = schema();
    let mut consumer = ReferenceConsumer::new(tenant);
    let mut seen = HashMap::new();
    for delivered in messages {
        let body: Value = serde_json::from_slice(&delivered.body).unwrap();
        let errors: Vec<String> = schema.iter_errors(&body).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "seed {seed}: {errors:?} in {body}");
        let message = ChangeMessage::decode(&delivered.body).unwrap();
        assert_eq!(
            message.tenant_id, tenant,
            "seed {seed}: another tenant's change in {tenant}'s queue"
        );
        assert_eq!(delivered.message_id, message.message_id(), "seed {seed}");
        assert_eq!(delivered.kind, message.operation.as_str(), "seed {seed}");
        assert_eq!(delivered.content_type, "application/json", "seed {seed}");
        assert_eq!(delivered.delivery_mode, 2, "seed {seed}: not persistent");
        assert_eq!(
            delivered.timestamp as i64,
            message.changed_at.unix_timestamp(),
            "seed {seed}"
        );
        consumer.receive(&message);
        *seen.entry(delivered.message_id.clone()).or_insert(0) += 1;
    }
    (consumer, seen)
}

/// Drains each tenant's queue and checks that the reference consumer rebuilds, from it alone,
/// every copy of the tenant's feeds as Postgres holds it.
async fn assert_queues_rebuild(env: &Env, tenants: &[Uuid], feeds: &[Feed]) {
    assert_queues_rebuild_checking(env, tenants, feeds, |_, _| {}).await;
}

/// [`assert_queues_rebuild`], with `check` run first on each tenant's consumer and on how often
/// each message_id came.
async fn assert_queues_rebuild_checking(
    env: &Env,
    tenants: &[Uuid],
    feeds: &[Feed],
    check: impl Fn(&ReferenceConsumer, &HashMap<String, usize>),
) {
    let broker = env.broker().await;
    for &tenant in tenants {
        let messages = drain(&broker, &tenant_queue(tenant), true).await;
        let (consumer, seen) = rebuild(tenant, &messages, env.seed);
        check(&consumer, &seen);
        let own: Vec<&Feed> = feeds.iter().filter(|f| f.tenant == tenant).collect();
        assert_rebuilt(&env.db.pool, &consumer, &own, env.seed).await;
    }
}

/// The rebuilt copy of every feed equals Postgres' copy; every change came, in order (no gap).
async fn assert_rebuilt(pool: &PgPool, consumer: &ReferenceConsumer, feeds: &[&Feed], seed: u64) {
    let stats = consumer.stats();
    assert_eq!(
        stats.waiting, 0,
        "seed {seed}: changes out of order or missing: {stats:?}"
    );
    assert_eq!(stats.other_tenant, 0, "seed {seed}");
    for feed in feeds {
        let count = change_count(pool, feed.endpoint).await;
        assert_eq!(
            consumer.position(feed.endpoint),
            (relay_publisher::FIRST_EPOCH, count),
            "seed {seed}: endpoint {} has {count} changes",
            feed.endpoint
        );
        assert_eq!(
            consumer.items(feed.endpoint),
            postgres_items(pool, feed.endpoint).await,
            "seed {seed}: endpoint {}",
            feed.endpoint
        );
    }
}

// ---- The tests ----

/// Two tenants, three endpoints each, written before and while the publisher runs: each
/// tenant's queue holds exactly its own changes, once each, gapless and in order, and both the
/// reference consumer and `relay tail` rebuild each endpoint's copy from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenants_queue_rebuilds_its_copies_once_and_in_order() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenants = [env.db.tenant().await, env.db.tenant().await];
    let mut feeds = feeds_of(&env.db, (0..6).map(|i| tenants[i % 2])).await;
    write(pool, &mut feeds, &mut rng, 120).await;

    let (publisher, registry) = env.start(env.config(env.vhost.url())).await;
    write(pool, &mut feeds, &mut rng, 120).await;
    wait_published(pool, &tenants, seed).await;
    publisher.stop().await;

    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM changes")
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(total > 100, "seed {seed}: only {total} changes written");
    // Without a crash, nothing is sent twice.
    assert_eq!(
        metric(&registry, "relay_publisher_changes_marked_total"),
        total as f64
    );
    assert_eq!(
        metric(&registry, "relay_publisher_messages_confirmed_total"),
        total as f64
    );
    assert_eq!(
        metric(&registry, "relay_publisher_messages_published_total"),
        total as f64
    );
    assert_eq!(
        metric(&registry, "relay_publisher_publish_latency_seconds"),
        total as f64
    );
    assert_eq!(
        metric(&registry, "relay_publisher_confirm_wait_seconds"),
        total as f64
    );
    assert_eq!(metric(&registry, "relay_publisher_tenants_owned"), 0.0);

    assert_queues_rebuild_checking(&env, &tenants, &feeds, |consumer, seen| {
        assert!(
            seen.values().all(|&n| n == 1),
            "seed {seed}: a message came twice"
        );
        assert_eq!(consumer.stats().duplicates, 0, "seed {seed}");
    })
    .await;

    // `relay tail` over a queue: write more, publish, and let tail read and acknowledge. The
    // queue was drained above: tail resumes after each endpoint's last change drained.
    let tenant = tenants[0];
    let mut drained = Vec::new();
    for feed in feeds.iter().filter(|f| f.tenant == tenant) {
        drained.push((
            feed.endpoint,
            relay_publisher::FIRST_EPOCH,
            change_count(pool, feed.endpoint).await,
        ));
    }
    let (publisher, _registry) = env.start(env.config(env.vhost.url())).await;
    write(pool, &mut feeds, &mut rng, 60).await;
    wait_published(pool, &tenants, seed).await;
    publisher.stop().await;
    let (stats, out) = tail(&env, tenant, TailOutput::Changes, drained).await;
    let lines: Vec<ChangeMessage> = String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| ChangeMessage::decode(l.as_bytes()).unwrap())
        .collect();
    assert_eq!(stats.applied, lines.len() as u64, "seed {seed}: {stats:?}");
    assert_eq!(stats.waiting, 0, "seed {seed}: {stats:?}");
    for feed in feeds.iter().filter(|f| f.tenant == tenant) {
        let seqs: Vec<i64> = lines
            .iter()
            .filter(|m| m.webhook_endpoint_id == feed.endpoint)
            .map(|m| m.change_seq)
            .collect();
        let published_before: i64 =
            sqlx::query_scalar("SELECT count(*) FROM changes WHERE endpoint_id = $1")
                .bind(feed.endpoint)
                .fetch_one(pool)
                .await
                .unwrap();
        let first = published_before - seqs.len() as i64 + 1;
        let expected: Vec<i64> = (first..=published_before).collect();
        assert_eq!(seqs, expected, "seed {seed}: endpoint {}", feed.endpoint);
    }
}

/// A replay and a resync asked while a publisher holds the tenant, and would keep holding it (a
/// tenant with a steady flow of changes is never idle long enough to be let go; here the idle
/// release is longer than the test), are sent: the move takes the tenant's publishing token, and
/// the holder, whose memory of what it read the move made wrong and which may have nothing to
/// mark, learns so at its next sweep, gives the tenant (and its lease) up, and its successor
/// sends from the moved cursor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_and_a_resync_while_a_publisher_holds_the_tenant_are_sent() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenant = env.db.tenant().await;
    let mut feeds = feeds_of(&env.db, [tenant]).await;
    write(pool, &mut feeds, &mut rng, 20).await;
    let moved = feeds.remove(0);
    let (endpoint, tenant_id) = (
        relay_store::EndpointId(moved.endpoint),
        relay_store::TenantId(tenant),
    );
    let config = PublisherConfig {
        idle_release: Duration::from_secs(600),
        ..env.config(env.vhost.url())
    };
    let (publisher, registry) = env.start(config).await;
    wait_published(pool, &[tenant], seed).await;

    let last = change_count(pool, moved.endpoint).await;
    let replayed = relay_store::changes::replay(pool, tenant_id, endpoint, 1)
        .await
        .unwrap();
    assert!(
        matches!(
            replayed,
            Some(relay_store::changes::Replay::Replaying { .. })
        ),
        "seed {seed}: {replayed:?}"
    );
    wait_published(pool, &[tenant], seed).await;
    let resynced = relay_store::restores::resync(pool, tenant_id, endpoint)
        .await
        .unwrap();
    let Some(relay_store::restores::Resync::Begun { epoch, .. }) = resynced else {
        panic!("seed {seed}: {resynced:?}");
    };
    wait_published(pool, &[tenant], seed).await;
    publisher.stop().await;
    assert!(
        metric(&registry, "relay_publisher_ownership_losses_total") >= 2.0,
        "seed {seed}: the holder gave the tenant up at each move"
    );

    // The queue holds the moved endpoint's first epoch twice over, then the new epoch whole.
    let broker = env.broker().await;
    let delivered = drain(&broker, &tenant_queue(tenant), true).await;
    let mut seen: HashMap<String, usize> = HashMap::new();
    for message in &delivered {
        *seen.entry(message.message_id.clone()).or_default() += 1;
    }
    for seq in 1..=last {
        let id = format!("{}:{}:{seq}", moved.endpoint, relay_publisher::FIRST_EPOCH);
        assert!(
            seen.get(&id).copied().unwrap_or(0) >= 2,
            "seed {seed}: change {id} was not sent again by the replay"
        );
    }
    let new_epoch = change_count(pool, moved.endpoint).await;
    assert!(new_epoch >= 2, "seed {seed}: the new epoch's snapshot");
    for seq in 1..=new_epoch {
        let id = format!("{}:{epoch}:{seq}", moved.endpoint);
        assert!(
            seen.contains_key(&id),
            "seed {seed}: change {id} of the resync's epoch was never sent"
        );
    }
    let _ = broker.close(200, "done").await;
}

/// A consumer that takes changes and puts them back (a nack with requeue, a connection lost
/// before its acks) lets the quorum queue deliver later changes before earlier ones. `relay
/// tail` read after it holds each change until its predecessors come: the copy it prints is
/// whole and in order, and nothing is left waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_holds_changes_redelivered_out_of_order_until_their_predecessors_come() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenant = env.db.tenant().await;
    let mut feeds = feeds_of(&env.db, [tenant; 2]).await;
    write(pool, &mut feeds, &mut rng, 120).await;
    let (publisher, _registry) = env.start(env.config(env.vhost.url())).await;
    wait_published(pool, &[tenant], seed).await;
    publisher.stop().await;

    // A consumer takes a seeded share of the queue, nacks some with requeue in a seeded order,
    // and goes away without acknowledging the rest.
    let broker = env.broker().await;
    let channel = broker.create_channel().await.unwrap();
    channel
        .basic_qos(0, BasicQosOptions::default())
        .await
        .unwrap();
    let mut deliveries = channel
        .basic_consume(
            &tenant_queue(tenant),
            "careless",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let take = rng.gen_range(20..60);
    let mut taken = Vec::new();
    while taken.len() < take {
        let delivery = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
            .await
            .expect("the queue delivers")
            .unwrap()
            .unwrap();
        taken.push(delivery);
    }
    let mut nacked: Vec<_> = taken.drain(..take / 2).collect();
    rand::seq::SliceRandom::shuffle(&mut nacked[..], &mut rng);
    for delivery in nacked {
        put_back(&delivery).await;
    }
    broker.close(200, "gone").await.unwrap();

    let (stats, out) = tail(&env, tenant, TailOutput::Copy, Vec::new()).await;
    eprintln!("seed {seed}: {take} taken and put back; tail: {stats:?}");
    assert!(
        stats.reordered > 0,
        "seed {seed}: the queue redelivered in order; nothing was held: {stats:?}"
    );
    assert_eq!(stats.waiting, 0, "seed {seed}: {stats:?}");
    assert_eq!(stats.removals_of_nothing, 0, "seed {seed}: {stats:?}");
    assert_tail_printed_the_copies(pool, out, &feeds, seed).await;
}

/// The broker goes away (connections refused, then accepted but silent) while changes are
/// written, and comes back: nothing is lost, nothing is out of order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_mid_run_loses_nothing_and_keeps_order() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenants = [env.db.tenant().await, env.db.tenant().await];
    let mut feeds = feeds_of(&env.db, (0..4).map(|i| tenants[i % 2])).await;
    let proxy = PgProxy::start(amqp_addr()).await;
    let config = PublisherConfig {
        // A silent broker is given up on sooner.
        confirm_timeout: Duration::from_secs(2),
        ..env.config(env.vhost.url_via(proxy.address))
    };
    let (publisher, registry) = env.start(config).await;

    write(pool, &mut feeds, &mut rng, 60).await;
    // Silent first (the open connection's publishes get no confirm), then refusing.
    for mode in [ProxyMode::Blackhole, ProxyMode::Refuse] {
        proxy.set(mode);
        let errors_before = metric(&registry, "relay_publisher_broker_errors_total");
        write(pool, &mut feeds, &mut rng, 60).await;
        // The outage is felt: a connect or publish failed (and the backlog waits).
        wait_until(
            &format!("a broker error under {mode:?} (seed {seed})"),
            Duration::from_secs(60),
            || async { metric(&registry, "relay_publisher_broker_errors_total") > errors_before },
        )
        .await;
        assert!(unpublished(pool, &tenants).await > 0, "seed {seed}");
    }
    proxy.set(ProxyMode::Pass);
    write(pool, &mut feeds, &mut rng, 60).await;
    wait_published(pool, &tenants, seed).await;
    publisher.stop().await;

    assert_queues_rebuild(&env, &tenants, &feeds).await;
}

/// More tenants than pooled connections: every tenant's marks and reads share a pool of
/// three. A mark's transaction must not sit on its connection while its tenant's task waits for
/// another one (as it did when the mark ran inside the task's loop: with every connection held
/// by a parked mark, each tenant's read waited out the pool's acquire timeout). Postgres never
/// fails the publisher, and every queue rebuilds its copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_tenants_than_connections_share_the_pool_without_timeouts() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let mut tenants = Vec::new();
    for _ in 0..12 {
        tenants.push(env.db.tenant().await);
    }
    let mut feeds = feeds_of(&env.db, (0..24).map(|i| tenants[i % 12])).await;
    write(pool, &mut feeds, &mut rng, 480).await;
    let publisher_pool = relay_store::connect(
        &env.db.url,
        &relay_store::PoolOptions {
            max_connections: 3,
            acquire_timeout: Duration::from_secs(2),
            ..relay_store::PoolOptions::default()
        },
    )
    .unwrap();
    let registry = prometheus::Registry::new();
    let publisher = Publisher::start(
        publisher_pool,
        env.config(env.vhost.url()),
        relay_tests::keys(),
        &registry,
    )
    .await
    .unwrap();
    write(pool, &mut feeds, &mut rng, 120).await;
    wait_published(pool, &tenants, seed).await;
    publisher.stop().await;
    assert_eq!(
        metric(&registry, "relay_publisher_postgres_errors_total"),
        0.0,
        "seed {seed}: the publisher waited out its pool"
    );

    assert_queues_rebuild(&env, &tenants, &feeds).await;
}

/// Someone deletes the tenant's queue while the publisher holds a connection to it: the next
/// publish comes back unroutable (not counted as published), the queue is declared again, and
/// every later change arrives in it, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_deleted_under_the_publisher_is_declared_again() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenant = env.db.tenant().await;
    let mut feeds = feeds_of(&env.db, [tenant; 3]).await;
    let config = PublisherConfig {
        // Keep the tenant (and its connection) between the two phases.
        idle_release: Duration::from_secs(600),
        ..env.config(env.vhost.url())
    };
    let (publisher, registry) = env.start(config).await;
    write(pool, &mut feeds, &mut rng, 50).await;
    wait_published(pool, &[tenant], seed).await;
    let before: Vec<i64> = {
        let mut counts = Vec::new();
        for feed in &feeds {
            counts.push(change_count(pool, feed.endpoint).await);
        }
        counts
    };

    let broker = env.broker().await;
    let channel = broker.create_channel().await.unwrap();
    channel
        .queue_delete(&tenant_queue(tenant), QueueDeleteOptions::default())
        .await
        .unwrap();
    write(pool, &mut feeds, &mut rng, 50).await;
    wait_published(pool, &[tenant], seed).await;
    publisher.stop().await;
    assert!(
        metric(&registry, "relay_publisher_messages_returned_total") >= 1.0,
        "seed {seed}: no publish came back from the deleted queue"
    );

    let messages = drain(&broker, &tenant_queue(tenant), true).await;
    let (_, seen) = rebuild(tenant, &messages, seed);
    assert!(seen.values().all(|&n| n == 1), "seed {seed}");
    for (feed, before) in feeds.iter().zip(before) {
        let seqs: Vec<i64> = messages
            .iter()
            .map(|m| ChangeMessage::decode(&m.body).unwrap())
            .filter(|m| m.webhook_endpoint_id == feed.endpoint)
            .map(|m| m.change_seq)
            .collect();
        let after = change_count(pool, feed.endpoint).await;
        let expected: Vec<i64> = (before + 1..=after).collect();
        assert_eq!(seqs, expected, "seed {seed}: endpoint {}", feed.endpoint);
    }
}

/// Tenant A's own topology on the test broker: the durable direct exchange `tenant-a`, and the
/// queue `tenant-a-changes` bound to it by the routing key `changes`.
async fn declare_tenant_a_topology(channel: &Channel) {
    channel
        .exchange_declare(
            "tenant-a",
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let queue_options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    bind_queue(
        channel,
        "tenant-a-changes",
        queue_options,
        FieldTable::default(),
        "tenant-a",
        "changes",
    )
    .await;
}

/// Tenant A sends to its own exchange on a broker that accepts connections and says nothing;
/// tenant B, on the relay's queue, is published in full meanwhile. When A's broker answers, A's
/// changes reach its exchange (and not the relay's queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_whose_broker_is_unreachable_does_not_stall_another() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let (a, b) = (env.db.tenant().await, env.db.tenant().await);

    // A's own topology: a direct exchange and a queue bound to it.
    let broker = env.broker().await;
    let channel = broker.create_channel().await.unwrap();
    declare_tenant_a_topology(&channel).await;
    let proxy = PgProxy::start(amqp_addr()).await;
    proxy.set(ProxyMode::Blackhole);
    set_own_exchange(
        pool,
        a,
        &env.vhost.url_via(proxy.address),
        "tenant-a",
        "changes",
    )
    .await;

    let mut feeds_a = feeds_of(&env.db, [a; 2]).await;
    let mut feeds_b = feeds_of(&env.db, [b; 2]).await;
    let (publisher, registry) = env.start(env.config(env.vhost.url())).await;
    for _ in 0..3 {
        write(pool, &mut feeds_a, &mut rng, 30).await;
        write(pool, &mut feeds_b, &mut rng, 30).await;
    }
    wait_published(pool, &[b], seed).await;
    // A got nowhere: its broker never answered.
    let a_published: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM changes c LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = c.endpoint_id
         WHERE c.tenant_id = $1 AND c.change_seq <= COALESCE(p.published_through, 0)",
    )
    .bind(a)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(a_published, 0, "seed {seed}");
    // And while A's connects keep timing out, B's new changes go on being published.
    wait_until(
        &format!("A's connects timing out (seed {seed})"),
        Duration::from_secs(60),
        || async { metric(&registry, "relay_publisher_broker_errors_total") >= 2.0 },
    )
    .await;
    write(pool, &mut feeds_b, &mut rng, 30).await;
    wait_published(pool, &[b], seed).await;
    let a_backlog = change_count_of(pool, a).await;
    assert_eq!(unpublished(pool, &[a]).await, a_backlog, "seed {seed}");
    // A's backlog shows in its gauges: every change waiting, the oldest of them aging.
    let a_label = a.to_string();
    let of_a = Some(("tenant", a_label.as_str()));
    wait_until(
        &format!("A's backlog gauge at {a_backlog} (seed {seed})"),
        Duration::from_secs(60),
        || async {
            series(&registry, "relay_publisher_backlog_changes", of_a) == Some(a_backlog as f64)
                && series(
                    &registry,
                    "relay_publisher_oldest_unpublished_age_seconds",
                    of_a,
                )
                .is_some_and(|age| age > 0.0)
                && metric(&registry, "relay_publisher_backlog_tenants") == 1.0
        },
    )
    .await;

    proxy.set(ProxyMode::Pass);
    wait_published(pool, &[a], seed).await;
    publisher.stop().await;

    for (tenant, queue, feeds) in [
        (a, "tenant-a-changes".to_owned(), &feeds_a),
        (b, tenant_queue(b), &feeds_b),
    ] {
        let messages = drain(&broker, &queue, true).await;
        let (consumer, _) = rebuild(tenant, &messages, seed);
        let own: Vec<&Feed> = feeds.iter().collect();
        assert_rebuilt(pool, &consumer, &own, seed).await;
    }
    // The relay declared no queue for A: its changes went only to its own exchange.
    let declared = declare_passive(&channel, &tenant_queue(a)).await;
    assert!(
        declared.is_err(),
        "seed {seed}: a relay queue exists for tenant A"
    );
}

/// A tenant's own broker named by its cluster's nodes, the first of them dead: its changes
/// reach its exchange through the node that answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_broker_named_by_several_nodes_is_reached_through_one_that_answers() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let a = env.db.tenant().await;
    let broker = env.broker().await;
    let channel = broker.create_channel().await.unwrap();
    declare_tenant_a_topology(&channel).await;
    // The live node is the test broker behind a proxy: at its own address it would be the
    // relay's broker, which no destination may name.
    let live = PgProxy::start(amqp_addr()).await;
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let nodes = format!(
        "{},{}",
        env.vhost.url_via(dead),
        env.vhost.url_via(live.address)
    );
    set_own_exchange(pool, a, &nodes, "tenant-a", "changes").await;

    let mut feeds_a = feeds_of(&env.db, [a; 2]).await;
    let (publisher, _registry) = env.start(env.config(env.vhost.url())).await;
    write(pool, &mut feeds_a, &mut rng, 30).await;
    wait_published(pool, &[a], seed).await;
    publisher.stop().await;
    let messages = drain(&broker, "tenant-a-changes", true).await;
    let (consumer, _) = rebuild(a, &messages, seed);
    let own: Vec<&Feed> = feeds_a.iter().collect();
    assert_rebuilt(pool, &consumer, &own, seed).await;
}

/// Publishers in several processes at once (here, several in one), one of them killed midway
/// and another started: every endpoint's changes still arrive gapless and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_publishers_at_once_keep_each_endpoints_order() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenants = [
        env.db.tenant().await,
        env.db.tenant().await,
        env.db.tenant().await,
    ];
    let mut feeds = feeds_of(&env.db, (0..6).map(|i| tenants[i % 3])).await;
    let config = || PublisherConfig {
        // Rounds of one endpoint each, so the publishers trade tenants mid-backlog.
        max_in_flight: 1,
        idle_release: Duration::from_millis(50),
        ..env.config(env.vhost.url())
    };
    let (first, first_metrics) = env.start(config()).await;
    write(pool, &mut feeds, &mut rng, 50).await;
    wait_until(
        &format!("the first publisher at work (seed {seed})"),
        Duration::from_secs(60),
        || async { metric(&first_metrics, "relay_publisher_changes_marked_total") > 0.0 },
    )
    .await;
    let (second, _) = env.start(config()).await;
    write(pool, &mut feeds, &mut rng, 100).await;
    // Killed: its tenants stay leased until the leases run out, then the others take them.
    first.abort();
    write(pool, &mut feeds, &mut rng, 100).await;
    let (third, _) = env.start(config()).await;
    write(pool, &mut feeds, &mut rng, 100).await;
    second.stop().await;
    write(pool, &mut feeds, &mut rng, 50).await;
    wait_published(pool, &tenants, seed).await;
    third.stop().await;

    assert_queues_rebuild(&env, &tenants, &feeds).await;
}

/// A publisher dies after the broker confirmed a round and before it marked it: its successor
/// sends that round again, and nothing else twice, under the same message ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_killed_between_confirm_and_mark_resends_only_those_message_ids() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenant = env.db.tenant().await;
    let mut feeds = feeds_of(&env.db, [tenant; 3]).await;
    write(pool, &mut feeds, &mut rng, 90).await;

    // The third round's confirms are the last thing the first publisher sees.
    let (stalled_tx, stalled_rx) = tokio::sync::oneshot::channel::<Vec<(Uuid, i64)>>();
    let stalled_tx = Arc::new(Mutex::new(Some(stalled_tx)));
    let rounds = Arc::new(Mutex::new(0));
    let hook = BeforeMark(Arc::new(move |ids: Vec<(Uuid, i64)>| {
        let round = {
            let mut rounds = rounds.lock().unwrap();
            *rounds += 1;
            *rounds
        };
        let stalled_tx = stalled_tx.clone();
        Box::pin(async move {
            if round == 3 {
                if let Some(tx) = stalled_tx.lock().unwrap().take() {
                    let _ = tx.send(ids);
                }
                std::future::pending::<()>().await;
            }
        })
    }));
    let (first, _) = env
        .start(PublisherConfig {
            before_mark: Some(hook),
            ..env.config(env.vhost.url())
        })
        .await;
    // Changes keep coming while it runs: its windows could send a backlog written beforehand
    // whole in a round or two.
    let (_, stalled) = tokio::join!(
        write(pool, &mut feeds, &mut rng, 90),
        tokio::time::timeout(Duration::from_secs(60), stalled_rx)
    );
    let confirmed_not_marked: BTreeSet<String> = stalled
        .expect("the first publisher reached its third round")
        .unwrap()
        .into_iter()
        .map(|(endpoint, seq)| {
            relay_publisher::message_id(endpoint, relay_publisher::FIRST_EPOCH, seq)
        })
        .collect();
    first.abort();
    assert!(!confirmed_not_marked.is_empty());
    // What the first publisher left unmarked: the stalled batch, and whatever it went on to
    // send and have confirmed while that mark hung (sending does not wait for marks).
    let unmarked_at_abort: BTreeSet<String> = rows_of::<(Uuid, i64), _>(pool, "SELECT c.endpoint_id, c.change_seq FROM changes c LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = c.endpoint_id
         WHERE c.tenant_id = $1 AND c.change_seq > COALESCE(p.published_through, 0)", tenant).await
    .into_iter()
    .map(|(endpoint, seq)| relay_publisher::message_id(endpoint, relay_publisher::FIRST_EPOCH, seq))
    .collect();

    let (second, _) = env.start(env.config(env.vhost.url())).await;
    wait_published(pool, &[tenant], seed).await;
    second.stop().await;

    let broker = env.broker().await;
    // Read without acknowledging: the messages stay for `relay tail` below.
    let messages = drain(&broker, &tenant_queue(tenant), false).await;
    let (consumer, seen) = rebuild(tenant, &messages, seed);
    let twice: BTreeSet<String> = seen
        .iter()
        .filter(|(_, &n)| n > 1)
        .map(|(id, _)| id.clone())
        .collect();
    // Sent twice: every change confirmed and not marked when the first died, and nothing the
    // first had marked.
    assert!(
        confirmed_not_marked.is_subset(&twice),
        "seed {seed}: the stalled batch {confirmed_not_marked:?} was not all sent again: {twice:?}"
    );
    assert!(
        twice.is_subset(&unmarked_at_abort),
        "seed {seed}: sent twice but marked before the crash: {:?}",
        twice.difference(&unmarked_at_abort).collect::<Vec<_>>()
    );
    assert!(seen.values().all(|&n| n <= 2), "seed {seed}");
    let own: Vec<&Feed> = feeds.iter().collect();
    assert_rebuilt(pool, &consumer, &own, seed).await;

    // `relay tail` reads the same queue, drops the repeats, and prints the copy it rebuilt.
    let (stats, out) = tail(&env, tenant, TailOutput::Copy, Vec::new()).await;
    assert_eq!(stats.messages, messages.len() as u64, "seed {seed}");
    assert_eq!(stats.duplicates, twice.len() as u64, "seed {seed}");
    assert_eq!(stats.waiting, 0, "seed {seed}");
    assert_tail_printed_the_copies(pool, out, &feeds, seed).await;
}

/// What `relay tail --output copy` printed (`out`) is each of `feeds`' copy as Postgres holds
/// it, and nothing of another endpoint.
async fn assert_tail_printed_the_copies(pool: &PgPool, out: Vec<u8>, feeds: &[Feed], seed: u64) {
    let mut printed: BTreeMap<Uuid, BTreeMap<String, Value>> = BTreeMap::new();
    for line in String::from_utf8(out).unwrap().lines() {
        let line: Value = serde_json::from_str(line).unwrap();
        let endpoint: Uuid = line["webhook_endpoint_id"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        let subject = line["subject"].as_str().unwrap().to_owned();
        printed
            .entry(endpoint)
            .or_default()
            .insert(subject, line["item"].clone());
    }
    for feed in feeds {
        assert_eq!(
            printed.remove(&feed.endpoint).unwrap_or_default(),
            postgres_items(pool, feed.endpoint).await,
            "seed {seed}: tail's copy of {}",
            feed.endpoint
        );
    }
    assert!(
        printed.is_empty(),
        "seed {seed}: tail printed unknown endpoints"
    );
}

/// A publisher that stalls between a confirm and its mark, past its lease (a long GC pause, a
/// frozen VM) while another takes the tenant over: its late mark is refused by the fence, it
/// gives the tenant up, and the queue still holds every change in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_stalled_past_its_lease_is_fenced_out() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenant = env.db.tenant().await;
    let mut feeds = feeds_of(&env.db, [tenant; 2]).await;
    write(pool, &mut feeds, &mut rng, 60).await;

    // The first publisher's task freezes at its second mark (the hook blocks its thread, as a
    // long GC pause or a frozen VM would: no sending) until the tenant's fence has moved on
    // (another publisher claimed it). A frozen VM renews nothing either: its lock runs out,
    // which the test stands for by removing it.
    let (moved_tx, moved_rx) = std::sync::mpsc::channel::<()>();
    let moved_rx = Arc::new(Mutex::new(moved_rx));
    let (stalled_tx, stalled_rx) = tokio::sync::oneshot::channel::<()>();
    let stalled_tx = Arc::new(Mutex::new(Some(stalled_tx)));
    let rounds = Arc::new(Mutex::new(0));
    let first_batch = Arc::new(Mutex::new(0usize));
    let first_batch_size = first_batch.clone();
    let hook = BeforeMark(Arc::new(move |ids: Vec<(Uuid, i64)>| {
        let round = {
            let mut rounds = rounds.lock().unwrap();
            *rounds += 1;
            *rounds
        };
        if round == 1 {
            *first_batch_size.lock().unwrap() = ids.len();
        }
        if round == 2 {
            if let Some(tx) = stalled_tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
            let _ = moved_rx
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(120));
        }
        Box::pin(async {})
    }));
    let (first, first_metrics) = env
        .start(PublisherConfig {
            before_mark: Some(hook),
            ..env.config(env.vhost.url())
        })
        .await;
    // Changes keep coming while it runs: its windows could send a backlog written beforehand
    // whole in one round.
    let (_, stalled) = tokio::join!(
        write(pool, &mut feeds, &mut rng, 30),
        tokio::time::timeout(Duration::from_secs(60), stalled_rx)
    );
    stalled
        .expect("the first publisher reached its second round")
        .unwrap();
    crate::convergence::delete_redis_keys(&env.prefix.0).await;
    let (second, _) = env.start(env.config(env.vhost.url())).await;
    wait_until(
        &format!("the second publisher claiming the tenant (seed {seed})"),
        Duration::from_secs(60),
        || async {
            let token: Option<i64> =
                sqlx::query_scalar("SELECT token FROM publisher_fences WHERE tenant_id = $1")
                    .bind(tenant)
                    .fetch_optional(pool)
                    .await
                    .unwrap();
            token >= Some(2)
        },
    )
    .await;
    moved_tx.send(()).unwrap();
    wait_until(
        &format!("the first publisher giving the tenant up (seed {seed})"),
        Duration::from_secs(60),
        || async { metric(&first_metrics, "relay_publisher_ownership_losses_total") == 1.0 },
    )
    .await;
    // Its second batch was confirmed but never marked by it.
    let first_batch = *first_batch.lock().unwrap();
    assert!(first_batch > 0, "seed {seed}");
    assert_eq!(
        metric(&first_metrics, "relay_publisher_changes_marked_total"),
        first_batch as f64,
        "seed {seed}: only the first batch is marked by the first publisher"
    );
    write(pool, &mut feeds, &mut rng, 30).await;
    wait_published(pool, &[tenant], seed).await;
    first.stop().await;
    second.stop().await;

    assert_queues_rebuild(&env, &[tenant], &feeds).await;
}

/// The tenant's own queue is full and refuses more (`x-overflow: reject-publish`): the broker
/// nacks, nothing nacked is marked, and once a consumer makes room every change arrives, once
/// and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nacked_changes_are_sent_again_in_order() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenant = env.db.tenant().await;
    let broker = env.broker().await;
    let channel = broker.create_channel().await.unwrap();
    channel
        .exchange_declare(
            "tenant-x",
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(5));
    arguments.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    bind_queue(
        &channel,
        "tenant-x-small",
        QueueDeclareOptions::default(),
        arguments,
        "tenant-x",
        "all",
    )
    .await;
    // The tenant's "own" broker: the test's vhost through an address that is not the relay's.
    let own_broker = PgProxy::start(amqp_addr()).await;
    set_own_exchange(
        pool,
        tenant,
        &env.vhost.url_via(own_broker.address),
        "tenant-x",
        "all",
    )
    .await;

    let mut feeds = feeds_of(&env.db, [tenant; 3]).await;
    write(pool, &mut feeds, &mut rng, 60).await;
    let (publisher, registry) = env.start(env.config(env.vhost.url())).await;
    wait_until(
        &format!("a nack from the full queue (seed {seed})"),
        Duration::from_secs(60),
        || async { metric(&registry, "relay_publisher_messages_nacked_total") > 0.0 },
    )
    .await;
    // Exactly what the queue took is marked: its five, none of the nacked ones.
    wait_until(
        &format!("the queue's five changes marked (seed {seed})"),
        Duration::from_secs(60),
        || async {
            let published: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM changes c LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = c.endpoint_id
         WHERE c.tenant_id = $1 AND c.change_seq <= COALESCE(p.published_through, 0)",
            )
            .bind(tenant)
            .fetch_one(pool)
            .await
            .unwrap();
            assert!(
                published <= 5,
                "seed {seed}: {published} marked, the queue holds 5"
            );
            published == 5 && metric(&registry, "relay_publisher_changes_marked_total") == 5.0
        },
    )
    .await;

    let collector = Collector::start(&broker, "tenant-x-small").await;
    write(pool, &mut feeds, &mut rng, 30).await;
    wait_published(pool, &[tenant], seed).await;
    publisher.stop().await;
    let total = change_count_of(pool, tenant).await as usize;
    wait_until(
        &format!("every change consumed (seed {seed})"),
        Duration::from_secs(60),
        || async { collector.distinct() == total },
    )
    .await;
    let messages = collector.finish().await;
    let (consumer, _) = rebuild(tenant, &messages, seed);
    let own: Vec<&Feed> = feeds.iter().collect();
    assert_rebuilt(pool, &consumer, &own, seed).await;
}

/// RabbitMQ's management API beside the test broker (guest, as the vhosts are made for).
fn management_url() -> String {
    std::env::var("RELAY_TEST_AMQP_MANAGEMENT_URL")
        .unwrap_or_else(|_| format!("http://{}:15672", amqp_addr().ip()))
}

/// A path segment percent-encoded for the management API (a connection's name holds spaces and
/// `>`, a vhost's may hold `/`).
fn path_segment(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn management_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// The names of `vhost`'s connections whose client named them starting with `named`, as the
/// management API lists them (a connection shows there a moment after it opened).
async fn connections_named(vhost: &str, named: &str) -> Vec<String> {
    let listed: Value = management_client()
        .get(format!(
            "{}/api/vhosts/{}/connections",
            management_url(),
            path_segment(vhost)
        ))
        .basic_auth("guest", Some("guest"))
        .send()
        .await
        .and_then(|answer| answer.error_for_status())
        .expect("the test needs RabbitMQ's management API (rabbitmq_management)")
        .json()
        .await
        .unwrap();
    listed
        .as_array()
        .into_iter()
        .flatten()
        .filter(|connection| {
            connection["client_properties"]["connection_name"]
                .as_str()
                .is_some_and(|name| name.starts_with(named))
        })
        .map(|connection| connection["name"].as_str().unwrap().to_owned())
        .collect()
}

/// Closes the connection `name` through the management API (`DELETE /api/connections/{name}`),
/// as an operator or a failing node would.
async fn close_connection(name: &str) {
    let answer = management_client()
        .delete(format!(
            "{}/api/connections/{}",
            management_url(),
            path_segment(name)
        ))
        .basic_auth("guest", Some("guest"))
        .header("X-Reason", "closed by a publisher test")
        .send()
        .await
        .unwrap();
    // Gone already (closed by the broker or the client meanwhile) is as good.
    assert!(
        answer.status().is_success() || answer.status() == 404,
        "closing {name}: {}",
        answer.status()
    );
}

/// How many publishes went out with more than one change of their endpoint in its window (the
/// buckets of `relay_publisher_endpoint_in_flight_changes` above 1), and the most seen (the
/// upper bound of the highest bucket with a publish).
fn window_use(registry: &prometheus::Registry) -> (u64, f64) {
    let family = registry
        .gather()
        .into_iter()
        .find(|f| f.name() == "relay_publisher_endpoint_in_flight_changes")
        .expect("the publisher registers its window histogram");
    let histogram = family.get_metric()[0].get_histogram();
    let mut alone = 0;
    let mut most = 0.0;
    let mut below = 0;
    for bucket in histogram.get_bucket() {
        if bucket.upper_bound() <= 1.0 {
            alone = bucket.cumulative_count();
        }
        if bucket.cumulative_count() > below {
            most = bucket.upper_bound();
            below = bucket.cumulative_count();
        }
    }
    if histogram.get_sample_count() > below {
        most = f64::INFINITY;
    }
    (histogram.get_sample_count() - alone, most)
}

/// One busy endpoint, a burst of a few thousand changes, sent many at once (a window of 64): the
/// tenant's own queue fills up and nacks (`x-overflow: reject-publish`), is unbound while
/// changes are in flight (they come back as returns), and the publisher's connection is closed
/// under it through the management API. Each time the change in trouble is sent again with
/// every change sent after it. On the queue, as a consumer reads it: every change_seq came, the
/// last copy of each after the last copy of every lower one, and the copy rebuilt from it is
/// the copy in Postgres. Only the changes the queue took were ever marked while it was full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_endpoints_window_is_sent_again_in_order_after_nacks_returns_and_a_lost_connection()
{
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenant = env.db.tenant().await;
    let broker = env.broker().await;
    let channel = broker.create_channel().await.unwrap();
    let (exchange, queue, key) = ("tenant-w", "tenant-w-changes", "all");
    channel
        .exchange_declare(
            exchange,
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let room: i64 = rng.gen_range(100..300);
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(room));
    arguments.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    bind_queue(
        &channel,
        queue,
        QueueDeclareOptions::default(),
        arguments,
        exchange,
        key,
    )
    .await;
    // The tenant's "own" broker: the test's vhost through an address that is not the relay's.
    let own_broker = PgProxy::start(amqp_addr()).await;
    let url = env.vhost.url_via(own_broker.address);
    set_own_exchange(pool, tenant, &url, exchange, key).await;

    let mut feed = Feed::new(&env.db, tenant).await;
    let events = rng.gen_range(1_000..1_400);
    feed.burst(pool, &mut rng, events).await;
    let config = PublisherConfig {
        endpoint_window: 64,
        // One tenant task (and connection) throughout.
        idle_release: Duration::from_secs(600),
        ..env.config(env.vhost.url())
    };
    let (publisher, registry) = env.start(config).await;
    let published_through = || async {
        sqlx::query_scalar::<_, Option<i64>>(
            "SELECT published_through FROM endpoint_publish_cursors WHERE endpoint_id = $1",
        )
        .bind(feed.endpoint)
        .fetch_optional(pool)
        .await
        .unwrap()
        .flatten()
        .unwrap_or(0)
    };

    // 1. Nacks: nobody reads the queue; it takes `room` changes and refuses the rest of each
    // window, round after round. Exactly its changes are marked, never one it refused.
    wait_until(
        &format!("the full queue's nacks (seed {seed})"),
        Duration::from_secs(60),
        || async { metric(&registry, "relay_publisher_messages_nacked_total") > 0.0 },
    )
    .await;
    wait_until(
        &format!("the queue's {room} changes marked (seed {seed})"),
        Duration::from_secs(60),
        || async {
            let through = published_through().await;
            assert!(
                through <= room,
                "seed {seed}: marked through {through}, the queue holds {room}"
            );
            through == room
        },
    )
    .await;
    let (windowed, most) = window_use(&registry);
    assert!(
        windowed > 0,
        "seed {seed}: every publish went out alone in its endpoint's window"
    );
    eprintln!(
        "seed {seed}: {windowed} publishes with others of their endpoint in flight, up to {most}"
    );
    assert!(
        metric(&registry, "relay_publisher_changes_resent_total") > 0.0,
        "seed {seed}: nothing was sent again after the nacks"
    );

    // 2. A slow consumer makes room a change at a time, so the queue stays about full: a
    // window's publishes meet a full queue and one with room by turns, and some changes are
    // taken behind one refused (their first copies are repeated by the resends).
    let collector = Collector::paced(&broker, queue, 1, Duration::from_millis(1)).await;

    // 3. Returns: the queue is unbound as a burst is being sent, and bound again once the
    // publisher had changes come back.
    let events = rng.gen_range(1_000..1_400);
    feed.burst(pool, &mut rng, events).await;
    channel
        .queue_unbind(queue, exchange, key, FieldTable::default())
        .await
        .unwrap();
    wait_until(
        &format!("changes returned by the unbound exchange (seed {seed})"),
        Duration::from_secs(60),
        || async { metric(&registry, "relay_publisher_messages_returned_total") > 0.0 },
    )
    .await;
    channel
        .queue_bind(
            queue,
            exchange,
            key,
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();

    // 4. The connection is closed under the publisher as a burst is being sent. The consumer
    // keeps up now, so the windows are full rather than waiting out the pauses after nacks. A
    // close that finds nothing in flight is no trouble (the publisher opens another connection
    // when it next sends): then another burst, and another close.
    collector.set_pace(Duration::ZERO);
    let resent_before = metric(&registry, "relay_publisher_changes_resent_total");
    let vhost = env.vhost.name.clone();
    let mut closes = 0;
    let felt = loop {
        assert!(
            closes < 10,
            "seed {seed}: {closes} closes of the connection found nothing in flight"
        );
        if closes > 0 {
            // The publisher connects again when it next has something to send.
            feed.burst(pool, &mut rng, 10).await;
        }
        let listed_by = tokio::time::Instant::now() + Duration::from_secs(30);
        let names = loop {
            let names = connections_named(&vhost, "relay-publisher").await;
            if !names.is_empty() {
                break names;
            }
            assert!(
                tokio::time::Instant::now() < listed_by,
                "seed {seed}: the publisher's connection was never listed"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let errors_before = metric(&registry, "relay_publisher_broker_errors_total");
        // Closed a seeded moment into a burst, while the publisher sends what it committed.
        let events = rng.gen_range(300..600);
        let after = Duration::from_millis(rng.gen_range(20..200));
        tokio::join!(feed.burst(pool, &mut rng, events), async {
            tokio::time::sleep(after).await;
            for name in &names {
                close_connection(name).await;
            }
        });
        closes += 1;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        while tokio::time::Instant::now() < deadline {
            if metric(&registry, "relay_publisher_broker_errors_total") > errors_before {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if metric(&registry, "relay_publisher_broker_errors_total") > errors_before {
            break closes;
        }
    };
    eprintln!("seed {seed}: close {felt} of the connection found publishes in flight");

    wait_published(pool, &[tenant], seed).await;
    publisher.stop().await;
    let resent = metric(&registry, "relay_publisher_changes_resent_total");
    eprintln!(
        "seed {seed}: published {}, confirmed {}, nacked {}, returned {}, resent {resent} \
         ({} after the connection was closed), window use {:?}",
        metric(&registry, "relay_publisher_messages_published_total"),
        metric(&registry, "relay_publisher_messages_confirmed_total"),
        metric(&registry, "relay_publisher_messages_nacked_total"),
        metric(&registry, "relay_publisher_messages_returned_total"),
        resent - resent_before,
        window_use(&registry),
    );

    let total = change_count(pool, feed.endpoint).await;
    assert!(total > 2_000, "seed {seed}: only {total} changes written");
    // Each change confirmed in turn once, however many times it was sent.
    assert_eq!(
        metric(&registry, "relay_publisher_messages_confirmed_total"),
        total as f64,
        "seed {seed}"
    );
    wait_until(
        &format!("every change consumed (seed {seed})"),
        Duration::from_secs(60),
        || async { collector.distinct() == total as usize },
    )
    .await;
    let messages = collector.finish().await;
    let _ = broker.close(200, "done").await;

    // The raw order: the last copy of every change_seq after the last of every lower one.
    let mut last_copy: BTreeMap<i64, usize> = BTreeMap::new();
    for (at, delivered) in messages.iter().enumerate() {
        let message = ChangeMessage::decode(&delivered.body).unwrap();
        assert_eq!(message.webhook_endpoint_id, feed.endpoint, "seed {seed}");
        last_copy.insert(message.change_seq, at);
    }
    assert_eq!(
        last_copy.keys().copied().collect::<Vec<_>>(),
        (1..=total).collect::<Vec<_>>(),
        "seed {seed}: not every change_seq came"
    );
    for (seq, at) in &last_copy {
        if let Some(before) = last_copy.get(&(seq - 1)) {
            assert!(
                before < at,
                "seed {seed}: the last copy of change {seq} (delivery {at}) came before the \
                 last copy of change {} (delivery {before})",
                seq - 1
            );
        }
    }
    let repeats = messages.len() - total as usize;
    eprintln!(
        "seed {seed}: {} deliveries, {repeats} repeats",
        messages.len()
    );
    assert!(
        repeats > 0,
        "seed {seed}: no change was taken behind one refused; the consumer's side was not tried"
    );
    // And the consumer that drops repeats and holds what comes ahead rebuilds the copy.
    let (consumer, _) = rebuild(tenant, &messages, seed);
    assert_rebuilt(pool, &consumer, &[&feed], seed).await;
}

/// A tenant's own exchange that does not exist yet (the broker closes the channel on each
/// publish), then exists without a binding (every publish comes back unroutable), then is bound
/// to a queue: nothing is marked before that, and then everything arrives, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_exchange_or_binding_holds_the_backlog_until_fixed() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenant = env.db.tenant().await;
    // The tenant's "own" broker: the test's vhost through an address that is not the relay's.
    let own_broker = PgProxy::start(amqp_addr()).await;
    set_own_exchange(
        pool,
        tenant,
        &env.vhost.url_via(own_broker.address),
        "late",
        "changes",
    )
    .await;
    let mut feeds = feeds_of(&env.db, [tenant; 2]).await;
    write(pool, &mut feeds, &mut rng, 40).await;
    let (publisher, registry) = env.start(env.config(env.vhost.url())).await;

    wait_until(
        &format!("publishes to a missing exchange failing (seed {seed})"),
        Duration::from_secs(60),
        || async { metric(&registry, "relay_publisher_broker_errors_total") >= 2.0 },
    )
    .await;
    let broker = env.broker().await;
    let channel = broker.create_channel().await.unwrap();
    channel
        .exchange_declare(
            "late",
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    wait_until(
        &format!("publishes coming back unroutable (seed {seed})"),
        Duration::from_secs(60),
        || async { metric(&registry, "relay_publisher_messages_returned_total") >= 2.0 },
    )
    .await;
    assert_eq!(
        unpublished(pool, &[tenant]).await,
        change_count_of(pool, tenant).await,
        "seed {seed}: a change was marked that reached no queue"
    );
    assert_eq!(
        metric(&registry, "relay_publisher_messages_confirmed_total"),
        0.0
    );

    bind_queue(
        &channel,
        "late-changes",
        QueueDeclareOptions::default(),
        FieldTable::default(),
        "late",
        "changes",
    )
    .await;
    write(pool, &mut feeds, &mut rng, 20).await;
    wait_published(pool, &[tenant], seed).await;
    publisher.stop().await;

    let messages = drain(&broker, "late-changes", true).await;
    let (consumer, seen) = rebuild(tenant, &messages, seed);
    assert!(seen.values().all(|&n| n == 1), "seed {seed}");
    let own: Vec<&Feed> = feeds.iter().collect();
    assert_rebuilt(pool, &consumer, &own, seed).await;
}

/// Publishers killed (aborted) at random moments while changes keep coming, each replaced by a
/// new one: the queues still rebuild every copy, gapless and in order; repeats are only of a
/// message_id already delivered (the consumer drops them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishers_killed_at_random_moments_lose_and_reorder_nothing() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenants = [env.db.tenant().await, env.db.tenant().await];
    let mut feeds = feeds_of(&env.db, (0..4).map(|i| tenants[i % 2])).await;
    let kills = 6;
    for _ in 0..kills {
        let (publisher, _) = env.start(env.config(env.vhost.url())).await;
        let steps = rng.gen_range(10..40);
        write(pool, &mut feeds, &mut rng, steps).await;
        tokio::time::sleep(Duration::from_millis(rng.gen_range(0..300))).await;
        publisher.abort();
    }
    let (publisher, _) = env.start(env.config(env.vhost.url())).await;
    write(pool, &mut feeds, &mut rng, 20).await;
    wait_published(pool, &tenants, seed).await;
    publisher.stop().await;

    assert_queues_rebuild_checking(&env, &tenants, &feeds, |_, seen| {
        assert!(
            seen.values().all(|&n| n <= 1 + kills),
            "seed {seed}: a message came more often than publishers died"
        );
    })
    .await;
}

/// The mark statement by itself: each endpoint's publish cursor moves to the highest change_seq
/// given for it and never back; a stale fencing token marks nothing; an endpoint of another
/// tenant is never touched; the backlog and the sweep read what the cursors say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mark_moves_each_endpoints_cursor_forward_only_and_only_under_the_fence() {
    use relay_store::changes::{self, Marked};
    use relay_store::{EndpointId, TenantId};
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let (a, b) = (env.db.tenant().await, env.db.tenant().await);
    let mut feeds = feeds_of(&env.db, [a, a, b]).await;
    for feed in &mut feeds {
        while change_count(pool, feed.endpoint).await < 6 {
            feed.step(pool, &mut rng).await;
        }
    }
    let counts = [
        change_count(pool, feeds[0].endpoint).await,
        change_count(pool, feeds[1].endpoint).await,
    ];
    sqlx::query("INSERT INTO publisher_fences (tenant_id, token) VALUES ($1, 7), ($2, 3)")
        .bind(a)
        .bind(b)
        .execute(pool)
        .await
        .unwrap();
    let cursor = |endpoint: Uuid| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT published_through FROM endpoint_publish_cursors WHERE endpoint_id = $1",
        )
        .bind(endpoint)
        .fetch_optional(pool)
        .await
        .unwrap()
    };
    let (e0, e1, e2) = (feeds[0].endpoint, feeds[1].endpoint, feeds[2].endpoint);
    let (k0, k1, k2) = (EndpointId(e0), EndpointId(e1), EndpointId(e2));
    let (ta, tb) = (TenantId(a), TenantId(b));
    let mut sweep = changes::endpoints_with_backlog(pool, ta, 7, 10)
        .await
        .unwrap()
        .expect("7 is A's publishing token");
    sweep.sort();
    // Each with its last change, the counter's.
    assert_eq!(
        sweep.iter().map(|(_, last)| *last).collect::<Vec<_>>(),
        sweep
            .iter()
            .map(|(k, _)| counts[usize::from(*k == k1)])
            .collect::<Vec<_>>(),
        "seed {seed}"
    );
    let mut sweep: Vec<EndpointId> = sweep.into_iter().map(|(k, _)| k).collect();
    sweep.sort();
    // A holder whose token moved on (another publisher, a resync, a replay) is told so.
    assert_eq!(
        changes::endpoints_with_backlog(pool, ta, 6, 10)
            .await
            .unwrap(),
        None,
        "seed {seed}"
    );
    let mut expected = vec![k0, k1];
    expected.sort();
    assert_eq!(sweep, expected, "seed {seed}");
    let mut tenants = changes::tenants_with_backlog(pool, 10).await.unwrap();
    tenants.sort();
    let mut both = vec![ta, tb];
    both.sort();
    assert_eq!(tenants, both, "seed {seed}");

    // Keys in any order, several per endpoint: the highest of each counts.
    let marked = changes::mark_published(pool, ta, 7, &[(k0, 2), (k1, 1), (k0, 1), (k0, 3)])
        .await
        .unwrap();
    assert_eq!(marked, Marked::Marked(4), "seed {seed}");
    assert_eq!((cursor(e0).await, cursor(e1).await), (Some(3), Some(1)));
    let (backlog, oldest) = changes::backlog(pool, ta).await.unwrap();
    assert_eq!(backlog, counts[0] - 3 + counts[1] - 1, "seed {seed}");
    assert!(oldest.is_some());

    // A late or repeated mark moves nothing back.
    let marked = changes::mark_published(pool, ta, 7, &[(k0, 2), (k1, 1)])
        .await
        .unwrap();
    assert_eq!(marked, Marked::Marked(0), "seed {seed}");
    assert_eq!((cursor(e0).await, cursor(e1).await), (Some(3), Some(1)));

    // A stale token: nothing.
    let marked = changes::mark_published(pool, ta, 6, &[(k0, 5)])
        .await
        .unwrap();
    assert_eq!(marked, Marked::FencedOut, "seed {seed}");
    assert_eq!(cursor(e0).await, Some(3));

    // Tenant A's owner naming tenant B's endpoint, before and after B's own mark: B's cursor
    // is neither made nor moved by it.
    let marked = changes::mark_published(pool, ta, 7, &[(k2, 4)])
        .await
        .unwrap();
    assert_eq!(marked, Marked::Marked(0), "seed {seed}");
    assert_eq!(cursor(e2).await, None, "seed {seed}");
    let marked = changes::mark_published(pool, tb, 3, &[(k2, 1)])
        .await
        .unwrap();
    assert_eq!(marked, Marked::Marked(1), "seed {seed}");
    let marked = changes::mark_published(pool, ta, 7, &[(k2, 4)])
        .await
        .unwrap();
    assert_eq!(marked, Marked::Marked(0), "seed {seed}");
    assert_eq!(cursor(e2).await, Some(1), "seed {seed}");

    // Never past the endpoint's last change.
    let marked = changes::mark_published(pool, ta, 7, &[(k1, counts[1] + 1)])
        .await
        .unwrap();
    assert_eq!(marked, Marked::Marked(0), "seed {seed}");
    assert_eq!(cursor(e1).await, Some(1), "seed {seed}");

    // Every change marked: no backlog, no sweep, and the next read starts past the cursor.
    let marked = changes::mark_published(pool, ta, 7, &[(k0, counts[0]), (k1, counts[1])])
        .await
        .unwrap();
    assert_eq!(
        marked,
        Marked::Marked((counts[0] - 3 + counts[1] - 1) as u64),
        "seed {seed}"
    );
    assert_eq!(changes::backlog(pool, ta).await.unwrap(), (0, None));
    assert_eq!(
        changes::endpoints_with_backlog(pool, ta, 7, 10)
            .await
            .unwrap(),
        Some(Vec::new())
    );
    assert_eq!(
        changes::tenants_with_backlog(pool, 10).await.unwrap(),
        vec![tb]
    );
    let next = changes::next_changes(pool, ta, &[(k0, 0, 10), (k1, 0, 10)])
        .await
        .unwrap();
    assert!(next.is_empty(), "seed {seed}: {} read", next.len());
    feeds[0].step(pool, &mut rng).await;
    let next = changes::next_changes(pool, ta, &[(k0, 0, 10)])
        .await
        .unwrap();
    let seqs: Vec<i64> = next.iter().map(|c| c.change_seq).collect();
    let now = change_count(pool, e0).await;
    assert_eq!(
        seqs,
        ((counts[0] + 1)..=now).collect::<Vec<_>>(),
        "seed {seed}"
    );
}

/// Not a test of behaviour: how fast one publisher drains a backlog on this machine. Run with
/// `cargo test -p relay-tests --test it publisher_drain_rate -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn publisher_drain_rate() {
    let env = Env::new().await;
    let pool = &env.db.pool;
    // RELAY_TEST_DRAIN_SHAPE=tenants,endpoints,changes_per_endpoint (default 20,10,50).
    let shape: Vec<i32> = std::env::var("RELAY_TEST_DRAIN_SHAPE")
        .unwrap_or_else(|_| "20,10,50".into())
        .split(',')
        .map(|n| n.trim().parse().unwrap())
        .collect();
    let (tenants, endpoints, per_endpoint) = (shape[0], shape[1], shape[2]);
    let mut ids = Vec::new();
    for _ in 0..tenants {
        ids.push(env.db.tenant().await);
    }
    // Upserts of a realistic item (about 1 KB), written straight into the outbox.
    let item = item_json(1, 7).to_string();
    sqlx::query(
        "INSERT INTO changes (endpoint_id, change_seq, tenant_id, operation, subject, item_kind,
                              generation, sequence, event_id, item, parts_diff)
         SELECT e.endpoint_id, s, e.tenant_id, 'upsert', 'announcement:' || s, 'announcement',
                1, lpad(s::text, 19, '0'), 'evt_' || s, $4::json,
                '{\"added\": [], \"changed\": [\"flash:1\"], \"removed\": []}'::jsonb
         FROM (SELECT t AS tenant_id, gen_random_uuid() AS endpoint_id
               FROM unnest($1::uuid[]) t, generate_series(1, $2)) e,
              generate_series(1, $3) s",
    )
    .bind(&ids)
    .bind(endpoints)
    .bind(per_endpoint)
    .bind(&item)
    .execute(pool)
    .await
    .unwrap();
    // The counters the sequencer keeps beside its changes (the publisher reads its backlog there).
    sqlx::query(
        "INSERT INTO endpoint_change_counters (endpoint_id, tenant_id, last)
         SELECT endpoint_id, tenant_id, max(change_seq) FROM changes
         GROUP BY endpoint_id, tenant_id",
    )
    .execute(pool)
    .await
    .unwrap();
    let total = tenants * endpoints * per_endpoint;
    // RELAY_TEST_DRAIN_WINDOW: each endpoint's window (default the publisher's).
    let mut config = env.config(env.vhost.url());
    if let Ok(window) = std::env::var("RELAY_TEST_DRAIN_WINDOW") {
        config.endpoint_window = window.parse().expect("RELAY_TEST_DRAIN_WINDOW is a number");
    }
    let window = config.endpoint_window;
    let started = std::time::Instant::now();
    let (publisher, registry) = env.start(config).await;
    wait_published(pool, &ids, env.seed).await;
    let elapsed = started.elapsed();
    publisher.stop().await;
    let latency = registry
        .gather()
        .into_iter()
        .find(|f| f.name() == "relay_publisher_publish_latency_seconds")
        .unwrap();
    let histogram = latency.get_metric()[0].get_histogram();
    eprintln!(
        "drained {total} changes ({tenants} tenants x {endpoints} endpoints x {per_endpoint}, \
         windows of {window}) in {elapsed:.2?}: {:.0} changes/s; mean created-to-confirm {:.3} s",
        total as f64 / elapsed.as_secs_f64(),
        histogram.get_sample_sum() / histogram.get_sample_count() as f64
    );
}

/// Postgres goes away (connections refused) while the publisher runs, and comes back: what the
/// broker confirmed meanwhile is marked when Postgres is back rather than sent again, so every
/// message arrives exactly once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_mid_run_sends_nothing_twice() {
    let (env, mut rng) = Env::seeded().await;
    let (seed, pool) = (env.seed, &env.db.pool);
    let tenants = [env.db.tenant().await, env.db.tenant().await];
    let mut feeds = feeds_of(&env.db, (0..4).map(|i| tenants[i % 2])).await;
    let postgres: SocketAddr = std::env::var("RELAY_TEST_POSTGRES_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:5432".to_owned())
        .parse()
        .unwrap();
    let proxy = PgProxy::start(postgres).await;
    let publisher_pool = relay_store::connect(
        &format!("postgres://postgres@{}/{}", proxy.address, env.db.name),
        &relay_store::PoolOptions {
            max_connections: 4,
            acquire_timeout: Duration::from_secs(1),
            ..relay_store::PoolOptions::default()
        },
    )
    .unwrap();
    let registry = prometheus::Registry::new();
    let publisher = Publisher::start(
        publisher_pool.clone(),
        env.config(env.vhost.url()),
        relay_tests::keys(),
        &registry,
    )
    .await
    .unwrap();

    write(pool, &mut feeds, &mut rng, 60).await;
    wait_until(
        &format!("the publisher at work (seed {seed})"),
        Duration::from_secs(60),
        || async { metric(&registry, "relay_publisher_changes_marked_total") > 0.0 },
    )
    .await;
    proxy.set(ProxyMode::Refuse);
    write(pool, &mut feeds, &mut rng, 60).await;
    // Long enough for the publisher to meet the outage at some step of its loop.
    tokio::time::sleep(Duration::from_secs(1)).await;
    proxy.set(ProxyMode::Pass);
    write(pool, &mut feeds, &mut rng, 30).await;
    wait_published(pool, &tenants, seed).await;
    publisher.stop().await;
    publisher_pool.close().await;

    assert_queues_rebuild_checking(&env, &tenants, &feeds, |_, seen| {
        let twice: Vec<&String> = seen
            .iter()
            .filter(|(_, &n)| n > 1)
            .map(|(id, _)| id)
            .collect();
        assert!(twice.is_empty(), "seed {seed}: sent twice: {twice:?}");
    })
    .await;
}

/// Not a test of behaviour: created-to-confirm latency while changes arrive at a fixed rate.
/// `RELAY_TEST_RATE_SHAPE=tenants,endpoints_per_tenant,changes_per_second,seconds` (default
/// 10,20,1000,10); run with `-- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn publisher_latency_at_rate() {
    let env = Env::new().await;
    let pool = &env.db.pool;
    let shape: Vec<u64> = std::env::var("RELAY_TEST_RATE_SHAPE")
        .unwrap_or_else(|_| "10,20,1000,10".into())
        .split(',')
        .map(|n| n.trim().parse().unwrap())
        .collect();
    let (tenants, per_tenant, rate, seconds) = (shape[0], shape[1], shape[2], shape[3]);
    let mut endpoints = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..tenants {
        let tenant = env.db.tenant().await;
        ids.push(tenant);
        for _ in 0..per_tenant {
            endpoints.push((tenant, Uuid::new_v4(), 0i64));
        }
    }
    let config = PublisherConfig {
        poll_interval: Duration::from_millis(50),
        ..env.config(env.vhost.url())
    };
    let (publisher, registry) = env.start(config).await;
    let item = item_json(1, 7).to_string();
    let mut rng = StdRng::seed_from_u64(env.seed);
    // Every 10 ms, one insert of rate/100 changes to random endpoints.
    let per_tick = (rate / 100).max(1) as usize;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(seconds) {
        tick.tick().await;
        let (mut tenant_ids, mut endpoint_ids, mut seqs) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..per_tick {
            let i = rng.gen_range(0..endpoints.len());
            let e = &mut endpoints[i];
            e.2 += 1;
            tenant_ids.push(e.0);
            endpoint_ids.push(e.1);
            seqs.push(e.2);
        }
        // The changes and their endpoints' counters, as the sequencer writes them.
        sqlx::query(
            "WITH written AS (
                 INSERT INTO changes (endpoint_id, change_seq, tenant_id, operation, subject,
                                      item_kind, generation, sequence, event_id, item,
                                      parts_diff)
                 SELECT e, s, t, 'upsert', 'announcement:1', 'announcement', 1, '1', 'evt',
                        $4::json, '{\"added\": [], \"changed\": [], \"removed\": []}'::jsonb
                 FROM unnest($1::uuid[], $2::uuid[], $3::int8[]) AS x (t, e, s)
                 RETURNING endpoint_id, tenant_id, change_seq
             )
             INSERT INTO endpoint_change_counters (endpoint_id, tenant_id, last)
             SELECT endpoint_id, tenant_id, max(change_seq) FROM written
             GROUP BY endpoint_id, tenant_id
             ON CONFLICT (endpoint_id) DO UPDATE
                 SET last = GREATEST(endpoint_change_counters.last, excluded.last)",
        )
        .bind(&tenant_ids)
        .bind(&endpoint_ids)
        .bind(&seqs)
        .bind(&item)
        .execute(pool)
        .await
        .unwrap();
    }
    let sent: i64 = endpoints.iter().map(|e| e.2).sum();
    let offered = sent as f64 / started.elapsed().as_secs_f64();
    wait_published(pool, &ids, env.seed).await;
    publisher.stop().await;
    let family = registry
        .gather()
        .into_iter()
        .find(|f| f.name() == "relay_publisher_publish_latency_seconds")
        .unwrap();
    let histogram = family.get_metric()[0].get_histogram();
    let count = histogram.get_sample_count() as f64;
    let quantile = |q: f64| {
        histogram
            .get_bucket()
            .iter()
            .find(|b| b.cumulative_count() as f64 >= q * count)
            .map_or(f64::INFINITY, |b| b.upper_bound())
    };
    eprintln!(
        "{sent} changes at {offered:.0}/s over {tenants} tenants x {per_tenant} endpoints: \
         created-to-confirm mean {:.4} s, p50 <= {} s, p99 <= {} s (bucket bounds)",
        histogram.get_sample_sum() / count,
        quantile(0.5),
        quantile(0.99)
    );
}
