//! The copy's statements (relay-store's `runs::open_runs` / `runs::write_runs` around
//! relay-rules' `decide_run`, and `copy::merge`) against the in-memory executor of the same plans
//! (`relay_rules::Endpoint`), on the same random streams, and each guarantee the conditional
//! writes exist for, against a real Postgres.
//!
//! The property tests play a random stream of one endpoint's stored messages, cut into runs at
//! random points, with reload passes merged among them, once through [`CopyWriter`] (the
//! production statements) and once through the model, and after every run and every merge find
//! equal: the plans decided; every copy row (generation, sequence, tombstone or item, and its
//! reload round); the outbox (numbered 1..=n, each change's operation, subject, item, position,
//! cause and parts diff; replayed in order it rebuilds the copy's items); the track row; the
//! event ids applied; each message's outcome and counts, and the messages set aside.
//!
//! Cases: `PROPTEST_CASES` when set, else [`DEFAULT_CASES`] per property; each case is a fresh
//! endpoint in the one database of its test. A failing case is shrunk and printed by proptest
//! (its seed saved in `copy.proptest-regressions` beside this file and replayed first next time;
//! `PROPTEST_RNG_SEED` fixes the seed of a whole run).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use relay_rules::{
    decide_run, Decision, Endpoint, EndpointTrack, EventOutcome, Held, HeldContent, IgnoreReason,
    MergePlan, MessagePlan, ModelChange, Outcome, PartsDiff, Pass, ReadItem, RefetchAnswer,
    RefetchRead, Reload, ReloadStart, Run, RunPlan, StoredMessage, REFETCH_ATTEMPTS,
};
use relay_store::copy::{self, Merged};
use relay_store::runs::{self, OpenedRun, RunClaim, RunWrite, RunWritten};
use relay_store::tracks::{self, TrackClaim};
use relay_tests::readback::Operation;
use relay_tests::{rows_of, TestDb};
use relay_wire::{FeedItem, Message, Sequence};
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use crate::stack::CopyWriter;

/// Cases per property when `PROPTEST_CASES` is not set.
const DEFAULT_CASES: u32 = 24;

// ---- Messages shaped like the wire file's, parsed by relay_wire ----

/// Even subjects are announcements, odd ones pre-earnings analyses.
fn kind(s: u32) -> &'static str {
    if s.is_multiple_of(2) {
        "announcement"
    } else {
        "pre_earnings_analysis"
    }
}

fn subject(s: u32) -> String {
    format!("{}:{s}", kind(s))
}

fn seq(n: u64) -> Sequence {
    Sequence::from_parts(1, n)
}

/// The item at (subject, sequence): a function of (subject, sequence / 2), so that some different
/// positions carry an identical item (the rules then decide `Unchanged`) and one position never
/// carries two different items. Parts come and go and change version; text that is not ASCII,
/// quotes, a float and (for announcements) a company are kept exactly.
fn item_json(s: u32, n: u64) -> Value {
    let v = (n / 2) as i64;
    let mut parts = vec![
        json!({"kind": "flash", "part_id": "flash:1", "part_version": v}),
        json!({"kind": "story", "part_id": format!("story:{}", 7100 + s), "part_version": 1}),
    ];
    if v % 2 == 0 {
        parts.pop();
    }
    let mut item = json!({"type": "item", "feed_item_id": subject(s), "item_kind": kind(s),
        "seq": n / 2, "first_seq": 1, "op": "changed", "changes": [], "parts": parts,
        "lang": "sv", "head": {"title": format!("Größe {s} v{v} \"✓\" \\ ok")},
        "score": v as f64 / 4.0});
    if s.is_multiple_of(2) {
        item["company"] = json!({"company_id": 28 + i64::from(s), "name": "Alfa Group AB"});
    }
    item
}

fn feed_item(s: u32, n: u64) -> FeedItem {
    FeedItem::from_value(item_json(s, n), "item").unwrap()
}

fn read_item(s: u32, n: u64) -> ReadItem {
    ReadItem {
        subject: subject(s),
        sequence: seq(n),
        item: feed_item(s, n),
    }
}

fn update_json(id: &str, s: u32, n: u64) -> Value {
    json!({"id": id, "type": format!("{}.updated", kind(s)), "subject": subject(s),
           "sequence": seq(n).as_str(), "specversion": "1.0", "data": item_json(s, n)})
}

fn removal_json(id: &str, action: &str, s: u32, n: u64) -> Value {
    json!({"id": id, "type": format!("{}.{action}", kind(s)), "subject": subject(s),
           "sequence": seq(n).as_str(), "specversion": "1.0",
           "data": {"type": action, "feed_item_id": subject(s), "seq": n}})
}

fn refetch_json(id: &str, s: u32, n: u64) -> Value {
    json!({"id": id, "type": format!("{}.updated", kind(s)), "subject": subject(s),
           "sequence": seq(n).as_str(), "specversion": "1.0",
           "data": {"type": "refetch", "op": "changed", "feed_item_id": subject(s), "seq": n}})
}

fn parse(body: &Value) -> StoredMessage {
    Message::parse(body.to_string().as_bytes()).map_err(|e| e.to_string())
}

/// A feed message of `generation` (none: `None`) under `av`, holding `events`.
fn feed_message(
    endpoint: Uuid,
    generation: Option<u64>,
    av: &str,
    through: usize,
    events: Vec<Value>,
) -> StoredMessage {
    let mut body = json!({"v": 1, "webhook_endpoint_id": endpoint, "track": "feed",
        "access_version": av, "since": "1.0", "through": format!("1.{through}"),
        "complete": true, "events": events});
    if let Some(g) = generation {
        body["generation"] = json!(g);
    }
    parse(&body)
}

fn reset_message(endpoint: Uuid, generation: u64, av: &str) -> StoredMessage {
    parse(
        &json!({"v": 1, "webhook_endpoint_id": endpoint, "track": "feed",
        "generation": generation, "access_version": av,
        "events": [{"id": format!("evt_reset_{generation}_{av}"), "type": "webhook_endpoint.reset",
                    "specversion": "1.0",
                    "data": {"access_version": av, "generation": generation, "reason": "behind",
                             "resume_from": "1.1", "track": "feed"}}]}),
    )
}

// ---- Random streams ----

/// How a refetch's read answers (the reads are made before the run, as the sequencer does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// The item, under the message's access_version (the copy's when the refetch is decided).
    Found,
    /// A 404 under the message's access_version.
    Gone,
    /// The item under another access_version: read /v1/feed again.
    OtherAccess,
    /// A load balancer's 404 on every read: read /v1/feed again.
    Failing,
    /// Not in the reads at all (taken as reads that kept failing).
    Unread,
}

/// One event of a message of events, at the message's generation.
#[derive(Debug, Clone, Copy)]
enum Ev {
    Update(u32, u64),
    /// `withdrawn` (true) or `hidden`.
    Removal(u32, u64, bool),
    /// An update and a removal at one sequence; the removal first when true.
    Both(u32, u64, bool),
    Refetch(u32, u64, Answer),
    /// A `webhook_endpoint.tested` event among feed events.
    Tested,
    /// A feed action version 1 does not name.
    Unknown,
}

/// A generation relative to the one the model holds before the op (none held: 1), or absolute.
#[derive(Debug, Clone, Copy)]
enum Gen {
    Held(i8),
    Abs(u64),
}

/// The pages of a pass.
#[derive(Debug, Clone, Copy)]
enum Pages {
    /// `n` pages under the reload's access_version (for a reload no message began: `av{k}`, or
    /// the copy's when `None`).
    Agree(usize, Option<u8>),
    /// Two pages under different access_versions.
    Disagree,
    /// Pages that agree on an access_version no message carried.
    Other,
    /// No page at all.
    None,
}

