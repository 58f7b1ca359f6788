//! Losing a node of each engine while messages flow, measured the way Jepsen would.
//!
//! The test starts its own engines on this machine (`relay_tests::engines`): a three-node
//! RabbitMQ cluster, a Postgres primary with a synchronous streaming standby, and a Redis. Two
//! processes of every tier run against them (the front tiers behind a round-robin balancer),
//! each reaching every engine through a proxy of its tier's own, so that one tier can be cut off
//! from one engine. The simulator's feed and stories upstreams send with every fault on, while a
//! seeded schedule of faults runs: kill -9 the broker node leading a tenant's queue (started
//! again later), kill -9 the Postgres primary and promote the standby (the old primary then
//! rebuilt as the new standby), restart Redis empty, partition a tier from an engine for a while
//! (connections refused, or held without a byte), and combinations of them.
//!
//! After each schedule, with every fault healed: every message the relay answered 2xx is stored;
//! every copy equals the oracle; every tenant's queue, read from the cluster, rebuilds each copy
//! with no change missing or out of order. The campaign prints its figures (faults by kind,
//! messages answered 2xx, lost, copies converged, and the time from each fault to the relay
//! applying and publishing again); BENCHMARKS.md keeps them. `RELAY_FAULT_SCHEDULES=N` runs N
//! schedules (CI runs a few), `RELAY_TEST_SEED` replays a campaign (with `RELAY_FAULT_FROM=k`,
//! from its schedule k), and `RELAY_FAULT_REPORT=path` writes the figures there as JSON.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_netguard::TrustRoots;
use relay_publisher::{Delivered, ReferenceConsumer};
use relay_simulator::cli::{prepare, send_timeout, SimulateArgs};
use relay_simulator::stories::StoriesLogEntry;
use relay_simulator::{
    Answer, Faults, LogEntry, Simulation, Stories, StoriesConfig, StoriesWorkload,
    StoriesWorkloadConfig,
};
use relay_tests::engines::{PgPair, RabbitCluster, RedisServer};
use relay_tests::{PgProxy, ProxyMode};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::scale_out::{free_address, register_through_control_planes, round_robin, TierProcess};
use crate::stack::{backlog, check_tenant_queue, quiesce, upstream_listener, Backlog};
use crate::stories_convergence::{copy_rows, rebuilt_stories, register};

/// What the recovery times are measured beside: the same measurement from an instant with no
/// fault.
const BASELINE: &str = "no fault (baseline)";
/// How far behind the asynchronous standby is held when its primary is killed.
const STANDBY_LAG: Duration = Duration::from_secs(1);
/// The control planes' signing key.
const JWT_SECRET: &str = "failover-campaign-signing-key-at-least-32-bytes";
/// The stories upstream's time runs this much faster than the wire file's.
const STORIES_COMPRESSION: f64 = 60_000.0;
/// How long each schedule's traffic flows; the faults fall within it.
const TRAFFIC: Duration = Duration::from_secs(16);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Tier {
    Ingest,
    Sequencer,
    Publisher,
    Api,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Engine {
    Postgres,
    RabbitMq,
    Redis,
}

/// The cuts a schedule may make: each tier from each engine it uses.
const PARTITIONS: [(Tier, Engine); 7] = [
    (Tier::Ingest, Engine::Postgres),
    (Tier::Sequencer, Engine::Postgres),
    (Tier::Publisher, Engine::Postgres),
    (Tier::Publisher, Engine::RabbitMq),
    (Tier::Ingest, Engine::Redis),
    (Tier::Sequencer, Engine::Redis),
    (Tier::Publisher, Engine::Redis),
];

#[derive(Debug, Clone)]
enum Fault {
    /// kill -9 the broker node leading a tenant's queue; started again after `down`.
    BrokerLeader { down: Duration },
    /// kill -9 the Postgres primary; the standby promoted `promote_after` later, then the old
    /// primary rebuilt as its synchronous standby.
    PostgresPrimary { promote_after: Duration },
    /// kill -9 Redis and start it again empty: every lease and hint forgotten.
    RedisRestart,
    /// Cut `tier`'s processes off from `engine` for `lasting`: connections refused, or held
    /// without passing a byte (`ProxyMode::Blackhole`).
    Partition {
        tier: Tier,
        engine: Engine,
        mode: ProxyMode,
        lasting: Duration,
    },
}

impl Fault {
    fn kind(&self) -> &'static str {
        match self {
            Fault::BrokerLeader { .. } => "broker node leading a queue killed",
            Fault::PostgresPrimary { .. } => "postgres primary killed, standby promoted",
            Fault::RedisRestart => "redis restarted empty",
            Fault::Partition { .. } => "tier partitioned from an engine",
        }
    }
}

/// A fault and when in the schedule's traffic it begins.
#[derive(Debug, Clone)]
struct Planned {
    at: Duration,
    fault: Fault,
}

