//! One endpoint, owned: apply its messages in arrival order, run its reload beside them, keep
//! the lease renewed, and let go when there is nothing left to do.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use relay_coord::{Held, Owners};
use relay_netguard::RetryPolicy;
use relay_rules::{decide_failed_apply, ApplyBackoff, FailedApply, Reload};
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::apply::{ApplyError, EndpointContext};
use crate::metrics::SequencerMetrics;
use crate::reload::{run_reload, ReloadEnd, ReloadLimits, StopReload};
use crate::slots::{Slot, Slots};
use relay_store::endpoints::{self, EndpointRegistration};
use relay_store::{cursors, tracks, EndpointId, TenantId};

/// What the scheduler and the endpoint's worker share.
#[derive(Default)]
pub struct WorkerSignal {
    /// Wakes the worker when new messages are stored for its endpoint.
    pub notify: Notify,
    /// Counts wake-ups, so the scheduler can tell one arrived after the worker's last look.
    pub wakes: AtomicU64,
    /// Set when the endpoint's registration changed: the worker reads it again.
    registration_changed: AtomicBool,
}

impl WorkerSignal {
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
    /// Announces new changes to the publisher (see [`relay_coord::changes_channel`]).
    pub changes_waker: Option<relay_coord::Waker>,
    /// The shared apply transactions (`None`: each run applies in a transaction of its own).
    pub batcher: Option<crate::batch::ApplyBatcher>,
    /// The shared reads of pending messages (`None`: each worker reads its own). Reads at most
    /// `messages_per_read` per endpoint, as the worker does.
    pub reader: Option<crate::batch::PendingReader>,
    pub messages_per_read: i64,
    pub idle_linger: Duration,
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
}

/// How a worker ended: the wake count it had seen last (the scheduler starts it again when more
/// arrived since).
pub struct WorkerExit {
    pub endpoint: Uuid,
    pub wakes_seen: u64,
}

struct RunningReload {
    reload: Reload,
    stop: StopReload,
    task: JoinHandle<Result<ReloadEnd, ApplyError>>,
}

/// The endpoint's next message while its apply keeps failing.
struct NextFailing {
    arrival_seq: i64,
    attempts: u32,
}