#[derive(Debug, Clone)]
enum Op {
    /// A message of events; `av` `None` is the access_version the model holds (`av0` if none).
    Events {
        generation: Gen,
        av: Option<u8>,
        events: Vec<Ev>,
    },
    Reset {
        generation: Gen,
        av: Option<u8>,
    },
    /// An earlier message of the stream stored again, the same body.
    Again(Index),
    /// A body that is not a v1 message (not JSON, or another version).
    Junk(bool),
    /// A feed message with no generation.
    NoGeneration,
    Test,
    OtherTrack,
    /// The run being gathered ends here.
    Cut,
    /// A pass of the running reload (or, `stopped`, of the last reload no longer running) merged.
    /// The pending run is applied first.
    Merge {
        pages: Pages,
        items: Vec<(u32, u64)>,
        /// The track's generation the endpoint read gives: relative to the held one, or absolute.
        upstream: Option<Gen>,
        /// The pass began before the latest "read /v1/feed again".
        stale: bool,
        stopped: bool,
    },
}

fn an_answer() -> impl Strategy<Value = Answer> {
    prop_oneof![
        3 => Just(Answer::Found),
        2 => Just(Answer::Gone),
        1 => Just(Answer::OtherAccess),
        1 => Just(Answer::Failing),
        1 => Just(Answer::Unread),
    ]
}

fn an_event() -> impl Strategy<Value = Ev> {
    prop_oneof![
        10 => (0u32..4, 1u64..=6).prop_map(|(s, n)| Ev::Update(s, n)),
        6 => (0u32..4, 1u64..=6, any::<bool>()).prop_map(|(s, n, w)| Ev::Removal(s, n, w)),
        3 => (0u32..4, 1u64..=6, any::<bool>()).prop_map(|(s, n, r)| Ev::Both(s, n, r)),
        3 => (0u32..4, 1u64..=6, an_answer()).prop_map(|(s, n, a)| Ev::Refetch(s, n, a)),
        1 => Just(Ev::Tested),
        1 => Just(Ev::Unknown),
    ]
}

/// Events, some of them twice in one message (the same id).
fn events() -> impl Strategy<Value = Vec<Ev>> {
    prop::collection::vec((an_event(), prop::bool::weighted(0.15)), 0..5).prop_map(|v| {
        v.into_iter()
            .flat_map(|(e, twice)| std::iter::repeat_n(e, 1 + usize::from(twice)))
            .collect()
    })
}

fn a_message_generation() -> impl Strategy<Value = Gen> {
    prop_oneof![
        8 => Just(Gen::Held(0)),
        2 => Just(Gen::Held(-1)),
        2 => Just(Gen::Held(1)),
        1 => (1u64..=4).prop_map(Gen::Abs),
    ]
}

fn a_reset_generation() -> impl Strategy<Value = Gen> {
    prop_oneof![
        4 => Just(Gen::Held(1)),
        1 => Just(Gen::Held(2)),
        1 => Just(Gen::Held(0)),
        1 => (1u64..=5).prop_map(Gen::Abs),
    ]
}

fn an_access_version() -> impl Strategy<Value = Option<u8>> {
    prop_oneof![6 => Just(None), 1 => (0u8..3).prop_map(Some)]
}

fn pages() -> impl Strategy<Value = Pages> {
    prop_oneof![
        8 => (1usize..=3, prop::option::of(0u8..3)).prop_map(|(n, av)| Pages::Agree(n, av)),
        1 => Just(Pages::Disagree),
        1 => Just(Pages::Other),
        1 => Just(Pages::None),
    ]
}

fn upstream() -> impl Strategy<Value = Option<Gen>> {
    prop_oneof![
        3 => Just(None),
        2 => Just(Some(Gen::Held(0))),
        1 => Just(Some(Gen::Held(1))),
        1 => (1u64..=6).prop_map(|g| Some(Gen::Abs(g))),
    ]
}

/// Items of a pass: subjects may repeat (a later page's read of a subject), and overlap what
/// messages wrote.
fn read() -> impl Strategy<Value = Vec<(u32, u64)>> {
    prop::collection::vec((0u32..4, 1u64..=6), 0..5)
}

fn a_merge(pages: impl Strategy<Value = Pages>) -> impl Strategy<Value = Op> {
    (
        pages,
        read(),
        upstream(),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(pages, items, upstream, stale, stopped)| Op::Merge {
            pages,
            items,
            upstream,
            stale,
            stopped,
        })
}

fn an_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (a_message_generation(), an_access_version(), events())
            .prop_map(|(generation, av, events)| Op::Events { generation, av, events }),
        2 => (a_reset_generation(), an_access_version())
            .prop_map(|(generation, av)| Op::Reset { generation, av }),
        2 => any::<Index>().prop_map(Op::Again),
        4 => Just(Op::Cut),
        1 => any::<bool>().prop_map(Op::Junk),
        1 => Just(Op::NoGeneration),
        1 => Just(Op::Test),
        1 => Just(Op::OtherTrack),
        5 => a_merge(pages()),
    ]
}

fn a_stream() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(an_op(), 0..40)
}

/// A stream that reloads under the generation it holds: a first message and its reload merged,
/// messages at that generation, then a reload begun at it (by a message under another
/// access_version, a body set aside, or a refetch that means "read /v1/feed again"), messages
/// while it reads, its pass merged, and a random tail.
fn a_same_generation_stream() -> impl Strategy<Value = Vec<Op>> {
    let begin = prop_oneof![
        3 => ((1u8..3), events()).prop_map(|(k, events)| vec![Op::Events {
            generation: Gen::Held(0),
            av: Some(k),
            events,
        }]),
        1 => any::<bool>().prop_map(|b| vec![Op::Junk(b)]),
        1 => Just(vec![Op::NoGeneration]),
        2 => (0u32..4, 1u64..=6, prop_oneof![Just(Answer::OtherAccess), Just(Answer::Failing)])
            .prop_map(|(s, n, a)| vec![Op::Events {
                generation: Gen::Held(0),
                av: None,
                events: vec![Ev::Refetch(s, n, a)],
            }]),
    ];
    let during = prop::collection::vec(
        prop_oneof![
            4 => events().prop_map(|events| Op::Events {
                generation: Gen::Held(0),
                av: None,
                events,
            }),
            1 => Just(Op::Cut),
            1 => any::<Index>().prop_map(Op::Again),
        ],
        0..5,
    );
    // The pass of the reload just begun: neither stale nor of a stopped reload.
    let merge = (
        prop_oneof![4 => (1usize..=2).prop_map(|n| Pages::Agree(n, None)), 1 => pages()],
        read(),
        upstream(),
    )
        .prop_map(|(pages, items, upstream)| Op::Merge {
            pages,
            items,
            upstream,
            stale: false,
            stopped: false,
        });
    (
        events(),
        read(),
        prop::collection::vec(events(), 0..3),
        begin,
        during,
        merge,
        prop::collection::vec(an_op(), 0..12),
    )
        .prop_map(|(first, first_read, before, begin, during, merge, tail)| {
            let mut ops = vec![
                Op::Events {
                    generation: Gen::Abs(1),
                    av: Some(0),
                    events: first,
                },
                Op::Merge {
                    pages: Pages::Agree(1, None),
                    items: first_read,
                    upstream: None,
                    stale: false,
                    stopped: false,
                },
            ];
            ops.extend(before.into_iter().map(|events| Op::Events {
                generation: Gen::Held(0),
                av: None,
                events,
            }));
            ops.push(Op::Cut);
            ops.extend(begin);
            ops.extend(during);
            ops.push(merge);
            ops.extend(tail);
            ops
        })
}

// ---- One stream played on both ----

