//! The whole relay in one test process, for the tests that run it end to end (the pipeline,
//! the hostile tenant): the control plane and a client for it, the copy and the oracle, the
//! backlog, the publisher, and the queues read back.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use relay_api::{mint, JwtKeys, Subject};
use relay_api::{ApiConfig, ApiServer};
use relay_api::{BrokerAccess, ManagementSettings};
use relay_netguard::OutboundPolicy;
use relay_publisher::lapin::Connection;
use relay_publisher::{
    ChangeMessage, Publisher, PublisherConfig, PublisherHandle, ReferenceConsumer,
};
use relay_rules::DestinationPolicy;
use relay_sequencer::{Sequencer, SequencerConfig, SequencerMetrics};
use relay_simulator::cli::{url_template, SimulateArgs};
use relay_simulator::model::World;
use relay_simulator::{
    EndpointInfo, Faults, SenderConfig, Simulation, Upstream, Workload, WorkloadConfig,
};
use relay_store::endpoints::{self, NewEndpoint};
use relay_store::tenants;
use relay_store::PoolOptions;
use relay_tests::{redis_url, RedisPrefix, TestApp, TestDb, Vhost};
use relay_wire::SigningSecret;
use serde_json::{json, Value};
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

/// Changes of the endpoints `$1` the broker has not confirmed: past their endpoint's publish
/// cursor.
const UNPUBLISHED: &str = "SELECT count(*) FROM changes c
     LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = c.endpoint_id
     WHERE c.change_seq > COALESCE(p.published_through, 0) AND c.endpoint_id = ANY($1)";

// ---- The control plane ----

/// The control planes' signing key in these tests.
pub(crate) const KEY: &[u8] = b"test-signing-key-of-the-whole-relay-in-one-process";

/// A token for `subject` signed with `key` (as `relay token issue` mints it), valid an hour.
pub(crate) fn token_for(key: &[u8], subject: &Subject) -> String {
    mint(
        &JwtKeys::new(key).unwrap(),
        "relay",
        subject,
        Duration::from_secs(3600),
        OffsetDateTime::now_utc(),
    )
    .unwrap()
    .token
}

/// One call of the control plane at `base_url`: `method` on `path`, with `token` as bearer and
/// `body` as JSON when given; the answer's JSON is null when the body is not JSON.
pub(crate) async fn call_api(
    client: &reqwest::Client,
    base_url: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Answer {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = client.request(method, format!("{base_url}{path}"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request.json(body);
    }
    answer_of(request.send().await.expect("the API answers")).await
}

/// A response of the API as an [`Answer`].
pub(crate) async fn answer_of(response: reqwest::Response) -> Answer {
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let cache_control = response
        .headers()
        .get(reqwest::header::CACHE_CONTROL)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let text = response.text().await.unwrap();
    let json = serde_json::from_str(&text).unwrap_or(Value::Null);
    Answer {
        status,
        text,
        json,
        cache_control,
        retry_after,
    }
}

/// The control plane in-process on port 0, signing with [`KEY`], and a client for it.
pub(crate) struct Api {
    pub(crate) server: ApiServer,
    pub(crate) base_url: String,
    pub(crate) client: reqwest::Client,
    /// Where the control plane's metrics are registered.
    pub(crate) registry: prometheus::Registry,
}

pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) text: String,
    pub(crate) json: Value,
    /// Its `Cache-Control` header, if any.
    pub(crate) cache_control: Option<String>,
    /// Its `Retry-After` header, if any.
    pub(crate) retry_after: Option<String>,
}

/// The answer refuses the request as invalid, naming `field`; `what` says which request.
pub(crate) fn assert_refused_field(answer: &Answer, field: &str, what: &str) {
    assert_eq!(answer.status, 400, "{what}: {}", answer.text);
    assert_eq!(
        answer.json["error"], "invalid_request",
        "{what}: {}",
        answer.text
    );
    assert_eq!(answer.json["field"], field, "{what}: {}", answer.text);
}

/// The relay's own broker at `relay_amqp_url` for a control plane (destinations at it are
/// refused, tenants' users are made there), with `policy` for tenants' own brokers.
pub(crate) fn relay_broker(relay_amqp_url: &str, policy: DestinationPolicy) -> BrokerAccess {
    BrokerAccess::new(relay_amqp_url, &ManagementSettings::default(), None, policy).unwrap()
}

