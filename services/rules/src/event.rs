//! One event in, one [`Decision`] out.
//!
//! The sequencer looks up what the copy holds of the event's subject ([`feed_subject`]), calls
//! [`decide_event`] (or [`decide_event_dedup`]) with the message's generation, and carries the
//! decision out as one conditional write on that subject's row (see
//! [`precedence()`] for the `where`).

use relay_wire::{Event, EventBody, FeedData, FeedItem, Sequence};

use crate::parts::{diff_parts, PartsDiff};
use crate::precedence::{precedence, Held, HeldContent, Precedence};

/// What to do with one event (or one refetched or reloaded item) for one subject.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Store `item` as the subject's item at (`generation`, `sequence`), the event's sequence and
    /// not the item's own `seq`. `diff` is what changed against the held item, for the outbox.
    Store {
        subject: String,
        generation: u64,
        sequence: Sequence,
        item: FeedItem,
        diff: PartsDiff,
    },
    /// The item is exactly what is held (same parts, same JSON), at a winning position: raise
    /// the row's generation and sequence to these, change nothing else, and send no outbox row.
    /// The position must still be written, or an older update arriving later would win over the
    /// held one.
    Unchanged {
        subject: String,
        generation: u64,
        sequence: Sequence,
    },
    /// Remove the item and keep a tombstone at (`generation`, `sequence`). `removed_item` is true
    /// when an item was held (the outbox gets a removal), false when only a tombstone was, or
    /// nothing.
    Tombstone {
        subject: String,
        generation: u64,
        sequence: Sequence,
        removed_item: bool,
    },
    /// Read `/v1/feed/items/{feed_item_id}` before applying the next message, and apply the
    /// answer at this generation and sequence (see [`crate::refetch`]).
    Refetch {
        subject: String,
        feed_item_id: String,
        generation: u64,
        sequence: Sequence,
    },
    /// Write nothing.
    Ignore(IgnoreReason),
}

/// Why an event writes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IgnoreReason {
    /// Its id was applied before on this endpoint.
    Duplicate,
    /// Same generation, and the held sequence wins.
    Older,
    /// What is held is of a newer generation.
    OlderGeneration,
    /// A removal at exactly the held tombstone's position: already carried out.
    AlreadyRemoved,
    /// A reload's read item that the copy's own row wins over (see [`crate::reload`]).
    KeptByMerge,
    /// `webhook_endpoint.tested`: answered, never applied.
    Test,
    /// `webhook_endpoint.reset`: handled for the whole message by [`crate::track::step`].
    Reset,
    /// A type, or a feed action, version 1 does not name.
    UnknownType,
}

impl Decision {
    /// The subject row the decision writes, if it writes one.
    pub fn subject(&self) -> Option<&str> {
        match self {
            Decision::Store { subject, .. }
            | Decision::Unchanged { subject, .. }
            | Decision::Tombstone { subject, .. } => Some(subject),
            Decision::Refetch { .. } | Decision::Ignore(_) => None,
        }
    }

    /// True when the outbox gets a row: a stored item, or a removed one.
    pub fn is_change(&self) -> bool {
        matches!(
            self,
            Decision::Store { .. }
                | Decision::Tombstone {
                    removed_item: true,
                    ..
                }
        )
    }
}

/// The subject of a feed item's event (the row it concerns); `None` for every other event.
pub fn feed_subject(event: &Event) -> Option<&str> {
    match &event.body {
        EventBody::Feed { subject, .. } => Some(subject),
        _ => None,
    }
}

