//! Helpers over the rules' plans, shared by the test files: an event decided and carried out on a
//! [`FeedCopy`], a run of messages through an [`Endpoint`], a pass of `/v1/feed`.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};

use crate::common::{content, feed_message, subject};
use relay_rules::{
    decide_event, feed_subject, Decision, Endpoint, FeedCopy, Held, HeldContent, MergePlan,
    ModelChange, Pass, ReadItem, RefetchRead, RunPlan, StoredMessage,
};
use relay_wire::{Event, Message};
use serde_json::Value;

/// What `FeedCopy::apply_event` did before the run API: [`decide_event`] against what the copy
/// holds of the event's subject, at the message's `generation`, carried out on the copy.
pub fn apply_event(copy: &mut FeedCopy, generation: u64, event: &Event) -> Decision {
    let held = feed_subject(event).and_then(|s| copy.get(s));
    let decision = decide_event(held, generation, event);
    copy.apply(&decision);
    decision
}

/// Messages as a run takes them (each parsed).
pub fn stored(messages: &[Message]) -> Vec<StoredMessage> {
    messages.iter().cloned().map(Ok).collect()
}

/// One run of `messages` with no refetch read.
pub fn run(endpoint: &mut Endpoint, messages: &[Message]) -> RunPlan {
    endpoint.run(&stored(messages), &HashMap::new())
}

/// One run of one [`feed_message`].
pub fn run_feed(
    endpoint: &mut Endpoint,
    generation: u64,
    access_version: &str,
    through: &str,
    events: &[(u32, u64, u64, bool)],
) -> RunPlan {
    run(
        endpoint,
        &[feed_message(generation, access_version, through, events)],
    )
}

/// One run of one message, with these refetch reads.
pub fn run_with(
    endpoint: &mut Endpoint,
    message: &Message,
    refetches: &[(&str, RefetchRead)],
) -> RunPlan {
    let refetches: HashMap<String, RefetchRead> = refetches
        .iter()
        .map(|(id, read)| (id.to_string(), read.clone()))
        .collect();
    endpoint.run(&[Ok(message.clone())], &refetches)
}

/// One pass of `/v1/feed`: every page under `access_version`, begun when the reload's
/// `read_again` was `read_again_at_start`.
pub fn pass(
    access_version: &str,
    items: Vec<ReadItem>,
    upstream_generation: Option<u64>,
    read_again_at_start: u32,
) -> Pass {
    Pass {
        page_access_versions: vec![access_version.to_owned()],
        items,
        upstream_generation,
        read_again_at_start,
    }
}

/// The merge a plan carries out; panics on any other plan.
pub fn merged(plan: MergePlan) -> relay_rules::Merge {
    match plan {
        MergePlan::Merge(merge) => *merge,
        other => panic!("expected a merge, got {other:?}"),
    }
}

/// Each row as (subject, generation, sequence's seq number, tombstone), for compact asserts.
pub fn positions(copy: &FeedCopy) -> Vec<(String, u64, u64, bool)> {
    copy.rows()
        .iter()
        .map(|(s, h)| {
            let n = h.sequence.parts().expect("a sequence the tests made").1;
            (s.clone(), h.generation, n, h.is_tombstone())
        })
        .collect()
}

/// [`positions`] as the tests write them: (subject number, generation, seq number, tombstone).
pub fn positions_of(rows: &[(u32, u64, u64, bool)]) -> Vec<(String, u64, u64, bool)> {
    rows.iter()
        .map(|&(n, generation, seq, tombstone)| (subject(n), generation, seq, tombstone))
        .collect()
}

/// The copy's items (tombstones left out), by subject.
pub fn items(copy: &FeedCopy) -> BTreeMap<String, Value> {
    copy.rows()
        .iter()
        .filter_map(|(s, h)| match &h.content {
            HeldContent::Item { item, .. } => Some((s.clone(), item.clone())),
            HeldContent::Tombstone => None,
        })
        .collect()
}

/// The outbox replayed in order onto an empty map: what a consumer of the changes holds.
pub fn replay(changes: &[ModelChange]) -> BTreeMap<String, Value> {
    let mut held = BTreeMap::new();
    for change in changes {
        match change {
            ModelChange::Upsert { subject, item } => {
                held.insert(subject.clone(), item.clone());
            }
            ModelChange::Remove { subject } => {
                held.remove(subject);
            }
        }
    }
    held
}

/// The outbox row that stores [`content`]`(subject_n, sequence)` under `subject_n`.
pub fn upsert(subject_n: u32, sequence: u64) -> ModelChange {
    ModelChange::Upsert {
        subject: subject(subject_n),
        item: content(subject_n, sequence).raw,
    }
}

/// The outbox row that removes `subject_n`.
pub fn remove(subject_n: u32) -> ModelChange {
    ModelChange::Remove {
        subject: subject(subject_n),
    }
}

/// The endpoint's outbox, replayed, holds what its copy holds.
pub fn assert_replays(endpoint: &Endpoint) {
    assert_eq!(replay(&endpoint.changes), items(&endpoint.copy));
}

/// Whether `held` is an item (not a tombstone).
pub fn is_item(held: Option<&Held>) -> bool {
    held.is_some_and(|h| !h.is_tombstone())
}