impl Api {
    /// The control plane on `pool`, signing with [`KEY`], with the settings `configure` makes.
    pub(crate) async fn serve(pool: PgPool, configure: impl FnOnce(&mut ApiConfig)) -> Self {
        let mut config = ApiConfig::new(JwtKeys::new(KEY).unwrap(), relay_tests::keys());
        configure(&mut config);
        let registry = config.registry.clone();
        let server = ApiServer::start(pool, config).await.unwrap();
        let base_url = format!("http://{}", server.address);
        Self {
            server,
            base_url,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
            registry,
        }
    }

    /// The control plane on `database_url`, with `relay_amqp_url` as the relay's own broker
    /// (destinations are refused there, tenants' users are made there) and `outbound` as the
    /// operator's policy for upstream URLs.
    pub(crate) async fn start(
        database_url: &str,
        relay_amqp_url: &str,
        outbound: OutboundPolicy,
    ) -> Self {
        let pool = relay_store::connect(database_url, &PoolOptions::default()).unwrap();
        Self::serve(pool, |config| {
            config.upstream_timeout = Duration::from_secs(5);
            config.outbound = outbound;
            config.broker = relay_broker(relay_amqp_url, DestinationPolicy::default());
        })
        .await
    }

    pub(crate) async fn stop(self) {
        self.server.stop().await.unwrap();
    }

    /// An operator's token, minted with the API's signing key (as `relay token issue` does).
    pub(crate) fn operator_token() -> String {
        let operator = Subject::Operator {
            name: "stack-test".into(),
        };
        token_for(KEY, &operator)
    }

    /// A token of `tenant`, minted with the API's signing key.
    pub(crate) fn tenant_token(tenant: Uuid) -> String {
        token_for(KEY, &Subject::Tenant(tenant))
    }

    pub(crate) async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> Answer {
        call_api(&self.client, &self.base_url, method, path, token, body).await
    }