/// A change as the outbox keeps it, every column the plans decide.
#[derive(Debug, Clone, PartialEq)]
struct ChangeRow {
    operation: Operation,
    subject: String,
    item_kind: Option<String>,
    item: Option<Value>,
    generation: u64,
    sequence: Option<Sequence>,
    event_id: Option<String>,
    reload_generation: Option<u64>,
    parts_diff: PartsDiff,
}

impl From<&relay_tests::readback::Change> for ChangeRow {
    fn from(c: &relay_tests::readback::Change) -> Self {
        Self {
            operation: c.operation,
            subject: c.subject.clone(),
            item_kind: c.item_kind.clone(),
            item: c.item.clone(),
            generation: c.generation,
            sequence: c.sequence.clone(),
            event_id: c.event_id.clone(),
            reload_generation: c.reload_generation,
            parts_diff: c.parts_diff.clone(),
        }
    }
}

/// The kind a subject names (every item here is of its subject's kind).
fn kind_of(subject: &str) -> Option<String> {
    subject.split_once(':').map(|(kind, _)| kind.to_owned())
}

fn removal_row(subject: &str, generation: u64, sequence: Option<Sequence>) -> ChangeRow {
    ChangeRow {
        operation: Operation::Remove,
        subject: subject.to_owned(),
        item_kind: kind_of(subject),
        item: None,
        generation,
        sequence,
        event_id: None,
        reload_generation: None,
        parts_diff: PartsDiff::default(),
    }
}

/// The outbox rows a run's plan appends.
fn run_changes(plan: &RunPlan) -> Vec<ChangeRow> {
    plan.changes
        .iter()
        .map(|c| match &c.decision {
            Decision::Store {
                subject,
                generation,
                sequence,
                item,
                diff,
            } => ChangeRow {
                operation: Operation::Upsert,
                subject: subject.clone(),
                item_kind: Some(item.item_kind.as_str().to_owned()),
                item: Some(item.raw.clone()),
                generation: *generation,
                sequence: Some(sequence.clone()),
                event_id: Some(c.event_id.clone()),
                reload_generation: None,
                parts_diff: diff.clone(),
            },
            Decision::Tombstone {
                subject,
                generation,
                sequence,
                ..
            } => ChangeRow {
                event_id: Some(c.event_id.clone()),
                ..removal_row(subject, *generation, Some(sequence.clone()))
            },
            other => panic!("a planned change that is not one: {other:?}"),
        })
        .collect()
}

/// The outbox rows a merge appends: its stores, then its drops of items, then its withdrawals.
fn merge_changes(merge: &relay_rules::Merge) -> Vec<ChangeRow> {
    let g = merge.generation;
    let stores = merge.writes.iter().filter_map(|d| match d {
        Decision::Store {
            subject,
            sequence,
            item,
            diff,
            ..
        } => Some(ChangeRow {
            operation: Operation::Upsert,
            subject: subject.clone(),
            item_kind: Some(item.item_kind.as_str().to_owned()),
            item: Some(item.raw.clone()),
            generation: g,
            sequence: Some(sequence.clone()),
            event_id: None,
            reload_generation: Some(g),
            parts_diff: diff.clone(),
        }),
        _ => None,
    });
    let dropped = merge
        .dropped
        .iter()
        .filter(|(_, item)| *item)
        .map(|(subject, _)| ChangeRow {
            reload_generation: Some(g),
            ..removal_row(subject, g, None)
        });
    let withdrawn = merge.withdrawn.iter().map(|(subject, sequence)| ChangeRow {
        reload_generation: Some(g),
        ..removal_row(subject, g, Some(sequence.clone()))
    });
    stores.chain(dropped).chain(withdrawn).collect()
}

/// What the streams exercised, over all cases of a property (printed with `--nocapture`).
#[derive(Debug, Default)]
struct Seen {
    cases: u32,
    runs: u32,
    messages: u32,
    outcomes: BTreeMap<&'static str, u32>,
    events: BTreeMap<&'static str, u32>,
    merged: u32,
    merged_same_generation: u32,
    merged_newer_upstream: u32,
    /// A merge's writes: items stored, items only raised (`Unchanged`).
    merge_stores: u32,
    merge_raises: u32,
    read_again: u32,
    superseded: u32,
    rows_dropped: u32,
    items_withdrawn: u32,
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} cases passed, {} runs of {} messages; merges: {} merged ({} under the held generation, \
             {} under a newer upstream one; {} items stored, {} raised), {} read again, {} \
             superseded; {} rows dropped, {} items withdrawn",
            self.cases,
            self.runs,
            self.messages,
            self.merged,
            self.merged_same_generation,
            self.merged_newer_upstream,
            self.merge_stores,
            self.merge_raises,
            self.read_again,
            self.superseded,
            self.rows_dropped,
            self.items_withdrawn
        )?;
        writeln!(f, "  outcomes: {:?}", self.outcomes)?;
        write!(f, "  events: {:?}", self.events)
    }
}

/// One endpoint's stream, played on the model and through the production statements.
struct Case<'a> {
    pool: &'a PgPool,
    writer: CopyWriter,
    model: Endpoint,
    /// The run being gathered.
    pending: Vec<StoredMessage>,
    /// Every message stored so far, for `Op::Again`.
    sent: Vec<StoredMessage>,
    /// Every refetch read, by event id (one id names one answer).
    reads: HashMap<String, RefetchRead>,
    /// The last reload that stopped running (superseded or merged).
    stopped: Option<Reload>,
    /// The outbox as the plans say it must be.
    changes: Vec<ChangeRow>,
    /// Each message's plan, in arrival order.
    notes: Vec<MessagePlan>,
    seen: &'a RefCell<Seen>,
}

