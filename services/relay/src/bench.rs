//! `relay bench apply` and `relay bench reload`: the sequencer's benchmarks (BENCHMARKS.md).
//!
//! Both build their own database from nothing (the URL's database is dropped and created again,
//! which is why they ask for `--recreate-database`), run the real sequencer in this process
//! against it, and print what they measured.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use axum::extract::{Query, State};
use axum::routing::get;
use axum::{Json, Router};
use bytes::Bytes;
use clap::{Args, Subcommand};
use relay_sequencer::{Sequencer, SequencerConfig, SequencerMetrics};
use relay_store::endpoints::{self, NewEndpoint};
use relay_store::messages::{store_batch, IncomingMessage};
use relay_store::tenants;
use relay_wire::{Sequence, SigningSecret};
use serde_json::{json, Value};
use sqlx::{Connection, PgPool};
use time::OffsetDateTime;
use uuid::Uuid;

pub use crate::bench_isolation::{slow_connection, SlowEnd};
use crate::cli::{GlobalArgs, SequencerArgs};

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Store many messages of feed events for many endpoints, then time the sequencer applying
    /// them all.
    Apply(ApplyBenchArgs),
    /// Time a reload of a large feed: read every page from a local feed server, merge, drop.
    Reload(ReloadBenchArgs),
    /// The whole path in one process: signed messages at a fixed rate into the front tier,
    /// applied by the sequencer, published to RabbitMQ and confirmed; receipt-to-confirm
    /// latency and backlogs.
    Pipeline(PipelineBenchArgs),
    /// Tenant B's answer and apply latency, and the process's resident memory, in quiet phases
    /// and in phases of each class of attack (hostile messages and slow heads, bodies that stop
    /// short, kept-alive hogs, hostile upstream pages, a flood past a quota), alternating in
    /// one run.
    Isolation(crate::bench_isolation::IsolationBenchArgs),
    /// Stories endpoints' events applied per second and a reload in full of a large stories
    /// copy, each beside the feed's figure for the same work, alternating in one run.
    Stories(crate::bench_stories::StoriesBenchArgs),
    /// The whole path (receipt to a change confirmed in the tenant's queue) beside the front
    /// tier alone, for one or more builds' binaries in turns, with CPU by process, WAL, rows and
    /// commits per message, and the machine's ceilings for the same work.
    Path(crate::bench_path::PathBenchArgs),
}

#[derive(Debug, Args)]
pub struct PipelineBenchArgs {
    /// Drop and create RELAY_DATABASE_URL's database first (required: the bench needs it empty).
    #[arg(long)]
    pub recreate_database: bool,
    /// Messages per second in all (one new item each, about 3 KB).
    #[arg(long, default_value_t = 2000.0)]
    pub rate: f64,
    #[arg(long, default_value_t = 1000)]
    pub endpoints: usize,
    /// Seconds of load that are measured, after the warm-up.
    #[arg(long, default_value_t = 60)]
    pub duration_s: u64,
    /// Seconds of load before measuring starts. The first seconds are every endpoint's first
    /// messages: the sequencer takes each endpoint (a lock, a fencing token, its state read)
    /// while the load is already at full rate.
    #[arg(long, default_value_t = 3)]
    pub warmup_s: u64,
    /// The front tier's concurrent batch writers, as `relay ingest --writers`.
    #[arg(long, env = "RELAY_INGEST_WRITERS", default_value_t = relay_ingest::defaults::WRITERS)]
    pub ingest_writers: usize,
    /// Delete applied messages and published changes this many seconds old, every third of it,
    /// while the load runs (0: keep everything, as the defaults of a week never reach in a
    /// run). The latencies are then measured over the rows that are left.
    #[arg(long, default_value_t = 0)]
    pub retention_s: u64,
    #[command(flatten)]
    pub sequencer: SequencerArgs,
    #[command(flatten)]
    pub publisher: relay_publisher::PublisherArgs,
}

#[derive(Debug, Args)]
pub struct ApplyBenchArgs {
    /// Drop and create RELAY_DATABASE_URL's database first (required: the bench needs it empty).
    #[arg(long)]
    pub recreate_database: bool,
    #[arg(long, default_value_t = 1000)]
    pub endpoints: usize,
    #[arg(long, default_value_t = 20)]
    pub messages_per_endpoint: usize,
    #[arg(long, default_value_t = 10)]
    pub events_per_message: usize,
    /// Distinct items per endpoint the events update (round robin).
    #[arg(long, default_value_t = 50)]
    pub items_per_endpoint: usize,
    #[command(flatten)]
    pub sequencer: SequencerArgs,
}

#[derive(Debug, Args)]
pub struct ReloadBenchArgs {
    /// Drop and create RELAY_DATABASE_URL's database first (required: the bench needs it empty).
    #[arg(long)]
    pub recreate_database: bool,
    #[arg(long, default_value_t = 100_000)]
    pub items: usize,
    /// Share of items changed between the first load and the timed reload.
    #[arg(long, default_value_t = 0.1)]
    pub changed: f64,
    /// Share of items gone between the first load and the timed reload.
    #[arg(long, default_value_t = 0.05)]
    pub removed: f64,
    #[command(flatten)]
    pub sequencer: SequencerArgs,
}

pub async fn run(global: &GlobalArgs, command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Apply(args) => apply(global, args).await,
        BenchCommand::Reload(args) => reload(global, args).await,
        BenchCommand::Pipeline(args) => pipeline(global, args).await,
        BenchCommand::Isolation(args) => crate::bench_isolation::run(global, args).await,
        BenchCommand::Stories(args) => crate::bench_stories::run(global, args).await,
        BenchCommand::Path(args) => crate::bench_path::run(global, args).await,
    }
}

