//! Stories end to end: the simulated stories upstream (seed 000) sends signed webhooks, with
//! every fault on, over real HTTP to the real front tier; sequencer processes (this test binary
//! re-run as a child, so a kill is a real SIGKILL) apply them and catch up from the simulator's
//! `GET /v1/events`; a publisher sends every change to the tenant's RabbitMQ queue. At
//! quiescence each stories copy, and each copy rebuilt from the queue, must equal the oracle;
//! every story that became strong (live) must be notified exactly once (the claim and its
//! notification commit together, so no crash falls between them), and none for backfill.
//!
//! Also: an outage of the relay longer than the webhooks' retries, recovered by catch-up alone;
//! and the catch-up cursor expiring (410), recovered by a reload in full.
//!
//! Every run prints its seed; `RELAY_TEST_SEED=<seed>` replays one.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_netguard::OutboundPolicy;
use relay_publisher::{Delivered, ReferenceConsumer};
use relay_rules::StoriesMode;
use relay_sequencer::{SequencerConfig, SequencerMetrics};
use relay_simulator::model::World;
use relay_simulator::stories::{CopyRow, StoryEventType};
use relay_simulator::upstream::{SenderConfig, Upstream};
use relay_simulator::{
    Faults, Origin, Simulation, Stories, StoriesConfig, StoriesEndpointInfo, StoriesFaults,
    StoriesWorkload, StoriesWorkloadConfig,
};
use relay_store::endpoints::{self, Registration, Source, StoriesSettings};
use relay_store::{EndpointId, TenantId};
use relay_tests::{TestApp, Vhost};
use relay_wire::SigningSecret;
use sqlx::PgPool;
use uuid::Uuid;

use crate::convergence::{sequencer_spec, Sequencers};
use crate::stack::{
    connect_broker, labelled, metric, publisher_config, start_publisher, upstream_listener,
};

/// Simulated time runs this much faster than the wire file's: retries back off in
/// milliseconds, and the 30-day window is about 43 minutes.
const COMPRESSION: f64 = 60_000.0;

/// One seeded run's shape.
#[derive(Debug, Clone)]
struct Run {
    seed: u64,
    endpoints: usize,
    rate: f64,
    duration: Duration,
    sequencers: usize,
    kills: bool,
    /// Every endpoint in `fetch_on_notify` mode (otherwise the modes alternate).
    fetch_on_notify_only: bool,
}

impl Run {
    /// A run of `endpoints` endpoints for `duration_s` seconds, 30 changes a second, with one
    /// sequencer that is never killed, the endpoints' modes alternating.
    fn new(seed: u64, endpoints: usize, duration_s: u64) -> Self {
        Self {
            seed,
            endpoints,
            rate: 30.0,
            duration: Duration::from_secs(duration_s),
            sequencers: 1,
            kills: false,
            fetch_on_notify_only: false,
        }
    }

    /// The run's workload of stories changes, seeded by `seed`.
    fn workload(&self, seed: u64) -> StoriesWorkload {
        StoriesWorkload::new(
            seed,
            StoriesWorkloadConfig {
                endpoints: self.endpoints,
                ..StoriesWorkloadConfig::default()
            },
        )
    }
}

/// A change of one story: its seq, operation, version, event id and reload round.
type ChangeReport = (i64, String, Option<i64>, Option<String>, Option<i64>);

/// The relay's copy of a stories endpoint of `tenant`, open and closed stories, read as the API
/// reads it, as the oracle compares it.
pub(crate) async fn copy_rows(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: Uuid,
) -> BTreeMap<String, CopyRow> {
    let every_story = (None, true);
    let rows = relay_store::stories::list(
        pool,
        tenant,
        EndpointId(endpoint),
        every_story,
        None,
        i64::MAX,
    )
    .await
    .unwrap();
    rows.into_iter()
        .map(|row| {
            (
                row.id,
                CopyRow {
                    ticker: row.ticker,
                    version: row.version as u64,
                    closed: row.closed,
                    story: row.story,
                },
            )
        })
        .collect()
}