/// Schedule `index` of the campaign seeded `seed`: of every five, four take one fault each, of
/// each kind in turn, and the fifth two or three of any kinds at once (at most one Postgres
/// failover: the new primary has no standby until the old one is rebuilt).
fn plan(seed: u64, index: usize) -> Vec<Planned> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (index as u64).wrapping_mul(0x9e37_79b9));
    let fault = |kind: usize, rng: &mut ChaCha8Rng| match kind {
        0 => Fault::BrokerLeader {
            down: Duration::from_millis(rng.gen_range(2_000..6_000)),
        },
        1 => Fault::PostgresPrimary {
            promote_after: Duration::from_millis(rng.gen_range(300..3_000)),
        },
        2 => Fault::RedisRestart,
        _ => {
            let (tier, engine) = PARTITIONS[rng.gen_range(0..PARTITIONS.len())];
            Fault::Partition {
                tier,
                engine,
                mode: if rng.gen_bool(0.5) {
                    ProxyMode::Refuse
                } else {
                    ProxyMode::Blackhole
                },
                lasting: Duration::from_millis(rng.gen_range(2_000..6_000)),
            }
        }
    };
    let kinds: Vec<usize> = if index % 5 < 4 {
        vec![index % 5]
    } else {
        let count = rng.gen_range(2..=3);
        let mut kinds = Vec::new();
        while kinds.len() < count {
            let kind = rng.gen_range(0..4);
            if kind != 1 || !kinds.contains(&1) {
                kinds.push(kind);
            }
        }
        kinds
    };
    kinds
        .into_iter()
        .map(|kind| Planned {
            at: Duration::from_millis(rng.gen_range(2_000..8_000)),
            fault: fault(kind, &mut rng),
        })
        .collect()
}

/// The engines, each behind a lock: faults run at once, each holding its engine only while it
/// acts on it.
struct Engines {
    pg: Mutex<PgPair>,
    rabbit: Mutex<RabbitCluster>,
    redis: Mutex<RedisServer>,
    pg_addrs: [SocketAddr; 2],
    rabbit_addrs: Vec<SocketAddr>,
    redis_addr: SocketAddr,
    /// Node 1's management API, where the control planes make tenants' users.
    management: String,
}

/// Each tier's proxies to each engine's servers (Postgres' two, the cluster's three nodes,
/// Redis), which a partition switches together.
struct Proxies(BTreeMap<(Tier, Engine), Vec<PgProxy>>);

impl Proxies {
    async fn start(engines: &Engines) -> Self {
        let mut proxies = BTreeMap::new();
        for tier in [Tier::Ingest, Tier::Sequencer, Tier::Publisher, Tier::Api] {
            let mut postgres = Vec::new();
            for address in engines.pg_addrs {
                postgres.push(PgProxy::start(address).await);
            }
            proxies.insert((tier, Engine::Postgres), postgres);
            proxies.insert(
                (tier, Engine::Redis),
                vec![PgProxy::start(engines.redis_addr).await],
            );
            if matches!(tier, Tier::Publisher | Tier::Api) {
                let mut nodes = Vec::new();
                for &address in &engines.rabbit_addrs {
                    nodes.push(PgProxy::start(address).await);
                }
                proxies.insert((tier, Engine::RabbitMq), nodes);
            }
        }
        Self(proxies)
    }

    fn addresses(&self, tier: Tier, engine: Engine) -> Vec<SocketAddr> {
        self.0[&(tier, engine)].iter().map(|p| p.address).collect()
    }

    fn set(&self, tier: Tier, engine: Engine, mode: ProxyMode) {
        for proxy in &self.0[&(tier, engine)] {
            proxy.set(mode);
        }
    }

    fn heal(&self) {
        for proxies in self.0.values() {
            for proxy in proxies {
                proxy.set(ProxyMode::Pass);
            }
        }
    }
}

/// A libpq-style URL naming every server at `addresses`.
fn postgres_url(addresses: &[SocketAddr], database: &str) -> String {
    let hosts: Vec<String> = addresses.iter().map(ToString::to_string).collect();
    format!("postgres://postgres@{}/{database}", hosts.join(","))
}

/// RELAY_AMQP_URL naming every node at `addresses`.
fn amqp_url(addresses: &[SocketAddr]) -> String {
    let urls: Vec<String> = addresses
        .iter()
        .map(|address| format!("amqp://guest:guest@{address}/%2f"))
        .collect();
    urls.join(",")
}

/// One sample of the relay's progress over a schedule's endpoints.
#[derive(Debug, Clone, Copy)]
struct Progress {
    at: Instant,
    applied: i64,
    published: i64,
}

