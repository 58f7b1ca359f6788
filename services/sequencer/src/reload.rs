//! Running a reload: read every page of `/v1/feed` for the endpoint's selection, pass after pass,
//! and merge each pass relay-rules' [`decide_merge`](relay_rules::decide_merge) says to merge
//! (relay-store's `copy::merge`: one transaction that holds the endpoint and decides under its
//! lock), until the track no longer runs the reload.
//!
//! The worker keeps applying messages while this runs ("While you read, keep applying the
//! messages that follow"); the merge's rule keeps what those wrote. A reload is stopped between
//! statements, never inside its transaction: the worker asks it to stop ([`StopReload`]) and
//! awaits it, so no pooled connection is left inside an aborted transaction.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use relay_netguard::RetryPolicy;
use relay_rules::{MergePlan, PagesCheck, Pass, Reload};
use relay_store::copy::{self, Merged};
use relay_store::reload_waits;
use relay_store::tracks::{self, TrackClaim};
use sqlx::PgPool;
use tokio::sync::{watch, Semaphore};

use crate::apply::{ApplyError, EndpointContext};
use crate::metrics::{SequencerMetrics, RELOAD_READ, RELOAD_TOTAL};
use crate::service::defaults;
use crate::slots::{Slot, Slots};
use crate::upstream::{self, PassBudget, UpstreamError};

/// How a reload ended in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadEnd {
    /// Merged: the copy is held under the pages' access_version.
    Merged { items: usize, removed: usize },
    /// The track no longer runs this reload (a newer one replaced it, or it was merged).
    Superseded,
    /// The fence moved on: another worker owns the endpoint and runs the reload there.
    Fenced,
}

/// What reload passes may hold at once in this process: at most `slots`' passes read and merge
/// at a time (a tenant at most its share of them, as with endpoint slots), each reading at most
/// `max_pass_bytes` ([`PassBudget`]). A stories endpoint's sync takes a slot and a budget too.
/// Together they bound what reloads hold: README, "Memory".
///
/// A tenant with an endpoint whose reads have been failing ([`FailingMark`]) takes its slots
/// within the failing lane, one slot fewer than the process has (when it has more than one):
/// however many tenants' upstreams hang, answer endlessly or answer what cannot be stored, they
/// queue behind one another for the lane's slots, and a tenant whose upstream answers always
/// finds the slot they cannot hold.
#[derive(Clone)]
pub(crate) struct ReloadLimits {
    pub slots: Arc<Slots>,
    pub max_pass_bytes: u64,
    failing_lane: Arc<Semaphore>,
    /// Each tenant's endpoints marked failing, counted.
    failing: Arc<Mutex<HashMap<relay_store::TenantId, usize>>>,
}