impl Case<'_> {
    fn endpoint(&self) -> Uuid {
        self.writer.claim.endpoint.0
    }

    fn generation(&self, g: Gen) -> u64 {
        let held = self.model.track.generation.unwrap_or(1);
        match g {
            Gen::Held(delta) => held.saturating_add_signed(i64::from(delta)).max(1),
            Gen::Abs(g) => g,
        }
    }

    fn access_version(&self, av: Option<u8>) -> String {
        match av {
            Some(k) => format!("av{k}"),
            None => self
                .model
                .track
                .access_version
                .clone()
                .unwrap_or_else(|| "av0".into()),
        }
    }

    /// The stored message of op `i` (not a cut or a merge), rendered against the model as it is
    /// before the pending run.
    fn render(&mut self, i: usize, op: &Op) -> Option<StoredMessage> {
        let endpoint = self.endpoint();
        Some(match op {
            Op::Events {
                generation,
                av,
                events,
            } => {
                let g = self.generation(*generation);
                let av = self.access_version(*av);
                let events = events
                    .iter()
                    .enumerate()
                    .flat_map(|(k, ev)| self.event_json(i, k, g, &av, *ev))
                    .collect();
                feed_message(endpoint, Some(g), &av, i, events)
            }
            Op::Reset { generation, av } => {
                let g = self.generation(*generation);
                reset_message(endpoint, g, &self.access_version(*av))
            }
            Op::Again(index) if !self.sent.is_empty() => {
                self.sent[index.index(self.sent.len())].clone()
            }
            Op::Again(_) => return None,
            Op::Junk(true) => Err(Message::parse(b"{\"v\": 1, \"events\": [")
                .unwrap_err()
                .to_string()),
            Op::Junk(false) => parse(&json!({"v": 2, "webhook_endpoint_id": endpoint,
                                             "events": []})),
            Op::NoGeneration => {
                let av = self.access_version(None);
                let update = update_json(&format!("u_nogen_{i}"), 0, 1);
                feed_message(endpoint, None, &av, i, vec![update])
            }
            Op::Test => parse(&json!({"v": 1, "webhook_endpoint_id": endpoint,
                "events": [{"id": format!("evt_test_{i}"), "type": "webhook_endpoint.tested",
                            "specversion": "1.0",
                            "data": {"test_send_id": "5f0e3c1a-7b2d-4e8f-9a6b-1c2d3e4f5a6b"}}]})),
            Op::OtherTrack => parse(&json!({"v": 1, "webhook_endpoint_id": endpoint,
                "track": "stories", "generation": 9, "access_version": "av0",
                "events": [update_json("u_stories", 0, 1)]})),
            Op::Cut | Op::Merge { .. } => return None,
        })
    }

    /// The JSON of event `k` of op `i`'s message of generation `g` under `av`. Ids name the
    /// change, so a change sent again (in another message too) is a duplicate; a refetch's id
    /// names its answer and access_version too, so one id never has two answers.
    fn event_json(&mut self, i: usize, k: usize, g: u64, av: &str, ev: Ev) -> Vec<Value> {
        let update = |s, n| update_json(&format!("u_{s}_{g}_{n}"), s, n);
        let removal = |s, n, withdrawn: bool| {
            let action = if withdrawn { "withdrawn" } else { "hidden" };
            removal_json(&format!("r_{s}_{g}_{n}_{action}"), action, s, n)
        };
        match ev {
            Ev::Update(s, n) => vec![update(s, n)],
            Ev::Removal(s, n, withdrawn) => vec![removal(s, n, withdrawn)],
            Ev::Both(s, n, removal_first) => {
                let mut both = vec![update(s, n), removal(s, n, k.is_multiple_of(2))];
                if removal_first {
                    both.reverse();
                }
                both
            }
            Ev::Refetch(s, n, answer) => {
                let id = format!("f_{s}_{g}_{n}_{answer:?}_{av}");
                let read = match answer {
                    Answer::Found => Some((
                        RefetchAnswer::Found {
                            access_version: av.to_owned(),
                            sequence: seq(n + 7),
                            item: feed_item(s, n),
                        },
                        1,
                    )),
                    Answer::Gone => Some((
                        RefetchAnswer::NotFound {
                            access_version: av.to_owned(),
                        },
                        1,
                    )),
                    Answer::OtherAccess => Some((
                        RefetchAnswer::Found {
                            access_version: "elsewhere".into(),
                            sequence: seq(n),
                            item: feed_item(s, n),
                        },
                        1,
                    )),
                    Answer::Failing => Some((RefetchAnswer::LoadBalancer404, REFETCH_ATTEMPTS)),
                    Answer::Unread => None,
                };
                if let Some((answer, attempts)) = read {
                    self.reads
                        .insert(id.clone(), RefetchRead { answer, attempts });
                }
                vec![refetch_json(&id, s, n)]
            }
            Ev::Tested => vec![json!({"id": format!("t_{i}_{k}"),
                "type": "webhook_endpoint.tested", "specversion": "1.0",
                "data": {"test_send_id": "5f0e3c1a-7b2d-4e8f-9a6b-1c2d3e4f5a6b"}})],
            Ev::Unknown => vec![json!({"id": format!("x_{i}_{k}"),
                "type": "announcement.pinned", "subject": subject(0),
                "sequence": seq(1).as_str(), "data": {"whatever": true}})],
        }
    }

    /// The pending messages as one run, on both; then both compared.
    async fn flush(&mut self, at: usize) -> Result<(), TestCaseError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let messages = std::mem::take(&mut self.pending);
        let expected = self.model.run(&messages, &self.reads);
        let written = self.writer.run(self.pool, &messages, &self.reads).await;
        prop_assert_eq!(
            &written,
            &expected,
            "the plans of the run ending at op {}",
            at
        );
        for start in &expected.reloads {
            if let ReloadStart::Supersede { stopped, .. } = start {
                self.stopped = Some(stopped.clone());
            }
        }
        self.changes.extend(run_changes(&expected));
        self.notes.extend(expected.messages.iter().cloned());
        {
            let mut seen = self.seen.borrow_mut();
            seen.runs += 1;
            seen.messages += messages.len() as u32;
            for m in &expected.messages {
                *seen.outcomes.entry(m.outcome.as_str()).or_default() += 1;
            }
            for e in &expected.events {
                *seen.events.entry(e.as_str()).or_default() += 1;
            }
        }
        self.compare(at).await
    }

    /// A pass merged on both (the pending run applied first); then both compared.
    async fn merge(&mut self, at: usize, op: &Op) -> Result<(), TestCaseError> {
        let Op::Merge {
            pages,
            items,
            upstream,
            stale,
            stopped,
        } = op
        else {
            unreachable!("not a merge");
        };
        self.flush(at).await?;
        let reload = if *stopped {
            self.stopped.clone()
        } else {
            self.model.track.reload.clone()
        };
        let Some(reload) = reload else {
            return Ok(());
        };
        let agreed = match (pages, &reload.access_version) {
            (_, Some(av)) => av.clone(),
            (Pages::Agree(_, Some(k)), None) => format!("av{k}"),
            (_, None) => self.access_version(None),
        };
        let page_access_versions = match pages {
            Pages::Agree(n, _) => vec![agreed; *n],
            Pages::Disagree => vec![agreed, "av8".into()],
            Pages::Other => vec!["av9".into(); 2],
            Pages::None => vec![],
        };
        let pass = Pass {
            page_access_versions,
            items: items.iter().map(|&(s, n)| read_item(s, n)).collect(),
            upstream_generation: upstream.map(|g| self.generation(g)),
            read_again_at_start: if *stale {
                reload.read_again.saturating_sub(1)
            } else {
                reload.read_again
            },
        };
        let held = self.model.track.generation;
        let expected = self.model.merge(&reload, &pass);
        // `CopyWriter::merge`'s statement, its error a failure of the case rather than a panic.
        let merged = match copy::merge(self.pool, self.writer.claim, &reload, &pass).await {
            Ok(merged) => merged,
            Err(e) => {
                return Err(TestCaseError::fail(format!(
                    "the merge of op {at} failed: {e}; the model's plan: {expected:?}"
                )))
            }
        };
        match &expected {
            MergePlan::Merge(merge) => {
                let removed =
                    merge.dropped.iter().filter(|(_, item)| *item).count() + merge.withdrawn.len();
                let counts = Merged::Merged {
                    written: merge.writes.len(),
                    removed,
                };
                prop_assert_eq!(&merged, &counts, "the merge of op {}", at);
                self.changes.extend(merge_changes(merge));
                if self.model.track.reload.is_none() {
                    self.stopped = Some(reload.clone());
                }
                let mut seen = self.seen.borrow_mut();
                seen.merged += 1;
                seen.merged_same_generation += u32::from(held == Some(merge.generation));
                seen.merged_newer_upstream += u32::from(held.is_some_and(|h| merge.generation > h));
                for write in &merge.writes {
                    match write {
                        Decision::Store { .. } => seen.merge_stores += 1,
                        _ => seen.merge_raises += 1,
                    }
                }
                seen.rows_dropped += merge.dropped.len() as u32;
                seen.items_withdrawn += merge.withdrawn.len() as u32;
            }
            other => {
                prop_assert_eq!(
                    &merged,
                    &Merged::NotMerged(other.clone()),
                    "the merge of op {}",
                    at
                );
                let mut seen = self.seen.borrow_mut();
                match other {
                    MergePlan::Superseded => seen.superseded += 1,
                    _ => seen.read_again += 1,
                }
            }
        }
        self.compare(at).await
    }

    /// Everything Postgres holds of the endpoint, against the model and the plans.
    async fn compare(&self, at: usize) -> Result<(), TestCaseError> {
        let (pool, endpoint) = (self.pool, self.endpoint());
        let rows = relay_tests::readback::copy_rows(pool, endpoint)
            .await
            .unwrap();
        prop_assert_eq!(
            &rows,
            self.model.copy.rows(),
            "the copy's rows after op {}",
            at
        );
        let rounds = rounds(pool, endpoint).await;
        prop_assert_eq!(
            &rounds,
            &self.model.rounds,
            "the rows' rounds after op {}",
            at
        );
        let facts = facts(pool, endpoint).await;
        let expected: BTreeMap<String, Facts> = self
            .model
            .copy
            .rows()
            .iter()
            .map(|(subject, held)| (subject.clone(), expected_facts(subject, held)))
            .collect();
        prop_assert_eq!(
            facts,
            expected,
            "the rows' kind and company after op {}",
            at
        );

        let changes = relay_tests::readback::list_changes(pool, endpoint)
            .await
            .unwrap();
        let numbers: Vec<i64> = changes.iter().map(|c| c.change_seq).collect();
        let gapless: Vec<i64> = (1..=changes.len() as i64).collect();
        prop_assert_eq!(numbers, gapless, "the outbox's numbers after op {}", at);
        let outbox: Vec<ModelChange> = changes.iter().map(model_change).collect();
        prop_assert_eq!(&outbox, &self.model.changes, "the outbox after op {}", at);
        let outbox: Vec<ChangeRow> = changes.iter().map(ChangeRow::from).collect();
        prop_assert_eq!(
            &outbox,
            &self.changes,
            "the outbox's columns after op {}",
            at
        );
        let replayed = replay(&changes)?;
        prop_assert_eq!(
            replayed,
            items(&rows),
            "the outbox replayed after op {}",
            at
        );

        let track = tracks::peek(pool, relay_store::EndpointId(endpoint))
            .await
            .unwrap();
        prop_assert_eq!(&track, &self.model.track, "the track after op {}", at);
        let applied = applied(pool, endpoint).await;
        prop_assert_eq!(
            &applied,
            &self.model.applied,
            "the ids applied after op {}",
            at
        );

        // A row for each exception only: the common outcome (applied, nothing ignored) is
        // said by the cursor passing the message.
        let notes: Vec<(i64, String, i32, i32)> = rows_of(
            pool,
            "SELECT arrival_seq, outcome, events_applied, events_ignored
             FROM message_applications WHERE endpoint_id = $1 ORDER BY arrival_seq",
            endpoint,
        )
        .await;
        let expected: Vec<(i64, String, i32, i32)> = self
            .notes
            .iter()
            .zip(&self.model.outcomes)
            .enumerate()
            .filter(|(_, (note, _))| note.is_exception())
            .map(|(i, (note, outcome))| {
                let (a, b) = (note.events_applied as i32, note.events_ignored as i32);
                (i as i64 + 1, outcome.as_str().to_owned(), a, b)
            })
            .collect();
        prop_assert_eq!(notes, expected, "the messages' outcomes after op {}", at);
        let set_aside: Vec<i64> = sqlx::query_scalar(
            "SELECT arrival_seq FROM quarantined_messages WHERE endpoint_id = $1
             ORDER BY arrival_seq",
        )
        .bind(endpoint)
        .fetch_all(pool)
        .await
        .unwrap();
        let expected: Vec<i64> = (1..)
            .zip(&self.model.outcomes)
            .filter(|(_, o)| **o == Outcome::Quarantined)
            .map(|(i, _)| i)
            .collect();
        prop_assert_eq!(
            set_aside,
            expected,
            "the messages set aside after op {}",
            at
        );
        Ok(())
    }
}

