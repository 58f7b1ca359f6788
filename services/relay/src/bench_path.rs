//! `relay bench path`: what a message costs from receipt to a change confirmed in its tenant's
//! queue, beside what the front tier alone costs for the same load, for one or several builds of
//! the relay measured in one sitting, in turns (BENCHMARKS.md).
//!
//! Every run starts a build's own binary as a process of its own (`relay ingest` for the front
//! tier alone, `relay all` for the whole path) on a database, a RabbitMQ vhost and a Redis key
//! prefix made for the run, so the builds before and after a change are measured by the same
//! load generator, consumer and counters. The load is a closed loop of signed v1 messages of one
//! event each (a new item of realistic text that does not compress to nothing) to many
//! endpoints of one tenant; the whole path's changes are consumed from the tenant's queue.
//! Between the end of the warm-up and the end of the load the bench reads the CPU time of every
//! process by what it is (the build's process, Postgres, RabbitMQ, Redis, this bench), and
//! Postgres' own counters of WAL, rows and commits. Beside them it measures the machine's
//! ceilings for the same work: Postgres inserting the rows a message leaves (its message, copy
//! row, change and event id) in batches with synchronous commit, and RabbitMQ's confirmed
//! publishes of change-sized messages to a quorum queue.
//!
//! The builds' schemas may differ: the bench registers endpoints through the store functions
//! every build shares (tenants, endpoints, secrets) and marks each endpoint's feed track as in
//! sync with one insert into `endpoint_tracks`, which every build has.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use futures::StreamExt;
use rand::distributions::{Distribution, WeightedIndex};
use rand::{Rng, SeedableRng};
use relay_publisher::lapin;
use relay_wire::SigningSecret;
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::cli::GlobalArgs;
use crate::cpu::CpuSnapshot;
use crate::loadgen::{build_events_message, loadgen_endpoints, loadgen_tenant};

/// The database every run makes for itself on RELAY_DATABASE_URL's server.
const DATABASE: &str = "relay_bench_path";
/// The load generator's seed: its tenant and endpoints (ids, secrets) follow from it.
const SEED: u64 = 1;
/// What a v1 message of one event holds besides its item's text, in bytes.
const ENVELOPE_BYTES: usize = 850;
/// Messages a ceiling's Postgres transaction inserts, and its connections at once.
const CEILING_BATCH: usize = 100;
const CEILING_CONNECTIONS: usize = 2;
/// The processes a message's CPU is counted over: the build's, and the servers it uses. The
/// bench's own (the load and the consumer) and anything else on the machine are reported apart.
const ALL_IN: [&str; 4] = ["relay", "postgres", "rabbitmq", "redis"];
/// Confirms a ceiling's RabbitMQ publisher waits for at once.
const CEILING_IN_FLIGHT: usize = 512;

#[derive(Debug, Args)]
pub struct PathBenchArgs {
    /// A build to measure, as `label=path` of its `relay` binary (or a path, then labelled by
    /// it). Give two, the build before a change and the one after, to measure them in one
    /// sitting: every round runs each mode of each build in turn.
    #[arg(long = "build", required = true)]
    pub builds: Vec<String>,
    /// What to run of each build: `front` (the front tier alone), `whole` (every tier, the
    /// changes consumed from the tenant's queue), `retention` (as `whole`, with the build's
    /// retention settings from `--retention-env`).
    #[arg(long, value_delimiter = ',', default_value = "front,whole")]
    pub modes: Vec<PathMode>,
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Seconds of load measured, after the warm-up.
    #[arg(long, default_value_t = 30)]
    pub duration_s: u64,
    /// Seconds of load before the measuring starts (each endpoint's first messages: the
    /// sequencer takes every endpoint while the load is already at full speed).
    #[arg(long, default_value_t = 10)]
    pub warmup_s: u64,
    #[arg(long, default_value_t = 1000)]
    pub endpoints: usize,
    /// The loads each mode of each build runs, comma-separated: `senders:N` (a closed loop: N
    /// senders, each sending its next message when its last is answered), `rate:R` (an open
    /// loop: R messages a second on a fixed schedule, each latency counted from when its
    /// message was due), `idle` (no messages: what the build costs doing nothing), and
    /// `burst:MxE` (one endpoint sent M messages of E events each, one at a time as the upstream
    /// sends an endpoint's messages: how long until its last change is in the queue).
    #[arg(long, value_delimiter = ',', default_value = "senders:64")]
    pub loads: Vec<Load>,
    /// Postgres' statements that took the most time in each run's window, from
    /// `pg_stat_statements` (in `shared_preload_libraries` of the bench's server; when it is
    /// not, the runs say so): how many, 0 for none.
    #[arg(long, default_value_t = 12)]
    pub statements: usize,
    #[arg(long, default_value_t = 3072)]
    pub body_bytes: usize,
    /// Seconds each ceiling (Postgres' batched inserts, RabbitMQ's confirmed publishes) runs
    /// once a round; 0 leaves them out.
    #[arg(long, default_value_t = 15)]
    pub ceiling_s: u64,
    /// `NAME=VALUE` settings given to a build in `retention` mode (comma-separated), e.g. the
    /// retention periods (fractions of a day) and the sweep's interval that make it forget at the
    /// load's own rate.
    #[arg(long, value_delimiter = ',')]
    pub retention_env: Vec<String>,
    /// `NAME=VALUE` settings of the runs' database (`ALTER DATABASE ... SET`, comma-separated),
    /// e.g. `log_min_duration_statement=0` to see in the server's log where its time goes.
    #[arg(long, value_delimiter = ',')]
    pub database_setting: Vec<String>,
    /// RabbitMQ's AMQP address, without a vhost: each run gets a vhost of its own.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672")]
    pub amqp_server_url: String,
    /// RabbitMQ's management API, which makes and removes the runs' vhosts.
    #[arg(long, default_value = "http://127.0.0.1:15672")]
    pub amqp_management_url: String,
    #[arg(long, default_value = "guest")]
    pub amqp_management_user: String,
    #[arg(long, default_value = "guest")]
    pub amqp_management_password: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PathMode {
    Front,
    Whole,
    Retention,
}

impl PathMode {
    fn name(self) -> &'static str {
        match self {
            PathMode::Front => "front",
            PathMode::Whole => "whole",
            PathMode::Retention => "retention",
        }
    }

    fn consumes(self) -> bool {
        self != PathMode::Front
    }
}

/// One load a run sends (see `--loads`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// A closed loop of this many senders.
    Senders(usize),
    /// An open loop of this many messages a second.
    Rate(f64),
    /// No messages.
    Idle,
    /// One endpoint's messages of `events` events each, one at a time.
    Burst { messages: usize, events: usize },
}