    /// A call with a token of `tenant`: the answer's status and JSON.
    pub(crate) async fn call_as(
        &self,
        tenant: Uuid,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> (u16, Value) {
        let token = Self::tenant_token(tenant);
        let answer = self.call(method, path, Some(&token), body).await;
        (answer.status, answer.json)
    }

    /// A call that must answer `expect`; its JSON.
    pub(crate) async fn ok(
        &self,
        expect: u16,
        method: &str,
        path: &str,
        token: &str,
        body: Option<&Value>,
    ) -> Value {
        let answer = self.call(method, path, Some(token), body).await;
        assert_eq!(answer.status, expect, "{method} {path}: {}", answer.text);
        answer.json
    }

    /// A counter of the control plane: the series of `name` with `label` set to `value`.
    pub(crate) fn counter(&self, name: &str, label: &str, value: &str) -> u64 {
        labelled(&self.registry, name, label, value) as u64
    }

    /// The tenant of `token` has its changes sent to its queue at the relay's broker: the
    /// destination the API answers.
    pub(crate) async fn use_relay_queue(&self, token: &str) -> Value {
        let body = json!({"kind": "relay_queue"});
        self.ok(200, "PUT", "/v1/destination", token, Some(&body))
            .await
    }

    /// A tenant named `name`, made by the operator, and a token for it (valid an hour).
    pub(crate) async fn tenant(&self, name: &str) -> (Uuid, String) {
        let operator = Self::operator_token();
        let created = self
            .ok(
                201,
                "POST",
                "/v1/tenants",
                &operator,
                Some(&json!({"name": name})),
            )
            .await;
        let tenant: Uuid = created["id"].as_str().unwrap().parse().unwrap();
        let minted = self
            .ok(
                201,
                "POST",
                &format!("/v1/tenants/{tenant}/tokens"),
                &operator,
                Some(&json!({"ttl_s": 3600})),
            )
            .await;
        (tenant, minted["token"].as_str().unwrap().to_owned())
    }

    /// The simulated endpoint `info` registered for the tenant of `token`, read from
    /// `upstream_api` with its key and its secrets: the API's answer.
    pub(crate) async fn register(
        &self,
        token: &str,
        info: &EndpointInfo,
        upstream_api: &str,
    ) -> Value {
        self.ok(
            201,
            "POST",
            "/v1/endpoints",
            token,
            Some(&json!({
                "id": info.id,
                "lang": info.lang,
                "upstream_base_url": upstream_api,
                "upstream_api_key": info.key_token,
                "secrets": info.secrets,
            })),
        )
        .await
    }

    /// The endpoint's copy read through the API, page by page (tombstones left out).
    pub(crate) async fn copy(&self, token: &str, endpoint: Uuid) -> Items {
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
pub(crate) type Items = BTreeMap<String, (String, Value)>;

/// The tenant of a simulated key (one per key, its id derived from the key), made unless it is
/// there already.
pub(crate) async fn tenant_of_key(pool: &PgPool, key_token: &str, name: &str) -> Uuid {
    let tenant = Uuid::new_v5(&Uuid::NAMESPACE_URL, key_token.as_bytes());
    match tenants::create(pool, tenant, name).await {
        Ok(_) | Err(relay_store::StoreError::AlreadyExists { .. }) => {}
        Err(error) => panic!("creating a tenant: {error}"),
    }
    tenant
}

/// The simulated endpoint `info` written to the store for `tenant` (not through the API), with
/// its first secret, read from `upstream_api` with its key.
pub(crate) async fn create_endpoint(
    pool: &PgPool,
    tenant: Uuid,
    info: &EndpointInfo,
    upstream_api: &str,
) {
    endpoints::create(
        pool,
        &relay_tests::keys(),
        &NewEndpoint {
            id: info.id,
            tenant_id: tenant,
            secret: SigningSecret::parse(&info.secrets[0]).unwrap(),
            upstream_base_url: Some(upstream_api.to_owned()),
            upstream_api_key: Some(info.key_token.clone().into()),
        },
    )
    .await
    .unwrap();
}

/// `relay simulate`'s arguments for a quiet run of `endpoints` endpoints over `keys` keys,
/// sending to `receiver_url`, `rate` changes a second for `duration_s` seconds, an upstream hour
/// a second, without faults (a test sets its own on the upstream) and its API on a free port.
pub(crate) fn simulate_args(
    receiver_url: &str,
    endpoints: usize,
    keys: usize,
    seed: u64,
    rate: f64,
    duration_s: u64,
) -> SimulateArgs {
    SimulateArgs {
        receiver_url: receiver_url.to_owned(),
        endpoints,
        keys,
        seed,
        rate,
        duration_s,
        faults: "none".into(),
        time_compression: 3600.0,
        listen: "127.0.0.1:0".into(),
        select_all: false,
        print_endpoints: false,
        quiet: true,
    }
}

/// A simulated upstream with `endpoints` endpoints under one key, sending to `receiver_url`,
/// its seeded workload, and the endpoints. Every endpoint selects everything (as `relay
/// simulate` does, less its random filters, one of which can select none of a short run's
/// items and leave a test comparing empty copies).
pub(crate) fn simulation(
    seed: u64,
    receiver_url: &str,
    endpoints: usize,
    faults: Faults,
) -> (Upstream, Workload, Vec<EndpointInfo>) {
    let mut workload = Workload::new(
        seed,
        WorkloadConfig {
            endpoints,
            keys: 1,
            refetch: faults.refetch,
            random_filters: false,
            ..WorkloadConfig::default()
        },
    );
    let mut upstream = Upstream::new(
        World::default(),
        SenderConfig::from_wire_limits(3600.0),
        faults,
        seed,
    );
    let infos = workload.setup(&mut upstream, &url_template(receiver_url), 0);
    (upstream, workload, infos)
}

pub(crate) fn oracle(sim: &Simulation, endpoint: Uuid) -> Items {
    sim.lock()
        .expected_copy(endpoint)
        .into_iter()
        .map(|(subject, (sequence, item))| (subject, (sequence.as_str().to_owned(), item)))
        .collect()
}

pub(crate) fn without_positions(items: &Items) -> BTreeMap<String, Value> {
    items
        .iter()
        .map(|(s, (_, item))| (s.clone(), item.clone()))
        .collect()
}

/// The copy in Postgres (for the wait; the checks read it through the API).
pub(crate) async fn copy_items(pool: &PgPool, endpoint: Uuid) -> Items {
    relay_tests::readback::copy_rows(pool, endpoint)
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
pub(crate) struct Backlog {
    /// Messages stored and not applied.
    pub(crate) waiting: i64,
    /// Reloads not merged.
    pub(crate) reloading: i64,
    /// Changes not published.
    pub(crate) unpublished: i64,
}

/// Messages stored and not applied, and reloads not merged, over every endpoint.
pub(crate) async fn relay_backlog(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM messages m
                 LEFT JOIN endpoint_apply_cursors c ON c.endpoint_id = m.endpoint_id
                 WHERE m.arrival_seq > COALESCE(c.applied_arrival_seq, 0)),
                (SELECT count(*) FROM endpoint_tracks WHERE reload IS NOT NULL)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

impl Backlog {
    /// Nothing left to do.
    pub(crate) const NONE: Self = Self {
        waiting: 0,
        reloading: 0,
        unpublished: 0,
    };
}

/// What is left to do for `endpoints`.
pub(crate) async fn backlog(pool: &PgPool, endpoints: &[Uuid]) -> Backlog {
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM messages m
         LEFT JOIN endpoint_apply_cursors c ON c.endpoint_id = m.endpoint_id
         WHERE m.arrival_seq > coalesce(c.applied_arrival_seq, 0)
           AND m.endpoint_id = ANY($1)",
    )
    .bind(endpoints)
    .fetch_one(pool)
    .await
    .unwrap();
    let reloading: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM endpoint_tracks WHERE reload IS NOT NULL AND endpoint_id = ANY($1)",
    )
    .bind(endpoints)
    .fetch_one(pool)
    .await
    .unwrap();
    let unpublished: i64 = sqlx::query_scalar(UNPUBLISHED)
        .bind(endpoints)
        .fetch_one(pool)
        .await
        .unwrap();
    Backlog {
        waiting,
        reloading,
        unpublished,
    }
}

/// Whether the upstream is idle (after a short wait), and what is left to do for `endpoints`.
pub(crate) async fn look(pool: &PgPool, sim: &Simulation, endpoints: &[Uuid]) -> (bool, Backlog) {
    let idle = sim.wait_idle(Duration::from_millis(10)).await;
    (idle, backlog(pool, endpoints).await)
}

/// Looks in a row that found everything done: three make a relay settled.
#[derive(Default)]
pub(crate) struct Steady(u32);

impl Steady {
    /// Counts this look (`done` or not); whether it is the third done in a row.
    pub(crate) fn look(&mut self, done: bool) -> bool {
        self.0 = if done { self.0 + 1 } else { 0 };
        self.0 >= 3
    }
}

/// Waits until the upstream is idle and `endpoints` have nothing left to apply, merge or
/// publish, with every copy equal to the oracle, three looks in a row; panics with what differs
/// after `limit`. Returns how long it took.
pub(crate) async fn quiesce(
    pool: &PgPool,
    sim: &Simulation,
    endpoints: &[Uuid],
    limit: Duration,
    seed: u64,
) -> Duration {
    let started = Instant::now();
    let mut steady = Steady::default();
    loop {
        let (idle, left) = look(pool, sim, endpoints).await;
        let mut equal = true;
        for &id in endpoints {
            if copy_items(pool, id).await != oracle(sim, id) {
                equal = false;
                break;
            }
        }
        if steady.look(idle && left == Backlog::NONE && equal) {
            return started.elapsed();
        }
        if started.elapsed() > limit {
            let mut report = Vec::new();
            for &id in endpoints {
                let (copy, truth) = (copy_items(pool, id).await, oracle(sim, id));
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
}

/// The endpoint's change stream as the outbox holds it: its epoch, and its last change_seq.
pub(crate) async fn stream_position(pool: &PgPool, endpoint: Uuid) -> (u64, i64) {
    let (epoch, last): (i64, i64) = sqlx::query_as(
        "SELECT COALESCE(max(epoch), 1), COALESCE(max(last), 0) FROM endpoint_change_counters
         WHERE endpoint_id = $1",
    )
    .bind(endpoint)
    .fetch_one(pool)
    .await
    .unwrap();
    (epoch as u64, last)
}

pub(crate) async fn change_count(pool: &PgPool, endpoint: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM changes WHERE endpoint_id = $1")
        .bind(endpoint)
        .fetch_one(pool)
        .await
        .unwrap()
}

pub(crate) fn describe_difference(copy: &Items, oracle: &Items) -> String {
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

/// A connection to the broker at `url` for a test's consumer; `test` names the test that needs
/// RabbitMQ when it is not there.
pub(crate) async fn connect_broker(url: &str, test: &str) -> Connection {
    try_connect_broker(url)
        .await
        .unwrap_or_else(|e| panic!("the {test} test needs RabbitMQ on 127.0.0.1:5672: {e}"))
}

/// A connection to the broker at `url` trusting the platform's roots, or why there is none (for
/// tests that expect a refusal).
pub(crate) async fn try_connect_broker(
    url: &str,
) -> Result<Connection, relay_publisher::BrokerError> {
    relay_publisher::connect(
        url,
        "test",
        Duration::from_secs(10),
        &relay_netguard::TrustRoots::platform(),
    )
    .await
}

/// Stops the simulation and waits for its senders to end.
pub(crate) async fn stop_simulation(sim: &Simulation, senders: Vec<JoinHandle<()>>) {
    sim.shutdown();
    for sender in senders {
        let _ = sender.await;
    }
}

// ---- The publisher and the queues ----

pub(crate) fn publisher_config(amqp_url: String, key_prefix: &str) -> PublisherConfig {
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
        // Tests read the publish cursors soon after the queue has the changes.
        mark_interval: Duration::from_millis(100),
        metrics_interval: Duration::from_millis(100),
        destination_refresh: Duration::from_millis(300),
        ..PublisherConfig::default()
    }
}

pub(crate) async fn start_publisher(
    pool: &PgPool,
    config: PublisherConfig,
) -> (PublisherHandle, prometheus::Registry) {
    let registry = prometheus::Registry::new();
    let handle = Publisher::start(pool.clone(), config, relay_tests::keys(), &registry)
        .await
        .expect("the pipeline test needs Redis on 127.0.0.1:6379");
    (handle, registry)
}

/// The sum of the series of metric family `name` that carry `label` (its name and value) when
/// given, every series otherwise: a counter's or a gauge's value, a histogram's count of samples;
/// `None` when no series matches.
pub(crate) fn series(
    registry: &prometheus::Registry,
    name: &str,
    label: Option<(&str, &str)>,
) -> Option<f64> {
    use prometheus::proto::MetricType;
    let mut sum = None;
    for family in registry.gather().iter().filter(|f| f.name() == name) {
        for m in family.get_metric() {
            let labelled = label.is_none_or(|(label, value)| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == label && l.value() == value)
            });
            if !labelled {
                continue;
            }
            *sum.get_or_insert(0.0) += match family.get_field_type() {
                MetricType::COUNTER => m.get_counter().get_value(),
                MetricType::GAUGE => m.get_gauge().get_value(),
                _ => m.get_histogram().get_sample_count() as f64,
            };
        }
    }
    sum
}

/// Sum of every series of a metric family (0 when absent).
pub(crate) fn metric(registry: &prometheus::Registry, name: &str) -> f64 {
    series(registry, name, None).unwrap_or(0.0)
}

/// Sum of the series of a metric family with `label` set to `value` (0 when absent).
pub(crate) fn labelled(
    registry: &prometheus::Registry,
    name: &str,
    label: &str,
    value: &str,
) -> f64 {
    series(registry, name, Some((label, value))).unwrap_or(0.0)
}

/// Drains `tenant`'s queue (its publisher stopped, so the count is final) and checks that it
/// rebuilds each of `own` endpoints' copies: the oracle's items, every change sequence once,
/// nothing of another tenant or endpoint, repeats only of the same message. Returns how many
/// messages came, and how many of them were repeats.
pub(crate) async fn check_tenant_queue(
    broker: &Connection,
    pool: &PgPool,
    sim: &Simulation,
    tenant: Uuid,
    own: &[Uuid],
    seed: u64,
) -> (usize, usize) {
    let (messages, repeats) =
        check_tenant_queue_from(broker, pool, sim, ReferenceConsumer::new(tenant), own, seed).await;
    (messages.len(), repeats)
}

/// [`check_tenant_queue`] for a consumer that took some changes already: each of `own`
/// endpoints' changes after the last `consumer` took must be in the queue (and no other
/// change), and the consumer must rebuild the oracle's items from them. Returns the messages
/// drained, in order, and how many of them were repeats.
pub(crate) async fn check_tenant_queue_from(
    broker: &Connection,
    pool: &PgPool,
    sim: &Simulation,
    mut consumer: ReferenceConsumer,
    own: &[Uuid],
    seed: u64,
) -> (Vec<ChangeMessage>, usize) {
    let tenant = consumer.tenant();
    let before = consumer.stats();
    let taken: HashMap<Uuid, (u64, i64)> =
        own.iter().map(|&id| (id, consumer.position(id))).collect();
    let mut tenant_changes = 0;
    for &id in own {
        tenant_changes += change_count(pool, id).await;
    }
    // The queue is declared with the tenant's first publish: an endpoint whose filter selects
    // nothing may have no change at all, and a tenant of only such endpoints no queue.
    let messages = if tenant_changes > 0 {
        crate::publisher::drain(broker, &relay_publisher::tenant_queue(tenant), true).await
    } else {
        Vec::new()
    };
    let mut bodies: HashMap<String, Value> = HashMap::new();
    let mut repeats = 0;
    let mut decoded = Vec::with_capacity(messages.len());
    for delivered in &messages {
        let message = ChangeMessage::decode(&delivered.body)
            .unwrap_or_else(|e| panic!("seed {seed}: an undecodable message: {e}"));
        assert_eq!(
            message.tenant_id, tenant,
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
            format!(
                "{}:{}:{}",
                message.webhook_endpoint_id, message.epoch, message.change_seq
            ),
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
                repeats += 1;
            }
            None => {
                bodies.insert(delivered.message_id.clone(), body);
            }
        }
        consumer.receive(&message);
        decoded.push(message);
    }
    let stats = consumer.stats();
    assert_eq!(
        stats.waiting, 0,
        "seed {seed}: tenant {tenant}: changes missing or out of order: {stats:?}"
    );
    assert_eq!(
        stats.other_tenant, before.other_tenant,
        "seed {seed}: {stats:?}"
    );
    assert_eq!(
        stats.removals_of_nothing, before.removals_of_nothing,
        "seed {seed}: {stats:?}"
    );
    assert_eq!(
        (stats.duplicates - before.duplicates) as usize,
        messages.len() - bodies.len(),
        "seed {seed}: a repeat that is not of the same message_id: {stats:?}"
    );
    for &id in own {
        let (epoch, count) = stream_position(pool, id).await;
        assert_eq!(
            change_count(pool, id).await,
            count,
            "seed {seed}: endpoint {id}'s outbox holds its epoch's changes"
        );
        // An endpoint whose filter selected nothing has no change, and the consumer no epoch
        // of it to follow.
        let expected = if count == 0 { (0, 0) } else { (epoch, count) };
        assert_eq!(
            consumer.position(id),
            expected,
            "seed {seed}: endpoint {id} has {count} changes in epoch {epoch}"
        );
        let received: BTreeSet<i64> = bodies
            .values()
            .filter(|b| {
                b["webhook_endpoint_id"] == id.to_string() && b["epoch"].as_u64() == Some(epoch)
            })
            .map(|b| b["change_seq"].as_i64().unwrap())
            .collect();
        let first = match taken[&id] {
            (taken_epoch, seq) if taken_epoch == epoch => seq + 1,
            _ => 1,
        };
        assert_eq!(
            received,
            (first..=count).collect::<BTreeSet<i64>>(),
            "seed {seed}: endpoint {id}: a change sequence is missing, or one taken already came"
        );
        let truth = oracle(sim, id);
        let rebuilt = consumer.items(id);
        assert!(
            rebuilt == without_positions(&truth),
            "seed {seed}: endpoint {id}'s copy rebuilt from the queue ({} items) is not the \
             oracle's ({} items)",
            rebuilt.len(),
            truth.len()
        );
    }
    (decoded, repeats)
}

/// The sequencer of a whole-relay test, in this process (see [`sequencer_config`]).
pub(crate) async fn start_sequencer(
    database_url: &str,
    key_prefix: &str,
    max_concurrent_endpoints: usize,
    outbound: OutboundPolicy,
) -> Sequencer {
    start_sequencer_with(
        database_url,
        sequencer_config(key_prefix, max_concurrent_endpoints, outbound),
        SequencerMetrics::unregistered(),
    )
    .await
}

/// A whole-relay test's sequencer settings: short leases and sweeps so a test quiesces
/// quickly, reloads of 8 items a page so the faults between pages strike, at most
/// `max_concurrent_endpoints` worked at once, upstream requests only where `outbound` allows.
pub(crate) fn sequencer_config(
    key_prefix: &str,
    max_concurrent_endpoints: usize,
    outbound: OutboundPolicy,
) -> SequencerConfig {
    SequencerConfig {
        redis_url: redis_url(),
        key_prefix: key_prefix.to_owned(),
        lease: Duration::from_millis(1500),
        max_concurrent_endpoints,
        sweep_interval: Duration::from_millis(200),
        idle_linger: Duration::from_millis(100),
        upstream_timeout: Duration::from_secs(5),
        feed_page_limit: 8,
        outbound,
        ..SequencerConfig::default()
    }
}

/// A pool for a sequencer of its own, sized and timed as the whole-relay tests run it.
pub(crate) fn sequencer_pool(database_url: &str) -> PgPool {
    relay_store::connect(
        database_url,
        &PoolOptions {
            max_connections: 8,
            acquire_timeout: Duration::from_secs(30),
            statement_timeout: Some(Duration::from_secs(60)),
            generic_plans: false,
            ..PoolOptions::default()
        },
    )
    .unwrap()
}

/// The sequencer with `config` and `metrics`, on a pool of its own.
pub(crate) async fn start_sequencer_with(
    database_url: &str,
    config: SequencerConfig,
    metrics: SequencerMetrics,
) -> Sequencer {
    Sequencer::start(
        sequencer_pool(database_url),
        config,
        relay_tests::keys(),
        metrics,
    )
    .await
    .expect("the whole-relay tests need Redis on 127.0.0.1:6379")
}

// ---- A test's whole relay ----

/// A whole-relay test's own room on the shared servers, removed when dropped: a Redis key
/// prefix and a RabbitMQ vhost.
pub(crate) struct Room {
    pub(crate) prefix: RedisPrefix,
    pub(crate) vhost: Vhost,
}

impl Room {
    pub(crate) async fn new() -> Self {
        Self {
            prefix: RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple())),
            vhost: tokio::task::spawn_blocking(Vhost::create).await.unwrap(),
        }
    }
}

