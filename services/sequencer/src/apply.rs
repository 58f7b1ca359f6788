//! Applying runs of stored messages: the driver of relay-rules' [`decide_run`], as its module
//! doc says to drive it.
//!
//! One transaction applies one run of messages for each of several endpoints (a batch of one
//! when applied alone), two statements inside it (relay-store's `runs`): the first checks each
//! fence, takes each endpoint's writer lock, reads its track row locked, the run's event ids
//! applied before and the rows of the subjects the run touches (locked); the rules decide each
//! run whole; the second writes each [`RunPlan`] (rows still checking their position, changes,
//! track, ids, outcomes, cursor moved only from where it was read). A refetch's item read
//! happens before that transaction (so no lock is held across HTTP), and its answer is decided
//! inside it against the row as the run's earlier events left it: "read it before applying the
//! next message".

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_netguard::RetryPolicy;
use relay_rules::{
    decide_run, event_ids, quarantine, refetches_wanted, subjects, Outcome, RefetchAnswer,
    RefetchRead, ReloadStart, Run, RunPlan, StoredMessage, Unapplicable, REFETCH_ATTEMPTS,
};
use relay_store::cursors::PendingMessage;
use relay_store::endpoints::EndpointRegistration;
use relay_store::runs::{self, RunClaim, RunWrite};
use relay_store::tracks::{self, TrackClaim};
use relay_store::{EndpointId, StoreError, TenantId};
use relay_wire::Message;
use sqlx::{PgConnection, PgPool};
use time::OffsetDateTime;
use tokio::sync::watch;

use crate::batch::BatchedRun;
use crate::metrics::SequencerMetrics;
use crate::reload::ReloadLimits;
use crate::upstream::{self, FeedSelection, UpstreamClient, UpstreamError};

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The fencing token moved on: another worker owns the endpoint now. Stop.
    #[error("the endpoint's fence moved on: another worker owns it")]
    Fenced,
    /// The cursor was not where this worker read it: someone else applied these messages.
    #[error("the apply cursor moved under this worker")]
    CursorMoved,
    /// Another writer (a reload's merge that committed while the run's first statement waited
    /// for the endpoint's lock) wrote rows that statement could not see: its rows were stale
    /// (relay-store's `OpenedRun::stale`), or a write of the plan made from them was refused.
    /// Nothing committed; the run is decided again at once.
    #[error("a row changed under the run: decided again")]
    Raced,
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("postgres: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Stopped(#[from] crate::batch::BatcherStopped),
    /// A shared read of pending messages failed (the statement's error, as text: it answered
    /// several workers).
    #[error("reading pending messages: {0}")]
    PendingRead(String),
    /// A stories endpoint's upstream read failed: tried again later.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
}

impl ApplyError {
    /// Whether the connection the failure came on may be unusable now (its stream broke, or
    /// the server ended the session): the next try takes another.
    pub fn may_have_broken_the_connection(&self) -> bool {
        match self {
            ApplyError::Database(error) | ApplyError::Store(StoreError::Database(error)) => {
                match error {
                    sqlx::Error::Database(db) => db
                        .code()
                        .is_some_and(|code| matches!(code.get(..2), Some("08" | "57"))),
                    sqlx::Error::Io(_)
                    | sqlx::Error::Tls(_)
                    | sqlx::Error::Protocol(_)
                    | sqlx::Error::WorkerCrashed => true,
                    _ => false,
                }
            }
            _ => false,
        }
    }

    /// Whether the failure may come from the messages being applied, so that it counts as a
    /// failed attempt of the endpoint's next message: Postgres refused a statement for what it
    /// holds, or a stored value does not fit. Not when it comes from around them (Postgres out
    /// of reach, too slow or shutting down, a conflict with another transaction, another owner,
    /// the sequencer stopping): those are retried for as long as they last and quarantine
    /// nothing.
    pub fn may_be_the_message(&self) -> bool {
        match self {
            ApplyError::Database(error) | ApplyError::Store(StoreError::Database(error)) => {
                statement_refused(error)
            }
            ApplyError::Store(StoreError::Invalid(_)) => true,
            _ => false,
        }
    }
}

