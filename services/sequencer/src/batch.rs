//! Group commit for apply transactions: runs of different endpoints of one source kind share
//! one (and so do the reads of their pending messages, whatever their kind).
//!
//! At a steady rate spread over many endpoints, most runs are one message: applied alone, each
//! costs a transaction of its own (two statements, a commit and its WAL flush). Workers instead
//! hand their prepared runs to a queue; a few appliers each take whatever has gathered (up to a
//! limit, each endpoint once) and apply it with [`apply_runs`], which still decides every run by
//! itself under its own locks and answers each worker with its own run's outcome. While one
//! applier commits, the next batch gathers for another, so batches grow with load and latency
//! stays near one transaction. [`PendingReader`] does the same for the read that comes before:
//! the workers looking for messages at one moment share one statement.

use std::future::Future;
use std::sync::Arc;

use relay_coord::{Gather, GatherLimits, Waker};
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::apply::{ApplyError, BatchReport};
use crate::metrics::SequencerMetrics;
use relay_store::cursors::PendingMessage;
use relay_store::{EndpointId, TenantId};

/// A source kind's run of one endpoint's messages, ready to apply beside other endpoints' runs
/// of the same kind: its reads done, nothing left but its transaction.
pub trait BatchedRun: Send + Sync + Sized + 'static {
    /// The endpoint whose run it is, and its tenant.
    fn key(&self) -> (TenantId, EndpointId);
    /// The run's messages.
    fn pending(&self) -> &[PendingMessage];
    /// Applies `runs` (each endpoint once) in one transaction, answering each in the order
    /// given: a run whose fence moved on, or that failed by itself, is answered so and the
    /// others still commit. `Err` when the transaction failed as a whole: nothing of it
    /// committed.
    fn apply_together(
        pool: &PgPool,
        runs: &[&Self],
        metrics: &SequencerMetrics,
    ) -> impl Future<Output = Result<Vec<Result<BatchReport, ApplyError>>, ApplyError>> + Send;
}

/// Applies several endpoints' runs (each endpoint once), answering each run in the order given.
///
/// They are tried in one transaction ([`BatchedRun::apply_together`]). When that transaction
/// fails as a whole (an error, or a write refused because a row changed under it), nothing of
/// it committed, and each run is tried again alone, so one endpoint's trouble is answered to
/// that endpoint only; a run refused for a row that changed under it ([`ApplyError::Raced`]) is
/// decided again once more at once, in a fresh statement that sees the row.
pub async fn apply_runs<R: BatchedRun>(
    pool: &PgPool,
    runs: Vec<R>,
    metrics: &SequencerMetrics,
) -> Vec<Result<BatchReport, ApplyError>> {
    let all: Vec<&R> = runs.iter().collect();
    match R::apply_together(pool, &all, metrics).await {
        Ok(answers) => answers,
        Err(error) if runs.len() == 1 && !matches!(error, ApplyError::Raced) => vec![Err(error)],
        Err(error) => {
            tracing::debug!(%error, runs = runs.len(), "runs applied together failed; alone now");
            metrics.apply_batches_split.inc();
            let mut answers = Vec::with_capacity(runs.len());
            for run in &runs {
                let mut answer = R::apply_together(pool, &[run], metrics).await;
                if matches!(answer, Err(ApplyError::Raced)) {
                    answer = R::apply_together(pool, &[run], metrics).await;
                }
                answers.push(match answer {
                    Ok(mut answer) => answer.pop().expect("one answer per run"),
                    Err(error) => Err(error),
                });
            }
            answers
        }
    }
}

struct Job<R> {
    run: R,
    reply: oneshot::Sender<Result<BatchReport, ApplyError>>,
}

/// The workers' way to the appliers of one kind's runs (cheap to clone).
pub struct ApplyBatcher<R> {
    queue: mpsc::Sender<Job<R>>,
}

impl<R> Clone for ApplyBatcher<R> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
        }
    }
}

impl<R> std::fmt::Debug for ApplyBatcher<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApplyBatcher").finish_non_exhaustive()
    }
}

/// Why a run handed to the batcher has no answer.
#[derive(Debug, thiserror::Error)]
#[error("the sequencer's appliers have stopped")]
pub struct BatcherStopped;

impl<R: BatchedRun> ApplyBatcher<R> {
    /// Starts `appliers` tasks taking up to `max_runs` runs, and no more runs once they hold
    /// `max_messages` messages, a transaction (long runs, a backlog's, need no company: their
    /// cost per message is low already, and a huge transaction only delays every run in it).
    /// They end when every clone of the batcher is dropped and the queue is empty.
    /// `changes_waker` announces to the publisher the endpoints a transaction appended changes
    /// to, once it committed.
    pub fn start(
        pool: PgPool,
        appliers: usize,
        (max_runs, max_messages): (usize, usize),
        changes_waker: Option<Waker>,
        metrics: SequencerMetrics,
    ) -> (Self, Vec<JoinHandle<()>>) {
        let (queue, receiver) = mpsc::channel(1024);
        let receiver = Arc::new(Mutex::new(receiver));
        let tasks = (0..appliers.max(1))
            .map(|_| {
                tokio::spawn(apply_batches(
                    pool.clone(),
                    receiver.clone(),
                    GatherLimits {
                        jobs: max_runs.max(1),
                        weight: max_messages.max(1),
                    },
                    changes_waker.clone(),
                    metrics.clone(),
                ))
            })
            .collect();
        (Self { queue }, tasks)
    }

