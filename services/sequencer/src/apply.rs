//! Applying runs of stored messages: the driver around relay-rules' [`step`] and
//! [`decide_event`].
//!
//! One transaction applies one run of messages for each of several endpoints (a batch of one
//! when applied alone), two statements inside it: the first checks each fence, takes each
//! endpoint's writer lock, reads its track row locked, records the runs' event ids and reads
//! (and locks) the rows of the subjects they touch; the second writes the rows the decisions
//! left (each still checking its position), appends their changes, writes the track rows and
//! the outcomes, forgets the ids of messages that did not apply and moves each apply cursor
//! (only from where it was read). A
//! refetch's item read happens before that transaction (so no lock is held across HTTP), and
//! its answer is decided inside it against the row as it is then: "read it before applying the
//! next message".

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_netguard::RetryPolicy;
use relay_rules::{
    decide_event, decide_refetch, feed_subject, quarantine, step, Decision, EndpointTrack,
    FeedCopy, IgnoreReason, MessageDecision, PendingRefetch, RefetchAnswer, RefetchOutcome,
    ReloadStart, Unapplicable, REFETCH_ATTEMPTS,
};
use relay_store::copy;
use relay_store::StoreError;
use relay_wire::{EventBody, FeedData, Message};
use sqlx::PgPool;
use time::OffsetDateTime;
use tokio::sync::{watch, Mutex};
use uuid::Uuid;

use crate::metrics::SequencerMetrics;
use crate::state::{self, EndpointRegistration, MessageOutcome, PendingMessage, StateError};
use crate::upstream::{self, FeedSelection, UpstreamClient, UpstreamError};

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The fencing token moved on: another worker owns the endpoint now. Stop.
    #[error("the endpoint's fence moved on: another worker owns it")]
    Fenced,
    /// The cursor was not where this worker read it: someone else applied these messages.
    #[error("the apply cursor moved under this worker")]
    CursorMoved,
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("postgres: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Stopped(#[from] crate::batch::BatcherStopped),
    /// A shared read of pending messages failed (the statement's error, as text: it answered
    /// several workers).
    #[error("reading pending messages: {0}")]
    PendingRead(String),
}