/// Postgres refused the statement for its values (a data exception, a constraint, ...) rather
/// than for the state of the server or of other transactions (SQLSTATE classes 08 connection,
/// 40 rollback: serialization or deadlock, 53 resources, 55 lock not available, 57 cancelled or
/// shutting down, 58 system, XX internal).
fn statement_refused(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => !db.code().is_some_and(|code| {
            matches!(
                code.get(..2),
                Some("08" | "40" | "53" | "55" | "57" | "58" | "XX")
            )
        }),
        sqlx::Error::Encode(_) => true,
        _ => false,
    }
}

/// One owned endpoint: its registration as last read, and its upstream client.
///
/// The registration can change while the endpoint is owned (a tenant rotates a leaked key or
/// moves its upstream URL): [`EndpointContext::update`] swaps the client and tells whoever waits
/// on [`EndpointContext::changes`]
/// (a reload pausing after a failed read tries again at once, with the new values).
pub struct EndpointContext {
    id: EndpointId,
    tenant: TenantId,
    http: relay_netguard::GuardedClient,
    feed_page_limit: usize,
    /// `None`: the registration names no upstream base URL or key; nothing is read until it does.
    upstream: std::sync::RwLock<Option<UpstreamClient>>,
    changed: watch::Sender<u64>,
    /// The process's bounds on reload passes, shared by every endpoint's.
    reloads: ReloadLimits,
}

impl EndpointContext {
    pub fn new(registration: EndpointRegistration, http: relay_netguard::GuardedClient) -> Self {
        let context = Self {
            id: registration.id,
            tenant: registration.tenant_id,
            http,
            feed_page_limit: crate::upstream::FEED_PAGE_LIMIT,
            upstream: std::sync::RwLock::new(None),
            changed: watch::channel(0).0,
            reloads: ReloadLimits::default(),
        };
        context.set_client(&registration);
        context
    }

    pub fn id(&self) -> EndpointId {
        self.id
    }

    pub fn tenant(&self) -> TenantId {
        self.tenant
    }

    /// Reads `/v1/feed` `limit` items per page (see [`UpstreamClient::with_page_limit`]).
    pub fn with_feed_page_limit(mut self, limit: usize) -> Self {
        self.feed_page_limit = limit;
        let client = self.upstream.get_mut().expect("not poisoned").take();
        *self.upstream.get_mut().expect("not poisoned") =
            client.map(|client| client.with_page_limit(limit));
        self
    }

    /// Runs this endpoint's reload passes under `limits` (the process's, shared with every
    /// other endpoint) instead of bounds of its own.
    pub(crate) fn with_reloads(mut self, limits: ReloadLimits) -> Self {
        self.reloads = limits;
        self
    }

    pub(crate) fn reloads(&self) -> &ReloadLimits {
        &self.reloads
    }

    fn set_client(&self, registration: &EndpointRegistration) {
        let client = UpstreamClient::new(
            self.http.clone(),
            registration.upstream_base_url.as_deref(),
            registration.upstream_api_key.as_ref(),
        )
        .ok()
        .map(|client| client.with_page_limit(self.feed_page_limit));
        *self.upstream.write().expect("not poisoned") = client;
    }

    /// The upstream client as the registration is now, or [`UpstreamError::NotConfigured`].
    pub fn upstream(&self) -> Result<UpstreamClient, UpstreamError> {
        self.upstream
            .read()
            .expect("not poisoned")
            .clone()
            .ok_or(UpstreamError::NotConfigured)
    }

    /// Whether the registration names an upstream to read: without one, no reload or refetch
    /// read is tried (each would fail the same way) until a change names one.
    pub fn has_upstream(&self) -> bool {
        self.upstream.read().expect("not poisoned").is_some()
    }