    /// Applies one prepared run, beside whatever other endpoints' runs are waiting.
    pub async fn apply(&self, run: R) -> Result<BatchReport, ApplyError> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Job { run, reply })
            .await
            .map_err(|_| ApplyError::Stopped(BatcherStopped))?;
        answer
            .await
            .map_err(|_| ApplyError::Stopped(BatcherStopped))?
    }
}

async fn apply_batches<R: BatchedRun>(
    pool: PgPool,
    receiver: Arc<Mutex<mpsc::Receiver<Job<R>>>>,
    limits: GatherLimits,
    changes_waker: Option<Waker>,
    metrics: SequencerMetrics,
) {
    let mut batches = Gather::new(receiver, limits, |job: &Job<R>| job.run.pending().len());
    loop {
        // Runs of an endpoint already in the batch wait for the next one: two runs of one
        // endpoint in one statement would write its rows twice.
        let Some(batch) = batches.next_distinct(|job| job.run.key().1).await else {
            return;
        };
        metrics.apply_batch_runs.observe(batch.len() as f64);
        let keys: Vec<(TenantId, EndpointId)> = batch.iter().map(|job| job.run.key()).collect();
        let (runs, replies): (Vec<R>, Vec<_>) =
            batch.into_iter().map(|job| (job.run, job.reply)).unzip();
        let answers = apply_runs(&pool, runs, &metrics).await;
        let mut announced: Vec<String> = Vec::new();
        for ((reply, answer), (tenant, endpoint)) in replies.into_iter().zip(answers).zip(keys) {
            if answer.as_ref().is_ok_and(|report| report.changes > 0) {
                announced.push(relay_coord::change_payload(tenant, endpoint));
            }
            // A worker that stopped waiting has nothing to learn.
            let _ = reply.send(answer);
        }
        if let (Some(waker), false) = (&changes_waker, announced.is_empty()) {
            // Best effort: a lost announcement only means the publisher's poll finds them.
            if let Err(error) = waker.publish(&announced).await {
                tracing::debug!(%error, "could not announce new changes");
            }
        }
    }
}

/// Each endpoint's pending messages, as [`relay_store::cursors::pending_messages`] reads them.
type PendingRead = Result<(i64, Vec<PendingMessage>), ApplyError>;

struct ReadJob {
    endpoint: EndpointId,
    applied: i64,
    reply: oneshot::Sender<PendingRead>,
}

/// Group reads of pending messages: the workers that look for messages at the same moment
/// share one statement ([`relay_store::cursors::pending_messages_many`]) instead of a round trip each.
#[derive(Clone)]
pub struct PendingReader {
    queue: mpsc::Sender<ReadJob>,
}

impl std::fmt::Debug for PendingReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingReader").finish_non_exhaustive()
    }
}

impl PendingReader {
    /// Starts `readers` tasks, each reading for up to `max_endpoints` endpoints at once, at
    /// most `limit` messages each.
    pub fn start(
        pool: PgPool,
        readers: usize,
        max_endpoints: usize,
        limit: i64,
    ) -> (Self, Vec<JoinHandle<()>>) {
        let (queue, receiver) = mpsc::channel(1024);
        let receiver = Arc::new(Mutex::new(receiver));
        let tasks = (0..readers.max(1))
            .map(|_| {
                tokio::spawn(read_batches(
                    pool.clone(),
                    receiver.clone(),
                    max_endpoints.max(1),
                    limit,
                ))
            })
            .collect();
        (Self { queue }, tasks)
    }

    /// The endpoint's arrival counter and its messages after `applied` (see
    /// [`relay_store::cursors::pending_messages`]).
    pub async fn read(&self, endpoint: EndpointId, applied: i64) -> PendingRead {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(ReadJob {
                endpoint,
                applied,
                reply,
            })
            .await
            .map_err(|_| ApplyError::Stopped(BatcherStopped))?;
        answer
            .await
            .map_err(|_| ApplyError::Stopped(BatcherStopped))?
    }
}

async fn read_batches(
    pool: PgPool,
    receiver: Arc<Mutex<mpsc::Receiver<ReadJob>>>,
    max_endpoints: usize,
    limit: i64,
) {
    // Reads follow each other closely under load: keep the connection between them.
    let mut connection = relay_store::KeptConnection::new(pool);
    let limits = GatherLimits {
        jobs: max_endpoints,
        weight: usize::MAX,
    };
    let mut batches = Gather::new(receiver, limits, |_| 1);
    loop {
        let Some(batch) = batches.next_distinct(|job| job.endpoint).await else {
            return;
        };
        let cursors: Vec<(Uuid, i64)> = batch.iter().map(|j| (j.endpoint.0, j.applied)).collect();
        let read = match connection.take().await {
            Ok(mut taken) => {
                let read =
                    relay_store::cursors::pending_messages_many(&mut taken, &cursors, limit).await;
                if read.is_ok() {
                    connection.keep(taken);
                }
                read
            }
            Err(error) => Err(error.into()),
        };
        match read {
            Ok(mut found) => {
                for job in batch {
                    let read = found.remove(&job.endpoint.0).unwrap_or((0, Vec::new()));
                    let _ = job.reply.send(Ok(read));
                }
            }
            Err(error) => {
                let error = error.to_string();
                for job in batch {
                    let _ = job.reply.send(Err(ApplyError::PendingRead(error.clone())));
                }
            }
        }
    }
}