/// The relay's tiers in this process on one database, under a [`Room`]'s prefix and vhost: the
/// front tier, the control plane and a sequencer (16 endpoints at once), both taking any
/// upstream URL, and a publisher.
pub(crate) struct Relay {
    pub(crate) app: TestApp,
    pub(crate) api: Api,
    pub(crate) sequencer: Sequencer,
    pub(crate) publisher: Option<PublisherHandle>,
}

impl Relay {
    /// The relay on a database of its own.
    pub(crate) async fn start(room: &Room) -> Self {
        Self::start_on(TestDb::new().await, room).await
    }

    /// The relay on `db` (one restored from a backup, say).
    pub(crate) async fn start_on(db: TestDb, room: &Room) -> Self {
        let (prefix, amqp_url) = (&room.prefix.0, room.vhost.url());
        let app = TestApp::spawn_waking_on(db, prefix).await;
        let api = Api::start(&app.db.url, &amqp_url, OutboundPolicy::ANY).await;
        let sequencer = start_sequencer(&app.db.url, prefix, 16, OutboundPolicy::ANY).await;
        let (publisher, _) =
            start_publisher(&app.db.pool, publisher_config(amqp_url, prefix)).await;
        Self {
            app,
            api,
            sequencer,
            publisher: Some(publisher),
        }
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.app.db.pool
    }