    /// Takes the registration as it is now: the next upstream read uses its URL and key, and
    /// [`EndpointContext::changes`] fires.
    pub fn update(&self, registration: &EndpointRegistration) {
        self.set_client(registration);
        self.changed.send_modify(|version| *version += 1);
    }

    /// Fires on each [`EndpointContext::update`].
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The endpoint's language, filter and track generation as they are now
    /// (`GET /v1/webhook-endpoints/{id}`): read for each run that refetches and each reload
    /// pass, never kept, so a language changed upstream is read in the next.
    pub async fn read_selection(&self) -> Result<FeedSelection, UpstreamError> {
        self.upstream()?.selection(self.id).await
    }
}

/// The answers of a run's refetch reads, by event id.
type Prefetched = HashMap<String, RefetchRead>;

/// Pauses between refetch reads that failed: short, since the next message waits on them.
const REFETCH_RETRY: RetryPolicy = RetryPolicy {
    first: Duration::from_millis(50),
    max: Duration::from_millis(400),
};

/// Reads every refetch the run asks for whose event is not applied yet (step 1 of
/// [`decide_run`]'s driving), trying a failed read (a load balancer's 404, no answer) up to
/// [`REFETCH_ATTEMPTS`] times. The selection is read afresh for the run (the endpoint's language
/// may have changed since the last reload), once, and only when a refetch is to be read.
async fn prefetch(
    pool: &PgPool,
    ctx: &EndpointContext,
    messages: &[StoredMessage],
    metrics: &SequencerMetrics,
) -> Result<Prefetched, ApplyError> {
    let wanted = refetches_wanted(messages);
    let mut answers = Prefetched::new();
    if wanted.is_empty() {
        return Ok(answers);
    }
    let ids: Vec<&str> = wanted.iter().map(|(id, _)| *id).collect();
    let applied = relay_store::copy::applied_among(pool, ctx.id(), &ids).await?;
    // Read once for the run, when the first refetch is to be read; `None` inside: it failed.
    let mut selection: Option<Option<FeedSelection>> = None;
    for (event_id, feed_item_id) in wanted {
        if applied.contains(event_id) || answers.contains_key(event_id) {
            continue;
        }
        if selection.is_none() {
            let read = ctx.read_selection().await;
            match &read {
                // Without settings nothing was tried: the state says so without a failure.
                Err(UpstreamError::NotConfigured) | Ok(_) => {}
                Err(error) => {
                    metrics
                        .upstream_failures
                        .with_label_values(&["endpoint", error.kind()])
                        .inc();
                    upstream::record_failure(pool, ctx.tenant(), ctx.id(), error).await?;
                }
            }
            selection = Some(read.ok());
        }
        let (Ok(upstream), Some(Some(selection))) = (ctx.upstream(), &selection) else {
            metrics.refetches.with_label_values(&["failed"]).inc();
            let read = RefetchRead {
                answer: RefetchAnswer::Failed,
                attempts: REFETCH_ATTEMPTS,
            };
            answers.insert(event_id.to_owned(), read);
            continue;
        };
        let mut attempts = 1;
        let mut pauses = REFETCH_RETRY.pauses();
        let answer = loop {
            let answer = match upstream.read_item(selection, feed_item_id).await {
                Ok(RefetchAnswer::LoadBalancer404) => {
                    metrics
                        .upstream_failures
                        .with_label_values(&["refetch", "load_balancer_404"])
                        .inc();
                    RefetchAnswer::LoadBalancer404
                }
                Ok(answer) => {
                    upstream::record_success(pool, ctx.tenant(), ctx.id()).await?;
                    answer
                }
                Err(error) => {
                    metrics
                        .upstream_failures
                        .with_label_values(&["refetch", error.kind()])
                        .inc();
                    let failures =
                        upstream::record_failure(pool, ctx.tenant(), ctx.id(), &error).await?;
                    tracing::debug!(endpoint = %ctx.id(), %error, failures, "refetch read failed");
                    RefetchAnswer::Failed
                }
            };
            let label = match &answer {
                RefetchAnswer::Found { .. } => "found",
                RefetchAnswer::NotFound { .. } => "not_found",
                RefetchAnswer::LoadBalancer404 => "load_balancer_404",
                RefetchAnswer::Failed => "failed",
            };
            metrics.refetches.with_label_values(&[label]).inc();
            if answer.failed() && attempts < REFETCH_ATTEMPTS {
                attempts += 1;
                tokio::time::sleep(pauses.next_pause()).await;
                continue;
            }
            break answer;
        };
        answers.insert(event_id.to_owned(), RefetchRead { answer, attempts });
    }
    Ok(answers)
}

