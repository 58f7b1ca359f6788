//! `relay demo`: the whole relay on this machine against the simulated upstream, faults on,
//! to a verdict a user can check.
//!
//! It makes a database of its own (`relay_demo_<run>` on RELAY_DATABASE_URL's server) and a
//! Redis key prefix of its own, starts every tier in this process as `relay all` does, and
//! starts the simulator. Then, as a user would, it registers a tenant and its endpoints and
//! asks for the tenant's broker credentials through the control plane's API, and reads the
//! tenant's queue with them, rebuilding each copy from the change messages
//! ([`ReferenceConsumer`]) and acknowledging them as a real consumer does. Beside the feed
//! endpoints it registers one stories endpoint in `fetch_on_notify` mode: every event is then
//! followed by a read of the story, so the stories API's faults (stale reads, load balancer
//! 404s, 503s) meet the relay on every event and not only at catch-up and reloads. Once the
//! upstream has stopped changing and the relay has settled, the verdict: each endpoint's copy
//! read through the API, and each copy rebuilt from the queue, against the simulator's truth,
//! and the stories endpoint's notifications (each live strong story once).
//!
//! With `--backup-at-s` and `--restore-at-s` the relay loses its database mid-run and is brought
//! back from a backup as docs/restore.md tells an operator to: a `pg_dump` taken while every tier
//! works, then later every tier stopped, the dump restored into a fresh database
//! (`relay_demo_<run>_restored`), `relay restored`, the tiers started on it at the same addresses,
//! and each feed endpoint rewound through the API; the verdict is the restored relay's, and a
//! consumer of the queue must follow it across the restore's new epochs.
//!
//! Progress goes to stderr; stdout carries JSON lines (`started`, `restored`, `verdict`, and with
//! `--keep` `explore`), for scripts. Without `--keep` everything it made is removed at the end: the
//! tenant's broker user and queues, and the database. Ctrl-C or SIGTERM ends it early, every
//! tier stopped as `relay all` stops them, and it exits 0 with no verdict.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{IsTerminal as _, Write as _};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Args;
use rand::RngCore as _;
use relay_publisher::lapin::options::BasicAckOptions;
use relay_publisher::{redact, Interruption, QueueFollower, QueueReader, ReferenceConsumer};
use relay_simulator::cli::SimulateArgs;
use relay_simulator::stories::CopyRow;
use relay_simulator::{
    Faults, Simulation, Stories, StoriesConfig, StoriesEndpointInfo, StoriesWorkload,
    StoriesWorkloadConfig,
};
use serde_json::{json, Value};
use sqlx::migrate::MigrateDatabase as _;
use sqlx::Postgres;
use uuid::Uuid;

use crate::cli::{AllArgs, GlobalArgs};
use crate::startup::{shutdown_signal, AllTiers};

/// Upstream seconds per real second: an upstream hour of retries and backoffs in a second, as
/// the end-to-end tests run it.
const TIME_COMPRESSION: f64 = 3600.0;
/// Looks in a row that find the relay settled before the verdict is taken.
const SETTLED_LOOKS: u32 = 3;
/// How long the tokens the demo mints (and prints with `--keep`) live.
const TOKEN_TTL_S: u64 = 7 * 24 * 3600;
/// How the stories endpoint applies its events (see the module's comment for why this one).
const STORIES_MODE: &str = "fetch_on_notify";

/// Run every tier and the simulated upstream with faults on this machine, and check the copies.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub all: AllArgs,
    /// Seconds the simulated upstream keeps changing its feed.
    #[arg(long, default_value_t = 30)]
    pub duration_s: u64,
    /// Webhook endpoints, all of one tenant.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=50))]
    pub endpoints: u16,
    /// Feed changes per second.
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    /// Story changes per second (creations, updates, strong stories, closes, merges), over
    /// the same `--duration-s`.
    #[arg(long, default_value_t = 5.0)]
    pub stories_rate: f64,
    /// What goes wrong upstream: `all`, `none`, or `name=probability,...` (as `relay simulate
    /// --faults`: duplicates, old messages redelivered, rewinds, slow and stale reads, load
    /// balancer 404s, resets and access changes mid-reload, refetches, expired cursors).
    #[arg(long, default_value = "all")]
    pub faults: String,
    /// Seeds every random choice of the simulator: the same seed plays the same upstream.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Seconds the relay may take to settle once the upstream has stopped changing.
    #[arg(long, default_value_t = 180)]
    pub settle_timeout_s: u64,
    /// After the verdict, leave everything running for you to explore (the API, the queue,
    /// `relay tail`, the metrics) until Ctrl-C, and keep the database afterwards.
    #[arg(long)]
    pub keep: bool,
    /// Leave the tenant's queue to a consumer of your own (a client library's test, say): the
    /// `started` line carries the tenant's token and broker URL, the verdict compares the
    /// copies read through the API and the claimed notifications with the simulator's truth
    /// (the queue is yours to compare), and after the verdict every tier keeps running until
    /// SIGTERM, so your consumer can finish and read the API; then what the demo made is
    /// removed, unless `--keep`.
    #[arg(long)]
    pub external_consumer: bool,
    /// Back up the relay's database (`pg_dump`) this many seconds into the run, while every
    /// tier works, to restore it at `--restore-at-s`.
    #[arg(long, requires = "restore_at_s")]
    pub backup_at_s: Option<u64>,
    /// This many seconds into the run (at most `--duration-s`) the relay loses its database and
    /// is restored from the backup as docs/restore.md tells an operator to: every tier stops,
    /// the backup goes into a fresh database (`pg_restore`, then `relay restored`), the tiers
    /// start on it at the same addresses, and each feed endpoint's track is rewound through the
    /// API. The verdict is then the restored relay's; a `restored` line on stdout says what was
    /// done. Needs PostgreSQL's client tools (`pg_dump`, `pg_restore`) of the server's version.
    #[arg(long, requires = "backup_at_s")]
    pub restore_at_s: Option<u64>,
}

impl DemoArgs {
    /// When to back up and when to restore, in the run's time, if asked.
    fn restore_plan(&self) -> anyhow::Result<Option<RestorePlan>> {
        match (self.backup_at_s, self.restore_at_s) {
            (Some(backup_at), Some(restore_at)) => {
                if backup_at >= restore_at || restore_at > self.duration_s {
                    bail!(
                        "--backup-at-s ({backup_at}) must come before --restore-at-s \
                         ({restore_at}), and the restore within --duration-s ({})",
                        self.duration_s
                    );
                }
                Ok(Some(RestorePlan {
                    backup_at: Duration::from_secs(backup_at),
                    restore_at: Duration::from_secs(restore_at),
                }))
            }
            _ => Ok(None),
        }
    }
}

/// When, in the run's time, the demo backs the relay's database up and restores it.
#[derive(Debug, Clone, Copy)]
struct RestorePlan {
    backup_at: Duration,
    restore_at: Duration,
}

/// The relay the demo runs: its tiers (none between a stop and the start after a restore) and
/// the databases it made, the first and the restored one, all dropped at the end.
struct DemoRelay {
    tiers: Option<AllTiers>,
    /// RELAY_DATABASE_URL's server, without a database.
    server_url: String,
    databases: Vec<String>,
}