/// Stories endpoint `endpoint`'s copy as `consumer` rebuilt it from the queue, in the oracle's
/// rows.
pub(crate) fn rebuilt_stories(
    consumer: &ReferenceConsumer,
    endpoint: Uuid,
) -> BTreeMap<String, CopyRow> {
    consumer
        .stories(endpoint)
        .into_iter()
        .map(|(story_id, row)| {
            (
                story_id,
                CopyRow {
                    ticker: row.ticker,
                    version: row.version,
                    closed: row.closed,
                    story: row.story,
                },
            )
        })
        .collect()
}

/// Registers each simulated endpoint for one tenant, alternating the two modes unless
/// `fetch_on_notify_only`.
pub(crate) async fn register(
    pool: &PgPool,
    infos: &[StoriesEndpointInfo],
    api: &str,
    fetch_on_notify_only: bool,
) -> TenantId {
    let tenant = TenantId(Uuid::new_v4());
    relay_store::tenants::create(pool, tenant.0, "stories tenant")
        .await
        .unwrap();
    for (i, info) in infos.iter().enumerate() {
        let mode = if i % 2 == 0 && !fetch_on_notify_only {
            StoriesMode::Snapshot
        } else {
            StoriesMode::FetchOnNotify
        };
        endpoints::register(
            pool,
            &relay_tests::keys(),
            tenant,
            &Registration {
                id: EndpointId(info.id),
                name: None,
                source: Source::Stories(StoriesSettings {
                    mode,
                    tickers: info.tickers.clone(),
                }),
                lang: None,
                upstream_base_url: Some(api.to_owned()),
                upstream_api_key: Some(info.api_key.clone().into()),
                secrets: info
                    .secrets
                    .iter()
                    .map(|s| SigningSecret::parse(s).unwrap())
                    .collect(),
            },
        )
        .await
        .unwrap();
    }
    tenant
}

/// What a run stands on: the front tier, the simulator serving the stories API and sending
/// webhooks, the endpoints registered, sequencer children, a publisher to a vhost of its own.
struct Stand {
    app: TestApp,
    sim: std::sync::Arc<Simulation>,
    infos: Vec<StoriesEndpointInfo>,
    tenant: TenantId,
    sequencers: Sequencers,
    vhost: Vhost,
    publisher: relay_publisher::PublisherHandle,
    key_prefix: String,
    sender: tokio::task::JoinHandle<()>,
}