/// What applying a run of messages did.
#[derive(Debug, Clone)]
pub struct BatchReport {
    pub messages: usize,
    /// Changes appended to the outbox.
    pub changes: usize,
    /// True when the track has a reload to run after these messages.
    pub reload_pending: bool,
    /// Those changes as the outbox holds them, when the kind's statements said (the feed's):
    /// the appliers hand them to this process's publisher (see [`crate::batch`]).
    pub appended: Vec<relay_store::changes::Unpublished>,
}

/// A run of one endpoint's stored messages, parsed, with its refetch reads done: ready to apply
/// in a transaction, alone or beside other endpoints' runs.
pub struct PreparedRun {
    ctx: Arc<EndpointContext>,
    token: i64,
    /// The apply cursor the messages follow.
    applied: i64,
    /// Where the cursor moves: at or past the last message (the arrival counter the messages
    /// were read under, when they were all the messages below it, so numbers that duplicates
    /// took and left unused are skipped in the same transaction).
    through: i64,
    pending: Vec<PendingMessage>,
    parsed: Vec<StoredMessage>,
    prefetched: Prefetched,
    started: Instant,
}

impl BatchedRun for PreparedRun {
    fn key(&self) -> (TenantId, EndpointId) {
        (self.ctx.tenant(), self.ctx.id())
    }

    fn pending(&self) -> &[PendingMessage] {
        &self.pending
    }

    /// Two statements whatever the number of runs: [`runs::open_runs`], then [`decide_run`]
    /// for each run still owned, then [`runs::write_runs`]. Sharing the transaction changes
    /// only how many round trips and commits the runs take: endpoints never share a row. A
    /// write refused because a row changed under it fails the whole ([`ApplyError::Raced`]).
    async fn apply_together(
        conn: &mut PgConnection,
        runs: &[&Self],
        metrics: &SequencerMetrics,
    ) -> Result<Vec<Result<BatchReport, ApplyError>>, ApplyError> {
        apply_together(conn, runs, metrics).await
    }
}

/// Parses the run's messages and reads each refetch they ask for (so no lock is ever held
/// across HTTP). `cursor` is (the cursor the messages follow, where it moves to).
pub async fn prepare_run(
    pool: &PgPool,
    ctx: &Arc<EndpointContext>,
    token: i64,
    (applied, through): (i64, i64),
    pending: Vec<PendingMessage>,
    metrics: &SequencerMetrics,
) -> Result<PreparedRun, ApplyError> {
    let started = Instant::now();
    let parsed: Vec<StoredMessage> = pending
        .iter()
        .map(|m| Message::parse(&m.body).map_err(|e| e.to_string()))
        .collect();
    let prefetched = prefetch(pool, ctx, &parsed, metrics).await?;
    let through = pending
        .last()
        .map_or(through, |m| through.max(m.arrival_seq));
    Ok(PreparedRun {
        ctx: ctx.clone(),
        token,
        applied,
        through,
        pending,
        parsed,
        prefetched,
        started,
    })
}

