//! Merging a reload's read into the copy, and checking the pass its pages make.
//!
//! Rules "To reload: ... Read the pages again until they carry the same access_version", "The
//! copy is held under the access_version of the message that began its reload", and "Then merge
//! the read into the copy under the reset's generation".

use std::collections::BTreeMap;

use relay_wire::{FeedItem, Sequence};

use crate::event::{Decision, IgnoreReason};
use crate::parts::diff_parts;
use crate::precedence::{Held, HeldContent};
use crate::track::{EndpointTrack, Reload};

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
///
/// Rules: R-RELOAD-READ, R-ACCESS-VERSION (services/rules/RULES.md).
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

/// A row of the copy as a merge needs it: what is held, and the reload round it was written in
/// ([`EndpointTrack::reloads_begun`] then).
#[derive(Debug, Clone, PartialEq)]
pub struct HeldRow {
    pub held: Held,
    pub round: u64,
}

/// One pass of `/v1/feed` read for a reload.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Pass {
    /// Each page's access_version, in the order read.
    pub page_access_versions: Vec<String>,
    /// Every item of every page, in the order read.
    pub items: Vec<ReadItem>,
    /// The track's generation in the endpoint read the pass began with
    /// (`GET /v1/webhook-endpoints/{id}`: `tracks.feed.generation`), when it gave one.
    pub upstream_generation: Option<u64>,
    /// The reload's [`Reload::read_again`] when the pass began.
    pub read_again_at_start: u32,
}

/// What to do with a pass a reload read: [`decide_merge`].
#[derive(Debug, Clone, PartialEq)]
pub enum MergePlan {
    /// The reload is no longer the track's running one (a newer reset replaced it, or a pass
    /// was merged and nothing asked for another): write nothing, stop reading.
    Superseded,
    /// The pass cannot be merged: read another.
    ReadAgain(PagesCheck),
    /// Merge it: carry out [`Merge`] in one transaction, in its order.
    Merge(Box<Merge>),
}

/// A pass merged into the copy, to carry out in this order under the endpoint's writer lock.
#[derive(Debug, Clone, PartialEq)]
pub struct Merge {
    /// The generation the pass merges under ([`Reload::merge_generation`]).
    pub generation: u64,
    /// The round every row the merge writes is kept with (the track's `reloads_begun`).
    pub round: u64,
    /// 1. Each subject read once (its latest read), decided by [`merge_item`]: `Store` (an
    ///    upsert change, caused by the reload) or `Unchanged` (its position only); in subject
    ///    order. Subjects the copy's row wins over are not listed.
    pub writes: Vec<Decision>,
    /// 2. Every row held from an older generation that the pass did not read, deleted (rule
    ///    "Then remove everything held from an older generation"); `true` for an item (a removal change, in subject order),
    ///    `false` for a tombstone (its removal was reported when it was made).
    pub dropped: Vec<(String, bool)>,
    /// 3. Items held at the merge's generation from before the reload began that the pass does
    ///    not hold: the upstream no longer serves them. Each becomes a tombstone at its own
    ///    position (a removal change, in subject order): a late update of that generation must
    ///    not bring it back, and a newer one still wins (rule R-MERGE-SAME-GENERATION).
    pub withdrawn: Vec<(String, Sequence)>,
    /// 4. The track row after the merge ([`EndpointTrack::reload_merged`]).
    pub track: EndpointTrack,
}