impl std::str::FromStr for Load {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let wrong = || format!("{text:?}: senders:N, rate:R, idle or burst:MxE");
        let positive = |n: usize| (n > 0).then_some(n).ok_or_else(wrong);
        match text.split_once(':') {
            None if text == "idle" => Ok(Load::Idle),
            Some(("senders", n)) => Ok(Load::Senders(positive(n.parse().map_err(|_| wrong())?)?)),
            Some(("rate", r)) => match r.parse::<f64>() {
                Ok(rate) if rate > 0.0 && rate.is_finite() => Ok(Load::Rate(rate)),
                _ => Err(wrong()),
            },
            Some(("burst", shape)) => {
                let (m, e) = shape.split_once('x').ok_or_else(wrong)?;
                let events = positive(e.parse().map_err(|_| wrong())?)?;
                if events > relay_wire::limits::MAX_EVENTS {
                    return Err(format!(
                        "{text:?}: a message holds at most {} events",
                        relay_wire::limits::MAX_EVENTS
                    ));
                }
                Ok(Load::Burst {
                    messages: positive(m.parse().map_err(|_| wrong())?)?,
                    events,
                })
            }
            _ => Err(wrong()),
        }
    }
}

impl std::fmt::Display for Load {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Load::Senders(n) => write!(f, "senders:{n}"),
            Load::Rate(r) => write!(f, "rate:{r}"),
            Load::Idle => f.write_str("idle"),
            Load::Burst { messages, events } => write!(f, "burst:{messages}x{events}"),
        }
    }
}

#[derive(Debug, Clone)]
struct Build {
    label: String,
    binary: PathBuf,
}

impl Build {
    fn parse(text: &str) -> anyhow::Result<Self> {
        let (label, path) = match text.split_once('=') {
            Some((label, path)) => (label.to_owned(), path),
            None => (text.to_owned(), text),
        };
        let binary = PathBuf::from(path);
        if !binary.is_file() {
            bail!("build {label}: {} is not a file", binary.display());
        }
        Ok(Build { label, binary })
    }
}

/// What one run measured; its figures are also printed as a JSON line.
#[derive(Debug, Clone)]
struct RunFigures {
    build: String,
    mode: PathMode,
    load: Load,
    json: Value,
}

pub async fn run(global: &GlobalArgs, args: PathBenchArgs) -> anyhow::Result<()> {
    let builds: Vec<Build> = args
        .builds
        .iter()
        .map(|b| Build::parse(b))
        .collect::<anyhow::Result<_>>()?;
    let retention_env: Vec<(String, String)> = args
        .retention_env
        .iter()
        .map(|pair| {
            pair.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .with_context(|| format!("--retention-env {pair:?}: NAME=VALUE"))
        })
        .collect::<anyhow::Result<_>>()?;
    let (server, _) = global
        .database_url
        .rsplit_once('/')
        .context("RELAY_DATABASE_URL has no database name")?;
    let bench = Bench {
        server: server.to_owned(),
        global: global.clone(),
        args: &args,
        retention_env,
        management: reqwest::Client::new(),
    };
    let mut figures = Vec::new();
    let mut ceilings = Vec::new();
    for round in 1..=args.rounds {
        // Alternate which build goes first, so neither always meets the machine as the other
        // left it.
        let order: Vec<&Build> = if round % 2 == 1 {
            builds.iter().collect()
        } else {
            builds.iter().rev().collect()
        };
        for build in order {
            for &load in &args.loads {
                for &mode in &args.modes {
                    let what = format!("round {round}: {} {} {load}", build.label, mode.name());
                    eprintln!("{what}");
                    let run = bench.run(build, mode, load).await.context(what)?;
                    println!(
                        "{}",
                        json!({"round": round, "build": build.label, "mode": mode,
                               "load": load.to_string(), "figures": run.json})
                    );
                    figures.push(run);
                }
            }
        }
        if args.ceiling_s > 0 {
            let newest = builds.last().expect("at least one build");
            eprintln!("round {round}: the ceilings (schema of {})", newest.label);
            let ceiling = json!({
                "round": round,
                "postgres": bench.postgres_ceiling(newest).await.context("Postgres' ceiling")?,
                "rabbitmq": bench.rabbitmq_ceiling().await.context("RabbitMQ's ceiling")?,
            });
            println!("{}", json!({ "ceiling": ceiling }));
            ceilings.push(ceiling);
        }
    }
    println!(
        "{}",
        json!({ "summary": summary(&builds, &args.loads, &figures, &ceilings) })
    );
    Ok(())
}

struct Bench<'a> {
    server: String,
    global: GlobalArgs,
    args: &'a PathBenchArgs,
    retention_env: Vec<(String, String)>,
    management: reqwest::Client,
}

