//! `relay tail --tenant T`: reads a tenant's queue with the [`ReferenceConsumer`] and prints
//! what it rebuilt, as JSON lines. The reference consumer for users, runnable: changes that come
//! out of order are held until their predecessors come, repeats are dropped, and changes that
//! never came are named at the end (and the command fails: the copy printed is not whole).
//!
//! A stories endpoint's messages are read the same way: `--output changes` prints each as it is,
//! `--output copy` prints its copy of the stories (`"kind": "story"` lines, closed rows too) and
//! the stories it notified (`"kind": "notification"` lines).

use std::future::Future;
use std::io::Write;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt as _;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::broker::{connect_any, tenant_queue};
use crate::config::{redact, DEFAULT_AMQP_URL};
use crate::consumer::{ConsumerStats, ReferenceConsumer};
use relay_netguard::{RetryPolicy, TrustRoots};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TailOutput {
    /// At the end, every item of every endpoint's rebuilt copy, one per line (a stories
    /// endpoint's: every story, open or closed, then every story it notified).
    Copy,
    /// As they arrive, each change applied (repeats dropped), one message per line.
    Changes,
}

#[derive(Debug, Clone, clap::Args)]
pub struct TailArgs {
    /// The tenant whose changes to read.
    #[arg(long)]
    pub tenant: Uuid,

    /// The broker holding the queue (the relay's own, for tenants without a destination).
    #[arg(long, env = "RELAY_AMQP_URL", default_value = DEFAULT_AMQP_URL, hide_env_values = true)]
    pub amqp_url: String,

    /// The queue to read; by default the relay's `relay.tenant.<tenant>`. Name yours when the
    /// tenant's changes go to its own exchange.
    #[arg(long)]
    pub queue: Option<String>,

    /// Acknowledge what is read, which removes it from the queue, as a real consumer does.
    /// Without it nothing is acknowledged and the broker puts every message back when tail
    /// exits.
    #[arg(long)]
    pub ack: bool,

    /// Stop once no message came for this many milliseconds; 0 reads until interrupted.
    #[arg(long, env = "RELAY_TAIL_IDLE_EXIT_MS", default_value_t = 2_000)]
    pub idle_exit_ms: u64,

    /// What to print.
    #[arg(long, value_enum, default_value_t = TailOutput::Copy)]
    pub output: TailOutput,

    /// Resume after this change: the message id (`<endpoint>:<epoch>:<change_seq>`) of the last
    /// change already applied for its endpoint, when the queue no longer holds the changes
    /// before it. Repeat for each endpoint. Without it, each endpoint's changes are taken from
    /// change_seq 1 (of the first epoch seen).
    #[arg(long = "after", value_name = "MESSAGE_ID", value_parser = parse_position)]
    pub after: Vec<(Uuid, u64, i64)>,
}

/// `<endpoint>:<epoch>:<change_seq>`, as a message id names a change.
fn parse_position(text: &str) -> Result<(Uuid, u64, i64), String> {
    let mut parts = text.splitn(3, ':');
    let (Some(endpoint), Some(epoch), Some(seq)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err("a message id: <endpoint>:<epoch>:<change_seq>".to_owned());
    };
    let endpoint = endpoint
        .parse()
        .map_err(|e| format!("endpoint {endpoint:?}: {e}"))?;
    let epoch = epoch.parse().map_err(|e| format!("epoch {epoch:?}: {e}"))?;
    let seq = seq
        .parse()
        .map_err(|e| format!("change_seq {seq:?}: {e}"))?;
    Ok((endpoint, epoch, seq))
}

/// One line of `--output copy`.
#[derive(Debug, Serialize)]
struct CopyLine<'a> {
    webhook_endpoint_id: Uuid,
    subject: &'a str,
    item_kind: &'a Option<String>,
    generation: u64,
    sequence: &'a Option<String>,
    change_seq: i64,
    item: &'a Value,
}

/// One line of `--output copy` for a stories endpoint's story (`kind` `story`).
#[derive(Debug, Serialize)]
struct StoryCopyLine<'a> {
    kind: &'static str,
    webhook_endpoint_id: Uuid,
    story_id: &'a str,
    ticker: &'a Option<String>,
    version: u64,
    closed: bool,
    story: &'a Option<Value>,
}

/// One line of `--output copy` for a story a stories endpoint notified (`kind`
/// `notification`): how many notifications of it came (1, unless one was sent twice).
#[derive(Debug, Serialize)]
struct NotifiedLine<'a> {
    kind: &'static str,
    webhook_endpoint_id: Uuid,
    story_id: &'a str,
    notifications: u64,
}

/// Who reads a queue, and how: the broker's URL, the connection's name, the consumer's tag,
/// and the most deliveries unacknowledged at once (0: no limit).
pub struct QueueReader<'a> {
    pub url: &'a str,
    pub name: &'a str,
    pub tag: &'a str,
    pub prefetch: u16,
}