/// Rules "To reload: ... Read the pages again until they carry the same access_version" and
/// "Then merge the read into the copy under the reset's generation ... Then remove everything
/// held from an older generation", for one pass of `reload`, against the track row and every
/// row of the copy (both read under the endpoint's writer lock).
///
/// A reload under the generation the copy already holds (one no message began, after a restore
/// or a refetch that kept failing; or one begun by a message under another access_version at
/// the held generation) removes nothing by generation; yet what the upstream withdrew before it
/// began must not stay (rule R-MERGE-SAME-GENERATION): so an item held at the merge's
/// generation, written before the reload began, that the pass does not hold is withdrawn.
/// Items written while the pass was read are events newer than the reload's start and stay,
/// as the rule keeps them.
///
/// Rules: R-MERGE, R-MERGE-SAME-GENERATION (services/rules/RULES.md).
pub fn decide_merge(
    track: &EndpointTrack,
    reload: &Reload,
    pass: &Pass,
    held: &BTreeMap<String, HeldRow>,
) -> MergePlan {
    if !track.reload.as_ref().is_some_and(|r| r.is(reload)) {
        return MergePlan::Superseded;
    }
    let pages = pass.page_access_versions.iter().map(String::as_str);
    match check_pages(reload.access_version.as_deref(), pages) {
        PagesCheck::Agree => {}
        other => return MergePlan::ReadAgain(other),
    }
    let generation = reload.merge_generation(pass.upstream_generation);
    // The latest read of each subject (later pages may carry newer ones).
    let mut read: BTreeMap<&str, &ReadItem> = BTreeMap::new();
    for item in &pass.items {
        match read.get(item.subject.as_str()) {
            Some(kept) if kept.sequence > item.sequence => {}
            _ => {
                read.insert(item.subject.as_str(), item);
            }
        }
    }
    let writes = read
        .iter()
        .map(|(subject, item)| merge_item(held.get(*subject).map(|r| &r.held), generation, item))
        .filter(|d| matches!(d, Decision::Store { .. } | Decision::Unchanged { .. }))
        .collect();
    let mut dropped = Vec::new();
    let mut withdrawn = Vec::new();
    for (subject, row) in held {
        // A subject the pass read is written at the merge's generation above, not dropped.
        if row.held.generation < generation && !read.contains_key(subject.as_str()) {
            dropped.push((subject.clone(), !row.held.is_tombstone()));
        } else if row.held.generation == generation
            && row.round < reload.round
            && !row.held.is_tombstone()
            && !read.contains_key(subject.as_str())
        {
            withdrawn.push((subject.clone(), row.held.sequence.clone()));
        }
    }
    MergePlan::Merge(Box::new(Merge {
        generation,
        round: track.reloads_begun,
        writes,
        dropped,
        withdrawn,
        track: track.reload_merged(
            reload,
            pass.read_again_at_start,
            generation,
            &pass.page_access_versions[0],
        ),
    }))
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

    fn row(generation: u64, n: u64, tombstone: bool, round: u64) -> HeldRow {
        HeldRow {
            held: held(generation, n, tombstone),
            round,
        }
    }

    fn read_item(subject: &str, n: u64) -> ReadItem {
        let raw = serde_json::json!({"feed_item_id": subject, "item_kind": "announcement",
            "seq": n, "type": "item", "parts": []});
        ReadItem {
            subject: subject.to_owned(),
            sequence: Sequence::from_parts(1, n),
            item: FeedItem::from_value(raw, "item").expect("an item"),
        }
    }

    fn running(track: &EndpointTrack) -> (EndpointTrack, Reload) {
        let (track, _) = track.read_feed_again();
        let reload = track.reload.clone().expect("a reload runs");
        (track, reload)
    }

    fn pass(items: Vec<ReadItem>, upstream_generation: Option<u64>) -> Pass {
        Pass {
            page_access_versions: vec!["av".into()],
            items,
            upstream_generation,
            read_again_at_start: 0,
        }
    }

    #[test]
    fn merge_rule_then_removes_everything_of_an_older_generation() {
        let track = EndpointTrack {
            generation: Some(3),
            ..Default::default()
        };
        let (track, reload) = running(&track);
        let held = BTreeMap::from([
            ("announcement:1".to_owned(), row(2, 99, false, 0)),
            ("announcement:2".to_owned(), row(2, 99, true, 0)),
            ("announcement:3".to_owned(), row(5, 1, false, 0)),
        ]);
        // The upstream's endpoint read says generation 4: the merge goes under it.
        let MergePlan::Merge(merge) = decide_merge(&track, &reload, &pass(vec![], Some(4)), &held)
        else {
            panic!("the pass merges");
        };
        assert_eq!(merge.generation, 4);
        assert_eq!(
            merge.dropped,
            vec![
                ("announcement:1".to_owned(), true),
                ("announcement:2".to_owned(), false)
            ]
        );
        assert!(merge.withdrawn.is_empty());
        assert_eq!(merge.track.reload, None);
        assert_eq!(merge.track.generation, Some(4));
    }

    #[test]
    fn merge_same_generation_withdraws_items_held_from_before_the_reload_that_the_read_lacks() {
        let track = EndpointTrack {
            generation: Some(3),
            reloads_begun: 2,
            ..Default::default()
        };
        let (track, reload) = running(&track);
        assert_eq!(reload.round, 3);
        let held = BTreeMap::from([
            // Held from before the reload, not read: withdrawn at its own position.
            ("announcement:1".to_owned(), row(3, 10, false, 2)),
            // Held from before, read: stored from the read.
            ("announcement:2".to_owned(), row(3, 10, false, 2)),
            // Written while the pass was read: an event newer than the reload's start, kept.
            ("announcement:3".to_owned(), row(3, 12, false, 3)),
            // A tombstone from before: kept, a late update must not bring the item back.
            ("announcement:4".to_owned(), row(3, 11, true, 1)),
        ]);
        let read = vec![read_item("announcement:2", 20)];
        let MergePlan::Merge(merge) = decide_merge(&track, &reload, &pass(read, Some(3)), &held)
        else {
            panic!("the pass merges");
        };
        assert_eq!(merge.generation, 3);
        assert!(merge.dropped.is_empty());
        assert_eq!(
            merge.withdrawn,
            vec![("announcement:1".to_owned(), Sequence::from_parts(1, 10))]
        );
        assert_eq!(merge.writes.len(), 1);
    }

    #[test]
    fn merge_of_a_pass_begun_before_a_read_again_keeps_the_reload_running() {
        let track = EndpointTrack {
            generation: Some(3),
            ..Default::default()
        };
        let (track, reload) = running(&track);
        // A refetch kept failing while the pass was read: read /v1/feed again.
        let (track, again) = track.read_feed_again();
        assert!(matches!(again, crate::track::ReloadStart::ReadAgain(_)));
        let MergePlan::Merge(merge) =
            decide_merge(&track, &reload, &pass(vec![], None), &BTreeMap::new())
        else {
            panic!("a pass begun before the ask still merges");
        };
        let still = merge.track.reload.clone().expect("another pass is read");
        assert!(still.is(&reload));
        // The next pass begins after the ask: its merge ends the reload.
        let next = Pass {
            read_again_at_start: still.read_again,
            ..pass(vec![], None)
        };
        let MergePlan::Merge(merge) = decide_merge(&merge.track, &still, &next, &BTreeMap::new())
        else {
            panic!("merges");
        };
        assert_eq!(merge.track.reload, None);
        // A reload no longer running merges nothing.
        assert_eq!(
            decide_merge(&merge.track, &still, &next, &BTreeMap::new()),
            MergePlan::Superseded
        );
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
