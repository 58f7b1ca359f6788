//! Property tests over orderings: on the reference copy ([`relay_rules::FeedCopy`]) event by
//! event, and on whole runs of stored messages through [`relay_rules::Endpoint`] (the executor of
//! [`relay_rules::decide_run`]'s and [`relay_rules::decide_merge`]'s plans).
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
//!   business (a message of an older generation than the track's is skipped whole). The stream
//!   properties below state that part with an oracle written from the rule text
//!   ([`Oracle`]), not from the crate.
//! - A reload's merge under generation G, with events of generations >= G arriving before or
//!   after it in any order, ends in the same copy (the wire file's claim), whatever the rows held
//!   before the reset (all of generations < G) and whether the pass reads their subjects again.
//! - A run is decided the same however the stored messages are cut into runs
//!   (`run_rules_a_run_decides_the_same_however_the_messages_are_cut_into_runs`).
//! - A reload under the generation the copy holds keeps no item its pass lacks unless a message
//!   wrote it during the read (rule R-MERGE-SAME-GENERATION in RULES.md).
//!
//! The number of cases is each block's default unless `PROPTEST_CASES` is set.

mod common;
mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use common::*;
use proptest::prelude::*;
use proptest::sample::Index;
use relay_rules::{
    decide_run, Decision, Endpoint, EndpointTrack, EventOutcome, FeedCopy, Held, HeldContent,
    MergePlan, MessagePlan, Outcome, Pass, PlannedChange, ReadItem, RefetchAnswer, RefetchRead,
    Reload, ReloadCause, ReloadStart, Run, StoredMessage, REFETCH_ATTEMPTS,
};
use relay_wire::Message;
use serde_json::json;
use support::*;

/// (subject, generation, sequence, is_removal): a feed event, named by its position.
type Key = (u32, u64, u64, bool);

fn apply_all(copy: &mut FeedCopy, keys: &[Key]) {
    for &(s, g, n, r) in keys {
        apply_event(copy, g, &feed_event(s, g, n, r));
    }
}

fn sorted(keys: &[Key]) -> Vec<Key> {
    let mut keys = keys.to_vec();
    keys.sort_by_key(|&(s, g, n, r)| (s, g, n, r));
    keys
}

/// The row a position leaves: the item `content` gives it, or a tombstone.
fn held_at(s: u32, g: u64, n: u64, removal: bool) -> Held {
    let content = if removal {
        HeldContent::Tombstone
    } else {
        let item = content(s, n);
        HeldContent::Item {
            parts: item.parts,
            item: item.raw,
        }
    };
    Held {
        generation: g,
        sequence: seq(n),
        content,
    }
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
        .map(|(s, (g, n, r))| (subject(s), held_at(s, g, n, r)))
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

fn track_at(generation: u64, access_version: &str) -> EndpointTrack {
    EndpointTrack {
        generation: Some(generation),
        access_version: Some(access_version.into()),
        through: Some("1.1".into()),
        ..Default::default()
    }
}

/// The event of `key` written by a message while a reload reads, as a run writes it: the row,
/// and the track's round with it (not the outbox).
fn apply_during(endpoint: &mut Endpoint, (s, g, n, r): Key) {
    let decision = apply_event(&mut endpoint.copy, g, &feed_event(s, g, n, r));
    if let Some(subject) = decision.subject() {
        let round = endpoint.track.reloads_begun;
        endpoint.rounds.insert(subject.to_owned(), round);
    }
}

proptest! {
    #![proptest_config(config(384))]

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

        // The same with the event-id de-duplication in front, as `decide_run` does it: each
        // event a one-message run at its generation, the ids applied before seen; ids skipped
        // change nothing.
        let mut applied: HashSet<String> = HashSet::new();
        let mut dedup = FeedCopy::new();
        let no_reads = HashMap::new();
        for &(s, g, n, r) in &shuffled {
            let messages = [Ok(message(g, "av", "1.1", vec![feed_event_json(s, g, n, r)]))];
            let track = track_at(g, "av");
            let held = dedup.get(&subject(s)).map(|h| (subject(s), h.clone())).into_iter().collect();
            let run = Run { track: &track, messages: &messages, seen: &applied, refetches: &no_reads };
            let plan = decide_run(run, held);
            let mut rows = dedup.into_rows();
            rows.extend(plan.rows.into_iter().map(|row| (row.subject, row.held)));
            dedup = FeedCopy::from_rows(rows);
            applied.extend(plan.keep);
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
        apply_event(&mut copy, g, &e);
        let once = copy.clone();
        let second = apply_event(&mut copy, g, &e);
        prop_assert_eq!(&copy, &once);
        prop_assert!(matches!(second, Decision::Ignore(_)), "{:?}", second);
    }

    /// Rule "Then merge the read into the copy under the reset's generation ... Merged this way,
    /// the copy ends the same whatever order the pages and the messages came in": rows of older
    /// generations held before the reset, a read at generation 3 (overlapping those rows'
    /// subjects or not), and events of generations 3 and 4 (a rewind's) arriving in any order,
    /// the merge anywhere among them. (Events are applied subject by subject here; whole
    /// messages are the stream properties' business.)
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
        // The copy before the reset of generation 3, and the reset's reload.
        let mut old = Endpoint { track: track_at(2, "av"), ..Default::default() };
        apply_all(&mut old.copy, &before);
        run(&mut old, &[reset(G, "av", "behind")]);
        let reload = old.track.reload.clone().unwrap();
        let the_pass = |read_again_at_start| pass("av", read.clone(), None, read_again_at_start);

        // Canonical: every event first, sorted, then the merge. Before it, "read /v1/feed
        // again" was asked, so that the same pass can be merged twice below.
        let mut canonical = old.clone();
        for &k in &sorted(&during) {
            apply_during(&mut canonical, k);
        }
        canonical.track = canonical.track.read_feed_again().0;
        merged(canonical.merge(&reload, &the_pass(0)));

        // Any order, the merge at any point among the events.
        let split = at.index(shuffled.len() + 1);
        let mut any_order = old.clone();
        for &k in &shuffled[..split] {
            apply_during(&mut any_order, k);
        }
        merged(any_order.merge(&reload, &the_pass(0)));
        for &k in &shuffled[split..] {
            apply_during(&mut any_order, k);
        }
        // (Only the copy: events applied here write no outbox; the run properties check it.)
        prop_assert_eq!(&any_order.copy, &canonical.copy);

        // And it is the formula: the read counts as an update at (G, its sequence); nothing of
        // an older generation survives.
        let mut keys: Vec<Key> = during.clone();
        keys.extend(read.iter().map(|r| {
            let s: u32 = r.subject.trim_start_matches("announcement:").parse().unwrap();
            (s, G, r.sequence.parts().unwrap().1, false)
        }));
        prop_assert_eq!(canonical.copy.rows(), &expected(&keys));

        // Merging the same read again (the pass asked for after the first) changes nothing.
        let mut again = canonical.clone();
        let running = again.track.reload.clone().expect("another pass was asked for");
        let merge = merged(again.merge(&running, &the_pass(1)));
        prop_assert_eq!(&again.copy, &canonical.copy);
        prop_assert_eq!(&again.changes, &canonical.changes);
        prop_assert!(merge.writes.is_empty() && merge.dropped.is_empty() && merge.withdrawn.is_empty(),
            "{:?}", merge);
        prop_assert_eq!(again.track.reload, None);
    }
}

