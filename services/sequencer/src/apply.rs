//! Applying a run of stored messages: the driver around relay-rules' [`step`] and
//! [`decide_event`].
//!
//! One transaction per run, three statements inside it: the first checks the fence, takes the
//! endpoint's writer lock and reads the track row locked; the second records the run's event
//! ids and reads (and locks) the rows of the subjects they touch; the third writes the rows the
//! decisions left (each still checking its position), appends their changes, writes the track
//! row and the outcomes and moves the apply cursor (only from where it was read). A refetch's
//! item read happens before that transaction (so no lock is held across HTTP), and its answer
//! is decided inside it against the row as it is then: "read it before applying the next
//! message".

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_rules::{
    decide_event, decide_refetch, feed_subject, step, Decision, FeedCopy, IgnoreReason,
    MessageDecision, PendingRefetch, RefetchAnswer, RefetchOutcome, ReloadStart, REFETCH_ATTEMPTS,
};
use relay_store::copy;
use relay_store::StoreError;
use relay_wire::{EventBody, FeedData, Message};
use sqlx::PgPool;
use time::OffsetDateTime;
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::metrics::SequencerMetrics;
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
/// token `token`, in one transaction.
///
/// Each message is still taken one at a time, in order, by the rules: the track row goes
/// through [`step`] message by message, and each event is decided against what the copy holds
/// after every earlier event (relay-rules' reference copy, [`FeedCopy`], seeded with the rows
/// read and locked here). What one transaction changes is only how many round trips that takes
/// (see the module's note): the fence, writer lock and track in one statement
/// ([`state::open_track`]), the event ids and the held rows in one
/// ([`copy::record_event_ids_and_load_held`]), and every write in one ([`state::write_run`]).
pub async fn apply_messages(
    pool: &PgPool,
    ctx: &Arc<EndpointContext>,
    token: i64,
    applied: i64,
    pending: &[PendingMessage],
    metrics: &SequencerMetrics,
) -> Result<BatchReport, ApplyError> {
    let through = pending.last().map_or(applied, |m| m.arrival_seq);
    apply_messages_through(pool, ctx, token, applied, through, pending, metrics).await
}

