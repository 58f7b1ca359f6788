//! A run of one endpoint's stored messages, decided whole: the raft-rs `Ready` of the relay.
//!
//! # How to drive it
//! For each endpoint, in one transaction that holds the endpoint (its fence and writer lock):
//! 1. Before the transaction, parse the run's stored messages in arrival order and read every
//!    refetch they ask for ([`refetches_wanted`]) whose event id was not applied before, trying
//!    a failed read ([`RefetchAnswer::failed`]) up to [`REFETCH_ATTEMPTS`] times: no lock is
//!    held across HTTP, and the rule's "read it before applying the next message" holds because
//!    every answer is read before any of the run is written.
//! 2. Under the lock, read the track row, the event ids of the run already applied, and what the
//!    copy holds of the run's subjects ([`subjects`]).
//! 3. Call [`decide_run`]. It calls nothing else and reads no clock.
//! 4. Carry out the [`RunPlan`] in its order, each write still deciding in its own statement
//!    (a row only where its position wins over the row as it is; the cursor only from where it
//!    was read), and commit. Count and log only after the commit.
//!
//! The in-memory model ([`crate::model`]) executes the same plan, so the property tests compare
//! what production writes with what the rules say.

use std::collections::{BTreeMap, HashMap, HashSet};

use relay_wire::{EventBody, FeedData, ItemKind, Message};

use crate::event::{decide_event, feed_subject, Decision, IgnoreReason};
use crate::model::FeedCopy;
use crate::precedence::Held;
use crate::quarantine::{quarantine, Unapplicable};
use crate::refetch::{
    decide_refetch, PendingRefetch, RefetchAnswer, RefetchOutcome, RefetchRead, REFETCH_ATTEMPTS,
};
use crate::track::{step, EndpointTrack, MessageDecision, ReloadStart};

/// A stored message as the run takes it: parsed, or the reason it is not a v1 message.
pub type StoredMessage = Result<Message, String>;

/// What [`decide_run`] takes.
#[derive(Debug, Clone, Copy)]
pub struct Run<'a> {
    /// The track row as read under the lock.
    pub track: &'a EndpointTrack,
    /// The run's messages, in arrival order.
    pub messages: &'a [StoredMessage],
    /// Of the run's event ids, those applied before (rule "De-duplicate events by id").
    pub seen: &'a HashSet<String>,
    /// The refetch reads made for the run, by the refetch event's id. A refetch not read (its id
    /// was applied when the reads were made, say) is taken as reads that kept failing.
    pub refetches: &'a HashMap<String, RefetchRead>,
}

/// How a stored message was taken, kept for support reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    Test,
    IgnoredTrack,
    OlderGeneration,
    ReloadBegun,
    ReloadSuperseded,
    /// Set aside: it can never be applied (see [`crate::quarantine`]).
    Quarantined,
}

impl Outcome {
    pub const ALL: [Outcome; 7] = [
        Outcome::Applied,
        Outcome::Test,
        Outcome::IgnoredTrack,
        Outcome::OlderGeneration,
        Outcome::ReloadBegun,
        Outcome::ReloadSuperseded,
        Outcome::Quarantined,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::Test => "test",
            Outcome::IgnoredTrack => "ignored_track",
            Outcome::OlderGeneration => "older_generation",
            Outcome::ReloadBegun => "reload_begun",
            Outcome::ReloadSuperseded => "reload_superseded",
            Outcome::Quarantined => "quarantined",
        }
    }
}

/// One message's part of a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct MessagePlan {
    pub outcome: Outcome,
    pub events_applied: u32,
    pub events_ignored: u32,
    /// Set aside, with why.
    pub quarantined: Option<Unapplicable>,
}

impl MessagePlan {
    /// Whether the message's outcome is kept in a row of its own. The common outcome (applied,
    /// none of its events ignored) is not: the apply cursor passing the message, and the event
    /// count the front tier stored with it, already say it, so the apply writes no row per
    /// message for it.
    pub fn is_exception(&self) -> bool {
        self.outcome != Outcome::Applied || self.events_ignored > 0 || self.quarantined.is_some()
    }
}

