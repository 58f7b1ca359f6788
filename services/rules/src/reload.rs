//! Merging a reload's read into the copy, and checking the pass its pages make.
//!
//! Rules "To reload: ... Read the pages again until they carry the same access_version", "The
//! copy is held under the access_version of the message that began its reload", and "Then merge
//! the read into the copy under the reset's generation".

use relay_wire::{FeedItem, Sequence};

use crate::event::{Decision, IgnoreReason};
use crate::parts::diff_parts;
use crate::precedence::{Held, HeldContent};

/// One item of a `/v1/feed` page: its subject, the sequence the page gives it, and the item.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadItem {
    pub subject: String,
    pub sequence: Sequence,
    pub item: FeedItem,
}

/// What the merge does with one item read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergeDecision {
    /// The copy's row wins: an event that arrived while the pages were read.
    Keep,
    /// Store the item read at the reload's generation and the page's sequence.
    Store,
}

/// Rule "Then merge the read into the copy under the reset's generation", for one item read
/// under reload generation `generation` at `read_sequence`: keep what the copy holds of its
/// subject at that generation at the same sequence or a later one, or at a newer generation;
/// otherwise store the item read.
///
/// As a condition on the held row (the `where` of the upsert), store when
/// `held.generation < $g or (held.generation = $g and held.sequence < $read_sequence)`: the same
/// comparison as an update event at ($g, $read_sequence) (a unit test checks they agree).
pub fn merge_read_item(
    held: Option<&Held>,
    generation: u64,
    read_sequence: &Sequence,
) -> MergeDecision {
    match held {
        Some(h) if h.generation > generation => MergeDecision::Keep,
        Some(h) if h.generation == generation && h.sequence >= *read_sequence => {
            MergeDecision::Keep
        }
        _ => MergeDecision::Store,
    }
}

/// [`merge_read_item`] as a [`Decision`] for the sequencer and the outbox: `Ignore(KeptByMerge)`,
/// or `Store` with the parts diff against the held item, or `Unchanged` when the held item is the
/// one read (only its position rises to the reload's generation, which keeps it from the drop).
pub fn merge_item(held: Option<&Held>, generation: u64, read: &ReadItem) -> Decision {
    if merge_read_item(held, generation, &read.sequence) == MergeDecision::Keep {
        return Decision::Ignore(IgnoreReason::KeptByMerge);
    }
    let held_parts = match held.map(|h| &h.content) {
        Some(HeldContent::Item { parts, item }) => {
            if *parts == read.item.parts && *item == read.item.raw {
                return Decision::Unchanged {
                    subject: read.subject.clone(),
                    generation,
                    sequence: read.sequence.clone(),
                };
            }
            Some(parts.as_slice())
        }
        _ => None,
    };
    Decision::Store {
        subject: read.subject.clone(),
        generation,
        sequence: read.sequence.clone(),
        item: read.item.clone(),
        diff: diff_parts(held_parts, &read.item.parts),
    }
}

/// Rule "Then merge ...": after the items read are merged, remove everything held from an older
/// generation than the reload's, items and tombstones alike (a tombstone lives "until a reload of
/// a later generation drops it"). As SQL: `delete ... where generation < $g`.
pub fn drop_after_merge(held: &Held, generation: u64) -> bool {
    held.generation < generation
}

/// Whether one pass of `/v1/feed` can be merged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PagesCheck {
    /// Every page carries the reload's access_version: merge.
    Agree,
    /// The pages disagree among themselves (or there are none): read the pass again.
    ReadAgain,
    /// The pages agree, on another access_version than the reload's: the reload begins again.
    OtherAccessVersion { pages: String },
}

/// Rule "To reload: ... Read the pages again until they carry the same access_version": true when
/// there is at least one page and every page carries the same access_version.
pub fn pages_agree<'a>(pages: impl IntoIterator<Item = &'a str>) -> bool {
    let mut pages = pages.into_iter();
    match pages.next() {
        None => false,
        Some(first) => pages.all(|p| p == first),
    }
}