pub(crate) async fn fresh_database(global: &GlobalArgs, recreate: bool) -> anyhow::Result<PgPool> {
    if !recreate {
        bail!(
            "the bench drops and creates RELAY_DATABASE_URL's database: pass --recreate-database"
        );
    }
    let (server, name) = global
        .database_url
        .rsplit_once('/')
        .context("RELAY_DATABASE_URL has no database name")?;
    let name = name.split('?').next().unwrap_or(name);
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        bail!("database name {name:?}: letters, digits and _ only");
    }
    let mut admin = sqlx::PgConnection::connect(&format!("{server}/postgres")).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&mut admin)
        .await?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await?;
    crate::commands::migrate(global).await?;
    crate::startup::tier_pool(
        global,
        Duration::from_secs(60),
        Duration::from_secs(600),
        false,
    )
}

/// A message stored as the front tier stores one, received now: of the feed track at
/// `feed_generation`, or with neither track nor generation (a stories endpoint's).
pub(crate) fn stored_message(
    endpoint: Uuid,
    tenant: Uuid,
    feed_generation: Option<i64>,
    body: &Value,
) -> anyhow::Result<IncomingMessage> {
    Ok(IncomingMessage {
        endpoint_id: endpoint,
        tenant_id: tenant,
        webhook_id: format!("msg_{}", Uuid::new_v4().simple()),
        signed_at: OffsetDateTime::now_utc(),
        attempt: Some(1),
        received_at: OffsetDateTime::now_utc(),
        track: feed_generation.map(|_| "feed".into()),
        generation: feed_generation,
        events: Some(match body.get("events") {
            Some(Value::Array(events)) => i32::try_from(events.len())?,
            _ => 1,
        }),
        body: Bytes::from(serde_json::to_vec(body)?),
    })
}

/// Stores the messages pushed into it, in batches as the front tier would.
pub(crate) struct Batches<'a> {
    pool: &'a PgPool,
    batch: Vec<IncomingMessage>,
    pushed: i64,
}

impl<'a> Batches<'a> {
    const SIZE: usize = 500;

    pub(crate) fn new(pool: &'a PgPool) -> Self {
        Self {
            pool,
            batch: Vec::with_capacity(Self::SIZE),
            pushed: 0,
        }
    }

    pub(crate) async fn push(&mut self, message: IncomingMessage) -> anyhow::Result<()> {
        self.batch.push(message);
        self.pushed += 1;
        if self.batch.len() >= Self::SIZE {
            store_batch(self.pool, &self.batch).await?;
            self.batch.clear();
        }
        Ok(())
    }

    /// Stores what is left; how many messages were pushed in all.
    async fn finish(self) -> anyhow::Result<i64> {
        store_batch(self.pool, &self.batch).await?;
        Ok(self.pushed)
    }
}

/// The sequencer as `relay sequencer` runs it, with the bench's settings and its own pool (as
/// `relay sequencer` makes it: generic plans; the bench's pool plans every statement anew,
/// which is not what production runs).
pub(crate) async fn start_sequencer(
    global: &GlobalArgs,
    args: &SequencerArgs,
) -> anyhow::Result<Sequencer> {
    Ok(Sequencer::start(
        crate::startup::sequencer_pool(global)?,
        sequencer_config(global, args)?,
        global.seal.keyring()?,
        SequencerMetrics::unregistered(),
    )
    .await?)
}