/// The condition of the first property is needed: two different items at one position of one
/// subject end as whichever came first (an update at an equal sequence is ignored).
#[test]
fn an_order_condition_two_different_items_at_one_position_make_order_matter() {
    let a = event(plain_update_json("a", 1, 10, "a"));
    let b = event(plain_update_json("b", 1, 10, "b"));
    let mut ab = FeedCopy::new();
    apply_event(&mut ab, 1, &a);
    apply_event(&mut ab, 1, &b);
    let mut ba = FeedCopy::new();
    apply_event(&mut ba, 1, &b);
    apply_event(&mut ba, 1, &a);
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

fn to_message(step: &Step, through: usize) -> Option<Message> {
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
    #![proptest_config(config(256))]

    /// Rules "Ignore a message of an older generation", "Handle every webhook_endpoint.reset the
    /// same way", "The copy is held under the access_version of the message that began its
    /// reload" and "Then merge ...", run together on random streams, one message per run: the
    /// held generation never falls; a message older than held (a reset: not newer) changes
    /// nothing but its outcome; no row is of a newer generation than the track; a running
    /// reload is never newer than the track and the copy is held under its access_version;
    /// after a merge of generation G nothing older than G is held; and (rule "Keep the event ids
    /// you applied") any message of events received again later changes nothing in the copy.
    #[test]
    fn message_rules_hold_their_invariants_on_random_streams(
        steps in prop::collection::vec(a_step(), 0..14),
        again in any::<Index>(),
    ) {
        let mut endpoint = Endpoint::new();
        let mut received = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            let before = endpoint.track.generation;
            if let Step::Merge(read) = step {
                let Some(reload) = endpoint.track.reload.clone() else { continue };
                let pages = reload.access_version.clone().unwrap_or_else(|| "av0".into());
                let read: Vec<ReadItem> = read.iter().map(|&(s, n)| read_item(s, n)).collect();
                let plan = endpoint.merge(&reload, &pass(&pages, read, None, reload.read_again));
                let MergePlan::Merge(merge) = plan else {
                    return Err(TestCaseError::fail(format!("not merged: {plan:?}")));
                };
                prop_assert_eq!(merge.generation, reload.generation);
                prop_assert!(endpoint.track.reload.is_none());
                prop_assert!(endpoint.copy.rows().values().all(|h| h.generation >= reload.generation));
                continue;
            }
            let message = to_message(step, i + 1).unwrap();
            let prior = endpoint.clone();
            run(&mut endpoint, std::slice::from_ref(&message));
            received.push(message);
            // Older than held (a reset: not newer): nothing changes but the outcome noted.
            let older = match step {
                Step::Events { generation, .. } => before.is_some_and(|b| *generation < b),
                Step::Reset { generation, .. } => before.is_some_and(|b| *generation <= b),
                Step::Merge(_) => false,
            };
            if older {
                prop_assert_eq!(endpoint.outcomes.last(), Some(&Outcome::OlderGeneration));
                let mut unchanged = endpoint.clone();
                unchanged.outcomes.pop();
                prop_assert_eq!(&unchanged, &prior);
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
            let plan = run(&mut endpoint, std::slice::from_ref(message));
            prop_assert_eq!(&endpoint.copy, &copy);
            prop_assert!(plan.changes.is_empty(), "{:?}", plan);
        }
    }
}

// ---- Random streams of stored messages and merges, against an oracle ----

/// How a refetch's read answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// The item, under the copy's access_version.
    Found,
    /// A 404 under the copy's access_version.
    Gone,
    /// The item, under another access_version: read /v1/feed again.
    OtherAccess,
    /// A load balancer's 404, every read: read /v1/feed again.
    Failing,
}