/// Rules "Read the pages again until they carry the same access_version" and "The copy is held
/// under the access_version of the message that began its reload": a pass merges only when its
/// pages agree with each other and with `reload_access_version`. Pages that agree on another one
/// mean the reload must begin again (the sequencer bounds how often before it waits for the
/// message or reset that announces the new access).
///
/// `reload_access_version` is `None` for a reload no message began (see
/// [`Reload`](crate::track::Reload)): then any agreed access_version merges.
pub fn check_pages<'a>(
    reload_access_version: Option<&str>,
    pages: impl IntoIterator<Item = &'a str>,
) -> PagesCheck {
    let pages: Vec<&str> = pages.into_iter().collect();
    if !pages_agree(pages.iter().copied()) {
        return PagesCheck::ReadAgain;
    }
    if reload_access_version.is_none_or(|av| av == pages[0]) {
        PagesCheck::Agree
    } else {
        PagesCheck::OtherAccessVersion {
            pages: pages[0].to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precedence::{precedence, Precedence};

    fn held(generation: u64, n: u64, tombstone: bool) -> Held {
        Held {
            generation,
            sequence: Sequence::from_parts(1, n),
            content: if tombstone {
                HeldContent::Tombstone
            } else {
                HeldContent::Item {
                    parts: vec![],
                    item: serde_json::Value::Null,
                }
            },
        }
    }

    #[test]
    fn merge_rule_keeps_same_generation_at_same_or_later_sequence_and_newer_generation() {
        let s = |n| Sequence::from_parts(1, n);
        for t in [false, true] {
            assert_eq!(
                merge_read_item(Some(&held(4, 10, t)), 4, &s(10)),
                MergeDecision::Keep
            );
            assert_eq!(
                merge_read_item(Some(&held(4, 11, t)), 4, &s(10)),
                MergeDecision::Keep
            );
            assert_eq!(
                merge_read_item(Some(&held(5, 1, t)), 4, &s(10)),
                MergeDecision::Keep
            );
            assert_eq!(
                merge_read_item(Some(&held(4, 9, t)), 4, &s(10)),
                MergeDecision::Store
            );
            assert_eq!(
                merge_read_item(Some(&held(3, 99, t)), 4, &s(10)),
                MergeDecision::Store
            );
        }
        assert_eq!(merge_read_item(None, 4, &s(10)), MergeDecision::Store);
    }

    #[test]
    fn merge_rule_is_the_update_precedence_at_the_reload_generation() {
        let s = |n| Sequence::from_parts(1, n);
        for g in 1..=5 {
            for n in 8..=12 {
                for t in [false, true] {
                    let h = held(3, 10, t);
                    let merge = merge_read_item(Some(&h), g, &s(n)) == MergeDecision::Store;
                    let update = precedence(Some(&h), g, &s(n), false) == Precedence::Apply;
                    assert_eq!(merge, update, "g={g} n={n} tombstone={t}");
                }
            }
        }
    }

    #[test]
    fn merge_rule_then_removes_everything_of_an_older_generation() {
        assert!(drop_after_merge(&held(3, 99, false), 4));
        assert!(drop_after_merge(&held(3, 99, true), 4));
        assert!(!drop_after_merge(&held(4, 1, true), 4));
        assert!(!drop_after_merge(&held(5, 1, false), 4));
    }

    #[test]
    fn reload_rule_read_the_pages_again_until_they_carry_the_same_access_version() {
        assert!(pages_agree(["a", "a", "a"]));
        assert!(!pages_agree(["a", "b", "a"]));
        assert!(!pages_agree([]));
        assert_eq!(check_pages(Some("a"), ["a", "a"]), PagesCheck::Agree);
        assert_eq!(check_pages(Some("a"), ["a", "b"]), PagesCheck::ReadAgain);
        assert_eq!(check_pages(Some("a"), []), PagesCheck::ReadAgain);
        assert_eq!(check_pages(None, ["z", "z"]), PagesCheck::Agree);
    }

    #[test]
    fn copy_held_under_access_version_rule_pages_under_another_begin_the_reload_again() {
        assert_eq!(
            check_pages(Some("b4d934cf"), ["c0ffee00", "c0ffee00"]),
            PagesCheck::OtherAccessVersion {
                pages: "c0ffee00".into()
            }
        );
    }
}
