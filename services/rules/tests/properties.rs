//! Property tests over orderings, on the reference copy ([`relay_rules::FeedCopy`]).
//!
//! The conditions under which order does not matter, exactly as tested here:
//!
//! - Per subject, the events' positions (generation, sequence, is_removal) are ordered
//!   lexicographically, and the held row always ends as the event with the greatest position
//!   (a newer generation wins whatever its sequence; within one, the higher sequence; at one
//!   sequence, the removal). This holds for any order of arrival, within a generation and across
//!   generations, **provided one position never carries two different items** (the upstream's
//!   sequence names one change of one subject; `an_order_condition_...` shows what breaks
//!   without it). Duplicates (the same event again) are allowed and change nothing.
//! - This is per subject: which messages reach the subject rules at all is the message rules'
//!   business (a message of an older generation than the track's is skipped whole).
//! - A reload's merge under generation G, with events of generations >= G arriving before or
//!   after it in any order, ends in the same copy (the wire file's claim), whatever the rows held
//!   before the reset (all of generations < G).

mod common;

use std::collections::BTreeMap;

use common::*;
use proptest::prelude::*;
use proptest::sample::Index;
use relay_rules::{Decision, FeedCopy, Held, HeldContent, ReadItem};

/// (subject, generation, sequence, is_removal): a feed event, named by its position.
type Key = (u32, u64, u64, bool);

fn apply_all(copy: &mut FeedCopy, keys: &[Key]) {
    for &(s, g, n, r) in keys {
        copy.apply_event(g, &feed_event(s, g, n, r));
    }
}

fn sorted(keys: &[Key]) -> Vec<Key> {
    let mut keys = keys.to_vec();
    keys.sort_by_key(|&(s, g, n, r)| (s, g, n, r));
    keys
}

/// The rule stated as a formula: each subject holds its greatest position's content.
fn expected(keys: &[Key]) -> BTreeMap<String, Held> {
    let mut best: BTreeMap<u32, (u64, u64, bool)> = BTreeMap::new();
    for &(s, g, n, r) in keys {
        let e = best.entry(s).or_insert((g, n, r));
        if (g, n, r) > *e {
            *e = (g, n, r);
        }
    }
    best.into_iter()
        .map(|(s, (g, n, r))| {
            let content = if r {
                HeldContent::Tombstone
            } else {
                let item = content(s, n);
                HeldContent::Item {
                    parts: item.parts,
                    item: item.raw,
                }
            };
            (
                subject(s),
                Held {
                    generation: g,
                    sequence: seq(n),
                    content,
                },
            )
        })
        .collect()
}

fn key(generations: std::ops::RangeInclusive<u64>) -> impl Strategy<Value = Key> {
    (0u32..3, generations, 1u64..=8, any::<bool>())
}