impl QueueReader<'_> {
    /// Connects and starts consuming `queue`: the connection (close it when done) and its
    /// deliveries.
    pub async fn open(
        &self,
        queue: &str,
        trust: &TrustRoots,
    ) -> anyhow::Result<(lapin::Connection, lapin::Consumer)> {
        let (connection, _) = connect_any(self.url, 0, self.name, Duration::from_secs(10), trust)
            .await
            .with_context(|| format!("connecting to {}", redact(self.url)))?;
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        let deliveries = channel
            .basic_consume(
                queue,
                self.tag,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("reading queue {queue}"))?;
        Ok((connection, deliveries))
    }
}

/// A queue read across the broker's restarts: deliveries one by one, reconnecting with
/// jittered backoff when the connection or channel is lost (a broker restarting, a connection
/// closed through the management API, a network blip), each loss said on stderr and counted;
/// a permanent refusal (authentication, a queue or vhost that does not exist or is not allowed)
/// ends it with the cause. Deliveries not acknowledged before a loss come again; a consumer
/// that drops repeats (the [`ReferenceConsumer`]) applies each once.
pub struct QueueFollower<'a> {
    reader: QueueReader<'a>,
    queue: String,
    trust: TrustRoots,
    open: Option<(lapin::Connection, lapin::Consumer)>,
    /// The interruptions ridden through so far.
    pub interruptions: Vec<Interruption>,
}

/// A loss of the connection to the broker, and how long the follower was without one.
#[derive(Debug, Clone, Serialize)]
pub struct Interruption {
    /// What was lost, as the broker or the socket said it.
    pub cause: String,
    /// How long until consuming again, in seconds (`None` while not yet back).
    pub away_s: Option<f64>,
}

/// The pauses between tries to connect again: half a second, doubling to 30 s, each with the
/// policy's jitter, so that consumers dropped together do not come back together.
const RECONNECT: RetryPolicy = RetryPolicy {
    first: Duration::from_millis(500),
    max: Duration::from_secs(30),
};

impl<'a> QueueFollower<'a> {
    pub fn new(reader: QueueReader<'a>, queue: &str, trust: &TrustRoots) -> Self {
        Self {
            reader,
            queue: queue.to_owned(),
            trust: trust.clone(),
            open: None,
            interruptions: Vec::new(),
        }
    }

    /// The next delivery; `None` when the broker ended the consumer (its queue deleted).
    pub async fn next(&mut self) -> anyhow::Result<Option<lapin::message::Delivery>> {
        let mut pauses = RECONNECT.pauses();
        let mut lost_at: Option<std::time::Instant> = None;
        loop {
            if self.open.is_none() {
                match self.reader.open(&self.queue, &self.trust).await {
                    Ok(open) => {
                        if let (Some(at), Some(last)) = (lost_at, self.interruptions.last_mut()) {
                            let away = at.elapsed().as_secs_f64();
                            last.away_s = Some(away);
                            eprintln!("{}: consuming again after {away:.1} s", self.reader.name);
                        }
                        self.open = Some(open);
                    }
                    Err(error) => {
                        if let Some(refusal) = permanent_refusal(&error) {
                            return Err(error.context(refusal));
                        }
                        if lost_at.is_none() {
                            self.lost(format!("{error:#}"));
                            lost_at = Some(std::time::Instant::now());
                        }
                        let wait = pauses.next().unwrap_or(RECONNECT.max);
                        eprintln!(
                            "{}: the broker cannot be reached ({error:#}); trying again in                              {:.1} s",
                            self.reader.name,
                            wait.as_secs_f64()
                        );
                        tokio::time::sleep(wait).await;
                        continue;
                    }
                }
            }
            let (_, deliveries) = self.open.as_mut().expect("opened above");
            match deliveries.next().await {
                Some(Ok(delivery)) => return Ok(Some(delivery)),
                None => {
                    let (connection, _) = self.open.take().expect("opened above");
                    if connection.status().connected() {
                        let _ = connection.close(200, "consumer ended").await;
                        return Ok(None);
                    }
                    self.lost("the connection closed".to_owned());
                    lost_at = Some(std::time::Instant::now());
                }
                Some(Err(error)) => {
                    let error = anyhow::Error::from(error);
                    if let Some(refusal) = permanent_refusal(&error) {
                        return Err(error.context(refusal));
                    }
                    self.open = None;
                    self.lost(format!("{error:#}"));
                    lost_at = Some(std::time::Instant::now());
                }
            }
        }
    }

    fn lost(&mut self, cause: String) {
        eprintln!(
            "{}: lost the broker ({cause}); reconnecting",
            self.reader.name
        );
        self.interruptions.push(Interruption {
            cause,
            away_s: None,
        });
    }

    /// Closes the connection (unacknowledged deliveries go back to the queue).
    pub async fn close(self, reason: &str) {
        if let Some((connection, _)) = self.open {
            let _ =
                tokio::time::timeout(Duration::from_secs(2), connection.close(200, reason)).await;
        }
    }
}

