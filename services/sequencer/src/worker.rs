//! One endpoint, owned: apply its messages in arrival order, run its kind's background job
//! beside them, hold the lease, and let go when there is nothing left to do. Written once for
//! every source kind ([`crate::source`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use relay_coord::{Held, Owners};
use relay_netguard::RetryPolicy;
use relay_rules::{decide_failed_apply, ApplyBackoff, FailedApply};
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::apply::ApplyError;
use crate::batch::ApplyBatcher;
use crate::metrics::SequencerMetrics;
use crate::reload::{ReloadLimits, StopReload};
use crate::slots::{Slot, Slots};
use crate::source::{Applied, JobEnded, Owned, SourceKind, Tried};
use relay_store::cursors::PendingMessage;
use relay_store::endpoints::{self, EndpointRegistration};
use relay_store::{cursors, EndpointId, TenantId};

/// What the scheduler and the endpoint's worker share.
#[derive(Default)]
pub struct WorkerSignal {
    /// Wakes the worker when new messages are stored for its endpoint.
    pub notify: Notify,
    /// Counts wake-ups, so the scheduler can tell one arrived after the worker's last look.
    pub wakes: AtomicU64,
    /// Set when the endpoint's registration changed: the worker reads it again.
    registration_changed: AtomicBool,
    /// When the worker began to wait with nothing to do (milliseconds of the process's
    /// [`IdleClock`]; 0 while it has work, or a job, or a reason to stay).
    pub(crate) idle_since: AtomicU64,
    /// Set by the scheduler when the process holds too many idle endpoints: the worker lets its
    /// endpoint go as soon as it is idle.
    pub(crate) let_go: AtomicBool,
}

/// The milliseconds [`WorkerSignal`]s count idleness in: since the process's scheduler began
/// (never 0, which means "not idle").
#[derive(Debug, Clone, Copy)]
pub(crate) struct IdleClock(std::time::Instant);

impl IdleClock {
    pub(crate) fn new() -> Self {
        Self(std::time::Instant::now())
    }

    fn now(self) -> u64 {
        u64::try_from(self.0.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }
}

impl WorkerSignal {
    /// Since when the worker has been idle (its [`IdleClock`]'s milliseconds), if it is.
    pub(crate) fn idle_since(&self) -> Option<u64> {
        Some(self.idle_since.load(Ordering::SeqCst)).filter(|&since| since > 0)
    }

    /// Asks the worker to let its endpoint go once it is idle (now, if it is).
    pub(crate) fn let_go(&self) {
        self.let_go.store(true, Ordering::SeqCst);
        self.notify.notify_one();
    }

    pub fn wake(&self) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        self.notify.notify_one();
    }

    /// The endpoint's registration changed (or may have: notifications were lost): the worker
    /// reads it again before its next step.
    pub fn registration_changed(&self) {
        self.registration_changed.store(true, Ordering::SeqCst);
        self.wake();
    }

    /// Whether the registration changed since the last call.
    pub(crate) fn take_registration_changed(&self) -> bool {
        self.registration_changed.swap(false, Ordering::SeqCst)
    }
}

/// How a worker behaves (see `SequencerConfig` for the defaults).
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Opens the endpoints' sealed upstream API keys.
    pub keys: relay_store::Keyring,
    /// Announces new changes to the publisher (see [`relay_coord::changes_channel`]).
    pub changes_waker: Option<relay_coord::Waker>,
    /// The shared apply transactions of each kind's runs.
    pub feed_runs: ApplyBatcher<crate::apply::PreparedRun>,
    pub stories_runs: ApplyBatcher<crate::stories::PreparedStoriesRun>,
    /// The shared reads of pending messages (`None`: each worker reads its own). Reads at most
    /// `messages_per_read` per endpoint, as the worker does.
    pub reader: Option<crate::batch::PendingReader>,
    /// The front tier of this process hands stored messages over here (`relay all`).
    pub messages_handoff: Option<relay_coord::Handoff<PendingMessage>>,
    pub messages_per_read: i64,
    pub idle_linger: Duration,
    /// What the workers' idleness is counted in (see [`WorkerSignal::idle_since`]).
    pub(crate) idle_clock: IdleClock,
    pub reload_retry: RetryPolicy,
    /// The process's bounds on reload passes (and stories endpoints' syncs), shared by every
    /// worker.
    pub(crate) reloads: ReloadLimits,
    pub error_pause: Duration,
    /// Items per `/v1/feed` page a reload asks for.
    pub feed_page_limit: usize,
    /// Tries of a message whose apply fails before it is quarantined, and the waits between.
    pub apply_attempts: u32,
    pub apply_backoff: ApplyBackoff,
    /// A stories endpoint's story reads: tries, and reads owed.
    pub story_reads: crate::stories::StoryReadRetry,
    /// How often a stories endpoint catches up, and since when every one is due (the
    /// process's start).
    pub stories_catch_up: (Duration, time::OffsetDateTime),
}