/// Events with repeats: some keys drawn twice or three times.
fn events_with_duplicates(
    generations: std::ops::RangeInclusive<u64>,
    max: usize,
) -> impl Strategy<Value = Vec<Key>> {
    prop::collection::vec((key(generations), 1usize..=3), 0..max).prop_map(|v| {
        v.into_iter()
            .flat_map(|(k, times)| std::iter::repeat_n(k, times))
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(384))]

    /// Rule "On a feed item's event" ("messages arrive in no promised order"): any order of a
    /// subject's events, across 1-3 generations, with repeats and removals at an equal sequence,
    /// ends in the same copy as the sorted order, and in the greatest position's content.
    #[test]
    fn feed_item_event_rule_any_order_of_events_ends_in_the_same_copy(
        (keys, shuffled) in events_with_duplicates(1..=3, 20)
            .prop_flat_map(|k| (Just(k.clone()), Just(k).prop_shuffle()))
    ) {
        let mut canonical = FeedCopy::new();
        apply_all(&mut canonical, &sorted(&keys));
        let mut any_order = FeedCopy::new();
        apply_all(&mut any_order, &shuffled);
        prop_assert_eq!(&any_order, &canonical);
        prop_assert_eq!(canonical.rows(), &expected(&keys));

        // The same with the event-id de-duplication in front: ids skipped change nothing.
        let mut applied = std::collections::BTreeSet::new();
        let mut dedup = FeedCopy::new();
        for &(s, g, n, r) in &shuffled {
            let e = feed_event(s, g, n, r);
            let held = dedup.get(&subject(s)).cloned();
            let d = relay_rules::decide_event_dedup(|id| applied.contains(id), held.as_ref(), g, &e);
            dedup.apply(&d);
            applied.insert(e.id.clone());
        }
        prop_assert_eq!(&dedup, &canonical);
    }

    /// Idempotence: after any events, applying an event twice changes nothing the second time
    /// (neither the copy nor the outbox: the second decision is an `Ignore`).
    #[test]
    fn feed_item_event_rule_applying_an_event_twice_changes_nothing_the_second_time(
        prefix in events_with_duplicates(1..=3, 12),
        (s, g, n, r) in key(1..=3),
    ) {
        let mut copy = FeedCopy::new();
        apply_all(&mut copy, &prefix);
        let e = feed_event(s, g, n, r);
        copy.apply_event(g, &e);
        let once = copy.clone();
        let second = copy.apply_event(g, &e);
        prop_assert_eq!(&copy, &once);
        prop_assert!(matches!(second, Decision::Ignore(_)), "{:?}", second);
    }

    /// Rule "Then merge the read into the copy under the reset's generation ... Merged this way,
    /// the copy ends the same whatever order the pages and the messages came in": rows of older
    /// generations held before the reset, a read at generation 3, and events of generations 3
    /// and 4 (a rewind's) arriving in any order, the merge anywhere among them.
    #[test]
    fn merge_rule_the_copy_ends_the_same_whatever_order_pages_and_messages_came_in(
        before in events_with_duplicates(1..=2, 10),
        read in prop::collection::btree_map(0u32..4, 1u64..=8, 0..4),
        (during, shuffled) in events_with_duplicates(3..=4, 14)
            .prop_flat_map(|k| (Just(k.clone()), Just(k).prop_shuffle())),
        at in any::<Index>(),
    ) {
        const G: u64 = 3;
        let read: Vec<ReadItem> = read.into_iter().map(|(s, n)| read_item(s, n)).collect();
        let mut old = FeedCopy::new();
        apply_all(&mut old, &before);

        // Canonical: every event first, sorted, then the merge.
        let mut canonical = old.clone();
        apply_all(&mut canonical, &sorted(&during));
        canonical.merge(G, &read);

        // Any order, the merge at any point among the events.
        let split = at.index(shuffled.len() + 1);
        let mut any_order = old.clone();
        apply_all(&mut any_order, &shuffled[..split]);
        any_order.merge(G, &read);
        apply_all(&mut any_order, &shuffled[split..]);
        prop_assert_eq!(&any_order, &canonical);

        // And it is the formula: the read counts as an update at (G, its sequence); nothing of
        // an older generation survives.
        let mut keys: Vec<Key> = during.clone();
        keys.extend(read.iter().map(|r| {
            let s: u32 = r.subject.trim_start_matches("announcement:").parse().unwrap();
            (s, G, r.sequence.parts().unwrap().1, false)
        }));
        prop_assert_eq!(canonical.rows(), &expected(&keys));

        // Merging the same read again changes nothing.
        let mut again = canonical.clone();
        let (decisions, removed) = again.merge(G, &read);
        prop_assert_eq!(&again, &canonical);
        prop_assert!(removed.is_empty());
        prop_assert!(decisions.iter().all(|d| !d.is_change()), "{:?}", decisions);
    }
}

/// The condition of the first property is needed: two different items at one position of one
/// subject end as whichever came first (an update at an equal sequence is ignored).
#[test]
fn an_order_condition_two_different_items_at_one_position_make_order_matter() {
    let a = event(update_json("a", 1, 10, item_json(1, 10, &[], "a")));
    let b = event(update_json("b", 1, 10, item_json(1, 10, &[], "b")));
    let mut ab = FeedCopy::new();
    ab.apply_event(1, &a);
    ab.apply_event(1, &b);
    let mut ba = FeedCopy::new();
    ba.apply_event(1, &b);
    ba.apply_event(1, &a);
    assert_ne!(ab, ba);
}