/// One event of a message of a stream, at the message's generation.
#[derive(Debug, Clone, Copy)]
enum Ev {
    Update(u32, u64),
    Removal(u32, u64),
    Refetch(u32, u64, Answer),
}

/// One step of a stream: a stored message, or a reload's pass merged.
#[derive(Debug, Clone)]
enum Op {
    Events {
        generation: u64,
        av: u8,
        events: Vec<Ev>,
    },
    Reset {
        generation: u64,
        av: u8,
    },
    /// An earlier message of the stream stored again (a retry the upstream sent with a new
    /// webhook-id, or a rewind's resend): the same body.
    Again(Index),
    /// A stored body that is not a v1 message: set aside, and the feed read again.
    Junk,
    Test,
    OtherTrack,
    /// The running reload's pass: these (subject, sequence) items, the upstream's endpoint read
    /// giving `upstream` as the track's generation. `stale`: the pass began before the latest
    /// "read /v1/feed again". `stopped`: the pass is the last reload no longer running's.
    Merge {
        items: Vec<(u32, u64)>,
        upstream: Option<u64>,
        stale: bool,
        stopped: bool,
    },
}

fn an_event() -> impl Strategy<Value = Ev> {
    let answer = prop_oneof![
        Just(Answer::Found),
        Just(Answer::Gone),
        Just(Answer::OtherAccess),
        Just(Answer::Failing),
    ];
    prop_oneof![
        4 => (0u32..4, 1u64..=6).prop_map(|(s, n)| Ev::Update(s, n)),
        3 => (0u32..4, 1u64..=6).prop_map(|(s, n)| Ev::Removal(s, n)),
        1 => (0u32..4, 1u64..=6, answer).prop_map(|(s, n, a)| Ev::Refetch(s, n, a)),
    ]
}

fn an_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (1u64..=4, 0u8..2, prop::collection::vec(an_event(), 0..5))
            .prop_map(|(generation, av, events)| Op::Events { generation, av, events }),
        2 => (1u64..=5, 0u8..2).prop_map(|(generation, av)| Op::Reset { generation, av }),
        2 => any::<Index>().prop_map(Op::Again),
        1 => Just(Op::Junk),
        1 => Just(Op::Test),
        1 => Just(Op::OtherTrack),
        4 => (
            prop::collection::vec((0u32..4, 1u64..=6), 0..4),
            prop::option::of(1u64..=6),
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.15),
        )
            .prop_map(|(items, upstream, stale, stopped)| Op::Merge { items, upstream, stale, stopped }),
    ]
}

/// The id of `ev` in a message of `generation` under access_version `av{av}`. One id names one
/// change, so one read answers it: a refetch's id names its answer and the access_version it is
/// under (its message's, [`refetch_reads`]), so that messages under two access_versions never
/// carry one refetch id with two answers.
fn event_id(ev: Ev, generation: u64, av: u8) -> String {
    match ev {
        Ev::Update(s, n) => format!("evt_{s}_{generation}_{n}_false"),
        Ev::Removal(s, n) => format!("evt_{s}_{generation}_{n}_true"),
        Ev::Refetch(s, n, a) => format!("rf_{s}_{generation}_{n}_{a:?}_av{av}"),
    }
}

/// The stored message of an op that is one (`Again` resolved beforehand).
fn stored_message(op: &Op, through: usize) -> StoredMessage {
    let av = |av: &u8| format!("av{av}");
    match op {
        Op::Events {
            generation,
            av: a,
            events,
        } => {
            let events = events
                .iter()
                .map(|&ev| match ev {
                    Ev::Update(s, n) => feed_event_json(s, *generation, n, false),
                    Ev::Removal(s, n) => feed_event_json(s, *generation, n, true),
                    Ev::Refetch(s, n, _) => refetch_json(&event_id(ev, *generation, *a), s, n),
                })
                .collect();
            Ok(message(
                *generation,
                &av(a),
                &format!("1.{through}"),
                events,
            ))
        }
        Op::Reset { generation, av: a } => Ok(reset(*generation, &av(a), "behind")),
        Op::Junk => Err("expected value at line 1 column 1".into()),
        Op::Test => Ok(wire_example("test")),
        Op::OtherTrack => Ok(parse(
            json!({"v": 1, "webhook_endpoint_id": ENDPOINT, "track": "stories",
                   "generation": 9, "events": []}),
        )),
        Op::Again(_) | Op::Merge { .. } => unreachable!("not a message"),
    }
}