    pub(crate) async fn stop_publisher(&mut self) {
        if let Some(publisher) = self.publisher.take() {
            publisher.stop().await;
        }
    }

    /// Stops every tier, the front tier first (so nothing more is stored); the database stays.
    pub(crate) async fn stop(mut self) -> TestDb {
        if let Some(server) = self.app.server.take() {
            server.stop().await.unwrap();
        }
        let publisher = self.publisher.take();
        self.sequencer.stop().await;
        if let Some(publisher) = publisher {
            publisher.stop().await;
        }
        self.api.stop().await;
        self.app.db
    }
}

/// A listener for the simulator's API on `host`, port 0, and the base URL it serves at: bound
/// before the endpoints are registered, since they name it.
pub(crate) async fn upstream_listener(host: &str) -> (TcpListener, String) {
    let listener = TcpListener::bind(format!("{host}:0")).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    (listener, url)
}

/// The simulation of `upstream`, sending each webhook within `send_timeout`, its API served on
/// `listener`, and its senders (started).
pub(crate) async fn serve_simulation(
    upstream: Upstream,
    send_timeout: Duration,
    listener: TcpListener,
) -> (Arc<Simulation>, Vec<JoinHandle<()>>) {
    let sim = Simulation::new(upstream, send_timeout);
    relay_simulator::api::serve(listener, sim.clone())
        .await
        .unwrap();
    let senders = sim.spawn_senders();
    (sim, senders)
}