/// How a worker ended: the wake count it had seen last (the scheduler starts it again when more
/// arrived since).
pub struct WorkerExit {
    pub endpoint: Uuid,
    pub wakes_seen: u64,
}

/// The endpoint's background job, running.
struct RunningJob<K: SourceKind> {
    job: K::Job,
    stop: StopReload,
    task: JoinHandle<Result<K::End, ApplyError>>,
}

/// The endpoint's next message while its apply keeps failing.
struct NextFailing {
    arrival_seq: i64,
    attempts: u32,
}

/// An endpoint given to a worker by the scheduler, with what the worker works it with.
pub(crate) struct Assignment {
    pub pool: PgPool,
    pub owners: Owners,
    pub http: relay_netguard::GuardedClient,
    pub registration: EndpointRegistration,
    pub signal: Arc<WorkerSignal>,
    pub config: WorkerConfig,
    pub metrics: SequencerMetrics,
    /// Set when the sequencer stops.
    pub stopping: Arc<AtomicBool>,
    /// The process's slots, and the one this worker took.
    pub slots: (Arc<Slots>, Slot),
}

/// Owns the endpoint if nobody else does, and works it until idle: its messages by its kind
/// `K`, and `K`'s background job beside them (see [`crate::source`] for the calls it makes).
pub(crate) async fn run_worker<K: SourceKind>(assignment: Assignment) -> WorkerExit {
    let Assignment {
        pool,
        owners,
        http,
        registration,
        signal,
        config,
        metrics,
        stopping,
        slots: (slots, slot),
    } = assignment;
    // The slot bounds endpoints being *worked* at once; an idle worker lingering for more
    // messages, or waiting to try a failed message again, gives it back, so waiting never
    // starves endpoints that have work.
    let endpoint = registration.id;
    let tenant = registration.tenant_id;
    let mut permit = Some(slot);
    let mut wakes_seen = signal.wakes.load(Ordering::SeqCst);
    let exit = |wakes_seen| WorkerExit {
        endpoint: endpoint.0,
        wakes_seen,
    };
    let held = match owners.hold(endpoint.0).await {
        Ok(Some(held)) => held,
        Ok(None) => return exit(wakes_seen),
        Err(error) => {
            tracing::warn!(%endpoint, %error, "could not take the endpoint's lock");
            return exit(wakes_seen);
        }
    };
    metrics.endpoints_owned.inc();
    // Opened once the endpoint is held: what the front tier of this process stores for it from
    // now on comes here, and what it stored before was announced and is read from Postgres.
    let mut handed = Handed {
        inbox: config
            .messages_handoff
            .as_ref()
            .map(|handoff| handoff.open(endpoint.0)),
        next: Vec::new(),
    };
    let owned = Owned {
        pool: &pool,
        token: held.token(),
        config: &config,
        metrics: &metrics,
    };
    let mut kind = match K::open(registration, http, &owned).await {
        Ok(kind) => kind,
        Err(error) => {
            tracing::warn!(%endpoint, %error, "could not open the endpoint's work");
            if handed.close() {
                signal.wake();
            }
            return finish::<K>(held, None, &metrics, exit(wakes_seen)).await;
        }
    };
    let mut job: Option<RunningJob<K>> = None;
    // A job retries its own failures; one that ends in a failure anyway (or panics) is started
    // again only after a pause, growing while that repeats, so it never spins. Until then the
    // worker waits for the pause rather than letting go (the sweep would start a new worker,
    // and the job, at once).
    let mut job_pauses = config.reload_retry.pauses();
    let mut job_after: Option<tokio::time::Instant> = None;
    let mut cursor: Option<i64> = None;
    // After a run failed in a way its messages may have caused: apply the next message alone,
    // so that a failure is that message's (and the messages before it still apply).
    let mut next_alone = false;
    let mut failing: Option<NextFailing> = None;

    loop {
        if held.is_lost() {
            metrics.lock_losses.inc();
            tracing::warn!(%endpoint, "the endpoint's lock was lost: stopping");
            break;
        }
        if stopping.load(Ordering::SeqCst) {
            break;
        }
        if permit.is_none() {
            permit = Some(slots.take(tenant).await);
        }
        wakes_seen = signal.wakes.load(Ordering::SeqCst);
        if signal.take_registration_changed() {
            match endpoints::load_registration(&pool, &config.keys, endpoint).await {
                Ok(Some(registration)) => {
                    tracing::info!(%endpoint, upstream = registration.upstream_base_url.is_some(),
                        "the endpoint's registration changed");
                    kind.update(&registration);
                }
                // Removed: nothing more to do for it here.
                Ok(None) => break,
                Err(error) => {
                    tracing::warn!(%endpoint, %error, "reading the registration failed; retrying");
                    signal.registration_changed.store(true, Ordering::SeqCst);
                    tokio::time::sleep(config.error_pause).await;
                    continue;
                }
            }
        }
        let mut tried = Tried::default();
        let step = apply_available(
            &mut kind,
            &owned,
            (&mut cursor, &mut handed),
            next_alone,
            &mut tried,
        )
        .await;
        if step.is_err() {
            // Its commit may or may not have happened: read the cursor again.
            cursor = None;
        }
        let applied = match step {
            Ok(applied) => {
                next_alone = false;
                applied
            }
            Err(error @ (ApplyError::Fenced | ApplyError::CursorMoved)) => {
                metrics.lock_losses.inc();
                tracing::info!(%endpoint, %error, "lost the endpoint to another worker");
                break;
            }
            Err(error) if error.may_be_the_message() => {
                let Some((applied, arrival_seq)) = tried.alone else {
                    if !next_alone {
                        tracing::info!(%endpoint, %error,
                            "a run failed; its next message alone now");
                        next_alone = true;
                    } else {
                        // Failed before any message was tried: nothing to count it against.
                        tracing::warn!(%endpoint, %error, "applying messages failed; retrying");
                        tokio::time::sleep(config.error_pause).await;
                    }
                    continue;
                };
                next_alone = true;
                metrics.apply_failures.inc();
                let attempts = match &failing {
                    Some(f) if f.arrival_seq == arrival_seq => f.attempts + 1,
                    _ => 1,
                };
                failing = Some(NextFailing {
                    arrival_seq,
                    attempts,
                });
                let decision = decide_failed_apply(
                    attempts,
                    config.apply_attempts,
                    config.apply_backoff,
                    rand::random::<f64>(),
                );
                match decision {
                    FailedApply::RetryAfter(wait) => {
                        tracing::warn!(%endpoint, arrival_seq, attempts, %error, ?wait,
                            "applying the message failed; it is tried again");
                        // Waits holding only the lock: the slot goes to endpoints with work.
                        permit = None;
                        wait_or_stop(&signal, &stopping, &held, wait).await;
                    }
                    FailedApply::Quarantine => {
                        let quarantined = kind
                            .quarantine(
                                &owned,
                                (applied, arrival_seq),
                                (attempts, error.to_string()),
                            )
                            .await;
                        match quarantined {
                            Ok(()) => {
                                failing = None;
                                next_alone = false;
                                cursor = Some(arrival_seq);
                            }
                            Err(error @ (ApplyError::Fenced | ApplyError::CursorMoved)) => {
                                metrics.lock_losses.inc();
                                tracing::info!(%endpoint, %error,
                                    "lost the endpoint to another worker");
                                break;
                            }
                            Err(error) => {
                                // Still failing when tried next: quarantined then.
                                tracing::warn!(%endpoint, %error, "quarantining failed; retrying");
                                tokio::time::sleep(config.error_pause).await;
                            }
                        }
                    }
                }
                continue;
            }
            Err(error) => {
                tracing::warn!(%endpoint, %error, "applying messages failed; retrying");
                tokio::time::sleep(config.error_pause).await;
                continue;
            }
        };

        let wanted = match kind
            .wanted(&owned, &applied, job.as_ref().map(|running| &running.job))
            .await
        {
            Ok(wanted) => wanted,
            Err(error) => {
                tracing::warn!(%endpoint, %error, "reading the endpoint's state failed; retrying");
                tokio::time::sleep(config.error_pause).await;
                continue;
            }
        };
        if let Some(running) = &job {
            if running.task.is_finished() || K::supersedes(&running.job, wanted.as_ref()) {
                let running = job.take().expect("checked above");
                // Replaced by a newer job: it stops at its next await outside a transaction.
                running.stop.stop();
                let end = running.task.await;
                match kind.ended(&owned, end).await {
                    JobEnded::Done => job_pauses = config.reload_retry.pauses(),
                    JobEnded::Fenced => {
                        metrics.lock_losses.inc();
                        break;
                    }
                    JobEnded::Failed => {
                        let pause = job_pauses.next_pause();
                        tracing::info!(%endpoint, ?pause, "the job starts again after a pause");
                        job_after = Some(tokio::time::Instant::now() + pause);
                    }
                }
                // What the job wants next may have changed with its end.
                continue;
            }
        }
        let mut job_delayed = false;
        if job.is_none() {
            let due = job_after.is_none_or(|after| tokio::time::Instant::now() >= after);
            job_delayed = !due && wanted.is_some();
            // Without upstream settings the job waits for them, started by the registration
            // change that gives them (the sweep leaves such endpoints alone meanwhile).
            if let Some(wanted) = wanted.filter(|_| kind.can_start() && due) {
                job_after = None;
                let (stop, stop_seen) = StopReload::new();
                let task = kind.start(&owned, wanted.clone(), stop_seen);
                job = Some(RunningJob {
                    job: wanted,
                    stop,
                    task,
                });
                continue;
            }
        }
        // Everything stored when the messages were read is applied: wait for a wake-up (one
        // that came meanwhile is kept by the `Notify` and ends the wait at once), or for the
        // job to end; let go after a while with nothing to do.
        permit = None;
        match &job {
            Some(running) => {
                tokio::select! {
                    _ = signal.notify.notified() => {}
                    () = handed.arrived() => {}
                    _ = wait_finished(&running.task) => {}
                    _ = tokio::time::sleep(config.idle_linger * 4) => {}
                }
            }
            None => {
                let due = job_after
                    .filter(|_| job_delayed)
                    .or_else(|| kind.due_at(config.idle_linger));
                match due {
                    Some(at) => {
                        tokio::select! {
                            _ = signal.notify.notified() => {}
                            () = handed.arrived() => {}
                            _ = tokio::time::sleep_until(at) => {}
                        }
                    }
                    None if kind.busy(config.idle_linger) => {
                        tokio::select! {
                            _ = signal.notify.notified() => {}
                            () = handed.arrived() => {}
                            _ = tokio::time::sleep(config.idle_linger) => {}
                        }
                    }
                    None => {
                        // Idle: kept while more may come (its next message then costs no lock,
                        // token or reads), until the linger ends or the process holds too many
                        // idle endpoints and this one has waited longest.
                        signal
                            .idle_since
                            .store(config.idle_clock.now(), Ordering::SeqCst);
                        let lingered = tokio::select! {
                            _ = signal.notify.notified() => false,
                            () = handed.arrived() => false,
                            _ = tokio::time::sleep(config.idle_linger) => true,
                        };
                        signal.idle_since.store(0, Ordering::SeqCst);
                        if lingered || signal.let_go.swap(false, Ordering::SeqCst) {
                            break;
                        }
                    }
                }
            }
        }
    }
    // A message handed over and not applied was announced to nobody else: the scheduler
    // starts a worker again for it, as it would after a wake-up.
    if handed.close() {
        signal.wake();
    }
    let stopped = job.map(|running| (&mut kind, &owned, running));
    finish(held, stopped, &metrics, exit(wakes_seen)).await
}