/// Stores the rest of `batches` (`what` they hold, stored since `started`), then starts the
/// sequencer and times it until every message is applied: the seconds it took and how many
/// changes the copies took in all.
pub(crate) async fn apply_stored(
    global: &GlobalArgs,
    args: &SequencerArgs,
    batches: Batches<'_>,
    started: Instant,
    what: &str,
) -> anyhow::Result<(f64, i64)> {
    let pool = batches.pool;
    let messages = batches.finish().await?;
    eprintln!(
        "stored {what} in {:.1} s; applying",
        started.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    let sequencer = start_sequencer(global, args).await?;
    loop {
        let applied: i64 = sqlx::query_scalar(
            "SELECT coalesce(sum(applied_arrival_seq), 0)::int8 FROM endpoint_apply_cursors",
        )
        .fetch_one(pool)
        .await?;
        if applied >= messages {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    sequencer.stop().await;
    let changes: i64 = sqlx::query_scalar("SELECT count(*) FROM changes")
        .fetch_one(pool)
        .await?;
    Ok((elapsed, changes))
}

fn item_json(subject_n: u64, seq: u64, version: u64) -> Value {
    // About 1 KB, shaped like the wire file's example item.
    json!({
        "access": "full", "changes": [], "companyid": 28,
        "company": {"company_id": 28, "name": "Alfa Group AB", "symbol": "ALFA B",
                    "market_exchange_mic": "XSTO"},
        "feed_item_id": format!("announcement:{subject_n}"), "first_seq": seq,
        "head": {"announcement_id": subject_n, "title": format!("Alfa wins order {subject_n}"),
                 "language": "sv", "route": "press_release"},
        "item_kind": "announcement", "lang": "en", "op": "changed",
        "parts": [
            {"kind": "flash", "part_id": format!("flash:{subject_n}"), "part_version": version,
             "headline": "Alfa wins SEK 500M order, its largest to date, from a data centre"},
            {"kind": "story", "part_id": format!("story:{subject_n}"), "part_version": version,
             "headline": "Alfa wins its largest order",
             "lede_first_sentence": "Alfa Group has won an order worth SEK 500 million from \
                 Northern Data Centres, its largest to date, with deliveries from the first \
                 quarter of 2027 and options for two more years."}
        ],
        "published_at": "2026-10-08T06:00:00.000000Z", "seq": seq,
        "sort_at": "2026-10-08T06:00:00.300000Z", "type": "item"
    })
}

async fn bench_tenant(
    pool: &PgPool,
    keys: &relay_store::Keyring,
    endpoints: &[Uuid],
    upstream: Option<&str>,
) -> Uuid {
    let tenant = Uuid::new_v4();
    tenants::create(pool, tenant, "bench")
        .await
        .expect("tenant");
    for &id in endpoints {
        endpoints::create(
            pool,
            keys,
            &NewEndpoint {
                id,
                tenant_id: tenant,
                secret: SigningSecret::parse("whsec_YmVuY2gtc2VjcmV0LWJlbmNoLXNlY3JldA==")
                    .expect("a valid secret"),
                upstream_base_url: upstream.map(str::to_owned),
                upstream_api_key: upstream.map(|_| relay_store::SecretText::new("bench-key")),
            },
        )
        .await
        .expect("endpoint");
    }
    tenant
}

/// Messages stored and not applied, and changes not published: each a sum over per-endpoint
/// counters and cursors (a few thousand rows), so the sample costs little and the same whatever
/// the history.
async fn backlog_sample(pool: &PgPool) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query_as(
        "SELECT (SELECT coalesce(sum(a.last_arrival_seq - coalesce(c.applied_arrival_seq, 0)), 0)::int8
                 FROM endpoint_arrival_counters a
                 LEFT JOIN endpoint_apply_cursors c ON c.endpoint_id = a.endpoint_id),
                (SELECT coalesce(sum(k.last - coalesce(p.published_through, 0)), 0)::int8
                 FROM endpoint_change_counters k
                 LEFT JOIN endpoint_publish_cursors p ON p.endpoint_id = k.endpoint_id)",
    )
    .fetch_one(pool)
    .await
}

/// The histograms that split the path into steps: each apply transaction's steps, and the
/// broker's confirm wait.
const STEP_HISTOGRAMS: [(&str, Option<&str>); 2] = [
    ("relay_sequencer_apply_step_seconds", Some("step")),
    ("relay_publisher_confirm_wait_seconds", None),
];

/// Per step: each bucket's upper bound (seconds) and cumulative count, as gathered now.
type StepBuckets = std::collections::BTreeMap<String, Vec<(f64, u64)>>;

fn step_buckets(registry: &prometheus::Registry) -> StepBuckets {
    let mut steps = StepBuckets::new();
    for family in registry.gather() {
        let Some((name, label)) = STEP_HISTOGRAMS
            .iter()
            .find(|(name, _)| *name == family.name())
        else {
            continue;
        };
        for metric in family.get_metric() {
            let key = match label {
                Some(label) => metric
                    .get_label()
                    .iter()
                    .find(|pair| pair.name() == *label)
                    .map(|pair| format!("apply_{}", pair.value()))
                    .unwrap_or_default(),
                None => name
                    .trim_start_matches("relay_publisher_")
                    .trim_end_matches("_seconds")
                    .to_owned(),
            };
            let histogram = metric.get_histogram();
            // The last bucket (+Inf) is the count of every observation.
            let buckets = histogram
                .get_bucket()
                .iter()
                .map(|b| (b.upper_bound(), b.cumulative_count()))
                .chain([(f64::INFINITY, histogram.get_sample_count())])
                .collect();
            steps.insert(key, buckets);
        }
    }
    steps
}

/// p50 and p99 (ms) of what each step observed between two gatherings, estimated from the
/// buckets as Prometheus' `histogram_quantile` does (linear within the bucket the quantile falls
/// in; the last finite bound when it falls past it).
fn step_quantiles(before: &StepBuckets, after: &StepBuckets) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for (step, buckets) in after {
        let earlier = before.get(step);
        let counts: Vec<(f64, u64)> = buckets
            .iter()
            .enumerate()
            .map(|(i, (bound, count))| {
                let was = earlier.and_then(|e| e.get(i)).map_or(0, |b| b.1);
                (*bound, count.saturating_sub(was))
            })
            .collect();
        let total = counts.last().map_or(0, |c| c.1);
        let quantile = |q: f64| {
            if total == 0 {
                return None;
            }
            let rank = q * total as f64;
            let (mut lower, mut below) = (0.0, 0u64);
            for &(upper, count) in &counts {
                if count as f64 >= rank {
                    let seconds = if upper.is_finite() {
                        let share = (rank - below as f64) / (count - below).max(1) as f64;
                        lower + (upper - lower) * share
                    } else {
                        lower
                    };
                    return Some((seconds * 1000.0 * 100.0).round() / 100.0);
                }
                (lower, below) = (upper, count);
            }
            None
        };
        out.insert(
            step.clone(),
            json!({"count": total, "p50": quantile(0.5), "p99": quantile(0.99)}),
        );
    }
    serde_json::Value::Object(out)
}