/// Every refetch read the stream's messages ask for, by event id. Each answer is under the
/// message's access_version (the copy's when the refetch is decided: the message's own step
/// holds the copy under it) or another.
fn refetch_reads(ops: &[Op]) -> HashMap<String, RefetchRead> {
    let mut reads = HashMap::new();
    for op in ops {
        let Op::Events {
            generation,
            av,
            events,
        } = op
        else {
            continue;
        };
        for &ev in events {
            let Ev::Refetch(s, n, answer) = ev else {
                continue;
            };
            let ours = format!("av{av}");
            let (answer, attempts) = match answer {
                Answer::Found => (
                    RefetchAnswer::Found {
                        access_version: ours,
                        sequence: seq(n),
                        item: content(s, n),
                    },
                    1,
                ),
                Answer::Gone => (
                    RefetchAnswer::NotFound {
                        access_version: ours,
                    },
                    1,
                ),
                Answer::OtherAccess => (
                    RefetchAnswer::Found {
                        access_version: "elsewhere".into(),
                        sequence: seq(n),
                        item: content(s, n),
                    },
                    1,
                ),
                Answer::Failing => (RefetchAnswer::LoadBalancer404, REFETCH_ATTEMPTS),
            };
            reads.insert(
                event_id(ev, *generation, *av),
                RefetchRead { answer, attempts },
            );
        }
    }
    reads
}

/// The stream with each `Again` replaced by the message it repeats (dropped when none was sent
/// yet), so every execution and the oracle see the same ops.
fn resolve(ops: Vec<Op>) -> Vec<Op> {
    let mut sent: Vec<Op> = Vec::new();
    let mut out = Vec::new();
    for op in ops {
        let op = match op {
            Op::Again(i) if sent.is_empty() => {
                let _ = i;
                continue;
            }
            Op::Again(i) => sent[i.index(sent.len())].clone(),
            other => other,
        };
        if !matches!(op, Op::Merge { .. }) {
            sent.push(op.clone());
        }
        out.push(op);
    }
    out
}

/// The pass a merge op reads for the running reload, or `None` when no reload runs. Its items
/// may be subjects the copy holds from an older generation than the merge's, or not at all.
fn pass_for(
    endpoint: &Endpoint,
    items: &[(u32, u64)],
    upstream: Option<u64>,
    stale: bool,
) -> Option<(Reload, Pass)> {
    let reload = endpoint.track.reload.clone()?;
    let items = items.iter().map(|&(s, n)| read_item(s, n)).collect();
    let pages = reload
        .access_version
        .clone()
        .unwrap_or_else(|| "av0".into());
    let at_start = if stale {
        reload.read_again.saturating_sub(1)
    } else {
        reload.read_again
    };
    Some((reload, pass(&pages, items, upstream, at_start)))
}

/// Everything the runs and merges of one execution of a stream decided, in order.
#[derive(Debug, Default, PartialEq)]
struct Trace {
    events: Vec<EventOutcome>,
    changes: Vec<PlannedChange>,
    keep: Vec<String>,
    messages: Vec<MessagePlan>,
    reloads: Vec<ReloadStart>,
    merges: Vec<MergePlan>,
}

/// Plays `ops` on a new endpoint, the messages between two merges cut into runs after each
/// message `i` for which `cut(i)` holds. Returns the endpoint and what was decided.
fn play(ops: &[Op], cut: impl Fn(usize) -> bool) -> (Endpoint, Trace) {
    let reads = refetch_reads(ops);
    let mut endpoint = Endpoint::new();
    let mut trace = Trace::default();
    let mut pending: Vec<StoredMessage> = Vec::new();
    let mut last_stopped: Option<Reload> = None;
    let flush = |endpoint: &mut Endpoint,
                 pending: &mut Vec<StoredMessage>,
                 trace: &mut Trace,
                 last_stopped: &mut Option<Reload>| {
        if pending.is_empty() {
            return;
        }
        let plan = endpoint.run(pending, &reads);
        pending.clear();
        for start in &plan.reloads {
            if let ReloadStart::Supersede { stopped, .. } = start {
                *last_stopped = Some(stopped.clone());
            }
        }
        trace.events.extend(plan.events);
        trace.changes.extend(plan.changes);
        trace.keep.extend(plan.keep);
        trace.messages.extend(plan.messages);
        trace.reloads.extend(plan.reloads);
    };
    let mut index = 0;
    for (i, op) in ops.iter().enumerate() {
        if let Op::Merge {
            items,
            upstream,
            stale,
            stopped,
        } = op
        {
            flush(&mut endpoint, &mut pending, &mut trace, &mut last_stopped);
            if *stopped {
                if let Some(old) = &last_stopped {
                    let p = pass("av0", vec![], *upstream, old.read_again);
                    trace.merges.push(endpoint.merge(old, &p));
                }
                continue;
            }
            if let Some((reload, p)) = pass_for(&endpoint, items, *upstream, *stale) {
                let plan = endpoint.merge(&reload, &p);
                if endpoint.track.reload.is_none() {
                    last_stopped = Some(reload);
                }
                trace.merges.push(plan);
            }
            continue;
        }
        pending.push(stored_message(op, i + 1));
        if cut(index) {
            flush(&mut endpoint, &mut pending, &mut trace, &mut last_stopped);
        }
        index += 1;
    }
    flush(&mut endpoint, &mut pending, &mut trace, &mut last_stopped);
    (endpoint, trace)
}