impl ReloadLimits {
    pub fn new(max_concurrent: usize, tenant_share: f64, max_pass_bytes: u64) -> Self {
        let max_concurrent = max_concurrent.max(1);
        Self {
            slots: Slots::new(max_concurrent, tenant_share),
            max_pass_bytes,
            failing_lane: Arc::new(Semaphore::new((max_concurrent - 1).max(1))),
            failing: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// Marks `tenant`'s endpoint as failing for as long as the mark lives: its tenant's passes
    /// and syncs then take the failing lane's slots.
    pub fn failing(&self, tenant: relay_store::TenantId) -> FailingMark {
        *self
            .failing
            .lock()
            .expect("the failing tenants' map is never poisoned")
            .entry(tenant)
            .or_default() += 1;
        FailingMark {
            failing: self.failing.clone(),
            tenant,
        }
    }

    fn is_failing(&self, tenant: relay_store::TenantId) -> bool {
        self.failing
            .lock()
            .expect("the failing tenants' map is never poisoned")
            .contains_key(&tenant)
    }

    /// A slot for a pass (or a sync) of `waiter`'s endpoint, its budget, and the gauge of passes
    /// reading. A slot free now is taken at once and costs nothing more; otherwise the wait is
    /// recorded (the endpoint's state says since when, `relay_sequencer_reload_slot_waiting`
    /// counts it) until a slot is taken or the caller stops waiting. Either way
    /// `relay_sequencer_reload_slot_wait_seconds` says how long it took.
    pub async fn take(
        &self,
        waiter: Waiter<'_>,
        metrics: &SequencerMetrics,
    ) -> (Reading, Arc<PassBudget>) {
        let started = Instant::now();
        let lane = || {
            self.is_failing(waiter.tenant)
                .then(|| self.failing_lane.clone())
        };
        let slot = match self.slots.try_take_in(waiter.tenant, lane) {
            Some(slot) => slot,
            None => {
                let waiting = Waiting::begin(waiter, metrics).await;
                let slot = self.slots.take_in(waiter.tenant, lane).await;
                waiting.end().await;
                slot
            }
        };
        metrics
            .reload_slot_wait
            .observe(started.elapsed().as_secs_f64());
        metrics.reload_passes_reading.inc();
        let reading = Reading {
            _slot: slot,
            gauge: metrics.reload_passes_reading.clone(),
        };
        (reading, PassBudget::new(self.max_pass_bytes))
    }
}

/// An endpoint whose upstream reads have been failing (a reload's pass, a stories sync), from
/// its failure until a read succeeds or its reload (or worker) ends: while its tenant has one,
/// [`ReloadLimits::take`] gives the tenant's passes the failing lane's slots.
pub(crate) struct FailingMark {
    failing: Arc<Mutex<HashMap<relay_store::TenantId, usize>>>,
    tenant: relay_store::TenantId,
}

impl Drop for FailingMark {
    fn drop(&mut self) {
        let mut failing = self
            .failing
            .lock()
            .expect("the failing tenants' map is never poisoned");
        if let Some(count) = failing.get_mut(&self.tenant) {
            *count -= 1;
            if *count == 0 {
                failing.remove(&self.tenant);
            }
        }
    }
}

/// Whose pass (or sync) takes a reload slot: the endpoint's tenant, whose share of the slots it
/// counts against, and its owner's fencing token, which the recorded wait names.
#[derive(Clone, Copy)]
pub(crate) struct Waiter<'a> {
    pub pool: &'a PgPool,
    pub tenant: relay_store::TenantId,
    pub endpoint: relay_store::EndpointId,
    pub token: i64,
}

/// A pass waiting for a reload slot: counted in `relay_sequencer_reload_slot_waiting` and
/// recorded for the endpoint's state while it lasts. Dropped without [`Waiting::end`] (the
/// reload was stopped while it waited), the record is ended by a task of its own.
struct Waiting {
    pool: PgPool,
    endpoint: relay_store::EndpointId,
    token: i64,
    gauge: prometheus::IntGauge,
    recorded: bool,
}

impl Waiting {
    async fn begin(waiter: Waiter<'_>, metrics: &SequencerMetrics) -> Self {
        let gauge = metrics.reload_slot_waiting.clone();
        gauge.inc();
        // Best effort: the state would only miss the wait, and the wait goes on regardless.
        let recorded =
            match reload_waits::begin(waiter.pool, waiter.tenant, waiter.endpoint, waiter.token)
                .await
            {
                Ok(()) => true,
                Err(error) => {
                    tracing::debug!(endpoint = %waiter.endpoint, %error,
                    "could not record the wait for a reload slot");
                    false
                }
            };
        Self {
            pool: waiter.pool.clone(),
            endpoint: waiter.endpoint,
            token: waiter.token,
            gauge,
            recorded,
        }
    }