/// The messages the front tier of this process handed the worker for its endpoint, and those
/// taken from the inbox and not applied yet (in arrival order).
struct Handed {
    inbox: Option<relay_coord::Inbox<PendingMessage>>,
    next: Vec<PendingMessage>,
}

impl Handed {
    /// Resolves when a message was handed over (never without an inbox).
    async fn arrived(&self) {
        match &self.inbox {
            Some(inbox) => inbox.handed().await,
            None => std::future::pending().await,
        }
    }

    /// The messages handed over that follow on from `applied` without a gap, at most `limit`
    /// (in arrival order); those at or below `applied` are forgotten. Empty when the next
    /// message was not handed over (it was stored before the inbox opened, or handed elsewhere,
    /// or the inbox was full, or its number went to a duplicate): then Postgres is read, and
    /// what was taken is let go too (Postgres has it), so the worker holds no more than `limit`
    /// messages besides one inbox's bound, however far behind it falls.
    fn following(&mut self, applied: i64, limit: usize) -> Vec<PendingMessage> {
        if self.next.len() < limit {
            if let Some(inbox) = &self.inbox {
                self.next.extend(inbox.take());
            }
        }
        // Two writers of the front tier may hand an endpoint's messages out of order.
        self.next.sort_unstable_by_key(|m| m.arrival_seq);
        self.next.dedup_by_key(|m| m.arrival_seq);
        self.next.retain(|m| m.arrival_seq > applied);
        let run = self
            .next
            .iter()
            .zip(applied + 1..)
            .take_while(|(m, expected)| m.arrival_seq == *expected)
            .count()
            .min(limit);
        if run == 0 {
            self.next.clear();
            return Vec::new();
        }
        self.next.drain(..run).collect()
    }