impl DemoRelay {
    fn tiers(&self) -> anyhow::Result<&AllTiers> {
        self.tiers
            .as_ref()
            .context("the relay's tiers are not running (a restore failed)")
    }
}

/// What the demo registered, as the API answered.
struct Registered {
    tenant: Uuid,
    operator_token: String,
    tenant_token: String,
    endpoints: Vec<Uuid>,
    stories_endpoint: Uuid,
    /// When the relay registered the stories endpoint: it notifies only of events since.
    stories_registered_at: time::OffsetDateTime,
    queue: String,
    /// The tenant's broker URL with its password: what its consumer connects with.
    tenant_amqp_url: String,
}

/// The control plane at `base_url`, called as a user's script would.
struct ApiClient {
    http: reqwest::Client,
    base_url: String,
    /// The control plane's answers a read rode through: a refused or lost connection, or a
    /// 429, 502 or 503, each asked again after a pause.
    interruptions: Mutex<Vec<ApiInterruption>>,
}

/// A read of the control plane that failed for a while before it was answered.
#[derive(Debug, Clone, serde::Serialize)]
struct ApiInterruption {
    request: String,
    /// The first failure, as the connection or the answer said it.
    cause: String,
    tries: u32,
    /// How long until answered, in seconds.
    away_s: f64,
}

/// How long a read of the control plane keeps being asked again while it cannot be answered
/// (a restart of Postgres or of the control plane takes seconds), before the demo gives up.
const API_PATIENCE: Duration = Duration::from_secs(120);

/// The pauses before a read is asked again: a quarter second, doubling to 5 s, with jitter.
const API_RETRY: relay_netguard::RetryPolicy = relay_netguard::RetryPolicy {
    first: Duration::from_millis(250),
    max: Duration::from_secs(5),
};

impl Registered {
    /// The feed endpoints, then the stories endpoint.
    fn all_endpoints(&self) -> impl Iterator<Item = &Uuid> {
        self.endpoints
            .iter()
            .chain(std::iter::once(&self.stories_endpoint))
    }
}