/// Stores the confirm times the publisher reported in a table of the bench's database, for the
/// latency query to join. A change confirmed twice (sent again after a lost confirm) keeps its
/// first time.
async fn record_confirms(
    pool: &PgPool,
    confirmed_at: Vec<(Uuid, i64, OffsetDateTime)>,
) -> anyhow::Result<()> {
    sqlx::query(
        "CREATE TABLE bench_confirms (
             endpoint_id uuid NOT NULL,
             change_seq bigint NOT NULL,
             confirmed_at timestamptz NOT NULL,
             PRIMARY KEY (endpoint_id, change_seq)
         )",
    )
    .execute(pool)
    .await?;
    for chunk in confirmed_at.chunks(20_000) {
        let endpoints: Vec<Uuid> = chunk.iter().map(|c| c.0).collect();
        let seqs: Vec<i64> = chunk.iter().map(|c| c.1).collect();
        let times: Vec<OffsetDateTime> = chunk.iter().map(|c| c.2).collect();
        sqlx::query(
            "INSERT INTO bench_confirms (endpoint_id, change_seq, confirmed_at)
             SELECT * FROM unnest($1::uuid[], $2::int8[], $3::timestamptz[])
             ON CONFLICT (endpoint_id, change_seq) DO NOTHING",
        )
        .bind(&endpoints)
        .bind(&seqs)
        .bind(&times)
        .execute(pool)
        .await?;
    }
    Ok(())
}

pub(crate) fn sequencer_config(
    global: &GlobalArgs,
    args: &SequencerArgs,
) -> anyhow::Result<SequencerConfig> {
    Ok(SequencerConfig {
        key_prefix: format!("relay-bench-{}:", Uuid::new_v4().simple()),
        // The benchmark's upstream is its own feed server, on 127.0.0.1 over http.
        outbound: relay_netguard::OutboundPolicy::ANY,
        ..args.to_config(global)?
    })
}

pub(crate) async fn apply(global: &GlobalArgs, args: ApplyBenchArgs) -> anyhow::Result<()> {
    let pool = fresh_database(global, args.recreate_database).await?;
    let endpoints: Vec<Uuid> = (0..args.endpoints).map(|_| Uuid::new_v4()).collect();
    let tenant = bench_tenant(&pool, &global.seal.keyring()?, &endpoints, None).await;
    // Endpoints already in sync (generation 1 under the messages' access_version): the bench
    // times applying events, not the first reload.
    sqlx::query(
        "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id, generation, access_version)
         SELECT unnest($1::uuid[]), 'feed', $2, 1, 'bench1'",
    )
    .bind(&endpoints)
    .bind(tenant)
    .execute(&pool)
    .await?;

    let started = Instant::now();
    let mut batches = Batches::new(&pool);
    let mut events_total = 0u64;
    for m in 0..args.messages_per_endpoint {
        for &endpoint in &endpoints {
            let events: Vec<Value> = (0..args.events_per_message)
                .map(|e| {
                    let k = (m * args.events_per_message + e) as u64;
                    let subject_n = 88_000 + k % args.items_per_endpoint as u64;
                    let seq = 1_000 + k;
                    json!({
                        "id": format!("evt_{}", Uuid::new_v4().simple()),
                        "type": "announcement.updated",
                        "subject": format!("announcement:{subject_n}"),
                        "sequence": Sequence::from_parts(1, seq).as_str(),
                        "source": "https://api.quanor.com/v1/feed", "specversion": "1.0",
                        "datacontenttype": "application/json",
                        "data": item_json(subject_n, seq, k + 1),
                    })
                })
                .collect();
            events_total += events.len() as u64;
            let body = json!({
                "v": 1, "webhook_endpoint_id": endpoint.to_string(), "track": "feed",
                "generation": 1, "access_version": "bench1", "complete": true,
                "since": format!("1.{}", 1_000 + m * args.events_per_message),
                "through": format!("1.{}", 1_000 + (m + 1) * args.events_per_message),
                "events": events,
            });
            batches
                .push(stored_message(endpoint, tenant, Some(1), &body)?)
                .await?;
        }
    }
    let messages_total = (args.endpoints * args.messages_per_endpoint) as i64;
    let what = format!("{messages_total} messages ({events_total} events)");
    let (elapsed, changes) = apply_stored(global, &args.sequencer, batches, started, &what).await?;
    println!(
        "{}",
        json!({
            "bench": "feed_apply",
            "endpoints": args.endpoints,
            "messages": messages_total,
            "events": events_total,
            "seconds": (elapsed * 100.0).round() / 100.0,
            "messages_per_s": (messages_total as f64 / elapsed).round(),
            "events_per_s": (events_total as f64 / elapsed).round(),
            "changes_written": changes,
            "max_concurrent_endpoints": args.sequencer.max_concurrent_endpoints,
        })
    );
    pool.close().await;
    Ok(())
}

/// The local feed a reload bench reads: pre-rendered pages, one access_version.
struct StaticFeed {
    pages: Vec<Value>,
}

async fn endpoint_view() -> Json<Value> {
    Json(
        json!({"lang": "en", "status": "active", "filter": null, "tracks": {"feed": {"generation": 2}}}),
    )
}

async fn feed_page(
    State(feed): State<Arc<StaticFeed>>,
    Query(query): Query<std::collections::HashMap<String, String>>,
) -> Json<Value> {
    let page = query
        .get("cursor")
        .and_then(|c| c.parse::<usize>().ok())
        .unwrap_or(0);
    Json(feed.pages.get(page).cloned().unwrap_or_else(
        || json!({"access_version": "bench1", "data": [], "next_cursor": null, "has_more": false}),
    ))
}

fn render_pages(items: &[(u64, u64, u64)]) -> Vec<Value> {
    let chunks: Vec<&[(u64, u64, u64)]> = items.chunks(500).collect();
    let count = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| {
            let data: Vec<Value> = chunk
                .iter()
                .map(|&(n, seq, version)| {
                    json!({
                        "subject": format!("announcement:{n}"),
                        "sequence": Sequence::from_parts(1, seq).as_str(),
                        "item": item_json(n, seq, version),
                    })
                })
                .collect();
            let more = i + 1 < count;
            json!({"access_version": "bench1", "data": data,
                   "next_cursor": more.then(|| (i + 1).to_string()), "has_more": more})
        })
        .collect()
}

