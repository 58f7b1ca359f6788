//! `relay loadgen`: drives a running front tier with correctly signed messages.
//!
//! By default a closed loop: `concurrency` senders each post a message, wait for the answer,
//! and post the next, to endpoints chosen at random among `endpoints`. With `--rate`, an open
//! loop: the senders share a fixed schedule of that many messages per second. Each message is a v1 `feed` message of
//! one `announcement.updated` event padded to about `body_bytes`, with a fresh webhook-id,
//! signed at the moment it is sent. With `--provision`, the endpoints (and a tenant for them)
//! are first registered in the database the front tier uses.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use rand::{Rng as _, SeedableRng as _};
use relay_store::endpoints::{self, NewEndpoint};
use relay_store::{tenants, StoreError};
use relay_wire::SigningSecret;
use serde_json::json;
use uuid::Uuid;

use crate::cli::GlobalArgs;

#[derive(Debug, Clone, Args)]
pub struct LoadgenArgs {
    /// The front tier's base URL.
    #[arg(
        long,
        env = "RELAY_LOADGEN_URL",
        default_value = "http://127.0.0.1:8080"
    )]
    pub url: String,
    /// How many endpoints to spread messages over.
    #[arg(long, default_value_t = 1000)]
    pub endpoints: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// How long to measure, after the warm-up.
    #[arg(long, default_value_t = 30)]
    pub duration_s: u64,
    /// Seconds of load before measuring starts (connections, caches, Postgres buffers).
    #[arg(long, default_value_t = 3)]
    pub warmup_s: u64,
    /// Messages per second in all, sent on a fixed schedule (0: as fast as answers allow).
    /// With a rate, each latency is measured from the moment the message was due, so time a
    /// message spent waiting for a free sender counts against the relay.
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Approximate size of each message body.
    #[arg(long, default_value_t = 3072)]
    pub body_bytes: usize,
    /// Register the tenant and endpoints first (idempotent), in RELAY_DATABASE_URL.
    #[arg(long)]
    pub provision: bool,
    /// Seed for endpoint ids, secrets and the choice of endpoints: the same seed gives the same
    /// endpoints, so a provisioned database can be reused. Webhook-ids are new on every run.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// The endpoints a seed stands for: ids and secrets derived from the seed alone.
pub fn loadgen_endpoints(seed: u64, count: usize) -> Vec<(Uuid, SigningSecret)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..count)
        .map(|_| {
            let id = uuid::Builder::from_random_bytes(rng.gen()).into_uuid();
            let key: [u8; 32] = rng.gen();
            (
                id,
                SigningSecret::from_bytes(key.to_vec()).expect("32 bytes is long enough"),
            )
        })
        .collect()
}

pub fn loadgen_tenant(seed: u64) -> Uuid {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x7e4a_4e7a);
    uuid::Builder::from_random_bytes(rng.gen()).into_uuid()
}

pub async fn provision(global: &GlobalArgs, args: &LoadgenArgs) -> anyhow::Result<()> {
    let pool = relay_store::connect(&global.database_url, &Default::default())?;
    let tenant_id = loadgen_tenant(args.seed);
    match tenants::create(&pool, tenant_id, "loadgen").await {
        Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
        Err(error) => return Err(error).context("creating the loadgen tenant"),
    }
    // The load generator's one tenant stands for the whole load: no quota of a tenant's may
    // shape what a benchmark measures.
    relay_store::quotas::set_overrides(
        &pool,
        relay_store::TenantId(tenant_id),
        &relay_store::quotas::QuotaOverrides {
            max_endpoints: Some(relay_store::quotas::MAX_QUOTA),
            messages_per_second: Some(relay_store::quotas::MAX_QUOTA),
        },
    )
    .await
    .context("lifting the loadgen tenant's quotas")?;
    let keys = global.seal.keyring()?;
    let mut created = 0;
    for (id, secret) in loadgen_endpoints(args.seed, args.endpoints) {
        let new = NewEndpoint {
            id,
            tenant_id,
            secret,
            upstream_base_url: None,
            upstream_api_key: None,
        };
        match endpoints::create(&pool, &keys, &new).await {
            Ok(()) => created += 1,
            Err(StoreError::AlreadyExists { .. }) => {}
            Err(error) => return Err(error).context("creating a loadgen endpoint"),
        }
    }
    eprintln!(
        "provisioned {created} new endpoints ({} in all) for tenant {tenant_id}",
        args.endpoints
    );
    Ok(())
}

/// Builds one signed message: (webhook-id, timestamp, signature header, body).
pub fn build_message(
    endpoint: Uuid,
    secret: &SigningSecret,
    n: u64,
    padding: &str,
) -> (String, i64, String, Vec<u8>) {
    build_events_message(endpoint, secret, n, &[padding])
}

