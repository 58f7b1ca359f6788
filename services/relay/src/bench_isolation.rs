//! `relay bench isolation`: what tenant A's attacks cost tenant B (issues 23 and 38).
//!
//! One process runs the front tier and the sequencer against a fresh database. Tenant B (the
//! loadgen's tenant, sending from 127.0.0.1) sends signed feed messages at a fixed rate for the
//! whole run; the run is cut into phases that alternate quiet (B alone) and attacked, one class of
//! attack a phase ([`AttackClass`]). Every attacker sends from a loopback address of its own, so
//! the listener's bounds per client meet the attacker and never B. For each kind of phase the
//! bench measures B's answer latency (the loadgen's samples, placed by when each was due), B's
//! apply lag (received to applied, from the rows themselves) and the process's peak resident
//! memory (VmRSS, sampled every 100 ms). The figures compared come from the same minutes of the
//! same machine, so their ratio is what an attack costs, however the machine's speed drifts.
//!
//! The attacks are the bench's own versions of what tests/it/hostile_tenant.rs and
//! tests/it/ingest_envelope.rs drive; the binary calls no test code.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use relay_sequencer::{Sequencer, SequencerConfig, SequencerMetrics};
use relay_store::endpoints::{self, NewEndpoint};
use relay_store::quotas::{self, QuotaOverrides};
use relay_store::{tenants, TenantId};
use relay_wire::{Sequence, SigningSecret};
use serde_json::{json, Value};
use sqlx::PgPool;
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::cli::{GlobalArgs, SequencerArgs};
use crate::loadgen::Sample;

#[derive(Debug, Args)]
pub struct IsolationBenchArgs {
    /// Drop and create RELAY_DATABASE_URL's database first (required: the bench needs it empty).
    #[arg(long)]
    pub recreate_database: bool,
    /// The classes of attack, each its own attacked phase, in this order in every round.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "poison,bodies,hogs,pages,flood"
    )]
    pub attacks: Vec<AttackClass>,
    /// Tenant B's messages per second, all phases.
    #[arg(long, default_value_t = 200.0)]
    pub rate: f64,
    /// Tenant B's endpoints.
    #[arg(long, default_value_t = 100)]
    pub endpoints: usize,
    /// Tenant A's endpoints: sent poison in turn; half read an endless page and half a poisoned
    /// one in `pages`; flooded in turn in `flood`.
    #[arg(long, default_value_t = 20)]
    pub attacker_endpoints: usize,
    /// `poison`: tenant A's signed hostile messages per second.
    #[arg(long, default_value_t = 50.0)]
    pub attack_rate: f64,
    /// `poison`: connections a stranger holds open on the ingest port, each sending one header
    /// byte a second.
    #[arg(long, default_value_t = 300)]
    pub slow_connections: usize,
    /// `bodies`: a stranger's connections, each sending a 1 MiB body one byte short, and again
    /// (at most once a second) when the relay has ended it.
    #[arg(long, default_value_t = 300)]
    pub short_bodies: usize,
    /// `hogs`: a stranger's kept-alive connections, each sending an unsigned request for one of
    /// A's endpoints a second (answered 401, the connection kept).
    #[arg(long, default_value_t = 1200)]
    pub hogs: usize,
    /// Tenant A's quota of messages per second (above `--attack-rate`, so that its poison is
    /// let in).
    #[arg(long, default_value_t = 100)]
    pub attacker_quota: u32,
    /// `flood`: tenant A's signed good messages per second.
    #[arg(long, default_value_t = 1000.0)]
    pub flood_rate: f64,
    /// Seconds in each phase.
    #[arg(long, default_value_t = 10)]
    pub phase_s: u64,
    /// Seconds after each `pages` phase, counted in no phase's latencies, for A's reloads to
    /// read good pages and merge before the next quiet phase.
    #[arg(long, default_value_t = 10)]
    pub settle_s: u64,
    /// Rounds: each is a quiet phase before every class's attacked phase.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    #[command(flatten)]
    pub sequencer: SequencerArgs,
}

/// A class of attack: each is an attacked phase of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum AttackClass {
    /// A's signed hostile messages (issue 23), and a stranger's slow request heads.
    Poison,
    /// A stranger's 1 MiB bodies, each one byte short, to one of A's endpoints.
    Bodies,
    /// A stranger's many kept-alive connections sending cheap requests for A's endpoint.
    Hogs,
    /// A's upstream answering its endpoints' reloads with an endless page and a poisoned one.
    Pages,
    /// A's good messages many times faster than its quota.
    Flood,
}

impl AttackClass {
    fn label(self) -> &'static str {
        match self {
            AttackClass::Poison => "poison",
            AttackClass::Bodies => "bodies",
            AttackClass::Hogs => "hogs",
            AttackClass::Pages => "pages",
            AttackClass::Flood => "flood",
        }
    }
}

/// A phase of the run: B alone, or B under one class of attack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum PhaseKind {
    Quiet,
    Attacked(AttackClass),
}

impl PhaseKind {
    fn label(self) -> &'static str {
        match self {
            PhaseKind::Quiet => "quiet",
            PhaseKind::Attacked(class) => class.label(),
        }
    }
}

/// Where each party sends from: B's loadgen from 127.0.0.1 (the default source towards
/// 127.0.0.1), everyone else from an address of its own, as the hostile-tenant test has them.
const STRANGER_SLOW: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3));
const STRANGER_BODIES: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 4));
const STRANGER_HOGS: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 5));
const A_SENDER: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 7));
/// Where A's upstream API listens (the bench serves it).
const A_UPSTREAM: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));

/// A's endpoints' API keys: A's upstream answers a reload by the key it is read with.
const ENDLESS_KEY: &str = "a-endless";
const POISONED_KEY: &str = "a-poisoned";
/// The access_version of A's copies, its messages and its upstream's good pages: one value, so
/// that none of A's messages asks for a reload by its access_version alone.
const A_ACCESS_VERSION: &str = "attack1";

/// B's load before the first phase (connections opened, caches warm), measured in no phase.
const LEAD_IN: Duration = Duration::from_secs(2);
/// The resident memory read before B's load starts: the idle figure.
const IDLE: Duration = Duration::from_secs(1);
const MIB: usize = 1024 * 1024;