/// Why `error` is one that connecting again cannot mend: the broker refused the credentials
/// (403 ACCESS_REFUSED), the queue or vhost does not exist (404 NOT_FOUND) or is not allowed
/// (530 NOT_ALLOWED).
fn permanent_refusal(error: &anyhow::Error) -> Option<String> {
    error.chain().find_map(|cause| {
        let lapin::ErrorKind::ProtocolError(amqp) = cause.downcast_ref::<lapin::Error>()?.kind()
        else {
            return None;
        };
        matches!(amqp.get_id(), 403 | 404 | 530).then(|| {
            format!(
                "the broker refused: {} {}",
                amqp.get_id(),
                amqp.get_message()
            )
        })
    })
}

/// Runs tail until the queue is idle for `idle_exit_ms` or Ctrl-C, printing to `out`.
pub async fn tail(
    args: &TailArgs,
    trust: &TrustRoots,
    out: &mut (dyn Write + Send),
) -> anyhow::Result<ConsumerStats> {
    tail_until(args, trust, out, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}

/// [`tail`], stopping when `stop` completes instead of on Ctrl-C (or when idle, as there).
pub async fn tail_until(
    args: &TailArgs,
    trust: &TrustRoots,
    out: &mut (dyn Write + Send),
    stop: impl Future<Output = ()>,
) -> anyhow::Result<ConsumerStats> {
    let queue = args
        .queue
        .clone()
        .unwrap_or_else(|| tenant_queue(args.tenant));
    // Without acks a prefetch limit would stop the broker after that many: take them all.
    let prefetch = if args.ack { 1_000 } else { 0 };
    let reader = QueueReader {
        url: &args.amqp_url,
        name: "relay tail",
        tag: "relay-tail",
        prefetch,
    };
    let mut follower = QueueFollower::new(reader, &queue, trust);

    let mut consumer = ReferenceConsumer::new(args.tenant);
    for &(endpoint, epoch, seq) in &args.after {
        consumer.resume(endpoint, epoch, seq);
    }
    let idle = (args.idle_exit_ms > 0).then(|| Duration::from_millis(args.idle_exit_ms));
    tokio::pin!(stop);
    loop {
        let next = async {
            match idle {
                Some(idle) => tokio::time::timeout(idle, follower.next()).await.ok(),
                None => Some(follower.next().await),
            }
        };
        let delivery = tokio::select! {
            _ = &mut stop => break,
            next = next => match next {
                None => break,
                Some(next) => match next.context("reading the queue")? {
                    None => break,
                    Some(delivery) => delivery,
                },
            },
        };
        let print_changes = args.output == TailOutput::Changes;
        let mut printed = Ok(());
        let received = consumer.receive_body_with(&delivery.data, &mut |applied| {
            if print_changes && printed.is_ok() {
                printed = serde_json::to_writer(&mut *out, applied)
                    .map_err(anyhow::Error::from)
                    .and_then(|()| Ok(writeln!(out)?));
            }
        });
        printed?;
        if let Err(error) = received {
            tracing::warn!(error = %error, "not a change message; skipped");
        }
        if args.ack {
            delivery.ack(BasicAckOptions::default()).await?;
        }
    }
    if args.output == TailOutput::Copy {
        for (endpoint, replica) in consumer.endpoints() {
            for (subject, item) in &replica.items {
                serde_json::to_writer(
                    &mut *out,
                    &CopyLine {
                        webhook_endpoint_id: *endpoint,
                        subject,
                        item_kind: &item.item_kind,
                        generation: item.generation,
                        sequence: &item.sequence,
                        change_seq: item.change_seq,
                        item: &item.item,
                    },
                )?;
                writeln!(out)?;
            }
            for (story_id, row) in &replica.stories {
                serde_json::to_writer(
                    &mut *out,
                    &StoryCopyLine {
                        kind: "story",
                        webhook_endpoint_id: *endpoint,
                        story_id,
                        ticker: &row.ticker,
                        version: row.version,
                        closed: row.closed,
                        story: &row.story,
                    },
                )?;
                writeln!(out)?;
            }
            for (story_id, epochs) in &replica.notified {
                let notifications: u64 = epochs.values().sum();
                serde_json::to_writer(
                    &mut *out,
                    &NotifiedLine {
                        kind: "notification",
                        webhook_endpoint_id: *endpoint,
                        story_id,
                        notifications,
                    },
                )?;
                writeln!(out)?;
            }
        }
    }
    out.flush()?;
    // Unacknowledged messages go back to the queue as the connection closes.
    let interruptions = std::mem::take(&mut follower.interruptions);
    follower.close("bye").await;
    if !interruptions.is_empty() {
        tracing::info!(?interruptions, "rode through the broker's interruptions");
    }
    for (endpoint, epoch, missing) in consumer.missing() {
        tracing::warn!(%endpoint, epoch, first = missing.start(), last = missing.end(),
                       "changes never came: the changes after them are held, not applied");
    }
    let stats = consumer.stats();
    tracing::info!(?stats, queue, "tail done");
    Ok(stats)
}
