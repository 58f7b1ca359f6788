//! Group commit for apply transactions: runs of different endpoints share one (and so do the
//! reads of their pending messages).
//!
//! At a steady rate spread over many endpoints, most runs are one message: applied alone, each
//! costs a transaction of its own (two statements, a commit and its WAL flush). Workers instead
//! hand their prepared runs to a queue; a few appliers each take whatever has gathered (up to a
//! limit, each endpoint once) and apply it with [`apply_runs`], which still decides every run by
//! itself under its own locks and answers each worker with its own run's outcome. While one
//! applier commits, the next batch gathers for another, so batches grow with load and latency
//! stays near one transaction. [`PendingReader`] does the same for the read that comes before:
//! the workers looking for messages at one moment share one statement.

use std::sync::Arc;

use relay_coord::{Gather, GatherLimits, Waker};
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::apply::{apply_runs, ApplyError, BatchReport, PreparedRun};
use crate::metrics::SequencerMetrics;
use relay_store::cursors::PendingMessage;
use relay_store::{EndpointId, TenantId};

struct Job {
    run: PreparedRun,
    reply: oneshot::Sender<Result<BatchReport, ApplyError>>,
}

/// The workers' way to the appliers (cheap to clone).
#[derive(Clone)]
pub struct ApplyBatcher {
    queue: mpsc::Sender<Job>,
}

impl std::fmt::Debug for ApplyBatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApplyBatcher").finish_non_exhaustive()
    }
}

/// Why a run handed to the batcher has no answer.
#[derive(Debug, thiserror::Error)]
#[error("the sequencer's appliers have stopped")]
pub struct BatcherStopped;

impl ApplyBatcher {
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
    pub async fn apply(&self, run: PreparedRun) -> Result<BatchReport, ApplyError> {
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

async fn apply_batches(
    pool: PgPool,
    receiver: Arc<Mutex<mpsc::Receiver<Job>>>,
    limits: GatherLimits,
    changes_waker: Option<Waker>,
    metrics: SequencerMetrics,
) {
    let mut batches = Gather::new(receiver, limits, |job: &Job| job.run.messages());
    loop {
        // Runs of an endpoint already in the batch wait for the next one: two runs of one
        // endpoint in one statement would write its rows twice.
        let Some(batch) = batches.next_distinct(|job| job.run.endpoint()).await else {
            return;
        };
        metrics.apply_batch_runs.observe(batch.len() as f64);
        let keys: Vec<(TenantId, EndpointId)> = batch
            .iter()
            .map(|job| (job.run.tenant(), job.run.endpoint()))
            .collect();
        let (runs, replies): (Vec<PreparedRun>, Vec<_>) =
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