impl Bench<'_> {
    fn database_url(&self) -> String {
        format!("{}/{DATABASE}", self.server)
    }

    async fn recreate_database(&self) -> anyhow::Result<()> {
        let mut admin = PgConnection::connect(&format!("{}/postgres", self.server)).await?;
        sqlx::query(&format!("DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)"))
            .execute(&mut admin)
            .await?;
        sqlx::query(&format!("CREATE DATABASE {DATABASE}"))
            .execute(&mut admin)
            .await?;
        for setting in &self.args.database_setting {
            let (name, value) = setting
                .split_once('=')
                .with_context(|| format!("--database-setting {setting:?}: NAME=VALUE"))?;
            if !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            {
                bail!("--database-setting {name:?}: a setting's name");
            }
            sqlx::query(&format!(
                "ALTER DATABASE {DATABASE} SET {name} = '{}'",
                value.replace('\'', "''")
            ))
            .execute(&mut admin)
            .await?;
        }
        Ok(())
    }

    async fn drop_database(&self) -> anyhow::Result<()> {
        let mut admin = PgConnection::connect(&format!("{}/postgres", self.server)).await?;
        sqlx::query(&format!("DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)"))
            .execute(&mut admin)
            .await?;
        Ok(())
    }

    /// A vhost of the run's own, with every permission for the management user (the build's
    /// broker user in the run).
    async fn make_vhost(&self, vhost: &str) -> anyhow::Result<()> {
        let base = self.args.amqp_management_url.trim_end_matches('/');
        let auth = (
            &self.args.amqp_management_user,
            &self.args.amqp_management_password,
        );
        self.management
            .put(format!("{base}/api/vhosts/{vhost}"))
            .basic_auth(auth.0, Some(auth.1))
            .json(&json!({}))
            .send()
            .await?
            .error_for_status()?;
        self.management
            .put(format!("{base}/api/permissions/{vhost}/{}", auth.0))
            .basic_auth(auth.0, Some(auth.1))
            .json(&json!({"configure": ".*", "write": ".*", "read": ".*"}))
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }

    async fn remove_vhost(&self, vhost: &str) {
        let base = self.args.amqp_management_url.trim_end_matches('/');
        let removed = self
            .management
            .delete(format!("{base}/api/vhosts/{vhost}"))
            .basic_auth(
                &self.args.amqp_management_user,
                Some(&self.args.amqp_management_password),
            )
            .send()
            .await;
        if let Err(error) = removed {
            eprintln!("removing vhost {vhost}: {error}");
        }
    }

    fn amqp_url(&self, vhost: &str) -> String {
        format!(
            "{}/{vhost}",
            self.args.amqp_server_url.trim_end_matches('/')
        )
    }

    /// Migrates the run's database with `build`'s own binary, registers the load's tenant and
    /// endpoints as every build's schema takes them, and marks every endpoint's feed as held at
    /// the load's generation; then migrates again, so a build that seals secrets at rest seals
    /// them as it would a database an older build wrote.
    async fn prepare_database(&self, build: &Build) -> anyhow::Result<()> {
        self.recreate_database().await?;
        self.migrate(build).await?;
        let mut conn = PgConnection::connect(&self.database_url()).await?;
        let tenant = loadgen_tenant(SEED);
        let endpoints = loadgen_endpoints(SEED, self.args.endpoints);
        let ids: Vec<Uuid> = endpoints.iter().map(|(id, _)| *id).collect();
        let secrets: Vec<String> = endpoints.iter().map(|(_, s)| s.to_whsec()).collect();
        // Plain statements, not the store's: the builds compared may predate its columns. The
        // load's one tenant stands for the whole load: no quota of a tenant's shapes it.
        for statement in [
            "INSERT INTO tenants (id, name) VALUES ($1, 'loadgen')",
            "INSERT INTO tenant_quotas (tenant_id, max_endpoints, max_messages_per_second)
             VALUES ($1, 1000000, 1000000)",
            "INSERT INTO webhook_endpoints (id, tenant_id) SELECT unnest($2::uuid[]), $1",
            "INSERT INTO endpoint_arrival_counters (endpoint_id) SELECT unnest($2::uuid[])",
            "INSERT INTO endpoint_secrets (tenant_id, endpoint_id, secret)
             SELECT $1, unnest($2::uuid[]), unnest($3::text[])",
            "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id, generation, access_version)
             SELECT id, 'feed', tenant_id, 1, 'loadgen1' FROM webhook_endpoints",
        ] {
            sqlx::query(statement)
                .bind(tenant)
                .bind(&ids)
                .bind(&secrets)
                .execute(&mut conn)
                .await
                .with_context(|| format!("provisioning the load: {statement}"))?;
        }
        self.migrate(build).await
    }

    /// `relay migrate` of `build`'s own binary on the run's database.
    async fn migrate(&self, build: &Build) -> anyhow::Result<()> {
        let migrated = tokio::process::Command::new(&build.binary)
            .arg("migrate")
            .envs(self.global.seal.environment())
            .env("RELAY_DATABASE_URL", self.database_url())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .await?;
        if !migrated.status.success() {
            bail!(
                "{} migrate failed: {}",
                build.label,
                String::from_utf8_lossy(&migrated.stderr)
            );
        }
        Ok(())
    }

    async fn run(&self, build: &Build, mode: PathMode, load: Load) -> anyhow::Result<RunFigures> {
        self.prepare_database(build).await?;
        let vhost = format!("relay-bench-path-{}", Uuid::new_v4().simple());
        self.make_vhost(&vhost).await?;
        let result = self.run_in(build, (mode, load), &vhost).await;
        self.remove_vhost(&vhost).await;
        self.drop_database().await?;
        Ok(RunFigures {
            build: build.label.clone(),
            mode,
            load,
            json: result?,
        })
    }

    async fn run_in(
        &self,
        build: &Build,
        (mode, load): (PathMode, Load),
        vhost: &str,
    ) -> anyhow::Result<Value> {
        let listen = free_port()?;
        let metrics = free_port()?;
        let log = std::env::temp_dir().join(format!("relay-bench-path-{}.log", Uuid::new_v4()));
        let mut command = tokio::process::Command::new(&build.binary);
        command
            .arg(if mode == PathMode::Front {
                "ingest"
            } else {
                "all"
            })
            .envs(self.global.seal.environment())
            .env("RELAY_DATABASE_URL", self.database_url())
            .env("RELAY_REDIS_URL", &self.global.redis_url)
            .env(
                "RELAY_REDIS_KEY_PREFIX",
                format!("relay-bench-path-{}:", Uuid::new_v4().simple()),
            )
            .env("RELAY_AMQP_URL", self.amqp_url(vhost))
            .env("RELAY_INGEST_LISTEN", format!("127.0.0.1:{listen}"))
            .env("RELAY_METRICS_LISTEN", format!("127.0.0.1:{metrics}"))
            .env_remove("RELAY_API_JWT_SECRET_FILE")
            .env_remove("RELAY_API_JWT_SECRET")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .kill_on_drop(true);
        if mode == PathMode::Retention {
            command.envs(self.retention_env.iter().map(|(k, v)| (k, v)));
        }
        let mut child = command.spawn().context("starting the build")?;
        let pid = child.id().context("the build's process has no pid")?;
        let ready = wait_ready(metrics, &mut child).await;
        let measured = match ready {
            Ok(()) => self.measure((mode, load), listen, vhost, pid).await,
            Err(error) => Err(error),
        };
        terminate(&mut child).await;
        match measured {
            Ok(mut figures) => {
                figures["log"] = json!(log.display().to_string());
                Ok(figures)
            }
            Err(error) => Err(error.context(format!("the build's log: {}", log.display()))),
        }
    }

    async fn measure(
        &self,
        (mode, load): (PathMode, Load),
        listen: u16,
        vhost: &str,
        pid: u32,
    ) -> anyhow::Result<Value> {
        let sent_at: SentAt = Arc::default();
        let delivered: Delivered = Arc::default();
        let consumer = if mode.consumes() {
            let queue = relay_publisher::tenant_queue(loadgen_tenant(SEED));
            Some(tokio::spawn(consume(
                self.amqp_url(vhost),
                self.global.trust()?,
                queue,
                sent_at.clone(),
                delivered.clone(),
            )))
        } else {
            None
        };
        let mut stats = PgConnection::connect(&self.database_url()).await?;
        let statements = Statements::prepare(&mut stats, self.args.statements).await?;
        let base = format!("http://127.0.0.1:{listen}");
        let sent_at = mode.consumes().then(|| sent_at.clone());
        // A burst is measured whole, from its first message to its last change; every other
        // load over a window after its warm-up.
        let (before, after, answers, window) = if let Load::Burst { messages, events } = load {
            let started = Instant::now();
            statements.reset(&mut stats).await?;
            let before = Snapshot::take(&mut stats, pid).await?;
            let answers = send_burst(self.args, base, sent_at, (messages, events)).await?;
            if mode.consumes() {
                let expected = answers
                    .iter()
                    .filter(|a| a.status == 202)
                    .map(|a| a.events)
                    .sum();
                wait_delivered(&delivered, expected).await;
            }
            let after = Snapshot::take(&mut stats, pid).await?;
            (before, after, answers, (started, Instant::now()))
        } else {
            let started = Instant::now();
            let warmup_ends = started + Duration::from_secs(self.args.warmup_s);
            let ends = warmup_ends + Duration::from_secs(self.args.duration_s);
            let senders = send_load(self.args, load, base, sent_at, ends);
            tokio::time::sleep_until(warmup_ends.into()).await;
            statements.reset(&mut stats).await?;
            let before = Snapshot::take(&mut stats, pid).await?;
            tokio::time::sleep_until(ends.into()).await;
            let after = Snapshot::take(&mut stats, pid).await?;
            (before, after, senders.await?, (warmup_ends, ends))
        };
        let seconds = (window.1 - window.0).as_secs_f64();
        let in_window: Vec<&Answer> = answers.iter().filter(|a| a.sent >= window.0).collect();
        let accepted = in_window.iter().filter(|a| a.status == 202).count() as u64;
        // What the front tier's figures are per: each event stored (one a message, but in a
        // burst).
        let accepted_events: u64 = in_window
            .iter()
            .filter(|a| a.status == 202)
            .map(|a| a.events)
            .sum();
        let mut answer_latency: Vec<Duration> = in_window.iter().map(|a| a.latency).collect();
        let mut statuses: BTreeMap<String, u64> = BTreeMap::new();
        for answer in &in_window {
            *statuses.entry(answer.status.to_string()).or_default() += 1;
        }
        let mut figures = json!({
            "accepted_per_s": per_s(accepted, seconds),
            "answers": statuses,
            "answer_ms": percentiles(&mut answer_latency),
        });
        if let Load::Burst { .. } = load {
            // From the first message sent to the last one answered.
            let answered = answers
                .iter()
                .map(|a| a.sent + a.latency)
                .max()
                .map(|last| round2((last - window.0).as_secs_f64()));
            figures["burst_answered_s"] = json!(answered);
        }
        let measured = if mode.consumes() {
            // Everything accepted (warm-up included) reaches the queue unless the path loses it.
            let expected: u64 = answers
                .iter()
                .filter(|a| a.status == 202)
                .map(|a| a.events)
                .sum();
            let drain_started = Instant::now();
            let drained = wait_delivered(&delivered, expected).await;
            if let Some(consumer) = consumer {
                consumer.abort();
            }
            let delivered = delivered.lock().expect("not poisoned");
            let taken: Vec<&(Instant, Option<Duration>)> = delivered
                .iter()
                .filter(|(at, _)| *at >= window.0 && *at <= window.1)
                .collect();
            let mut latency: Vec<Duration> = taken.iter().filter_map(|(_, l)| *l).collect();
            figures["reached_queue_per_s"] = json!(per_s(taken.len() as u64, seconds));
            figures["receipt_to_queue_ms"] = percentiles(&mut latency);
            figures["accepted_in_all"] = json!(expected);
            figures["reached_queue_in_all"] = json!(delivered.len());
            figures["drained_after_load_s"] =
                json!(round1(drain_started.elapsed().as_secs_f64().min(drained)));
            if let Load::Burst { .. } = load {
                let last = delivered.iter().map(|(at, _)| *at).max();
                figures["burst_in_queue_s"] =
                    json!(last.map(|last| round2((last - window.0).as_secs_f64())));
            }
            taken.len() as u64
        } else {
            accepted_events
        };
        figures["per_message"] = after.since(&before, measured, seconds);
        figures["statements"] = statements.top(&mut stats).await?;
        Ok(figures)
    }

    /// Postgres inserting, per message, the rows the whole path must keep of it (the message,
    /// its copy row, its change, its event id), `CEILING_BATCH` messages a transaction with
    /// synchronous commit, on `CEILING_CONNECTIONS` connections, into `build`'s schema.
    async fn postgres_ceiling(&self, build: &Build) -> anyhow::Result<Value> {
        self.prepare_database(build).await?;
        let mut stats = PgConnection::connect(&self.database_url()).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let inserted = Arc::new(AtomicU64::new(0));
        let body = realistic_text(
            self.args.body_bytes,
            &mut rand::rngs::StdRng::seed_from_u64(9),
        );
        let item = json!({"body": body}).to_string();
        let tenant = loadgen_tenant(SEED);
        let endpoints: Vec<Uuid> = loadgen_endpoints(SEED, self.args.endpoints.max(1))
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        let mut writers = Vec::new();
        for writer in 0..CEILING_CONNECTIONS {
            let mut conn = PgConnection::connect(&self.database_url()).await?;
            let (stop, inserted, item, endpoints) = (
                stop.clone(),
                inserted.clone(),
                item.clone(),
                endpoints.clone(),
            );
            writers.push(tokio::spawn(async move {
                let mut n: i64 = (writer as i64) << 40;
                while !stop.load(Ordering::Relaxed) {
                    let batch: Vec<(Uuid, i64)> = (0..CEILING_BATCH)
                        .map(|i| {
                            n += 1;
                            (endpoints[(n as usize + i) % endpoints.len()], n)
                        })
                        .collect();
                    insert_ceiling_batch(&mut conn, tenant, &batch, &item).await?;
                    inserted.fetch_add(batch.len() as u64, Ordering::Relaxed);
                }
                Ok::<_, anyhow::Error>(())
            }));
        }
        // A short warm-up, then the measured window.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (before, count_before) = (
            Snapshot::take(&mut stats, 0).await?,
            inserted.load(Ordering::Relaxed),
        );
        tokio::time::sleep(Duration::from_secs(self.args.ceiling_s)).await;
        let (after, count_after) = (
            Snapshot::take(&mut stats, 0).await?,
            inserted.load(Ordering::Relaxed),
        );
        stop.store(true, Ordering::Relaxed);
        for writer in writers {
            writer.await??;
        }
        drop(stats);
        self.drop_database().await?;
        let messages = count_after - count_before;
        Ok(json!({
            "messages_per_s": per_s(messages, self.args.ceiling_s as f64),
            "per_message": after.since(&before, messages, self.args.ceiling_s as f64),
        }))
    }

    /// RabbitMQ taking change-sized messages with publisher confirms into a quorum queue
    /// (`CEILING_IN_FLIGHT` unconfirmed at most), a consumer draining it meanwhile.
    async fn rabbitmq_ceiling(&self) -> anyhow::Result<Value> {
        use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions};
        use lapin::types::FieldTable;
        use lapin::BasicProperties;
        let vhost = format!("relay-bench-path-{}", Uuid::new_v4().simple());
        self.make_vhost(&vhost).await?;
        let trust = self.global.trust()?;
        let url = self.amqp_url(&vhost);
        let result = async {
            let queue = "relay.bench.ceiling";
            let connection =
                relay_publisher::connect(&url, "relay-bench-ceiling", Duration::from_secs(5), &trust)
                    .await?;
            let channel = connection.create_channel().await?;
            relay_publisher::declare_tenant_queue(&channel, queue).await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            let drain = tokio::spawn({
                let consumer_channel = connection.create_channel().await?;
                async move {
                    let mut consumer = consumer_channel
                        .basic_consume(
                            queue,
                            "relay-bench-ceiling",
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
                    Ok::<_, anyhow::Error>(())
                }
            });
            let body = json!({
                "item": {"body": realistic_text(self.args.body_bytes, &mut rand::rngs::StdRng::seed_from_u64(5))}
            })
            .to_string()
            .into_bytes();
            let mut stats = PgConnection::connect(&format!("{}/postgres", self.server)).await?;
            let mut in_flight = futures::stream::FuturesUnordered::new();
            let mut confirmed: u64 = 0;
            let started = Instant::now();
            let measured_from = started + Duration::from_secs(2);
            let ends = measured_from + Duration::from_secs(self.args.ceiling_s);
            let mut before: Option<(Snapshot, u64)> = None;
            while Instant::now() < ends {
                if before.is_none() && Instant::now() >= measured_from {
                    before = Some((Snapshot::take(&mut stats, 0).await?, confirmed));
                }
                while in_flight.len() < CEILING_IN_FLIGHT {
                    let confirm = channel
                        .basic_publish(
                            "",
                            queue,
                            BasicPublishOptions::default(),
                            &body,
                            BasicProperties::default().with_delivery_mode(2),
                        )
                        .await?;
                    in_flight.push(confirm);
                }
                if let Some(confirm) = in_flight.next().await {
                    if confirm?.is_ack() {
                        confirmed += 1;
                    }
                }
            }
            let after = (Snapshot::take(&mut stats, 0).await?, confirmed);
            let (before, confirmed_before) = before.context("the window never began")?;
            drain.abort();
            let _ = connection.close(200, "done").await;
            let messages = after.1 - confirmed_before;
            Ok::<_, anyhow::Error>(json!({
                "confirmed_per_s": per_s(messages, self.args.ceiling_s as f64),
                "per_message": after.0.since(&before, messages, self.args.ceiling_s as f64),
            }))
        }
        .await;
        self.remove_vhost(&vhost).await;
        result
    }
}

