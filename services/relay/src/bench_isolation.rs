//! `relay bench isolation`: what tenant A's attacks cost tenant B.
//!
//! One process runs the front tier and the sequencer against a fresh database. Tenant B (the
//! loadgen's tenant) sends signed feed messages at a fixed rate for the whole run; the run is cut
//! into phases that alternate quiet (B alone) and attacked (B, while tenant A sends every hostile
//! message the isolation work defends against, and a stranger holds slow connections open on the
//! ingest port). B's apply lag (received to applied, from the rows themselves) is measured per
//! phase, so the two figures come from the same minutes of the same machine and their ratio is
//! what the attacks cost.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use relay_sequencer::{Sequencer, SequencerConfig, SequencerMetrics};
use relay_store::endpoints::{self, NewEndpoint};
use relay_store::tenants;
use relay_wire::SigningSecret;
use serde_json::{json, Value};
use sqlx::PgPool;
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use uuid::Uuid;

use crate::cli::{GlobalArgs, SequencerArgs};

#[derive(Debug, Args)]
pub struct IsolationBenchArgs {
    /// Drop and create RELAY_DATABASE_URL's database first (required: the bench needs it empty).
    #[arg(long)]
    pub recreate_database: bool,
    /// Tenant B's messages per second, all phases.
    #[arg(long, default_value_t = 200.0)]
    pub rate: f64,
    /// Tenant B's endpoints.
    #[arg(long, default_value_t = 100)]
    pub endpoints: usize,
    /// Tenant A's endpoints, each sent hostile messages in turn.
    #[arg(long, default_value_t = 20)]
    pub attacker_endpoints: usize,
    /// Tenant A's signed hostile messages per second while attacking.
    #[arg(long, default_value_t = 50.0)]
    pub attack_rate: f64,
    /// Connections a stranger holds open on the ingest port while attacking, each sending one
    /// header byte a second.
    #[arg(long, default_value_t = 300)]
    pub slow_connections: usize,
    /// Seconds in each phase.
    #[arg(long, default_value_t = 10)]
    pub phase_s: u64,
    /// Quiet and attacked phase pairs, alternating.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    #[command(flatten)]
    pub sequencer: SequencerArgs,
}

/// Where the stranger's slow connections come from: another address than tenant B's sender
/// (127.0.0.1), as a stranger's would be, so the per-address bound meets only the stranger.
const STRANGER: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 3));

/// The hostile messages tenant A sends, in turn: each is genuine (signed with A's own secret),
/// and each once failed or wedged more than A's own stream.
#[derive(Debug, Clone, Copy)]
enum Attack {
    /// A NUL in `track`: once failed every message sharing its ingest batch.
    NulTrack,
    /// A NUL in an event id: once failed its endpoint's applies for ever.
    NulEventId,
    /// A body that is no v1 message: once answered 400, so resent for a day.
    Unparseable,
    /// A v1 field in a shape v1 does not have (an unknown `data.type` on an update).
    UnknownDataType,
}

const ATTACKS: [Attack; 4] = [
    Attack::NulTrack,
    Attack::NulEventId,
    Attack::Unparseable,
    Attack::UnknownDataType,
];

