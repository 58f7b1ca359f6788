//! Group commit: concurrent requests' messages share transactions.
//!
//! With synchronous commit on, a commit per message costs a WAL flush and several round trips
//! each. Requests instead hand their message to a queue; a few writer tasks each take whatever
//! has gathered (up to a batch limit), store it in one transaction, and answer every request of
//! the batch once it committed. While one writer commits, the next batch gathers for another, so
//! batches grow with load and latency stays near one commit.
//!
//! Sharing a statement must not let one message fail the others. The handler stores only values
//! that fit their columns, but should Postgres still refuse a batch for a value it holds, the
//! writer stores the batch's halves apart, and their halves, until the message that cannot be
//! stored is alone: only its request fails. Halves are stored in order, so arrival order still
//! follows the order the messages were taken.

use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_coord::{Arrivals, Coming, Gather, GatherLimits, Linger};
use relay_store::cursors::PendingMessage;
use relay_store::messages::{self, IncomingMessage, StoreOutcome};
use relay_store::{KeptConnection, StoreError};
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio::task::JoinHandle;

use crate::config::IngestConfig;
use crate::metrics::IngestMetrics;

/// Why a message could not be stored in time. The request answers 503: nothing was promised.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WriteError {
    #[error("the message store did not commit within the answer deadline")]
    TimedOut,
    #[error("the message store failed: {0}")]
    Failed(String),
    #[error("the front tier is shutting down")]
    ShuttingDown,
}

struct Job {
    message: IncomingMessage,
    reply: oneshot::Sender<Result<StoreOutcome, WriteError>>,
}

#[derive(Clone)]
pub struct BatchWriter {
    queue: mpsc::Sender<Job>,
    arrivals: Arc<Arrivals>,
}

struct Batching {
    waker: Option<relay_coord::Waker>,
    handoff: Option<relay_coord::Handoff<PendingMessage>>,
    /// Messages, weighing their bodies' bytes.
    limits: GatherLimits,
    linger: Linger,
    timeout: Duration,
}

impl BatchWriter {
    pub fn start(
        pool: PgPool,
        config: &IngestConfig,
        metrics: Arc<IngestMetrics>,
    ) -> (Self, Vec<JoinHandle<()>>) {
        let (queue, receiver) = mpsc::channel(config.queue_capacity.max(1));
        let receiver = Arc::new(Mutex::new(receiver));
        let arrivals = Arc::new(Arrivals::default());
        let batching = Arc::new(Batching {
            waker: config.waker.clone(),
            handoff: config.messages_handoff.clone(),
            limits: GatherLimits {
                jobs: config.batch_max_messages.max(1),
                weight: config.batch_max_bytes.max(1),
            },
            linger: Linger {
                arrivals: arrivals.clone(),
                max: config.batch_linger,
            },
            // A batch must end before the requests in it are answered 503 at their deadline.
            timeout: config.answer_deadline,
        });
        let tasks = (0..config.writers.max(1))
            .map(|_| {
                tokio::spawn(write_batches(
                    pool.clone(),
                    receiver.clone(),
                    batching.clone(),
                    metrics.clone(),
                ))
            })
            .collect();
        (Self { queue, arrivals }, tasks)
    }

    /// Counts a message that is on its way to [`BatchWriter::store`] (its request's body is
    /// read), so that the batch being gathered may wait for it; the count ends when the guard
    /// is given to `store` or dropped.
    pub fn coming(&self) -> Coming {
        self.arrivals.coming()
    }

    /// Stores one message, waiting at most until `deadline` for it to commit. `coming` (the
    /// message's count, see [`BatchWriter::coming`]) ends once the message is queued.
    pub async fn store(
        &self,
        message: IncomingMessage,
        deadline: tokio::time::Instant,
        coming: Coming,
    ) -> Result<StoreOutcome, WriteError> {
        let (reply, answer) = oneshot::channel();
        let job = Job { message, reply };
        let queued = tokio::time::timeout_at(deadline, self.queue.send(job)).await;
        if matches!(queued, Ok(Ok(()))) {
            self.arrivals.sent();
        }
        drop(coming);
        match queued {
            Err(_) => return Err(WriteError::TimedOut),
            Ok(Err(_)) => return Err(WriteError::ShuttingDown),
            Ok(Ok(())) => {}
        }
        match tokio::time::timeout_at(deadline, answer).await {
            Err(_) => Err(WriteError::TimedOut),
            Ok(Err(_)) => Err(WriteError::ShuttingDown),
            Ok(Ok(result)) => result,
        }
    }
}