/// Sets aside the endpoint's next message (`arrival_seq`, the first after the cursor at
/// `applied`), whose apply failed `attempts` times (the last with `error`), and reads the feed
/// again (relay-rules' [`quarantine`]), in one transaction: under the endpoint's locks
/// ([`tracks::open`]), one statement moves the cursor past it (only from `applied`), records it
/// and its outcome, and writes the track row with the reload.
pub async fn quarantine_failing(
    pool: &PgPool,
    ctx: &EndpointContext,
    token: i64,
    (applied, arrival_seq): (i64, i64),
    (attempts, error): (u32, String),
    metrics: &SequencerMetrics,
) -> Result<(), ApplyError> {
    let (tenant, endpoint) = (ctx.tenant(), ctx.id());
    let mut tx = pool.begin().await?;
    let claim = TrackClaim {
        endpoint,
        tenant,
        token,
    };
    let Some(held) = tracks::open(&mut tx, claim).await? else {
        return Err(ApplyError::Fenced);
    };
    let why = Unapplicable::KeepsFailing { attempts, error };
    let reason = why.to_string();
    let (track, decision) = quarantine(&held, why);
    let attempts = i32::try_from(attempts).unwrap_or(i32::MAX);
    let moved = runs::quarantine_next(
        &mut tx,
        (tenant, endpoint),
        (applied, arrival_seq),
        (&reason, attempts),
        Some(&track),
    )
    .await?;
    if !moved {
        return Err(ApplyError::CursorMoved);
    }
    tx.commit().await?;
    tracing::warn!(%endpoint, arrival_seq, %reason, "message quarantined; the feed is read again");
    if let relay_rules::MessageDecision::Quarantine { reload, .. } = &decision {
        note_reload(endpoint, reload, metrics);
    }
    metrics
        .messages
        .with_label_values(&[Outcome::Quarantined.as_str()])
        .inc();
    Ok(())
}

/// Times the steps of one apply transaction into `relay_sequencer_apply_step_seconds`: each
/// step from the end of the one before. A step that fails is not observed.
struct StepClock<'a> {
    metrics: &'a SequencerMetrics,
    last: std::time::Instant,
}

impl<'a> StepClock<'a> {
    fn new(metrics: &'a SequencerMetrics) -> Self {
        Self {
            metrics,
            last: std::time::Instant::now(),
        }
    }

    fn done(&mut self, step: &str) {
        let now = std::time::Instant::now();
        self.metrics
            .apply_step_duration
            .with_label_values(&[step])
            .observe((now - self.last).as_secs_f64());
        self.last = now;
    }
}