pub(crate) async fn serve_feed(
    pages: Vec<Value>,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let app = Router::new()
        .route("/v1/webhook-endpoints/{id}", get(endpoint_view))
        .route("/v1/feed", get(feed_page))
        .with_state(Arc::new(StaticFeed { pages }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((address, task))
}

fn reset_message(endpoint: Uuid, tenant: Uuid, generation: u64) -> anyhow::Result<IncomingMessage> {
    let body = json!({
        "v": 1, "webhook_endpoint_id": endpoint.to_string(), "track": "feed",
        "generation": generation, "access_version": "bench1",
        "events": [{
            "id": format!("evt_{}", Uuid::new_v4().simple()),
            "type": "webhook_endpoint.reset",
            "source": "https://api.quanor.com/v1/webhook-endpoints", "specversion": "1.0",
            "datacontenttype": "application/json",
            "data": {"access_version": "bench1", "generation": generation, "reason": "behind",
                     "resume_from": "1.1000", "track": "feed"},
        }],
    });
    stored_message(endpoint, tenant, Some(generation as i64), &body)
}

/// Stores a reset of `generation` and times the sequencer until the reload it begins is merged.
async fn timed_reload(
    global: &GlobalArgs,
    args: &SequencerArgs,
    pool: &PgPool,
    endpoint: Uuid,
    tenant: Uuid,
    generation: u64,
) -> anyhow::Result<f64> {
    store_batch(pool, &[reset_message(endpoint, tenant, generation)?]).await?;
    let started = Instant::now();
    let sequencer = start_sequencer(global, args).await?;
    loop {
        let merged: Option<bool> = sqlx::query_scalar(
            // The track row exists before the reset is applied, with no generation yet.
            "SELECT coalesce(reload IS NULL AND generation = $2, false) FROM endpoint_tracks
             WHERE endpoint_id = $1",
        )
        .bind(endpoint)
        .bind(generation as i64)
        .fetch_optional(pool)
        .await?;
        if merged == Some(true) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    sequencer.stop().await;
    Ok(elapsed)
}

pub(crate) async fn reload(global: &GlobalArgs, args: ReloadBenchArgs) -> anyhow::Result<()> {
    let pool = fresh_database(global, args.recreate_database).await?;
    let n = args.items as u64;
    // First feed: every item at version 1.
    let first: Vec<(u64, u64, u64)> = (0..n).map(|i| (100_000 + i, 1_000 + i, 1)).collect();
    // Second feed: some items changed (newer seq and part versions), some gone.
    let changed_every = (1.0 / args.changed.max(1e-9)).round() as u64;
    let removed_every = (1.0 / args.removed.max(1e-9)).round() as u64;
    let second: Vec<(u64, u64, u64)> = (0..n)
        .filter(|i| i % removed_every != removed_every - 1)
        .map(|i| {
            if i % changed_every == 0 {
                (100_000 + i, 1_000 + n + i, 2)
            } else {
                (100_000 + i, 1_000 + i, 1)
            }
        })
        .collect();

    let endpoint = Uuid::new_v4();
    let (first_address, first_server) = serve_feed(render_pages(&first)).await?;
    let tenant = bench_tenant(
        &pool,
        &global.seal.keyring()?,
        &[endpoint],
        Some(&format!("http://{first_address}")),
    )
    .await;
    let load_s = timed_reload(global, &args.sequencer, &pool, endpoint, tenant, 1).await?;
    first_server.abort();

    let (second_address, second_server) = serve_feed(render_pages(&second)).await?;
    sqlx::query("UPDATE webhook_endpoints SET upstream_base_url = $2 WHERE id = $1")
        .bind(endpoint)
        .bind(format!("http://{second_address}"))
        .execute(&pool)
        .await?;
    let changes_before: i64 = sqlx::query_scalar("SELECT count(*) FROM changes")
        .fetch_one(&pool)
        .await?;
    let reload_s = timed_reload(global, &args.sequencer, &pool, endpoint, tenant, 2).await?;
    second_server.abort();
    let (items, changes_after): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM copy_items WHERE NOT tombstone),
                (SELECT count(*) FROM changes)",
    )
    .fetch_one(&pool)
    .await?;
    if items != second.len() as i64 {
        bail!(
            "the copy holds {items} items after the reload, the feed {}",
            second.len()
        );
    }
    println!(
        "{}",
        json!({
            "bench": "feed_reload",
            "items": n,
            "first_load_s": (load_s * 100.0).round() / 100.0,
            "reload_s": (reload_s * 100.0).round() / 100.0,
            "reload_items_after": items,
            "reload_changes": changes_after - changes_before,
        })
    );
    pool.close().await;
    Ok(())
}

/// Reads and drops everything on the tenant's queue, as a fast consumer would.
async fn drain_queue(
    amqp_url: String,
    trust: relay_netguard::TrustRoots,
    queue: String,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    use relay_publisher::lapin::options::BasicConsumeOptions;
    use relay_publisher::lapin::types::FieldTable;
    let connection = relay_publisher::connect(
        &amqp_url,
        "relay-bench-drain",
        Duration::from_secs(5),
        &trust,
    )
    .await?;
    let channel = connection.create_channel().await?;
    relay_publisher::declare_tenant_queue(&channel, &queue).await?;
    let mut consumer = channel
        .basic_consume(
            &queue,
            "relay-bench-drain",
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    while let Some(delivery) = consumer.next().await {
        delivery?;
    }
    Ok(())
}

/// Deletes the bench tenant's queue, whatever it still holds.
async fn delete_queue(
    amqp_url: &str,
    trust: &relay_netguard::TrustRoots,
    queue: &str,
) -> anyhow::Result<()> {
    use relay_publisher::lapin::options::QueueDeleteOptions;
    let connection = relay_publisher::connect(
        amqp_url,
        "relay-bench-cleanup",
        Duration::from_secs(5),
        trust,
    )
    .await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_delete(queue, QueueDeleteOptions::default())
        .await?;
    connection.close(0, "bench done").await?;
    Ok(())
}

/// Each measured message's latencies, as `pairs`: the second of the load it arrived in
/// (`$1` the load's start), receipt to confirm, receipt to applied and applied to confirm, for
/// messages received from `$2` (the warm-up's end) to `$3` (the load's end).
const MEASURED_PAIRS: &str = "WITH pairs AS (
     SELECT floor(extract(epoch FROM m.received_at - $1))::float8 AS second,
            extract(epoch FROM b.confirmed_at - m.received_at)::float8 AS latency,
            extract(epoch FROM c.created_at - m.received_at)::float8 AS applied,
            extract(epoch FROM b.confirmed_at - c.created_at)::float8 AS published
     FROM messages m
     JOIN changes c ON c.endpoint_id = m.endpoint_id
         AND c.event_id = convert_from(m.body, 'UTF8')::jsonb #>> '{events,0,id}'
     JOIN bench_confirms b ON b.endpoint_id = c.endpoint_id
         AND b.change_seq = c.change_seq
     WHERE m.received_at >= $2 AND m.received_at < $3
 )";

/// Each measured second's p99 (by the second a message was received), to tell a tail made by a
/// few bad seconds from one spread over the run: the median second, how many seconds had a p99
/// over 100 ms, and the worst five as `[seconds into the load, p99, receipt to applied p99,
/// applied to confirm p99]`.
async fn per_second_tail(
    pool: &PgPool,
    load_started: OffsetDateTime,
    warmup_s: u64,
    load_ended: OffsetDateTime,
) -> Result<Value, sqlx::Error> {
    let rows: Vec<(f64, f64, f64, f64)> = sqlx::query_as(&format!(
        "{MEASURED_PAIRS}
         SELECT second,
                percentile_cont(0.99) WITHIN GROUP (ORDER BY latency),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY applied),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY published)
         FROM pairs GROUP BY second ORDER BY second"
    ))
    .bind(load_started)
    .bind(load_started + time::Duration::seconds(warmup_s as i64))
    .bind(load_ended)
    .fetch_all(pool)
    .await?;
    let ms = |s: f64| (s * 10_000.0).round() / 10.0;
    let mut p99s: Vec<f64> = rows.iter().map(|r| r.1).collect();
    p99s.sort_by(f64::total_cmp);
    let median = p99s.get(p99s.len() / 2).copied().map(ms);
    let mut worst = rows.clone();
    worst.sort_by(|a, b| b.1.total_cmp(&a.1));
    worst.truncate(5);
    Ok(json!({
        "seconds": rows.len(),
        "median": median,
        "over_100": p99s.iter().filter(|&&p| p > 0.1).count(),
        "worst": worst
            .iter()
            .map(|r| json!([r.0, ms(r.1), ms(r.2), ms(r.3)]))
            .collect::<Vec<_>>(),
    }))
}

