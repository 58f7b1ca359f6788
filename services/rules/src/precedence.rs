//! What the copy holds of one subject, and which event wins over it.
//!
//! Reading rule "On a feed item's event": an event of a newer generation wins over what is held
//! of its subject whatever its sequence; within a generation an event applies only when its
//! sequence is above the held one (the item's or its tombstone's), or equal to it and the event
//! a removal; sequences of one subject compare as strings.

use relay_wire::{PartRef, Sequence};
use serde_json::Value;

/// What the copy holds of one subject: one row, keyed by the subject.
#[derive(Debug, Clone, PartialEq)]
pub struct Held {
    /// The generation of the event (or reload) that wrote the row.
    pub generation: u64,
    /// The sequence of the event that wrote the row (for an update: the event's, not the
    /// item's own `seq`; for a reload's read: the page's).
    pub sequence: Sequence,
    pub content: HeldContent,
}

/// The item itself, or the tombstone a removal leaves.
#[derive(Debug, Clone, PartialEq)]
pub enum HeldContent {
    /// `parts` are the item's part ids and versions (what the outbox diff compares); `item` is
    /// the item's JSON exactly as received.
    Item { parts: Vec<PartRef>, item: Value },
    /// The subject was withdrawn or hidden at `sequence`; kept until a reload of a later
    /// generation drops it, so that an older update arriving late cannot bring the item back.
    Tombstone,
}

impl Held {
    pub fn is_tombstone(&self) -> bool {
        matches!(self.content, HeldContent::Tombstone)
    }
}

/// Whether an event at a position applies over what is held of its subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precedence {
    /// Nothing is held, or the event's position wins: write it.
    Apply,
    /// Same generation, and the held sequence is above the event's (or equal and the event is
    /// not a removal).
    Older,
    /// The held row is of a newer generation than the event.
    OlderGeneration,
}

/// Decides whether an event at (`generation`, `sequence`, `is_removal`) applies over `held`.
///
/// Rule "On a feed item's event", in our words: a newer generation wins whatever its sequence and
/// an older one loses; within one generation the event applies when its sequence is above what is
/// held of the subject, item or tombstone, or equal and the event a removal (at one sequence a
/// removal wins). Nothing held: apply (an update may be the first event about an item, and a
/// removal of an unknown item still leaves a tombstone).
///
/// In SQL, with `excluded` the event's row and the held row named `held`, and the sequence
/// column compared as bytes (`collate "C"`, since the rule compares them as strings):
///
/// ```text
/// where excluded.generation > held.generation
///    or (excluded.generation = held.generation
///        and (excluded.sequence > held.sequence
///             or (excluded.sequence = held.sequence and excluded.is_removal)))
/// ```
///
/// So the winner among a subject's events is the one with the greatest
/// (generation, sequence, is_removal) in lexicographic order, whatever order they arrive in,
/// provided one position never carries two different contents (see the `order` property test).
///
/// Rules: R-ITEM-EVENT, R-OLDER-GEN (services/rules/RULES.md).
pub fn precedence(
    held: Option<&Held>,
    generation: u64,
    sequence: &Sequence,
    is_removal: bool,
) -> Precedence {
    let Some(held) = held else {
        return Precedence::Apply;
    };
    if generation > held.generation {
        return Precedence::Apply;
    }
    if generation < held.generation {
        return Precedence::OlderGeneration;
    }
    // Sequence orders by its text: exactly the string comparison the rule asks for.
    match sequence.cmp(&held.sequence) {
        std::cmp::Ordering::Greater => Precedence::Apply,
        std::cmp::Ordering::Equal if is_removal => Precedence::Apply,
        _ => Precedence::Older,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(n: u64) -> Sequence {
        Sequence::from_parts(1, n)
    }

    fn held(generation: u64, n: u64, tombstone: bool) -> Held {
        Held {
            generation,
            sequence: seq(n),
            content: if tombstone {
                HeldContent::Tombstone
            } else {
                HeldContent::Item {
                    parts: vec![],
                    item: Value::Null,
                }
            },
        }
    }

    #[test]
    fn feed_item_event_rule_nothing_held_applies_update_and_removal() {
        assert_eq!(precedence(None, 1, &seq(5), false), Precedence::Apply);
        assert_eq!(precedence(None, 1, &seq(5), true), Precedence::Apply);
    }

    #[test]
    fn feed_item_event_rule_newer_generation_wins_whatever_its_sequence() {
        let h = held(3, 1000, false);
        assert_eq!(precedence(Some(&h), 4, &seq(1), false), Precedence::Apply);
        let t = held(3, 1000, true);
        assert_eq!(precedence(Some(&t), 4, &seq(1), false), Precedence::Apply);
    }

    #[test]
    fn feed_item_event_rule_older_generation_is_ignored_whatever_its_sequence() {
        let h = held(3, 10, false);
        assert_eq!(
            precedence(Some(&h), 2, &seq(99_999), true),
            Precedence::OlderGeneration
        );
    }

    #[test]
    fn feed_item_event_rule_same_generation_needs_a_higher_sequence_or_an_equal_removal() {
        for tombstone in [false, true] {
            let h = held(3, 10, tombstone);
            assert_eq!(precedence(Some(&h), 3, &seq(11), false), Precedence::Apply);
            assert_eq!(precedence(Some(&h), 3, &seq(11), true), Precedence::Apply);
            assert_eq!(precedence(Some(&h), 3, &seq(10), false), Precedence::Older);
            assert_eq!(precedence(Some(&h), 3, &seq(10), true), Precedence::Apply);
            assert_eq!(precedence(Some(&h), 3, &seq(9), true), Precedence::Older);
        }
    }

    #[test]
    fn feed_item_event_rule_sequences_compare_as_strings_across_epochs() {
        // Epoch 2's seq 1 is after epoch 1's seq 999: as text, not as the seq number.
        let h = held(3, 999, false);
        let later_epoch = Sequence::from_parts(2, 1);
        assert_eq!(
            precedence(Some(&h), 3, &later_epoch, false),
            Precedence::Apply
        );
        // Text that is not zero-padded still compares as text: "9" > "10".
        let h = Held {
            sequence: Sequence::new("10"),
            ..held(3, 0, false)
        };
        assert_eq!(
            precedence(Some(&h), 3, &Sequence::new("9"), false),
            Precedence::Apply
        );
    }
}
