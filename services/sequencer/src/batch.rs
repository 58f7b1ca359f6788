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
//!
//! Once a transaction committed, its new changes are the publisher's: handed to this process's
//! publisher in memory ([`Announce::handoff`]) when its task owns the tenant and has room, so it
//! need not read them back; announced through Redis ([`Announce::waker`]) otherwise, for
//! whichever publisher owns the tenant to read them from the outbox.

use std::future::Future;
use std::sync::Arc;

use relay_coord::{Arrivals, Coming, Gather, GatherLimits, Linger, Waker};
use relay_store::KeptConnection;
use sqlx::{PgConnection, PgPool};
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::apply::{ApplyError, BatchReport};
use crate::metrics::SequencerMetrics;
use relay_store::changes::Unpublished;
use relay_store::cursors::PendingMessage;
use relay_store::{EndpointId, TenantId};

/// A source kind's run of one endpoint's messages, ready to apply beside other endpoints' runs
/// of the same kind: its reads done, nothing left but its transaction.
pub trait BatchedRun: Send + Sync + Sized + 'static {
    /// The endpoint whose run it is, and its tenant.
    fn key(&self) -> (TenantId, EndpointId);
    /// The run's messages.
    fn pending(&self) -> &[PendingMessage];
    /// Applies `runs` (each endpoint once) in one transaction on `conn`, answering each in the
    /// order given: a run whose fence moved on, or that failed by itself, is answered so and
    /// the others still commit. `Err` when the transaction failed as a whole: nothing of it
    /// committed.
    fn apply_together(
        conn: &mut PgConnection,
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
    connection: &mut KeptConnection,
    runs: Vec<R>,
    metrics: &SequencerMetrics,
) -> Vec<Result<BatchReport, ApplyError>> {
    let all: Vec<&R> = runs.iter().collect();
    match attempt(connection, &all, metrics).await {
        Ok(answers) => answers,
        Err(error) if runs.len() == 1 && !matches!(error, ApplyError::Raced) => vec![Err(error)],
        Err(error) => {
            tracing::debug!(%error, runs = runs.len(), "runs applied together failed; alone now");
            metrics.apply_batches_split.inc();
            let mut answers = Vec::with_capacity(runs.len());
            for run in &runs {
                let mut answer = attempt(connection, &[run], metrics).await;
                if matches!(answer, Err(ApplyError::Raced)) {
                    answer = attempt(connection, &[run], metrics).await;
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

/// One try of [`BatchedRun::apply_together`] on the applier's connection, which is kept for the
/// next try unless the error may have broken it. A connection goes back to the pool only when
/// it has been idle a while ([`KeptConnection`]): sqlx checks each one it takes back with a
/// round trip of its own, which per transaction would cost as much as a statement.
async fn attempt<R: BatchedRun>(
    connection: &mut KeptConnection,
    runs: &[&R],
    metrics: &SequencerMetrics,
) -> Result<Vec<Result<BatchReport, ApplyError>>, ApplyError> {
    let mut conn = connection.take().await?;
    let answer = R::apply_together(&mut conn, runs, metrics).await;
    if !answer
        .as_ref()
        .is_err_and(ApplyError::may_have_broken_the_connection)
    {
        connection.keep(conn);
    }
    answer
}

struct Job<R> {
    run: R,
    reply: oneshot::Sender<Result<BatchReport, ApplyError>>,
}

/// The workers' way to the appliers of one kind's runs (cheap to clone).
pub struct ApplyBatcher<R> {
    queue: mpsc::Sender<Job<R>>,
    arrivals: Arc<Arrivals>,
}

impl<R> Clone for ApplyBatcher<R> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            arrivals: self.arrivals.clone(),
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
    /// cost per message is low already, and a huge transaction only delays every run in it),
    /// each transaction waiting at most `linger` for more runs (relay-coord's [`Linger`]).
    /// They end when every clone of the batcher is dropped and the queue is empty.
    /// `announce` gives the publisher the changes a transaction appended, once it committed.
    pub fn start(
        pool: PgPool,
        (appliers, linger): (usize, std::time::Duration),
        (max_runs, max_messages): (usize, usize),
        announce: Announce,
        metrics: SequencerMetrics,
    ) -> (Self, Vec<JoinHandle<()>>) {
        let (queue, receiver) = mpsc::channel(1024);
        let receiver = Arc::new(Mutex::new(receiver));
        let arrivals = Arc::new(Arrivals::default());
        let linger = Linger {
            arrivals: arrivals.clone(),
            max: linger,
        };
        let tasks = (0..appliers.max(1))
            .map(|_| {
                tokio::spawn(apply_batches(
                    pool.clone(),
                    receiver.clone(),
                    (
                        GatherLimits {
                            jobs: max_runs.max(1),
                            weight: max_messages.max(1),
                        },
                        linger.clone(),
                    ),
                    announce.clone(),
                    metrics.clone(),
                ))
            })
            .collect();
        (Self { queue, arrivals }, tasks)
    }

    /// Counts a run on its way to [`ApplyBatcher::apply`] (its worker has messages in hand),
    /// so that the transaction being gathered may wait for it; the count ends when the guard is
    /// given to `apply` or dropped.
    pub fn coming(&self) -> Coming {
        self.arrivals.coming()
    }

    /// Applies one prepared run, beside whatever other endpoints' runs are waiting. `coming`
    /// (the run's count, see [`ApplyBatcher::coming`]) ends once the run is queued.
    pub async fn apply(&self, run: R, coming: Coming) -> Result<BatchReport, ApplyError> {
        let (reply, answer) = oneshot::channel();
        let queued = self.queue.send(Job { run, reply }).await;
        if queued.is_ok() {
            self.arrivals.sent();
        }
        drop(coming);
        queued.map_err(|_| ApplyError::Stopped(BatcherStopped))?;
        answer
            .await
            .map_err(|_| ApplyError::Stopped(BatcherStopped))?
    }
}

/// How the appliers give the publisher the changes they committed.
#[derive(Clone, Default)]
pub struct Announce {
    /// This process's publisher, when it runs here: the changes themselves, to the task that
    /// owns their tenant.
    pub handoff: Option<relay_coord::Handoff<Unpublished>>,
    /// Redis: which endpoints have new changes, for whichever publisher owns their tenant.
    pub waker: Option<Waker>,
}

impl Announce {
    /// Hands `appended` (one endpoint's new changes, in order) to this process's publisher;
    /// `false` when it does not take them (then announce the endpoint).
    fn hand_over(&self, tenant: TenantId, appended: Vec<Unpublished>) -> bool {
        let Some(handoff) = &self.handoff else {
            return false;
        };
        if appended.is_empty() {
            return false;
        }
        let bytes = appended.iter().map(change_weight).sum();
        handoff.offer(tenant.0, appended, bytes)
    }
}

/// What a change held in memory weighs: its texts, and the rest of its row.
fn change_weight(change: &Unpublished) -> usize {
    const ROW: usize = 256;
    ROW + change.item.as_ref().map_or(0, String::len)
        + change.parts_diff.len()
        + change.subject.len()
}

async fn apply_batches<R: BatchedRun>(
    pool: PgPool,
    receiver: Arc<Mutex<mpsc::Receiver<Job<R>>>>,
    (limits, linger): (GatherLimits, Linger),
    announce: Announce,
    metrics: SequencerMetrics,
) {
    let mut batches =
        Gather::new(receiver, limits, |job: &Job<R>| job.run.pending().len()).lingering(linger);
    let mut connection = KeptConnection::new(pool);
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
        let answers = apply_runs(&mut connection, runs, &metrics).await;
        let mut announced: Vec<String> = Vec::new();
        for ((reply, mut answer), (tenant, endpoint)) in replies.into_iter().zip(answers).zip(keys)
        {
            if let Ok(report) = &mut answer {
                let appended = std::mem::take(&mut report.appended);
                if report.changes > 0 && !announce.hand_over(tenant, appended) {
                    announced.push(relay_coord::change_payload(tenant, endpoint));
                }
            }
            // A worker that stopped waiting has nothing to learn.
            let _ = reply.send(answer);
        }
        if let (Some(waker), false) = (&announce.waker, announced.is_empty()) {
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