/// Counters of what an attacker saw, by label.
type Counts = BTreeMap<String, u64>;

fn count(counts: &mut Counts, label: impl Into<String>, n: u64) {
    *counts.entry(label.into()).or_default() += n;
}

fn merge(into: &mut Counts, from: Counts) {
    for (label, n) in from {
        count(into, label, n);
    }
}

/// Awaits every task's counts and adds them up.
async fn collect(tasks: Vec<JoinHandle<Counts>>) -> Counts {
    let mut counts = Counts::new();
    for task in tasks {
        match task.await {
            Ok(each) => merge(&mut counts, each),
            Err(_) => count(&mut counts, "attacker_task_failed", 1),
        }
    }
    counts
}

/// The hostile messages tenant A sends in `poison`, in turn: each is genuine (signed with A's
/// own secret), and each once failed or wedged more than A's own stream.
#[derive(Debug, Clone, Copy)]
enum Poison {
    /// A NUL in `track`: once failed every message sharing its ingest batch.
    NulTrack,
    /// A NUL in an event id: once failed its endpoint's applies for ever.
    NulEventId,
    /// A body that is no v1 message: once answered 400, so resent for a day.
    Unparseable,
    /// A v1 field in a shape v1 does not have (an unknown `data.type` on an update).
    UnknownDataType,
}

const POISONS: [Poison; 4] = [
    Poison::NulTrack,
    Poison::NulEventId,
    Poison::Unparseable,
    Poison::UnknownDataType,
];

impl Poison {
    fn label(self) -> &'static str {
        match self {
            Poison::NulTrack => "nul_track",
            Poison::NulEventId => "nul_event_id",
            Poison::Unparseable => "unparseable",
            Poison::UnknownDataType => "unknown_data_type",
        }
    }

    /// The message, at A's current `generation`: one of an older generation would be ignored
    /// before its poison is met, once a `pages` phase has raised it.
    fn body(self, endpoint: Uuid, n: u64, generation: u64) -> String {
        let event = |id: &str, data: &str| {
            format!(
                r#"{{"id":"{id}","type":"announcement.updated","source":"https://api.quanor.com/v1/feed","specversion":"1.0","subject":"announcement:{n}","sequence":"1.{n}","data":{data}}}"#
            )
        };
        let item = format!(
            r#"{{"type":"item","feed_item_id":"announcement:{n}","seq":{n},"first_seq":{n},"item_kind":"announcement","lang":"en","op":"new","changes":[],"parts":[]}}"#
        );
        let message = |track: &str, generation: &str, events: &str| {
            format!(
                r#"{{"v":1,"webhook_endpoint_id":"{endpoint}","track":"{track}","generation":{generation},"access_version":"{A_ACCESS_VERSION}","since":"1.{n}","through":"1.{n}","events":{events}}}"#
            )
        };
        let generation = generation.to_string();
        match self {
            Poison::NulTrack => message("feed\\u0000x", &generation, "[]"),
            Poison::NulEventId => message(
                "feed",
                &generation,
                &format!("[{}]", event(&format!("evt_{n}\\u0000x"), &item)),
            ),
            Poison::Unparseable => message("feed", "\"one\"", "{}"),
            Poison::UnknownDataType => message(
                "feed",
                &generation,
                &format!(
                    "[{}]",
                    event(
                        &format!("evt_{:026x}", rand::random::<u128>()),
                        r#"{"type":"hologram","feed_item_id":"announcement:1"}"#
                    )
                ),
            ),
        }
    }
}

/// A good message of one event for A's endpoint (the flood's), at A's current generation and
/// access_version, so that those let in are applied as any tenant's would be.
fn good_message(endpoint: Uuid, n: u64, generation: u64) -> String {
    let sequence = Sequence::from_parts(1, n);
    let sequence = sequence.as_str();
    let event_id = format!("evt_{:026x}", rand::random::<u128>());
    format!(
        concat!(
            r#"{{"v":1,"webhook_endpoint_id":"{endpoint}","track":"feed","#,
            r#""generation":{generation},"access_version":"{access}","since":"1.{n}","#,
            r#""through":"1.{n}","complete":true,"events":[{{"id":"{event_id}","#,
            r#""type":"announcement.updated","source":"https://api.quanor.com/v1/feed","#,
            r#""specversion":"1.0","datacontenttype":"application/json","#,
            r#""subject":"announcement:{n}","sequence":"{sequence}","data":{{"type":"item","#,
            r#""feed_item_id":"announcement:{n}","seq":{n},"first_seq":{n},"#,
            r#""item_kind":"announcement","lang":"en","op":"new","changes":[],"parts":[]}}}}]}}"#
        ),
        endpoint = endpoint,
        generation = generation,
        access = A_ACCESS_VERSION,
        n = n,
        event_id = event_id,
        sequence = sequence,
    )
}

/// A `webhook_endpoint.reset` of `generation` for A's endpoint, shaped as the wire file's
/// example: applied, it begins a reload from A's upstream.
fn reset_message(endpoint: Uuid, generation: u64) -> String {
    json!({
        "v": 1, "webhook_endpoint_id": endpoint, "track": "feed", "generation": generation,
        "access_version": A_ACCESS_VERSION,
        "events": [{
            "id": format!("evt_{:026x}", rand::random::<u128>()),
            "type": "webhook_endpoint.reset",
            "source": "https://api.quanor.com/v1/webhook-endpoints", "specversion": "1.0",
            "datacontenttype": "application/json",
            "data": {"access_version": A_ACCESS_VERSION, "generation": generation,
                     "reason": "access_changed", "resume_from": "1.1", "track": "feed"},
        }],
    })
    .to_string()
}

/// A's upstream API, served by the bench. Good by default: an empty feed under A's
/// access_version. While hostile (`pages`), `/v1/feed` read with [`ENDLESS_KEY`] is a page that
/// never ends, and with [`POISONED_KEY`] a page whose subject holds a control character. The
/// reads of each kind are counted.
#[derive(Clone)]
struct HostileUpstream(Arc<UpstreamState>);

struct UpstreamState {
    hostile: AtomicBool,
    /// A's feed track's generation: raised by each `pages` phase's resets, and what the
    /// endpoint view reports.
    generation: AtomicU64,
    endless_reads: AtomicU64,
    poisoned_reads: AtomicU64,
    good_reads: AtomicU64,
}