/// The host's writeback settings, printed with the figures because they move the tail: with
/// the kernel's defaults, seconds of table growth are written back in one burst that every
/// commit waits behind (deploy/README.md, "The database host"). `None` where not readable.
fn writeback_settings() -> Value {
    let read = |name: &str| {
        std::fs::read_to_string(format!("/proc/sys/vm/{name}"))
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    json!({
        "dirty_background_bytes": read("dirty_background_bytes"),
        "dirty_background_ratio": read("dirty_background_ratio"),
        "dirty_expire_centisecs": read("dirty_expire_centisecs"),
    })
}

/// Messages built, signed and parsed by [`machine_probe_ms`].
const PROBE_MESSAGES: usize = 20_000;

/// How long this machine takes, on one thread, to build, sign and parse [`PROBE_MESSAGES`]
/// messages like the load's (one event, about 3.7 kB): the same work on every run, so the
/// figure moves only with the machine's speed. Taken on the idle machine before the load and
/// after the drain, it tells a slow run of a slow machine from a slow run of the code (the
/// machines of this kind have been seen to run the same build 25% slower from one session to
/// the next, and slower for minutes within one).
async fn machine_probe_ms() -> anyhow::Result<f64> {
    tokio::task::spawn_blocking(|| {
        let secret = SigningSecret::from_bytes(vec![7u8; 32]).expect("a 32-byte key");
        let padding = "results ".repeat(2_900 / 8);
        let started = Instant::now();
        for n in 0..PROBE_MESSAGES as u64 {
            let (_, _, signature, body) =
                crate::loadgen::build_message(Uuid::nil(), &secret, n, &padding);
            let parsed = relay_wire::Message::parse(&body)
                .map_err(|error| anyhow::anyhow!("the probe's message does not parse: {error}"))?;
            std::hint::black_box((signature, parsed));
        }
        Ok((started.elapsed().as_secs_f64() * 10_000.0).round() / 10.0)
    })
    .await?
}

/// The measured window's CPU: the machine's busy share, each process group's cores, and the
/// machine's CPU per measured message (busy share × cores × seconds / messages).
fn cpu_figures(usage: crate::cpu::CpuUsage, measured_s: u64, messages: i64) -> Value {
    let cores = crate::cpu::cores_of_machine() as f64;
    let busy_ms = usage.machine_busy_pct / 100.0 * cores * measured_s as f64 * 1000.0;
    let per_message = (messages > 0).then(|| (busy_ms / messages as f64 * 1000.0).round() / 1000.0);
    json!({
        "machine_busy_pct": usage.machine_busy_pct,
        "cores": usage.cores,
        "machine_cpu_ms_per_message": per_message,
    })
}

/// Registers the loadgen's tenant and endpoints, each in sync under the loadgen's
/// access_version: the benches time the path of events, not a first reload (loadgen endpoints
/// have no upstream API to reload from). Returns the tenant.
pub(crate) async fn provision_in_sync(
    global: &GlobalArgs,
    pool: &PgPool,
    loadgen: &crate::loadgen::LoadgenArgs,
) -> anyhow::Result<Uuid> {
    crate::loadgen::provision(global, loadgen).await?;
    sqlx::query(
        "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id, generation, access_version)
         SELECT id, 'feed', tenant_id, 1, 'loadgen1' FROM webhook_endpoints",
    )
    .execute(pool)
    .await?;
    Ok(crate::loadgen::loadgen_tenant(loadgen.seed))
}

/// The front tier on 127.0.0.1 (its webhooks and its metrics each on a port of their own), its
/// statements ended after 8 s.
pub(crate) async fn start_ingest(
    global: &GlobalArgs,
    config: relay_ingest::IngestConfig,
) -> anyhow::Result<crate::startup::IngestServer> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let metrics_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    crate::startup::IngestServer::start_with_registry(
        crate::startup::ingest_pool(global, Duration::from_secs(8))?,
        config,
        global.seal.keyring()?,
        listener,
        metrics_listener,
        Arc::new(relay_ingest::SystemClock),
        prometheus::Registry::new(),
        crate::telemetry::Readiness::default(),
    )
}