    /// Closes the inbox; whether a message handed over is left unapplied.
    fn close(&mut self) -> bool {
        let left = self.inbox.take().is_some_and(relay_coord::Inbox::close);
        left || !std::mem::take(&mut self.next).is_empty()
    }
}

/// Applies every message available now, in order, run by run (with `alone`, the first one in a
/// run of its own, named in `tried`). `cursor` is the apply cursor as this worker last left it
/// (read from Postgres when `None`): the worker owns the endpoint, so nobody else moves it.
async fn apply_available<K: SourceKind>(
    kind: &mut K,
    owned: &Owned<'_>,
    (cursor, handed): (&mut Option<i64>, &mut Handed),
    mut alone: bool,
    tried: &mut Tried,
) -> Result<Applied, ApplyError> {
    let Owned {
        pool,
        config,
        metrics,
        ..
    } = *owned;
    let endpoint = kind.id();
    let mut applied = match *cursor {
        Some(applied) => applied,
        None => cursors::applied_through(pool, endpoint).await?,
    };
    *cursor = Some(applied);
    let mut done = Applied::default();
    loop {
        tried.alone = None;
        let limit = if alone {
            1
        } else {
            usize::try_from(config.messages_per_read).unwrap_or(1)
        };
        let following = handed.following(applied, limit);
        if !following.is_empty() {
            // Handed over after their commit, numbered from the cursor on without a gap: the
            // same messages a read would give, without the read.
            metrics
                .messages_taken
                .with_label_values(&["handed"])
                .inc_by(following.len() as u64);
            tried.alone = (following.len() == 1).then(|| (applied, following[0].arrival_seq));
            alone = false;
            let through = following.last().map_or(applied, |m| m.arrival_seq);
            let run = kind.apply_run(owned, (applied, through), following).await?;
            applied = through;
            *cursor = Some(applied);
            done.messages += run.messages;
            done.job_pending = run.job_pending;
            if handed.next.is_empty() {
                // What was not handed over came with a wake-up, which brings the worker back
                // to read it.
                return Ok(done);
            }
            continue;
        }
        let (counter, mut pending) = match &config.reader {
            Some(reader) => reader.read(endpoint, applied).await?,
            None => {
                cursors::pending_messages(pool, endpoint, applied, config.messages_per_read).await?
            }
        };
        if pending.is_empty() {
            if counter > applied {
                // Only gaps left (numbers a duplicate took and did not use): skip them.
                kind.skip_gaps(owned, (applied, counter)).await?;
                *cursor = Some(counter);
            }
            return Ok(done);
        }
        if alone {
            pending.truncate(1);
        }
        metrics
            .messages_taken
            .with_label_values(&["postgres"])
            .inc_by(pending.len() as u64);
        tried.alone = (pending.len() == 1).then(|| (applied, pending[0].arrival_seq));
        // Everything below the counter was read: the cursor can skip to it.
        let complete = !alone && (pending.len() as i64) < config.messages_per_read;
        alone = false;
        let last = pending.last().map_or(applied, |m| m.arrival_seq);
        let through = if complete { counter.max(last) } else { last };
        let run = kind.apply_run(owned, (applied, through), pending).await?;
        applied = through;
        *cursor = Some(applied);
        done.messages += run.messages;
        done.job_pending = run.job_pending;
        if complete {
            // What arrives after the read comes with a wake-up of its own.
            return Ok(done);
        }
    }
}