/// A row's `item_kind` and `company_id`: what the publisher filters by.
type Facts = (Option<String>, Option<i64>);

async fn facts(pool: &PgPool, endpoint: Uuid) -> BTreeMap<String, Facts> {
    let rows: Vec<(String, Option<String>, Option<i64>)> = rows_of(
        pool,
        "SELECT subject, item_kind, company_id FROM copy_items WHERE endpoint_id = $1",
        endpoint,
    )
    .await;
    rows.into_iter().map(|(s, k, c)| (s, (k, c))).collect()
}

/// An item's kind and company as its JSON says; a tombstone keeps its subject's kind only.
fn expected_facts(subject: &str, held: &Held) -> Facts {
    match &held.content {
        HeldContent::Item { item, .. } => (
            item["item_kind"].as_str().map(str::to_owned),
            item["company"]["company_id"].as_i64(),
        ),
        HeldContent::Tombstone => (kind_of(subject), None),
    }
}

/// Each row's reload round (`copy_items.round`), by subject.
async fn rounds(pool: &PgPool, endpoint: Uuid) -> BTreeMap<String, u64> {
    let rows: Vec<(String, i64)> = rows_of(
        pool,
        "SELECT subject, round FROM copy_items WHERE endpoint_id = $1",
        endpoint,
    )
    .await;
    rows.into_iter()
        .map(|(s, r)| (s, u64::try_from(r).unwrap()))
        .collect()
}

async fn applied(pool: &PgPool, endpoint: Uuid) -> BTreeSet<String> {
    sqlx::query_scalar("SELECT event_id FROM applied_events WHERE endpoint_id = $1")
        .bind(endpoint)
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

fn model_change(change: &relay_tests::readback::Change) -> ModelChange {
    match change.operation {
        Operation::Upsert => ModelChange::Upsert {
            subject: change.subject.clone(),
            item: change.item.clone().unwrap_or(Value::Null),
        },
        Operation::Remove => ModelChange::Remove {
            subject: change.subject.clone(),
        },
    }
}

/// The copy's items (tombstones left out), by subject.
fn items(rows: &BTreeMap<String, Held>) -> BTreeMap<String, Value> {
    rows.iter()
        .filter_map(|(s, h)| match &h.content {
            HeldContent::Item { item, .. } => Some((s.clone(), item.clone())),
            HeldContent::Tombstone => None,
        })
        .collect()
}

/// The outbox replayed in order onto an empty map, as a consumer holds it; every removal must
/// remove an item the replay holds.
fn replay(
    changes: &[relay_tests::readback::Change],
) -> Result<BTreeMap<String, Value>, TestCaseError> {
    let mut held = BTreeMap::new();
    for change in changes {
        match change.operation {
            Operation::Upsert => {
                let item = change.item.clone();
                prop_assert!(item.is_some(), "upsert {} has no item", change.change_seq);
                held.insert(change.subject.clone(), item.unwrap());
            }
            Operation::Remove => prop_assert!(
                held.remove(&change.subject).is_some(),
                "change {} removes {}, which the replay does not hold",
                change.change_seq,
                change.subject
            ),
        }
    }
    Ok(held)
}

async fn play(
    db: &TestDb,
    tenant: Uuid,
    ops: &[Op],
    seen: &RefCell<Seen>,
) -> Result<(), TestCaseError> {
    let writer = CopyWriter::new(db, tenant, Uuid::new_v4()).await;
    let mut case = Case {
        pool: &db.pool,
        writer,
        model: Endpoint::new(),
        pending: Vec::new(),
        sent: Vec::new(),
        reads: HashMap::new(),
        stopped: None,
        changes: Vec::new(),
        notes: Vec::new(),
        seen,
    };
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Cut => case.flush(i).await?,
            Op::Merge { .. } => case.merge(i, op).await?,
            _ => {
                if let Some(message) = case.render(i, op) {
                    case.pending.push(message.clone());
                    case.sent.push(message);
                }
            }
        }
    }
    case.flush(ops.len()).await?;
    seen.borrow_mut().cases += 1;
    Ok(())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// Runs `streams` through [`play`]: one database, one tenant, each case a fresh endpoint.