/// One batch of the Postgres ceiling: `CEILING_BATCH` messages' rows, one statement a table,
/// one transaction.
async fn insert_ceiling_batch(
    conn: &mut PgConnection,
    tenant: Uuid,
    batch: &[(Uuid, i64)],
    item: &str,
) -> anyhow::Result<()> {
    let endpoints: Vec<Uuid> = batch.iter().map(|(e, _)| *e).collect();
    let numbers: Vec<i64> = batch.iter().map(|(_, n)| *n).collect();
    let mut tx = conn.begin().await?;
    sqlx::query(
        "INSERT INTO messages (endpoint_id, arrival_seq, tenant_id, webhook_id, signed_at,
                               received_at, track, generation, body)
         SELECT e, n, $3, 'msg_' || n, now(), now(), 'feed', 1, convert_to($4, 'UTF8')
         FROM unnest($1::uuid[], $2::int8[]) AS b(e, n)",
    )
    .bind(&endpoints)
    .bind(&numbers)
    .bind(tenant)
    .bind(item)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO copy_items (endpoint_id, subject, tenant_id, generation, sequence, tombstone,
                                 item_kind, parts, item)
         SELECT e, 'announcement:' || n, $3, 1, '1.' || n, false, 'announcement',
                '[{\"part_id\":\"story:1\",\"part_version\":1}]', $4::json
         FROM unnest($1::uuid[], $2::int8[]) AS b(e, n)",
    )
    .bind(&endpoints)
    .bind(&numbers)
    .bind(tenant)
    .bind(item)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO changes (endpoint_id, change_seq, tenant_id, operation, subject, item_kind,
                              generation, sequence, event_id, item, parts_diff)
         SELECT e, n, $3, 'upsert', 'announcement:' || n, 'announcement', 1, '1.' || n,
                'evt_' || n, $4::json, '{\"added\":[\"story:1\"],\"changed\":[],\"removed\":[]}'
         FROM unnest($1::uuid[], $2::int8[]) AS b(e, n)",
    )
    .bind(&endpoints)
    .bind(&numbers)
    .bind(tenant)
    .bind(item)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO applied_events (endpoint_id, event_id, tenant_id)
         SELECT e, 'evt_' || n, $3 FROM unnest($1::uuid[], $2::int8[]) AS b(e, n)",
    )
    .bind(&endpoints)
    .bind(&numbers)
    .bind(tenant)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// When each message of the load was sent, by endpoint and item number, until its change