impl Attack {
    fn label(self) -> &'static str {
        match self {
            Attack::NulTrack => "nul_track",
            Attack::NulEventId => "nul_event_id",
            Attack::Unparseable => "unparseable",
            Attack::UnknownDataType => "unknown_data_type",
        }
    }

    fn body(self, endpoint: Uuid, n: u64) -> String {
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
                r#"{{"v":1,"webhook_endpoint_id":"{endpoint}","track":"{track}","generation":{generation},"access_version":"attack1","since":"1.{n}","through":"1.{n}","events":{events}}}"#
            )
        };
        match self {
            Attack::NulTrack => message("feed\\u0000x", "1", "[]"),
            Attack::NulEventId => message(
                "feed",
                "1",
                &format!("[{}]", event(&format!("evt_{n}\\u0000x"), &item)),
            ),
            Attack::Unparseable => message("feed", "\"one\"", "{}"),
            Attack::UnknownDataType => message(
                "feed",
                "1",
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

/// What the attacker saw: answers by attack and status, and the slow connections' fate.
#[derive(Default)]
struct AttackTally {
    answers: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
    slow_refused: AtomicU64,
    slow_closed: AtomicU64,
    slow_open_at_end: AtomicU64,
}

impl AttackTally {
    fn answered(&self, attack: Attack, status: &str) {
        *self
            .answers
            .lock()
            .expect("not poisoned")
            .entry(format!("{} {status}", attack.label()))
            .or_default() += 1;
    }
}

pub async fn run(global: &GlobalArgs, args: IsolationBenchArgs) -> anyhow::Result<()> {
    let pool = crate::bench::fresh_database(global, args.recreate_database).await?;
    let phases = u64::from(args.rounds) * 2;
    let loadgen = crate::loadgen::LoadgenArgs {
        url: String::new(),
        endpoints: args.endpoints,
        concurrency: 64,
        duration_s: phases * args.phase_s,
        warmup_s: 0,
        rate: args.rate,
        body_bytes: 1024,
        provision: false,
        seed: 1,
    };
    let victim = crate::bench::provision_in_sync(global, &pool, &loadgen).await?;

    // A's endpoints read a local feed when a quarantine asks them to read /v1/feed again.
    let (feed, feed_task) = crate::bench::serve_feed(Vec::new()).await?;
    let attacker_tenant = Uuid::new_v4();
    tenants::create(&pool, attacker_tenant, "attacker").await?;
    let mut attacker = Vec::with_capacity(args.attacker_endpoints);
    for _ in 0..args.attacker_endpoints {
        let id = Uuid::new_v4();
        let secret = SigningSecret::from_bytes(rand::random::<[u8; 32]>().to_vec())?;
        endpoints::create(
            &pool,
            &NewEndpoint {
                id,
                tenant_id: attacker_tenant,
                secret: secret.clone(),
                upstream_base_url: Some(format!("http://{feed}")),
                upstream_api_key: Some("attacker-key".into()),
            },
        )
        .await?;
        attacker.push((id, secret));
    }

    let registry = prometheus::Registry::new();
    let prefix = format!("relay-bench-{}:", Uuid::new_v4().simple());
    let sequencer = Sequencer::start(
        crate::startup::sequencer_pool(global)?,
        SequencerConfig {
            key_prefix: prefix.clone(),
            // A's endpoints read the bench's own feed, on this machine.
            outbound: relay_netguard::OutboundPolicy::ANY,
            ..args.sequencer.to_config(global)?
        },
        SequencerMetrics::register(&registry)?,
    )
    .await?;
    let ingest_config = relay_ingest::IngestConfig {
        waker: Some(
            relay_coord::Waker::connect(&global.redis_url, &global.trust()?, &prefix).await?,
        ),
        ..relay_ingest::IngestConfig::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let metrics_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let ingest = crate::startup::IngestServer::start_with_registry(
        crate::startup::ingest_pool(global, Duration::from_secs(8))?,
        ingest_config,
        listener,
        metrics_listener,
        Arc::new(relay_ingest::SystemClock),
        prometheus::Registry::new(),
        crate::telemetry::Readiness::default(),
    )?;
    let address = ingest.address;

    let tally = Arc::new(AttackTally::default());
    let phase = Duration::from_secs(args.phase_s);
    let load = crate::loadgen::run(
        global,
        crate::loadgen::LoadgenArgs {
            url: format!("http://{address}"),
            ..loadgen
        },
    );
    let phased = async {
        let mut windows: Vec<(bool, OffsetDateTime, OffsetDateTime)> = Vec::new();
        for round in 0..phases {
            let attacked = round % 2 == 1;
            let started = OffsetDateTime::now_utc();
            if attacked {
                attack(address, &attacker, &args, phase, tally.clone()).await;
            } else {
                tokio::time::sleep(phase).await;
            }
            windows.push((attacked, started, OffsetDateTime::now_utc()));
        }
        windows
    };
    let (load, windows) = tokio::join!(load, phased);
    load?;

    // Let B's accepted messages drain before reading their lag from the rows.
    let drained = wait_applied(&pool, victim, Duration::from_secs(120)).await?;
    ingest.stop().await?;
    sequencer.stop().await;
    feed_task.abort();

    let mut rounds = Vec::new();
    for (attacked, from, to) in &windows {
        let figures = windows_lag(&pool, victim, &[(*from, *to)]).await?;
        rounds.push(json!({"attacked": attacked, "b_apply_lag_ms": figures}));
    }
    let quiet = pooled_lag(&pool, victim, &windows, false).await?;
    let attacked = pooled_lag(&pool, victim, &windows, true).await?;
    let ratio = |key: &str| match (attacked[key].as_f64(), quiet[key].as_f64()) {
        (Some(a), Some(q)) if q > 0.0 => Some((a / q * 100.0).round() / 100.0),
        _ => None,
    };
    let quarantined: (i64,) = sqlx::query_as(
        "SELECT count(*) FROM message_applications WHERE tenant_id = $1 AND outcome = 'quarantined'",
    )
    .bind(attacker_tenant)
    .fetch_one(&pool)
    .await
    .unwrap_or((-1,));
    let answers = tally.answers.lock().expect("not poisoned").clone();
    println!(
        "{}",
        json!({
            "b_rate": args.rate,
            "b_endpoints": args.endpoints,
            "attack_rate": args.attack_rate,
            "slow_connections": args.slow_connections,
            "phase_s": args.phase_s,
            "b_apply_lag_ms": {"quiet": quiet, "attacked": attacked},
            "attacked_over_quiet": {"p50": ratio("p50"), "p99": ratio("p99")},
            "b_drained": drained,
            "phases": rounds,
            "attacker_answers": answers,
            "attacker_quarantined_messages": quarantined.0,
            "slow": {
                "refused_503": tally.slow_refused.load(Ordering::Relaxed),
                "closed_by_relay": tally.slow_closed.load(Ordering::Relaxed),
                "still_open_at_phase_end": tally.slow_open_at_end.load(Ordering::Relaxed),
            },
        })
    );
    pool.close().await;
    Ok(())
}

/// One attacked phase: A's hostile messages at the attack rate, and a stranger's slow
/// connections, for `phase`.
async fn attack(
    address: SocketAddr,
    attacker: &[(Uuid, SigningSecret)],
    args: &IsolationBenchArgs,
    phase: Duration,
    tally: Arc<AttackTally>,
) {
    let ends = tokio::time::Instant::now() + phase;
    let slow: Vec<_> = (0..args.slow_connections)
        .map(|_| {
            let tally = tally.clone();
            tokio::spawn(async move {
                let end = slow_connection(address, STRANGER, Duration::from_secs(1), phase).await;
                let counter = match end {
                    SlowEnd::Refused => &tally.slow_refused,
                    SlowEnd::Closed => &tally.slow_closed,
                    SlowEnd::StillOpen => &tally.slow_open_at_end,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            })
        })
        .collect();
    let http = reqwest::Client::new();
    let interval = Duration::from_secs_f64(1.0 / args.attack_rate.max(0.1));
    let mut sent = Vec::new();
    let mut n: u64 = 0;
    while tokio::time::Instant::now() < ends && !attacker.is_empty() {
        let (endpoint, secret) = &attacker[n as usize % attacker.len()];
        let kind = ATTACKS[n as usize % ATTACKS.len()];
        let body = kind.body(*endpoint, n + 1);
        let webhook_id = format!("msg_{:032x}", rand::random::<u128>());
        let timestamp = OffsetDateTime::now_utc().unix_timestamp();
        let signature = relay_wire::sign(
            &webhook_id,
            timestamp,
            body.as_bytes(),
            std::slice::from_ref(secret),
        );
        let request = http
            .post(format!("http://{address}/webhooks/{endpoint}"))
            .header("webhook-id", webhook_id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .header("content-type", "application/json")
            .body(body)
            .timeout(Duration::from_secs(15));
        let tally = tally.clone();
        sent.push(tokio::spawn(async move {
            let status = match request.send().await {
                Ok(answer) => answer.status().as_u16().to_string(),
                Err(_) => "no_answer".to_owned(),
            };
            tally.answered(kind, &status);
        }));
        n += 1;
        tokio::time::sleep(interval).await;
    }
    for task in sent.into_iter().chain(slow) {
        let _ = task.await;
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
    from: std::net::IpAddr,
    pace: Duration,
    give_up: Duration,
) -> SlowEnd {
    let socket = match from {
        std::net::IpAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        std::net::IpAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
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

async fn pooled_lag(
    pool: &PgPool,
    tenant: Uuid,
    windows: &[(bool, OffsetDateTime, OffsetDateTime)],
    attacked: bool,
) -> anyhow::Result<Value> {
    let chosen: Vec<(OffsetDateTime, OffsetDateTime)> = windows
        .iter()
        .filter(|w| w.0 == attacked)
        .map(|w| (w.1, w.2))
        .collect();
    windows_lag(pool, tenant, &chosen).await
}