/// Waits `wait`, or less when the sequencer stops or the lease is lost (a stopping scheduler
/// wakes every worker).
pub(crate) async fn wait_or_stop(
    signal: &WorkerSignal,
    stopping: &AtomicBool,
    held: &Held,
    wait: Duration,
) {
    let until = tokio::time::Instant::now() + wait;
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(until) => return,
            () = held.lost() => return,
            _ = signal.notify.notified() => {
                if stopping.load(Ordering::SeqCst) {
                    return;
                }
            }
        }
    }
}

pub(crate) async fn wait_finished<T>(task: &JoinHandle<T>) {
    while !task.is_finished() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Tells the publisher the endpoint has new changes (committed). Best effort: a lost
/// announcement only means the publisher's poll finds them instead.
pub(crate) async fn announce(config: &WorkerConfig, tenant: TenantId, endpoint: EndpointId) {
    if let Some(waker) = &config.changes_waker {
        let payload = relay_coord::change_payload(tenant, endpoint);
        if let Err(error) = waker.publish(&[payload]).await {
            tracing::debug!(%endpoint, %error, "could not announce new changes");
        }
    }
}

/// Lets the endpoint go: its job stopped and awaited (so no pooled connection is left inside
/// its transaction) and its end given to the kind, its lock released.
async fn finish<K: SourceKind>(
    held: Held,
    stopped: Option<(&mut K, &Owned<'_>, RunningJob<K>)>,
    metrics: &SequencerMetrics,
    exit: WorkerExit,
) -> WorkerExit {
    if let Some((kind, owned, running)) = stopped {
        running.stop.stop();
        let end = running.task.await;
        kind.ended(owned, end).await;
    }
    held.release().await;
    metrics.endpoints_owned.dec();
    exit
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(arrival_seq: i64) -> PendingMessage {
        PendingMessage {
            arrival_seq,
            received_at: time::OffsetDateTime::UNIX_EPOCH,
            body: Vec::new(),
        }
    }

    fn seqs(messages: &[PendingMessage]) -> Vec<i64> {
        messages.iter().map(|m| m.arrival_seq).collect()
    }

    /// A hand-over point, an endpoint, and a worker's `Handed` with the endpoint's inbox open.
    fn opened() -> (relay_coord::Handoff<PendingMessage>, Uuid, Handed) {
        let handoff = relay_coord::Handoff::new(1 << 20, 1 << 20);
        let endpoint = Uuid::new_v4();
        let handed = Handed {
            inbox: Some(handoff.open(endpoint)),
            next: Vec::new(),
        };
        (handoff, endpoint, handed)
    }

    #[test]
    fn handed_messages_are_applied_only_from_the_cursor_on_without_a_gap() {
        let (handoff, endpoint, mut handed) = opened();
        // Two writers handed 7 before 6; 5 and below are applied already.
        for seq in [4, 7, 6] {
            assert!(handoff.offer(endpoint, vec![message(seq)], 1));
        }
        assert_eq!(seqs(&handed.following(5, 100)), vec![6, 7]);
        // At most `limit` at once, the rest kept for the next look.
        for seq in 8..=12 {
            assert!(handoff.offer(endpoint, vec![message(seq)], 1));
        }
        assert_eq!(seqs(&handed.following(7, 2)), vec![8, 9]);
        assert_eq!(seqs(&handed.following(9, 100)), vec![10, 11, 12]);
        // A gap (14 not handed over): nothing, and what was taken is let go for Postgres's read.
        assert!(handoff.offer(endpoint, vec![message(15)], 1));
        assert!(handed.following(12, 100).is_empty());
        assert!(handed.next.is_empty());
        // Handed and not taken when the worker lets go: it must be found again.
        assert!(handoff.offer(endpoint, vec![message(13)], 1));
        assert!(handed.close(), "13 was handed over and not applied");
    }

    #[test]
    fn a_worker_letting_go_with_a_message_taken_and_unapplied_says_so() {
        let (handoff, endpoint, mut handed) = opened();
        for seq in 1..=3 {
            assert!(handoff.offer(endpoint, vec![message(seq)], 1));
        }
        assert_eq!(seqs(&handed.following(0, 1)), vec![1]);
        assert!(handed.close(), "2 and 3 were taken and not applied");
        assert!(!handoff.offer(endpoint, vec![message(4)], 1), "closed");
    }
}