/// Builds one signed message of one event per text of `paddings`: items `n`, `n + 1`, ... each
/// new, each event an `announcement.updated` of its own subject (`announcement:<n>`) at the
/// sequence after its number. (webhook-id, timestamp, signature header, body).
pub fn build_events_message(
    endpoint: Uuid,
    secret: &SigningSecret,
    n: u64,
    paddings: &[&str],
) -> (String, i64, String, Vec<u8>) {
    use std::fmt::Write as _;
    // Fresh on every run (not from the seed): a repeated id would be a duplicate, not a load.
    let webhook_id = format!("msg_{:032x}", rand::random::<u128>());
    // Written out directly rather than through a JSON value: the generator should spend as
    // little of the shared CPU as it can. The padding is plain words, so needs no escaping.
    let mut events = String::new();
    for (n, padding) in (n..).zip(paddings) {
        let seq = n + 1;
        let sequence = relay_wire::Sequence::from_parts(1, seq);
        let event_id = format!("evt_{:026x}", rand::random::<u128>());
        if !events.is_empty() {
            events.push(',');
        }
        let _ = write!(
            events,
            concat!(
                r#"{{"companyid":28,"#,
                r#""data":{{"changes":[],"feed_item_id":"announcement:{n}","first_seq":{seq},"#,
                r#""item_kind":"announcement","lang":"en","op":"new","parts":[{{"kind":"story","#,
                r#""lede_first_sentence":"{padding}","part_id":"story:{n}","part_version":1}}],"#,
                r#""seq":{seq},"type":"item"}},"datacontenttype":"application/json","#,
                r#""id":"{event_id}","sequence":"{sequence}","#,
                r#""source":"https://api.quanor.com/v1/feed","specversion":"1.0","#,
                r#""subject":"announcement:{n}","type":"announcement.updated"}}"#
            ),
            n = n,
            seq = seq,
            padding = padding,
            event_id = event_id,
            sequence = sequence,
        );
    }
    let last = n + paddings.len().max(1) as u64;
    let body = format!(
        concat!(
            r#"{{"access_version":"loadgen1","complete":true,"events":[{events}],"generation":1,"#,
            r#""since":"1.{n}","through":"1.{last}","track":"feed","v":1,"#,
            r#""webhook_endpoint_id":"{endpoint}"}}"#
        ),
        events = events,
        n = n,
        last = last,
        endpoint = endpoint,
    )
    .into_bytes();
    let timestamp = time::OffsetDateTime::now_utc().unix_timestamp();
    let signature = relay_wire::sign(&webhook_id, timestamp, &body, std::slice::from_ref(secret));
    (webhook_id, timestamp, signature, body)
}

/// `len` bytes of word-like text.
fn prose(len: usize, seed: u64) -> String {
    const WORDS: [&str; 16] = [
        "order",
        "revenue",
        "quarter",
        "guidance",
        "margin",
        "contract",
        "board",
        "dividend",
        "growth",
        "market",
        "shares",
        "results",
        "outlook",
        "deliveries",
        "customer",
        "report",
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut text = String::with_capacity(len + 16);
    while text.len() < len {
        text.push_str(WORDS[rng.gen_range(0..WORDS.len())]);
        text.push_str(&format!(" {} ", rng.gen_range(0..100_000)));
    }
    text.truncate(len);
    text
}

/// How a message's request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answered {
    /// Answered with this HTTP status.
    Status(u16),
    /// No answer within the client's timeout.
    Timeout,
    /// No answer: the connection failed or was closed.
    Error,
}

impl std::fmt::Display for Answered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Answered::Status(status) => write!(f, "{status}"),
            Answered::Timeout => f.write_str("timeout"),
            Answered::Error => f.write_str("error"),
        }
    }
}

/// One message sent after the warm-up: when it was due (when it was sent, in a closed loop),
/// how long from then its answer took, and the answer.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub due: Instant,
    pub latency: Duration,
    pub answered: Answered,
}