// ---- The copy written without a sequencer ----

/// Writes one endpoint's copy through the statements the sequencer runs (relay-store's
/// `runs::open_runs` and `runs::write_runs` around relay-rules' `decide_run`, and
/// `copy::merge`), as relay-rules' `run` module says to drive them, with no worker, lease or
/// stored message: for tests that need a copy, its outbox or its track in a given state, and for
/// comparing the SQL with the in-memory model on the same runs.
pub(crate) struct CopyWriter {
    pub(crate) claim: relay_store::tracks::TrackClaim,
    /// The arrival number the next run's messages are noted under.
    next_seq: i64,
}

impl CopyWriter {
    /// Registers `endpoint` for `tenant` (the fence names a registered endpoint) and claims its
    /// fence.
    pub(crate) async fn new(db: &relay_tests::TestDb, tenant: Uuid, endpoint: Uuid) -> Self {
        db.endpoint(tenant, endpoint, &relay_tests::random_secret())
            .await;
        let token = db.claim_fence(endpoint).await;
        let claim = relay_store::tracks::TrackClaim {
            endpoint: relay_store::EndpointId(endpoint),
            tenant: relay_store::TenantId(tenant),
            token,
        };
        Self { claim, next_seq: 0 }
    }

    /// Decides `messages` as one run against the copy as it is, and writes the plan in one
    /// transaction. Panics when a planned row is refused (nothing else writes this copy).
    pub(crate) async fn run(
        &mut self,
        pool: &PgPool,
        messages: &[relay_rules::StoredMessage],
        refetches: &HashMap<String, relay_rules::RefetchRead>,
    ) -> relay_rules::RunPlan {
        use relay_store::runs::{self, RunWrite};
        let mut tx = pool.begin().await.unwrap();
        let plan = open_and_decide(&mut tx, self.claim, messages, refetches).await;
        let from = self.next_seq;
        let seqs: Vec<i64> = (1..=messages.len() as i64).map(|i| from + i).collect();
        let to = seqs.last().copied().unwrap_or(from);
        let write = RunWrite {
            endpoint: self.claim.endpoint,
            tenant: self.claim.tenant,
            plan: &plan,
            from,
            to,
            arrival_seqs: &seqs,
            last_received_at: None,
        };
        let written = runs::write_runs(&mut tx, &[write]).await.unwrap();
        assert_eq!(
            written[0].rows,
            plan.rows.len() as i64,
            "a planned row was refused"
        );
        assert!(written[0].cursor_moved);
        tx.commit().await.unwrap();
        self.next_seq = to;
        assert_appended_is_the_outbox(pool, self.claim, &written[0]).await;
        plan
    }