/// [`apply_messages`], moving the cursor to `through` (at or past the last message): the arrival
/// counter the messages were read under, when they were all the messages below it, so numbers
/// that duplicates took and left unused are skipped in the same transaction.
pub async fn apply_messages_through(
    pool: &PgPool,
    ctx: &Arc<EndpointContext>,
    token: i64,
    applied: i64,
    through: i64,
    pending: &[PendingMessage],
    metrics: &SequencerMetrics,
) -> Result<BatchReport, ApplyError> {
    let Some(last) = pending.last() else {
        return Ok(BatchReport {
            messages: 0,
            changes: 0,
            reload_pending: false,
        });
    };
    let started = Instant::now();
    let parsed: Vec<Result<Message, relay_wire::MessageError>> =
        pending.iter().map(|m| Message::parse(&m.body)).collect();
    let mut prefetched = Prefetched::new();
    for message in parsed.iter().flatten() {
        prefetched.extend(prefetch(pool, ctx, message, metrics).await?);
    }

    let (tenant, endpoint) = (ctx.tenant(), ctx.id());
    let mut tx = pool.begin().await?;
    let Some(held_track) =
        state::open_track(&mut tx, tenant, endpoint, token, state::FEED_TRACK).await?
    else {
        return Err(ApplyError::Fenced);
    };

    // Which messages apply their events: the track's transitions alone decide that (a refetch's
    // "read /v1/feed again" begins a reload, which never changes whether a later message
    // applies), so the run's event ids and subjects are known before anything is written.
    let mut probe = held_track.clone();
    let mut applying: Vec<&relay_wire::Event> = Vec::new();
    for message in parsed.iter().flatten() {
        let (next, decision) = step(&probe, message);
        if matches!(decision, MessageDecision::ApplyEvents { .. }) {
            applying.extend(message.events.iter());
        }
        probe = next;
    }
    let ids: Vec<&str> = applying.iter().map(|e| e.id.as_str()).collect();
    let mut subjects: Vec<&str> = applying.iter().filter_map(|e| feed_subject(e)).collect();
    subjects.sort_unstable();
    subjects.dedup();
    let (first_seen, held_entries) =
        copy::record_event_ids_and_load_held(&mut tx, tenant, endpoint, &ids, &subjects).await?;
    // The rows go into the reference copy whole (no copy of their items); what reads keep
    // beside them (kind, company) waits here for the write.
    let mut held_meta: HashMap<String, (Option<String>, Option<i64>)> = HashMap::new();
    let mut held_rows = std::collections::BTreeMap::new();
    for (subject, entry) in held_entries {
        held_meta.insert(subject.clone(), (entry.item_kind, entry.company_id));
        held_rows.insert(subject, entry.held);
    }
    let mut reference = FeedCopy::from_rows(held_rows);

    let mut track = held_track.clone();
    let mut seen_in_run: HashSet<&str> = HashSet::new();
    let mut decided: Vec<(Decision, &str)> = Vec::new();
    let mut outcomes: Vec<(i64, MessageOutcome, i32, i32)> = Vec::with_capacity(pending.len());
    for (message, stored) in parsed.iter().zip(pending) {
        let Ok(message) = message else {
            // The front tier parsed it before storing it, so this is a stored body the current
            // code reads differently: log it, count it, and move on (it can never apply).
            tracing::error!(%endpoint, arrival_seq = stored.arrival_seq,
                "stored message does not parse");
            outcomes.push((stored.arrival_seq, MessageOutcome::Malformed, 0, 0));
            continue;
        };
        let (next, decision) = step(&track, message);
        track = next;
        let mut events_applied = 0;
        let mut events_ignored = 0;
        let outcome = match decision {
            MessageDecision::Test => MessageOutcome::Test,
            MessageDecision::IgnoredTrack => MessageOutcome::IgnoredTrack,
            MessageDecision::Malformed(why) => {
                tracing::warn!(%endpoint, arrival_seq = stored.arrival_seq, %why,
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
                            &prefetched,
                            metrics,
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
                                    decided.push((decision, event.id.as_str()));
                                }
                                label
                            }
                        }
                    };
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
        outcomes.push((stored.arrival_seq, outcome, events_applied, events_ignored));
    }

    // The rows the decisions left, each subject once, with what reads keep beside them (the
    // kind and company of the last item stored, else what was held).
    let mut touched: Vec<&str> = decided.iter().filter_map(|(d, _)| d.subject()).collect();
    touched.sort_unstable();
    touched.dedup();
    let mut meta: HashMap<&str, (Option<String>, Option<i64>)> = HashMap::new();
    for (decision, _) in &decided {
        match decision {
            Decision::Store { subject, item, .. } => {
                meta.insert(
                    subject,
                    (Some(item.item_kind.as_str().to_owned()), item.company_id),
                );
            }
            Decision::Tombstone { subject, .. } => {
                meta.insert(subject, (None, None));
            }
            _ => {}
        }
    }
    let mut final_rows = reference.into_rows();
    let mut held: std::collections::BTreeMap<String, copy::HeldEntry> =
        std::collections::BTreeMap::new();
    for subject in &touched {
        let row = final_rows
            .remove(*subject)
            .expect("a decided subject is held");
        let (item_kind, company_id) = match meta.remove(subject) {
            Some(m) => m,
            None => held_meta.remove(*subject).unwrap_or_default(),
        };
        held.insert(
            (*subject).to_owned(),
            copy::HeldEntry {
                held: row,
                item_kind,
                company_id,
            },
        );
    }
    // Each stored item serialised once: for its change, and for its row when it is the row's
    // last store (an `Unchanged` after it keeps the same item).
    let texts: Vec<Option<String>> = decided
        .iter()
        .map(|(d, _)| match d {
            Decision::Store { item, .. } => Some(item.raw.to_string()),
            _ => None,
        })
        .collect();
    let mut row_text: HashMap<&str, Option<&str>> = HashMap::new();
    for ((decision, _), text) in decided.iter().zip(&texts) {
        match decision {
            Decision::Store { subject, .. } => {
                row_text.insert(subject, text.as_deref());
            }
            Decision::Tombstone { subject, .. } => {
                row_text.insert(subject, None);
            }
            _ => {}
        }
    }
    let rows: Vec<(&str, &copy::HeldEntry, Option<&str>)> = touched
        .iter()
        .map(|s| {
            let entry = held.get(*s).expect("entered above");
            (*s, entry, row_text.get(s).copied().flatten())
        })
        .collect();
    let changes: Vec<copy::DecidedChange<'_>> = decided
        .iter()
        .zip(&texts)
        .filter(|((d, _), _)| d.is_change())
        .map(|((decision, event_id), text)| copy::DecidedChange {
            decision,
            event_id,
            item_text: text.as_deref(),
        })
        .collect();
    let decided_write = copy::DecidedWrite::new(&rows, &changes)?;
    let end = state::RunEnd {
        track: (track != held_track).then_some(&track),
        outcomes: &outcomes,
        from: applied,
        to: through.max(last.arrival_seq),
        last_received_at: Some(last.received_at),
    };
    let written = state::write_run(&mut tx, tenant, endpoint, decided_write, end).await?;
    if written.rows != rows.len() as i64 {
        // Every row was decided under its lock, so the statement can only agree; if it does
        // not, something else writes this copy: stop rather than write a wrong change.
        tracing::error!(%endpoint, written = written.rows, decided = rows.len(),
            "rows decided under lock were refused");
        return Err(ApplyError::CursorMoved);
    }
    if !written.cursor_moved {
        return Err(ApplyError::CursorMoved);
    }
    tx.commit().await?;

    for (_, outcome, _, _) in &outcomes {
        metrics
            .messages
            .with_label_values(&[outcome.as_str()])
            .inc();
    }
    let per_message = started.elapsed().as_secs_f64() / pending.len() as f64;
    let now = OffsetDateTime::now_utc();
    for message in pending {
        metrics.message_apply_duration.observe(per_message);
        metrics
            .apply_lag
            .observe((now - message.received_at).as_seconds_f64().max(0.0));
    }
    Ok(BatchReport {
        messages: pending.len(),
        changes: usize::try_from(written.changes).unwrap_or(0),
        reload_pending: track.reload.is_some(),
    })
}

/// One event not seen before, decided against the reference copy: the decision to carry out,
/// or the label of why nothing is (a refetch dropped, or one that reads `/v1/feed` again).
fn decide_one(
    reference: &FeedCopy,
    track: &mut relay_rules::EndpointTrack,
    generation: u64,
    event: &relay_wire::Event,
    prefetched: &Prefetched,
    metrics: &SequencerMetrics,
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
            metrics.refetches.with_label_values(&[label]).inc();
            let (next, start) = track.read_feed_again();
            *track = next;
            note_reload_start(metrics, endpoint, &start);
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