/// Sends the load `args` describe (registering its endpoints first with `--provision`) and
/// returns every message due after the warm-up, in no particular order: a benchmark that cuts
/// the run into phases places each message by its `due`.
pub async fn samples(global: &GlobalArgs, args: &LoadgenArgs) -> anyhow::Result<Vec<Sample>> {
    if args.provision {
        provision(global, args).await?;
    }
    let endpoints = Arc::new(loadgen_endpoints(args.seed, args.endpoints.max(1)));
    // The envelope is about 850 bytes; pad the rest with text that compresses like prose does,
    // not like a run of one letter.
    let padding: Arc<str> = prose(args.body_bytes.saturating_sub(850), args.seed).into();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency)
        .timeout(Duration::from_secs(20))
        .build()?;
    let base = args.url.trim_end_matches('/').to_owned();
    let started = Instant::now();
    let (rate, concurrency) = (args.rate, args.concurrency.max(1));
    let warmup_ends = started + Duration::from_secs(args.warmup_s);
    let ends = warmup_ends + Duration::from_secs(args.duration_s);

    let senders = (0..args.concurrency.max(1)).map(|worker| {
        let (client, endpoints, padding, base) = (
            client.clone(),
            endpoints.clone(),
            padding.clone(),
            base.clone(),
        );
        let seed = args
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(worker as u64);
        tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut samples = Vec::new();
            let mut n = (worker as u64) << 32;
            // On a schedule, worker w sends the messages due at w, w + c, w + 2c, ... in units
            // of 1/rate seconds (c senders), so together they keep the rate.
            let interval = (rate > 0.0).then(|| Duration::from_secs_f64(concurrency as f64 / rate));
            let mut next_due = started
                + Duration::from_secs_f64(if rate > 0.0 {
                    worker as f64 / rate
                } else {
                    0.0
                });
            loop {
                // Latency counts from when the message was due (open loop) or from now.
                let due = match interval {
                    Some(interval) => {
                        let due = next_due;
                        next_due += interval;
                        tokio::time::sleep_until(due.into()).await;
                        due
                    }
                    None => Instant::now(),
                };
                if Instant::now() >= ends {
                    return samples;
                }
                let (id, secret) = &endpoints[rng.gen_range(0..endpoints.len())];
                n += 1;
                let (webhook_id, timestamp, signature, body) =
                    build_message(*id, secret, n, &padding);
                let result = client
                    .post(format!("{base}/webhooks/{id}"))
                    .header("content-type", "application/json")
                    .header("webhook-id", webhook_id)
                    .header("webhook-timestamp", timestamp.to_string())
                    .header("webhook-signature", signature)
                    .header("quanor-webhook-attempt", "1")
                    .body(body)
                    .send()
                    .await;
                let answered = match result {
                    Ok(response) => {
                        let status = response.status().as_u16();
                        let _ = response.bytes().await;
                        Answered::Status(status)
                    }
                    Err(error) if error.is_timeout() => Answered::Timeout,
                    Err(_) => Answered::Error,
                };
                if due >= warmup_ends {
                    samples.push(Sample {
                        due,
                        latency: due.elapsed(),
                        answered,
                    });
                }
            }
        })
    });
    let mut all = Vec::new();
    for sender in futures::future::join_all(senders).await {
        all.extend(sender.context("a sender panicked")?);
    }
    Ok(all)
}

pub async fn run(global: &GlobalArgs, args: LoadgenArgs) -> anyhow::Result<()> {
    let samples = samples(global, &args).await?;
    let mut latencies_us: Vec<u64> = samples
        .iter()
        .map(|s| s.latency.as_micros() as u64)
        .collect();
    let mut by_status: BTreeMap<String, u64> = BTreeMap::new();
    for sample in &samples {
        *by_status.entry(sample.answered.to_string()).or_default() += 1;
    }
    latencies_us.sort_unstable();
    let quantile = |q: f64| -> f64 {
        if latencies_us.is_empty() {
            return 0.0;
        }
        let at = ((latencies_us.len() as f64 * q).ceil() as usize).saturating_sub(1);
        latencies_us[at.min(latencies_us.len() - 1)] as f64 / 1000.0
    };
    let seconds = args.duration_s.max(1) as f64;
    let accepted = by_status.get("202").copied().unwrap_or(0);
    let summary = json!({
        "endpoints": args.endpoints,
        "concurrency": args.concurrency,
        "rate": args.rate,
        "body_bytes": args.body_bytes,
        "duration_s": args.duration_s,
        "requests": latencies_us.len(),
        "by_status": by_status,
        "accepted_per_s": (accepted as f64 / seconds).round(),
        "latency_ms": {"p50": quantile(0.50), "p90": quantile(0.90), "p99": quantile(0.99),
                       "max": quantile(1.0)},
    });
    println!("{summary}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_messages_are_valid_signed_v1_messages_of_about_the_asked_size() {
        let (id, secret) = loadgen_endpoints(3, 1).remove(0);
        let padding = prose(3072 - 850, 3);
        let (webhook_id, timestamp, signature, body) = build_message(id, &secret, 41, &padding);
        let message = relay_wire::Message::parse(&body).unwrap();
        assert_eq!(message.webhook_endpoint_id, id);
        assert_eq!(message.events.len(), 1);
        assert!((2_800..3_400).contains(&body.len()), "{} bytes", body.len());
        let headers = relay_wire::SignatureHeaders {
            webhook_id: Some(&webhook_id),
            webhook_timestamp: Some(&timestamp.to_string()),
            webhook_signature: Some(&signature),
        };
        assert!(relay_wire::verify(headers, &body, &[secret], timestamp).is_ok());
    }

    #[test]
    fn a_message_of_several_events_holds_one_new_item_each_in_order() {
        let (id, secret) = loadgen_endpoints(4, 1).remove(0);
        let texts = ["one", "two", "three"];
        let (_, _, _, body) = build_events_message(id, &secret, 7, &texts);
        let message = relay_wire::Message::parse(&body).unwrap();
        assert_eq!(message.events.len(), 3);
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["since"], "1.7");
        assert_eq!(json["through"], "1.10");
        assert_eq!(json["events"][2]["subject"], "announcement:9");
        assert_eq!(json["events"][2]["data"]["seq"], 10);
    }
}