impl HostileUpstream {
    fn new() -> Self {
        Self(Arc::new(UpstreamState {
            hostile: AtomicBool::new(false),
            generation: AtomicU64::new(1),
            endless_reads: AtomicU64::new(0),
            poisoned_reads: AtomicU64::new(0),
            good_reads: AtomicU64::new(0),
        }))
    }

    fn generation(&self) -> u64 {
        self.0.generation.load(Ordering::SeqCst)
    }

    async fn serve(&self, host: IpAddr) -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
        use axum::routing::get;
        let listener = tokio::net::TcpListener::bind(SocketAddr::new(host, 0)).await?;
        let address = listener.local_addr()?;
        let (view, feed) = (self.clone(), self.clone());
        let router = axum::Router::new()
            .route(
                "/v1/webhook-endpoints/{id}",
                get(
                    move |axum::extract::Path(id): axum::extract::Path<String>| async move {
                        axum::Json(json!({
                            "id": id, "lang": "en", "status": "active", "filter": {},
                            "tracks": {"feed": {"generation": view.generation()}},
                        }))
                    },
                ),
            )
            .route(
                "/v1/feed",
                get(move |headers: axum::http::HeaderMap| {
                    let feed = feed.clone();
                    async move { feed.feed(&headers) }
                }),
            );
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Ok((address, task))
    }

    fn feed(&self, headers: &axum::http::HeaderMap) -> axum::response::Response {
        use axum::response::IntoResponse as _;
        let key = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let state = &self.0;
        if state.hostile.load(Ordering::SeqCst) && key.ends_with(ENDLESS_KEY) {
            state.endless_reads.fetch_add(1, Ordering::Relaxed);
            // A page that never ends, made as it is sent: this side holds one item.
            let head = futures::stream::once(async {
                Ok::<_, std::io::Error>(bytes::Bytes::from(format!(
                    r#"{{"access_version":"{A_ACCESS_VERSION}","has_more":false,"data":["#
                )))
            });
            let item = bytes::Bytes::from(format!(
                "{{\"subject\":\"announcement:1\",\"sequence\":\"{}\",\"item\":{{\"type\":\"item\",\
                 \"feed_item_id\":\"announcement:1\",\"seq\":1,\"item_kind\":\"announcement\",\
                 \"parts\":[],\"padding\":\"{}\"}}}},",
                Sequence::from_parts(1, 1).as_str(),
                "x".repeat(64 * 1024)
            ));
            let items = futures::stream::repeat_with(move || Ok(item.clone()));
            let body = axum::body::Body::from_stream(futures::StreamExt::chain(head, items));
            return ([("content-type", "application/json")], body).into_response();
        }
        if state.hostile.load(Ordering::SeqCst) && key.ends_with(POISONED_KEY) {
            state.poisoned_reads.fetch_add(1, Ordering::Relaxed);
            return axum::Json(json!({
                "access_version": A_ACCESS_VERSION, "has_more": false, "next_cursor": null,
                "data": [{"subject": "announcement:1\u{1}",
                          "sequence": Sequence::from_parts(1, 1).as_str(),
                          "item": {"type": "item", "feed_item_id": "announcement:1", "seq": 1,
                                   "item_kind": "announcement", "parts": []}}],
            }))
            .into_response();
        }
        state.good_reads.fetch_add(1, Ordering::Relaxed);
        axum::Json(
            json!({"access_version": A_ACCESS_VERSION, "data": [], "next_cursor": null,
                          "has_more": false}),
        )
        .into_response()
    }
}

/// The process's resident memory, read from /proc every `every` on a thread of its own, so
/// that a busy runtime does not thin out the samples when memory is likeliest to peak.
struct ResidentSampler {
    going: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(Instant, u64)>>,
}

impl ResidentSampler {
    fn start(every: Duration) -> Self {
        let going = Arc::new(AtomicBool::new(true));
        let still = going.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while still.load(Ordering::SeqCst) {
                if let Some(kib) = resident_kib() {
                    samples.push((Instant::now(), kib));
                }
                std::thread::sleep(every);
            }
            samples
        });
        Self { going, thread }
    }

    fn stop(self) -> Vec<(Instant, u64)> {
        self.going.store(false, Ordering::SeqCst);
        self.thread.join().unwrap_or_default()
    }
}

/// VmRSS of this process, in KiB (every tier the bench runs is in it).
fn resident_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|n| n.trim().parse().ok())
}

/// One phase as it ran: its kind, when it began and ended (by the monotonic clock, for B's
/// samples, and the wall clock, for the rows' timestamps), and until when its memory counts
/// (a `pages` phase's includes the settling after it).
struct Window {
    kind: PhaseKind,
    from: Instant,
    to: Instant,
    memory_to: Instant,
    from_at: OffsetDateTime,
    to_at: OffsetDateTime,
}

/// Everything an attacker needs: the relay's address, A's endpoints and upstream, a client
/// that sends from A's own address.
struct Attackers {
    relay: SocketAddr,
    pool: PgPool,
    tenant: Uuid,
    endpoints: Arc<Vec<(Uuid, SigningSecret)>>,
    upstream: HostileUpstream,
    a_client: reqwest::Client,
    /// Numbers A's messages' subjects, so each is new.
    next: AtomicU64,
}

impl Attackers {
    async fn phase(&self, class: AttackClass, args: &IsolationBenchArgs, ends: Instant) -> Counts {
        match class {
            AttackClass::Poison => self.poison(args, ends).await,
            AttackClass::Bodies => self.bodies(args, ends).await,
            AttackClass::Hogs => self.hogs(args, ends).await,
            AttackClass::Pages => self.pages(ends).await,
            AttackClass::Flood => self.flood(args, ends).await,
        }
    }