impl ApiClient {
    /// `method path` with `token`; the answer's JSON when it is a 2xx.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        // A read changes nothing: asked again while the control plane cannot answer it. A
        // write is asked once: only an answer says whether it was done.
        let read = method == reqwest::Method::GET;
        let started = Instant::now();
        let mut pauses = API_RETRY.pauses();
        let mut failures: Vec<String> = Vec::new();
        loop {
            let mut request = self
                .http
                .request(method.clone(), format!("{}{path}", self.base_url))
                .bearer_auth(token);
            if let Some(body) = &body {
                request = request.json(body);
            }
            let failure = match request.send().await {
                Ok(answer) => {
                    let status = answer.status();
                    let text = answer.text().await?;
                    if status.is_success() {
                        if let Some(first) = failures.first() {
                            let away_s = started.elapsed().as_secs_f64();
                            eprintln!("relay demo: {method} {path} answered after {away_s:.1} s");
                            self.interruptions.lock().unwrap().push(ApiInterruption {
                                request: format!("{method} {path}"),
                                cause: first.clone(),
                                tries: failures.len() as u32 + 1,
                                away_s,
                            });
                        }
                        return Ok(serde_json::from_str(&text).unwrap_or(Value::Null));
                    }
                    let passing = matches!(status.as_u16(), 429 | 502 | 503);
                    if !(read && passing) {
                        bail!("{method} {path} answered {status}: {text}");
                    }
                    format!("{status}: {text}")
                }
                Err(error) if read && (error.is_connect() || error.is_request()) => {
                    format!("{error:#}")
                }
                Err(error) => {
                    return Err(anyhow::Error::from(error).context(format!("{method} {path}")))
                }
            };
            if started.elapsed() >= API_PATIENCE {
                bail!(
                    "{method} {path} failed for {} s ({} tries; last: {failure})",
                    API_PATIENCE.as_secs(),
                    failures.len() + 1
                );
            }
            let wait = pauses.next().unwrap_or(API_RETRY.max);
            eprintln!(
                "relay demo: {method} {path}: {failure}; asking again in {:.1} s",
                wait.as_secs_f64()
            );
            failures.push(failure);
            tokio::time::sleep(wait).await;
        }
    }

    async fn register(
        &self,
        operator_token: String,
        simulator_api: &str,
        infos: &[relay_simulator::EndpointInfo],
        stories: &StoriesEndpointInfo,
    ) -> anyhow::Result<Registered> {
        use reqwest::Method;
        let tenant = self
            .call(
                Method::POST,
                "/v1/tenants",
                &operator_token,
                Some(json!({"name": "relay demo"})),
            )
            .await?;
        let tenant: Uuid = tenant["id"].as_str().context("a tenant id")?.parse()?;
        let minted = self
            .call(
                Method::POST,
                &format!("/v1/tenants/{tenant}/tokens"),
                &operator_token,
                Some(json!({"ttl_s": TOKEN_TTL_S})),
            )
            .await?;
        let tenant_token = minted["token"].as_str().context("a token")?.to_owned();
        for info in infos {
            self.call(
                Method::POST,
                "/v1/endpoints",
                &tenant_token,
                Some(json!({
                    "id": info.id,
                    "lang": info.lang,
                    "upstream_base_url": simulator_api,
                    "upstream_api_key": info.key_token,
                    "secrets": info.secrets,
                })),
            )
            .await?;
        }
        let stories_endpoint = self
            .call(
                Method::POST,
                "/v1/endpoints",
                &tenant_token,
                Some(json!({
                    "id": stories.id,
                    "source": "stories",
                    "tickers": stories.tickers,
                    "stories_mode": STORIES_MODE,
                    "upstream_base_url": simulator_api,
                    "upstream_api_key": stories.api_key,
                    "secrets": stories.secrets,
                })),
            )
            .await?;
        let stories_registered_at = time::OffsetDateTime::parse(
            stories_endpoint["created_at"]
                .as_str()
                .context("a created_at")?,
            &time::format_description::well_known::Rfc3339,
        )?;
        let credentials = self
            .call(Method::POST, "/v1/broker/credentials", &tenant_token, None)
            .await
            .context(
                "the control plane makes tenants' broker users through RabbitMQ's management \
                 API: is its plugin on (`rabbitmq-plugins enable rabbitmq_management`)?",
            )?;
        let password = credentials["password"].as_str().context("a password")?;
        let url = credentials["amqp_url"].as_str().context("an amqp_url")?;
        let (scheme, rest) = url.split_once("://").context("amqp_url's scheme")?;
        let (user, rest) = rest.split_once('@').context("amqp_url's user")?;
        Ok(Registered {
            tenant,
            operator_token,
            tenant_token,
            endpoints: infos.iter().map(|info| info.id).collect(),
            stories_endpoint: stories.id,
            stories_registered_at,
            queue: credentials["queue"].as_str().context("a queue")?.to_owned(),
            tenant_amqp_url: format!("{scheme}://{user}:{password}@{rest}"),
        })
    }

    /// The endpoint's copy, page by page: subject → (sequence, item), tombstones left out.
    async fn copy(
        &self,
        token: &str,
        endpoint: Uuid,
    ) -> anyhow::Result<BTreeMap<String, (String, Value)>> {
        let path = format!("/v1/endpoints/{endpoint}/copy");
        let mut items = BTreeMap::new();
        for row in self.pages(token, &path, &[]).await? {
            if row["tombstone"] == true {
                continue;
            }
            let subject = row["subject"].as_str().context("a subject")?.to_owned();
            let sequence = row["sequence"].as_str().unwrap_or_default().to_owned();
            items.insert(subject, (sequence, row["item"].clone()));
        }
        Ok(items)
    }

    /// Every page of `path` (a list answering `data` and `next_cursor`), with `query`.
    async fn pages(
        &self,
        token: &str,
        path: &str,
        query: &[(&str, &str)],
    ) -> anyhow::Result<Vec<Value>> {
        let mut rows = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let mut request = self
                .http
                .get(format!("{}{path}", self.base_url))
                .bearer_auth(token)
                .query(&[("limit", "500")])
                .query(query);
            if let Some(after) = &after {
                request = request.query(&[("after", after)]);
            }
            let page: Value = request.send().await?.error_for_status()?.json().await?;
            rows.extend(
                page["data"]
                    .as_array()
                    .with_context(|| format!("a page of {path}"))?
                    .iter()
                    .cloned(),
            );
            match page["next_cursor"].as_str() {
                Some(cursor) => after = Some(cursor.to_owned()),
                None => return Ok(rows),
            }
        }
    }

    /// The stories endpoint's copy, open and closed rows, as the oracle compares it.
    async fn stories(
        &self,
        token: &str,
        endpoint: Uuid,
    ) -> anyhow::Result<BTreeMap<String, CopyRow>> {
        let path = format!("/v1/endpoints/{endpoint}/stories");
        let mut rows = BTreeMap::new();
        for row in self
            .pages(token, &path, &[("include_closed", "true")])
            .await?
        {
            let id = row["id"].as_str().context("a story id")?.to_owned();
            rows.insert(
                id,
                CopyRow {
                    ticker: row["ticker"].as_str().map(str::to_owned),
                    version: row["version"].as_u64().context("a story version")?,
                    closed: row["closed"] == true,
                    story: row.get("story").cloned(),
                },
            );
        }
        Ok(rows)
    }

    /// The stories the endpoint claimed a notification for (keys `strong:<story id>`).
    async fn notifications(&self, token: &str, endpoint: Uuid) -> anyhow::Result<Vec<String>> {
        let path = format!("/v1/endpoints/{endpoint}/notifications");
        self.pages(token, &path, &[])
            .await?
            .iter()
            .map(|row| {
                let key = row["key"].as_str().context("a notification key")?;
                Ok(key.strip_prefix("strong:").unwrap_or(key).to_owned())
            })
            .collect()
    }

    async fn state(&self, token: &str, endpoint: Uuid) -> anyhow::Result<Value> {
        self.call(
            reqwest::Method::GET,
            &format!("/v1/endpoints/{endpoint}/state"),
            token,
            None,
        )
        .await
    }

    /// `POST /v1/endpoints/{id}/tracks/feed/rewind`, again while the upstream fails it (502)
    /// or the tenant's rewinds are all in flight (429): the answer.
    async fn rewind(&self, token: &str, endpoint: Uuid) -> anyhow::Result<Value> {
        let path = format!("/v1/endpoints/{endpoint}/tracks/feed/rewind");
        let mut tries = 0;
        loop {
            tries += 1;
            let answer = self
                .http
                .post(format!("{}{path}", self.base_url))
                .bearer_auth(token)
                .send()
                .await
                .with_context(|| format!("POST {path}"))?;
            let status = answer.status();
            let text = answer.text().await?;
            if status.is_success() {
                return serde_json::from_str(&text)
                    .with_context(|| format!("POST {path} answered {text}"));
            }
            let again = status == reqwest::StatusCode::BAD_GATEWAY
                || status == reqwest::StatusCode::TOO_MANY_REQUESTS;
            if !again || tries >= REWIND_TRIES {
                bail!("POST {path} answered {status} ({tries} tries): {text}");
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

/// RELAY_DATABASE_URL with its database replaced by `database`.
fn with_database(url: &str, database: &str) -> anyhow::Result<String> {
    let mut parsed = reqwest::Url::parse(url).context("RELAY_DATABASE_URL is not a URL")?;
    parsed.set_path(&format!("/{database}"));
    Ok(parsed.into())
}

/// The sum of every series of the metric family `name` (counters and gauges), over the
/// registries of every start of the tiers (the first, and the one after a restore).
fn metric_sum(registries: &[prometheus::Registry], name: &str) -> f64 {
    registries
        .iter()
        .flat_map(prometheus::Registry::gather)
        .filter(|family| family.name() == name)
        .map(|family| {
            family
                .get_metric()
                .iter()
                .map(|metric| metric.get_counter().get_value() + metric.get_gauge().get_value())
                .sum::<f64>()
        })
        .sum()
}

/// The series of `name` whose label `label` is `value`, over `registries` as [`metric_sum`].
fn metric_with(registries: &[prometheus::Registry], name: &str, label: &str, value: &str) -> f64 {
    registries
        .iter()
        .flat_map(prometheus::Registry::gather)
        .filter(|family| family.name() == name)
        .map(|family| {
            family
                .get_metric()
                .iter()
                .filter(|metric| {
                    metric
                        .get_label()
                        .iter()
                        .any(|pair| pair.name() == label && pair.value() == value)
                })
                .map(|metric| metric.get_counter().get_value())
                .sum::<f64>()
        })
        .sum()
}

/// Reads the tenant's queue with its credentials into `consumer`, acknowledging each message
/// once applied, until `stop` is sent; across losses of the broker (a restart, a connection
/// closed), which it reconnects after and returns. A refusal of its credentials or its queue
/// ends it with the cause.
async fn consume(
    url: String,
    queue: String,
    trust: relay_netguard::TrustRoots,
    consumer: Arc<Mutex<ReferenceConsumer>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<Vec<Interruption>> {
    let reader = QueueReader {
        url: &url,
        name: "relay demo",
        tag: "relay-demo",
        prefetch: 500,
    };
    let mut follower = QueueFollower::new(reader, &queue, &trust);
    loop {
        let delivery = tokio::select! {
            _ = stop.changed() => break,
            next = follower.next() => match next.context("reading the queue")? {
                None => bail!("the broker ended the consumer"),
                Some(delivery) => delivery,
            },
        };
        let received = consumer
            .lock()
            .unwrap()
            .receive_body_with(&delivery.data, &mut |_| {});
        if let Err(error) = received {
            tracing::warn!(%error, "not a change message; skipped");
        }
        // A delivery whose ack is lost with the connection comes again, and is dropped as a
        // repeat: the consumer carries on.
        if let Err(error) = delivery.ack(BasicAckOptions::default()).await {
            tracing::info!(%error, "an acknowledgement was lost with the connection");
        }
    }
    let interruptions = std::mem::take(&mut follower.interruptions);
    follower.close("demo done").await;
    Ok(interruptions)
}

/// One endpoint's verdict line.
#[derive(Debug, serde::Serialize)]
struct EndpointVerdict {
    webhook_endpoint_id: Uuid,
    /// Items the simulator says the copy must hold.
    expected_items: usize,
    /// `"equal"`, or what differs.
    api_copy: String,
    queue_copy: String,
    messages_sent: usize,
    last_change_seq: i64,
}

/// The stories endpoint's verdict line.
#[derive(Debug, serde::Serialize)]
struct StoriesVerdict {
    webhook_endpoint_id: Uuid,
    stories_mode: &'static str,
    /// Open stories the simulator says the copy must hold (closed ones aside).
    expected_open: usize,
    /// `"equal"`, or what differs (as the oracle compares copies).
    api_copy: String,
    queue_copy: String,
    /// Stories that became strong live, each to be notified once.
    expected_notifications: usize,
    /// `"equal"`, or what differs: the claims read through the API, the notifications read
    /// from the queue.
    api_notifications: String,
    queue_notifications: String,
    /// Webhooks the relay answered 2xx, duplicates included.
    events_delivered: usize,
}

impl StoriesVerdict {
    fn ok(&self) -> bool {
        [
            &self.api_copy,
            &self.queue_copy,
            &self.api_notifications,
            &self.queue_notifications,
        ]
        .iter()
        .all(|v| agrees(v))
    }
}

/// What a verdict says of the queue when an external consumer reads it.
const NOT_READ: &str = "not read: an external consumer reads the queue";

fn not_read() -> String {
    NOT_READ.to_owned()
}

/// Whether a verdict's comparison holds: equal, or left to an external consumer.
fn agrees(comparison: &str) -> bool {
    comparison == "equal" || comparison == NOT_READ
}

/// The oracle's differences, in a few words: `"equal"`, or how many and the first.
fn story_difference(found: &[String]) -> String {
    match found {
        [] => "equal".to_owned(),
        [first, ..] => format!("{} differ, first {first}", found.len()),
    }
}

/// Notifications against the oracle's, each story once: `"equal"`, or what differs.
fn notification_difference(
    notified: &BTreeMap<String, u64>,
    expected: &BTreeSet<String>,
) -> String {
    let missing = expected
        .iter()
        .filter(|s| !notified.contains_key(*s))
        .count();
    let extra = notified.keys().filter(|s| !expected.contains(*s)).count();
    let repeated = notified.values().filter(|&&n| n > 1).count();
    if missing + extra + repeated == 0 {
        "equal".to_owned()
    } else {
        format!("{missing} missing, {extra} not owed, {repeated} more than once")
    }
}

/// What differs between a copy and the truth, in a few words; `"equal"` when nothing does.
fn difference<V: PartialEq>(copy: &BTreeMap<String, V>, truth: &BTreeMap<String, V>) -> String {
    let missing = truth.keys().filter(|s| !copy.contains_key(*s)).count();
    let extra = copy.keys().filter(|s| !truth.contains_key(*s)).count();
    let differing = truth
        .iter()
        .filter(|(s, v)| copy.get(*s).is_some_and(|c| c != *v))
        .count();
    if missing + extra + differing == 0 {
        "equal".to_owned()
    } else {
        format!("{missing} missing, {extra} extra, {differing} differing")
    }
}

/// The simulator's truth for `endpoint`: subject → (sequence, item).
fn truth(sim: &Simulation, endpoint: Uuid) -> BTreeMap<String, (String, Value)> {
    sim.lock()
        .expected_copy(endpoint)
        .into_iter()
        .map(|(subject, (sequence, item))| (subject, (sequence.as_str().to_owned(), item)))
        .collect()
}

fn without_positions(items: &BTreeMap<String, (String, Value)>) -> BTreeMap<String, Value> {
    items
        .iter()
        .map(|(subject, (_, item))| (subject.clone(), item.clone()))
        .collect()
}

/// Progress figures, from the tiers' metrics and the endpoints' state.
struct Progress {
    received: f64,
    duplicates: f64,
    applied: f64,
    published: f64,
    from_queue: u64,
    waiting: i64,
    unpublished: i64,
    lag_s: f64,
    reloads: f64,
    reloading: usize,
    stories_received: usize,
    story_writes: f64,
    notifications: f64,
    notifications_from_queue: u64,
}

impl Progress {
    fn line(&self, elapsed: Duration, phase: &str) -> String {
        format!(
            "{:>4}s {phase:<9} received {:.0} (duplicates {:.0}) | applied {:.0} | published {:.0} \
             | read from queue {} | waiting {} | unpublished {} | lag {:.1}s | reloads {:.0} ({} running) \
             | stories: received {} | written {:.0} | notified {:.0} (read from queue {})",
            elapsed.as_secs(),
            self.received,
            self.duplicates,
            self.applied,
            self.published,
            self.from_queue,
            self.waiting,
            self.unpublished,
            self.lag_s,
            self.reloads,
            self.reloading,
            self.stories_received,
            self.story_writes,
            self.notifications,
            self.notifications_from_queue,
        )
    }
}

/// Everything running, for the look at progress and the verdict.
struct Running<'a> {
    /// The tiers' metrics: of their first start, and of their start after a restore.
    registries: Vec<prometheus::Registry>,
    api: &'a ApiClient,
    registered: &'a Registered,
    sim: &'a Simulation,
    /// The demo's own reader of the queue; `None` with `--external-consumer`.
    consumer: Option<&'a Mutex<ReferenceConsumer>>,
}

impl Running<'_> {
    async fn progress(&self) -> anyhow::Result<Progress> {
        let registry = &self.registries[..];
        // Taken apart from the literal below: its temporaries' guards live to its end.
        let queue_stats = self
            .consumer
            .map(|consumer| consumer.lock().unwrap().stats())
            .unwrap_or_default();
        let stories_received = self
            .sim
            .stories()
            .delivered(self.registered.stories_endpoint)
            .len();
        let mut progress = Progress {
            received: metric_sum(registry, "relay_ingest_messages_total"),
            duplicates: metric_with(
                registry,
                "relay_ingest_messages_total",
                "outcome",
                "duplicate",
            ),
            applied: metric_sum(registry, "relay_sequencer_messages_total"),
            published: metric_sum(registry, "relay_publisher_messages_confirmed_total"),
            from_queue: queue_stats.messages,
            waiting: 0,
            unpublished: 0,
            lag_s: 0.0,
            reloads: metric_with(
                registry,
                "relay_sequencer_reloads_total",
                "outcome",
                "started",
            ),
            reloading: 0,
            stories_received,
            story_writes: metric_sum(registry, "relay_sequencer_story_writes_total"),
            notifications: metric_sum(registry, "relay_sequencer_stories_notifications_total"),
            notifications_from_queue: queue_stats.notifications,
        };
        for &endpoint in self.registered.all_endpoints() {
            let state = self
                .api
                .state(&self.registered.tenant_token, endpoint)
                .await?;
            progress.waiting += state["messages_waiting"].as_i64().unwrap_or(0);
            progress.unpublished += state["outbox_backlog"].as_i64().unwrap_or(0);
            progress.lag_s = progress
                .lag_s
                .max(state["apply_lag_s"].as_f64().unwrap_or(0.0));
            progress.reloading += usize::from(state["reload_running"] == true);
        }
        Ok(progress)
    }

    /// Whether the upstream is idle, nothing is left to apply, reload or publish, and every
    /// copy (through the API and from the queue) is the truth.
    async fn settled(&self, progress: &Progress) -> anyhow::Result<bool> {
        if !self.sim.wait_idle(Duration::from_millis(10)).await
            || progress.waiting > 0
            || progress.unpublished > 0
            || progress.reloading > 0
        {
            return Ok(false);
        }
        for &endpoint in &self.registered.endpoints {
            let truth = truth(self.sim, endpoint);
            if self
                .api
                .copy(&self.registered.tenant_token, endpoint)
                .await?
                != truth
            {
                return Ok(false);
            }
            if let Some(consumer) = self.consumer {
                if consumer.lock().unwrap().items(endpoint) != without_positions(&truth) {
                    return Ok(false);
                }
            }
        }
        Ok(self.stories_verdict().await?.ok())
    }

    /// The stories endpoint's copy and notifications, through the API and from the queue,
    /// against the simulator's oracle.
    async fn stories_verdict(&self) -> anyhow::Result<StoriesVerdict> {
        let (token, endpoint) = (
            &self.registered.tenant_token,
            self.registered.stories_endpoint,
        );
        let api_copy = self.api.stories(token, endpoint).await?;
        let mut api_notified = BTreeMap::new();
        for story in self.api.notifications(token, endpoint).await? {
            *api_notified.entry(story).or_insert(0) += 1;
        }
        let queue = self.consumer.map(|consumer| {
            let consumer = consumer.lock().unwrap();
            let rows = consumer
                .stories(endpoint)
                .into_iter()
                .map(|(id, row)| {
                    let row = CopyRow {
                        ticker: row.ticker,
                        version: row.version,
                        closed: row.closed,
                        story: row.story,
                    };
                    (id, row)
                })
                .collect();
            let notified = consumer.notification_counts(endpoint);
            (rows, notified)
        });
        let stories = self.sim.stories();
        let expected = stories.expected_notifications(endpoint);
        Ok(StoriesVerdict {
            webhook_endpoint_id: endpoint,
            stories_mode: STORIES_MODE,
            expected_open: stories
                .expected_stories(endpoint)
                .values()
                .filter(|story| !story.closed)
                .count(),
            api_copy: story_difference(&stories.compare_copy(endpoint, &api_copy)),
            queue_copy: queue.as_ref().map_or_else(not_read, |(copy, _)| {
                story_difference(&stories.compare_copy(endpoint, copy))
            }),
            expected_notifications: expected.len(),
            api_notifications: notification_difference(&api_notified, &expected),
            queue_notifications: queue.as_ref().map_or_else(not_read, |(_, notified)| {
                notification_difference(notified, &expected)
            }),
            events_delivered: stories.delivered(endpoint).len(),
        })
    }

    async fn verdict(&self) -> anyhow::Result<Vec<EndpointVerdict>> {
        let mut verdicts = Vec::new();
        for &endpoint in &self.registered.endpoints {
            let truth = truth(self.sim, endpoint);
            let api_copy = self
                .api
                .copy(&self.registered.tenant_token, endpoint)
                .await?;
            let queue_copy = self
                .consumer
                .map(|consumer| consumer.lock().unwrap().items(endpoint));
            let state = self
                .api
                .state(&self.registered.tenant_token, endpoint)
                .await?;
            verdicts.push(EndpointVerdict {
                webhook_endpoint_id: endpoint,
                expected_items: truth.len(),
                api_copy: difference(&api_copy, &truth),
                queue_copy: queue_copy.map_or_else(not_read, |copy| {
                    difference(&copy, &without_positions(&truth))
                }),
                messages_sent: self.sim.lock().sent_bodies(endpoint).len(),
                last_change_seq: state["last_change_seq"].as_i64().unwrap_or(0),
            });
        }
        Ok(verdicts)
    }
}

/// Prints `progress` on stderr: over the same line on a terminal, a line every few seconds
/// otherwise.
struct Reporter {
    terminal: bool,
    last_line: Instant,
}

impl Reporter {
    fn show(&mut self, line: &str, force: bool) {
        let mut stderr = std::io::stderr().lock();
        if self.terminal {
            let _ = write!(stderr, "\r\x1b[2K{line}");
            if force {
                let _ = writeln!(stderr);
            }
        } else if force || self.last_line.elapsed() >= Duration::from_secs(5) {
            let _ = writeln!(stderr, "{line}");
            self.last_line = Instant::now();
        }
        let _ = stderr.flush();
    }
}

fn print_line(value: &Value) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{value}");
    let _ = stdout.flush();
}

/// `relay demo`.
pub async fn run(global: &GlobalArgs, args: DemoArgs) -> anyhow::Result<()> {
    let mut run_id = [0u8; 4];
    rand::thread_rng().fill_bytes(&mut run_id);
    let run_id = hex::encode(run_id);
    let mut global = global.clone();
    let server_url = global.database_url.clone();
    let database = format!("relay_demo_{run_id}");
    global.database_url = with_database(&server_url, &database)?;
    global.redis_key_prefix = format!("{}demo:{run_id}:", global.redis_key_prefix);
    // The demo's database is its own: without the operator's keys, its secrets are sealed
    // under a key made for the run (it restores its own backup with it too).
    if global.seal.seal_keys_file.is_none() && global.seal.seal_keys.is_none() {
        global.seal.seal_keys = Some(relay_seal::LocalKeys::generate_entry("demo")?);
    }
    // The simulated upstream is plain http on 127.0.0.1, which the relay refuses by default.
    global.outbound.upstream_allow_http = true;
    global.outbound.upstream_allow_private = true;
    crate::commands::migrate(&global).await?;

    let mut all = args.all.clone();
    let mut key = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut key);
    all.api.jwt.jwt_secret = Some(hex::encode(key));
    all.api.jwt.jwt_secret_file = None;
    let restore_plan = args.restore_plan()?;
    let mut relay = DemoRelay {
        tiers: Some(AllTiers::start(&global, &all).await?),
        server_url: server_url.clone(),
        databases: vec![database.clone()],
    };
    let outcome = demonstrate(&global, &all, &args, restore_plan, &mut relay).await;
    let remove = match &outcome {
        Ok(demonstrated) if !args.keep => Some(&demonstrated.registered),
        _ => None,
    };
    let credentials_removed = match remove {
        Some(registered) => match relay.tiers() {
            Ok(tiers) => remove_broker_user(tiers, registered).await,
            Err(error) => Err(error),
        },
        None => Ok(()),
    };
    if let Some(tiers) = relay.tiers.take() {
        tiers.stop(None).await?;
    }
    // Only once the publisher has stopped: a queue deleted under its confirms makes the broker
    // close its connection with INTERNAL_ERROR.
    let cleanup = match remove {
        Some(registered) => match credentials_removed {
            Ok(()) => remove_queues(&global, &all, registered).await,
            Err(error) => Err(error),
        },
        None => Ok(()),
    };
    if args.keep {
        for database in &relay.databases {
            eprintln!(
                "kept the database {database}; drop it with: psql {} -c 'DROP DATABASE {database}'",
                redact(&server_url)
            );
        }
    } else {
        for database in &relay.databases {
            drop_database(&global, &server_url, database).await?;
        }
        if let Err(error) = &cleanup {
            eprintln!("could not remove the demo tenant's broker user and queues: {error:#}");
        }
    }
    let outcome = outcome?;
    if !outcome.ok && !outcome.interrupted {
        bail!("the copies are not the simulator's truth (the verdict line says how)");
    }
    Ok(())
}