    /// Merges a pass of `reload` as the sequencer's reload does.
    pub(crate) async fn merge(
        &self,
        pool: &PgPool,
        reload: &relay_rules::Reload,
        pass: &relay_rules::Pass,
    ) -> relay_store::copy::Merged {
        relay_store::copy::merge(pool, self.claim, reload, pass)
            .await
            .unwrap()
    }
}

/// What `write_runs` reports appended (what the sequencer hands the publisher of its process) is
/// what the publisher would read back from the outbox: every column, each change as its
/// message.
pub(crate) async fn assert_appended_is_the_outbox(
    pool: &PgPool,
    claim: relay_store::tracks::TrackClaim,
    written: &relay_store::runs::RunWritten,
) {
    assert_eq!(
        written.appended.len() as i64,
        written.changes,
        "every change appended"
    );
    let Some(first) = written.appended.first() else {
        return;
    };
    let plan = [(claim.endpoint, first.change_seq - 1, written.changes)];
    let read = relay_store::changes::next_changes(pool, claim.tenant, &plan)
        .await
        .unwrap();
    // A publisher running beside the writer may have sent and marked the first of them between
    // the commit and this read, which then skips them: those must be marked published.
    let skipped = written.appended.len() - read.len();
    if skipped > 0 {
        let published: Option<i64> = sqlx::query_scalar(
            "SELECT published_through FROM endpoint_publish_cursors WHERE endpoint_id = $1",
        )
        .bind(claim.endpoint)
        .fetch_optional(pool)
        .await
        .unwrap();
        assert!(
            published >= Some(first.change_seq + skipped as i64 - 1),
            "the outbox read skipped {skipped} changes from {} that are not marked published \
             ({published:?})",
            first.change_seq
        );
    }
    for (handed, read) in written.appended[skipped..].iter().zip(read) {
        let diff = |text: &str| serde_json::from_str::<serde_json::Value>(text).unwrap();
        assert_eq!(diff(&handed.parts_diff), diff(&read.parts_diff));
        let same_diff = relay_store::changes::Unpublished {
            parts_diff: handed.parts_diff.clone(),
            ..read
        };
        assert_eq!(format!("{handed:?}"), format!("{same_diff:?}"));
    }
}

/// Opens the run of `messages` under `claim` in `tx` (relay-store's `runs::open_runs`, under the
/// endpoint's locks) and decides it whole with relay-rules' `decide_run`, as the sequencer does.
/// Panics when the fence is not `claim`'s.
pub(crate) async fn open_and_decide(
    tx: &mut sqlx::PgConnection,
    claim: relay_store::tracks::TrackClaim,
    messages: &[relay_rules::StoredMessage],
    refetches: &HashMap<String, relay_rules::RefetchRead>,
) -> relay_rules::RunPlan {
    let ids = relay_rules::event_ids(messages);
    let subjects = relay_rules::subjects(messages);
    let claim = relay_store::runs::RunClaim {
        claim,
        event_ids: &ids,
        subjects: &subjects,
    };
    let opened = relay_store::runs::open_runs(tx, &[claim])
        .await
        .unwrap()
        .pop()
        .flatten()
        .expect("the fence is the claim's");
    let run = relay_rules::Run {
        track: &opened.track,
        messages,
        seen: &opened.seen,
        refetches,
    };
    relay_rules::decide_run(run, opened.held)
}
