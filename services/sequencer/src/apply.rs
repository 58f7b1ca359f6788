//! Applying one stored message: the driver around relay-rules' [`step`] and [`decide_event`].
//!
//! One transaction per message: check the fence, lock the endpoint, lock the track row, decide
//! the message's transition and each event's decision, carry each decision out in one
//! conditional statement (relay_store::copy), write the track row, note the outcome and move the
//! apply cursor (conditionally), commit. A refetch's item read happens before that transaction
//! (so no lock is held across HTTP), and its answer is decided inside it against the row as it
//! is then: "read it before applying the next message".

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_rules::{
    decide_event, decide_refetch, feed_subject, step, Decision, IgnoreReason, MessageDecision,
    PendingRefetch, RefetchAnswer, RefetchOutcome, ReloadStart, REFETCH_ATTEMPTS,
};
use relay_store::copy::{self, Applied, Cause};
use relay_store::StoreError;
use relay_wire::{EventBody, FeedData, Message};
use sqlx::PgPool;
use time::OffsetDateTime;
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::metrics::SequencerMetrics;
use crate::ownership::check_fence;
use crate::state::{self, EndpointRegistration, MessageOutcome, PendingMessage, StateError};
use crate::upstream::{FeedSelection, UpstreamClient, UpstreamError};

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
}

/// One owned endpoint: its registration, its upstream client, and the selection (language,
/// filter) last read from the upstream.
pub struct EndpointContext {
    pub registration: EndpointRegistration,
    pub upstream: Result<UpstreamClient, UpstreamError>,
    selection: Mutex<Option<FeedSelection>>,
}

impl EndpointContext {
    pub fn new(registration: EndpointRegistration, http: reqwest::Client) -> Self {
        let upstream = UpstreamClient::new(
            http,
            registration.upstream_base_url.as_deref(),
            registration.upstream_api_key.as_deref(),
        );
        Self {
            registration,
            upstream,
            selection: Mutex::new(None),
        }
    }

    pub fn id(&self) -> Uuid {
        self.registration.id
    }

    pub fn tenant(&self) -> Uuid {
        self.registration.tenant_id
    }

    /// The endpoint's language and filter: read once, and again by every reload.
    pub async fn selection(&self) -> Result<FeedSelection, UpstreamError> {
        let mut held = self.selection.lock().await;
        if let Some(selection) = held.as_ref() {
            return Ok(selection.clone());
        }
        let upstream = self
            .upstream
            .as_ref()
            .map_err(|_| UpstreamError::NotConfigured)?;
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

/// Pause between refetch reads that failed: short, since the next message waits on them.
const REFETCH_RETRY_PAUSE: Duration = Duration::from_millis(50);

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
        let (Ok(upstream), Ok(selection)) = (ctx.upstream.as_ref(), ctx.selection().await) else {
            metrics.refetches.with_label_values(&["failed"]).inc();
            answers.insert(
                event_id.to_owned(),
                (RefetchAnswer::Failed, REFETCH_ATTEMPTS),
            );
            continue;
        };
        let mut attempt = 1;
        let answer = loop {
            let answer = upstream.read_item(&selection, feed_item_id).await;
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
                tokio::time::sleep(REFETCH_RETRY_PAUSE * attempt).await;
                continue;
            }
            break answer;
        };
        answers.insert(event_id.to_owned(), (answer, attempt));
    }
    Ok(answers)
}