async fn write_batches(
    pool: PgPool,
    receiver: Arc<Mutex<mpsc::Receiver<Job>>>,
    batching: Arc<Batching>,
    metrics: Arc<IngestMetrics>,
) {
    // Batches follow each other closely under load: keep the connection between them.
    let mut connection = KeptConnection::new(pool);
    let mut batches = Gather::new(receiver, batching.limits, |job: &Job| {
        job.message.body.len()
    })
    .lingering(batching.linger.clone());
    loop {
        let Some(jobs) = batches.next().await else {
            return;
        };
        // A request whose deadline passed has already answered 503; storing its message anyway
        // would be harmless (its retry is a duplicate) but is wasted work.
        let jobs: Vec<Job> = jobs.into_iter().filter(|j| !j.reply.is_closed()).collect();
        if jobs.is_empty() {
            continue;
        }
        let deadline = tokio::time::Instant::now() + batching.timeout;
        let mut stored: Vec<uuid::Uuid> = Vec::new();
        // Parts still to store, the next one last.
        let mut parts: Vec<Vec<Job>> = vec![jobs];
        while let Some(mut part) = parts.pop() {
            let batch: Vec<IncomingMessage> = part.iter().map(|j| j.message.clone()).collect();
            let started = Instant::now();
            let result = tokio::time::timeout_at(deadline, async {
                let mut taken = connection.take().await.map_err(StoreError::from)?;
                let outcomes = messages::store_batch(&mut *taken, &batch).await?;
                Ok::<_, StoreError>((outcomes, taken))
            })
            .await;
            metrics
                .batch_seconds
                .observe(started.elapsed().as_secs_f64());
            metrics.batch_messages.observe(batch.len() as f64);
            match result {
                Ok(Ok((outcomes, taken))) => {
                    connection.keep(taken);
                    for (job, outcome) in part.into_iter().zip(outcomes) {
                        if let StoreOutcome::Stored { arrival_seq } = outcome {
                            if !batching.hand_over(&job.message, arrival_seq) {
                                stored.push(job.message.endpoint_id);
                            }
                        }
                        let _ = job.reply.send(Ok(outcome));
                    }
                }
                Ok(Err(error)) if part.len() > 1 && refused_for_a_value(&error) => {
                    tracing::warn!(%error, messages = part.len(), "a batch was refused for a value it holds; storing its halves apart");
                    let second = part.split_off(part.len() / 2);
                    parts.push(second);
                    parts.push(part);
                }
                Ok(Err(error)) => {
                    // The connection went with the error: a broken one is not kept.
                    tracing::warn!(%error, messages = part.len(), "storing a batch failed");
                    let error = WriteError::Failed(error.to_string());
                    for job in part {
                        let _ = job.reply.send(Err(error.clone()));
                    }
                }
                Err(_) => {
                    // The transaction future was dropped: its connection is closed rather than
                    // returned, and Postgres rolls back whatever it had begun.
                    tracing::warn!(messages = part.len(), "storing a batch timed out");
                    for job in part.into_iter().chain(parts.drain(..).flatten()) {
                        let _ = job.reply.send(Err(WriteError::TimedOut));
                    }
                }
            }
        }
        if let Some(waker) = batching.waker.as_ref().filter(|_| !stored.is_empty()) {
            stored.sort_unstable();
            stored.dedup();
            let waker = waker.clone();
            // After the answers: a lost wake-up only waits for the sequencer's sweep.
            tokio::spawn(async move {
                if let Err(error) = waker.wake(&stored).await {
                    tracing::debug!(%error, "wake-up not published");
                }
            });
        }
    }
}

impl Batching {
    /// Hands a message just committed to this process's sequencer worker for its endpoint;
    /// `false` when none takes it (then it is announced). A taken message needs no wake-up:
    /// the offer wakes the worker, and a worker that lets go with it untaken announces it.
    fn hand_over(&self, message: &IncomingMessage, arrival_seq: i64) -> bool {
        let Some(handoff) = &self.handoff else {
            return false;
        };
        // As Postgres keeps it (microseconds), so the worker sees what a read would give.
        let received_at = message.received_at;
        let received_at = received_at
            .replace_nanosecond(received_at.nanosecond() / 1_000 * 1_000)
            .unwrap_or(received_at);
        let pending = PendingMessage {
            arrival_seq,
            received_at,
            body: message.body.to_vec(),
        };
        handoff.offer(
            message.endpoint_id,
            vec![pending],
            MESSAGE_ROW_BYTES + message.body.len(),
        )
    }
}

/// What a handed message weighs besides its body.
const MESSAGE_ROW_BYTES: usize = 64;

/// True when Postgres refused the statement for a value it was given (SQLSTATE classes 22,
/// data exception; 23, integrity constraint; 54, program limit exceeded, such as an index row
/// too large), or the store found one message's endpoint in a state it cannot store for: the
/// same batch without that message would be stored. Not for a lost connection, a timeout or
/// a server shutting down, which fail every part alike.
fn refused_for_a_value(error: &StoreError) -> bool {
    match error {
        StoreError::Database(sqlx::Error::Database(database)) => {
            database.code().is_some_and(|code| {
                ["22", "23", "54"]
                    .iter()
                    .any(|class| code.starts_with(class))
            })
        }
        StoreError::Invalid(_) => true,
        _ => false,
    }
}