/// What became of one event of a message that applied its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventOutcome {
    Stored,
    Unchanged,
    Removed,
    Ignored(IgnoreReason),
    /// A refetch whose answer (or failure to answer) means "read /v1/feed again".
    RefetchReload {
        answered: bool,
    },
}

impl EventOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            EventOutcome::Stored => "stored",
            EventOutcome::Unchanged => "unchanged",
            EventOutcome::Removed => "removed",
            EventOutcome::Ignored(IgnoreReason::Duplicate) => "ignored_duplicate",
            EventOutcome::Ignored(IgnoreReason::Older) => "ignored_older",
            EventOutcome::Ignored(IgnoreReason::OlderGeneration) => "ignored_older_generation",
            EventOutcome::Ignored(IgnoreReason::AlreadyRemoved) => "ignored_already_removed",
            EventOutcome::Ignored(IgnoreReason::Test) => "ignored_test",
            EventOutcome::Ignored(IgnoreReason::Reset) => "ignored_reset",
            EventOutcome::Ignored(IgnoreReason::UnknownType | IgnoreReason::KeptByMerge) => {
                "ignored_unknown_type"
            }
            EventOutcome::RefetchReload { .. } => "refetch_reload",
        }
    }

    /// Whether the event changed (or confirmed) the copy, as the message's note counts it.
    pub fn applied(self) -> bool {
        matches!(
            self,
            EventOutcome::Stored | EventOutcome::Unchanged | EventOutcome::Removed
        )
    }
}

/// One row the run leaves: each subject it wrote, once, as it is after the run.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedRow {
    pub subject: String,
    pub held: Held,
    /// The track's `reloads_begun` at the subject's last write.
    pub round: u64,
    /// The item's kind and company, when the row's item was stored by this run (else the row
    /// keeps what it held: a raised position, or a tombstone).
    pub facts: Option<(ItemKind, Option<i64>)>,
    /// The index in [`RunPlan::changes`] of the change whose item is this row's, when there is
    /// one (so the item is serialised once).
    pub change: Option<usize>,
}

/// One change for the outbox, and the event that caused it.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedChange {
    /// A `Store` (an upsert) or a `Tombstone` that removed an item (a removal).
    pub decision: Decision,
    pub event_id: String,
}

/// Everything a run writes, in the order to write it (one transaction):
/// 1. [`rows`](Self::rows): each subject's row, each write conditional on its position winning
///    over the row as it is now (under the lock it always does; a refusal means another writer
///    and the transaction must roll back);
/// 2. [`changes`](Self::changes): appended in order, numbered from the endpoint's counter;
/// 3. [`track`](Self::track): the track row, when the run changed it;
/// 4. [`keep`](Self::keep): the event ids applied, recorded with the copy;
/// 5. [`messages`](Self::messages): each message's outcome, and those set aside;
/// 6. the apply cursor moved past the run (only from where the run read it).
///
/// [`events`](Self::events) and [`reloads`](Self::reloads) are for metrics and logs after the
/// commit.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunPlan {
    pub rows: Vec<PlannedRow>,
    pub changes: Vec<PlannedChange>,
    pub track: Option<EndpointTrack>,
    pub keep: Vec<String>,
    pub messages: Vec<MessagePlan>,
    pub events: Vec<EventOutcome>,
    pub reloads: Vec<ReloadStart>,
}

impl RunPlan {
    /// The track after the run: the one written, or the one read when the run changed nothing.
    pub fn track_after<'a>(&'a self, read: &'a EndpointTrack) -> &'a EndpointTrack {
        self.track.as_ref().unwrap_or(read)
    }
}