    /// Sends `body` signed with A's endpoint's secret from A's address; the answer's label.
    fn send(&self, endpoint: Uuid, secret: &SigningSecret, body: String) -> JoinHandle<String> {
        let webhook_id = format!("msg_{:032x}", rand::random::<u128>());
        let timestamp = OffsetDateTime::now_utc().unix_timestamp();
        let signature = relay_wire::sign(
            &webhook_id,
            timestamp,
            body.as_bytes(),
            std::slice::from_ref(secret),
        );
        let request = self
            .a_client
            .post(format!("http://{}/webhooks/{endpoint}", self.relay))
            .header("webhook-id", webhook_id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .header("content-type", "application/json")
            .body(body);
        tokio::spawn(async move {
            match request.send().await {
                Ok(answer)
                    if answer.status() == 429 && !answer.headers().contains_key("retry-after") =>
                {
                    "429 without retry-after".to_owned()
                }
                Ok(answer) => answer.status().as_u16().to_string(),
                Err(_) => "no_answer".to_owned(),
            }
        })
    }

    /// Sends `rate` of A's messages a second until `ends`, to A's endpoints in turn. `make` takes
    /// the endpoint, the message's place in the phase and its number among A's messages, and
    /// gives a label and the body: the answers are counted by label and status.
    async fn send_at_rate(
        &self,
        rate: f64,
        ends: Instant,
        make: impl Fn(Uuid, u64, u64) -> (String, String),
    ) -> Counts {
        let started = Instant::now();
        let interval = Duration::from_secs_f64(1.0 / rate.max(0.1));
        let mut sent: Vec<(String, JoinHandle<String>)> = Vec::new();
        for k in 0u32.. {
            // Due times, not sleeps of the interval: at 1,000 a second a sleep's granularity
            // (1 ms) would halve the rate.
            let due = started + interval * k;
            if due >= ends || self.endpoints.is_empty() {
                break;
            }
            tokio::time::sleep_until(due.into()).await;
            let (endpoint, secret) = &self.endpoints[k as usize % self.endpoints.len()];
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            let (label, body) = make(*endpoint, u64::from(k), n);
            sent.push((label, self.send(*endpoint, secret, body)));
        }
        let mut counts = Counts::new();
        count(&mut counts, "sent", sent.len() as u64);
        for (label, task) in sent {
            let answer = task.await.unwrap_or_else(|_| "no_answer".to_owned());
            let label = if label.is_empty() {
                answer
            } else {
                format!("{label} {answer}")
            };
            count(&mut counts, label, 1);
        }
        counts
    }

    /// A's hostile messages at `--attack-rate`, and a stranger's slow request heads.
    async fn poison(&self, args: &IsolationBenchArgs, ends: Instant) -> Counts {
        let relay = self.relay;
        let slow: Vec<_> = (0..args.slow_connections)
            .map(|_| {
                tokio::spawn(async move {
                    let give_up = ends.saturating_duration_since(Instant::now());
                    let end =
                        slow_connection(relay, STRANGER_SLOW, Duration::from_secs(1), give_up)
                            .await;
                    let label = match end {
                        SlowEnd::Refused => "slow refused_503",
                        SlowEnd::Closed => "slow closed_by_relay",
                        SlowEnd::StillOpen => "slow still_open_at_phase_end",
                    };
                    Counts::from([(label.to_owned(), 1)])
                })
            })
            .collect();
        let generation = self.upstream.generation();
        let mut counts = self
            .send_at_rate(args.attack_rate, ends, |endpoint, k, n| {
                let kind = POISONS[k as usize % POISONS.len()];
                (kind.label().to_owned(), kind.body(endpoint, n, generation))
            })
            .await;
        merge(&mut counts, collect(slow).await);
        counts
    }

    /// A stranger's 1 MiB bodies, each one byte short, to A's first endpoint; each connection
    /// opened again (at most once a second) when the relay has ended it.
    async fn bodies(&self, args: &IsolationBenchArgs, ends: Instant) -> Counts {
        let body = Arc::new(vec![b'x'; MIB]);
        let (relay, endpoint) = (self.relay, self.endpoints[0].0);
        let tasks = (0..args.short_bodies)
            .map(|_| {
                let body = body.clone();
                tokio::spawn(async move {
                    let mut counts = Counts::new();
                    while Instant::now() < ends {
                        let began = Instant::now();
                        let end = short_body(relay, STRANGER_BODIES, endpoint, &body, ends).await;
                        count(&mut counts, end.label(), 1);
                        tokio::time::sleep_until((began + Duration::from_secs(1)).min(ends).into())
                            .await;
                    }
                    counts
                })
            })
            .collect();
        collect(tasks).await
    }

    /// A stranger's kept-alive connections sending unsigned requests for A's second endpoint.
    async fn hogs(&self, args: &IsolationBenchArgs, ends: Instant) -> Counts {
        let endpoint = self.endpoints[1].0;
        let relay = self.relay;
        let tasks = (0..args.hogs)
            .map(|i| {
                // Opened over about a second: all at once, most would meet the bound on
                // connections without a head (256 per address), not the bound on a client's
                // connections this attack is about.
                let opens = Instant::now() + Duration::from_millis(i as u64);
                tokio::spawn(hog(relay, endpoint, opens, ends))
            })
            .collect();
        collect(tasks).await
    }

    /// Resets A's endpoints so that they reload, while A's upstream answers with an endless
    /// page (half of them) and a poisoned one (the other half).
    async fn pages(&self, ends: Instant) -> Counts {
        let state = &self.upstream.0;
        state.hostile.store(true, Ordering::SeqCst);
        let generation = state.generation.fetch_add(1, Ordering::SeqCst) + 1;
        let (endless, poisoned) = (
            state.endless_reads.load(Ordering::Relaxed),
            state.poisoned_reads.load(Ordering::Relaxed),
        );
        let resets: Vec<_> = self
            .endpoints
            .iter()
            .map(|(endpoint, secret)| {
                self.send(*endpoint, secret, reset_message(*endpoint, generation))
            })
            .collect();
        let mut counts = Counts::new();
        for reset in resets {
            let answer = reset.await.unwrap_or_else(|_| "no_answer".to_owned());
            count(&mut counts, format!("reset {answer}"), 1);
        }
        tokio::time::sleep_until(ends.into()).await;
        count(
            &mut counts,
            "feed_reads endless",
            state.endless_reads.load(Ordering::Relaxed) - endless,
        );
        count(
            &mut counts,
            "feed_reads poisoned",
            state.poisoned_reads.load(Ordering::Relaxed) - poisoned,
        );
        // What A's endpoints' state says at the phase's end: failing, and why.
        let failing: Vec<(String, i64)> = sqlx::query_as(
            "SELECT last_error_kind, count(*) FROM endpoint_upstream_status
             WHERE tenant_id = $1 AND failing_since IS NOT NULL GROUP BY 1",
        )
        .bind(self.tenant)
        .fetch_all(&self.pool)
        .await
        .unwrap_or_default();
        for (kind, n) in failing {
            count(
                &mut counts,
                format!("failing_at_phase_end {kind}"),
                n as u64,
            );
        }
        counts
    }

    /// After `pages`: A's upstream answers good pages again; waits until every one of A's
    /// reloads merged under the phase's generation, then until `until`. How long the merges
    /// took, or `None` if they had not all merged by `until`.
    async fn settle(&self, until: Instant) -> anyhow::Result<Option<Duration>> {
        self.upstream.0.hostile.store(false, Ordering::SeqCst);
        let generation = self.upstream.generation() as i64;
        let started = Instant::now();
        let mut merged = None;
        while Instant::now() < until {
            let (left,): (i64,) = sqlx::query_as(
                "SELECT count(*) FROM endpoint_tracks
                 WHERE tenant_id = $1 AND (reload IS NOT NULL OR generation IS DISTINCT FROM $2)",
            )
            .bind(self.tenant)
            .bind(generation)
            .fetch_one(&self.pool)
            .await?;
            if left == 0 {
                merged = Some(started.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep_until(until.into()).await;
        Ok(merged)
    }

    /// A's good messages at `--flood-rate`, many times its quota.
    async fn flood(&self, args: &IsolationBenchArgs, ends: Instant) -> Counts {
        let generation = self.upstream.generation();
        self.send_at_rate(args.flood_rate, ends, |endpoint, _, n| {
            (String::new(), good_message(endpoint, n, generation))
        })
        .await
    }
}

/// Connects to `to` from `from`, one of this machine's loopback addresses (all of 127/8 is), so
/// that each attacker is a client of its own.
async fn connect_from(to: SocketAddr, from: IpAddr) -> std::io::Result<TcpStream> {
    let socket = match from {
        IpAddr::V4(_) => TcpSocket::new_v4()?,
        IpAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.bind(SocketAddr::new(from, 0))?;
    socket.connect(to).await
}

/// How a connection that sent a body's head and all but its last byte ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ShortBody {
    /// Answered 503 `body_budget_spent`: refused before or while its body was read.
    BudgetSpent,
    /// Answered 503 `too_many_connections`: the client held as many connections as it may.
    TooManyConnections,
    /// Answered 408: its body was held until the body read timeout.
    TimedOut,
    /// Closed unanswered.
    Dropped,
    /// Still held by the relay when the phase ended (the stranger closed it then).
    HeldAtPhaseEnd,
    /// Answered anything else, or never connected.
    Other,
}

impl ShortBody {
    fn label(self) -> &'static str {
        match self {
            ShortBody::BudgetSpent => "503 body_budget_spent",
            ShortBody::TooManyConnections => "503 too_many_connections",
            ShortBody::TimedOut => "408 body read timeout",
            ShortBody::Dropped => "closed unanswered",
            ShortBody::HeldAtPhaseEnd => "held at phase end",
            ShortBody::Other => "other",
        }
    }
}

/// A body one byte short of the length its head announces, to `endpoint`, from `from`: the head,
/// then everything but the last byte, then a wait for the answer until `ends`.
async fn short_body(
    to: SocketAddr,
    from: IpAddr,
    endpoint: Uuid,
    body: &[u8],
    ends: Instant,
) -> ShortBody {
    let attempt = async {
        let Ok(mut stream) = connect_from(to, from).await else {
            return ShortBody::Other;
        };
        let head = format!(
            "POST /webhooks/{endpoint} HTTP/1.1\r\nhost: relay\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nwebhook-id: msg_short\r\nwebhook-timestamp: 1\r\n\
             webhook-signature: v1,AAAA\r\n\r\n",
            body.len()
        );
        if stream.write_all(head.as_bytes()).await.is_err() {
            return ShortBody::Other;
        }
        // A refused body is answered at once and the connection closed: the write fails then.
        let _ = stream.write_all(&body[..body.len() - 1]).await;
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer).await;
        let answer = String::from_utf8_lossy(&answer);
        if answer.is_empty() {
            ShortBody::Dropped
        } else if answer.starts_with("HTTP/1.1 503") && answer.contains("body_budget_spent") {
            ShortBody::BudgetSpent
        } else if answer.starts_with("HTTP/1.1 503") && answer.contains("too_many_connections") {
            ShortBody::TooManyConnections
        } else if answer.starts_with("HTTP/1.1 408") {
            ShortBody::TimedOut
        } else {
            ShortBody::Other
        }
    };
    tokio::time::timeout_at(ends.into(), attempt)
        .await
        .unwrap_or(ShortBody::HeldAtPhaseEnd)
}

/// One kept-alive connection of the hog's, opened at `opens`: sends an unsigned request for
/// `endpoint` (answered 401, the connection kept) a second until `ends`. Its answers by status,
/// and whether it was served or refused.
async fn hog(relay: SocketAddr, endpoint: Uuid, opens: Instant, ends: Instant) -> Counts {
    let mut counts = Counts::new();
    tokio::time::sleep_until(opens.into()).await;
    let Ok(mut stream) = connect_from(relay, STRANGER_HOGS).await else {
        count(&mut counts, "connections not connected", 1);
        return counts;
    };
    let request = format!(
        "POST /webhooks/{endpoint} HTTP/1.1\r\nhost: relay\r\ncontent-length: 2\r\n\r\n{{}}"
    );
    let mut served = false;
    let ended = loop {
        let sent = Instant::now();
        if sent >= ends {
            break "kept to phase end";
        }
        match tokio::time::timeout_at(ends.into(), keep_alive_exchange(&mut stream, &request)).await
        {
            Err(_) => break "kept to phase end",
            Ok(None) => break "closed by relay",
            Ok(Some((status, closed))) => {
                count(&mut counts, format!("answers {status}"), 1);
                served |= status == 401;
                if closed {
                    break "closed by relay";
                }
            }
        }
        tokio::time::sleep_until((sent + Duration::from_secs(1)).min(ends).into()).await;
    };
    count(&mut counts, format!("connections {ended}"), 1);
    let fate = if served { "served" } else { "refused" };
    count(&mut counts, format!("connections {fate}"), 1);
    counts
}

/// Sends a request on a kept-alive connection and reads one answer: its status and whether the
/// server closed the connection after it. `None`: no whole answer (the connection closed).
async fn keep_alive_exchange(stream: &mut TcpStream, request: &str) -> Option<(u16, bool)> {
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut answer = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        let read = stream.read(&mut buffer).await.ok()?;
        answer.extend_from_slice(&buffer[..read]);
        let text = String::from_utf8_lossy(&answer).to_ascii_lowercase();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|l| l.trim().parse().ok())
                .unwrap_or(0);
            if body.len() >= length || read == 0 {
                let status = head.split(' ').nth(1)?.parse().ok()?;
                return Some((status, head.contains("connection: close") || read == 0));
            }
        }
        if read == 0 {
            return None;
        }
    }
}