/// A position of a subject: (generation, seq number, is_removal), ordered as the rule orders
/// them; and the reload round of its write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Row {
    position: (u64, u64, bool),
    round: u64,
}

#[derive(Debug, Clone)]
struct OracleReload {
    generation: u64,
    access_version: Option<String>,
    read_again_cause: bool,
    read_again: u32,
    round: u64,
}

/// The reading rules restated from the wire file's text, on plain maps, without calling the
/// crate: what the copy, the track, the ids and the outcomes must be after each step.
#[derive(Debug, Default)]
struct Oracle {
    generation: Option<u64>,
    access_version: Option<String>,
    reloads_begun: u64,
    running: Option<OracleReload>,
    last_stopped: Option<u64>,
    rows: BTreeMap<u32, Row>,
    applied: BTreeSet<String>,
    outcomes: Vec<Outcome>,
}

impl Oracle {
    /// "The copy is held under the access_version of the message that began its reload"; a
    /// reload begun while one runs replaces it ("its reload replaces this one").
    fn begin(&mut self, generation: u64, access_version: Option<String>, read_again_cause: bool) {
        self.reloads_begun += 1;
        if access_version.is_some() {
            self.access_version = access_version.clone();
        }
        self.running = Some(OracleReload {
            generation,
            access_version,
            read_again_cause,
            read_again: 0,
            round: self.reloads_begun,
        });
    }

    /// "Read /v1/feed again": a running reload reads another pass; else one begins under the
    /// held generation, taking the pages' access_version.
    fn read_again(&mut self) {
        match &mut self.running {
            Some(r) => r.read_again += 1,
            None => self.begin(self.generation.unwrap_or(0), None, true),
        }
    }

    /// "Within a generation, apply an event only when its sequence is above what you hold of
    /// its subject ... or equal to it and the event a removal", "an event of a newer generation
    /// wins": the greater position, lexicographically, is written.
    fn write(&mut self, s: u32, position: (u64, u64, bool)) {
        if self.rows.get(&s).is_none_or(|row| position > row.position) {
            let round = self.reloads_begun;
            self.rows.insert(s, Row { position, round });
        }
    }

    fn message(&mut self, op: &Op) {
        match op {
            Op::Junk => {
                self.outcomes.push(Outcome::Quarantined);
                self.read_again();
            }
            Op::Test => self.outcomes.push(Outcome::Test),
            Op::OtherTrack => self.outcomes.push(Outcome::IgnoredTrack),
            Op::Reset { generation, av } => {
                // "a reset is applied before anything sent after it, and a message applied ahead
                // of an earlier reset makes that reset read as older, so it is skipped".
                if self.generation.is_some_and(|held| *generation <= held) {
                    self.outcomes.push(Outcome::OlderGeneration);
                    return;
                }
                self.generation = Some(*generation);
                self.outcomes.push(if self.running.is_some() {
                    Outcome::ReloadSuperseded
                } else {
                    Outcome::ReloadBegun
                });
                self.begin(*generation, Some(format!("av{av}")), false);
            }
            Op::Events {
                generation: g,
                av,
                events,
            } => {
                // "Ignore a message of an older generation than the one held."
                if self.generation.is_some_and(|held| *g < held) {
                    self.outcomes.push(Outcome::OlderGeneration);
                    return;
                }
                self.generation = Some(self.generation.map_or(*g, |held| held.max(*g)));
                self.outcomes.push(Outcome::Applied);
                let ours = format!("av{av}");
                if self.access_version.as_deref() != Some(ours.as_str()) {
                    self.begin(*g, Some(ours), false);
                }
                for &ev in events {
                    // "De-duplicate events by id."
                    if !self.applied.insert(event_id(ev, *g, *av)) {
                        continue;
                    }
                    match ev {
                        Ev::Update(s, n) => self.write(s, (*g, n, false)),
                        Ev::Removal(s, n) => self.write(s, (*g, n, true)),
                        Ev::Refetch(s, n, answer) => {
                            // Read only when at least a removal at its position would win.
                            let wins = self.rows.get(&s).is_none_or(|row| {
                                let (hg, hn, _) = row.position;
                                *g > hg || (*g == hg && n >= hn)
                            });
                            if !wins {
                                continue;
                            }
                            match answer {
                                Answer::Found => self.write(s, (*g, n, false)),
                                Answer::Gone => self.write(s, (*g, n, true)),
                                Answer::OtherAccess | Answer::Failing => self.read_again(),
                            }
                        }
                    }
                }
            }
            Op::Again(_) | Op::Merge { .. } => unreachable!(),
        }
    }