    /// A slot was taken: the wait is over, and its record gone before the pass reads.
    async fn end(mut self) {
        if std::mem::take(&mut self.recorded) {
            if let Err(error) = reload_waits::end(&self.pool, self.endpoint, self.token).await {
                tracing::debug!(endpoint = %self.endpoint, %error,
                    "could not end the record of a wait for a reload slot");
            }
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.gauge.dec();
        // Outside a runtime (the process is shutting down) the next owner's wait replaces the
        // record, and the state shows none once the fence moves on.
        if let (true, Ok(runtime)) = (self.recorded, tokio::runtime::Handle::try_current()) {
            let (pool, endpoint, token) = (self.pool.clone(), self.endpoint, self.token);
            runtime.spawn(async move {
                if let Err(error) = reload_waits::end(&pool, endpoint, token).await {
                    tracing::debug!(%endpoint, %error,
                        "could not end the record of a wait for a reload slot");
                }
            });
        }
    }
}

impl Default for ReloadLimits {
    fn default() -> Self {
        Self::new(
            defaults::MAX_CONCURRENT_RELOADS,
            defaults::MAX_TENANT_SHARE,
            defaults::MAX_RELOAD_BYTES,
        )
    }
}

impl std::fmt::Debug for ReloadLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadLimits")
            .field("max_pass_bytes", &self.max_pass_bytes)
            .finish_non_exhaustive()
    }
}

/// A pass's hold on a reload slot; counted in `relay_sequencer_reload_passes_reading` while
/// held.
pub(crate) struct Reading {
    _slot: Slot,
    gauge: prometheus::IntGauge,
}