/// Applies the stored message that follows `applied` (its arrival_seq is `message.arrival_seq`)
/// under fencing token `token`, in one transaction.
pub async fn apply_message(
    pool: &PgPool,
    ctx: &Arc<EndpointContext>,
    token: i64,
    applied: i64,
    pending: &PendingMessage,
    metrics: &SequencerMetrics,
) -> Result<MessageReport, ApplyError> {
    let started = Instant::now();
    let parsed = Message::parse(&pending.body);
    let prefetched = match &parsed {
        Ok(message) => prefetch(pool, ctx, message, metrics).await?,
        Err(_) => Prefetched::new(),
    };

    let (tenant, endpoint) = (ctx.tenant(), ctx.id());
    let mut tx = pool.begin().await?;
    if !check_fence(&mut tx, endpoint, token).await? {
        return Err(ApplyError::Fenced);
    }
    copy::lock_endpoint(&mut tx, tenant, endpoint).await?;
    let held_track = state::load_track(&mut tx, endpoint, state::FEED_TRACK).await?;

    let mut events_applied = 0;
    let mut events_ignored = 0;
    let (outcome, track) = match &parsed {
        Err(error) => {
            // The front tier parsed it before storing it, so this is a stored body the current
            // code reads differently: log it, count it, and move on (it can never apply).
            tracing::error!(%endpoint, arrival_seq = pending.arrival_seq, %error,
                "stored message does not parse");
            (MessageOutcome::Malformed, held_track.clone())
        }
        Ok(message) => {
            let (mut track, decision) = step(&held_track, message);
            let outcome = match decision {
                MessageDecision::Test => MessageOutcome::Test,
                MessageDecision::IgnoredTrack => MessageOutcome::IgnoredTrack,
                MessageDecision::Malformed(why) => {
                    tracing::warn!(%endpoint, arrival_seq = pending.arrival_seq, %why,
                        "message not applied");
                    MessageOutcome::Malformed
                }
                MessageDecision::SkipOlderGeneration { generation, held } => {
                    tracing::debug!(%endpoint, generation, held, "message of an older generation");
                    MessageOutcome::OlderGeneration
                }
                MessageDecision::BeginReload(reload) => {
                    tracing::info!(%endpoint, generation = reload.generation, "reset: reload begins");
                    metrics.reloads.with_label_values(&["started"]).inc();
                    MessageOutcome::ReloadBegun
                }
                MessageDecision::SupersedeReload { stopped, begun } => {
                    tracing::info!(%endpoint, stopped = stopped.generation,
                        begun = begun.generation, "newer reset: reload replaced");
                    metrics.reloads.with_label_values(&["started"]).inc();
                    MessageOutcome::ReloadSuperseded
                }
                MessageDecision::ApplyEvents { generation, reload } => {
                    if let Some(start) = &reload {
                        note_reload_start(metrics, endpoint, start);
                    }
                    for event in &message.events {
                        let label = apply_event(
                            &mut tx,
                            ctx,
                            &mut track,
                            generation,
                            event,
                            &prefetched,
                            metrics,
                        )
                        .await?;
                        metrics.events.with_label_values(&[label]).inc();
                        if label.starts_with("ignored") || label.starts_with("refetch_") {
                            events_ignored += 1;
                        } else {
                            events_applied += 1;
                        }
                    }
                    MessageOutcome::Applied
                }
            };
            (outcome, track)
        }
    };

    if track != held_track {
        state::save_track(&mut tx, tenant, endpoint, state::FEED_TRACK, &track).await?;
    }
    state::record_application(
        &mut tx,
        tenant,
        endpoint,
        pending.arrival_seq,
        outcome,
        events_applied,
        events_ignored,
    )
    .await?;
    if !state::advance_cursor(
        &mut tx,
        tenant,
        endpoint,
        applied,
        pending.arrival_seq,
        Some(pending.received_at),
    )
    .await?
    {
        return Err(ApplyError::CursorMoved);
    }
    tx.commit().await?;

    metrics
        .messages
        .with_label_values(&[outcome.as_str()])
        .inc();
    metrics
        .message_apply_duration
        .observe(started.elapsed().as_secs_f64());
    let lag = (OffsetDateTime::now_utc() - pending.received_at).as_seconds_f64();
    metrics.apply_lag.observe(lag.max(0.0));
    Ok(MessageReport {
        outcome,
        reload_pending: track.reload.is_some(),
    })
}

fn note_reload_start(metrics: &SequencerMetrics, endpoint: Uuid, start: &ReloadStart) {
    metrics.reloads.with_label_values(&["started"]).inc();
    match start {
        ReloadStart::Begin(r) => {
            tracing::info!(%endpoint, generation = r.generation, cause = ?r.cause, "reload begins")
        }
        ReloadStart::Supersede { stopped, begun } => tracing::info!(%endpoint,
            stopped = stopped.generation, begun = begun.generation, cause = ?begun.cause,
            "reload replaced"),
    }
}

/// One event of a message of events, at the message's `generation`. Returns the metric label
/// of what it did.
async fn apply_event(
    tx: &mut sqlx::PgConnection,
    ctx: &EndpointContext,
    track: &mut relay_rules::EndpointTrack,
    generation: u64,
    event: &relay_wire::Event,
    prefetched: &Prefetched,
    metrics: &SequencerMetrics,
) -> Result<&'static str, ApplyError> {
    let (tenant, endpoint) = (ctx.tenant(), ctx.id());
    // Rule "De-duplicate events by id, for each endpoint": the insert decides.
    if !copy::record_event_id(tx, tenant, endpoint, &event.id).await? {
        return Ok("ignored_duplicate");
    }
    let Some(subject) = feed_subject(event) else {
        return Ok(ignore_label(&decide_event(None, generation, event)));
    };
    let held = copy::load_held(tx, endpoint, subject).await?;
    let mut decision = decide_event(held.as_ref(), generation, event);
    if let Some(pending) = PendingRefetch::from_decision(&decision) {
        let (answer, attempt) = prefetched
            .get(&event.id)
            .cloned()
            // Not read beforehand (its id was applied then, yet not now: cannot happen under
            // the lock, but never guess): take it as reads that failed.
            .unwrap_or((RefetchAnswer::Failed, REFETCH_ATTEMPTS));
        match decide_refetch(
            track.access_version.as_deref(),
            held.as_ref(),
            &pending,
            false,
            attempt,
            &answer,
        ) {
            RefetchOutcome::Apply(d) => decision = *d,
            RefetchOutcome::Drop => return Ok("refetch_dropped"),
            RefetchOutcome::Reload | RefetchOutcome::Retry { .. } => {
                // "An answer under another access_version ... means: read /v1/feed again", as
                // does a read that kept failing.
                let label = match answer {
                    RefetchAnswer::Found { .. } | RefetchAnswer::NotFound { .. } => {
                        "other_access_version"
                    }
                    _ => "reload",
                };
                metrics.refetches.with_label_values(&[label]).inc();
                let (next, start) = track.read_feed_again();
                *track = next;
                if let Some(start) = start {
                    note_reload_start(metrics, endpoint, &start);
                }
                return Ok("refetch_reload");
            }
        }
    }
    let applied = copy::apply(tx, tenant, endpoint, &decision, Cause::Event(&event.id)).await?;
    Ok(match (&decision, applied) {
        (_, Applied::Refused) => "refused",
        (Decision::Store { .. }, _) => "stored",
        (Decision::Unchanged { .. }, _) => "unchanged",
        (Decision::Tombstone { .. }, _) => "removed",
        (d, _) => ignore_label(d),
    })
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