impl ApplyError {
    /// Whether the failure may come from the messages being applied, so that it counts as a
    /// failed attempt of the endpoint's next message: Postgres refused a statement for what it
    /// holds, or a stored value does not fit. Not when it comes from around them (Postgres out
    /// of reach, too slow or shutting down, a conflict with another transaction, another owner,
    /// the sequencer stopping): those are retried for as long as they last and quarantine
    /// nothing.
    pub fn may_be_the_message(&self) -> bool {
        match self {
            ApplyError::Database(error)
            | ApplyError::Store(StoreError::Database(error))
            | ApplyError::State(StateError::Database(error)) => statement_refused(error),
            ApplyError::Store(StoreError::Invalid(_))
            | ApplyError::State(StateError::Invalid(_)) => true,
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

/// One owned endpoint: its registration as last read, its upstream client, and the selection
/// (language, filter) last read from the upstream.
///
/// The registration can change while the endpoint is owned (a tenant rotates a leaked key or
/// moves its upstream URL): [`EndpointContext::update`] swaps the client, forgets the selection
/// (the language may have changed with it) and tells whoever waits on [`EndpointContext::changes`]
/// (a reload pausing after a failed read tries again at once, with the new values).
pub struct EndpointContext {
    id: Uuid,
    tenant: Uuid,
    http: relay_netguard::GuardedClient,
    feed_page_limit: usize,
    /// `None`: the registration names no upstream base URL or key; nothing is read until it does.
    upstream: std::sync::RwLock<Option<UpstreamClient>>,
    changed: watch::Sender<u64>,
    selection: Mutex<Option<FeedSelection>>,
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
            selection: Mutex::new(None),
        };
        context.set_client(&registration);
        context
    }

    pub fn id(&self) -> Uuid {
        self.id
    }

    pub fn tenant(&self) -> Uuid {
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

    fn set_client(&self, registration: &EndpointRegistration) {
        let client = UpstreamClient::new(
            self.http.clone(),
            registration.upstream_base_url.as_deref(),
            registration.upstream_api_key.as_deref(),
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

    /// Takes the registration as it is now: the next upstream read uses its URL and key, the
    /// selection is read again, and [`EndpointContext::changes`] fires.
    pub async fn update(&self, registration: &EndpointRegistration) {
        self.set_client(registration);
        *self.selection.lock().await = None;
        self.changed.send_modify(|version| *version += 1);
    }

    /// Fires on each [`EndpointContext::update`].
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The endpoint's language and filter: read once, and again by every reload.
    pub async fn selection(&self) -> Result<FeedSelection, UpstreamError> {
        let mut held = self.selection.lock().await;
        if let Some(selection) = held.as_ref() {
            return Ok(selection.clone());
        }
        let upstream = self.upstream()?;
        let selection = upstream.selection(self.id()).await?;
        *held = Some(selection.clone());
        Ok(selection)
    }

    /// A reload read the selection as it is now: later refetches use it.
    pub async fn set_selection(&self, selection: FeedSelection) {
        *self.selection.lock().await = Some(selection);
    }
}

/// What applying one message did.
#[derive(Debug, Clone)]
pub struct MessageReport {
    pub outcome: MessageOutcome,
    /// True when the track has a reload to run after this message.
    pub reload_pending: bool,
}

/// The answers of a message's refetch reads, by event id, with the number of the last read.
type Prefetched = HashMap<String, (RefetchAnswer, u32)>;

/// Pauses between refetch reads that failed: short, since the next message waits on them.
const REFETCH_RETRY: RetryPolicy = RetryPolicy {
    first: Duration::from_millis(50),
    max: Duration::from_millis(400),
};

/// Reads every refetch of the message whose event is not applied yet, trying a failed read
/// (a load balancer's 404, no answer) up to [`REFETCH_ATTEMPTS`] times.
async fn prefetch(
    pool: &PgPool,
    ctx: &EndpointContext,
    message: &Message,
    metrics: &SequencerMetrics,
) -> Result<Prefetched, ApplyError> {
    let refetches: Vec<(&str, &str)> = message
        .events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::Feed {
                data: FeedData::Refetch { feed_item_id, .. },
                ..
            } => Some((e.id.as_str(), feed_item_id.as_str())),
            _ => None,
        })
        .collect();
    let mut answers = Prefetched::new();
    if refetches.is_empty() {
        return Ok(answers);
    }
    let ids: Vec<&str> = refetches.iter().map(|(id, _)| *id).collect();
    let applied: HashSet<String> = sqlx::query_scalar(
        "SELECT event_id FROM applied_events WHERE endpoint_id = $1 AND event_id = ANY($2)",
    )
    .bind(ctx.id())
    .bind(&ids)
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    for (event_id, feed_item_id) in refetches {
        if applied.contains(event_id) || answers.contains_key(event_id) {
            continue;
        }
        let selection = ctx.selection().await;
        match &selection {
            // Without settings nothing was tried: the state says so without a failure.
            Err(UpstreamError::NotConfigured) | Ok(_) => {}
            Err(error) => upstream::record_failure(pool, ctx.tenant(), ctx.id(), error).await?,
        }
        let (Ok(upstream), Ok(selection)) = (ctx.upstream(), selection) else {
            metrics.refetches.with_label_values(&["failed"]).inc();
            answers.insert(
                event_id.to_owned(),
                (RefetchAnswer::Failed, REFETCH_ATTEMPTS),
            );
            continue;
        };
        let mut attempt = 1;
        let mut pauses = REFETCH_RETRY.pauses();
        let answer = loop {
            let answer = match upstream.read_item(&selection, feed_item_id).await {
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
                    tracing::debug!(endpoint = %ctx.id(), %error, "refetch read failed");
                    metrics
                        .upstream_failures
                        .with_label_values(&["refetch", error.kind()])
                        .inc();
                    upstream::record_failure(pool, ctx.tenant(), ctx.id(), &error).await?;
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
            let failed = matches!(
                answer,
                RefetchAnswer::LoadBalancer404 | RefetchAnswer::Failed
            );
            if failed && attempt < REFETCH_ATTEMPTS {
                attempt += 1;
                tokio::time::sleep(pauses.next_pause()).await;
                continue;
            }
            break answer;
        };
        answers.insert(event_id.to_owned(), (answer, attempt));
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
}

/// Applies `pending`, the stored messages that follow `applied` in arrival order, under fencing
/// token `token`, in one transaction of its own (see [`apply_runs`]).
pub async fn apply_messages(
    pool: &PgPool,
    ctx: &Arc<EndpointContext>,
    token: i64,
    applied: i64,
    pending: &[PendingMessage],
    metrics: &SequencerMetrics,
) -> Result<BatchReport, ApplyError> {
    let through = pending.last().map_or(applied, |m| m.arrival_seq);
    let run = prepare_run(
        pool,
        ctx,
        token,
        (applied, through),
        pending.to_vec(),
        metrics,
    )
    .await?;
    apply_runs(pool, vec![run], metrics)
        .await
        .pop()
        .expect("one answer per run")
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
    parsed: Vec<Result<Message, relay_wire::MessageError>>,
    prefetched: Prefetched,
    started: Instant,
}

impl PreparedRun {
    pub fn endpoint(&self) -> Uuid {
        self.ctx.id()
    }

    pub fn tenant(&self) -> Uuid {
        self.ctx.tenant()
    }

    /// The number of messages in the run.
    pub fn messages(&self) -> usize {
        self.pending.len()
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
    let parsed: Vec<Result<Message, relay_wire::MessageError>> =
        pending.iter().map(|m| Message::parse(&m.body)).collect();
    let mut prefetched = Prefetched::new();
    for message in parsed.iter().flatten() {
        prefetched.extend(prefetch(pool, ctx, message, metrics).await?);
    }
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
/// ([`state::open_track`]), the statement that moves the cursor past it (only from `applied`)
/// records it and its outcome, and the track row takes the reload.
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
    let Some(held) = state::open_track(&mut tx, tenant, endpoint, token, state::FEED_TRACK).await?
    else {
        return Err(ApplyError::Fenced);
    };
    let why = Unapplicable::KeepsFailing { attempts, error };
    let reason = why.to_string();
    let (track, decision) = quarantine(&held, why);
    let attempts = i32::try_from(attempts).unwrap_or(i32::MAX);
    if !state::quarantine_next(
        &mut tx,
        tenant,
        endpoint,
        (applied, arrival_seq),
        &reason,
        attempts,
    )
    .await?
    {
        return Err(ApplyError::CursorMoved);
    }
    state::save_track(&mut tx, tenant, endpoint, state::FEED_TRACK, &track).await?;
    tx.commit().await?;
    tracing::warn!(%endpoint, arrival_seq, %reason, "message quarantined; the feed is read again");
    let mut tally = Tally::default();
    if let MessageDecision::Quarantine { reload, .. } = &decision {
        note_reload_start(&mut tally, endpoint, reload);
    }
    tally.count(metrics);
    metrics
        .messages
        .with_label_values(&[MessageOutcome::Quarantined.as_str()])
        .inc();
    Ok(())
}

/// Applies several endpoints' runs (each endpoint once), answering each run in the order given.
///
/// They are tried in one transaction of two statements whatever their number (see
/// [`apply_together`]); a run whose fence moved on is answered [`ApplyError::Fenced`] and the
/// others still commit. When that transaction fails as a whole (an error, or a write that
/// disagreed with what was decided under its locks), nothing of it committed, and each run is
/// tried again alone, so one endpoint's trouble is answered to that endpoint only.
pub async fn apply_runs(
    pool: &PgPool,
    runs: Vec<PreparedRun>,
    metrics: &SequencerMetrics,
) -> Vec<Result<BatchReport, ApplyError>> {
    let all: Vec<&PreparedRun> = runs.iter().collect();
    match apply_together(pool, &all, metrics).await {
        Ok(answers) => answers,
        Err(error) if runs.len() == 1 => vec![Err(error)],
        Err(error) => {
            tracing::debug!(%error, runs = runs.len(), "runs applied together failed; alone now");
            let mut answers = Vec::with_capacity(runs.len());
            for run in &runs {
                answers.push(match apply_together(pool, &[run], metrics).await {
                    Ok(mut answer) => answer.pop().expect("one answer per run"),
                    Err(error) => Err(error),
                });
            }
            answers
        }
    }
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

/// One transaction for every run in `runs`, two statements inside it: the first
/// ([`state::open_runs`]) checks each fence, takes each endpoint's writer lock, reads its track
/// row locked, records the event ids of every message of the run and reads (and locks) the rows
/// of the subjects they touch; the second ([`state::write_runs`]) writes the rows the decisions
/// left (each still checking its position), appends their changes, writes the track rows and
/// the outcomes, forgets the ids of the messages the track says do not apply, and moves each
/// cursor (only from where it was read).
///
/// Each run's messages are still taken one at a time, in order, by the rules: the track row goes
/// through [`step`] message by message, and each event is decided against what the copy holds
/// after every earlier event (relay-rules' reference copy, [`FeedCopy`], seeded with the rows
/// read and locked here). Sharing the transaction changes only how many round trips and commits
/// that takes: endpoints never share a row.
async fn apply_together(
    pool: &PgPool,
    runs: &[&PreparedRun],
    metrics: &SequencerMetrics,
) -> Result<Vec<Result<BatchReport, ApplyError>>, ApplyError> {
    let mut steps = StepClock::new(metrics);
    let mut tx = pool.begin().await?;
    steps.done("begin");
    // Every event of every message, and the subjects they touch: which messages apply their
    // events depends on the track, which the same statement reads (and locks). The ids of
    // those that do not apply are forgotten again by the write, in this transaction.
    let every_key: Vec<(Vec<&str>, Vec<&str>)> = runs.iter().map(|run| all_keys(run)).collect();
    let claims: Vec<state::RunClaim<'_>> = runs
        .iter()
        .zip(&every_key)
        .map(|(run, (ids, subjects))| state::RunClaim {
            claim: state::TrackClaim {
                endpoint: run.ctx.id(),
                tenant: run.ctx.tenant(),
                token: run.token,
            },
            keys: copy::RunKeys {
                endpoint: run.ctx.id(),
                tenant: run.ctx.tenant(),
                event_ids: ids,
                subjects,
            },
        })
        .collect();
    let opened = state::open_runs(&mut tx, &claims, state::FEED_TRACK).await?;
    steps.done("open");

    // The runs whose fence is still theirs, each with its track as read, the ids to forget
    // (recorded above, but of messages the track says do not apply), and its decisions.
    let mut owned: Vec<(&PreparedRun, EndpointTrack, Vec<String>)> = Vec::new();
    let mut decided: Vec<DecidedRun> = Vec::new();
    for (run, opened) in runs.iter().zip(opened) {
        let Some(state::OpenedRun { track, held }) = opened else {
            continue;
        };
        let applying = applying_event_ids(run, &track);
        let forget = held
            .first_seen
            .iter()
            .filter(|id| !applying.contains(id.as_str()))
            .cloned()
            .collect();
        decided.push(decide_run(run, track.clone(), held));
        owned.push((*run, track, forget));
    }
    let mut writes = copy::DecidedWrites::default();
    let mut ends = Vec::with_capacity(decided.len());
    for ((run, held_track, forget), run_decided) in owned.iter().zip(&decided) {
        let rows: Vec<(&str, &copy::HeldEntry, Option<&str>)> = run_decided
            .rows
            .iter()
            .map(|(subject, entry, text)| {
                let text = text.and_then(|i| run_decided.texts[i].as_deref());
                (subject.as_str(), entry, text)
            })
            .collect();
        let changes: Vec<copy::DecidedChange<'_>> = run_decided
            .decided
            .iter()
            .zip(&run_decided.texts)
            .filter(|((d, _), _)| d.is_change())
            .map(|((decision, event_id), text)| copy::DecidedChange {
                decision,
                event_id,
                item_text: text.as_deref(),
            })
            .collect();
        writes.push(run.ctx.id(), run.ctx.tenant(), &rows, &changes)?;
        let last = run.pending.last();
        ends.push(state::RunEnd {
            endpoint: run.ctx.id(),
            tenant: run.ctx.tenant(),
            track: (run_decided.track != *held_track).then_some(&run_decided.track),
            outcomes: &run_decided.outcomes,
            quarantined: &run_decided.quarantined,
            forget: forget.iter().map(String::as_str).collect(),
            from: run.applied,
            to: run.through,
            last_received_at: last.map(|m| m.received_at),
        });
    }
    steps.done("decide");
    let written = state::write_runs(&mut tx, writes, &ends).await?;
    steps.done("write");
    for (((run, _, _), run_decided), written) in owned.iter().zip(&decided).zip(&written) {
        let endpoint = run.ctx.id();
        if written.rows != run_decided.rows.len() as i64 {
            // Every row was decided under its lock, so the statement can only agree; if it does
            // not, something else writes this copy: stop rather than write a wrong change.
            tracing::error!(%endpoint, written = written.rows, decided = run_decided.rows.len(),
                "rows decided under lock were refused");
            return Err(ApplyError::CursorMoved);
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
        .zip(&decided)
        .zip(&written)
        .map(|(((run, _, _), run_decided), written)| {
            run_decided.tally.count(metrics);
            for (_, outcome, _, _) in &run_decided.outcomes {
                metrics
                    .messages
                    .with_label_values(&[outcome.as_str()])
                    .inc();
            }
            let per_message = run.started.elapsed().as_secs_f64() / run.pending.len().max(1) as f64;
            for message in &run.pending {
                metrics.message_apply_duration.observe(per_message);
                metrics
                    .apply_lag
                    .observe((now - message.received_at).as_seconds_f64().max(0.0));
            }
            (
                run.ctx.id(),
                BatchReport {
                    messages: run.pending.len(),
                    changes: usize::try_from(written.changes).unwrap_or(0),
                    reload_pending: run_decided.track.reload.is_some(),
                },
            )
        })
        .collect::<HashMap<Uuid, BatchReport>>();
    Ok(runs
        .iter()
        .map(|run| reports.remove(&run.ctx.id()).ok_or(ApplyError::Fenced))
        .collect())
}

/// Every event id of a run's messages, and the subjects of its feed events (sorted, once each).
fn all_keys(run: &PreparedRun) -> (Vec<&str>, Vec<&str>) {
    let events = || run.parsed.iter().flatten().flat_map(|m| m.events.iter());
    let ids: Vec<&str> = events().map(|e| e.id.as_str()).collect();
    let mut subjects: Vec<&str> = events().filter_map(|e| feed_subject(e)).collect();
    subjects.sort_unstable();
    subjects.dedup();
    (ids, subjects)
}

/// The event ids of the run's messages that apply their events, from the messages' track
/// transitions alone (a refetch's "read /v1/feed again" begins a reload, which never changes
/// whether a later message applies).
fn applying_event_ids<'r>(run: &'r PreparedRun, held_track: &EndpointTrack) -> HashSet<&'r str> {
    let mut probe = held_track.clone();
    let mut applying = HashSet::new();
    for message in run.parsed.iter().flatten() {
        let (next, decision) = step(&probe, message);
        if matches!(decision, MessageDecision::ApplyEvents { .. }) {
            applying.extend(message.events.iter().map(|e| e.id.as_str()));
        }
        probe = next;
    }
    applying
}

/// What a run's decisions count in the metrics, kept until its transaction commits: a run
/// decided again (its shared transaction failed as a whole and it is tried alone) counts once.
#[derive(Debug, Default)]
struct Tally {
    /// One label of `relay_sequencer_events_total` per event.
    events: Vec<&'static str>,
    /// Labels of `relay_sequencer_refetches_total` decided under the lock.
    refetches: Vec<&'static str>,
    /// Reloads begun or superseded.
    reloads_started: u64,
}

impl Tally {
    fn count(&self, metrics: &SequencerMetrics) {
        for label in &self.events {
            metrics.events.with_label_values(&[label]).inc();
        }
        for label in &self.refetches {
            metrics.refetches.with_label_values(&[label]).inc();
        }
        if self.reloads_started > 0 {
            metrics
                .reloads
                .with_label_values(&["started"])
                .inc_by(self.reloads_started);
        }
    }
}

/// What one run's decisions leave to write.
struct DecidedRun {
    /// The track after the run.
    track: EndpointTrack,
    /// The decisions that write, in order, with the event that caused each.
    decided: Vec<(Decision, String)>,
    /// Each stored item serialised once (by index into `decided`): for its change, and for its
    /// row when it is the row's last store (an `Unchanged` after it keeps the same item).
    texts: Vec<Option<String>>,
    /// The rows the decisions left, each subject once, with what reads keep beside them, and
    /// which of `texts` is the row's item.
    rows: Vec<(String, copy::HeldEntry, Option<usize>)>,
    outcomes: Vec<(i64, MessageOutcome, i32, i32)>,
    /// The messages set aside: (arrival_seq, reason).
    quarantined: Vec<(i64, String)>,
    tally: Tally,
}

/// Carries one run's messages out by the rules, against the rows read and locked for it.
fn decide_run(run: &PreparedRun, held_track: EndpointTrack, found: copy::RunHeld) -> DecidedRun {
    let mut tally = Tally::default();
    let endpoint = run.ctx.id();
    let copy::RunHeld {
        first_seen,
        held: held_entries,
    } = found;
    // The rows go into the reference copy whole (no copy of their items); what reads keep
    // beside them (kind, company) waits here for the write.
    let mut held_meta: HashMap<String, (Option<String>, Option<i64>)> = HashMap::new();
    let mut held_rows = BTreeMap::new();
    for (subject, entry) in held_entries {
        held_meta.insert(subject.clone(), (entry.item_kind, entry.company_id));
        held_rows.insert(subject, entry.held);
    }
    let mut reference = FeedCopy::from_rows(held_rows);

    let mut track = held_track;
    let mut seen_in_run: HashSet<&str> = HashSet::new();
    let mut decided: Vec<(Decision, String)> = Vec::new();
    let mut outcomes: Vec<(i64, MessageOutcome, i32, i32)> = Vec::with_capacity(run.pending.len());
    let mut quarantined: Vec<(i64, String)> = Vec::new();
    for (message, stored) in run.parsed.iter().zip(&run.pending) {
        // A stored body that is not a v1 message (the front tier stores what the upstream
        // signed, whatever it holds) can never apply: set aside, and the feed read again.
        let (next, decision) = match message {
            Ok(message) => step(&track, message),
            Err(error) => quarantine(&track, Unapplicable::NotV1(error.to_string())),
        };
        // Only a message that parsed has events to apply.
        let events = message.as_ref().map_or(&[][..], |m| m.events.as_slice());
        track = next;
        let mut events_applied = 0;
        let mut events_ignored = 0;
        let outcome = match decision {
            MessageDecision::Test => MessageOutcome::Test,
            MessageDecision::IgnoredTrack => MessageOutcome::IgnoredTrack,
            MessageDecision::Quarantine { why, reload } => {
                tracing::warn!(%endpoint, arrival_seq = stored.arrival_seq, %why,
                    "message quarantined; the feed is read again");
                note_reload_start(&mut tally, endpoint, &reload);
                quarantined.push((stored.arrival_seq, why.to_string()));
                MessageOutcome::Quarantined
            }
            MessageDecision::SkipOlderGeneration { generation, held } => {
                tracing::debug!(%endpoint, generation, held, "message of an older generation");
                MessageOutcome::OlderGeneration
            }
            MessageDecision::BeginReload(reload) => {
                tracing::info!(%endpoint, generation = reload.generation, "reset: reload begins");
                tally.reloads_started += 1;
                MessageOutcome::ReloadBegun
            }
            MessageDecision::SupersedeReload { stopped, begun } => {
                tracing::info!(%endpoint, stopped = stopped.generation,
                    begun = begun.generation, "newer reset: reload replaced");
                tally.reloads_started += 1;
                MessageOutcome::ReloadSuperseded
            }
            MessageDecision::ApplyEvents { generation, reload } => {
                if let Some(start) = &reload {
                    note_reload_start(&mut tally, endpoint, start);
                }
                for event in events {
                    // Rule "De-duplicate events by id, for each endpoint": recorded before this
                    // run, or earlier in it.
                    let label = if !first_seen.contains(&event.id)
                        || !seen_in_run.insert(event.id.as_str())
                    {
                        "ignored_duplicate"
                    } else {
                        let decision = decide_one(
                            &reference,
                            &mut track,
                            generation,
                            event,
                            &run.prefetched,
                            &mut tally,
                            endpoint,
                        );
                        match decision {
                            Err(label) => label,
                            Ok(decision) => {
                                reference.apply(&decision);
                                let label = decision_label(&decision);
                                if matches!(
                                    decision,
                                    Decision::Store { .. }
                                        | Decision::Unchanged { .. }
                                        | Decision::Tombstone { .. }
                                ) {
                                    decided.push((decision, event.id.clone()));
                                }
                                label
                            }
                        }
                    };
                    tally.events.push(label);
                    if label.starts_with("ignored") || label.starts_with("refetch_") {
                        events_ignored += 1;
                    } else {
                        events_applied += 1;
                    }
                }
                MessageOutcome::Applied
            }
        };
        outcomes.push((stored.arrival_seq, outcome, events_applied, events_ignored));
    }

    // The rows the decisions left, each subject once, with what reads keep beside them (the
    // kind and company of the last item stored, else what was held), and which text is the
    // row's item (its last store; a removal after it leaves none).
    let texts: Vec<Option<String>> = decided
        .iter()
        .map(|(d, _)| match d {
            Decision::Store { item, .. } => Some(item.raw.to_string()),
            _ => None,
        })
        .collect();
    let mut meta: HashMap<&str, (Option<String>, Option<i64>)> = HashMap::new();
    let mut row_text: HashMap<&str, Option<usize>> = HashMap::new();
    for (i, (decision, _)) in decided.iter().enumerate() {
        match decision {
            Decision::Store { subject, item, .. } => {
                meta.insert(
                    subject,
                    (Some(item.item_kind.as_str().to_owned()), item.company_id),
                );
                row_text.insert(subject, Some(i));
            }
            Decision::Tombstone { subject, .. } => {
                meta.insert(subject, (None, None));
                row_text.insert(subject, None);
            }
            _ => {}
        }
    }
    let mut touched: Vec<&str> = decided.iter().filter_map(|(d, _)| d.subject()).collect();
    touched.sort_unstable();
    touched.dedup();
    let mut final_rows = reference.into_rows();
    let rows = touched
        .iter()
        .map(|subject| {
            let row = final_rows
                .remove(*subject)
                .expect("a decided subject is held");
            let (item_kind, company_id) = match meta.remove(subject) {
                Some(m) => m,
                None => held_meta.remove(*subject).unwrap_or_default(),
            };
            let entry = copy::HeldEntry {
                held: row,
                item_kind,
                company_id,
            };
            (
                (*subject).to_owned(),
                entry,
                row_text.get(subject).copied().flatten(),
            )
        })
        .collect();
    DecidedRun {
        track,
        decided,
        texts,
        rows,
        outcomes,
        quarantined,
        tally,
    }
}

/// One event not seen before, decided against the reference copy: the decision to carry out,
/// or the label of why nothing is (a refetch dropped, or one that reads `/v1/feed` again).
fn decide_one(
    reference: &FeedCopy,
    track: &mut relay_rules::EndpointTrack,
    generation: u64,
    event: &relay_wire::Event,
    prefetched: &Prefetched,
    tally: &mut Tally,
    endpoint: Uuid,
) -> Result<Decision, &'static str> {
    let held = feed_subject(event).and_then(|s| reference.get(s));
    let decision = decide_event(held, generation, event);
    let Some(pending) = PendingRefetch::from_decision(&decision) else {
        return Ok(decision);
    };
    let (answer, attempt) = prefetched
        .get(&event.id)
        .cloned()
        // Not read beforehand (its id was applied then): take it as reads that failed.
        .unwrap_or((RefetchAnswer::Failed, REFETCH_ATTEMPTS));
    match decide_refetch(
        track.access_version.as_deref(),
        held,
        &pending,
        false,
        attempt,
        &answer,
    ) {
        RefetchOutcome::Apply(d) => Ok(*d),
        RefetchOutcome::Drop => Err("refetch_dropped"),
        RefetchOutcome::Reload | RefetchOutcome::Retry { .. } => {
            // "An answer under another access_version ... means: read /v1/feed again", as does
            // a read that kept failing.
            let label = match answer {
                RefetchAnswer::Found { .. } | RefetchAnswer::NotFound { .. } => {
                    "other_access_version"
                }
                _ => "reload",
            };
            tally.refetches.push(label);
            let (next, start) = track.read_feed_again();
            *track = next;
            note_reload_start(tally, endpoint, &start);
            Err("refetch_reload")
        }
    }
}

fn decision_label(decision: &Decision) -> &'static str {
    match decision {
        Decision::Store { .. } => "stored",
        Decision::Unchanged { .. } => "unchanged",
        Decision::Tombstone { .. } => "removed",
        other => ignore_label(other),
    }
}

fn note_reload_start(tally: &mut Tally, endpoint: Uuid, start: &ReloadStart) {
    tally.reloads_started += 1;
    match start {
        ReloadStart::Begin(r) => {
            tracing::info!(%endpoint, generation = r.generation, cause = ?r.cause, "reload begins")
        }
        ReloadStart::Supersede { stopped, begun } => tracing::info!(%endpoint,
            stopped = stopped.generation, begun = begun.generation, cause = ?begun.cause,
            "reload replaced"),
    }
}

fn ignore_label(decision: &Decision) -> &'static str {
    match decision {
        Decision::Ignore(IgnoreReason::Duplicate) => "ignored_duplicate",
        Decision::Ignore(IgnoreReason::Older) => "ignored_older",
        Decision::Ignore(IgnoreReason::OlderGeneration) => "ignored_older_generation",
        Decision::Ignore(IgnoreReason::AlreadyRemoved) => "ignored_already_removed",
        Decision::Ignore(IgnoreReason::Test) => "ignored_test",
        Decision::Ignore(IgnoreReason::Reset) => "ignored_reset",
        Decision::Ignore(IgnoreReason::UnknownType)
        | Decision::Ignore(IgnoreReason::KeptByMerge) => "ignored_unknown_type",
        Decision::Store { .. } => "stored",
        Decision::Unchanged { .. } => "unchanged",
        Decision::Tombstone { .. } => "removed",
        Decision::Refetch { .. } => "refetch_reload",
    }
}