fn check_streams(name: &str, streams: impl Strategy<Value = Vec<Op>>) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let tenant = runtime.block_on(db.tenant());
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        source_file: Some(file!()),
        ..Config::default()
    });
    let seen = RefCell::new(Seen::default());
    let result = runner.run(&streams, |ops| {
        runtime.block_on(play(&db, tenant, &ops, &seen))
    });
    eprintln!("{name}: {}", seen.borrow());
    runtime.block_on(db.pool.close());
    drop(db);
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
}

/// Random streams of one endpoint's messages (updates, removals, a removal and an update at one
/// sequence, duplicates of events and of whole messages, generations older, held and newer,
/// resets, other access_versions, tests, other tracks, bodies set aside, refetches with their
/// reads), cut into runs anywhere, with passes of the running reload (pages agreeing or not, items
/// overlapping the messages', the upstream's generation sometimes newer; stale passes, and passes
/// of a reload no longer running) merged among them: Postgres holds what the model holds after
/// every run and merge.
#[test]
fn random_streams_write_what_the_model_writes() {
    check_streams("random_streams_write_what_the_model_writes", a_stream());
}

/// Rule R-MERGE-SAME-GENERATION through the production statements: streams that reload under
/// the generation the copy holds (begun by a message under another access_version at that
/// generation, by a body set aside, or by a refetch's answer), with messages written while the
/// pass is read: the rows withdrawn, kept and stored, their rounds and the outbox as the model's.
#[test]
fn reloads_under_the_held_generation_write_what_the_model_writes() {
    check_streams(
        "reloads_under_the_held_generation_write_what_the_model_writes",
        a_same_generation_stream(),
    );
}

// ---- One test per guarantee ----

fn messages(endpoint: Uuid, generation: u64, events: Vec<Value>) -> Vec<StoredMessage> {
    vec![feed_message(endpoint, Some(generation), "av0", 1, events)]
}

fn no_reads() -> HashMap<String, RefetchRead> {
    HashMap::new()
}

/// Opens `messages`' run in `conn` as the sequencer does: the endpoint held, its track, the
/// run's ids applied before and its rows read under that hold.
async fn open(
    conn: &mut sqlx::PgConnection,
    claim: TrackClaim,
    messages: &[StoredMessage],
) -> OpenedRun {
    let ids = relay_rules::event_ids(messages);
    let subjects = relay_rules::subjects(messages);
    let run = RunClaim {
        claim,
        event_ids: &ids,
        subjects: &subjects,
    };
    runs::open_runs(conn, &[run])
        .await
        .unwrap()
        .pop()
        .flatten()
        .expect("the fence is this writer's")
}

/// `messages` decided against `track` and `held`, with the ids `seen`.
fn decide(
    track: &EndpointTrack,
    messages: &[StoredMessage],
    seen: &HashSet<String>,
    held: BTreeMap<String, Held>,
) -> RunPlan {
    let reads = no_reads();
    let run = Run {
        track,
        messages,
        seen,
        refetches: &reads,
    };
    decide_run(run, held)
}

/// `plan` written by `runs::write_runs` (its cursor from where no run put it: not moved).
async fn write(conn: &mut sqlx::PgConnection, claim: TrackClaim, plan: &RunPlan) -> RunWritten {
    let seqs: Vec<i64> = (1..=plan.messages.len() as i64).map(|i| 1000 + i).collect();
    let write = RunWrite {
        endpoint: claim.endpoint,
        tenant: claim.tenant,
        plan,
        from: 1000,
        to: 1000 + seqs.len() as i64,
        arrival_seqs: &seqs,
        last_received_at: None,
    };
    runs::write_runs(conn, &[write])
        .await
        .unwrap()
        .into_iter()
        .next()
        .expect("one run written")
}

/// A plan decided from a view of the endpoint that is not what it holds now (`track`, or the
/// track as it is; and `held`), written by the production statements in a transaction that holds
/// the endpoint, then rolled back (a refusal means the run must be read again). Returns the plan
/// and what was written.
async fn write_stale(
    pool: &PgPool,
    claim: TrackClaim,
    messages: &[StoredMessage],
    track: Option<EndpointTrack>,
    held: BTreeMap<String, Held>,
) -> (RunPlan, RunWritten) {
    let mut tx = pool.begin().await.unwrap();
    let opened = open(&mut tx, claim, messages).await;
    let track = track.unwrap_or(opened.track);
    let plan = decide(&track, messages, &opened.seen, held);
    let written = write(&mut tx, claim, &plan).await;
    tx.rollback().await.unwrap();
    (plan, written)
}

fn held_item(s: u32, g: u64, n: u64) -> Held {
    let item = feed_item(s, n);
    Held {
        generation: g,
        sequence: seq(n),
        content: HeldContent::Item {
            parts: item.parts,
            item: item.raw,
        },
    }
}

async fn fresh() -> (TestDb, CopyWriter) {
    let db = TestDb::new().await;
    let tenant = db.tenant().await;
    let writer = CopyWriter::new(&db, tenant, Uuid::new_v4()).await;
    (db, writer)
}

fn operations(changes: &[relay_tests::readback::Change]) -> Vec<(Operation, String)> {
    changes
        .iter()
        .map(|c| (c.operation, c.subject.clone()))
        .collect()
}

/// Rule "On withdrawn and hidden, remove the item and keep a tombstone ... an older update
/// arriving after a removal would otherwise bring the item back".
#[tokio::test]
async fn an_older_update_after_a_removal_does_not_bring_the_item_back() {
    let (db, mut writer) = fresh().await;
    let endpoint = writer.claim.endpoint;
    let first = messages(
        endpoint.0,
        1,
        vec![update_json("u5", 0, 5), removal_json("r6", "hidden", 0, 6)],
    );
    let plan = writer.run(&db.pool, &first, &no_reads()).await;
    assert_eq!(plan.events, [EventOutcome::Stored, EventOutcome::Removed]);

    // Late: an update older than the removal, and one at the removal's own sequence.
    let late = messages(
        endpoint.0,
        1,
        vec![update_json("u4", 0, 4), update_json("u6", 0, 6)],
    );
    let plan = writer.run(&db.pool, &late, &no_reads()).await;
    let older = EventOutcome::Ignored(IgnoreReason::Older);
    assert_eq!(plan.events, [older, older]);
    assert!(plan.rows.is_empty() && plan.changes.is_empty());

    // And the same decided by a writer that saw nothing held: the statement itself refuses it.
    let again = messages(
        endpoint.0,
        1,
        vec![update_json("u4b", 0, 4), update_json("u6b", 0, 6)],
    );
    let (plan, written) = write_stale(&db.pool, writer.claim, &again, None, BTreeMap::new()).await;
    assert_eq!(plan.rows.len(), 1, "the stale plan stores the item");
    assert_eq!(plan.changes.len(), 2);
    assert_eq!(written.rows, 0, "the row was refused");
    assert_eq!(written.changes, 0, "no change for a refused row");

    let rows = relay_tests::readback::copy_rows(&db.pool, endpoint.0)
        .await
        .unwrap();
    let held = &rows[&subject(0)];
    assert!(held.is_tombstone());
    assert_eq!((held.generation, &held.sequence), (1, &seq(6)));
    let changes = relay_tests::readback::list_changes(&db.pool, endpoint.0)
        .await
        .unwrap();
    assert_eq!(
        operations(&changes),
        [
            (Operation::Upsert, subject(0)),
            (Operation::Remove, subject(0))
        ]
    );
}

