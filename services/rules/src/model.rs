//! A reference copy in memory: the rules' plans carried out on maps.
//!
//! [`FeedCopy`] holds rows by subject; [`decide_run`] decides against one. [`Endpoint`] is a thin
//! executor of the same plans production writes to Postgres ([`RunPlan`], [`MergePlan`]): the
//! property tests run random runs through it and through the SQL statements, and compare.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use serde_json::Value;

use crate::event::Decision;
use crate::precedence::{Held, HeldContent};
use crate::refetch::RefetchRead;
use crate::reload::{decide_merge, HeldRow, MergePlan, Pass};
use crate::run::{decide_run, event_ids, subjects, Outcome, Run, RunPlan, StoredMessage};
use crate::track::{EndpointTrack, Reload};

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
}

/// One change in an [`Endpoint`]'s outbox.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelChange {
    Upsert { subject: String, item: Value },
    Remove { subject: String },
}

/// One endpoint as the sequencer keeps it: the track row, the copy with each row's reload round,
/// the event ids applied, the outbox and each message's outcome, changed only by executing
/// plans.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Endpoint {
    pub track: EndpointTrack,
    pub copy: FeedCopy,
    pub rounds: BTreeMap<String, u64>,
    pub applied: BTreeSet<String>,
    pub changes: Vec<ModelChange>,
    pub outcomes: Vec<Outcome>,
}

impl Endpoint {
    pub fn new() -> Self {
        Self::default()
    }

    /// Decides a run of stored messages the way the sequencer drives [`decide_run`] (the rows
    /// of its subjects, its ids seen before) and executes the plan.
    pub fn run(
        &mut self,
        messages: &[StoredMessage],
        refetches: &HashMap<String, RefetchRead>,
    ) -> RunPlan {
        let held = subjects(messages)
            .into_iter()
            .filter_map(|s| Some((s.to_owned(), self.copy.get(s)?.clone())))
            .collect();
        let seen: HashSet<String> = event_ids(messages)
            .into_iter()
            .filter(|id| self.applied.contains(*id))
            .map(str::to_owned)
            .collect();
        let run = Run {
            track: &self.track,
            messages,
            seen: &seen,
            refetches,
        };
        let plan = decide_run(run, held);
        self.execute_run(&plan);
        plan
    }

    fn execute_run(&mut self, plan: &RunPlan) {
        for row in &plan.rows {
            self.copy.held.insert(row.subject.clone(), row.held.clone());
            self.rounds.insert(row.subject.clone(), row.round);
        }
        for change in &plan.changes {
            self.changes.push(match &change.decision {
                Decision::Store { subject, item, .. } => ModelChange::Upsert {
                    subject: subject.clone(),
                    item: item.raw.clone(),
                },
                other => ModelChange::Remove {
                    subject: other.subject().unwrap_or_default().to_owned(),
                },
            });
        }
        if let Some(track) = &plan.track {
            self.track = track.clone();
        }
        self.applied.extend(plan.keep.iter().cloned());
        self.outcomes
            .extend(plan.messages.iter().map(|m| m.outcome));
    }

    /// Decides a pass of `reload` against the whole copy, as the sequencer's merge does, and
    /// executes the plan.
    pub fn merge(&mut self, reload: &Reload, pass: &Pass) -> MergePlan {
        let held: BTreeMap<String, HeldRow> = self
            .copy
            .rows()
            .iter()
            .map(|(subject, held)| {
                let round = self.rounds.get(subject).copied().unwrap_or(0);
                let row = HeldRow {
                    held: held.clone(),
                    round,
                };
                (subject.clone(), row)
            })
            .collect();
        let plan = decide_merge(&self.track, reload, pass, &held);
        if let MergePlan::Merge(merge) = &plan {
            let merge = merge.as_ref();
            for decision in &merge.writes {
                self.copy.apply(decision);
                if let Some(subject) = decision.subject() {
                    self.rounds.insert(subject.to_owned(), merge.round);
                }
                if let Decision::Store { subject, item, .. } = decision {
                    self.changes.push(ModelChange::Upsert {
                        subject: subject.clone(),
                        item: item.raw.clone(),
                    });
                }
            }
            for (subject, item) in &merge.dropped {
                self.copy.held.remove(subject);
                self.rounds.remove(subject);
                if *item {
                    self.changes.push(ModelChange::Remove {
                        subject: subject.clone(),
                    });
                }
            }
            for (subject, sequence) in &merge.withdrawn {
                let row = Held {
                    generation: merge.generation,
                    sequence: sequence.clone(),
                    content: HeldContent::Tombstone,
                };
                self.copy.held.insert(subject.clone(), row);
                self.rounds.insert(subject.clone(), merge.round);
                self.changes.push(ModelChange::Remove {
                    subject: subject.clone(),
                });
            }
            self.track = merge.track.clone();
        }
        plan
    }
}