/// What the demo did: whom it registered, and whether the verdict was right.
struct Demonstrated {
    registered: Registered,
    ok: bool,
    /// Ctrl-C or SIGTERM came before the verdict: not a failure, the user asked to stop.
    interrupted: bool,
}

/// The demo once the tiers run: register, run the upstream, settle, take the verdict.
async fn demonstrate(
    global: &GlobalArgs,
    all: &AllArgs,
    args: &DemoArgs,
    restore_plan: Option<RestorePlan>,
    relay: &mut DemoRelay,
) -> anyhow::Result<Demonstrated> {
    let tiers = relay.tiers()?;
    let api_address = tiers
        .api
        .as_ref()
        .context("the control plane did not start")?
        .address;
    let ingest_address = loopback(tiers.ingest.address);
    let metrics_url = format!("http://{}/metrics", loopback(tiers.ingest.metrics_address));
    let api = ApiClient {
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?,
        base_url: format!("http://{}", loopback(api_address)),
        interruptions: Mutex::new(Vec::new()),
    };

    let simulate = SimulateArgs {
        receiver_url: format!("http://{ingest_address}"),
        endpoints: usize::from(args.endpoints),
        keys: 1,
        seed: args.seed,
        rate: args.rate,
        duration_s: args.duration_s,
        faults: args.faults.clone(),
        time_compression: TIME_COMPRESSION,
        listen: "127.0.0.1:0".to_owned(),
        select_all: true,
        print_endpoints: false,
        quiet: true,
    };
    let (upstream, workload, infos) = relay_simulator::cli::prepare(&simulate)?;
    let faults: Faults = args.faults.parse().context("--faults")?;
    // The upstream's time starts at the wall clock's now, as the relay's registration does.
    let stories_config = StoriesConfig {
        start_unix_ms: (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64,
        ..StoriesConfig::from_wire_limits(TIME_COMPRESSION)
    };
    let mut stories = Stories::new(stories_config, faults.stories, args.seed);
    let mut stories_workload = StoriesWorkload::new(
        args.seed,
        StoriesWorkloadConfig {
            endpoints: 1,
            ..StoriesWorkloadConfig::default()
        },
    );
    let stories_info = stories_workload
        .setup(
            &mut stories,
            &relay_simulator::cli::url_template(&simulate.receiver_url),
        )
        .pop()
        .context("the stories workload made no endpoint")?;
    let sim = Simulation::with_stories(
        upstream,
        stories,
        relay_simulator::cli::send_timeout(TIME_COMPRESSION),
    );
    let simulator_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let simulator_api = format!(
        "http://{}",
        relay_simulator::api::serve(simulator_listener, sim.clone()).await?
    );

    let operator_token = relay_api::issue_token(&relay_api::TokenArgs {
        operator: true,
        tenant: None,
        name: "relay demo".to_owned(),
        ttl_s: TOKEN_TTL_S,
        jwt: all.api.jwt.clone(),
    })?
    .token;
    let registered = api
        .register(operator_token, &simulator_api, &infos, &stories_info)
        .await?;
    sim.stories().set_registered_at(
        registered.stories_endpoint,
        registered.stories_registered_at,
    );
    print_line(&json!({
        "event": "started",
        "database_url": redact(&global.database_url),
        "ingest_url": format!("http://{ingest_address}"),
        "api_base_url": api.base_url,
        "simulator_api_url": simulator_api,
        "metrics_url": metrics_url,
        "tenant_id": registered.tenant,
        "queue": registered.queue,
        "webhook_endpoint_ids": registered.endpoints,
        "stories_endpoint_id": registered.stories_endpoint,
        "stories_mode": STORIES_MODE,
        "faults": args.faults,
        "seed": args.seed,
        "external_consumer": args.external_consumer,
    }));
    if args.external_consumer {
        print_line(&json!({
            "event": "credentials",
            "tenant_id": registered.tenant,
            "tenant_token": registered.tenant_token,
            "operator_token": registered.operator_token,
            "queue": registered.queue,
            "tenant_amqp_url": registered.tenant_amqp_url,
        }));
    }
    eprintln!(
        "relay demo: every tier is running; tenant {} has {} feed endpoints and a stories \
         endpoint ({STORIES_MODE}, tickers {}); the simulated upstream changes its feed and its \
         stories for {} s with faults `{}`",
        registered.tenant,
        args.endpoints,
        stories_info.tickers.join(", "),
        args.duration_s,
        args.faults
    );

    let consumer = Arc::new(Mutex::new(ReferenceConsumer::new(registered.tenant)));
    let (stop_consumer, consumer_stop) = tokio::sync::watch::channel(false);
    let mut consuming = if args.external_consumer {
        tokio::spawn(std::future::pending::<anyhow::Result<Vec<Interruption>>>())
    } else {
        tokio::spawn(consume(
            registered.tenant_amqp_url.clone(),
            registered.queue.clone(),
            global.trust()?,
            consumer.clone(),
            consumer_stop,
        ))
    };
    let mut senders = sim.spawn_senders();
    senders.push(sim.spawn_stories_sender());
    let duration = Duration::from_secs(args.duration_s);
    let feed_changes = sim.clone().run_workload(workload, args.rate, duration);
    let story_changes =
        sim.clone()
            .run_stories_workload(stories_workload, args.stories_rate, duration);
    let mut workload = tokio::spawn(async move { tokio::join!(feed_changes, story_changes) });

    let mut running = Running {
        registries: vec![tiers.registry.clone()],
        api: &api,
        registered: &registered,
        sim: &sim,
        consumer: (!args.external_consumer).then_some(&*consumer),
    };
    let mut reporter = Reporter {
        terminal: std::io::stderr().is_terminal(),
        last_line: Instant::now(),
    };
    let started = Instant::now();
    let mut changes_done = None;
    let mut settle_started = None;
    let mut settled_looks = 0;
    let settle_limit = Duration::from_secs(args.settle_timeout_s);
    // Ctrl-C or SIGTERM ends the run early, and what it made is still removed.
    let interrupt = shutdown_signal();
    tokio::pin!(interrupt);
    let mut interrupted = false;
    let mut backup = None;
    let mut restore_pending = restore_plan.is_some();
    let settled = loop {
        tokio::select! {
            () = &mut interrupt => {
                interrupted = true;
                eprintln!();
                break None;
            }
            steps = &mut workload, if changes_done.is_none() => {
                changes_done = Some(steps.context("the workload task")?);
                settle_started = Some(Instant::now());
            }
            ended = &mut consuming => {
                ended.context("the consumer task")??;
                bail!("the consumer stopped");
            }
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        if let Some(plan) = restore_plan.filter(|_| restore_pending) {
            if backup.is_none() && started.elapsed() >= plan.backup_at {
                backup = Some(back_up(&global.database_url).await?);
                reporter.show(
                    &format!(
                        "{:>4}s backed the relay's database up ({} bytes)",
                        started.elapsed().as_secs(),
                        backup.as_ref().map_or(0, Vec::len)
                    ),
                    true,
                );
            }
            if let Some(archive) = backup
                .as_deref()
                .filter(|_| started.elapsed() >= plan.restore_at)
            {
                reporter.show(
                    &format!(
                        "{:>4}s the relay loses its database: stopping every tier to restore the backup",
                        started.elapsed().as_secs()
                    ),
                    true,
                );
                let restored = restore(global, all, relay, archive, &api, &registered).await?;
                running.registries.push(relay.tiers()?.registry.clone());
                restore_pending = false;
                reporter.show(
                    &format!(
                        "{:>4}s restored into {} and rewound every feed endpoint: {}",
                        started.elapsed().as_secs(),
                        restored.database,
                        restored.summary()
                    ),
                    true,
                );
                print_line(&restored.line(plan));
            }
        }
        let progress = running.progress().await?;
        let phase = if changes_done.is_some() {
            "settling"
        } else {
            "changing"
        };
        reporter.show(&progress.line(started.elapsed(), phase), false);
        if let Some(since) = settle_started.filter(|_| !restore_pending) {
            settled_looks = if running.settled(&progress).await? {
                settled_looks + 1
            } else {
                0
            };
            if settled_looks >= SETTLED_LOOKS {
                reporter.show(&progress.line(started.elapsed(), "settled"), true);
                break Some(since.elapsed());
            }
            if since.elapsed() > settle_limit {
                reporter.show(&progress.line(started.elapsed(), "unsettled"), true);
                break None;
            }
        }
    };

    let verdicts = running.verdict().await?;
    let stories_verdict = running.stories_verdict().await?;
    let ok = settled.is_some()
        && stories_verdict.ok()
        && verdicts
            .iter()
            .all(|v| agrees(&v.api_copy) && agrees(&v.queue_copy));
    let stats = (!args.external_consumer).then(|| consumer.lock().unwrap().stats());
    print_line(&json!({
        "event": "verdict",
        "ok": ok,
        "interrupted": interrupted,
        "settled_in_s": settled.map(|d| d.as_secs_f64()),
        "feed_changes": changes_done.map(|(feed, _)| feed),
        "story_changes": changes_done.map(|(_, stories)| stories),
        "endpoints": verdicts,
        "stories_endpoint": stories_verdict,
        "queue_consumer": stats,
    }));
    for verdict in &verdicts {
        eprintln!(
            "endpoint {}: {} items; copy through the API: {}; copy rebuilt from the queue: {}",
            verdict.webhook_endpoint_id,
            verdict.expected_items,
            verdict.api_copy,
            verdict.queue_copy
        );
    }
    eprintln!(
        "stories endpoint {}: {} open stories, {} to notify; copy through the API: {}; copy \
         rebuilt from the queue: {}; notifications claimed: {}; notifications from the queue: {}",
        stories_verdict.webhook_endpoint_id,
        stories_verdict.expected_open,
        stories_verdict.expected_notifications,
        stories_verdict.api_copy,
        stories_verdict.queue_copy,
        stories_verdict.api_notifications,
        stories_verdict.queue_notifications,
    );
    eprintln!(
        "verdict: {}",
        if ok && args.external_consumer {
            "every copy read through the API is the simulator's truth, and each strong story \
             was claimed once; the queue is the external consumer's to check"
        } else if ok {
            "every copy, and every copy rebuilt from the tenant's queue, is the simulator's \
             truth, and each strong story was notified once"
        } else if interrupted {
            "none: interrupted before the relay settled"
        } else if settled.is_none() {
            "the relay did not settle in time (see the last progress line)"
        } else {
            "a copy differs from the simulator's truth"
        }
    );

    if args.keep && !interrupted {
        explore(all, &api, &registered, &metrics_url);
    }
    if (args.keep || args.external_consumer) && !interrupted {
        shutdown_signal().await;
    }
    let _ = stop_consumer.send(true);
    let broker_interruptions = if args.external_consumer {
        consuming.abort();
        Vec::new()
    } else {
        match tokio::time::timeout(Duration::from_secs(5), consuming).await {
            Ok(ended) => ended.context("the consumer task")??,
            Err(_) => Vec::new(),
        }
    };
    let api_interruptions = api.interruptions.lock().unwrap().clone();
    print_line(&json!({
        "event": "interruptions",
        "broker": broker_interruptions,
        "api": api_interruptions,
    }));
    if !broker_interruptions.is_empty() || !api_interruptions.is_empty() {
        eprintln!(
            "relay demo: rode through {} loss(es) of the broker by its consumer and {} read(s) \
             of the control plane asked again",
            broker_interruptions.len(),
            api_interruptions.len()
        );
    }
    sim.shutdown();
    for sender in senders {
        let _ = sender.await;
    }
    Ok(Demonstrated {
        registered,
        ok,
        interrupted,
    })
}

/// Tries of one endpoint's rewind while the upstream fails it (502: its API's faults) or the
/// tenant's rewinds are all in flight (429), a second apart.
const REWIND_TRIES: u32 = 30;

/// A custom-format `pg_dump` of the database at `database_url`: one consistent snapshot taken
/// while every tier writes, as docs/restore.md's backup.
async fn back_up(database_url: &str) -> anyhow::Result<Vec<u8>> {
    let output = tokio::process::Command::new("pg_dump")
        .args(["--format=custom", "--dbname", database_url])
        .kill_on_drop(true)
        .output()
        .await
        .context("running pg_dump (PostgreSQL's client tools) for --backup-at-s")?;
    if !output.status.success() {
        bail!(
            "pg_dump failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(output.stdout)
}

/// What a restore did: the database restored into, `relay restored`'s line of each endpoint,
/// and each feed endpoint's rewind as the API answered it.
struct Restored {
    database: String,
    database_url: String,
    marked: Vec<Value>,
    rewinds: BTreeMap<Uuid, Value>,
}

impl Restored {
    /// Each rewind's outcome and how many there were of it, for the progress line.
    fn summary(&self) -> String {
        let mut outcomes = BTreeMap::<String, usize>::new();
        for answer in self.rewinds.values() {
            let outcome = answer["outcome"].as_str().unwrap_or("unknown").to_owned();
            *outcomes.entry(outcome).or_default() += 1;
        }
        outcomes
            .iter()
            .map(|(outcome, n)| format!("{n} {outcome}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The `restored` line on stdout.
    fn line(&self, plan: RestorePlan) -> Value {
        json!({
            "event": "restored",
            "backup_at_s": plan.backup_at.as_secs(),
            "restore_at_s": plan.restore_at.as_secs(),
            "database_url": redact(&self.database_url),
            "endpoints": self.marked,
            "rewinds": self.rewinds,
        })
    }
}

/// docs/restore.md's steps, on the running demo: stops every tier, restores `archive` into a
/// fresh database, marks it restored (`relay restored`), starts the tiers on it at the addresses
/// the first ones had (the upstream's URLs and the API's name them), and rewinds each feed
/// endpoint's track through the API. A stories endpoint needs no rewind: its worker catches up
/// from the cursor the backup kept.
async fn restore(
    global: &GlobalArgs,
    all: &AllArgs,
    relay: &mut DemoRelay,
    archive: &[u8],
    api: &ApiClient,
    registered: &Registered,
) -> anyhow::Result<Restored> {
    let old = relay
        .tiers
        .take()
        .context("the relay's tiers are not running")?;
    let mut same_addresses = all.clone();
    same_addresses.ingest.listen = old.ingest.address;
    same_addresses.ingest.metrics_listen = old.ingest.metrics_address;
    if let Some(api_server) = &old.api {
        same_addresses.api.api_listen = api_server.address;
    }
    old.stop(None)
        .await
        .context("stopping the tiers for the restore")?;

    let database = format!("{}_restored", relay.databases[0]);
    let mut restored_global = global.clone();
    restored_global.database_url = with_database(&relay.server_url, &database)?;
    Postgres::create_database(&restored_global.database_url)
        .await
        .with_context(|| format!("creating {database}"))?;
    relay.databases.push(database.clone());
    pg_restore(&restored_global.database_url, archive).await?;
    crate::commands::migrate(&restored_global).await?;
    let pool = crate::commands::admin_pool(&restored_global)?;
    let mut lines = Vec::new();
    let marked = crate::commands::mark_restored(&pool, &mut lines).await;
    pool.close().await;
    marked?;
    let marked: Vec<Value> = lines
        .split(|&b| b == b'\n')
        .filter(|line| !line.is_empty())
        .map(serde_json::from_slice)
        .collect::<Result<_, _>>()
        .context("reading relay restored's lines")?;

    relay.tiers = Some(
        AllTiers::start(&restored_global, &same_addresses)
            .await
            .context("starting the tiers on the restored database at the first tiers' addresses")?,
    );
    let mut rewinds = BTreeMap::new();
    for &endpoint in &registered.endpoints {
        rewinds.insert(
            endpoint,
            api.rewind(&registered.tenant_token, endpoint).await?,
        );
    }
    Ok(Restored {
        database,
        database_url: restored_global.database_url,
        marked,
        rewinds,
    })
}

/// `pg_restore` of `archive` into the empty database at `database_url`, as an operator runs it.
async fn pg_restore(database_url: &str, archive: &[u8]) -> anyhow::Result<()> {
    let mut child = tokio::process::Command::new("pg_restore")
        .args(["--exit-on-error", "--no-owner", "--dbname", database_url])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("running pg_restore (PostgreSQL's client tools) for --restore-at-s")?;
    let mut stdin = child.stdin.take().context("pg_restore's stdin")?;
    let archive = archive.to_vec();
    // Written while pg_restore reads: one that stops early says why in its output.
    let writer = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt as _;
        let _ = stdin.write_all(&archive).await;
    });
    let output = child.wait_with_output().await?;
    let _ = writer.await;
    if !output.status.success() {
        bail!(
            "pg_restore failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// With `--keep`: how to look around, on stdout as JSON and on stderr in words.
fn explore(all: &AllArgs, api: &ApiClient, registered: &Registered, metrics_url: &str) {
    let tail = format!(
        "relay tail --tenant {} --amqp-url '{}'",
        registered.tenant, registered.tenant_amqp_url
    );
    print_line(&json!({
        "event": "explore",
        "api_base_url": api.base_url,
        "console_url": format!("{}/console/", api.base_url),
        "operator_token": registered.operator_token,
        "tenant_id": registered.tenant,
        "tenant_token": registered.tenant_token,
        "queue": registered.queue,
        "tenant_amqp_url": registered.tenant_amqp_url,
        "tail_command": tail,
        "metrics_url": metrics_url,
        "relay_amqp_url": redact(&all.publisher.amqp_url),
    }));
    eprintln!(
        "\nStill running (Ctrl-C ends it). To look around:\n  \
         open {}/console/ and sign in with the tenant token (or the operator token):\n  \
         export TOKEN={}\n  \
         curl -s -H \"Authorization: Bearer $TOKEN\" {}/v1/endpoints\n  \
         curl -s -H \"Authorization: Bearer $TOKEN\" {}/v1/endpoints/{}/copy?limit=5\n  \
         curl -s -H \"Authorization: Bearer $TOKEN\" {}/v1/endpoints/{}/state\n  \
         {tail}   # the queue is empty once read: a new change shows up here\n  \
         curl -s {metrics_url} | grep ^relay_",
        api.base_url,
        registered.tenant_token,
        api.base_url,
        api.base_url,
        registered.endpoints[0],
        api.base_url,
        registered.endpoints[0],
    );
}

/// The address to reach a listener on: 127.0.0.1 when it listens on every interface.
fn loopback(address: SocketAddr) -> SocketAddr {
    if address.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], address.port()))
    } else {
        address
    }
}

/// The tenant's broker user, through the API as a tenant would remove it.
async fn remove_broker_user(tiers: &AllTiers, registered: &Registered) -> anyhow::Result<()> {
    let api_address = tiers.api.as_ref().context("no control plane")?.address;
    let api = ApiClient {
        http: reqwest::Client::new(),
        base_url: format!("http://{}", loopback(api_address)),
        interruptions: Mutex::new(Vec::new()),
    };
    api.call(
        reqwest::Method::DELETE,
        "/v1/broker/credentials",
        &registered.tenant_token,
        None,
    )
    .await?;
    Ok(())
}

/// The tenant's queues, through the management API: the publisher has stopped and no one else
/// reads them.
async fn remove_queues(
    global: &GlobalArgs,
    all: &AllArgs,
    registered: &Registered,
) -> anyhow::Result<()> {
    let mut api_args = all.api.clone();
    api_args.relay_amqp_url = all.publisher.amqp_url.clone();
    let config = api_args.to_config(
        global.outbound.policy(),
        global.trust()?,
        global.seal.keyring()?,
    )?;
    let management = reqwest::Client::builder()
        .use_preconfigured_tls(global.trust()?.client_config())
        .timeout(Duration::from_secs(10))
        .build()?;
    config
        .broker
        .delete_queues(&management, relay_store::TenantId(registered.tenant))
        .await?;
    Ok(())
}

/// Drops the demo's database, ending what connections are left.
async fn drop_database(
    global: &GlobalArgs,
    server_url: &str,
    database: &str,
) -> anyhow::Result<()> {
    let mut admin = global.clone();
    admin.database_url = with_database(server_url, "postgres")?;
    let pool = crate::commands::admin_pool(&admin)?;
    sqlx::query(&format!(
        "DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"
    ))
    .execute(&pool)
    .await
    .with_context(|| format!("dropping {database}"))?;
    pool.close().await;
    Ok(())
}