/// A writer whose plan was decided from rows that changed since cannot write an older position:
/// each write's `where` refuses it, no change is appended, and `RunWritten::rows` falls short of
/// the plan (the caller then rolls back and reads the run again).
#[tokio::test]
async fn a_stale_caller_cannot_overwrite_a_newer_row() {
    let (db, mut writer) = fresh().await;
    let endpoint = writer.claim.endpoint;
    let s = subject(0);
    writer
        .run(
            &db.pool,
            &messages(endpoint.0, 2, vec![update_json("u5", 0, 5)]),
            &no_reads(),
        )
        .await;
    let seen_before = relay_tests::readback::copy_rows(&db.pool, endpoint.0)
        .await
        .unwrap();

    // Meanwhile another writer stores the item at 8.
    writer
        .run(
            &db.pool,
            &messages(endpoint.0, 2, vec![update_json("u8", 0, 8)]),
            &no_reads(),
        )
        .await;
    let newer = relay_tests::readback::copy_rows(&db.pool, endpoint.0)
        .await
        .unwrap();
    assert_eq!(newer[&s].sequence, seq(8));
    let changes_before = relay_tests::readback::list_changes(&db.pool, endpoint.0)
        .await
        .unwrap();

    // Plans decided from the rows as they were before that write (the item at 5), or from
    // nothing held, each a position the row at 8 wins over.
    let (stored, unchanged, removed) = (
        EventOutcome::Stored,
        EventOutcome::Unchanged,
        EventOutcome::Removed,
    );
    let stale = [
        // An update at 6 over the item at 5: a store.
        (
            "update",
            2,
            update_json("s6", 0, 6),
            seen_before.clone(),
            stored,
        ),
        // The item at 6 again at 7 (the same item): only its position raised.
        (
            "same item",
            2,
            update_json("s7", 0, 7),
            BTreeMap::from([(s.clone(), held_item(0, 2, 6))]),
            unchanged,
        ),
        // A removal at 7.
        (
            "removal",
            2,
            removal_json("s7r", "withdrawn", 0, 7),
            seen_before.clone(),
            removed,
        ),
        // An older generation's update and removal, decided by a writer whose track and rows
        // were read before the copy moved to generation 2.
        (
            "older update",
            1,
            update_json("g1u", 0, 99),
            BTreeMap::new(),
            stored,
        ),
        (
            "older removal",
            1,
            removal_json("g1r", "hidden", 0, 99),
            BTreeMap::new(),
            removed,
        ),
    ];
    // What a writer that read before the copy moved to generation 2 saw of the track.
    let generation_1 = EndpointTrack {
        generation: Some(1),
        access_version: Some("av0".into()),
        ..Default::default()
    };
    for (what, generation, event, held, outcome) in stale {
        let run = messages(endpoint.0, generation, vec![event]);
        let track = (generation == 1).then(|| generation_1.clone());
        let (plan, written) = write_stale(&db.pool, writer.claim, &run, track, held).await;
        assert_eq!(plan.events, [outcome], "{what}: the stale decision");
        assert_eq!(plan.rows.len(), 1, "{what}: the stale plan writes the row");
        assert_eq!(written.rows, 0, "{what}: refused");
        assert_eq!(written.changes, 0, "{what}: no change appended");
    }

    assert_eq!(
        relay_tests::readback::copy_rows(&db.pool, endpoint.0)
            .await
            .unwrap(),
        newer
    );
    let changes = relay_tests::readback::list_changes(&db.pool, endpoint.0)
        .await
        .unwrap();
    assert_eq!(
        changes, changes_before,
        "the refused writes appended no change"
    );
}

/// The interleaving the open statement documents: a run that opens while another writer holds
/// the endpoint waits for it, and its snapshot (taken before the wait) does not see the rows that
/// writer inserted; its plan stores over nothing, and the write refuses to go over the row.
#[tokio::test]
async fn a_run_that_waited_for_another_writer_cannot_overwrite_the_row_it_inserted() {
    let (db, writer) = fresh().await;
    let endpoint = writer.claim.endpoint;
    let claim = writer.claim;
    let update = |id: &str, n| messages(endpoint.0, 1, vec![update_json(id, 0, n)]);

    // The other writer: holds the endpoint, inserts the item at 8, not yet committed.
    let theirs = update("u8", 8);
    let mut other = db.pool.begin().await.unwrap();
    let opened = open(&mut other, claim, &theirs).await;
    let plan = decide(&opened.track, &theirs, &opened.seen, opened.held);
    let written = write(&mut other, claim, &plan).await;
    assert_eq!(written.rows, 1);

    // This run opens meanwhile and waits.
    let pool = db.pool.clone();
    let ours = update("u6", 6);
    let waiting = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let opened = open(&mut tx, claim, &ours).await;
        let plan = decide(&opened.track, &ours, &opened.seen, opened.held);
        let written = write(&mut tx, claim, &plan).await;
        tx.rollback().await.unwrap();
        (plan, written)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "the open waits for the other writer"
    );
    other.commit().await.unwrap();
    let (plan, written) = waiting.await.unwrap();
    assert_eq!(plan.events, [EventOutcome::Stored], "it saw nothing held");
    assert_eq!(written.rows, 0, "and its write was refused: {written:?}");
    assert_eq!(written.changes, 0);

    let rows = relay_tests::readback::copy_rows(&db.pool, endpoint.0)
        .await
        .unwrap();
    assert_eq!(rows[&subject(0)].sequence, seq(8));
    let changes = relay_tests::readback::list_changes(&db.pool, endpoint.0)
        .await
        .unwrap();
    assert_eq!(changes.len(), 1);
}

/// Every change appended in order, replayed onto an empty map, rebuilds the copy's items: through
/// updates, removals, a reset's reload (stores, an older generation's items and tombstones
/// dropped), and a reload under the held generation (an item the pass lacks withdrawn).
#[tokio::test]
async fn the_outbox_replayed_in_order_rebuilds_the_copys_items() {
    let (db, mut writer) = fresh().await;
    let endpoint = writer.claim.endpoint;
    let mut model = Endpoint::new();
    let pass = |av: &str, items: Vec<ReadItem>| Pass {
        page_access_versions: vec![av.to_owned()],
        items,
        upstream_generation: None,
        read_again_at_start: 0,
    };

    // Generation 1 under av0 (the first message begins the copy's reload), merged.
    let first = messages(
        endpoint.0,
        1,
        vec![
            update_json("a", 0, 2),
            update_json("b", 1, 2),
            update_json("c", 2, 3),
        ],
    );
    writer.run(&db.pool, &first, &no_reads()).await;
    model.run(&first, &no_reads());
    let reload = model.track.reload.clone().unwrap();
    let read = pass("av0", vec![read_item(3, 1)]);
    assert!(matches!(
        writer.merge(&db.pool, &reload, &read).await,
        Merged::Merged { .. }
    ));
    model.merge(&reload, &read);

    // Removals and updates.
    let more = messages(
        endpoint.0,
        1,
        vec![
            removal_json("d", "hidden", 1, 3),
            update_json("e", 2, 5),
            removal_json("f", "withdrawn", 3, 1),
        ],
    );
    writer.run(&db.pool, &more, &no_reads()).await;
    model.run(&more, &no_reads());

    // A message under another access_version at the held generation: a reload under it, whose
    // pass lacks subject 0 (withdrawn) and reads subject 2 again.
    let other = vec![feed_message(endpoint.0, Some(1), "av1", 2, vec![])];
    writer.run(&db.pool, &other, &no_reads()).await;
    model.run(&other, &no_reads());
    let reload = model.track.reload.clone().unwrap();
    let read = pass("av1", vec![read_item(2, 6)]);
    writer.merge(&db.pool, &reload, &read).await;
    let MergePlan::Merge(merge) = model.merge(&reload, &read) else {
        panic!("merged");
    };
    assert_eq!(merge.withdrawn, [(subject(0), seq(2))]);

    // A reset to generation 2: everything of generation 1 not read again is dropped.
    let reset = vec![reset_message(endpoint.0, 2, "av1")];
    writer.run(&db.pool, &reset, &no_reads()).await;
    model.run(&reset, &no_reads());
    let reload = model.track.reload.clone().unwrap();
    let read = pass("av1", vec![read_item(1, 4)]);
    writer.merge(&db.pool, &reload, &read).await;
    model.merge(&reload, &read);

    let rows = relay_tests::readback::copy_rows(&db.pool, endpoint.0)
        .await
        .unwrap();
    assert_eq!(&rows, model.copy.rows());
    let changes = relay_tests::readback::list_changes(&db.pool, endpoint.0)
        .await
        .unwrap();
    let numbers: Vec<i64> = changes.iter().map(|c| c.change_seq).collect();
    assert_eq!(numbers, (1..=changes.len() as i64).collect::<Vec<_>>());
    let outbox: Vec<ModelChange> = changes.iter().map(model_change).collect();
    assert_eq!(outbox, model.changes);
    let replayed = replay(&changes).unwrap();
    assert_eq!(replayed, items(&rows));
    assert_eq!(
        replayed.keys().cloned().collect::<Vec<_>>(),
        [subject(1)],
        "only the item the reset's pass read is left"
    );
    let removals = changes
        .iter()
        .filter(|c| c.operation == Operation::Remove)
        .count();
    assert_eq!(
        removals, 4,
        "hidden, withdrawn, dropped by the reset's merge"
    );
}