    /// "Then merge the read into the copy under the reset's generation. For each item read,
    /// keep what the copy holds of its subject at that generation at the same sequence or a
    /// later one, or at a newer generation ... Otherwise store the item read. Then remove
    /// everything held from an older generation." And R-MERGE-SAME-GENERATION: an item held at
    /// the merge's generation from before the reload began, not read, becomes a tombstone.
    fn merge(&mut self, pass: &Pass, upstream: Option<u64>) {
        let r = self.running.clone().expect("a running reload");
        let g = if r.read_again_cause {
            r.generation.max(upstream.unwrap_or(0))
        } else {
            r.generation
        };
        let mut read: BTreeMap<u32, u64> = BTreeMap::new();
        for item in &pass.items {
            let s: u32 = item.subject["announcement:".len()..].parse().unwrap();
            let n = item.sequence.parts().unwrap().1;
            let e = read.entry(s).or_insert(n);
            *e = (*e).max(n);
        }
        let before = self.rows.clone();
        let round = self.reloads_begun;
        for (&s, &n) in &read {
            if before
                .get(&s)
                .is_none_or(|row| (g, n, false) > row.position)
            {
                self.rows.insert(
                    s,
                    Row {
                        position: (g, n, false),
                        round,
                    },
                );
            }
        }
        for (s, row) in &before {
            let (hg, hn, removal) = row.position;
            if hg < g && !read.contains_key(s) {
                self.rows.remove(s);
            } else if hg == g && row.round < r.round && !removal && !read.contains_key(s) {
                self.rows.insert(
                    *s,
                    Row {
                        position: (g, hn, true),
                        round,
                    },
                );
            }
        }
        self.generation = Some(self.generation.map_or(g, |held| held.max(g)));
        self.access_version = Some(pass.page_access_versions[0].clone());
        if r.read_again == pass.read_again_at_start {
            self.running = None;
            self.last_stopped = Some(r.round);
        }
    }

    /// Compares the endpoint with what the rules say it must be.
    fn check(&self, endpoint: &Endpoint) -> Result<(), TestCaseError> {
        let rows: BTreeMap<String, Held> = self
            .rows
            .iter()
            .map(|(&s, row)| {
                let (g, n, removal) = row.position;
                (subject(s), held_at(s, g, n, removal))
            })
            .collect();
        prop_assert_eq!(endpoint.copy.rows(), &rows);
        let rounds: BTreeMap<String, u64> = self
            .rows
            .iter()
            .map(|(&s, row)| (subject(s), row.round))
            .collect();
        prop_assert_eq!(&endpoint.rounds, &rounds);
        let track = &endpoint.track;
        prop_assert_eq!(track.generation, self.generation);
        prop_assert_eq!(&track.access_version, &self.access_version);
        prop_assert_eq!(track.reloads_begun, self.reloads_begun);
        let running = track.reload.as_ref().map(|r| {
            (
                r.generation,
                r.access_version.clone(),
                r.cause == ReloadCause::ReadAgain,
                r.read_again,
                r.round,
            )
        });
        let expected = self.running.as_ref().map(|r| {
            (
                r.generation,
                r.access_version.clone(),
                r.read_again_cause,
                r.read_again,
                r.round,
            )
        });
        prop_assert_eq!(running, expected);
        let applied: BTreeSet<String> = self.applied.iter().cloned().collect();
        prop_assert_eq!(&endpoint.applied, &applied);
        prop_assert_eq!(&endpoint.outcomes, &self.outcomes);
        // The outbox replayed onto an empty map is the copy's items.
        prop_assert_eq!(replay(&endpoint.changes), items(&endpoint.copy));
        Ok(())
    }
}

/// Plays `ops` one message per run, checking the endpoint against the [`Oracle`] after every
/// step.
fn check_against_oracle(ops: &[Op]) -> Result<(), TestCaseError> {
    let reads = refetch_reads(ops);
    let mut endpoint = Endpoint::new();
    let mut oracle = Oracle::default();
    let mut stopped: Option<Reload> = None;
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Merge {
                items,
                upstream,
                stale,
                stopped: old,
            } => {
                if *old {
                    if let Some(reload) = &stopped {
                        let before = endpoint.clone();
                        let p = pass("av0", vec![], *upstream, reload.read_again);
                        prop_assert_eq!(endpoint.merge(reload, &p), MergePlan::Superseded);
                        prop_assert_eq!(&endpoint, &before);
                    }
                    continue;
                }
                let Some((reload, p)) = pass_for(&endpoint, items, *upstream, *stale) else {
                    prop_assert!(oracle.running.is_none());
                    continue;
                };
                let plan = endpoint.merge(&reload, &p);
                let MergePlan::Merge(merge) = &plan else {
                    return Err(TestCaseError::fail(format!("not merged: {plan:?}")));
                };
                // "Then remove everything held from an older generation" spares what the pass
                // read: it is written at the merge's generation (the store deletes by generation
                // after the writes and holds its count to `dropped`).
                prop_assert!(
                    merge
                        .dropped
                        .iter()
                        .all(|(s, _)| p.items.iter().all(|item| item.subject != *s)),
                    "{:?}",
                    merge
                );
                oracle.merge(&p, *upstream);
                if endpoint.track.reload.is_none() {
                    stopped = Some(reload);
                }
            }
            op => {
                let before = endpoint.track.reload.clone();
                endpoint.run(&[stored_message(op, i + 1)], &reads);
                oracle.message(op);
                if let Some(old) = before {
                    if endpoint.track.reload.as_ref().is_none_or(|r| !r.is(&old)) {
                        stopped = Some(old);
                    }
                }
            }
        }
        oracle.check(&endpoint)?;
    }
    Ok(())
}