/// Decides one event of a message of `generation`, given what the copy holds of its subject.
///
/// Rules: "Route each event by its type" and "Ignore an event type ... version 1 does not name"
/// (unknown types: `Ignore(UnknownType)`); "A webhook_endpoint.tested event is a test ... never a
/// change" (`Ignore(Test)`); resets are the whole message's business ([`crate::track::step`]).
/// "On a feed item's event": updated stores the data as the item with the event's sequence
/// ([`decide_update`]); withdrawn and hidden remove it and keep a tombstone
/// ([`decide_removal`]); both only when [`precedence`] says the event wins. "On a feed item's
/// event whose data is a refetch": `Refetch`, unless what is held already wins over any answer.
/// `data.op` is a hint and decides nothing here.
///
/// Rules: R-ITEM-EVENT, R-ROUTE, R-REFETCH, R-TEST, R-IGNORE-UNKNOWN (services/rules/RULES.md).
pub fn decide_event(held: Option<&Held>, generation: u64, event: &Event) -> Decision {
    match &event.body {
        EventBody::Tested(_) => Decision::Ignore(IgnoreReason::Test),
        EventBody::Reset(_) => Decision::Ignore(IgnoreReason::Reset),
        EventBody::Ignored { .. } => Decision::Ignore(IgnoreReason::UnknownType),
        EventBody::Feed {
            subject,
            sequence,
            data,
            ..
        } => match data {
            FeedData::Item(item) => decide_update(held, subject, generation, sequence, item),
            FeedData::Removal { .. } => decide_removal(held, subject, generation, sequence),
            FeedData::Refetch { feed_item_id, .. } => {
                // The answer may be an item (an update) or a 404 (a removal): read only when at
                // least the removal would win, the weaker of the two over an equal sequence.
                match precedence(held, generation, sequence, true) {
                    Precedence::Apply => Decision::Refetch {
                        subject: subject.clone(),
                        feed_item_id: feed_item_id.clone(),
                        generation,
                        sequence: sequence.clone(),
                    },
                    other => ignore(other),
                }
            }
        },
    }
}

/// Rule "On a feed item's event", updated: store the data as the item, at the event's sequence
/// (not the item's own `seq`), when the event wins over what is held; it may be the first event
/// about the item. An item equal to the held one (same parts, same JSON) is `Unchanged`.
pub fn decide_update(
    held: Option<&Held>,
    subject: &str,
    generation: u64,
    sequence: &Sequence,
    item: &FeedItem,
) -> Decision {
    match precedence(held, generation, sequence, false) {
        Precedence::Apply => {}
        other => return ignore(other),
    }
    let held_parts = match held.map(|h| &h.content) {
        Some(HeldContent::Item { parts, item: raw }) => {
            if *parts == item.parts && *raw == item.raw {
                return Decision::Unchanged {
                    subject: subject.to_owned(),
                    generation,
                    sequence: sequence.clone(),
                };
            }
            Some(parts.as_slice())
        }
        Some(HeldContent::Tombstone) | None => None,
    };
    Decision::Store {
        subject: subject.to_owned(),
        generation,
        sequence: sequence.clone(),
        item: item.clone(),
        diff: diff_parts(held_parts, &item.parts),
    }
}

/// Rule "On a feed item's event", withdrawn and hidden: remove the item and keep a tombstone of
/// its subject at the event's sequence, when the event wins (at an equal sequence a removal
/// wins). A removal with nothing held still leaves a tombstone: an older update arriving later
/// must not bring the item back.
pub fn decide_removal(
    held: Option<&Held>,
    subject: &str,
    generation: u64,
    sequence: &Sequence,
) -> Decision {
    match precedence(held, generation, sequence, true) {
        Precedence::Apply => {}
        other => return ignore(other),
    }
    if let Some(h) = held {
        if h.is_tombstone() && h.generation == generation && h.sequence == *sequence {
            return Decision::Ignore(IgnoreReason::AlreadyRemoved);
        }
    }
    Decision::Tombstone {
        subject: subject.to_owned(),
        generation,
        sequence: sequence.clone(),
        removed_item: held.is_some_and(|h| !h.is_tombstone()),
    }
}

fn ignore(p: Precedence) -> Decision {
    Decision::Ignore(match p {
        Precedence::OlderGeneration => IgnoreReason::OlderGeneration,
        _ => IgnoreReason::Older,
    })
}