pub async fn run(global: &GlobalArgs, args: IsolationBenchArgs) -> anyhow::Result<()> {
    let mut classes: Vec<AttackClass> = Vec::new();
    for class in &args.attacks {
        if !classes.contains(class) {
            classes.push(*class);
        }
    }
    anyhow::ensure!(!classes.is_empty(), "--attacks names no class of attack");
    anyhow::ensure!(
        args.attacker_endpoints >= 2,
        "--attacker-endpoints: at least 2 (one reads the endless page, one the poisoned one)"
    );
    let schedule: Vec<PhaseKind> = (0..args.rounds)
        .flat_map(|_| {
            classes
                .iter()
                .flat_map(|class| [PhaseKind::Quiet, PhaseKind::Attacked(*class)])
        })
        .collect();
    let settles = schedule
        .iter()
        .filter(|kind| **kind == PhaseKind::Attacked(AttackClass::Pages))
        .count() as u64;
    let pool = crate::bench::fresh_database(global, args.recreate_database).await?;
    let loadgen = crate::loadgen::LoadgenArgs {
        url: String::new(),
        endpoints: args.endpoints,
        concurrency: 64,
        // Attacked phases end when their attackers have stopped, a little after their time:
        // one phase more of B's load than planned, counted in no phase, keeps the last one whole.
        duration_s: (schedule.len() as u64 + 1) * args.phase_s + settles * args.settle_s,
        warmup_s: LEAD_IN.as_secs(),
        rate: args.rate,
        body_bytes: 1024,
        provision: false,
        seed: 1,
    };
    let victim = crate::bench::provision_in_sync(global, &pool, &loadgen).await?;

    // Tenant A: its endpoints in sync under its access_version and reading its own upstream,
    // its quota of messages per second set low.
    let upstream = HostileUpstream::new();
    let (upstream_address, upstream_task) = upstream.serve(A_UPSTREAM).await?;
    let attacker_tenant = Uuid::new_v4();
    tenants::create(&pool, attacker_tenant, "attacker").await?;
    quotas::set_overrides(
        &pool,
        TenantId(attacker_tenant),
        &QuotaOverrides {
            messages_per_second: Some(args.attacker_quota),
            ..QuotaOverrides::default()
        },
    )
    .await?;
    let keys = global.seal.keyring()?;
    let mut attacker = Vec::with_capacity(args.attacker_endpoints);
    for i in 0..args.attacker_endpoints {
        let id = Uuid::new_v4();
        let secret = SigningSecret::from_bytes(rand::random::<[u8; 32]>().to_vec())?;
        let key = if i % 2 == 0 {
            ENDLESS_KEY
        } else {
            POISONED_KEY
        };
        endpoints::create(
            &pool,
            &keys,
            &NewEndpoint {
                id,
                tenant_id: attacker_tenant,
                secret: secret.clone(),
                upstream_base_url: Some(format!("http://{upstream_address}")),
                upstream_api_key: Some(relay_store::SecretText::new(key)),
            },
        )
        .await?;
        attacker.push((id, secret));
    }
    sqlx::query(
        "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id, generation, access_version)
         SELECT id, 'feed', tenant_id, 1, $2 FROM webhook_endpoints WHERE tenant_id = $1",
    )
    .bind(attacker_tenant)
    .bind(A_ACCESS_VERSION)
    .execute(&pool)
    .await?;

    let registry = prometheus::Registry::new();
    let prefix = format!("relay-bench-{}:", Uuid::new_v4().simple());
    let sequencer = Sequencer::start(
        crate::startup::sequencer_pool(global)?,
        SequencerConfig {
            key_prefix: prefix.clone(),
            // A's endpoints read the bench's own upstream, on this machine.
            outbound: relay_netguard::OutboundPolicy::ANY,
            ..args.sequencer.to_config(global)?
        },
        keys.clone(),
        SequencerMetrics::register(&registry)?,
    )
    .await?;
    let ingest_config = relay_ingest::IngestConfig {
        waker: Some(
            relay_coord::Waker::connect(&global.redis_url, &global.trust()?, &prefix).await?,
        ),
        ..relay_ingest::IngestConfig::default()
    };
    let ingest = crate::bench::start_ingest(global, ingest_config).await?;
    let attackers = Attackers {
        relay: ingest.address,
        pool: pool.clone(),
        tenant: attacker_tenant,
        endpoints: Arc::new(attacker),
        upstream: upstream.clone(),
        a_client: reqwest::Client::builder()
            .local_address(A_SENDER)
            .timeout(Duration::from_secs(15))
            .build()?,
        next: AtomicU64::new(1),
    };

    let memory = ResidentSampler::start(Duration::from_millis(100));
    tokio::time::sleep(IDLE).await;
    let idle_until = Instant::now();

    let phase = Duration::from_secs(args.phase_s);
    let settle = Duration::from_secs(args.settle_s);
    let loadgen = crate::loadgen::LoadgenArgs {
        url: format!("http://{}", ingest.address),
        ..loadgen
    };
    let load = crate::loadgen::samples(global, &loadgen);
    let phased = async {
        tokio::time::sleep(LEAD_IN).await;
        let mut windows = Vec::with_capacity(schedule.len());
        let mut seen: BTreeMap<AttackClass, Counts> = BTreeMap::new();
        let mut settled: Vec<Option<f64>> = Vec::new();
        for kind in &schedule {
            let (from, from_at) = (Instant::now(), OffsetDateTime::now_utc());
            let ends = from + phase;
            match kind {
                PhaseKind::Quiet => tokio::time::sleep_until(ends.into()).await,
                PhaseKind::Attacked(class) => {
                    let counts = attackers.phase(*class, &args, ends).await;
                    merge(seen.entry(*class).or_default(), counts);
                }
            }
            let (to, to_at) = (Instant::now(), OffsetDateTime::now_utc());
            let mut memory_to = to;
            if *kind == PhaseKind::Attacked(AttackClass::Pages) {
                let merged = attackers.settle(to + settle).await?;
                settled.push(merged.map(|d| (d.as_secs_f64() * 10.0).round() / 10.0));
                memory_to = Instant::now();
            }
            windows.push(Window {
                kind: *kind,
                from,
                to,
                memory_to,
                from_at,
                to_at,
            });
        }
        anyhow::Ok((windows, seen, settled))
    };
    let (samples, phased) = tokio::join!(load, phased);
    let samples = samples?;
    let (windows, seen, settled) = phased?;
    let resident = memory.stop();

    // Let B's accepted messages drain before reading their lag from the rows.
    let drained = wait_applied(&pool, victim, Duration::from_secs(120)).await?;
    ingest.stop().await?;
    sequencer.stop().await;
    upstream_task.abort();

    let kib_to_mib = |kib: u64| (kib as f64 / 1024.0 * 10.0).round() / 10.0;
    let idle = resident
        .iter()
        .filter(|(at, _)| *at < idle_until)
        .map(|(_, kib)| *kib)
        .max();
    let peak = |windows: &[&Window]| {
        resident
            .iter()
            .filter(|(at, _)| windows.iter().any(|w| *at >= w.from && *at < w.memory_to))
            .map(|(_, kib)| *kib)
            .max()
    };

    let mut phases = Vec::new();
    for window in &windows {
        let answers = answer_figures(&samples, &[window]);
        let lag = windows_lag(&pool, victim, &[(window.from_at, window.to_at)]).await?;
        phases.push(json!({
            "kind": window.kind.label(),
            "answer_ms": {"p50": answers.p50, "p99": answers.p99},
            "apply_lag_ms": {"p50": lag["p50"], "p99": lag["p99"]},
            "peak_rss_mib": peak(&[window]).map(kib_to_mib),
        }));
    }

    let kinds: Vec<PhaseKind> = std::iter::once(PhaseKind::Quiet)
        .chain(classes.iter().map(|c| PhaseKind::Attacked(*c)))
        .collect();
    let mut figures: BTreeMap<PhaseKind, (AnswerFigures, Value, Option<u64>)> = BTreeMap::new();
    for kind in &kinds {
        let chosen: Vec<&Window> = windows.iter().filter(|w| w.kind == *kind).collect();
        let spans: Vec<_> = chosen.iter().map(|w| (w.from_at, w.to_at)).collect();
        figures.insert(
            *kind,
            (
                answer_figures(&samples, &chosen),
                windows_lag(&pool, victim, &spans).await?,
                peak(&chosen),
            ),
        );
    }
    let (quiet_answers, quiet_lag, quiet_peak) = figures[&PhaseKind::Quiet].clone();
    let ratio = |a: Option<f64>, q: Option<f64>| match (a, q) {
        (Some(a), Some(q)) if q > 0.0 => Some((a / q * 100.0).round() / 100.0),
        _ => None,
    };
    let mut by_kind = serde_json::Map::new();
    for kind in &kinds {
        let (answers, lag, peak) = &figures[kind];
        let mut figure = json!({
            "answer_ms": {"p50": answers.p50, "p99": answers.p99},
            "apply_lag_ms": {"p50": lag["p50"], "p99": lag["p99"], "max": lag["max"]},
            "peak_rss_mib": peak.map(kib_to_mib),
            "b_answers": answers.by_status,
            "b_applied_messages": lag["messages"],
        });
        if *kind != PhaseKind::Quiet {
            figure["ratio_to_quiet"] = json!({
                "answer_p50": ratio(answers.p50, quiet_answers.p50),
                "answer_p99": ratio(answers.p99, quiet_answers.p99),
                "apply_lag_p50": ratio(lag["p50"].as_f64(), quiet_lag["p50"].as_f64()),
                "apply_lag_p99": ratio(lag["p99"].as_f64(), quiet_lag["p99"].as_f64()),
                "peak_rss": ratio(peak.map(|p| p as f64), quiet_peak.map(|p| p as f64)),
            });
        }
        by_kind.insert(kind.label().to_owned(), figure);
    }
    let rss_ratio = |class: AttackClass, to: Option<u64>| {
        let peak = figures
            .get(&PhaseKind::Attacked(class))
            .and_then(|f| f.2)
            .map(|p| p as f64);
        ratio(peak, to.map(|t| t as f64))
    };
    let quarantined: (i64,) = sqlx::query_as(
        "SELECT count(*) FROM message_applications WHERE tenant_id = $1 AND outcome = 'quarantined'",
    )
    .bind(attacker_tenant)
    .fetch_one(&pool)
    .await
    .unwrap_or((-1,));
    let attacker_seen: BTreeMap<&str, &Counts> = seen
        .iter()
        .map(|(class, counts)| (class.label(), counts))
        .collect();
    println!(
        "{}",
        json!({
            "b_rate": args.rate,
            "b_endpoints": args.endpoints,
            "phase_s": args.phase_s,
            "rounds": args.rounds,
            "attacks": classes.iter().map(|c| c.label()).collect::<Vec<_>>(),
            "settings": {
                "attack_rate": args.attack_rate,
                "slow_connections": args.slow_connections,
                "short_bodies": args.short_bodies,
                "hogs": args.hogs,
                "attacker_endpoints": args.attacker_endpoints,
                "attacker_quota": args.attacker_quota,
                "flood_rate": args.flood_rate,
                "settle_s": args.settle_s,
            },
            "b": by_kind,
            "rss_mib": {
                "idle": idle.map(kib_to_mib),
                "quiet_peak": quiet_peak.map(kib_to_mib),
                "bodies_over_idle": rss_ratio(AttackClass::Bodies, idle),
                "bodies_over_quiet": rss_ratio(AttackClass::Bodies, quiet_peak),
                "pages_over_idle": rss_ratio(AttackClass::Pages, idle),
                "pages_over_quiet": rss_ratio(AttackClass::Pages, quiet_peak),
            },
            "attacker": attacker_seen,
            "a_quarantined_messages": quarantined.0,
            "a_reloads_merged_after_pages_s": settled,
            "b_drained": drained,
            "phases": phases,
        })
    );
    pool.close().await;
    Ok(())
}