/// The same stream played one message per run, as one run between merges, and cut at random:
/// everything decided and the endpoint after must be the same.
fn check_runs_cut_any_way(ops: &[Op], cuts: &[bool]) -> Result<(), TestCaseError> {
    let (one_each, one_each_trace) = play(ops, |_| true);
    let (whole, whole_trace) = play(ops, |_| false);
    let (chunks, chunks_trace) = play(ops, |i| {
        cuts.get(i % cuts.len().max(1)).copied().unwrap_or(true)
    });
    prop_assert_eq!(&whole, &one_each);
    prop_assert_eq!(&whole_trace, &one_each_trace);
    prop_assert_eq!(&chunks, &one_each);
    prop_assert_eq!(&chunks_trace, &one_each_trace);
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    /// Rules "Store the message ... apply it afterwards", "Apply each endpoint's stored messages
    /// one at a time ... in the order you received them", "De-duplicate events by id", "Ignore
    /// a message of an older generation", "Handle every webhook_endpoint.reset the same way",
    /// "On a feed item's event", "... whose data is a refetch", "The copy is held under the
    /// access_version ...", "Then merge ..." and R-MERGE-SAME-GENERATION together: random
    /// streams of messages (duplicates, messages stored again, generations in any order,
    /// removals at equal sequences, refetches and their answers, resets, tests, other tracks,
    /// bodies that are not v1) and reload passes (overlapping the messages and the rows held
    /// from an older generation than the merge's, begun before a "read again", of a reload no
    /// longer running) end, after every step, in the copy, rounds, track, event ids and
    /// outcomes the oracle computes from the rule text; the outbox replayed is the copy's
    /// items; and no merge drops a subject its pass read.
    #[test]
    fn run_rules_random_streams_end_as_the_oracle_says(
        ops in prop::collection::vec(an_op(), 0..24).prop_map(resolve),
    ) {
        check_against_oracle(&ops)?;
    }

    /// `decide_run` decides a run of messages as the same messages one run each: the same
    /// messages decided as one run, one run each, or cut at random, give the same copy, rounds,
    /// track, event ids kept, outcomes and outbox, and the same event outcomes, changes, reloads
    /// and merge plans in the same order.
    #[test]
    fn run_rules_a_run_decides_the_same_however_the_messages_are_cut_into_runs(
        ops in prop::collection::vec(an_op(), 0..24).prop_map(resolve),
        cuts in prop::collection::vec(any::<bool>(), 1..6),
    ) {
        check_runs_cut_any_way(&ops, &cuts)?;
    }

    /// Rule "Then merge ... Merged this way, the copy ends the same whatever order the pages and
    /// the messages came in", through whole runs: rows of generation 2, a reset of generation 3,
    /// then messages of generation 3 (repeats and removals at equal sequences among them) in
    /// any order, cut into runs anyhow, the pass (overlapping them and the rows of generation 2)
    /// merged anywhere among them: the same copy and the same items in the outbox as all
    /// messages first, then the merge; and that copy is the formula (the read an update at
    /// (3, its sequence)).
    #[test]
    fn merge_rule_reset_reload_messages_in_any_order_and_runs_merge_anywhere_same_copy(
        before in prop::collection::vec((0u32..4, 1u64..=6, any::<bool>()), 0..6),
        read in prop::collection::vec((0u32..4, 1u64..=6), 0..5),
        (during, shuffled) in prop::collection::vec((0u32..4, 1u64..=6, any::<bool>()), 0..10)
            .prop_flat_map(|k| (Just(k.clone()), Just(k).prop_shuffle())),
        at in any::<Index>(),
        cuts in prop::collection::vec(any::<bool>(), 1..4),
    ) {
        check_reset_merge_anywhere(&before, &read, &during, &shuffled, at, &cuts)?;
    }

    /// Rule R-MERGE-SAME-GENERATION: a reload under the generation the copy already holds (one
    /// a body that is not v1 began, or a message under another access_version) keeps no item
    /// its pass lacks unless a message wrote it during the read: an item held from before the
    /// reload, not read and not written since, ends a tombstone at its own position. The copy
    /// after the merge is, per subject, the greatest position among what was held, what the
    /// messages during the read wrote and what was read, except for those withdrawn.
    #[test]
    fn merge_same_generation_rule_keeps_no_item_the_pass_lacks_unless_written_during_the_read(
        before in prop::collection::vec((0u32..5, 1u64..=6, any::<bool>()), 0..8),
        by_access_version in any::<bool>(),
        during in prop::collection::vec((0u32..5, 1u64..=6, any::<bool>()), 0..5),
        read in prop::collection::vec((0u32..5, 1u64..=6), 0..5),
        upstream in prop::option::of(1u64..=3),
    ) {
        const G: u64 = 3;
        let mut endpoint = Endpoint { track: track_at(G, "av0"), ..Default::default() };
        let events = |keys: &[(u32, u64, bool)]| -> Vec<serde_json::Value> {
            keys.iter().map(|&(s, n, r)| feed_event_json(s, G, n, r)).collect()
        };
        run(&mut endpoint, &[message(G, "av0", "1.2", events(&before))]);
        prop_assert!(endpoint.track.reload.is_none());
        // The reload, under the held generation.
        let av = if by_access_version {
            run(&mut endpoint, &[message(G, "av1", "1.3", vec![])]);
            "av1"
        } else {
            endpoint.run(&[Err("not json".into())], &HashMap::new());
            "av0"
        };
        let reload = endpoint.track.reload.clone().expect("a reload runs");
        prop_assert_eq!(reload.merge_generation(upstream), G);
        // While the pass is read.
        run(&mut endpoint, &[message(G, av, "1.4", events(&during))]);
        let read_items: Vec<ReadItem> = read.iter().map(|&(s, n)| read_item(s, n)).collect();
        let merge = merged(endpoint.merge(&reload, &pass(av, read_items, upstream, 0)));
        prop_assert_eq!(merge.generation, G);
        prop_assert!(merge.dropped.is_empty());

        // The oracle, per subject: the greatest position of each source.
        let best = |keys: &mut dyn Iterator<Item = (u32, (u64, u64, bool))>| {
            let mut best: BTreeMap<u32, (u64, u64, bool)> = BTreeMap::new();
            for (s, p) in keys {
                let e = best.entry(s).or_insert(p);
                *e = (*e).max(p);
            }
            best
        };
        let b = best(&mut before.iter().map(|&(s, n, r)| (s, (G, n, r))));
        let d = best(&mut during.iter().map(|&(s, n, r)| (s, (G, n, r))));
        let r = best(&mut read.iter().map(|&(s, n)| (s, (G, n, false))));
        let all: BTreeSet<u32> = b.keys().chain(d.keys()).chain(r.keys()).copied().collect();
        let mut expected = BTreeMap::new();
        for s in all {
            let written_during = d.get(&s).is_some_and(|dp| b.get(&s).is_none_or(|bp| dp > bp));
            let (g, n, removal) = match b.get(&s) {
                Some(&(g, n, false)) if !r.contains_key(&s) && !written_during => (g, n, true),
                _ => [b.get(&s), d.get(&s), r.get(&s)].into_iter().flatten().max().copied().unwrap(),
            };
            expected.insert(subject(s), held_at(s, g, n, removal));
            // The rule itself: no item the pass lacks, unless a message wrote it meanwhile.
            if !removal {
                prop_assert!(r.contains_key(&s) || written_during, "subject {} kept", s);
            }
        }
        prop_assert_eq!(endpoint.copy.rows(), &expected);
        prop_assert_eq!(replay(&endpoint.changes), items(&endpoint.copy));
        prop_assert_eq!(endpoint.track.reload, None);
        prop_assert_eq!(endpoint.track.access_version.as_deref(), Some(av));
    }
}