/// One stored message of a random stream, or a reload's merge.
#[derive(Debug, Clone)]
enum Step {
    /// A message of events of `generation` under access_version `av{av}`, its events' positions
    /// drawn at that generation.
    Events {
        generation: u64,
        av: u8,
        events: Vec<(u32, u64, bool)>,
    },
    Reset {
        generation: u64,
        av: u8,
    },
    /// Merge the running reload, if any, with a read of these (subject, sequence) items.
    Merge(Vec<(u32, u64)>),
}

fn a_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (1u64..=4, 0u8..2, prop::collection::vec((0u32..3, 1u64..=8, any::<bool>()), 0..5))
            .prop_map(|(generation, av, events)| Step::Events { generation, av, events }),
        1 => (1u64..=4, 0u8..2).prop_map(|(generation, av)| Step::Reset { generation, av }),
        1 => prop::collection::vec((0u32..3, 1u64..=8), 0..3).prop_map(Step::Merge),
    ]
}

fn to_message(step: &Step, through: usize) -> Option<relay_wire::Message> {
    match step {
        Step::Events {
            generation,
            av,
            events,
        } => Some(message(
            *generation,
            &format!("av{av}"),
            &format!("1.{through}"),
            events
                .iter()
                .map(|&(s, n, r)| feed_event_json(s, *generation, n, r))
                .collect(),
        )),
        Step::Reset { generation, av } => Some(reset(*generation, &format!("av{av}"), "behind")),
        Step::Merge(_) => None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Rules "Ignore a message of an older generation", "Handle every webhook_endpoint.reset the
    /// same way", "The copy is held under the access_version of the message that began its
    /// reload" and "Then merge ...", run together on random streams: the held generation never
    /// falls; a message older than held (a reset not newer) changes nothing; no row is of a newer generation than the track; a running reload is never newer
    /// than the track and the copy is held under its access_version; after a merge of
    /// generation G nothing older than G is held; and (rule "Keep the event ids you applied")
    /// any message of events received again later changes nothing in the copy.
    #[test]
    fn message_rules_hold_their_invariants_on_random_streams(
        steps in prop::collection::vec(a_step(), 0..14),
        again in any::<Index>(),
    ) {
        let mut endpoint = relay_rules::Endpoint::new();
        let mut received = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            let before = endpoint.track.generation;
            if let Step::Merge(read) = step {
                let Some(reload) = endpoint.track.reload.clone() else { continue };
                let pages = reload.access_version.clone().unwrap_or_else(|| "av0".into());
                let read: Vec<ReadItem> = read.iter().map(|&(s, n)| read_item(s, n)).collect();
                prop_assert!(endpoint.merge(&reload, &[&pages], &read).is_some());
                prop_assert!(endpoint.track.reload.is_none());
                prop_assert!(endpoint.copy.rows().values().all(|h| h.generation >= reload.generation));
                continue;
            }
            let message = to_message(step, i + 1).unwrap();
            let prior = endpoint.clone();
            endpoint.receive(&message);
            received.push(message);
            // Older than held (a reset: not newer): nothing changes at all.
            let older = match step {
                Step::Events { generation, .. } => before.is_some_and(|b| *generation < b),
                Step::Reset { generation, .. } => before.is_some_and(|b| *generation <= b),
                Step::Merge(_) => false,
            };
            if older {
                prop_assert_eq!(&endpoint, &prior);
            }
            let track = &endpoint.track;
            prop_assert!(track.generation >= before);
            let held = track.generation.unwrap_or(0);
            prop_assert!(endpoint.copy.rows().values().all(|h| h.generation <= held));
            if let Some(reload) = &track.reload {
                prop_assert!(reload.generation <= held);
                prop_assert_eq!(&track.access_version, &reload.access_version);
            }
        }
        if !received.is_empty() {
            let message = &received[again.index(received.len())];
            let copy = endpoint.copy.clone();
            let r = endpoint.receive(message);
            prop_assert_eq!(&endpoint.copy, &copy);
            prop_assert!(r.events.iter().all(|d| !d.is_change()), "{:?}", r);
        }
    }
}