/// B's answers in some phases: latency quantiles (from when each message was due) and counts by
/// status.
#[derive(Clone)]
struct AnswerFigures {
    p50: Option<f64>,
    p99: Option<f64>,
    by_status: Counts,
}

fn answer_figures(samples: &[Sample], windows: &[&Window]) -> AnswerFigures {
    let mut latencies_us = Vec::new();
    let mut by_status = Counts::new();
    for sample in samples {
        if windows
            .iter()
            .any(|w| sample.due >= w.from && sample.due < w.to)
        {
            latencies_us.push(sample.latency.as_micros() as u64);
            count(&mut by_status, sample.answered.to_string(), 1);
        }
    }
    latencies_us.sort_unstable();
    // The nearest rank, as `relay loadgen` reports its own quantiles.
    let quantile = |q: f64| -> Option<f64> {
        let at = ((latencies_us.len() as f64 * q).ceil() as usize).saturating_sub(1);
        let us = *latencies_us.get(at.min(latencies_us.len().checked_sub(1)?))?;
        Some((us as f64 / 10.0).round() / 100.0)
    };
    AnswerFigures {
        p50: quantile(0.50),
        p99: quantile(0.99),
        by_status,
    }
}

/// How a slow client's connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlowEnd {
    /// Answered 503 before its head was complete: a bound was reached.
    Refused,
    /// Closed by the relay without an answer (the header read timeout), or never connected.
    Closed,
    /// Still open when the client gave up.
    StillOpen,
}