/// comes.
type SentAt = Arc<Mutex<HashMap<(Uuid, u64), Instant>>>;

/// Each change the consumer took: when, and how long after its message was sent (when known).
type Delivered = Arc<Mutex<Vec<(Instant, Option<Duration>)>>>;

/// One answered message of the load.
#[derive(Debug, Clone, Copy)]
struct Answer {
    /// When it was due: sent, in a closed loop; its place in the schedule, in an open one.
    sent: Instant,
    latency: Duration,
    /// The HTTP status, or 0 when no answer came.
    status: u16,
    /// The events it held (each a new item: a change once applied).
    events: u64,
}

/// Senders an open loop keeps: enough that a message due waits for one only when the relay is
/// far behind (its wait then counts against the relay).
const OPEN_LOOP_SENDERS: usize = 256;

/// The load `load` (a closed loop of senders, an open loop at a rate, or nothing) until `ends`.
/// Each message is one new item of an endpoint drawn at random (subject `announcement:<n>`, `n`
/// unique in the run), of text made for it; when `sent_at` is given, each message's send time
/// is kept under its endpoint and `n` for the consumer.
fn send_load(
    args: &PathBenchArgs,
    load: Load,
    base: String,
    sent_at: Option<SentAt>,
    ends: Instant,
) -> tokio::task::JoinHandle<Vec<Answer>> {
    let endpoints = Arc::new(loadgen_endpoints(SEED, args.endpoints.max(1)));
    let text_bytes = args.body_bytes.saturating_sub(ENVELOPE_BYTES);
    let (senders, interval) = match load {
        Load::Senders(n) => (n, None),
        Load::Rate(rate) => (
            OPEN_LOOP_SENDERS,
            Some(Duration::from_secs_f64(OPEN_LOOP_SENDERS as f64 / rate)),
        ),
        Load::Idle | Load::Burst { .. } => (0, None),
    };
    tokio::spawn(async move {
        let client = http_client(senders.max(1));
        let started = Instant::now();
        let senders = (0..senders).map(|worker| {
            let (client, endpoints, base, sent_at) = (
                client.clone(),
                endpoints.clone(),
                base.clone(),
                sent_at.clone(),
            );
            // On a schedule, sender w sends the messages due at w, w + c, w + 2c, ... in units
            // of the rate's interval (c senders), so together they keep the rate.
            let mut next_due =
                interval.map(|every| started + every.mul_f64(worker as f64 / senders as f64));
            tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(SEED ^ (worker as u64) << 20);
                let mut answers = Vec::new();
                let mut n = (worker as u64) << 32;
                loop {
                    let due = match (&mut next_due, interval) {
                        (Some(next), Some(every)) => {
                            let due = *next;
                            *next += every;
                            tokio::time::sleep_until(due.into()).await;
                            due
                        }
                        _ => Instant::now(),
                    };
                    if due >= ends {
                        return answers;
                    }
                    let (id, secret): &(Uuid, SigningSecret) =
                        &endpoints[rng.gen_range(0..endpoints.len())];
                    n += 1;
                    let text = realistic_text(text_bytes, &mut rng);
                    let message = build_events_message(*id, secret, n, &[&text]);
                    if let Some(sent_at) = &sent_at {
                        sent_at.lock().expect("not poisoned").insert((*id, n), due);
                    }
                    let status = post(&client, &base, *id, message).await;
                    answers.push(Answer {
                        sent: due,
                        latency: due.elapsed(),
                        status,
                        events: 1,
                    });
                }
            })
        });
        let mut all = Vec::new();
        for sender in futures::future::join_all(senders).await {
            all.extend(sender.unwrap_or_default());
        }
        if all.is_empty() {
            tokio::time::sleep_until(ends.into()).await;
        }
        all
    })
}