/// [`PreparedRun`]'s [`BatchedRun::apply_together`].
async fn apply_together(
    conn: &mut PgConnection,
    runs: &[&PreparedRun],
    metrics: &SequencerMetrics,
) -> Result<Vec<Result<BatchReport, ApplyError>>, ApplyError> {
    let mut steps = StepClock::new(metrics);
    let mut tx = sqlx::Connection::begin(conn).await?;
    steps.done("begin");
    let keys: Vec<(Vec<&str>, Vec<&str>)> = runs
        .iter()
        .map(|run| (event_ids(&run.parsed), subjects(&run.parsed)))
        .collect();
    let claims: Vec<RunClaim<'_>> = runs
        .iter()
        .zip(&keys)
        .map(|(run, (ids, subjects))| RunClaim {
            claim: TrackClaim {
                endpoint: run.ctx.id(),
                tenant: run.ctx.tenant(),
                token: run.token,
            },
            event_ids: ids,
            subjects,
        })
        .collect();
    let opened = runs::open_runs(&mut tx, &claims).await?;
    steps.done("open");

    // The runs whose fence is still theirs, each with its plan.
    let mut owned: Vec<(&PreparedRun, RunPlan, Vec<i64>, bool)> = Vec::new();
    for (run, opened) in runs.iter().zip(opened) {
        let Some(opened) = opened else { continue };
        if opened.stale {
            // Decided from these rows, a removal could tombstone an item it never saw (and
            // append no removal), an update diff its parts against nothing.
            return Err(ApplyError::Raced);
        }
        let decided = decide_run(
            Run {
                track: &opened.track,
                messages: &run.parsed,
                seen: &opened.seen,
                refetches: &run.prefetched,
            },
            opened.held,
        );
        let seqs = run.pending.iter().map(|m| m.arrival_seq).collect();
        let reload_pending = decided.track_after(&opened.track).reload.is_some();
        owned.push((*run, decided, seqs, reload_pending));
    }
    let writes: Vec<RunWrite<'_>> = owned
        .iter()
        .map(|(run, plan, seqs, _)| RunWrite {
            endpoint: run.ctx.id(),
            tenant: run.ctx.tenant(),
            plan,
            from: run.applied,
            to: run.through,
            arrival_seqs: seqs,
            last_received_at: run.pending.last().map(|m| m.received_at),
        })
        .collect();
    steps.done("decide");
    let written = runs::write_runs(&mut tx, &writes).await?;
    steps.done("write");
    for ((_, plan, _, _), written) in owned.iter().zip(&written) {
        if written.rows != plan.rows.len() as i64 {
            // Decided under the rows' locks, yet refused: another writer's row that the open
            // statement could not see, and did not find stale.
            return Err(ApplyError::Raced);
        }
        if !written.cursor_moved {
            return Err(ApplyError::CursorMoved);
        }
    }
    tx.commit().await?;
    steps.done("commit");

    let now = OffsetDateTime::now_utc();
    let mut reports = owned
        .iter()
        .zip(written)
        .map(|((run, plan, _, reload_pending), written)| {
            count_plan(run, plan, metrics);
            metrics.observe_applied(run.started, &run.pending, now);
            let report = BatchReport {
                messages: run.pending.len(),
                changes: usize::try_from(written.changes).unwrap_or(0),
                reload_pending: *reload_pending,
                appended: written.appended,
            };
            (run.ctx.id(), report)
        })
        .collect::<HashMap<EndpointId, BatchReport>>();
    Ok(runs
        .iter()
        .map(|run| reports.remove(&run.ctx.id()).ok_or(ApplyError::Fenced))
        .collect())
}

/// Counts and logs a committed run's plan.
fn count_plan(run: &PreparedRun, plan: &RunPlan, metrics: &SequencerMetrics) {
    let endpoint = run.ctx.id();
    for event in &plan.events {
        metrics.events.with_label_values(&[event.as_str()]).inc();
        if let relay_rules::EventOutcome::RefetchReload { answered } = event {
            let label = if *answered {
                "other_access_version"
            } else {
                "reload"
            };
            metrics.refetches.with_label_values(&[label]).inc();
        }
    }
    for (message, stored) in plan.messages.iter().zip(&run.pending) {
        metrics
            .messages
            .with_label_values(&[message.outcome.as_str()])
            .inc();
        if let Some(why) = &message.quarantined {
            tracing::warn!(%endpoint, arrival_seq = stored.arrival_seq, %why,
                "message quarantined; the feed is read again");
        }
    }
    for start in &plan.reloads {
        note_reload(endpoint, start, metrics);
    }
}

fn note_reload(endpoint: EndpointId, start: &ReloadStart, metrics: &SequencerMetrics) {
    match start {
        ReloadStart::Begin(r) => tracing::info!(%endpoint, generation = r.generation,
            cause = ?r.cause, "reload begins"),
        ReloadStart::Supersede { stopped, begun } => tracing::info!(%endpoint,
            stopped = stopped.generation, begun = begun.generation, cause = ?begun.cause,
            "reload replaced"),
        ReloadStart::ReadAgain(r) => {
            tracing::info!(%endpoint, generation = r.generation, asked = r.read_again,
                "the running reload reads another pass after this one");
            return;
        }
    }
    metrics.reloads.with_label_values(&["started"]).inc();
}