/// A slow client, from the address `from`: sends a request head to `address` one byte every
/// `pace` until the relay answers or closes the connection, or `give_up` passes.
pub async fn slow_connection(
    address: SocketAddr,
    from: IpAddr,
    pace: Duration,
    give_up: Duration,
) -> SlowEnd {
    let socket = match from {
        IpAddr::V4(_) => TcpSocket::new_v4(),
        IpAddr::V6(_) => TcpSocket::new_v6(),
    };
    let Ok(socket) = socket.and_then(|s| s.bind(SocketAddr::new(from, 0)).map(|()| s)) else {
        return SlowEnd::Closed;
    };
    let Ok(Ok(stream)) = tokio::time::timeout(give_up, socket.connect(address)).await else {
        return SlowEnd::Closed;
    };
    let (mut read, mut write) = stream.into_split();
    let answer = async move {
        let mut head = [0u8; 12];
        let read = read.read(&mut head).await.unwrap_or(0);
        head[..read].starts_with(b"HTTP/1.1 503")
    };
    let trickle = async move {
        let head = format!(
            "POST /webhooks/{} HTTP/1.1\r\nhost: relay\r\nx-slow: ",
            Uuid::new_v4()
        );
        for byte in head.bytes().chain(std::iter::repeat(b'a')) {
            if write.write_all(&[byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(pace).await;
        }
    };
    tokio::select! {
        refused = answer => if refused { SlowEnd::Refused } else { SlowEnd::Closed },
        () = trickle => SlowEnd::Closed,
        () = tokio::time::sleep(give_up) => SlowEnd::StillOpen,
    }
}

/// Waits until every message of `tenant` stored so far is applied; false if `limit` passed.
async fn wait_applied(pool: &PgPool, tenant: Uuid, limit: Duration) -> anyhow::Result<bool> {
    let started = tokio::time::Instant::now();
    loop {
        let (left,): (i64,) = sqlx::query_as(
            "SELECT coalesce(sum(a.last_arrival_seq - coalesce(c.applied_arrival_seq, 0)), 0)::int8
             FROM endpoint_arrival_counters a
             JOIN webhook_endpoints e ON e.id = a.endpoint_id
             LEFT JOIN endpoint_apply_cursors c ON c.endpoint_id = a.endpoint_id
             WHERE e.tenant_id = $1",
        )
        .bind(tenant)
        .fetch_one(pool)
        .await?;
        if left == 0 {
            return Ok(true);
        }
        if started.elapsed() > limit {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

const LAG_QUANTILES: &str = "
    SELECT count(*),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY lag),
           percentile_cont(0.99) WITHIN GROUP (ORDER BY lag),
           max(lag)
    FROM (SELECT extract(epoch FROM a.applied_at - m.received_at)::float8 * 1000 AS lag
          FROM messages m
          JOIN message_applications a
            ON a.endpoint_id = m.endpoint_id AND a.arrival_seq = m.arrival_seq
          WHERE m.tenant_id = $1
            AND EXISTS (SELECT 1 FROM unnest($2::timestamptz[], $3::timestamptz[]) w(s, e)
                        WHERE m.received_at >= w.s AND m.received_at < w.e)) l";

/// B's apply lag for messages received within the given windows.
async fn windows_lag(
    pool: &PgPool,
    tenant: Uuid,
    windows: &[(OffsetDateTime, OffsetDateTime)],
) -> anyhow::Result<Value> {
    let starts: Vec<OffsetDateTime> = windows.iter().map(|w| w.0).collect();
    let ends: Vec<OffsetDateTime> = windows.iter().map(|w| w.1).collect();
    let (count, p50, p99, max): (i64, Option<f64>, Option<f64>, Option<f64>) =
        sqlx::query_as(LAG_QUANTILES)
            .bind(tenant)
            .bind(&starts)
            .bind(&ends)
            .fetch_one(pool)
            .await?;
    let ms = |v: Option<f64>| v.map(|v| (v * 10.0).round() / 10.0);
    Ok(json!({"messages": count, "p50": ms(p50), "p99": ms(p99), "max": ms(max)}))
}