async fn pipeline(global: &GlobalArgs, args: PipelineBenchArgs) -> anyhow::Result<()> {
    let pool = fresh_database(global, args.recreate_database).await?;
    let probe_before = machine_probe_ms().await?;
    let loadgen = crate::loadgen::LoadgenArgs {
        url: String::new(),
        endpoints: args.endpoints,
        concurrency: 256,
        duration_s: args.duration_s,
        warmup_s: args.warmup_s,
        rate: args.rate,
        body_bytes: 3072,
        provision: false,
        seed: 1,
    };
    let tenant = provision_in_sync(global, &pool, &loadgen).await?;
    let queue = relay_publisher::tenant_queue(tenant);
    let drain = tokio::spawn(drain_queue(
        args.publisher.amqp_url.clone(),
        global.trust()?,
        queue.clone(),
    ));

    let registry = prometheus::Registry::new();
    let prefix = format!("relay-bench-{}:", Uuid::new_v4().simple());
    let sequencer = Sequencer::start(
        crate::startup::sequencer_pool(global)?,
        {
            let mut config = SequencerConfig {
                key_prefix: prefix.clone(),
                ..args.sequencer.to_config(global)?
            };
            if args.retention_s > 0 {
                let retention = Duration::from_secs(args.retention_s);
                config.message_retention = Some(retention);
                config.change_retention = Some(retention);
                config.retention_interval = retention / 3;
            } else {
                config.message_retention = None;
                config.change_retention = None;
            }
            config
        },
        global.seal.keyring()?,
        SequencerMetrics::register(&registry)?,
    )
    .await?;
    let mut publisher_args = args.publisher.clone();
    publisher_args.redis_url = global.redis_url.clone();
    publisher_args.publisher_key_prefix = prefix.clone();
    // When each change's broker confirm was taken in by the publisher.
    let confirmed_at = Arc::new(std::sync::Mutex::new(
        Vec::<(Uuid, i64, OffsetDateTime)>::new(),
    ));
    let mut publisher_config = publisher_args.config();
    publisher_config.trust = global.trust()?;
    let recorded = confirmed_at.clone();
    publisher_config.on_confirm = Some(relay_publisher::OnConfirm(Arc::new(
        move |endpoint, seq| {
            let at = OffsetDateTime::now_utc();
            recorded
                .lock()
                .expect("not poisoned")
                .push((endpoint, seq, at));
        },
    )));
    let publisher = relay_publisher::Publisher::start(
        pool.clone(),
        publisher_config,
        global.seal.keyring()?,
        &registry,
    )
    .await?;
    let mut ingest_config = relay_ingest::IngestConfig {
        waker: Some(
            relay_coord::Waker::connect(&global.redis_url, &global.trust()?, &prefix).await?,
        ),
        ..relay_ingest::IngestConfig::default()
    };
    ingest_config.answer_deadline = Duration::from_secs(10);
    ingest_config.writers = args.ingest_writers;
    let ingest = start_ingest(global, ingest_config).await?;

    // Backlogs once a second while the load runs: stored-not-applied and applied-not-confirmed.
    let sampler_pool = pool.clone();
    let samples = Arc::new(std::sync::Mutex::new(Vec::<(i64, i64)>::new()));
    let sampled = samples.clone();
    // And the growing tables' sizes every 10 s (MB of messages, changes), to see retention
    // hold them flat.
    let table_samples = Arc::new(std::sync::Mutex::new(Vec::<(u64, f64, f64)>::new()));
    let tables_sampled = table_samples.clone();
    let sampler = tokio::spawn(async move {
        let started = Instant::now();
        for tick in 1u64.. {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let sample = backlog_sample(&sampler_pool).await;
            match sample {
                Ok(sample) => sampled.lock().expect("not poisoned").push(sample),
                Err(error) => tracing::warn!(%error, "backlog sample failed"),
            }
            if tick % 10 == 0 {
                if let Ok(sizes) = relay_store::table_sizes(&sampler_pool).await {
                    let mb = |table: &str| {
                        sizes
                            .iter()
                            .find(|(name, _, _)| *name == table)
                            .map_or(0.0, |(_, bytes, _)| (*bytes as f64 / 1e5).round() / 10.0)
                    };
                    tables_sampled.lock().expect("not poisoned").push((
                        started.elapsed().as_secs(),
                        mb("messages"),
                        mb("changes"),
                    ));
                }
            }
        }
    });
    let load_started = OffsetDateTime::now_utc();
    // The step histograms and the CPU counters as the warm-up ends, so the run's figures
    // leave the warm-up out.
    let warmup_steps = {
        let registry = registry.clone();
        let warmup = Duration::from_secs(args.warmup_s);
        tokio::spawn(async move {
            tokio::time::sleep(warmup).await;
            (step_buckets(&registry), crate::cpu::CpuSnapshot::take())
        })
    };
    crate::loadgen::run(
        global,
        crate::loadgen::LoadgenArgs {
            url: format!("http://{}", ingest.address),
            ..loadgen
        },
    )
    .await?;
    let load_ended = OffsetDateTime::now_utc();
    let cpu_at_end = crate::cpu::CpuSnapshot::take();
    let (steps_at_warmup, cpu_at_warmup) = warmup_steps.await?;
    let steps = step_quantiles(&steps_at_warmup, &step_buckets(&registry));
    let cpu = cpu_at_warmup
        .zip(cpu_at_end)
        .map(|(before, after)| after.since(&before));
    // Backlog samples taken while the load ran (the ones after are the drain).
    let samples_during_load = samples.lock().expect("not poisoned").len();
    // Let what was accepted drain, then read the latencies from the rows themselves.
    let drain_started = Instant::now();
    loop {
        let (unapplied, unpublished) = backlog_sample(&pool).await?;
        if unapplied + unpublished == 0 || drain_started.elapsed() > Duration::from_secs(300) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let drain_s = drain_started.elapsed().as_secs_f64();
    sampler.abort();
    let probe_after = machine_probe_ms().await?;
    let mut samples = samples.lock().expect("not poisoned").clone();
    samples.truncate(samples_during_load);
    ingest.stop().await?;
    publisher.stop().await;
    sequencer.stop().await;
    drain.abort();
    // The bench's queue is of no use after it: leave the broker as it was.
    delete_queue(&args.publisher.amqp_url, &global.trust()?, &queue).await?;
    let confirmed_at = std::mem::take(&mut *confirmed_at.lock().expect("not poisoned"));
    record_confirms(&pool, confirmed_at).await?;

    // Receipt (the front tier began reading the message) to confirm (the publisher took in the
    // broker's confirm of the change), for messages received after the warm-up.
    // Split at the change's created_at (the sequencer's apply transaction began): receipt to
    // applied is the front tier and the sequencer, applied to confirm the publisher.
    type Latencies = (i64, Vec<Option<f64>>);
    let (count, quantiles): Latencies = sqlx::query_as(&format!(
        "{MEASURED_PAIRS}
         SELECT count(*), ARRAY[
                percentile_cont(0.5) WITHIN GROUP (ORDER BY latency),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY latency), max(latency),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY applied),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY applied),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY published),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY published)]
         FROM pairs"
    ))
    .bind(load_started)
    .bind(load_started + time::Duration::seconds(args.warmup_s as i64))
    .bind(load_ended)
    .fetch_one(&pool)
    .await?;
    let seconds = per_second_tail(&pool, load_started, args.warmup_s, load_ended).await?;
    let q = |i: usize| quantiles.get(i).copied().flatten();
    let (p50, p99, max) = (q(0), q(1), q(2));
    let ms = |v: Option<f64>| v.map(|s| (s * 10_000.0).round() / 10.0);
    let tail = &samples[samples.len().saturating_sub(10)..];
    println!(
        "{}",
        json!({
            "rate": args.rate,
            "endpoints": args.endpoints,
            "duration_s": args.duration_s,
            "warmup_s": args.warmup_s,
            "measured_changes": count,
            "receipt_to_confirm_ms": {"p50": ms(p50), "p99": ms(p99), "max": ms(max)},
            "receipt_to_applied_ms": {"p50": ms(q(3)), "p99": ms(q(4))},
            "applied_to_confirm_ms": {"p50": ms(q(5)), "p99": ms(q(6))},
            "backlog_max": {
                "unapplied_messages": samples.iter().map(|s| s.0).max(),
                "unpublished_changes": samples.iter().map(|s| s.1).max(),
            },
            "backlog_last_10_s_of_load": tail,
            "retention_s": args.retention_s,
            "table_mb_every_10_s": table_samples
                .lock()
                .expect("not poisoned")
                .iter()
                .map(|(at, messages, changes)| json!({"at_s": at, "messages": messages,
                                                    "changes": changes}))
                .collect::<Vec<_>>(),
            "drain_after_load_s": (drain_s * 10.0).round() / 10.0,
            "steps_ms": steps,
            "per_second_p99_ms": seconds,
            "host_writeback": writeback_settings(),
            "machine_probe_ms": {"before": probe_before, "after": probe_after},
            "cpu": cpu.map(|usage| cpu_figures(usage, args.duration_s, count)),
        })
    );
    pool.close().await;
    Ok(())
}
