//! A reference copy in memory: the rules' decisions carried out on a map of held rows.
//!
//! It is what the Postgres layer must be equal to: feed the same random inputs through
//! [`FeedCopy`] and through the SQL writes, and compare the rows. The property tests of this crate
//! (tests/properties.rs) run the rules through it. [`Endpoint`] adds the track row and the
//! applied event ids, and runs whole messages the way the sequencer does.

use std::collections::{BTreeMap, BTreeSet};

use relay_wire::{Event, Message};

use crate::event::{decide_event, decide_event_dedup, feed_subject, Decision};
use crate::precedence::{Held, HeldContent};
use crate::reload::{check_pages, drop_after_merge, merge_item, PagesCheck, ReadItem};
use crate::track::{step, EndpointTrack, MessageDecision, Reload};

/// What the copy holds, by subject: items and tombstones alike.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FeedCopy {
    held: BTreeMap<String, Held>,
}

impl FeedCopy {
    pub fn new() -> Self {
        Self::default()
    }

    /// A copy holding these rows (what the Postgres copy holds of some subjects, say).
    pub fn from_rows(held: BTreeMap<String, Held>) -> Self {
        Self { held }
    }

    /// Every held row, given up.
    pub fn into_rows(self) -> BTreeMap<String, Held> {
        self.held
    }

    /// What is held of `subject`.
    pub fn get(&self, subject: &str) -> Option<&Held> {
        self.held.get(subject)
    }

    /// Every held row, by subject.
    pub fn rows(&self) -> &BTreeMap<String, Held> {
        &self.held
    }

    /// Carries out a decision made against this copy's row of its subject: `Store` writes the
    /// item, `Unchanged` raises the row's position only, `Tombstone` replaces the row by a
    /// tombstone; `Refetch` and `Ignore` write nothing here.
    pub fn apply(&mut self, decision: &Decision) {
        match decision {
            Decision::Store {
                subject,
                generation,
                sequence,
                item,
                ..
            } => {
                self.held.insert(
                    subject.clone(),
                    Held {
                        generation: *generation,
                        sequence: sequence.clone(),
                        content: HeldContent::Item {
                            parts: item.parts.clone(),
                            item: item.raw.clone(),
                        },
                    },
                );
            }
            Decision::Unchanged {
                subject,
                generation,
                sequence,
            } => {
                if let Some(row) = self.held.get_mut(subject) {
                    row.generation = *generation;
                    row.sequence = sequence.clone();
                }
            }
            Decision::Tombstone {
                subject,
                generation,
                sequence,
                ..
            } => {
                self.held.insert(
                    subject.clone(),
                    Held {
                        generation: *generation,
                        sequence: sequence.clone(),
                        content: HeldContent::Tombstone,
                    },
                );
            }
            Decision::Refetch { .. } | Decision::Ignore(_) => {}
        }
    }

    /// Decides one event of a message of `generation` against this copy and carries it out.
    pub fn apply_event(&mut self, generation: u64, event: &Event) -> Decision {
        let held = crate::event::feed_subject(event).and_then(|s| self.held.get(s));
        let decision = decide_event(held, generation, event);
        self.apply(&decision);
        decision
    }

    /// Merges a reload's read under `generation` (rule "Then merge the read into the copy under
    /// the reset's generation"): each read item through [`merge_item`], then every row of an
    /// older generation removed. Returns the decisions made for the read items and the subjects
    /// of the items (not tombstones) the drop removed, which the outbox reports as removals.
    pub fn merge(&mut self, generation: u64, read: &[ReadItem]) -> (Vec<Decision>, Vec<String>) {
        let decisions = read
            .iter()
            .map(|r| {
                let d = merge_item(self.held.get(&r.subject), generation, r);
                self.apply(&d);
                d
            })
            .collect();
        let mut removed_items = Vec::new();
        self.held.retain(|subject, held| {
            let drop = drop_after_merge(held, generation);
            if drop && !held.is_tombstone() {
                removed_items.push(subject.clone());
            }
            !drop
        });
        (decisions, removed_items)
    }
}

/// One endpoint's track as the sequencer keeps it: the track row, the copy, and the event ids
/// applied, changed together as one transaction changes them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Endpoint {
    pub track: EndpointTrack,
    pub copy: FeedCopy,
    pub applied: BTreeSet<String>,
}

/// What [`Endpoint::receive`] decided: for the message, and for each of its events (empty when
/// the message's events are not applied).
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    pub message: MessageDecision,
    pub events: Vec<Decision>,
}

impl Endpoint {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes one stored message, in the order received: [`step`] for the message, then, for a
    /// message of events, each event through [`decide_event_dedup`] at the message's generation,
    /// its id kept with the copy (rules "De-duplicate events by id" and "Keep the event ids you
    /// applied with the copy, in the same transactions"). `Refetch` decisions are returned for
    /// the caller to read; nothing else is left to do.
    pub fn receive(&mut self, message: &Message) -> Received {
        let (track, decision) = step(&self.track, message);
        self.track = track;
        let mut events = Vec::new();
        if let MessageDecision::ApplyEvents { generation, .. } = &decision {
            for event in &message.events {
                let held = feed_subject(event).and_then(|s| self.copy.get(s));
                let applied = &self.applied;
                let d = decide_event_dedup(|id| applied.contains(id), held, *generation, event);
                self.copy.apply(&d);
                if feed_subject(event).is_some() {
                    self.applied.insert(event.id.clone());
                }
                events.push(d);
            }
        }
        Received {
            message: decision,
            events,
        }
    }

    /// Merges a reload's read when `reload` is still the running one and its pages pass
    /// [`check_pages`]; then the track no longer holds it. `None`, and nothing changed, otherwise
    /// (a superseded reload, or a pass to read again).
    pub fn merge(
        &mut self,
        reload: &Reload,
        pages: &[&str],
        read: &[ReadItem],
    ) -> Option<(Vec<Decision>, Vec<String>)> {
        if self.track.reload.as_ref() != Some(reload) {
            return None;
        }
        if check_pages(reload.access_version.as_deref(), pages.iter().copied()) != PagesCheck::Agree
        {
            return None;
        }
        let merged = self.copy.merge(reload.generation, read);
        self.track = self.track.reload_merged(reload, pages[0]);
        Some(merged)
    }
}