/// One endpoint's burst: `messages` messages of `events` new items each, sent one at a time
/// (the next once the last was answered 2xx, as the upstream sends an endpoint's messages), each
/// message as large as the wire file lets a message of several items' events be.
async fn send_burst(
    args: &PathBenchArgs,
    base: String,
    sent_at: Option<SentAt>,
    (messages, events): (usize, usize),
) -> anyhow::Result<Vec<Answer>> {
    let (id, secret) = loadgen_endpoints(SEED, 1).remove(0);
    let envelope = ENVELOPE_BYTES / 2;
    let per_event = (relay_wire::limits::MESSAGE_BYTES / events).saturating_sub(envelope);
    let text_bytes = args
        .body_bytes
        .saturating_sub(ENVELOPE_BYTES)
        .min(per_event.saturating_sub(envelope));
    let client = http_client(1);
    let mut rng = rand::rngs::StdRng::seed_from_u64(SEED ^ 0xb0257);
    let mut answers = Vec::with_capacity(messages);
    let mut n = 0u64;
    for _ in 0..messages {
        let texts: Vec<String> = (0..events)
            .map(|_| realistic_text(text_bytes, &mut rng))
            .collect();
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        let first = n + 1;
        n += events as u64;
        let message = build_events_message(id, &secret, first, &texts);
        let sent = Instant::now();
        if let Some(sent_at) = &sent_at {
            let mut sent_at = sent_at.lock().expect("not poisoned");
            for item in first..=n {
                sent_at.insert((id, item), sent);
            }
        }
        // Sent again until taken, as the upstream would (never past a minute).
        let mut status = post(&client, &base, id, message.clone()).await;
        while !(200..300).contains(&status) && sent.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            status = post(&client, &base, id, message.clone()).await;
        }
        answers.push(Answer {
            sent,
            latency: sent.elapsed(),
            status,
            events: events as u64,
        });
    }
    Ok(answers)
}

fn http_client(connections: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(connections)
        .timeout(Duration::from_secs(20))
        .build()
        .expect("a plain HTTP client")
}