impl Stand {
    async fn start(run: &Run, configure: impl FnOnce(&mut StoriesConfig)) -> Self {
        relay_tests::init_logging();
        let key_prefix = format!("relay-test-{}:", Uuid::new_v4().simple());
        let app = TestApp::spawn_waking(&key_prefix).await;
        let pool = app.db.pool.clone();
        let (api_listener, api) = upstream_listener("127.0.0.1").await;
        let faults = Faults::all();
        let mut config = StoriesConfig::from_wire_limits(COMPRESSION);
        // The upstream's time starts at the wall clock's now, as the relay's registrations do:
        // events created before an endpoint's registration notify nothing (decide_notify).
        config.start_unix_ms =
            (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64;
        configure(&mut config);
        let mut stories = Stories::new(config, faults.stories.clone(), run.seed);
        let mut workload = run.workload(run.seed);
        let infos = workload.setup(&mut stories, &format!("{}/webhooks/{{id}}", app.base_url));
        let tenant = register(&pool, &infos, &api, run.fetch_on_notify_only).await;
        for info in &infos {
            let registered: time::OffsetDateTime =
                sqlx::query_scalar("SELECT created_at FROM webhook_endpoints WHERE id = $1")
                    .bind(info.id)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            stories.set_registered_at(info.id, registered);
        }
        let upstream = Upstream::new(
            World::default(),
            SenderConfig::from_wire_limits(COMPRESSION),
            faults,
            run.seed,
        );
        let sim = Simulation::with_stories(upstream, stories, Duration::from_secs(2));
        relay_simulator::api::serve(api_listener, sim.clone())
            .await
            .unwrap();
        let spec = sequencer_spec(&app.db.url, &key_prefix, 8, Some(1500));
        let sequencers = Sequencers::start(spec, run.sequencers);
        let vhost = Vhost::create();
        let (publisher, _registry) =
            start_publisher(&pool, publisher_config(vhost.url(), &key_prefix)).await;
        let sender = sim.spawn_stories_sender();
        // The workload is the test's to run.
        let _ = workload;
        Self {
            app,
            sim,
            infos,
            tenant,
            sequencers,
            vhost,
            publisher,
            key_prefix,
            sender,
        }
    }

    /// For each story whose row differs from the oracle: its events as the upstream published
    /// them (and whether each was delivered), and the relay's changes of it.
    async fn explain(&self) -> String {
        let mut lines = Vec::new();
        let window_start = self
            .sim
            .change_stories(|stories, now| stories.window_start(now));
        lines.push(format!("window starts at position {window_start}"));
        for id in self.ids() {
            let rows = copy_rows(self.pool(), self.tenant, id).await;
            let (differing, events) = {
                let stories = self.sim.stories();
                let expected = stories.expected_stories(id);
                let delivered: BTreeSet<String> = stories.delivered(id).into_iter().collect();
                let differing: Vec<String> = expected
                    .iter()
                    .filter(|(story, e)| {
                        rows.get(*story).is_none_or(|r| {
                            r.closed != e.closed || (!e.closed && r.version != e.version)
                        })
                    })
                    .map(|(story, _)| story.clone())
                    .take(3)
                    .collect();
                let events: Vec<String> = differing
                    .iter()
                    .flat_map(|story| {
                        stories
                            .events()
                            .iter()
                            .filter(|e| {
                                e.story_id == *story
                                    || e.json.to_string().contains(&format!("\"{story}\""))
                            })
                            .map(|e| {
                                format!(
                                    "    {story}: #{} {:?} {:?} {} delivered {}",
                                    e.position,
                                    e.event_type,
                                    e.origin,
                                    e.event_id,
                                    delivered.contains(&e.event_id)
                                )
                            })
                            .collect::<Vec<_>>()
                    })
                    .collect();
                (differing, events)
            };
            lines.extend(events);
            for story in &differing {
                let changes: Vec<ChangeReport> = sqlx::query_as(
                    "SELECT change_seq, operation, story_version, event_id, reload_generation
                         FROM changes WHERE endpoint_id = $1 AND subject = $2 ORDER BY change_seq",
                )
                .bind(id)
                .bind(story)
                .fetch_all(self.pool())
                .await
                .unwrap();
                lines.push(format!("    {story}: relay changes {changes:?}"));
            }
        }
        let sync: Vec<(Uuid, Option<String>, i64, bool)> =
            sqlx::query_as("SELECT endpoint_id, cursor, rounds, reload_needed FROM stories_sync")
                .fetch_all(self.pool())
                .await
                .unwrap();
        lines.push(format!("sync: {sync:?}"));
        lines.join("\n")
    }

    fn ids(&self) -> Vec<Uuid> {
        self.infos.iter().map(|i| i.id).collect()
    }

    fn pool(&self) -> &PgPool {
        &self.app.db.pool
    }

    /// Waits until the upstream is idle, every copy equals the oracle and every endpoint has
    /// caught up since, three looks in a row; panics with the differences after `limit`.
    async fn settle(&self, seed: u64, limit: Duration) {
        let started = Instant::now();
        let mut steady = 0;
        // When the upstream was first seen idle with the copies right: a copy can be right
        // (owed reads paid) before catch-up has read the events whose webhooks were lost, and
        // only those events claim their notifications. So every endpoint must also have
        // caught up since then.
        let mut idle_since: Option<time::OffsetDateTime> = None;
        loop {
            let idle = self.sim.wait_idle(Duration::from_millis(10)).await;
            let mut differences = Vec::new();
            for id in self.ids() {
                let rows = copy_rows(self.pool(), self.tenant, id).await;
                let found = self.sim.stories().compare_copy(id, &rows);
                if !found.is_empty() {
                    differences.push(format!("endpoint {id}: {}", found.join("; ")));
                }
            }
            if idle && differences.is_empty() {
                let since = match idle_since {
                    Some(since) => since,
                    None => *idle_since.insert(
                        sqlx::query_scalar("SELECT now()")
                            .fetch_one(self.pool())
                            .await
                            .unwrap(),
                    ),
                };
                let caught_up: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM stories_sync
                      WHERE endpoint_id = ANY($1) AND caught_up_at >= $2",
                )
                .bind(self.ids())
                .bind(since)
                .fetch_one(self.pool())
                .await
                .unwrap();
                if caught_up == self.ids().len() as i64 {
                    steady += 1;
                } else {
                    differences.push(format!(
                        "{caught_up} of {} endpoints caught up since the upstream went idle",
                        self.ids().len()
                    ));
                }
                if steady >= 3 {
                    return;
                }
            } else {
                steady = 0;
                idle_since = None;
            }
            if started.elapsed() > limit {
                panic!(
                    "seed {seed}: no convergence within {limit:?} (upstream idle {idle}): {}\n{}",
                    differences.join(" | "),
                    self.explain().await
                );
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// Every change in the outbox published, then the tenant's queue drained: each endpoint's
    /// copy rebuilt from it equals the oracle, and the notifications are exactly the oracle's.
    /// `lost`: positions of the upstream's events that neither a webhook nor catch-up could
    /// bring (published while both were down, then out of the window before they came back).
    /// `lost: None`: notifications are not checked (the endpoint's tickers changed: the oracle
    /// names only those of its tickers now). Returns how many notifications the queue held.
    async fn check_queue(&self, seed: u64, lost: Option<std::ops::Range<usize>>) -> usize {
        self.wait_published(seed).await;
        let broker = connect_broker(&self.vhost.url(), "stories").await;
        let queue = relay_publisher::tenant_queue(self.tenant.0);
        let delivered = crate::publisher::drain(&broker, &queue, true).await;
        let mut consumer = ReferenceConsumer::new(self.tenant.0);
        let mut notified: HashMap<(Uuid, String), BTreeSet<String>> = HashMap::new();
        for message in &delivered {
            let decoded = Delivered::decode(&message.body)
                .unwrap_or_else(|e| panic!("seed {seed}: an undecodable message: {e}"));
            assert_eq!(message.message_id, decoded.message_id(), "seed {seed}");
            if let Delivered::Story(story) = &decoded {
                if story.kind == relay_publisher::StoryKind::Notification {
                    notified
                        .entry((story.webhook_endpoint_id, story.story_id.clone()))
                        .or_default()
                        .insert(message.message_id.clone());
                }
            }
            consumer.receive_delivered(&decoded);
        }
        let stats = consumer.stats();
        assert_eq!(stats.waiting, 0, "seed {seed}: changes missing: {stats:?}");
        let stories = self.sim.stories();
        for id in self.ids() {
            let found = stories.compare_copy(id, &rebuilt_stories(&consumer, id));
            assert!(
                found.is_empty(),
                "seed {seed}: endpoint {id}'s copy rebuilt from the queue: {}",
                found.join("; ")
            );
            let Some(lost) = lost.clone() else {
                continue;
            };
            // A story that became strong while the relay could neither receive the webhook nor
            // read the event before it left the window cannot be notified by anyone: the reload
            // that follows saves the story, and nothing says it became strong.
            let delivered: BTreeSet<String> = stories.delivered(id).into_iter().collect();
            let lost: BTreeSet<String> = stories
                .expected_notifications(id)
                .into_iter()
                .filter(|story| {
                    stories
                        .events()
                        .iter()
                        .filter(|e| {
                            e.story_id == *story
                                && e.event_type == StoryEventType::BecameStrong
                                && e.origin == Origin::Live
                        })
                        .all(|e| lost.contains(&e.position) && !delivered.contains(&e.event_id))
                })
                .collect();
            let expected: BTreeSet<String> = stories
                .expected_notifications(id)
                .difference(&lost)
                .cloned()
                .collect();
            let got: BTreeSet<String> = notified
                .iter()
                .filter(|((endpoint, _), _)| *endpoint == id)
                .map(|((_, story), ids)| {
                    assert_eq!(
                        ids.len(),
                        1,
                        "seed {seed}: story {story} of endpoint {id} notified {} times",
                        ids.len()
                    );
                    story.clone()
                })
                .collect();
            assert_eq!(got, expected, "seed {seed}: endpoint {id}'s notifications");
            for story in stories.backfill_strong(id) {
                assert!(
                    !got.contains(&story),
                    "seed {seed}: {story} notified for a backfill event"
                );
            }
        }
        notified.values().map(BTreeSet::len).sum()
    }

    /// Waits until every change in the outbox is published.
    async fn wait_published(&self, seed: u64) {
        let started = Instant::now();
        loop {
            let (backlog,): (i64,) = sqlx::query_as(
                "SELECT coalesce(sum(k.last - coalesce(p.published_through, 0)), 0)::int8
                 FROM endpoint_change_counters k
                 LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = k.endpoint_id",
            )
            .fetch_one(self.pool())
            .await
            .unwrap();
            if backlog == 0 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "seed {seed}: {backlog} changes still unpublished"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The run's workload seeded by `seed`, at the run's rate for `duration`: how many changes
    /// it made.
    fn run_workload(
        &self,
        run: &Run,
        seed: u64,
        duration: Duration,
    ) -> impl std::future::Future<Output = usize> + 'static {
        let workload = run.workload(seed);
        self.sim
            .clone()
            .run_stories_workload(workload, run.rate, duration)
    }

    async fn stop(self) {
        self.sequencers.kill_all().await;
        self.publisher.stop().await;
        self.sim.shutdown();
        let _ = self.sender.await;
        crate::convergence::delete_redis_keys(&self.key_prefix).await;
        self.app.stop().await;
    }
}

async fn converge(run: Run) {
    let seed = run.seed;
    eprintln!("stories convergence: seed {seed} ({run:?})");
    let mut stand = Stand::start(&run, |_| {}).await;
    let task = tokio::spawn(stand.run_workload(&run, seed, run.duration));
    let kills = stand
        .sequencers
        .kill_at_random(seed, run.kills, &task)
        .await;
    let steps = task.await.unwrap();
    stand.settle(seed, Duration::from_secs(90)).await;
    stand.check_queue(seed, Some(0..0)).await;
    eprintln!("stories convergence: seed {seed} converged: {steps} changes, {kills} kills");
    stand.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stories_copies_converge_with_every_fault_and_killed_sequencers() {
    for seed in crate::convergence::seeds(500_001, 3) {
        converge(Run {
            sequencers: 2,
            kills: true,
            ..Run::new(seed, 4, 6)
        })
        .await;
    }
}

/// The front tier is down for longer than the upstream keeps retrying: every webhook of that
/// stretch is given up, and only catch-up can bring its events. Then the window moves past the
/// relay's cursor: catch-up answers 410, and the reload in full converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catch_up_recovers_an_outage_longer_than_the_retries_and_a_410_reloads() {
    let seed = relay_tests::seed();
    let run = Run::new(seed, 2, 3);
    let stand = Stand::start(&run, |config| {
        config.sender.max_attempts = 3;
    })
    .await;
    stand.run_workload(&run, seed, run.duration).await;
    stand.settle(seed, Duration::from_secs(60)).await;

    // The outage: webhooks now go to a port nothing listens on and are given up after their
    // retries.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    stand.sim.change_stories(|stories, _| {
        for info in &stand.infos {
            stories.set_stories_url(info.id, &format!("{closed}/webhooks/{{id}}"));
        }
    });
    stand.run_workload(&run, seed + 1, run.duration).await;
    assert!(
        stand.sim.wait_idle(Duration::from_secs(30)).await,
        "seed {seed}"
    );
    let given_up: usize = stand
        .infos
        .iter()
        .map(|i| stand.sim.stories().given_up(i.id).len())
        .sum();
    assert!(given_up > 0, "seed {seed}: the outage gave up no webhook");
    stand.settle(seed, Duration::from_secs(60)).await;
    stand.sim.change_stories(|stories, _| {
        for info in &stand.infos {
            stories.set_stories_url(info.id, &info.url);
        }
    });

    // Another outage, the upstream's API down too, and meanwhile the window moves past the
    // relay's cursor: its next catch-up answers 410.
    let reloads_before = last_reload(stand.pool()).await;
    let lost_from = stand.sim.change_stories(|stories, _| {
        stories.set_api_paused(true);
        for info in &stand.infos {
            stories.set_stories_url(info.id, &format!("{closed}/webhooks/{{id}}"));
        }
        stories.events().len()
    });
    stand
        .run_workload(&run, seed + 2, Duration::from_secs(1))
        .await;
    assert!(
        stand.sim.wait_idle(Duration::from_secs(30)).await,
        "seed {seed}"
    );
    // The window is 30 days: what left it changed long ago, and no read is slow enough to
    // answer from before such a change. The API stays down past the simulator's horizon for
    // slow reads, so the reload reads every story as it is.
    tokio::time::sleep(Duration::from_millis(
        relay_simulator::stories::STALE_HORIZON_MS + 200,
    ))
    .await;
    let lost_until = stand.sim.change_stories(|stories, now| {
        stories.advance_window();
        stories.set_api_paused(false);
        for info in &stand.infos {
            stories.set_stories_url(info.id, &info.url);
        }
        stories.window_start(now)
    });
    let started = Instant::now();
    while last_reload(stand.pool()).await <= reloads_before {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "seed {seed}: the expired cursor led to no reload in full"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stand.settle(seed, Duration::from_secs(60)).await;
    stand.check_queue(seed, Some(lost_from..lost_until)).await;

    // A resync opens a new epoch with a snapshot of each copy: a consumer that reads only the
    // new epoch holds exactly the relay's rows, closed ones included.
    for id in stand.ids() {
        relay_store::restores::resync(stand.pool(), stand.tenant, EndpointId(id))
            .await
            .unwrap()
            .expect("the tenant's endpoint");
    }
    stand.wait_published(seed).await;
    let broker = connect_broker(&stand.vhost.url(), "stories resync").await;
    let queue = relay_publisher::tenant_queue(stand.tenant.0);
    let mut consumer = ReferenceConsumer::new(stand.tenant.0);
    for message in crate::publisher::drain(&broker, &queue, true).await {
        let decoded = Delivered::decode(&message.body).unwrap();
        assert!(
            decoded.epoch() > 1,
            "seed {seed}: an old epoch's change after the resync"
        );
        consumer.receive_delivered(&decoded);
    }
    for id in stand.ids() {
        let relay: BTreeMap<String, CopyRow> = copy_rows(stand.pool(), stand.tenant, id).await;
        let rebuilt: BTreeMap<String, CopyRow> = consumer
            .stories(id)
            .into_iter()
            .map(|(story, row)| {
                let row = CopyRow {
                    ticker: row.ticker,
                    version: row.version,
                    closed: row.closed,
                    story: row.story,
                };
                (story, row)
            })
            .collect();
        assert!(
            rebuilt == relay,
            "seed {seed}: endpoint {id}: the snapshot rebuilds {} rows, the relay holds {}",
            rebuilt.len(),
            relay.len()
        );
    }
    eprintln!("stories catch-up: seed {seed}: {given_up} webhooks given up, recovered");
    stand.stop().await;
}

/// When the last reload in full of any endpoint finished.
async fn last_reload(pool: &PgPool) -> Option<time::OffsetDateTime> {
    sqlx::query_scalar("SELECT max(reloaded_at) FROM stories_sync")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A ticker removed from an endpoint takes its open stories out of the copy (each with a
/// `dropped` change); one added is loaded once from `GET /v1/stories` and kept up to date by its
/// events from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_ticker_drops_its_stories_and_adding_one_loads_them() {
    let seed = relay_tests::seed();
    let run = Run::new(seed, 1, 2);
    let stand = Stand::start(&run, |_| {}).await;
    stand.run_workload(&run, seed, run.duration).await;
    stand.settle(seed, Duration::from_secs(60)).await;
    let info = &stand.infos[0];
    let all = info.tickers.clone();
    assert!(
        all.len() >= 3,
        "seed {seed}: the first endpoint follows every ticker"
    );
    let on = &stand;
    let set_tickers = |tickers: Vec<String>| async move {
        on.sim
            .change_stories(|stories, _| stories.set_stories_tickers(info.id, tickers.clone()));
        let changed = endpoints::change_settings(
            on.pool(),
            &relay_tests::keys(),
            on.tenant,
            EndpointId(info.id),
            &endpoints::SettingsChange {
                name: None,
                lang: None,
                upstream_base_url: None,
                upstream_api_key: None,
                stories_mode: None,
                tickers: Some(tickers),
            },
        )
        .await
        .unwrap();
        assert!(changed);
    };

    // Two tickers removed: their open stories leave the copy, each with a change.
    let open_of_removed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM stories WHERE endpoint_id = $1 AND NOT closed AND ticker = ANY($2)",
    )
    .bind(info.id)
    .bind(&all[2..])
    .fetch_one(stand.pool())
    .await
    .unwrap();
    set_tickers(all[..2].to_vec()).await;
    stand.run_workload(&run, seed + 1, run.duration).await;
    stand.settle(seed, Duration::from_secs(60)).await;
    let dropped: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM changes WHERE endpoint_id = $1 AND operation = 'dropped'",
    )
    .bind(info.id)
    .fetch_one(stand.pool())
    .await
    .unwrap();
    assert_eq!(
        dropped, open_of_removed,
        "seed {seed}: one drop per open story removed"
    );

    // One of them added again: its stories now, created meanwhile too, are loaded.
    set_tickers(all[..3].to_vec()).await;
    stand.run_workload(&run, seed + 2, run.duration).await;
    stand.settle(seed, Duration::from_secs(60)).await;
    let loaded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM stories WHERE endpoint_id = $1 AND NOT closed AND ticker = $2",
    )
    .bind(info.id)
    .bind(&all[2])
    .fetch_one(stand.pool())
    .await
    .unwrap();
    let expected = stand
        .sim
        .stories()
        .expected_stories(info.id)
        .values()
        .filter(|story| !story.closed && story.ticker == all[2])
        .count() as i64;
    assert_eq!(
        loaded, expected,
        "seed {seed}: the added ticker's open stories"
    );
    stand.check_queue(seed, None).await;
    eprintln!(
        "stories tickers: seed {seed}: {dropped} dropped, {loaded} loaded with the ticker added"
    );
    stand.stop().await;
}

/// Failed story reads at several rates, every endpoint reading what it is notified of. Half the
/// webhooks lead nowhere and are given up at their first failure, so catch-up pages carry much
/// of the stream; a page whose read fails after its tries moves the cursor on and owes the read,
/// which a later sync pays. Every rate converges: the copy, the queue's rebuilt copy and the
/// notifications (each strong story once) equal the oracle, and no read stays owed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stories_converge_with_failed_reads_at_several_rates() {
    let seed = relay_tests::seed();
    for lb_404 in [0.03, 0.10, 0.20] {
        converge_with_failed_reads(seed, lb_404).await;
    }
}