fn check_reset_merge_anywhere(
    before: &[(u32, u64, bool)],
    read: &[(u32, u64)],
    during: &[(u32, u64, bool)],
    shuffled: &[(u32, u64, bool)],
    at: Index,
    cuts: &[bool],
) -> Result<(), TestCaseError> {
    const G: u64 = 3;
    let mut old = Endpoint {
        track: track_at(2, "av"),
        ..Default::default()
    };
    let events = before
        .iter()
        .map(|&(s, n, r)| feed_event_json(s, 2, n, r))
        .collect();
    run(&mut old, &[message(2, "av", "1.2", events)]);
    run(&mut old, &[reset(G, "av", "behind")]);
    let reload = old.track.reload.clone().unwrap();
    let read: Vec<ReadItem> = read.iter().map(|&(s, n)| read_item(s, n)).collect();
    let the_pass = pass("av", read.clone(), Some(G), 0);
    let one = |k: &(u32, u64, bool)| {
        Ok(message(
            G,
            "av",
            "1.9",
            vec![feed_event_json(k.0, G, k.1, k.2)],
        ))
    };
    // Canonical: every message in the order drawn, one run each, then the merge.
    let mut canonical = old.clone();
    for k in during {
        canonical.run(&[one(k)], &HashMap::new());
    }
    merged(canonical.merge(&reload, &the_pass));
    // Shuffled, cut into runs, the merge between two runs.
    let split = at.index(shuffled.len() + 1);
    let mut any = old.clone();
    let runs_of = |keys: &[(u32, u64, bool)]| {
        let mut runs: Vec<Vec<StoredMessage>> = vec![vec![]];
        for (i, k) in keys.iter().enumerate() {
            runs.last_mut().unwrap().push(one(k));
            if cuts[i % cuts.len()] {
                runs.push(vec![]);
            }
        }
        runs
    };
    for r in runs_of(&shuffled[..split]) {
        any.run(&r, &HashMap::new());
    }
    merged(any.merge(&reload, &the_pass));
    for r in runs_of(&shuffled[split..]) {
        any.run(&r, &HashMap::new());
    }
    prop_assert_eq!(&any.copy, &canonical.copy);
    prop_assert_eq!(replay(&any.changes), items(&any.copy));
    prop_assert_eq!(replay(&canonical.changes), items(&canonical.copy));
    let mut keys: Vec<Key> = during.iter().map(|&(s, n, r)| (s, G, n, r)).collect();
    keys.extend(read.iter().map(|r| {
        let s: u32 = r.subject["announcement:".len()..].parse().unwrap();
        (s, G, r.sequence.parts().unwrap().1, false)
    }));
    prop_assert_eq!(canonical.copy.rows(), &expected(&keys));
    Ok(())
}