/// Posts one signed message to `endpoint`: the answer's status, 0 when none came.
async fn post(
    client: &reqwest::Client,
    base: &str,
    endpoint: Uuid,
    (webhook_id, timestamp, signature, body): (String, i64, String, Vec<u8>),
) -> u16 {
    let result = client
        .post(format!("{base}/webhooks/{endpoint}"))
        .header("content-type", "application/json")
        .header("webhook-id", webhook_id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
        .header("quanor-webhook-attempt", "1")
        .body(body)
        .send()
        .await;
    match result {
        Ok(response) => {
            let status = response.status().as_u16();
            let _ = response.bytes().await;
            status
        }
        Err(_) => 0,
    }
}

/// Waits until the consumer took `expected` changes, or none came for 15 s: the seconds from
/// the start of the wait to the last change taken.
async fn wait_delivered(delivered: &Delivered, expected: u64) -> f64 {
    let started = Instant::now();
    let mut last = (delivered.lock().expect("not poisoned").len(), started);
    loop {
        let count = delivered.lock().expect("not poisoned").len();
        if count != last.0 {
            last = (count, Instant::now());
        }
        if count as u64 >= expected || last.1.elapsed() > Duration::from_secs(15) {
            return (last.1 - started).as_secs_f64();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The statements Postgres spent the most time on in a run's window, from
/// `pg_stat_statements`, when the server loads it.
struct Statements {
    top: usize,
    loaded: bool,
}

impl Statements {
    /// Makes the extension's view in the run's database when the server loads its library.
    async fn prepare(stats: &mut PgConnection, top: usize) -> anyhow::Result<Self> {
        let loaded: bool = sqlx::query_scalar(
            "SELECT 'pg_stat_statements' = ANY(
                 string_to_array(replace(current_setting('shared_preload_libraries'), ' ', ''),
                                 ','))",
        )
        .fetch_one(&mut *stats)
        .await?;
        let loaded = loaded && top > 0;
        if loaded {
            sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                .execute(&mut *stats)
                .await?;
        }
        Ok(Self { top, loaded })
    }

    /// Starts the window (every database's counts: the bench runs alone).
    async fn reset(&self, stats: &mut PgConnection) -> anyhow::Result<()> {
        if self.loaded {
            sqlx::query("SELECT pg_stat_statements_reset()")
                .execute(&mut *stats)
                .await?;
        }
        Ok(())
    }

    /// The run database's statements by the time they took since the reset, the most first:
    /// each one's share, calls, milliseconds a call, rows, WAL records and bytes, and its text's
    /// beginning.
    async fn top(&self, stats: &mut PgConnection) -> anyhow::Result<Value> {
        if self.top == 0 {
            return Ok(Value::Null);
        }
        if !self.loaded {
            return Ok(json!(
                "pg_stat_statements is not in the server's shared_preload_libraries"
            ));
        }
        type Row = (f64, i64, f64, i64, i64, i64, String);
        let rows: Vec<Row> = sqlx::query_as(
            "WITH mine AS (
                 SELECT * FROM pg_stat_statements
                 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                   AND query NOT LIKE '%pg_stat%'
             )
             SELECT round((100 * total_exec_time / nullif(sum(total_exec_time) OVER (), 0))::numeric, 1)::float8,
                    calls, round((total_exec_time / greatest(calls, 1))::numeric, 3)::float8,
                    rows, wal_records, wal_bytes::int8,
                    left(regexp_replace(query, '\\s+', ' ', 'g'), 120)
             FROM mine ORDER BY total_exec_time DESC LIMIT $1",
        )
        .bind(self.top as i64)
        .fetch_all(&mut *stats)
        .await?;
        Ok(json!(rows
            .into_iter()
            .map(
                |(share, calls, ms, rows, wal_records, wal_bytes, text)| json!({
                    "pct": share, "calls": calls, "ms_per_call": ms, "rows": rows,
                    "wal_records": wal_records, "wal_bytes": wal_bytes, "statement": text,
                })
            )
            .collect::<Vec<_>>()))
    }
}

/// Reads the tenant's queue and notes, for each change, when it came and how long after its
/// message was sent (matched by endpoint and the item's subject).
async fn consume(
    amqp_url: String,
    trust: relay_netguard::TrustRoots,
    queue: String,
    sent_at: SentAt,
    delivered: Delivered,
) -> anyhow::Result<()> {
    use lapin::options::BasicConsumeOptions;
    use lapin::types::FieldTable;
    let connection = relay_publisher::connect(
        &amqp_url,
        "relay-bench-path",
        Duration::from_secs(5),
        &trust,
    )
    .await?;
    let channel = connection.create_channel().await?;
    relay_publisher::declare_tenant_queue(&channel, &queue).await?;
    let mut consumer = channel
        .basic_consume(
            &queue,
            "relay-bench-path",
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    #[derive(serde::Deserialize)]
    struct Change {
        webhook_endpoint_id: Uuid,
        subject: String,
    }
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery?;
        let at = Instant::now();
        let latency = serde_json::from_slice::<Change>(&delivery.data)
            .ok()
            .and_then(|change| {
                let n: u64 = change.subject.strip_prefix("announcement:")?.parse().ok()?;
                let sent = sent_at
                    .lock()
                    .expect("not poisoned")
                    .remove(&(change.webhook_endpoint_id, n))?;
                Some(at.duration_since(sent))
            });
        delivered.lock().expect("not poisoned").push((at, latency));
    }
    Ok(())
}

/// What Postgres and the machine's processes had done at one moment.
struct Snapshot {
    cpu: Option<CpuSnapshot>,
    wal: (i64, i64, i64),
    commits: i64,
    /// Per table: rows inserted, updated, deleted.
    rows: BTreeMap<String, (i64, i64, i64)>,
}

impl Snapshot {
    /// `pid`, when not 0, is the build's process: its CPU counts as `relay`, and this bench's
    /// own (which loads and consumes) as `bench`.
    async fn take(stats: &mut PgConnection, pid: u32) -> anyhow::Result<Self> {
        let wal: (i64, i64, i64) =
            sqlx::query_as("SELECT wal_records, wal_fpi, wal_bytes::int8 FROM pg_stat_wal")
                .fetch_one(&mut *stats)
                .await?;
        let commits: i64 = sqlx::query_scalar(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(&mut *stats)
        .await?;
        let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(
            "SELECT relname::text, n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables",
        )
        .fetch_all(&mut *stats)
        .await?;
        let own = std::process::id();
        let database: String = sqlx::query_scalar("SELECT current_database()::text")
            .fetch_one(&mut *stats)
            .await?;
        let cpu = CpuSnapshot::take_scoped(&[(pid, "relay"), (own, "bench")], Some(&database));
        Ok(Snapshot {
            cpu,
            wal,
            commits,
            rows: rows
                .into_iter()
                .map(|(table, i, u, d)| (table, (i, u, d)))
                .collect(),
        })
    }

    /// From `before` to `self`, per message of `messages` over `seconds`: CPU µs by process,
    /// WAL bytes and records, rows written (by table) and commits. Postgres' counters of a
    /// backend reach its statistics at most a second late, which a window of tens of seconds
    /// barely notices.
    fn since(&self, before: &Snapshot, messages: u64, seconds: f64) -> Value {
        let per = |v: f64| {
            if messages == 0 {
                Value::Null
            } else {
                json!(round2(v / messages as f64))
            }
        };
        let mut cpu = serde_json::Map::new();
        let mut cores_used = serde_json::Map::new();
        if let (Some(now), Some(then)) = (&self.cpu, &before.cpu) {
            let usage = now.since(then);
            let cores = crate::cpu::cores_of_machine() as f64;
            let (mut all_in, mut all_in_cores) = (0.0, 0.0);
            for (group, used) in &usage.cores {
                let us = used * seconds * 1e6;
                if ALL_IN.contains(group) {
                    all_in += us;
                    all_in_cores += used;
                }
                cpu.insert((*group).to_owned(), per(us));
                cores_used.insert((*group).to_owned(), json!(*used));
            }
            cpu.insert("all_in".into(), per(all_in));
            cores_used.insert("all_in".into(), json!(round4(all_in_cores)));
            cpu.insert(
                "machine_busy_pct".into(),
                json!(usage.machine_busy_pct.min(100.0 * cores)),
            );
        }
        let mut rows = serde_json::Map::new();
        let mut rows_all = 0;
        for (table, (i, u, d)) in &self.rows {
            let (bi, bu, bd) = before.rows.get(table).copied().unwrap_or_default();
            let written = (i - bi) + (u - bu) + (d - bd);
            if written > 0 {
                rows.insert(table.clone(), per(written as f64));
                rows_all += written;
            }
        }
        json!({
            "cpu_us": cpu,
            // What each process kept busy, in cores, whatever the messages: at light load and
            // idle, what the build costs by being there.
            "cores": cores_used,
            "wal_bytes": per((self.wal.2 - before.wal.2) as f64),
            "wal_records": per((self.wal.0 - before.wal.0) as f64),
            "wal_full_page_images": per((self.wal.1 - before.wal.1) as f64),
            // Less the bench's own three reads of the counters.
            "commits": per((self.commits - before.commits - 3).max(0) as f64),
            "rows_written": per(rows_all as f64),
            "rows_written_by_table": rows,
        })
    }
}

/// The figures of every run, by build and load: each figure's mean over the rounds, and the
/// ratios the issue asks for (within a build and load, the whole path to the front tier alone).
fn summary(builds: &[Build], loads: &[Load], figures: &[RunFigures], ceilings: &[Value]) -> Value {
    let mean = |build: &str, load: Load, mode: PathMode, pointer: &str| -> Option<f64> {
        let values: Vec<f64> = figures
            .iter()
            .filter(|f| f.build == build && f.mode == mode && f.load == load)
            .filter_map(|f| f.json.pointer(pointer).and_then(Value::as_f64))
            .collect();
        (!values.is_empty()).then(|| round2(values.iter().sum::<f64>() / values.len() as f64))
    };
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => json!(round2(a / b)),
        _ => Value::Null,
    };
    let mut by_build = serde_json::Map::new();
    for build in builds {
        let b = build.label.as_str();
        let mut by_load = serde_json::Map::new();
        for &load in loads {
            let m = |mode, pointer: &str| mean(b, load, mode, pointer);
            let front = m(PathMode::Front, "/accepted_per_s");
            let whole = m(PathMode::Whole, "/reached_queue_per_s");
            let cpu = |mode| m(mode, "/per_message/cpu_us/all_in");
            let by_process: serde_json::Map<String, Value> = ALL_IN
                .iter()
                .map(|g| {
                    let pointer = format!("/per_message/cpu_us/{g}");
                    (g.to_string(), json!(m(PathMode::Whole, &pointer)))
                })
                .collect();
            let mut figures = json!({
                "front_accepted_per_s": front,
                "whole_reached_queue_per_s": whole,
                "whole_over_front": ratio(whole, front),
                "front_cpu_us_per_message": cpu(PathMode::Front),
                "whole_cpu_us_per_message": cpu(PathMode::Whole),
                "whole_cpu_over_front": ratio(cpu(PathMode::Whole), cpu(PathMode::Front)),
                "whole_cpu_us_by_process": by_process,
                "front_cores_all_in": m(PathMode::Front, "/per_message/cores/all_in"),
                "whole_cores_all_in": m(PathMode::Whole, "/per_message/cores/all_in"),
                "whole_cores_postgres": m(PathMode::Whole, "/per_message/cores/postgres"),
                "whole_machine_busy_pct": m(PathMode::Whole, "/per_message/cpu_us/machine_busy_pct"),
                "front_answer_p50_ms": m(PathMode::Front, "/answer_ms/p50"),
                "whole_answer_p50_ms": m(PathMode::Whole, "/answer_ms/p50"),
                "whole_p50_ms": m(PathMode::Whole, "/receipt_to_queue_ms/p50"),
                "whole_p99_ms": m(PathMode::Whole, "/receipt_to_queue_ms/p99"),
                "whole_wal_bytes_per_message": m(PathMode::Whole, "/per_message/wal_bytes"),
                "whole_wal_records_per_message": m(PathMode::Whole, "/per_message/wal_records"),
                "whole_rows_per_message": m(PathMode::Whole, "/per_message/rows_written"),
                "whole_commits_per_message": m(PathMode::Whole, "/per_message/commits"),
                "retention_reached_queue_per_s": m(PathMode::Retention, "/reached_queue_per_s"),
                "retention_cpu_us_per_message": cpu(PathMode::Retention),
                "retention_cpu_over_whole": ratio(cpu(PathMode::Retention), cpu(PathMode::Whole)),
            });
            if let Load::Burst { .. } = load {
                let answered = m(PathMode::Front, "/burst_answered_s");
                let in_queue = m(PathMode::Whole, "/burst_in_queue_s");
                figures["burst_front_answered_s"] = json!(answered);
                figures["burst_whole_answered_s"] = json!(m(PathMode::Whole, "/burst_answered_s"));
                figures["burst_in_queue_s"] = json!(in_queue);
                figures["burst_in_queue_over_front_answered"] = ratio(in_queue, answered);
            }
            by_load.insert(load.to_string(), figures);
        }
        by_build.insert(b.to_owned(), Value::Object(by_load));
    }
    let ceiling_mean = |pointer: &str| -> Value {
        let values: Vec<f64> = ceilings
            .iter()
            .filter_map(|c| c.pointer(pointer).and_then(Value::as_f64))
            .collect();
        if values.is_empty() {
            Value::Null
        } else {
            json!(round2(values.iter().sum::<f64>() / values.len() as f64))
        }
    };
    json!({
        "builds": by_build,
        "ceilings": {
            "postgres_messages_per_s": ceiling_mean("/postgres/messages_per_s"),
            "postgres_cpu_us_per_message": ceiling_mean("/postgres/per_message/cpu_us/postgres"),
            "postgres_wal_bytes_per_message": ceiling_mean("/postgres/per_message/wal_bytes"),
            "rabbitmq_confirmed_per_s": ceiling_mean("/rabbitmq/confirmed_per_s"),
            "rabbitmq_cpu_us_per_message": ceiling_mean("/rabbitmq/per_message/cpu_us/rabbitmq"),
        },
    })
}

/// Text of `len` bytes that reads like news copy to a compressor: words of a financial news
/// vocabulary drawn by their frequency (a Zipf law, as words are in prose), sentences and
/// figures among them. It compresses as prose does (lz4, Postgres' compression here, takes
/// 2,235 bytes of it to 1,562 and 2,053 bytes of an English licence text to 1,405), not to
/// nothing as a run of one letter would.
fn realistic_text(len: usize, rng: &mut impl Rng) -> String {
    const WORDS: &str = "the of and to in a is that for on with as by at from its was are be has \
        it an this which have or not will said were their more than been company year million \
        billion per cent shares market quarter results revenue profit growth sales earnings \
        board group chief executive officer statement announced expects guidance operating \
        margin customers contract order deliveries production capacity investment dividend \
        analysts forecast demand prices costs increase decrease compared previous period \
        first second third fourth half fiscal net income loss cash flow debt financing capital \
        plan strategy acquisition agreement transaction regulatory approval report interim \
        annual strong weak higher lower record outlook remains expected continue new business \
        segment region europe nordic american asian oil energy technology bank insurance \
        retail industrial pharmaceutical software services products development";
    static VOCABULARY: std::sync::LazyLock<(Vec<&'static str>, WeightedIndex<f64>)> =
        std::sync::LazyLock::new(|| {
            let words: Vec<&str> = WORDS.split_whitespace().collect();
            let weights = (1..=words.len()).map(|rank| 1.0 / (rank as f64).powf(0.9));
            (
                words,
                WeightedIndex::new(weights).expect("positive weights"),
            )
        });
    let (words, frequency) = &*VOCABULARY;
    let mut text = String::with_capacity(len + 16);
    while text.len() < len {
        if rng.gen_ratio(6, 100) {
            text.push_str(&rng.gen_range(1..10_000).to_string());
        } else {
            text.push_str(words[frequency.sample(rng)]);
        }
        text.push_str(if rng.gen_ratio(7, 100) { ". " } else { " " });
    }
    text.truncate(len);
    text
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Waits until the build's `/readyz` answers 200 (every dependency reachable), or fails when it
/// exits or a minute passes.
async fn wait_ready(metrics: u16, child: &mut tokio::process::Child) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            bail!("the build exited before it was ready ({status})");
        }
        let ready = client
            .get(format!("http://127.0.0.1:{metrics}/readyz"))
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        if matches!(ready, Ok(answer) if answer.status().is_success()) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("the build was not ready within a minute")
}

/// SIGTERM, then SIGKILL if it has not ended within 30 s.
async fn terminate(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) with a pid this process started and has not reaped.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
        }
    }
    if tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}