/// Rule "Then merge the read into the copy": a pass that reads the item the copy holds, at a
/// position that wins (a later sequence of the reload's generation, or a newer generation), raises
/// the row's position and sends nothing (`Decision::Unchanged`), so that a late update of the
/// older position cannot win over it. Both reloads here: one under the generation held, one a
/// reset's under a newer generation.
///
/// Found by the properties above: `copy::merge` writes such a raise as a row with no item and
/// not a tombstone; Postgres checks `copy_items`' `CHECK (tombstone = (item IS NULL))` on the row
/// proposed for insertion before `ON CONFLICT` takes the existing row, so the whole merge fails.
#[tokio::test]
async fn a_merge_that_reads_the_held_item_again_raises_its_position_only() {
    let mut outcomes = Vec::new();
    for reset in [false, true] {
        let (db, mut writer) = fresh().await;
        let endpoint = writer.claim.endpoint;
        let mut model = Endpoint::new();
        // The item at 4 (the message begins the copy's first reload, under generation 1).
        let first = messages(endpoint.0, 1, vec![update_json("u4", 0, 4)]);
        writer.run(&db.pool, &first, &no_reads()).await;
        model.run(&first, &no_reads());
        if reset {
            let first_pass = Pass {
                page_access_versions: vec!["av0".into()],
                items: vec![read_item(0, 4)],
                upstream_generation: None,
                read_again_at_start: 0,
            };
            let reload = model.track.reload.clone().unwrap();
            writer.merge(&db.pool, &reload, &first_pass).await;
            model.merge(&reload, &first_pass);
            let reset = vec![reset_message(endpoint.0, 2, "av0")];
            writer.run(&db.pool, &reset, &no_reads()).await;
            model.run(&reset, &no_reads());
        }
        // The pass reads the same item (the same JSON and parts) at 5.
        let reload = model.track.reload.clone().unwrap();
        let pass = Pass {
            page_access_versions: vec!["av0".into()],
            items: vec![read_item(0, 5)],
            upstream_generation: None,
            read_again_at_start: 0,
        };
        let MergePlan::Merge(plan) = model.merge(&reload, &pass) else {
            panic!("the pass merges");
        };
        assert!(
            matches!(plan.writes[..], [Decision::Unchanged { .. }]),
            "{:?}",
            plan.writes
        );
        let merged = relay_store::copy::merge(&db.pool, writer.claim, &reload, &pass).await;
        let rows = relay_tests::readback::copy_rows(&db.pool, endpoint.0)
            .await
            .unwrap();
        outcomes.push((
            reset,
            merged.map_err(|e| e.to_string()),
            &rows == model.copy.rows(),
        ));
    }
    let merged = Ok(Merged::Merged {
        written: 1,
        removed: 0,
    });
    assert_eq!(
        outcomes,
        [(false, merged.clone(), true), (true, merged, true)],
        "(under a reset's generation, what merged, the copy as the model's)"
    );
}

/// Rule "De-duplicate events by id, for each endpoint": a run that repeats an applied event (and
/// a whole message) applies nothing again; another endpoint applies the same id once too.
#[tokio::test]
async fn a_duplicate_event_id_is_recorded_once() {
    let (db, mut writer) = fresh().await;
    let endpoint = writer.claim.endpoint;
    let message = messages(
        endpoint.0,
        1,
        vec![update_json("evt_2qyd41b3mqbv451ksq45hkm6tf", 0, 3)],
    );
    let first = writer.run(&db.pool, &message, &no_reads()).await;
    assert_eq!(first.events, [EventOutcome::Stored]);
    let twice = [message.clone(), message.clone()].concat();
    let again = writer.run(&db.pool, &twice, &no_reads()).await;
    let duplicate = EventOutcome::Ignored(IgnoreReason::Duplicate);
    assert_eq!(again.events, [duplicate, duplicate]);
    assert!(again.keep.is_empty() && again.changes.is_empty());

    let tenant = writer.claim.tenant;
    let mut elsewhere = CopyWriter::new(&db, tenant.0, Uuid::new_v4()).await;
    let there = elsewhere.run(&db.pool, &message, &no_reads()).await;
    assert_eq!(there.events, [EventOutcome::Stored]);

    let rows: Vec<(relay_store::EndpointId, String)> =
        sqlx::query_as("SELECT endpoint_id, event_id FROM applied_events ORDER BY endpoint_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let mut expected = vec![
        (endpoint, "evt_2qyd41b3mqbv451ksq45hkm6tf".to_owned()),
        (
            elsewhere.claim.endpoint,
            "evt_2qyd41b3mqbv451ksq45hkm6tf".to_owned(),
        ),
    ];
    expected.sort();
    assert_eq!(rows, expected);
}

/// Applied event ids past their retention are deleted in batches; the recent ones stay, so a
/// redelivery inside the retention is still recognised.
#[tokio::test]
async fn applied_event_ids_past_their_retention_are_forgotten_in_batches() {
    let (db, writer) = fresh().await;
    let (tenant, endpoint) = (writer.claim.tenant, writer.claim.endpoint);
    let retention = Duration::from_secs(31 * 24 * 3600);
    for (id, age_days) in [
        ("old-1", 40),
        ("old-2", 32),
        ("old-3", 365),
        ("new-1", 30),
        ("new-2", 0),
    ] {
        sqlx::query(
            "INSERT INTO applied_events (endpoint_id, event_id, tenant_id, applied_at)
             VALUES ($1, $2, $3, now() - make_interval(days => $4))",
        )
        .bind(endpoint)
        .bind(id)
        .bind(tenant)
        .bind(age_days)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let mut batches = Vec::new();
    loop {
        let deleted = copy::forget_applied_events(&db.pool, retention, 2)
            .await
            .unwrap();
        batches.push(deleted);
        if deleted < 2 {
            break;
        }
    }
    assert_eq!(batches, vec![2, 1]);
    assert_eq!(
        applied(&db.pool, endpoint.0).await,
        BTreeSet::from(["new-1".to_owned(), "new-2".to_owned()])
    );
    // What is still remembered is still a duplicate.
    let remembered = copy::applied_among(&db.pool, endpoint, &["new-1", "old-1"])
        .await
        .unwrap();
    assert_eq!(
        remembered,
        std::collections::HashSet::from(["new-1".to_owned()])
    );
}