/// Story events per catch-up page: larger than a reload's pages, so one page names many reads.
const CATCH_UP_PAGE: usize = 100;

/// The chance that, for one stretch, an endpoint's webhooks lead nowhere.
const LOST_SHARE: f64 = 0.5;

async fn converge_with_failed_reads(seed: u64, lb_404: f64) {
    let run = Run {
        rate: 40.0,
        sequencers: 0,
        fetch_on_notify_only: true,
        ..Run::new(seed, 4, 4)
    };
    eprintln!("stories failed reads: seed {seed}, lb_404 {lb_404} ({run:?})");
    // One attempt: a webhook sent while its endpoint's url leads nowhere is given up at once.
    let stand = Stand::start(&run, |config| config.sender.max_attempts = 1).await;
    // The 503s off, so that every failed read is the load balancer's 404 at the rate named.
    stand.sim.change_stories(|stories, _| {
        stories.set_faults(StoriesFaults {
            lb_404,
            server_error: 0.0,
            ..StoriesFaults::all()
        })
    });
    // The sequencer in this process, so its registry can be read. It shares the test's two
    // runtime threads with the front tier, the simulator and the publisher: a longer lease than
    // the child processes' keeps a late renewal from losing its endpoints.
    let registry = prometheus::Registry::new();
    let config = SequencerConfig {
        lease: Duration::from_secs(5),
        feed_page_limit: CATCH_UP_PAGE,
        stories_catch_up_interval: Duration::from_millis(1500),
        ..crate::stack::sequencer_config(&stand.key_prefix, 16, OutboundPolicy::ANY)
    };
    let sequencer = crate::stack::start_sequencer_with(
        &stand.app.db.url,
        config,
        SequencerMetrics::register(&registry).unwrap(),
    )
    .await;

    let nowhere = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/webhooks/{{id}}", listener.local_addr().unwrap())
    };
    let task = tokio::spawn(stand.run_workload(&run, seed, run.duration));
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6c6f7374);
    while !task.is_finished() {
        stand.sim.change_stories(|stories, _| {
            for info in &stand.infos {
                let url = if rng.gen_bool(LOST_SHARE) {
                    &nowhere
                } else {
                    &info.url
                };
                stories.set_stories_url(info.id, url);
            }
        });
        tokio::time::sleep(Duration::from_millis(rng.gen_range(100..400))).await;
    }
    stand.sim.change_stories(|stories, _| {
        for info in &stand.infos {
            stories.set_stories_url(info.id, &info.url);
        }
    });
    let steps = task.await.unwrap();
    let ended = Instant::now();
    stand.settle(seed, Duration::from_secs(90)).await;
    let owed_left = wait_owed_paid(stand.pool(), seed, Duration::from_secs(60)).await;
    let settled = ended.elapsed();
    let notified = stand.check_queue(seed, Some(0..0)).await;

    let (delivered, given_up) = {
        let stories = stand.sim.stories();
        stand.ids().iter().fold((0, 0), |(d, g), &id| {
            (
                d + stories.delivered(id).len(),
                g + stories.given_up(id).len(),
            )
        })
    };
    let pages = metric(&registry, "relay_sequencer_stories_catch_up_pages_total");
    let reads = |answer| {
        labelled(
            &registry,
            "relay_sequencer_story_reads_total",
            "answer",
            answer,
        )
    };
    let owed = |what| {
        labelled(
            &registry,
            "relay_sequencer_story_reads_owed_total",
            "what",
            what,
        )
    };
    let retried = metric(&registry, "relay_sequencer_story_reads_retried_total");
    let claimed = metric(&registry, "relay_sequencer_stories_notifications_total");
    eprintln!(
        "stories failed reads: seed {seed}, lb_404 {lb_404}: {steps} changes; webhooks \
         {delivered} delivered, {given_up} given up; {pages} catch-up pages; story reads \
         {} found, {} not_found, {} failed, {retried} retried; reads owed {} recorded, {} done, \
         {} failing again, {owed_left} left; notifications {claimed} claimed, {notified} in the \
         queue; settled in {settled:.1?}",
        reads("found"),
        reads("not_found"),
        reads("failed"),
        owed("recorded"),
        owed("done"),
        owed("failing"),
    );
    assert!(
        given_up > 0,
        "seed {seed}, lb_404 {lb_404}: no webhook was lost"
    );
    assert!(
        pages > 0.0,
        "seed {seed}, lb_404 {lb_404}: no catch-up page was read"
    );
    assert!(
        reads("failed") > 0.0,
        "seed {seed}, lb_404 {lb_404}: no story read failed"
    );
    assert!(
        owed("done") <= owed("recorded"),
        "seed {seed}, lb_404 {lb_404}: more reads paid ({}) than owed ({})",
        owed("done"),
        owed("recorded")
    );
    sequencer.stop().await;
    stand.stop().await;
}

/// Waits until no story read is owed; panics with what is still owed after `limit`. Returns the
/// rows left (none).
async fn wait_owed_paid(pool: &PgPool, seed: u64, limit: Duration) -> i64 {
    let started = Instant::now();
    loop {
        let left: Vec<(Uuid, String, i32)> =
            sqlx::query_as("SELECT endpoint_id, story_id, attempts FROM story_reads_owed")
                .fetch_all(pool)
                .await
                .unwrap();
        if left.is_empty() {
            return 0;
        }
        assert!(
            started.elapsed() < limit,
            "seed {seed}: reads still owed after {limit:?}: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