fn percentiles(values: &mut [Duration]) -> Value {
    if values.is_empty() {
        return Value::Null;
    }
    values.sort_unstable();
    let at = |q: f64| {
        let i = ((values.len() as f64 * q).ceil() as usize).clamp(1, values.len()) - 1;
        round2(values[i].as_secs_f64() * 1000.0)
    };
    json!({"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": at(1.0), "count": values.len()})
}

fn per_s(count: u64, seconds: f64) -> f64 {
    round1(count as f64 / seconds.max(0.001))
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

fn round4(v: f64) -> f64 {
    (v * 10_000.0).round() / 10_000.0
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn realistic_text_has_the_length_asked_and_compresses_like_prose_not_like_one_letter() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let text = realistic_text(2_222, &mut rng);
        assert_eq!(text.len(), 2_222);
        // Distinct words: a text of one letter, or of a few words, has almost none.
        let words: std::collections::HashSet<&str> = text.split_whitespace().collect();
        assert!(words.len() > 80, "{} distinct words", words.len());
        let other = realistic_text(2_222, &mut rng);
        assert_ne!(text, other, "each message gets text of its own");
    }

    #[test]
    fn a_build_is_a_label_and_a_binary_that_exists() {
        let me = std::env::current_exe().unwrap();
        let build = Build::parse(&format!("after={}", me.display())).unwrap();
        assert_eq!(build.label, "after");
        assert_eq!(build.binary, me);
        assert!(Build::parse("before=/no/such/relay").is_err());
    }

    #[test]
    fn a_load_is_senders_a_rate_idle_or_a_burst_and_nothing_else() {
        for (text, load) in [
            ("senders:4", Load::Senders(4)),
            ("rate:500", Load::Rate(500.0)),
            ("rate:0.5", Load::Rate(0.5)),
            ("idle", Load::Idle),
            (
                "burst:50x200",
                Load::Burst {
                    messages: 50,
                    events: 200,
                },
            ),
        ] {
            assert_eq!(text.parse::<Load>(), Ok(load), "{text}");
            assert_eq!(load.to_string().parse::<Load>(), Ok(load), "{text} again");
        }
        for wrong in [
            "senders:0",
            "senders:x",
            "rate:0",
            "rate:-1",
            "rate:inf",
            "burst:50",
            "burst:0x1",
            "burst:1x201",
            "idle:1",
            "",
            "bursts:1x1",
        ] {
            assert!(wrong.parse::<Load>().is_err(), "{wrong} taken");
        }
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let mut values: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let p = percentiles(&mut values);
        assert_eq!(p["p50"], json!(50.0));
        assert_eq!(p["p99"], json!(99.0));
        assert_eq!(p["max"], json!(100.0));
    }
}