/// Owns the endpoint if nobody else does, and works it until idle.
#[allow(clippy::too_many_arguments)]
pub async fn run_worker(
    pool: PgPool,
    owners: Owners,
    http: relay_netguard::GuardedClient,
    registration: EndpointRegistration,
    signal: Arc<WorkerSignal>,
    config: WorkerConfig,
    metrics: SequencerMetrics,
    stopping: Arc<AtomicBool>,
    (slots, slot): (Arc<Slots>, Slot),
) -> WorkerExit {
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
    let token = held.token();

    if let Err(error) = tracks::ensure(&pool, registration.tenant_id, endpoint).await {
        tracing::warn!(%endpoint, %error, "could not create the track row");
        return finish(held, None, &metrics, exit(wakes_seen)).await;
    }
    let ctx = Arc::new(
        EndpointContext::new(registration, http)
            .with_feed_page_limit(config.feed_page_limit)
            .with_reloads(config.reloads.clone()),
    );
    let mut reload: Option<RunningReload> = None;
    // A reload task retries its own failures; one that ends in an error anyway (or panics) is
    // started again only after a pause, growing while that repeats, so it never spins. Until
    // then the worker waits for the pause rather than letting go (the sweep would start a new
    // worker, and the reload, at once).
    let mut reload_pauses = config.reload_retry.pauses();
    let mut reload_after: Option<tokio::time::Instant> = None;
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
            match endpoints::load_registration(&pool, endpoint).await {
                Ok(Some(registration)) => {
                    tracing::info!(%endpoint, upstream = registration.upstream_base_url.is_some(),
                        "the endpoint's registration changed");
                    ctx.update(&registration);
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
            &pool,
            &ctx,
            token,
            &mut cursor,
            (&config, &metrics),
            (next_alone, &mut tried),
        )
        .await;
        let (applied_any, reload_pending) = match step {
            Ok(applied) => {
                next_alone = false;
                (applied.messages > 0, applied.reload_pending)
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
                        let quarantined = crate::apply::quarantine_failing(
                            &pool,
                            &ctx,
                            token,
                            (applied, arrival_seq),
                            (attempts, error.to_string()),
                            &metrics,
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

        // The reload the track holds now (a message may have begun or replaced it, and the
        // control plane's rewind may have begun one). Read when it can have changed: messages
        // left a reload pending, one is running, or the worker was woken with no message to
        // apply (the sweep wakes endpoints whose track holds a reload). Otherwise none.
        let wanted = if reload_pending || reload.is_some() || !applied_any {
            match tracks::peek(&pool, endpoint).await {
                Ok(track) => track.reload,
                Err(error) => {
                    tracing::warn!(%endpoint, %error, "reading the track failed; retrying");
                    tokio::time::sleep(config.error_pause).await;
                    continue;
                }
            }
        } else {
            None
        };
        if let Some(running) = &reload {
            let still_wanted = wanted.as_ref().is_some_and(|w| w.is(&running.reload));
            if running.task.is_finished() || !still_wanted {
                let running = reload.take().expect("checked above");
                // Replaced by a newer reload: it stops at its next read or pause, never inside
                // its merge (which checks under the lock that it is still the track's).
                running.stop.stop();
                match running.task.await {
                    Ok(Ok(ReloadEnd::Merged { .. })) => {
                        metrics.reloads.with_label_values(&["merged"]).inc();
                        reload_pauses = config.reload_retry.pauses();
                        announce_changes(&config, &ctx).await;
                    }
                    Ok(Ok(ReloadEnd::Fenced)) => {
                        metrics.reloads.with_label_values(&["abandoned"]).inc();
                        metrics.lock_losses.inc();
                        break;
                    }
                    Ok(Ok(ReloadEnd::Superseded)) => {
                        metrics.reloads.with_label_values(&["abandoned"]).inc()
                    }
                    Ok(Err(error)) => {
                        let pause = reload_pauses.next_pause();
                        tracing::warn!(%endpoint, %error, ?pause,
                            "reload failed; it starts again after a pause");
                        metrics.reloads.with_label_values(&["abandoned"]).inc();
                        reload_after = Some(tokio::time::Instant::now() + pause);
                    }
                    Err(error) => {
                        let pause = reload_pauses.next_pause();
                        tracing::error!(%endpoint, %error, ?pause,
                            "the reload task ended abnormally; it starts again after a pause");
                        metrics.reloads.with_label_values(&["abandoned"]).inc();
                        reload_after = Some(tokio::time::Instant::now() + pause);
                    }
                }
                metrics.reloads_running.dec();
            }
        }
        let mut reload_delayed = false;
        if reload.is_none() {
            let due = reload_after.is_none_or(|after| tokio::time::Instant::now() >= after);
            reload_delayed = !due && wanted.is_some();
            // Without upstream settings the reload waits for them, started by the registration
            // change that gives them (the sweep leaves such endpoints alone meanwhile).
            if let Some(wanted) = wanted.filter(|_| ctx.has_upstream() && due) {
                reload_after = None;
                // Also the path by which a reload begun and not merged starts again after a
                // restart: the row says one is running, and nothing here runs it.
                metrics.reloads_running.inc();
                let (pool, ctx, metrics) = (pool.clone(), ctx.clone(), metrics.clone());
                let retry = config.reload_retry;
                let task_reload = wanted.clone();
                let (stop, stopping) = StopReload::new();
                let task = tokio::spawn(async move {
                    run_reload(&pool, &ctx, token, &task_reload, retry, &metrics, stopping).await
                });
                reload = Some(RunningReload {
                    reload: wanted,
                    stop,
                    task,
                });
                continue;
            }
        }
        // Everything stored when the messages were read is applied: wait for a wake-up (one
        // that came meanwhile is kept by the `Notify` and ends the wait at once), or for the
        // reload to end; let go after a while with neither.
        let linger = tokio::time::sleep(config.idle_linger);
        permit = None;
        match &mut reload {
            Some(running) => {
                tokio::select! {
                    _ = signal.notify.notified() => {}
                    _ = wait_finished(&running.task) => {}
                    _ = tokio::time::sleep(config.idle_linger * 4) => {}
                }
            }
            None => match reload_after.filter(|_| reload_delayed) {
                Some(after) => {
                    tokio::select! {
                        _ = signal.notify.notified() => {}
                        _ = tokio::time::sleep_until(after) => {}
                    }
                }
                None => {
                    tokio::select! {
                        _ = signal.notify.notified() => {}
                        _ = linger => break,
                    }
                }
            },
        }
    }
    finish(held, reload, &metrics, exit(wakes_seen)).await
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

async fn wait_finished<T>(task: &JoinHandle<T>) {
    while !task.is_finished() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What one look at the endpoint's messages did.
struct Applied {
    messages: usize,
    /// The track has a reload to run (as the last apply transaction left it).
    reload_pending: bool,
}

/// The last run [`apply_available`] tried, when it was one message alone: (the cursor it
/// followed, its arrival_seq). After a failure, that message's failure.
#[derive(Default)]
struct Tried {
    alone: Option<(i64, i64)>,
}

/// Applies every message available now, in order (with `first_alone`, the first one in a run of
/// its own). `cursor` is the apply cursor as this worker last left it (read from Postgres when
/// `None`, and forgotten after an error, whose commit may or may not have happened): the worker
/// owns the endpoint, so nobody else moves it.
async fn apply_available(
    pool: &PgPool,
    ctx: &Arc<EndpointContext>,
    token: i64,
    cursor: &mut Option<i64>,
    (config, metrics): (&WorkerConfig, &SequencerMetrics),
    (first_alone, tried): (bool, &mut Tried),
) -> Result<Applied, ApplyError> {
    let result = apply_from_cursor(
        pool,
        ctx,
        token,
        cursor,
        (config, metrics),
        (first_alone, tried),
    )
    .await;
    if result.is_err() {
        *cursor = None;
    }
    result
}

async fn apply_from_cursor(
    pool: &PgPool,
    ctx: &Arc<EndpointContext>,
    token: i64,
    cursor: &mut Option<i64>,
    (config, metrics): (&WorkerConfig, &SequencerMetrics),
    (mut alone, tried): (bool, &mut Tried),
) -> Result<Applied, ApplyError> {
    let endpoint = ctx.id();
    let mut applied = match *cursor {
        Some(applied) => applied,
        None => cursors::applied_through(pool, endpoint).await?,
    };
    *cursor = Some(applied);
    let mut done = Applied {
        messages: 0,
        reload_pending: false,
    };
    loop {
        tried.alone = None;
        let (counter, mut pending) = match &config.reader {
            Some(reader) => reader.read(endpoint, applied).await?,
            None => {
                cursors::pending_messages(pool, endpoint, applied, config.messages_per_read).await?
            }
        };
        if pending.is_empty() {
            if counter > applied {
                // Only gaps left (numbers a duplicate took and did not use): skip them.
                let mut tx = pool.begin().await?;
                if !relay_coord::check_fence(&mut tx, endpoint, token).await? {
                    return Err(ApplyError::Fenced);
                }
                if !cursors::advance_cursor(&mut tx, ctx.tenant(), endpoint, applied, counter, None)
                    .await?
                {
                    return Err(ApplyError::CursorMoved);
                }
                tx.commit().await?;
                *cursor = Some(counter);
            }
            return Ok(done);
        }
        if alone {
            pending.truncate(1);
        }
        tried.alone = (pending.len() == 1).then(|| (applied, pending[0].arrival_seq));
        // Everything below the counter was read: the cursor can skip to it.
        let complete = !alone && (pending.len() as i64) < config.messages_per_read;
        alone = false;
        let last = pending.last().map_or(applied, |m| m.arrival_seq);
        let through = if complete { counter.max(last) } else { last };
        let run = crate::apply::prepare_run(pool, ctx, token, (applied, through), pending, metrics)
            .await?;
        let report = match &config.batcher {
            // The batcher announces the changes of every run it committed, together.
            Some(batcher) => batcher.apply(run).await?,
            None => {
                let report = crate::apply::apply_runs(pool, vec![run], metrics)
                    .await
                    .pop()
                    .expect("one answer per run")?;
                if report.changes > 0 {
                    announce_changes(config, ctx).await;
                }
                report
            }
        };
        applied = through;
        *cursor = Some(applied);
        done.messages += report.messages;
        done.reload_pending = report.reload_pending;
        if complete {
            // What arrives after the read comes with a wake-up of its own.
            return Ok(done);
        }
    }
}

/// Tells the publisher the endpoint has new changes (committed). Best effort: a lost
/// announcement only means the publisher's poll finds them instead.
async fn announce_changes(config: &WorkerConfig, ctx: &EndpointContext) {
    announce(config, ctx.tenant(), ctx.id()).await
}

/// [`announce_changes`] for any endpoint's worker.
pub(crate) async fn announce(config: &WorkerConfig, tenant: TenantId, endpoint: EndpointId) {
    if let Some(waker) = &config.changes_waker {
        let payload = relay_coord::change_payload(tenant, endpoint);
        if let Err(error) = waker.publish(&[payload]).await {
            tracing::debug!(%endpoint, %error, "could not announce new changes");
        }
    }
}

async fn finish(
    held: Held,
    reload: Option<RunningReload>,
    metrics: &SequencerMetrics,
    exit: WorkerExit,
) -> WorkerExit {
    if let Some(running) = reload {
        running.stop.stop();
        let _ = running.task.await;
        metrics.reloads.with_label_values(&["abandoned"]).inc();
        metrics.reloads_running.dec();
    }
    held.release().await;
    metrics.endpoints_owned.dec();
    exit
}