/// Samples the applied and published positions of `endpoints` every 100 ms until stopped.
fn sample_progress(
    pool: PgPool,
    endpoints: Vec<Uuid>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<Vec<Progress>> {
    tokio::spawn(async move {
        let mut samples = Vec::new();
        while !*stop.borrow() {
            let read = sqlx::query_as::<_, (i64, i64)>(
                "SELECT (SELECT coalesce(sum(applied_arrival_seq), 0)::int8
                           FROM endpoint_apply_cursors WHERE endpoint_id = ANY($1)),
                        (SELECT coalesce(sum(published_through), 0)::int8
                           FROM endpoint_publish_cursors WHERE endpoint_id = ANY($1))",
            )
            .bind(&endpoints)
            .fetch_one(&pool);
            if let Ok(Ok((applied, published))) =
                tokio::time::timeout(Duration::from_secs(1), read).await
            {
                samples.push(Progress {
                    at: Instant::now(),
                    applied,
                    published,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        samples
    })
}

/// From `from`, how long until the relay both applied and published something it had not at
/// `from`; `None` if it did not within the samples.
fn recovery(samples: &[Progress], from: Instant) -> Option<Duration> {
    let before = samples.iter().rev().find(|s| s.at <= from)?;
    samples
        .iter()
        .find(|s| s.at > from && s.applied > before.applied && s.published > before.published)
        .map(|s| s.at.duration_since(from))
}

/// What the campaign counts.
#[derive(Debug, Default)]
struct Figures {
    schedules: usize,
    faults: BTreeMap<&'static str, usize>,
    answered_2xx: usize,
    lost: usize,
    copies_converged: usize,
    queue_copies_converged: usize,
    /// Fault kind (of a schedule's only fault, or "in a combination") and time to applying and
    /// publishing again (from the kill, or from the heal of a partition).
    recoveries: Vec<(&'static str, Duration)>,
    unrecovered: usize,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Figures {
    fn report(&self, seed: u64) -> Value {
        let mut all: Vec<Duration> = self
            .recoveries
            .iter()
            .filter(|(kind, _)| *kind != BASELINE)
            .map(|(_, d)| *d)
            .collect();
        all.sort();
        let mut by_kind: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
        for (kind, took) in &self.recoveries {
            by_kind.entry(kind).or_default().push(*took);
        }
        let by_kind: BTreeMap<&str, Value> = by_kind
            .into_iter()
            .map(|(kind, mut took)| {
                took.sort();
                (
                    kind,
                    json!({
                        "n": took.len(),
                        "p50_ms": percentile(&took, 50.0).as_millis() as u64,
                        "p99_ms": percentile(&took, 99.0).as_millis() as u64,
                    }),
                )
            })
            .collect();
        json!({
            "seed": seed,
            "schedules": self.schedules,
            "faults": self.faults,
            "messages_answered_2xx": self.answered_2xx,
            "messages_lost": self.lost,
            "copies_converged": self.copies_converged,
            "queue_copies_converged": self.queue_copies_converged,
            "recovery_p50_ms": percentile(&all, 50.0).as_millis() as u64,
            "recovery_p99_ms": percentile(&all, 99.0).as_millis() as u64,
            "recovery_by_kind": by_kind,
            "faults_without_recovery_seen": self.unrecovered,
        })
    }
}

/// The relay on the engines: two processes of every tier, the test's own pool, the balancer.
struct Campaign {
    /// The standby asynchronous (`synchronous_standby_names` empty): the run that counts what a
    /// failover loses, rather than checking that nothing is.
    asynchronous_standby: bool,
    engines: Arc<Engines>,
    proxies: Arc<Proxies>,
    pool: PgPool,
    tiers: Vec<TierProcess>,
    apis: [String; 2],
    balancer: SocketAddr,
    client: reqwest::Client,
    _balancing: tokio::task::JoinHandle<()>,
}

impl Campaign {
    async fn start(asynchronous_standby: bool) -> Self {
        let started = Instant::now();
        let (pg, rabbit, redis) = tokio::join!(
            PgPair::start(),
            RabbitCluster::start(),
            RedisServer::start()
        );
        let (pg, rabbit, redis) = (
            pg.expect("a Postgres pair"),
            rabbit.expect("a RabbitMQ cluster"),
            redis.expect("a Redis"),
        );
        eprintln!("failover: engines up in {:?}", started.elapsed());
        let redis_addr: SocketAddr = redis
            .url()
            .trim_start_matches("redis://")
            .parse()
            .expect("redis://host:port");
        let engines = Arc::new(Engines {
            pg_addrs: pg.addrs(),
            rabbit_addrs: (0..3).map(|node| rabbit.amqp_addr(node)).collect(),
            redis_addr,
            management: rabbit.management_url(0),
            pg: Mutex::new(pg),
            rabbit: Mutex::new(rabbit),
            redis: Mutex::new(redis),
        });
        let database = "relay_failover";
        {
            let pg = engines.pg.lock().await;
            let admin = pg.url(pg.primary(), "postgres");
            let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect(&admin)
                .await
                .unwrap();
            sqlx::query(&format!("CREATE DATABASE {database}"))
                .execute(&mut connection)
                .await
                .unwrap();
        }
        let pool = relay_store::connect(
            &postgres_url(&engines.pg_addrs, database),
            &relay_store::PoolOptions::default(),
        )
        .unwrap();
        relay_store::MIGRATOR.run(&pool).await.unwrap();

        let proxies = Arc::new(Proxies::start(&engines).await);
        let global = |tier: Tier| -> Vec<String> {
            let redis = proxies.addresses(tier, Engine::Redis)[0];
            [
                "--database-url",
                &postgres_url(&proxies.addresses(tier, Engine::Postgres), database),
                "--redis-url",
                &format!("redis://{redis}"),
                "--redis-key-prefix",
                "failover:",
                "--upstream-allow-http",
                "--upstream-allow-private",
            ]
            .into_iter()
            .map(str::to_owned)
            .collect()
        };
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap();
        let ingest_addresses = [free_address(), free_address()];
        let api_addresses = [free_address(), free_address()];
        let mut tiers = Vec::new();
        for (i, address) in ingest_addresses.iter().enumerate() {
            let listen = address.to_string();
            tiers.push(TierProcess::start(
                &format!("ingest {i}"),
                &global(Tier::Ingest),
                &["ingest", "--listen", &listen],
                free_address(),
            ));
        }
        let publisher_amqp = amqp_url(&proxies.addresses(Tier::Publisher, Engine::RabbitMq));
        for i in 0..2 {
            tiers.push(TierProcess::start(
                &format!("sequencer {i}"),
                &global(Tier::Sequencer),
                &[
                    "sequencer",
                    "--sweep-interval-ms",
                    "200",
                    "--lease-ms",
                    "3000",
                    "--stories-catch-up-interval-s",
                    "2",
                ],
                free_address(),
            ));
            tiers.push(TierProcess::start(
                &format!("publisher {i}"),
                &global(Tier::Publisher),
                &[
                    "publisher",
                    "--amqp-url",
                    &publisher_amqp,
                    "--publisher-lease-ms",
                    "3000",
                ],
                free_address(),
            ));
        }
        let api_amqp = amqp_url(&proxies.addresses(Tier::Api, Engine::RabbitMq));
        for (i, address) in api_addresses.iter().enumerate() {
            let listen = address.to_string();
            tiers.push(TierProcess::start(
                &format!("api {i}"),
                &global(Tier::Api),
                &[
                    "api",
                    "--api-listen",
                    &listen,
                    "--amqp-url",
                    &api_amqp,
                    "--amqp-management-url",
                    &engines.management,
                    "--jwt-secret",
                    JWT_SECRET,
                ],
                free_address(),
            ));
        }
        for tier in &tiers {
            tier.wait_ready(&client).await;
        }
        let (balancer, balancing) = round_robin(ingest_addresses.to_vec()).await;
        eprintln!("failover: relay up in {:?}", started.elapsed());
        Self {
            asynchronous_standby,
            engines,
            proxies,
            pool,
            tiers,
            apis: api_addresses.map(|address| format!("http://{address}")),
            balancer,
            client,
            _balancing: balancing,
        }
    }

    /// Runs `fault` at `at` after `start`; returns when it is over (healed), with the instant
    /// recovery is measured from.
    async fn inject(
        engines: Arc<Engines>,
        proxies: Arc<Proxies>,
        queues: Vec<String>,
        start: Instant,
        planned: Planned,
        seed: u64,
    ) -> (&'static str, Instant) {
        tokio::time::sleep_until((start + planned.at).into()).await;
        let kind = planned.fault.kind();
        match planned.fault {
            Fault::BrokerLeader { down } => {
                let mut leader = None;
                for queue in &queues {
                    let rabbit = engines.rabbit.lock().await;
                    if let Ok(Some(node)) = rabbit.leader_of("/", queue).await {
                        leader = Some(node);
                        break;
                    }
                }
                let node = leader.unwrap_or(0);
                engines.rabbit.lock().await.kill(node);
                let killed = Instant::now();
                eprintln!("seed {seed}: killed broker node {} (leader)", node + 1);
                tokio::time::sleep(down).await;
                engines
                    .rabbit
                    .lock()
                    .await
                    .restart(node)
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed}: restarting node {node}: {e:#}"));
                (kind, killed)
            }
            Fault::PostgresPrimary { promote_after } => {
                let mut pg = engines.pg.lock().await;
                pg.kill_primary();
                let killed = Instant::now();
                eprintln!("seed {seed}: killed the Postgres primary");
                tokio::time::sleep(promote_after).await;
                pg.promote_standby()
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed}: promoting: {e:#}"));
                pg.rebuild_standby()
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed}: rebuilding the standby: {e:#}"));
                (kind, killed)
            }
            Fault::RedisRestart => {
                engines
                    .redis
                    .lock()
                    .await
                    .restart()
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed}: restarting Redis: {e:#}"));
                eprintln!("seed {seed}: restarted Redis");
                (kind, Instant::now())
            }
            Fault::Partition {
                tier,
                engine,
                mode,
                lasting,
            } => {
                proxies.set(tier, engine, mode);
                eprintln!("seed {seed}: {tier:?} cut from {engine:?} ({mode:?}) for {lasting:?}");
                tokio::time::sleep(lasting).await;
                proxies.set(tier, engine, ProxyMode::Pass);
                (kind, Instant::now())
            }
        }
    }

    /// One schedule: fresh simulated endpoints (feed and stories), traffic for [`TRAFFIC`]
    /// with the planned faults, then everything healed and checked.
    async fn run_schedule(&self, seed: u64, index: usize, figures: &mut Figures) {
        let schedule_seed = seed.wrapping_add(index as u64);
        let planned = if self.asynchronous_standby {
            // Only failovers, each at a moment of full traffic, the standby promoted at once.
            let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(index as u64));
            vec![Planned {
                at: Duration::from_millis(rng.gen_range(4_000..10_000)),
                fault: Fault::PostgresPrimary {
                    promote_after: Duration::from_millis(rng.gen_range(0..500)),
                },
            }]
        } else {
            plan(seed, index)
        };
        eprintln!("seed {seed}: schedule {index}: {planned:?}");
        // With an asynchronous standby, its WAL stream goes through a proxy of the test's, held
        // for the second before the primary is killed: the standby is then that far behind, as
        // a busy or distant one is.
        let replication = if self.asynchronous_standby {
            Some(self.lag_the_standby().await)
        } else {
            None
        };
        if let (Some(proxy), Some(first)) = (&replication, planned.first()) {
            let proxy_mode = proxy.clone();
            let hold_at = first.at.saturating_sub(STANDBY_LAG);
            tokio::spawn(async move {
                tokio::time::sleep(hold_at).await;
                proxy_mode.set(ProxyMode::Blackhole);
            });
        }

        // The feed: four endpoints of two keys.
        let (upstream, feed_workload, feed_infos) = prepare(&SimulateArgs {
            receiver_url: format!("http://{}", self.balancer),
            endpoints: 4,
            keys: 2,
            seed: schedule_seed,
            rate: 20.0,
            duration_s: TRAFFIC.as_secs(),
            faults: "all".into(),
            time_compression: 3600.0,
            listen: "127.0.0.1:0".into(),
            select_all: true,
            print_endpoints: false,
            quiet: true,
        })
        .unwrap();
        // The stories: two endpoints of a tenant of their own.
        let (api_listener, simulator_api) = upstream_listener("127.0.0.1").await;
        let faults = Faults::all();
        let mut config = StoriesConfig::from_wire_limits(STORIES_COMPRESSION);
        config.start_unix_ms =
            (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64;
        let mut stories = Stories::new(config, faults.stories.clone(), schedule_seed);
        let mut stories_workload = StoriesWorkload::new(
            schedule_seed,
            StoriesWorkloadConfig {
                endpoints: 2,
                ..StoriesWorkloadConfig::default()
            },
        );
        let stories_infos = stories_workload.setup(
            &mut stories,
            &format!("http://{}/webhooks/{{id}}", self.balancer),
        );
        let stories_tenant = register(&self.pool, &stories_infos, &simulator_api, false).await;
        for info in &stories_infos {
            let registered: time::OffsetDateTime =
                sqlx::query_scalar("SELECT created_at FROM webhook_endpoints WHERE id = $1")
                    .bind(info.id)
                    .fetch_one(&self.pool)
                    .await
                    .unwrap();
            stories.set_registered_at(info.id, registered);
        }
        let sim = Simulation::with_stories(upstream, stories, send_timeout(3600.0));
        relay_simulator::api::serve(api_listener, sim.clone())
            .await
            .unwrap();
        let feed_tenants = register_through_control_planes(
            &self.client,
            &self.apis,
            JWT_SECRET,
            "failover",
            &feed_infos,
            &simulator_api,
        )
        .await;

        let feed_ids: Vec<Uuid> = feed_infos.iter().map(|info| info.id).collect();
        let stories_ids: Vec<Uuid> = stories_infos.iter().map(|info| info.id).collect();
        let all_ids: Vec<Uuid> = feed_ids.iter().chain(&stories_ids).copied().collect();
        let queues: Vec<String> = feed_tenants
            .iter()
            .map(|(tenant, _)| *tenant)
            .chain([stories_tenant.0])
            .map(relay_publisher::tenant_queue)
            .collect();

        let (stop_sampling, sampling) = tokio::sync::watch::channel(false);
        let sampler = sample_progress(self.pool.clone(), all_ids.clone(), sampling);
        let mut senders = sim.spawn_senders();
        senders.push(sim.spawn_stories_sender());
        let start = Instant::now();
        let traffic = tokio::spawn(sim.clone().run_workload(feed_workload, 20.0, TRAFFIC));
        let stories_traffic = tokio::spawn(sim.clone().run_stories_workload(
            stories_workload,
            10.0,
            TRAFFIC,
        ));
        let mut injections = Vec::new();
        for planned in &planned {
            *figures.faults.entry(planned.fault.kind()).or_default() += 1;
            injections.push(Self::inject(
                self.engines.clone(),
                self.proxies.clone(),
                queues.clone(),
                start,
                planned.clone(),
                seed,
            ));
        }
        // Together, in this task: each holds its engine only while it acts on it.
        let mut measured_from = futures::future::join_all(injections).await;
        // The measurement's own floor: from an instant of the traffic before any fault (the
        // first is planned at 2 s), how long until the relay is seen applying and publishing
        // something new (the publish cursor moves at most once a second).
        measured_from.push((BASELINE, start + Duration::from_millis(1_500)));
        let _ = traffic.await;
        let _ = stories_traffic.await;
        self.proxies.heal();

        if self.asynchronous_standby {
            // What the promoted standby never received is gone, and the upstream does not send
            // again what it was answered 2xx for: count it, once the upstream has sent the rest.
            sim.wait_idle(Duration::from_secs(120)).await;
            let (answered, missing) = self.unstored(&sim, &feed_ids, &stories_ids).await;
            eprintln!(
                "seed {seed}: schedule {index}: asynchronous standby: {} of {answered} messages \
                 answered 2xx lost",
                missing.len()
            );
            figures.answered_2xx += answered;
            figures.lost += missing.len();
            let _ = stop_sampling.send(true);
            sim.shutdown();
            for sender in senders {
                let _ = sender.await;
            }
            figures.schedules += 1;
            return;
        }

        // Settled: the upstream idle, nothing left to apply or publish, every copy right.
        let took = quiesce(&self.pool, &sim, &feed_ids, Duration::from_secs(300), seed).await;
        self.settle_stories(&sim, stories_tenant, &stories_ids, &all_ids, seed)
            .await;
        eprintln!(
            "seed {seed}: schedule {index} settled {took:?} after its traffic ({:?} in all)",
            start.elapsed()
        );
        let _ = stop_sampling.send(true);
        let samples = sampler.await.unwrap();
        for (kind, from) in measured_from {
            // With faults overlapping, one fault's recovery waits on the others'.
            let kind = if planned.len() > 1 && kind != BASELINE {
                "in a combination"
            } else {
                kind
            };
            let took = recovery(&samples, from);
            eprintln!("seed {seed}: schedule {index}: {kind}: applying and publishing again after {took:?}");
            match took {
                Some(took) => figures.recoveries.push((kind, took)),
                None => figures.unrecovered += 1,
            }
        }
        figures.copies_converged += all_ids.len();

        // Every message answered 2xx is stored.
        let (answered, missing) = self.unstored(&sim, &feed_ids, &stories_ids).await;
        figures.answered_2xx += answered;
        assert!(
            missing.is_empty(),
            "seed {seed}: schedule {index}: messages answered 2xx and not stored: {missing:?}"
        );

        // Every queue, read from the cluster, rebuilds its copies.
        let broker = self.broker().await;
        for (tenant, endpoints) in &feed_tenants {
            let (messages, repeats) =
                check_tenant_queue(&broker, &self.pool, &sim, *tenant, endpoints, seed).await;
            eprintln!("seed {seed}: tenant {tenant}: {messages} messages, {repeats} repeats");
            figures.queue_copies_converged += endpoints.len();
        }
        self.check_stories_queue(&broker, &sim, stories_tenant.0, &stories_ids, seed)
            .await;
        figures.queue_copies_converged += stories_ids.len();
        let _ = broker.close(200, "checked").await;

        sim.shutdown();
        for sender in senders {
            let _ = sender.await;
        }
        figures.schedules += 1;
    }

    /// How many distinct messages the relay answered 2xx, and those of them not stored.
    async fn unstored(
        &self,
        sim: &Simulation,
        feed_ids: &[Uuid],
        stories_ids: &[Uuid],
    ) -> (usize, Vec<(Uuid, String)>) {
        let mut answered: Vec<(Uuid, BTreeSet<String>)> = Vec::new();
        {
            let upstream = sim.lock();
            for &id in feed_ids {
                let ids = upstream
                    .log(id)
                    .iter()
                    .filter_map(|entry| match entry {
                        LogEntry::Answered {
                            webhook_id,
                            answer: Answer::Status { code, .. },
                            ..
                        } if (200..300).contains(code) => Some(webhook_id.clone()),
                        _ => None,
                    })
                    .collect();
                answered.push((id, ids));
            }
        }
        {
            let stories = sim.stories();
            for &id in stories_ids {
                let ids = stories
                    .stories_log(id)
                    .iter()
                    .filter_map(|entry| match entry {
                        StoriesLogEntry::Answered {
                            webhook_id,
                            answer: Answer::Status { code, .. },
                            ..
                        } if (200..300).contains(code) => Some(webhook_id.clone()),
                        _ => None,
                    })
                    .collect();
                answered.push((id, ids));
            }
        }
        let mut count = 0;
        let mut missing = Vec::new();
        for (id, ids) in answered {
            let stored: BTreeSet<String> =
                sqlx::query_scalar("SELECT webhook_id FROM messages WHERE endpoint_id = $1")
                    .bind(id)
                    .fetch_all(&self.pool)
                    .await
                    .unwrap()
                    .into_iter()
                    .collect();
            count += ids.len();
            missing.extend(ids.difference(&stored).map(|webhook| (id, webhook.clone())));
        }
        (count, missing)
    }

    /// Makes the standby asynchronous and streaming through a proxy of the test's (passing
    /// for now), which the caller holds to make it lag.
    async fn lag_the_standby(&self) -> Arc<PgProxy> {
        // The standby made by the last failover is synchronous again: not in this run.
        sqlx::query("ALTER SYSTEM SET synchronous_standby_names = ''")
            .execute(&self.pool)
            .await
            .unwrap();
        sqlx::query("SELECT pg_reload_conf()")
            .execute(&self.pool)
            .await
            .unwrap();
        let (primary, standby_url) = {
            let pg = self.engines.pg.lock().await;
            (
                self.engines.pg_addrs[pg.primary()],
                pg.url(1 - pg.primary(), "postgres"),
            )
        };
        let proxy = Arc::new(PgProxy::start(primary).await);
        let mut standby = <sqlx::PgConnection as sqlx::Connection>::connect(&standby_url)
            .await
            .unwrap();
        let conninfo = format!(
            "host={} port={} user=postgres application_name=lagging",
            proxy.address.ip(),
            proxy.address.port()
        );
        sqlx::query(&format!("ALTER SYSTEM SET primary_conninfo = '{conninfo}'"))
            .execute(&mut standby)
            .await
            .unwrap();
        sqlx::query("SELECT pg_reload_conf()")
            .execute(&mut standby)
            .await
            .unwrap();
        // Streaming through the proxy before the traffic starts.
        let started = Instant::now();
        loop {
            let port: Option<i32> = sqlx::query_scalar(
                "SELECT sender_port FROM pg_stat_wal_receiver WHERE status = 'streaming'",
            )
            .fetch_optional(&mut standby)
            .await
            .unwrap()
            .flatten();
            if port == Some(i32::from(proxy.address.port())) {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the standby does not stream through the proxy"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        proxy
    }

    /// A connection to whichever node of the cluster answers.
    async fn broker(&self) -> relay_publisher::lapin::Connection {
        let (connection, _) = relay_publisher::connect_any(
            &amqp_url(&self.engines.rabbit_addrs),
            0,
            "failover campaign",
            Duration::from_secs(10),
            &TrustRoots::platform(),
        )
        .await
        .expect("a node of the cluster answers");
        connection
    }

    /// Waits until the stories upstream is idle, nothing is left to apply or publish, and each
    /// stories copy equals the oracle, three looks in a row.
    async fn settle_stories(
        &self,
        sim: &Simulation,
        tenant: relay_store::TenantId,
        endpoints: &[Uuid],
        all: &[Uuid],
        seed: u64,
    ) {
        let started = Instant::now();
        let mut steady = 0;
        loop {
            let idle = sim.wait_idle(Duration::from_millis(10)).await;
            let left = backlog(&self.pool, all).await;
            let mut differences = Vec::new();
            for &id in endpoints {
                let rows = copy_rows(&self.pool, tenant, id).await;
                let found = sim.stories().compare_copy(id, &rows);
                if !found.is_empty() {
                    differences.push(format!("endpoint {id}: {}", found.join("; ")));
                }
            }
            steady = if idle && left == Backlog::NONE && differences.is_empty() {
                steady + 1
            } else {
                0
            };
            if steady >= 3 {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(240),
                "seed {seed}: stories not settled (idle {idle}, {left:?}): {}",
                differences.join(" | ")
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// The stories tenant's queue rebuilds each stories copy, no change missing or out of
    /// order.
    async fn check_stories_queue(
        &self,
        broker: &relay_publisher::lapin::Connection,
        sim: &Simulation,
        tenant: Uuid,
        endpoints: &[Uuid],
        seed: u64,
    ) {
        let queue = relay_publisher::tenant_queue(tenant);
        let delivered = crate::publisher::drain(broker, &queue, true).await;
        let mut consumer = ReferenceConsumer::new(tenant);
        for message in &delivered {
            let decoded = Delivered::decode(&message.body)
                .unwrap_or_else(|e| panic!("seed {seed}: an undecodable message: {e}"));
            consumer.receive_delivered(&decoded);
        }
        let stats = consumer.stats();
        assert_eq!(stats.waiting, 0, "seed {seed}: changes missing: {stats:?}");
        let stories = sim.stories();
        for &id in endpoints {
            let found = stories.compare_copy(id, &rebuilt_stories(&consumer, id));
            assert!(
                found.is_empty(),
                "seed {seed}: stories endpoint {id}'s copy rebuilt from the queue: {}",
                found.join("; ")
            );
        }
    }

    async fn stop(self) {
        for tier in self.tiers {
            tier.kill().await;
        }
        self.pool.close().await;
    }
}

/// A broker setting naming several nodes: the first that answers is used, from the one asked
/// first; with none answering, the error names every node's failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_setting_of_several_nodes_connects_to_the_first_that_answers() {
    let dead = free_address();
    let live = relay_tests::amqp_addr();
    let trust = TrustRoots::platform();
    let setting = amqp_url(&[dead, live]);
    let (connection, node) =
        relay_publisher::connect_any(&setting, 0, "failover test", Duration::from_secs(5), &trust)
            .await
            .expect("the live node answers");
    assert_eq!(node, 1, "{setting}");
    let _ = connection.close(200, "done").await;
    let (connection, node) =
        relay_publisher::connect_any(&setting, 1, "failover test", Duration::from_secs(5), &trust)
            .await
            .unwrap();
    assert_eq!(node, 1);
    let _ = connection.close(200, "done").await;

    let error = relay_publisher::connect_any(
        &amqp_url(&[dead, free_address()]),
        0,
        "failover test",
        Duration::from_secs(5),
        &trust,
    )
    .await
    .expect_err("no node answers");
    let described = error.describe();
    assert!(
        described.contains("node 1") && described.contains("node 2"),
        "{described}"
    );
}

/// A pool on both servers of a pair, the standby named first: its connections go to the primary
/// (a standby is refused), and after the primary is killed and the standby promoted, to the new
/// primary, with nothing committed lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_on_a_primary_and_its_standby_writes_to_the_primary_and_follows_a_promotion() {
    let mut pg = PgPair::start().await.expect("a Postgres pair");
    let standby = 1 - pg.primary();
    let addrs = pg.addrs();
    let url = postgres_url(&[addrs[standby], addrs[pg.primary()]], "postgres");
    let pool = relay_store::connect(
        &url,
        &relay_store::PoolOptions {
            acquire_timeout: Duration::from_secs(10),
            ..relay_store::PoolOptions::default()
        },
    )
    .unwrap();
    sqlx::query("CREATE TABLE kept (n int PRIMARY KEY)")
        .execute(&pool)
        .await
        .expect("written on the primary, though the standby is named first");
    sqlx::query("INSERT INTO kept VALUES (1)")
        .execute(&pool)
        .await
        .unwrap();

    pg.kill_primary();
    pg.promote_standby().await.unwrap();
    let started = Instant::now();
    loop {
        match sqlx::query("INSERT INTO kept VALUES (2)")
            .execute(&pool)
            .await
        {
            Ok(_) => break,
            Err(error) => {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "no write after the promotion: {error}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    eprintln!("writing again {:?} after the promotion", started.elapsed());
    let kept: Vec<i32> = sqlx::query_scalar("SELECT n FROM kept ORDER BY n")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(kept, [1, 2]);
    let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(!in_recovery);
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run alone by .ci/run after the other tests: its engines and tiers take the machine"]
async fn the_relay_survives_losing_a_node_of_each_engine_while_messages_flow() {
    let seed = relay_tests::printed_seed("failover campaign");
    let schedules: usize = std::env::var("RELAY_FAULT_SCHEDULES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(5);
    // A schedule of a campaign replays alone: RELAY_TEST_SEED, RELAY_FAULT_FROM=its index.
    let from: usize = std::env::var("RELAY_FAULT_FROM")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let campaign = Campaign::start(false).await;
    let mut figures = Figures::default();
    let started = Instant::now();
    for index in from..from + schedules {
        campaign.run_schedule(seed, index, &mut figures).await;
    }
    let report = figures.report(seed);
    eprintln!(
        "failover campaign: {} in {:?}",
        serde_json::to_string_pretty(&report).unwrap(),
        started.elapsed()
    );
    if let Ok(path) = std::env::var("RELAY_FAULT_REPORT") {
        std::fs::write(path, serde_json::to_vec_pretty(&report).unwrap()).unwrap();
    }
    assert_eq!(figures.lost, 0, "seed {seed}: messages lost");
    campaign.stop().await;
}

/// What the relay cannot survive: a Postgres standby that is not synchronous. The same relay and
/// traffic, the standby's WAL stream held for [`STANDBY_LAG`] before the primary is killed under
/// full load and the standby promoted, each schedule; messages answered 2xx that the standby
/// never received are counted, not refused. Run by hand (docs/scaling.md, "What the relay cannot
/// survive"): `RELAY_FAULT_SCHEDULES=N`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement of a setting the relay must not be run with; run by hand"]
async fn an_asynchronous_standby_loses_what_it_had_not_received() {
    let seed = relay_tests::printed_seed("asynchronous standby");
    let schedules: usize = std::env::var("RELAY_FAULT_SCHEDULES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(5);
    let campaign = Campaign::start(true).await;
    let mut figures = Figures::default();
    for index in 0..schedules {
        campaign.run_schedule(seed, index, &mut figures).await;
    }
    eprintln!(
        "asynchronous standby: {} failovers, {} of {} messages answered 2xx lost",
        figures.schedules, figures.lost, figures.answered_2xx
    );
    campaign.stop().await;
}