impl Drop for Reading {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// Counts a task in `relay_sequencer_upstream_backing_off{call}` while it pauses after a
/// failure.
pub(crate) struct BackingOff(prometheus::IntGauge);

impl BackingOff {
    pub fn new(metrics: &SequencerMetrics, call: &str) -> Self {
        let gauge = metrics.upstream_backing_off.with_label_values(&[call]);
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for BackingOff {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Pauses between passes that cannot merge (a failed read, pages that disagree), by default.
pub const RELOAD_RETRY: RetryPolicy = RetryPolicy {
    first: Duration::from_millis(50),
    max: Duration::from_secs(5),
};

/// The worker's hold on a running reload: asks it to stop at its next await outside a
/// transaction.
#[derive(Debug)]
pub struct StopReload(watch::Sender<bool>);

impl StopReload {
    pub fn new() -> (Self, watch::Receiver<bool>) {
        let (sender, receiver) = watch::channel(false);
        (Self(sender), receiver)
    }

    pub fn stop(&self) {
        self.0.send_replace(true);
    }
}

/// Waits until `stop` says stop (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// What one look at the reload did: what comes before the next.
enum Step {
    /// Look again at once (a pass merged, or the reload was re-aimed).
    Again,
    /// Pause, then read again: the pages could not merge, nothing failed.
    Pause,
    /// Something failed (a read, the answer's checks, the merge): pause, longer each time.
    Failed,
    /// Nothing can be read until the registration names an upstream.
    WaitForSettings,
}

/// Runs `reload` until the track no longer runs it (merged, and no further pass asked for; or
/// replaced), or until `stop`. Whatever fails (a read, an answer the checks refuse or over its
/// bound, a merge Postgres refuses, Postgres out of reach) is retried with `retry`'s pauses,
/// growing with jitter to its cap, for as long as the reload is the track's: a reload is never
/// given up, since the copy cannot be right without it, and never retried at once. Each failure
/// is counted in the endpoint's upstream status (its state shows the reason and the failures
/// in a row) and in `relay_sequencer_upstream_failures_total{call="reload"}`.
///
/// Each pass reads and merges under one of the process's reload slots ([`ReloadLimits`]),
/// taken before it reads and given back before any pause, and reads at most the limits' bytes:
/// an endpoint backing off holds no slot, and one waiting for its tenant's share of them says so
/// in its state.
/// A change of the endpoint's registration ends the pause at once (a rotated key or a moved URL
/// is tried without waiting out the backoff); while the registration names no upstream, nothing
/// is read until one does.
pub async fn run_reload(
    pool: &PgPool,
    ctx: &Arc<EndpointContext>,
    token: i64,
    reload: &Reload,
    retry: RetryPolicy,
    metrics: &SequencerMetrics,
    mut stop: watch::Receiver<bool>,
) -> Result<ReloadEnd, ApplyError> {
    let endpoint = ctx.id();
    let claim = TrackClaim {
        endpoint,
        tenant: ctx.tenant(),
        token,
    };
    let started = Instant::now();
    let mut changes = ctx.changes();
    let mut pauses = retry.pauses();
    let mut passes = 0u32;
    // Held from a failed read until one succeeds: the tenant's passes use the failing lane.
    let mut failing: Option<FailingMark> = None;
    // What the passes merged here: `None` until one is.
    let mut merged: Option<(usize, usize)> = None;
    loop {
        let step = 'pass: {
            let track = match tracks::peek(pool, endpoint).await {
                Ok(track) => track,
                Err(error) => {
                    tracing::warn!(%endpoint, %error, "reading the reload's track failed");
                    break 'pass Step::Failed;
                }
            };
            let Some(running) = track.reload.filter(|r| r.is(reload)) else {
                return Ok(match merged {
                    Some((items, removed)) => ReloadEnd::Merged { items, removed },
                    None => ReloadEnd::Superseded,
                });
            };
            if !ctx.has_upstream() {
                break 'pass Step::WaitForSettings;
            }
            passes += 1;
            // Held until the pass is merged (its items are in memory until then), given back
            // before any pause.
            let waiter = Waiter {
                pool,
                tenant: ctx.tenant(),
                endpoint,
                token,
            };
            let (_reading, budget) = tokio::select! {
                taken = ctx.reloads().take(waiter, metrics) => taken,
                _ = stopped(&mut stop) => return Ok(ReloadEnd::Superseded),
            };
            let read = tokio::select! {
                read = read_pass(ctx, running.read_again, budget.clone()) => read,
                _ = stopped(&mut stop) => return Ok(ReloadEnd::Superseded),
            };
            let pass = match read {
                Ok(pass) => pass,
                Err(UpstreamError::CursorExpired) => {
                    tracing::debug!(%endpoint, passes, "feed cursor expired: reading again");
                    break 'pass Step::Pause;
                }
                Err(UpstreamError::NotConfigured) => break 'pass Step::WaitForSettings,
                Err(error) => {
                    metrics
                        .upstream_failures
                        .with_label_values(&["reload", error.kind()])
                        .inc();
                    let failures =
                        upstream::record_failure(pool, ctx.tenant(), endpoint, &error).await;
                    tracing::warn!(%endpoint, passes, %error, kind = error.kind(),
                        failures = failures.as_ref().ok(), "reload read failed");
                    failing.get_or_insert_with(|| ctx.reloads().failing(ctx.tenant()));
                    break 'pass Step::Failed;
                }
            };
            let bytes = budget.used();
            metrics.reload_pass_bytes.observe(bytes as f64);
            let read_s = started.elapsed().as_secs_f64();
            let merge = match copy::merge(pool, claim, reload, &pass).await {
                Ok(merge) => merge,
                Err(error) => {
                    merge_failed(pool, ctx, ApplyError::Store(error), metrics).await;
                    failing.get_or_insert_with(|| ctx.reloads().failing(ctx.tenant()));
                    break 'pass Step::Failed;
                }
            };
            if !matches!(merge, Merged::Fenced) {
                // The pass was read and taken: whatever failed before is over.
                failing = None;
                if let Err(error) = upstream::record_success(pool, ctx.tenant(), endpoint).await {
                    tracing::debug!(%endpoint, %error, "could not record the upstream's success");
                }
            }
            match merge {
                Merged::Merged { written, removed } => {
                    metrics
                        .reload_duration
                        .with_label_values(&[RELOAD_READ])
                        .observe(read_s);
                    metrics
                        .reload_duration
                        .with_label_values(&[RELOAD_TOTAL])
                        .observe(started.elapsed().as_secs_f64());
                    tracing::info!(%endpoint, generation = reload.generation, written,
                        removed, passes, read_s, bytes, "reload pass merged");
                    let (items, gone) = merged.unwrap_or_default();
                    merged = Some((items + written, gone + removed));
                    // The track says whether another pass follows (asked while this one
                    // was read): the loop's check reads it.
                    pauses = retry.pauses();
                    Step::Again
                }
                Merged::Fenced => return Ok(ReloadEnd::Fenced),
                Merged::NotMerged(MergePlan::Superseded) => Step::Again,
                Merged::NotMerged(MergePlan::ReadAgain(PagesCheck::OtherAccessVersion {
                    pages,
                })) => {
                    // The access changed again after the message that began this reload: the
                    // upstream sends a message (or reset) under the new one, which replaces
                    // or re-aims this reload. Until then, keep reading.
                    tracing::info!(%endpoint, passes, pages,
                        wanted = ?reload.access_version, "pages under another access_version");
                    Step::Pause
                }
                Merged::NotMerged(_) => {
                    tracing::debug!(%endpoint, passes, "pages disagree: reading again");
                    Step::Pause
                }
            }
        };
        let _backing_off = match step {
            Step::Again => continue,
            Step::WaitForSettings => {
                // Every read would fail the same way: wait for the registration to change.
                tracing::info!(%endpoint, "the reload waits for the endpoint's upstream settings");
                tokio::select! {
                    changed = changes.changed() => if changed.is_err() {
                        return Ok(ReloadEnd::Superseded);
                    },
                    _ = stopped(&mut stop) => return Ok(ReloadEnd::Superseded),
                }
                pauses = retry.pauses();
                continue;
            }
            Step::Pause => None,
            Step::Failed => Some(BackingOff::new(metrics, "reload")),
        };
        tokio::select! {
            _ = tokio::time::sleep(pauses.next_pause()) => {}
            _ = stopped(&mut stop) => return Ok(ReloadEnd::Superseded),
            changed = changes.changed() => {
                if changed.is_ok() {
                    tracing::info!(%endpoint, "the endpoint's registration changed: reading again now");
                    pauses = retry.pauses();
                }
            }
        }
    }
}

/// A merge that failed: when Postgres refused what the pass read (a value it cannot hold, a
/// constraint), the upstream's answer is why, and the endpoint's state says so (`store`); when
/// Postgres could not be reached or was busy, nothing is recorded (and the recording would
/// fail too). Either way the reload pauses before reading again.
async fn merge_failed(
    pool: &PgPool,
    ctx: &EndpointContext,
    error: ApplyError,
    metrics: &SequencerMetrics,
) {
    let endpoint = ctx.id();
    if !error.may_be_the_message() {
        tracing::warn!(%endpoint, %error, "the reload's merge failed; it is read again");
        return;
    }
    metrics
        .upstream_failures
        .with_label_values(&["reload", upstream::STORE_REFUSED])
        .inc();
    let detail = format!("the reload's merge was refused: {error}");
    let failures = relay_store::upstream_status::record_failure(
        pool,
        ctx.tenant(),
        endpoint,
        upstream::STORE_REFUSED,
        &detail,
    )
    .await;
    tracing::warn!(%endpoint, %error, failures = failures.as_ref().ok(),
        "the reload's merge was refused; it is read again");
}

/// One pass: the endpoint read as it is now ("read the endpoint's filter and language as they
/// are now"), then every page of `/v1/feed` with its selection, all within `budget`.
/// `read_again` is the reload's count of asks when the pass began.
async fn read_pass(
    ctx: &EndpointContext,
    read_again: u32,
    budget: Arc<PassBudget>,
) -> Result<Pass, UpstreamError> {
    let upstream = ctx.upstream()?.with_budget(budget);
    let selection = upstream.selection(ctx.id()).await?;
    let feed = upstream.read_feed(&selection).await?;
    Ok(Pass {
        page_access_versions: feed.page_access_versions,
        items: feed.items,
        upstream_generation: selection.generation,
        read_again_at_start: read_again,
    })
}