/// Every subject the run's feed events touch, sorted, once each: the rows to read and lock.
pub fn subjects(messages: &[StoredMessage]) -> Vec<&str> {
    let mut subjects: Vec<&str> = messages
        .iter()
        .flatten()
        .flat_map(|m| m.events.iter())
        .filter_map(feed_subject)
        .collect();
    subjects.sort_unstable();
    subjects.dedup();
    subjects
}

/// Every event id of the run's messages: the ids to look up as applied before.
pub fn event_ids(messages: &[StoredMessage]) -> Vec<&str> {
    messages
        .iter()
        .flatten()
        .flat_map(|m| m.events.iter())
        .map(|e| e.id.as_str())
        .collect()
}

/// The refetches the run's messages ask for: (event id, feed_item_id), in order.
pub fn refetches_wanted(messages: &[StoredMessage]) -> Vec<(&str, &str)> {
    messages
        .iter()
        .flatten()
        .flat_map(|m| m.events.iter())
        .filter_map(|e| match &e.body {
            EventBody::Feed {
                data: FeedData::Refetch { feed_item_id, .. },
                ..
            } => Some((e.id.as_str(), feed_item_id.as_str())),
            _ => None,
        })
        .collect()
}

/// Decides a whole run (see the module doc for how to drive it), against `held`: what the copy
/// holds of [`subjects`], as read under the lock.
///
/// Each message is taken in arrival order by [`step`] (rule "Apply each endpoint's stored
/// messages one at a time ... in the order you received them"); a body that is not a v1 message
/// is set aside ([`quarantine`]); each event of a message that applies its events goes through
/// the event-id check (seen before, or earlier in the run) and [`decide_event`] against the copy
/// as the run's earlier events left it, a refetch through [`decide_refetch`] with its answer.
///
/// Rules: R-ORDER, R-DEDUP, R-KEEP-IDS, R-READ-WHILE (services/rules/RULES.md).
pub fn decide_run(run: Run<'_>, held: BTreeMap<String, Held>) -> RunPlan {
    let mut copy = FeedCopy::from_rows(held);
    let mut track = run.track.clone();
    let mut plan = RunPlan::default();
    let mut seen_in_run: HashSet<&str> = HashSet::new();
    let mut written: BTreeMap<String, LastWrite> = BTreeMap::new();
    for message in run.messages {
        let (next, decision) = match message {
            Ok(message) => step(&track, message),
            Err(error) => quarantine(&track, Unapplicable::NotV1(error.clone())),
        };
        track = next;
        let mut note = MessagePlan {
            outcome: Outcome::Applied,
            events_applied: 0,
            events_ignored: 0,
            quarantined: None,
        };
        match decision {
            MessageDecision::Test => note.outcome = Outcome::Test,
            MessageDecision::IgnoredTrack => note.outcome = Outcome::IgnoredTrack,
            MessageDecision::SkipOlderGeneration { .. } => note.outcome = Outcome::OlderGeneration,
            MessageDecision::Quarantine { why, reload } => {
                plan.reloads.push(reload);
                note.outcome = Outcome::Quarantined;
                note.quarantined = Some(why);
            }
            MessageDecision::BeginReload(reload) => {
                plan.reloads.push(ReloadStart::Begin(reload));
                note.outcome = Outcome::ReloadBegun;
            }
            MessageDecision::SupersedeReload { stopped, begun } => {
                plan.reloads.push(ReloadStart::Supersede { stopped, begun });
                note.outcome = Outcome::ReloadSuperseded;
            }
            MessageDecision::ApplyEvents { generation, reload } => {
                plan.reloads.extend(reload);
                let events = message.as_ref().map_or(&[][..], |m| m.events.as_slice());
                for event in events {
                    let first = !run.seen.contains(&event.id) && seen_in_run.insert(&event.id);
                    let outcome = if first {
                        plan.keep.push(event.id.clone());
                        decide_one(&run, &copy, &mut track, generation, event, &mut plan)
                    } else {
                        Ok(Decision::Ignore(IgnoreReason::Duplicate))
                    };
                    let outcome = match outcome {
                        Err(outcome) => outcome,
                        Ok(decision) => {
                            copy.apply(&decision);
                            let outcome = match &decision {
                                Decision::Store { .. } => EventOutcome::Stored,
                                Decision::Unchanged { .. } => EventOutcome::Unchanged,
                                Decision::Tombstone { .. } => EventOutcome::Removed,
                                Decision::Ignore(reason) => EventOutcome::Ignored(*reason),
                                // `decide_one` carries a refetch through to its answer.
                                Decision::Refetch { .. } => {
                                    EventOutcome::RefetchReload { answered: false }
                                }
                            };
                            if let Some(subject) = decision.subject() {
                                let change = decision.is_change().then(|| {
                                    plan.changes.push(PlannedChange {
                                        decision: decision.clone(),
                                        event_id: event.id.clone(),
                                    });
                                    plan.changes.len() - 1
                                });
                                let entry = written.entry(subject.to_owned()).or_default();
                                entry.round = track.reloads_begun;
                                match &decision {
                                    Decision::Store { item, .. } => {
                                        entry.facts = Some((item.item_kind, item.company_id));
                                        entry.change = change;
                                    }
                                    Decision::Tombstone { .. } => {
                                        entry.facts = None;
                                        entry.change = None;
                                    }
                                    _ => {}
                                }
                            }
                            outcome
                        }
                    };
                    if outcome.applied() {
                        note.events_applied += 1;
                    } else {
                        note.events_ignored += 1;
                    }
                    plan.events.push(outcome);
                }
            }
        }
        plan.messages.push(note);
    }
    let mut rows = copy.into_rows();
    plan.rows = written
        .into_iter()
        .map(|(subject, last)| {
            let held = rows.remove(&subject).expect("a subject written is held");
            PlannedRow {
                subject,
                held,
                round: last.round,
                facts: last.facts,
                change: last.change,
            }
        })
        .collect();
    plan.track = (track != *run.track).then_some(track);
    plan
}

/// What a run's last write of a subject left to know about its row.
#[derive(Debug, Default)]
struct LastWrite {
    /// The track's `reloads_begun` then.
    round: u64,
    /// The kind and company of the item stored, when the run stored it.
    facts: Option<(ItemKind, Option<i64>)>,
    /// The change whose item is the row's.
    change: Option<usize>,
}

/// One event not seen before, decided against the copy as the run left it: the decision to carry
/// out, or, for a refetch whose answer means "read /v1/feed again", that outcome (the track then
/// asks for it).
fn decide_one(
    run: &Run<'_>,
    copy: &FeedCopy,
    track: &mut EndpointTrack,
    generation: u64,
    event: &relay_wire::Event,
    plan: &mut RunPlan,
) -> Result<Decision, EventOutcome> {
    let held = feed_subject(event).and_then(|s| copy.get(s));
    let decision = decide_event(held, generation, event);
    let Some(pending) = PendingRefetch::from_decision(&decision) else {
        return Ok(decision);
    };
    let read = run.refetches.get(&event.id);
    let (answer, attempts) = read.map_or((&RefetchAnswer::Failed, REFETCH_ATTEMPTS), |r| {
        (&r.answer, r.attempts)
    });
    match decide_refetch(
        track.access_version.as_deref(),
        held,
        &pending,
        attempts,
        answer,
    ) {
        RefetchOutcome::Apply(decision) => Ok(*decision),
        RefetchOutcome::Reload | RefetchOutcome::Retry { .. } => {
            // "An answer under another access_version ... means: read /v1/feed again", as does
            // a read that kept failing (a driver that stopped early is taken the same way).
            let (next, start) = track.read_feed_again();
            *track = next;
            plan.reloads.push(start);
            Err(EventOutcome::RefetchReload {
                answered: !answer.failed(),
            })
        }
    }
}
