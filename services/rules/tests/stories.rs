//! The stories source (seed 000, "Keeping a copy in sync"): a test named after each failure the
//! seed lists, its merge chains and notifications, the fetch-on-notify reads, and property tests
//! over orderings through [`relay_rules::decide_stories_run`] and its in-memory executor
//! [`relay_rules::StoriesCopy`].
//!
//! The conditions under which order does not matter, exactly as tested here:
//!
//! - The upstream's timeline is consistent: a story's version rises by one with every change
//!   (a merge into it is a change), one version names one snapshot, a story closes once at a
//!   version above all its snapshots', and a closed story never opens again. Events are
//!   delivered any number of times (at least once) in any order.
//! - Snapshot mode: every arrival order, cut into runs of any lengths, ends in the same rows as
//!   publication order, except for the ticker of a closed row: the seed's close statement
//!   inserts a fresh row with a null ticker and leaves an existing row's ticker as it was, so a
//!   closed row keeps the ticker of the last snapshot saved before the close arrived, and none
//!   when the close came first (`a_closed_rows_ticker_is_what_the_seeds_close_statement_left`).
//! - Fetch-on-notify: every story ends as the API's last state of it (open at its last version
//!   and snapshot, or closed), whatever the order and however stale each read, as long as no
//!   read is older than the events of its own run (which it was made for). A closed row's
//!   version is then the greatest the copy saw, not the closing version (a 404 closes at 0).
//! - Either way, replaying the changes the plans made, in order, onto an empty copy gives the
//!   executor's rows exactly, tickers included; and each notification is claimed once.
//!
//! The number of cases is each block's default unless `PROPTEST_CASES` is set.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use common::{config, snapshot_plan};
use proptest::prelude::*;
use proptest::sample::Index;
use relay_rules::{
    apply_write, decide_stories_run, fetched_write, notification_claim, plan_writes, save_wins,
    snapshot_writes, stories_of, stories_of_run, CopiedStory, HeldStory, PlannedClaim, StoriesCopy,
    StoriesMode, StoriesPlan, StoriesRun, StoryChange, StoryOutcome, StoryRead, StoryWrite,
};
use relay_wire::{Story, StoryEvent};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------------
// Builders: every story and event goes through the wire parser, as the relay's do.

/// A story's snapshot: its headline names its version, so one version names one snapshot.
fn snapshot(id: &str, version: i64, ticker: &str) -> Value {
    json!({"id": id, "ticker": ticker, "version": version, "headline": format!("{id} v{version}"),
           "articles": [{"id": format!("ar_{id}_{version}"), "story_id": id}], "extra": {"kept": true}})
}

fn story(id: &str, version: i64) -> Story {
    Story::from_value(&snapshot(id, version, "ALFA B")).unwrap()
}

fn event(event_id: &str, event_type: &str, origin: &str, data: Value) -> StoryEvent {
    StoryEvent::from_value(
        &json!({"event_id": event_id, "type": event_type, "origin": origin,
        "created_at": "2026-10-08T06:40:00.300000Z", "data": data}),
    )
    .unwrap()
}

fn created(event_id: &str, story: &Story) -> StoryEvent {
    event(
        event_id,
        "story.created",
        "live",
        json!({"story": story.snapshot}),
    )
}

fn updated(event_id: &str, story: &Story) -> StoryEvent {
    event(
        event_id,
        "story.updated",
        "live",
        json!({"story": story.snapshot}),
    )
}

fn strong(event_id: &str, origin: &str, story: &Story) -> StoryEvent {
    event(
        event_id,
        "story.became_strong",
        origin,
        json!({"story": story.snapshot}),
    )
}

fn closed(event_id: &str, story_id: &str, version: i64, merged_into: Option<&Story>) -> StoryEvent {
    event(
        event_id,
        "story.closed",
        "live",
        json!({"story_id": story_id, "version": version,
               "merged_into": merged_into.map(|s| s.snapshot.clone())}),
    )
}

fn shortlisted(event_id: &str, story_id: &str) -> StoryEvent {
    event(
        event_id,
        "article.shortlisted",
        "live",
        json!({"article": {"id": "ar_9", "story_id": story_id}}),
    )
}

fn held(version: i64, closed: bool) -> Option<HeldStory> {
    Some(HeldStory { version, closed })
}

fn open_row(story: &Story) -> CopiedStory {
    CopiedStory {
        ticker: story.ticker.clone(),
        version: story.version,
        closed: false,
        story: Some(story.snapshot.clone()),
    }
}

fn closed_row(ticker: Option<&str>, version: i64) -> CopiedStory {
    CopiedStory {
        ticker: ticker.map(str::to_owned),
        version,
        closed: true,
        story: None,
    }
}

/// What the sequencer does with one run (`stories.rs`, "How to drive it"): read the rows the run
/// names, decide, carry the plan out. Checks the plan's rows are the rows it leaves.
fn drive(
    copy: &mut StoriesCopy,
    mode: StoriesMode,
    events: &[Result<StoryEvent, String>],
    reads: &HashMap<String, StoryRead>,
) -> (StoriesPlan, Vec<PlannedClaim>) {
    let ids = stories_of_run(events);
    let held = copy.held_of(ids.iter().map(String::as_str));
    let plan = decide_stories_run(StoriesRun {
        tickers: None,
        mode,
        events,
        held: &held,
        reads,
        registered_at: None,
    });
    let notified = copy
        .execute(&plan)
        .expect("a plan matches the rows it was decided against");
    for (id, row) in &plan.rows {
        assert_eq!(copy.held(id), Some(*row), "plan row {id}");
    }
    (plan, notified)
}

/// Snapshot mode, one run of `events`.
fn apply(copy: &mut StoriesCopy, events: &[StoryEvent]) -> StoriesPlan {
    let events: Vec<_> = events.iter().cloned().map(Ok).collect();
    drive(copy, StoriesMode::Snapshot, &events, &HashMap::new()).0
}

/// The writes an event's reads ask for, or the first story whose read failed.
fn fetched_writes(
    event: &StoryEvent,
    reads: &HashMap<String, StoryRead>,
) -> Result<Vec<StoryWrite>, String> {
    stories_of(event)
        .into_iter()
        .map(|id| fetched_write(id, reads))
        .collect()
}

fn reads(answers: &[(&str, StoryRead)]) -> HashMap<String, StoryRead> {
    answers
        .iter()
        .map(|(id, read)| ((*id).to_owned(), read.clone()))
        .collect()
}

/// Every ordering of `items`.
fn permutations<T: Clone>(items: &[T]) -> Vec<Vec<T>> {
    if items.len() <= 1 {
        return vec![items.to_vec()];
    }
    let mut all = Vec::new();
    for (i, first) in items.iter().enumerate() {
        let mut rest = items.to_vec();
        rest.remove(i);
        for mut tail in permutations(&rest) {
            tail.insert(0, first.clone());
            all.push(tail);
        }
    }
    all
}

// ---------------------------------------------------------------------------------------------
// The seed's three failures.

/// Seed: "A late story.updated overwrites a newer one."
#[test]
fn a_late_story_updated_does_not_overwrite_a_newer_one() {
    let mut copy = StoriesCopy::default();
    let plan = apply(
        &mut copy,
        &[
            created("e1", &story("st_1", 1)),
            updated("e3", &story("st_1", 3)),
        ],
    );
    assert_eq!(plan.changes().count(), 2);
    let late = apply(&mut copy, &[updated("e2", &story("st_1", 2))]);
    assert_eq!(late.outcomes, vec![StoryOutcome::Applied]);
    assert_eq!(late.writes.len(), 1);
    assert_eq!(
        late.writes[0].change, None,
        "the late update changes nothing"
    );
    assert_eq!(copy.rows["st_1"], open_row(&story("st_1", 3)));
    // The same update again, and the newest again, change nothing either.
    let again = apply(
        &mut copy,
        &[
            updated("e3", &story("st_1", 3)),
            updated("e2", &story("st_1", 2)),
        ],
    );
    assert_eq!(again.changes().count(), 0);
    assert!(!save_wins(held(3, false), 3));
    assert!(!save_wins(held(3, false), 2));
    assert!(save_wins(held(3, false), 4));
    assert!(save_wins(None, 0));
}

/// Seed: "A story merges away and you delete it; then a late story.created ... saves it again."
/// The row is kept, closed, and a closed row is never saved again.
#[test]
fn a_story_merged_away_is_not_saved_again_by_a_late_story_created() {
    let survivor = story("st_2", 4);
    let mut copy = StoriesCopy::default();
    let plan = apply(&mut copy, &[closed("e9", "st_1", 3, Some(&survivor))]);
    assert_eq!(
        plan.changes().cloned().collect::<Vec<_>>(),
        vec![
            StoryChange::Closed {
                story_id: "st_1".into(),
                version: 3,
                merged_into: Some("st_2".into()),
            },
            StoryChange::Saved(survivor.clone()),
        ]
    );
    let late = apply(
        &mut copy,
        &[
            created("e1", &story("st_1", 1)),
            updated("e2", &story("st_1", 2)),
            // Even a snapshot with a version past the closing one: closed is for good.
            updated("e10", &story("st_1", 7)),
        ],
    );
    assert_eq!(late.changes().count(), 0);
    assert_eq!(copy.rows["st_1"], closed_row(None, 3));
    assert_eq!(copy.rows["st_2"], open_row(&survivor));
    assert!(!save_wins(held(3, true), 7));
}

/// Seed: "... or a slow API response that read the story before it closed, saves it again."
/// Fetch-on-notify: the read for an earlier event answers the story as it was before the close,
/// and is applied after the close.
#[test]
fn a_slow_api_read_from_before_the_close_does_not_save_the_story_again() {
    let mode = StoriesMode::FetchOnNotify;
    let before_close = story("st_1", 2);
    let mut copy = StoriesCopy::default();
    // The close is applied first: the API answers 404 for st_1, and st_2 as it is now.
    let close = vec![Ok(closed("e3", "st_1", 3, Some(&story("st_2", 5))))];
    let (plan, _) = drive(
        &mut copy,
        mode,
        &close,
        &reads(&[
            ("st_1", StoryRead::NotFound),
            ("st_2", StoryRead::Found(story("st_2", 5))),
        ]),
    );
    assert_eq!(plan.outcomes, vec![StoryOutcome::Applied]);
    assert_eq!(copy.rows["st_1"], closed_row(None, 0), "a 404 closes at 0");
    // Then the slow read, made for story.updated before the close, is applied.
    let slow = vec![Ok(updated("e2", &before_close))];
    let (plan, _) = drive(
        &mut copy,
        mode,
        &slow,
        &reads(&[("st_1", StoryRead::Found(before_close.clone()))]),
    );
    assert_eq!(plan.outcomes, vec![StoryOutcome::Applied]);
    assert_eq!(plan.changes().count(), 0);
    assert_eq!(copy.rows["st_1"], closed_row(None, 0));

    // And when the copy held the story open before the close: the 404 keeps its version, and
    // the slow read of that same version (or an older one) changes nothing.
    let mut copy = StoriesCopy::default();
    apply(&mut copy, &[created("e1", &before_close)]);
    drive(
        &mut copy,
        mode,
        &[Ok(closed("e3", "st_1", 3, None))],
        &reads(&[("st_1", StoryRead::NotFound)]),
    );
    assert_eq!(copy.rows["st_1"], closed_row(Some("ALFA B"), 2));
    for stale in [story("st_1", 1), story("st_1", 2)] {
        let (plan, _) = drive(
            &mut copy,
            mode,
            &[Ok(updated("e2", &stale))],
            &reads(&[("st_1", StoryRead::Found(stale.clone()))]),
        );
        assert_eq!(plan.changes().count(), 0);
    }
    assert_eq!(copy.rows["st_1"], closed_row(Some("ALFA B"), 2));
}

/// Seed: "Two handlers both check 'is this newer?', both see yes, and write in the wrong order."
/// Each write checks and writes in one statement, so two writes of different versions end the
/// same in either order (and a repeat changes nothing).
#[test]
fn two_handlers_checking_is_this_newer_at_once_end_the_same_in_either_order() {
    let writes = [
        StoryWrite::Save(story("st_1", 2)),
        StoryWrite::Save(story("st_1", 3)),
        StoryWrite::Close {
            story_id: "st_1".into(),
            version: 4,
            merged_into: Some("st_2".into()),
        },
    ];
    for start in [None, held(1, false), held(2, false), held(5, true)] {
        for a in &writes {
            for b in &writes {
                let mut ab = StoriesCopy::default();
                let mut ba = StoriesCopy::default();
                if let Some(start) = start {
                    for copy in [&mut ab, &mut ba] {
                        copy.rows.insert(
                            "st_1".into(),
                            if start.closed {
                                closed_row(Some("ALFA B"), start.version)
                            } else {
                                open_row(&story("st_1", start.version))
                            },
                        );
                    }
                }
                ab.apply(a);
                ab.apply(b);
                ba.apply(b);
                ba.apply(a);
                // Only a closed row's ticker can differ (see the test below); here every
                // snapshot has the same ticker, so from a row the copies are equal.
                assert_eq!(ab.held("st_1"), ba.held("st_1"), "{start:?}: {a:?}, {b:?}");
                assert_eq!(ab.rows["st_1"].story, ba.rows["st_1"].story);
                if start.is_some() {
                    assert_eq!(ab, ba, "{start:?}: {a:?} then {b:?}");
                }
                // The pure rule agrees with the statements, whichever came first.
                let (after_a, _) = apply_write(start, a);
                let (after_ab, _) = apply_write(Some(after_a), b);
                assert_eq!(ab.held("st_1"), Some(after_ab));
            }
        }
    }
}

/// The seed's close statement on a fresh row inserts no ticker, and on an existing row leaves
/// the ticker as it was: so a closed row's ticker is that of the last snapshot saved before the
/// close arrived. Nothing decides by a closed row's ticker (a reload reads open rows by ticker).
#[test]
fn a_closed_rows_ticker_is_what_the_seeds_close_statement_left() {
    let mut snapshot_first = StoriesCopy::default();
    apply(
        &mut snapshot_first,
        &[
            created("e1", &story("st_1", 1)),
            closed("e2", "st_1", 2, None),
        ],
    );
    let mut close_first = StoriesCopy::default();
    apply(
        &mut close_first,
        &[
            closed("e2", "st_1", 2, None),
            created("e1", &story("st_1", 1)),
        ],
    );
    assert_eq!(snapshot_first.rows["st_1"], closed_row(Some("ALFA B"), 2));
    assert_eq!(close_first.rows["st_1"], closed_row(None, 2));
}

/// A close at 0 (all that is known is a 404) keeps the greater version the row had; the row is
/// closed in either order with a newer save, but its version is the greatest the copy saw
/// before the close.
#[test]
fn a_404_close_keeps_the_version_the_row_had() {
    let close = StoryWrite::Close {
        story_id: "st_1".into(),
        version: 0,
        merged_into: None,
    };
    let save = StoryWrite::Save(story("st_1", 3));
    let (after, change) = apply_write(held(2, false), &close);
    assert_eq!(
        after,
        HeldStory {
            version: 2,
            closed: true
        }
    );
    assert_eq!(
        change,
        Some(StoryChange::Closed {
            story_id: "st_1".into(),
            version: 2,
            merged_into: None
        })
    );
    let (save_then_close, _) = apply_write(apply_write(held(2, false), &save).0.into(), &close);
    let (close_then_save, _) = apply_write(apply_write(held(2, false), &close).0.into(), &save);
    assert!(save_then_close.closed && close_then_save.closed);
    assert_eq!(save_then_close.version, 3);
    assert_eq!(close_then_save.version, 2);
}

#[test]
fn a_close_is_a_change_only_when_it_closes_or_raises_the_version() {
    let close = |version| StoryWrite::Close {
        story_id: "st_1".into(),
        version,
        merged_into: None,
    };
    let changed = |held, version| apply_write(held, &close(version)).1.map(|c| c.version());
    assert_eq!(changed(None, 4), Some(4));
    assert_eq!(changed(held(2, false), 4), Some(4));
    assert_eq!(
        changed(held(6, false), 4),
        Some(6),
        "the row's version after"
    );
    assert_eq!(changed(held(2, true), 4), Some(4));
    assert_eq!(changed(held(4, true), 4), None);
    assert_eq!(changed(held(6, true), 4), None);
    assert_eq!(changed(held(6, true), 0), None);
}

// ---------------------------------------------------------------------------------------------
// Merge chains.

/// Seed: "If A merges into B and B then merges into C, A and B are closed rows and C holds their
/// articles, whatever order the events arrive in." Every order of the six events, one run per
/// event and all in one run, in both modes.
#[test]
fn merge_chains_end_the_same_in_every_order() {
    let c_newest = story("st_c", 3);
    let events = vec![
        created("e1", &story("st_a", 1)),
        created("e2", &story("st_b", 1)),
        created("e3", &story("st_c", 1)),
        closed("e4", "st_a", 2, Some(&story("st_b", 2))),
        closed("e5", "st_b", 3, Some(&story("st_c", 2))),
        updated("e6", &c_newest),
    ];
    let expected = |copy: &StoriesCopy| {
        assert!(copy.rows["st_a"].closed && copy.rows["st_a"].story.is_none());
        assert!(copy.rows["st_b"].closed && copy.rows["st_b"].story.is_none());
        assert_eq!(copy.rows["st_c"], open_row(&c_newest));
    };
    let final_reads = reads(&[
        ("st_a", StoryRead::NotFound),
        ("st_b", StoryRead::NotFound),
        ("st_c", StoryRead::Found(c_newest.clone())),
    ]);
    for order in permutations(&events) {
        let stored: Vec<_> = order.iter().cloned().map(Ok).collect();
        for mode in StoriesMode::ALL {
            let mut whole = StoriesCopy::default();
            drive(&mut whole, mode, &stored, &final_reads);
            let mut one_by_one = StoriesCopy::default();
            for event in &stored {
                drive(
                    &mut one_by_one,
                    mode,
                    std::slice::from_ref(event),
                    &final_reads,
                );
            }
            assert_eq!(whole, one_by_one);
            expected(&whole);
            if mode == StoriesMode::Snapshot {
                assert_eq!(whole.held("st_a"), held(2, true));
                assert_eq!(whole.held("st_b"), held(3, true));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Notifications.

#[test]
fn a_live_became_strong_claims_strong_and_the_story_id() {
    let event = strong("e1", "live", &story("st_1", 2));
    assert_eq!(notification_claim(&event), Some("strong:st_1".into()));
}

/// Seed: "Skip notifications for events whose origin is backfill."
#[test]
fn a_backfill_became_strong_claims_nothing() {
    assert_eq!(
        notification_claim(&strong("e1", "backfill", &story("st_1", 2))),
        None
    );
}

#[test]
fn other_types_claim_nothing() {
    for event in [
        created("e1", &story("st_1", 1)),
        updated("e2", &story("st_1", 2)),
        closed("e3", "st_1", 3, Some(&story("st_2", 2))),
        shortlisted("e4", "st_1"),
        event(
            "e5",
            "story.promoted",
            "live",
            json!({"story": {"id": "st_1"}}),
        ),
    ] {
        assert_eq!(notification_claim(&event), None, "{}", event.event_type);
    }
}

/// Seed: "Notify only if a row came back": a key once per run, once ever; the save and the
/// claim are independent (a claim is made even when the snapshot lost to a newer one).
#[test]
fn a_notification_is_claimed_once_whatever_the_repeats() {
    let mut copy = StoriesCopy::default();
    let twice = vec![
        Ok(strong("e1", "live", &story("st_1", 2))),
        Ok(strong("e1", "live", &story("st_1", 2))),
        Ok(strong("e7", "backfill", &story("st_2", 2))),
    ];
    let (plan, notified) = drive(&mut copy, StoriesMode::Snapshot, &twice, &HashMap::new());
    assert_eq!(
        plan.claims,
        vec![PlannedClaim {
            key: "strong:st_1".into(),
            story: story("st_1", 2),
            event_id: "e1".into(),
            notify: true,
        }]
    );
    assert_eq!(notified, plan.claims);
    // Delivered again later (by catch-up, say), after a newer version was saved.
    apply(&mut copy, &[updated("e8", &story("st_1", 5))]);
    let (plan, notified) = drive(&mut copy, StoriesMode::Snapshot, &twice, &HashMap::new());
    assert_eq!(plan.claims.len(), 1);
    assert_eq!(plan.changes().count(), 0);
    assert!(notified.is_empty());
    assert_eq!(copy.claimed, BTreeSet::from(["strong:st_1".to_owned()]));
}

// ---------------------------------------------------------------------------------------------
// Fetch-on-notify reads.

/// `upstream-api.md`: "A 404 without that body is a load balancer's: a read that failed."
#[test]
fn a_load_balancers_404_is_a_failed_read_not_a_close() {
    for (status, body) in [
        (404, &b"<html>Not Found</html>"[..]),
        (404, b""),
        (404, br#"{"error": "no_route"}"#),
        (502, br#"{"error": "not_found"}"#),
        (500, b""),
        (200, b"{not json"),
        (200, br#"{"id": "st_2", "version": 1}"#),
        (200, br#"{"id": "st_1"}"#),
    ] {
        assert_eq!(
            StoryRead::from_answer("st_1", status, body),
            StoryRead::Failed,
            "{status} {}",
            String::from_utf8_lossy(body)
        );
    }
    assert_eq!(
        StoryRead::from_answer("st_1", 404, br#"{"error": "not_found"}"#),
        StoryRead::NotFound
    );
    let body = serde_json::to_vec(&snapshot("st_1", 4, "ALFA B")).unwrap();
    assert_eq!(
        StoryRead::from_answer("st_1", 200, &body),
        StoryRead::Found(story("st_1", 4))
    );

    let event = updated("e1", &story("st_1", 4));
    assert_eq!(
        fetched_writes(&event, &reads(&[("st_1", StoryRead::Failed)])),
        Err("st_1".into())
    );
    assert_eq!(fetched_writes(&event, &HashMap::new()), Err("st_1".into()));
    // A story found that is not the one asked for is not saved.
    assert_eq!(
        fetched_writes(
            &event,
            &reads(&[("st_1", StoryRead::Found(story("st_2", 4)))])
        ),
        Err("st_1".into())
    );
}

/// Seed: "A 404 means closed" and "0 when all you know is that the API answered 404".
#[test]
fn a_not_found_read_closes_at_version_0() {
    let event = closed("e1", "st_1", 7, Some(&story("st_2", 3)));
    assert_eq!(
        fetched_writes(
            &event,
            &reads(&[
                ("st_1", StoryRead::NotFound),
                ("st_2", StoryRead::Found(story("st_2", 4))),
            ])
        ),
        Ok(vec![
            StoryWrite::Close {
                story_id: "st_1".into(),
                version: 0,
                merged_into: None,
            },
            StoryWrite::Save(story("st_2", 4)),
        ])
    );
    // Each event only "means these stories changed": article.shortlisted reads its story too.
    assert_eq!(
        fetched_writes(
            &shortlisted("e2", "st_3"),
            &reads(&[("st_3", StoryRead::NotFound)])
        ),
        Ok(vec![StoryWrite::Close {
            story_id: "st_3".into(),
            version: 0,
            merged_into: None,
        }])
    );
}

/// A read that failed does not stop the run: its event is applied for what it can do without
/// the read (a claim uses the event's own snapshot), the story is owed, and every later event
/// is applied. Paying the read later (as the sync does) leaves the copy as reading it then would.
#[test]
fn a_failed_read_is_owed_and_the_run_goes_on() {
    let events = vec![
        Ok(updated("e1", &story("st_1", 2))),
        Err("not a stories event".to_owned()),
        Ok(event("e2", "story.promoted", "live", json!({}))),
        Ok(strong("e3", "live", &story("st_2", 3))),
        Ok(updated("e4", &story("st_1", 3))),
        Ok(closed("e5", "st_3", 2, Some(&story("st_2", 4)))),
    ];
    let mut copy = StoriesCopy::default();
    let failed = reads(&[
        ("st_1", StoryRead::Found(story("st_1", 3))),
        ("st_2", StoryRead::Failed),
        ("st_3", StoryRead::NotFound),
    ]);
    let (plan, notified) = drive(&mut copy, StoriesMode::FetchOnNotify, &events, &failed);
    assert_eq!(
        plan.outcomes,
        vec![
            StoryOutcome::Applied,
            StoryOutcome::Malformed("not a stories event".into()),
            StoryOutcome::Ignored,
            StoryOutcome::ReadOwed("st_2".into()),
            StoryOutcome::Applied,
            StoryOutcome::ReadOwed("st_2".into()),
        ]
    );
    assert_eq!(
        plan.outcomes.iter().filter(|o| o.applied()).count(),
        4,
        "every event of the stories source is applied"
    );
    assert_eq!(plan.owed, vec!["st_2".to_owned()], "once, however many ask");
    // The claim is the event's: it names the story and its snapshot without a read.
    assert_eq!(notified.len(), 1);
    assert_eq!(notified[0].story, story("st_2", 3));
    // Of an unread story, what its events themselves say is written (e3's snapshot, then the
    // merge's surviving snapshot in e5); the owed read may bring a newer state.
    assert_eq!(copy.rows["st_2"], open_row(&story("st_2", 4)));
    assert_eq!(copy.rows["st_1"], open_row(&story("st_1", 3)));
    assert!(copy.rows["st_3"].closed, "the merge's close was read");

    // The owed read, paid later: the story as the API answers it then.
    let paid = reads(&[("st_2", StoryRead::Found(story("st_2", 5)))]);
    let write = fetched_write("st_2".to_owned(), &paid).unwrap();
    let plan = plan_writes(&copy.held_of(["st_2"]), [write]);
    copy.execute(&plan).expect("planned against the rows held");
    assert_eq!(copy.rows["st_2"], open_row(&story("st_2", 5)));
    // A read not made is owed as a failed one is.
    let plan = decide_stories_run(StoriesRun {
        tickers: None,
        mode: StoriesMode::FetchOnNotify,
        events: &events,
        held: &HashMap::new(),
        reads: &HashMap::new(),
        registered_at: None,
    });
    assert_eq!(plan.owed, vec!["st_1", "st_2", "st_3"]);
    let written: Vec<StoryWrite> = plan.writes.iter().map(|w| w.write.clone()).collect();
    let said: Vec<StoryWrite> = events.iter().flatten().flat_map(snapshot_writes).collect();
    assert_eq!(
        written, said,
        "what the events say, as snapshot mode writes it"
    );
    assert_eq!(plan.claims.len(), 1);
    // Snapshot mode reads nothing, and owes nothing.
    let plan = snapshot_plan(&events, &HashMap::new(), None);
    assert!(plan.owed.is_empty());
    assert_eq!(plan.outcomes.len(), events.len());
}

/// A read that answers a state older than its event announced (it began before the change and
/// answered late; the simulator's stale reads): saving it would change nothing, and the change
/// would be lost for good when no later event names the story. The event's own state is
/// written instead; a read as new as the event, or newer, is written as read.
#[test]
fn a_read_older_than_its_event_writes_what_the_event_says() {
    let events = vec![
        Ok(updated("e1", &story("st_1", 3))),
        Ok(closed("e2", "st_2", 4, None)),
        Ok(updated("e3", &story("st_3", 2))),
        Ok(shortlisted("e4", "st_4")),
    ];
    let answers = reads(&[
        // Older than e1's version 3.
        ("st_1", StoryRead::Found(story("st_1", 2))),
        // Open, where e2 closed it.
        ("st_2", StoryRead::Found(story("st_2", 3))),
        // Newer than e3's: the API's newest state.
        ("st_3", StoryRead::Found(story("st_3", 5))),
        // An article.shortlisted says no version: the read is what there is.
        ("st_4", StoryRead::Found(story("st_4", 1))),
    ]);
    let mut copy = StoriesCopy::default();
    for (id, version) in [("st_1", 2), ("st_2", 3)] {
        copy.apply(&StoryWrite::Save(story(id, version)));
    }
    let (plan, _) = drive(&mut copy, StoriesMode::FetchOnNotify, &events, &answers);
    assert!(plan.owed.is_empty());
    assert!(plan.outcomes.iter().all(|o| *o == StoryOutcome::Applied));
    assert_eq!(copy.rows["st_1"], open_row(&story("st_1", 3)));
    assert!(copy.rows["st_2"].closed, "the close the event announced");
    assert_eq!(copy.rows["st_2"].version, 4);
    assert_eq!(copy.rows["st_3"], open_row(&story("st_3", 5)));
    assert_eq!(copy.rows["st_4"], open_row(&story("st_4", 1)));
}

// ---------------------------------------------------------------------------------------------
// The event rules one by one.

#[test]
fn stories_of_names_each_story_once_in_the_seeds_order() {
    assert_eq!(stories_of(&created("e", &story("st_1", 1))), vec!["st_1"]);
    assert_eq!(stories_of(&shortlisted("e", "st_4")), vec!["st_4"]);
    assert_eq!(
        stories_of(&closed("e", "st_1", 2, Some(&story("st_2", 5)))),
        vec!["st_1", "st_2"]
    );
    assert_eq!(stories_of(&closed("e", "st_1", 2, None)), vec!["st_1"]);
    assert_eq!(
        stories_of(&closed("e", "st_1", 2, Some(&story("st_1", 5)))),
        vec!["st_1"]
    );
    assert!(stories_of(&event("e", "story.promoted", "live", json!({}))).is_empty());
    let run = vec![
        Ok(shortlisted("e", "st_4")),
        Err("x".to_owned()),
        Ok(closed("e", "st_1", 2, Some(&story("st_2", 5)))),
        Ok(created("e", &story("st_1", 1))),
    ];
    assert_eq!(stories_of_run(&run), vec!["st_1", "st_2", "st_4"]);
}

#[test]
fn snapshot_writes_follow_apply_snapshot() {
    for event in [
        created("e", &story("st_1", 1)),
        updated("e", &story("st_1", 1)),
        strong("e", "backfill", &story("st_1", 1)),
    ] {
        assert_eq!(
            snapshot_writes(&event),
            vec![StoryWrite::Save(story("st_1", 1))]
        );
    }
    assert_eq!(
        snapshot_writes(&closed("e", "st_1", 4, Some(&story("st_2", 5)))),
        vec![
            StoryWrite::Close {
                story_id: "st_1".into(),
                version: 4,
                merged_into: Some("st_2".into()),
            },
            StoryWrite::Save(story("st_2", 5)),
        ]
    );
    assert!(snapshot_writes(&shortlisted("e", "st_1")).is_empty());
    assert!(snapshot_writes(&event("e", "x", "live", json!(null))).is_empty());
}

#[test]
fn stories_mode_names() {
    assert_eq!(StoriesMode::default(), StoriesMode::Snapshot);
    for mode in StoriesMode::ALL {
        assert_eq!(StoriesMode::parse(mode.as_str()), Some(mode));
    }
    assert_eq!(StoriesMode::parse("fetch-on-notify"), None);
    assert_eq!(StoriesMode::parse(""), None);
}

/// The example event of `upstream-api.md` ("The stories API", "Webhooks"), from its bytes.
#[test]
fn the_upstream_api_example_event_is_saved_as_received() {
    let body = br#"{"event_id": "evt_5c1b0a2f9d7e4c3a", "type": "story.updated", "origin": "live",
 "created_at": "2026-10-08T06:40:00.300000Z",
 "data": {"story": {"id": "st_7101", "ticker": "ALFA B", "version": 3,
                    "headline": "...", "articles": [{"id": "ar_1", "story_id": "st_7101"}]}}}"#;
    let event = StoryEvent::parse(body).unwrap();
    let mut copy = StoriesCopy::default();
    let plan = apply(&mut copy, &[event]);
    let row = &copy.rows["st_7101"];
    assert_eq!(row.ticker.as_deref(), Some("ALFA B"));
    assert_eq!(row.version, 3);
    assert_eq!(
        row.story.as_ref().unwrap()["articles"][0]["id"],
        json!("ar_1")
    );
    assert_eq!(
        plan.writes[0].event_id.as_deref(),
        Some("evt_5c1b0a2f9d7e4c3a")
    );
}

#[test]
fn a_plan_decided_against_other_rows_is_refused_by_the_executor() {
    let events = vec![Ok(updated("e2", &story("st_1", 2)))];
    let plan = snapshot_plan(&events, &HashMap::new(), None);
    let mut copy = StoriesCopy::default();
    apply(&mut copy, &[updated("e3", &story("st_1", 3))]);
    let mismatch = copy.execute(&plan).unwrap_err();
    assert_eq!(mismatch.index, 0);
    assert_eq!(mismatch.made, None);
}

/// A round's writes (a reload's batch, owed reads paid) are planned as a run's events are: each
/// write's change against the row as the earlier ones left it, the same story written several
/// times included; the plan names no event, and claims nothing.
#[test]
fn a_rounds_writes_are_planned_as_a_runs_events_are() {
    let writes = vec![
        StoryWrite::Save(story("st_1", 2)),
        StoryWrite::Save(story("st_1", 3)),
        StoryWrite::Save(story("st_1", 1)),
        StoryWrite::Close {
            story_id: "st_1".into(),
            version: 4,
            merged_into: None,
        },
        StoryWrite::Save(story("st_1", 5)),
        StoryWrite::Save(story("st_2", 1)),
    ];
    let held = HashMap::from([(
        "st_2".to_owned(),
        HeldStory {
            version: 1,
            closed: false,
        },
    )]);
    let plan = plan_writes(&held, writes.clone());
    let made: Vec<bool> = plan.writes.iter().map(|w| w.change.is_some()).collect();
    assert_eq!(made, vec![true, true, false, true, false, false]);
    assert!(plan.writes.iter().all(|w| w.event_id.is_none()));
    assert!(plan.claims.is_empty() && plan.outcomes.is_empty() && plan.owed.is_empty());
    assert_eq!(
        plan.rows["st_1"],
        HeldStory {
            version: 4,
            closed: true
        }
    );
    // The same writes asked for by events plan the same changes.
    let events: Vec<_> = [
        updated("e1", &story("st_1", 2)),
        updated("e2", &story("st_1", 3)),
        updated("e3", &story("st_1", 1)),
        closed("e4", "st_1", 4, None),
        updated("e5", &story("st_1", 5)),
        updated("e6", &story("st_2", 1)),
    ]
    .into_iter()
    .map(Ok)
    .collect();
    let run = snapshot_plan(&events, &held, None);
    assert_eq!(
        run.changes().collect::<Vec<_>>(),
        plan.changes().collect::<Vec<_>>()
    );
    assert_eq!(run.rows, plan.rows);
    let mut copy = StoriesCopy::default();
    copy.apply(&StoryWrite::Save(story("st_2", 1)));
    assert_eq!(copy.execute(&plan), Ok(Vec::new()));
    assert_eq!(copy.rows["st_1"], closed_row(Some("ALFA B"), 4));
}

// ---------------------------------------------------------------------------------------------
// Property tests.

const STORIES: u8 = 4;

fn story_id(n: u8) -> String {
    format!("st_{}", n % STORIES)
}

/// One step of the upstream's timeline: (action, story, other story, live, ticker).
type Step = (u8, u8, u8, bool, u8);

/// The API's state of one story.
#[derive(Debug, Clone, PartialEq)]
enum Api {
    Open(Story),
    Closed { closing: i64 },
}

/// What the upstream published: its events in order, and the API's state after each.
#[derive(Debug, Clone)]
struct Timeline {
    events: Vec<StoryEvent>,
    states: Vec<BTreeMap<String, Api>>,
}

impl Timeline {
    /// Reads steps as a consistent timeline: versions rise by one per change, a merge is a
    /// change of the survivor, a closed story never opens again.
    fn publish(steps: &[Step]) -> Timeline {
        let mut api: BTreeMap<String, Api> = BTreeMap::new();
        let mut timeline = Timeline {
            events: Vec::new(),
            states: Vec::new(),
        };
        for (n, &(action, a, b, live, ticker)) in steps.iter().enumerate() {
            let id = story_id(a);
            let origin = if live { "live" } else { "backfill" };
            let event_id = format!("evt_{n}");
            let ticker = format!("T{}", ticker % 3);
            let value = match (action % 5, api.get(&id).cloned()) {
                (0..=2, None) => {
                    let s = snapshot(&id, 1, &ticker);
                    api.insert(id.clone(), Api::Open(Story::from_value(&s).unwrap()));
                    json!({"type": "story.created", "data": {"story": s}})
                }
                (action @ 0..=2, Some(Api::Open(old))) => {
                    let s = snapshot(&id, old.version + 1, &ticker);
                    api.insert(id.clone(), Api::Open(Story::from_value(&s).unwrap()));
                    let kind = if action == 2 {
                        "story.became_strong"
                    } else {
                        "story.updated"
                    };
                    json!({"type": kind, "data": {"story": s}})
                }
                (3, Some(Api::Open(old))) => {
                    let closing = old.version + 1;
                    let survivor_id = story_id(b);
                    let survivor = match api.get(&survivor_id) {
                        Some(Api::Open(s)) if b < STORIES && survivor_id != id => {
                            let ticker = s.ticker.as_deref().unwrap_or("T0");
                            let merged = snapshot(&survivor_id, s.version + 1, ticker);
                            api.insert(
                                survivor_id.clone(),
                                Api::Open(Story::from_value(&merged).unwrap()),
                            );
                            merged
                        }
                        _ => Value::Null,
                    };
                    api.insert(id.clone(), Api::Closed { closing });
                    json!({"type": "story.closed",
                           "data": {"story_id": id, "version": closing, "merged_into": survivor}})
                }
                (_, Some(_)) if b % 2 == 0 => {
                    json!({"type": "article.shortlisted",
                           "data": {"article": {"id": format!("ar_{n}"), "story_id": id}}})
                }
                _ => json!({"type": "story.promoted", "data": {"story_id": id}}),
            };
            let mut value = value;
            value["event_id"] = json!(event_id);
            value["origin"] = json!(origin);
            timeline
                .events
                .push(StoryEvent::from_value(&value).expect("the timeline's events parse"));
            timeline.states.push(api.clone());
        }
        timeline
    }

    fn last(&self) -> BTreeMap<String, Api> {
        self.states.last().cloned().unwrap_or_default()
    }

    /// What `GET /v1/stories/{id}` answers after event `at`.
    fn read(&self, at: usize, id: &str) -> StoryRead {
        match self.states[at].get(id) {
            Some(Api::Open(story)) => StoryRead::Found(story.clone()),
            Some(Api::Closed { .. }) | None => StoryRead::NotFound,
        }
    }

    /// Every notification a live story.became_strong asks for.
    fn notifications(&self) -> BTreeSet<String> {
        self.events.iter().filter_map(notification_claim).collect()
    }
}

/// Events as they arrive: the published ones, some again, some stored messages that are not
/// stories events, in the order of `keys`. Each is tagged with its publication index.
fn arrive(
    timeline: &Timeline,
    again: &[Index],
    junk: &[Index],
    keys: &[u32],
) -> Vec<(usize, Result<StoryEvent, String>)> {
    let n = timeline.events.len();
    let mut arrivals: Vec<(usize, Result<StoryEvent, String>)> = timeline
        .events
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, e)| (i, Ok(e)))
        .collect();
    arrivals.extend(again.iter().map(|i| {
        let i = i.index(n);
        (i, Ok(timeline.events[i].clone()))
    }));
    arrivals.extend(
        junk.iter()
            .map(|_| (0, Err("not a stories event".to_owned()))),
    );
    let mut keyed: Vec<_> = arrivals
        .into_iter()
        .enumerate()
        .map(|(i, a)| ((keys[i % keys.len()], i), a))
        .collect();
    keyed.sort_by_key(|(key, _)| *key);
    keyed.into_iter().map(|(_, a)| a).collect()
}

/// The rows with a closed row's ticker left out: what any order of arrival agrees on.
fn comparable(copy: &StoriesCopy) -> BTreeMap<String, (i64, bool, Option<Value>, Option<String>)> {
    copy.rows
        .iter()
        .map(|(id, row)| {
            let ticker = if row.closed { None } else { row.ticker.clone() };
            (
                id.clone(),
                (row.version, row.closed, row.story.clone(), ticker),
            )
        })
        .collect()
}

/// A copy rebuilt from changes alone, as a queue consumer does.
fn rebuilt<'a>(changes: impl IntoIterator<Item = &'a StoryChange>) -> StoriesCopy {
    let mut copy = StoriesCopy::default();
    for change in changes {
        copy.apply_change(change);
    }
    copy
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec((0u8..5, 0u8..STORIES, 0u8..5, any::<bool>(), 0u8..3), 1..40)
}

/// What a run of the arrivals read under: the cut lengths, cycled.
fn cut_lengths() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..8, 1..8)
}

/// A write of one story, for the statement-level properties: a save of a version, or a close at
/// a version. With `one_snapshot_per_version`, a save's ticker (the one thing of its snapshot
/// not named by the version) is named by the version too; else it is any.
fn write_of(id: &'static str, one_snapshot_per_version: bool) -> impl Strategy<Value = StoryWrite> {
    prop_oneof![
        (0i64..8, 0i64..3).prop_map(move |(version, ticker)| {
            let ticker = if one_snapshot_per_version {
                version % 3
            } else {
                ticker
            };
            StoryWrite::Save(
                Story::from_value(&snapshot(id, version, &format!("T{ticker}"))).unwrap(),
            )
        }),
        (0i64..8, any::<bool>()).prop_map(move |(version, merged)| StoryWrite::Close {
            story_id: id.to_owned(),
            version,
            merged_into: merged.then(|| "st_x".to_owned()),
        }),
    ]
}

proptest! {
    #![proptest_config(config(256))]

    /// Seed: "With these two writes, applying an event twice changes nothing, and the order
    /// events arrive in doesn't matter." Snapshot mode: any order of arrival, with repeats and
    /// stored messages that are not stories events, cut into runs of any lengths (each decided
    /// against the rows the executor holds), ends in the same copy as publication order (a
    /// closed row's ticker aside), which is the API's last state: closed stories closed at their
    /// closing version, open ones at their newest snapshot. Replaying the plans' changes onto
    /// an empty copy gives the executor's rows exactly; each notification is made once.
    #[test]
    fn snapshot_mode_any_order_of_arrival_ends_in_the_same_copy(
        steps in steps(),
        again in prop::collection::vec(any::<Index>(), 0..20),
        junk in prop::collection::vec(any::<Index>(), 0..3),
        keys in prop::collection::vec(any::<u32>(), 64),
        cuts in cut_lengths(),
    ) {
        let timeline = Timeline::publish(&steps);
        let mode = StoriesMode::Snapshot;
        let none = HashMap::new();

        let mut in_order = StoriesCopy::default();
        let published: Vec<_> = timeline.events.iter().cloned().map(Ok).collect();
        let (plan, _) = drive(&mut in_order, mode, &published, &none);
        prop_assert_eq!(&rebuilt(plan.changes()).rows, &in_order.rows);

        let arrivals: Vec<_> = arrive(&timeline, &again, &junk, &keys)
            .into_iter()
            .map(|(_, a)| a)
            .collect();
        let mut any_order = StoriesCopy::default();
        let mut changes = Vec::new();
        let mut notified = Vec::new();
        let mut at = 0;
        for len in cuts.iter().cycle() {
            if at == arrivals.len() {
                break;
            }
            let run = &arrivals[at..(at + len).min(arrivals.len())];
            let (plan, claims) = drive(&mut any_order, mode, run, &none);
            prop_assert_eq!(plan.outcomes.len(), run.len());
            prop_assert!(plan.owed.is_empty());
            prop_assert_eq!(plan.outcomes.len(), run.len());
            changes.extend(plan.changes().cloned());
            notified.extend(claims.into_iter().map(|c| c.key));
            at += run.len();
        }

        prop_assert_eq!(comparable(&any_order), comparable(&in_order));
        prop_assert_eq!(&rebuilt(&changes).rows, &any_order.rows);
        let unique: BTreeSet<String> = notified.iter().cloned().collect();
        prop_assert_eq!(unique.len(), notified.len(), "each notification once");
        prop_assert_eq!(&unique, &timeline.notifications());
        prop_assert_eq!(&any_order.claimed, &timeline.notifications());

        let last = timeline.last();
        prop_assert_eq!(
            any_order.rows.keys().collect::<Vec<_>>(),
            last.keys().collect::<Vec<_>>()
        );
        for (id, api) in &last {
            let row = &any_order.rows[id];
            match api {
                Api::Open(story) => {
                    prop_assert!(!row.closed);
                    prop_assert_eq!(row.version, story.version);
                    prop_assert_eq!(row.story.as_ref(), Some(&story.snapshot));
                    prop_assert_eq!(&row.ticker, &story.ticker);
                }
                Api::Closed { closing } => {
                    prop_assert!(row.closed);
                    prop_assert_eq!(row.version, *closing);
                    prop_assert!(row.story.is_none());
                }
            }
        }
    }

    /// Fetch-on-notify: any order of arrival, runs of any lengths, reads that fail (the story is
    /// owed, and read again after the arrivals, as the sync does) and reads as stale as the
    /// run's own events allow (older than
    /// what earlier runs applied): every story ends as the API's last state of it. Seed: "A
    /// response that is slow because it read the story before a change can't undo that change".
    #[test]
    fn fetch_on_notify_any_order_and_stale_reads_end_in_the_apis_state(
        steps in steps(),
        again in prop::collection::vec(any::<Index>(), 0..20),
        junk in prop::collection::vec(any::<Index>(), 0..3),
        keys in prop::collection::vec(any::<u32>(), 64),
        cuts in cut_lengths(),
        staleness in prop::collection::vec((any::<Index>(), 0u8..4), 64),
    ) {
        let timeline = Timeline::publish(&steps);
        let n = timeline.events.len();
        let arrivals = arrive(&timeline, &again, &junk, &keys);
        let mut copy = StoriesCopy::default();
        let mut changes = Vec::new();
        let mut at = 0;
        let mut draws = staleness.iter().cycle();
        let mut owed = BTreeSet::new();
        for len in cuts.iter().cycle() {
            if at == arrivals.len() {
                break;
            }
            let run = &arrivals[at..(at + len).min(arrivals.len())];
            // A read is made after the run's events arrived, so it is no older than the newest of
            // them; it may be older than events applied by earlier runs (a slow read, or one made
            // before another worker's run committed).
            let floor = run.iter().map(|(i, _)| *i).max().unwrap_or(0);
            let events: Vec<_> = run.iter().map(|(_, e)| e.clone()).collect();
            let mut answers = HashMap::new();
            for id in stories_of_run(&events) {
                let (when, fail) = draws.next().unwrap();
                let read = if *fail == 0 {
                    StoryRead::Failed
                } else {
                    timeline.read(floor + when.index(n - floor), &id)
                };
                answers.insert(id, read);
            }
            let (plan, _) = drive(&mut copy, StoriesMode::FetchOnNotify, &events, &answers);
            prop_assert_eq!(plan.outcomes.len(), run.len());
            for (outcome, (_, event)) in plan.outcomes.iter().zip(run) {
                if let StoryOutcome::ReadOwed(id) = outcome {
                    prop_assert!(plan.owed.contains(id));
                    prop_assert!(stories_of(event.as_ref().unwrap()).contains(id));
                }
            }
            owed.extend(plan.owed.iter().cloned());
            changes.extend(plan.changes().cloned());
            at += run.len();
        }
        // The reads owed, made after every arrival: each as the API answers then, decided by
        // `apply_write` against the row as it is.
        let now = reads(&owed.iter().map(|id| (id.as_str(), timeline.read(n.saturating_sub(1), id))).collect::<Vec<_>>());
        for id in owed {
            let write = fetched_write(id, &now).unwrap();
            let (_, planned) = apply_write(copy.held(write.story_id()), &write);
            let made = copy.apply(&write);
            prop_assert_eq!(&made, &planned);
            changes.extend(made);
        }
        prop_assert_eq!(&rebuilt(&changes).rows, &copy.rows);
        for (id, api) in &timeline.last() {
            let named = arrivals.iter().any(|(_, e)| {
                e.as_ref().is_ok_and(|e| stories_of(e).contains(id))
            });
            prop_assert!(named, "every story the timeline has, an event named");
            let row = &copy.rows[id];
            match api {
                Api::Open(story) => {
                    prop_assert!(!row.closed, "{} open", id);
                    prop_assert_eq!(row.version, story.version);
                    prop_assert_eq!(row.story.as_ref(), Some(&story.snapshot));
                }
                Api::Closed { closing } => {
                    prop_assert!(row.closed, "{} closed", id);
                    // Closed at the last version read open (a 404's close), or at the closing
                    // version when a read older than story.closed wrote the event's own close.
                    prop_assert!(row.version <= *closing);
                    prop_assert!(row.story.is_none());
                }
            }
        }
    }

    /// The pure rule and the statements agree on every write from every row, and the changes
    /// they make rebuild the copy exactly (tickers included), for any sequence of writes: not
    /// only those a consistent timeline makes (saves after a close, closes below the row, the
    /// same version again).
    #[test]
    fn the_rule_the_statements_and_the_consumers_rebuild_agree(
        writes in prop::collection::vec(prop_oneof![write_of("st_1", false), write_of("st_2", false)], 0..30),
    ) {
        let mut copy = StoriesCopy::default();
        let mut changes = Vec::new();
        for write in &writes {
            let held = copy.held(write.story_id());
            let (after, planned) = apply_write(held, write);
            let made = copy.apply(write);
            prop_assert_eq!(&made, &planned);
            prop_assert_eq!(copy.held(write.story_id()), Some(after));
            prop_assert_eq!(after.closed, copy.rows[write.story_id()].story.is_none());
            if let StoryWrite::Save(story) = write {
                prop_assert_eq!(made.is_some(), save_wins(held, story.version));
            }
            changes.extend(made);
            prop_assert_eq!(&rebuilt(&changes).rows, &copy.rows);
        }
    }

    /// Seed: "Postgres checks the condition and writes in one step, even when two handlers race
    /// for the same story": two writes end the same in either order, from any row, when one
    /// version names one snapshot and no close is below a save (a closing version is above every
    /// snapshot's; see `a_404_close_keeps_the_version_the_row_had` for a 404's close at 0).
    #[test]
    fn two_writes_race_to_the_same_row(
        start in prop::option::of((0i64..8, any::<bool>(), 0u8..3)),
        first in write_of("st_1", true),
        second in write_of("st_1", true),
    ) {
        let mut ab = StoriesCopy::default();
        if let Some((version, closed, ticker)) = start {
            let row = if closed {
                closed_row(Some("T1"), version)
            } else {
                open_row(&Story::from_value(&snapshot("st_1", version, &format!("T{ticker}"))).unwrap())
            };
            ab.rows.insert("st_1".into(), row);
        }
        let mut ba = ab.clone();
        ab.apply(&first);
        ab.apply(&second);
        ba.apply(&second);
        ba.apply(&first);
        let version = |w: &StoryWrite| match w {
            StoryWrite::Save(s) => (s.version, false),
            StoryWrite::Close { version, .. } => (*version, true),
        };
        let ((v1, c1), (v2, c2)) = (version(&first), version(&second));
        let close_below_save = (c1 && !c2 && v1 < v2) || (c2 && !c1 && v2 < v1);
        // The closed flag and the snapshot agree whatever the order.
        prop_assert_eq!(ab.rows["st_1"].closed, ba.rows["st_1"].closed);
        if !close_below_save {
            prop_assert_eq!(comparable(&ab), comparable(&ba));
        }
        if !(c1 || c2) {
            prop_assert_eq!(&ab, &ba);
        }
    }

    /// Hostile input never panics: any bytes, and any JSON in place of any field of a good event.
    #[test]
    fn hostile_events_are_errors_not_panics(
        bytes in prop::collection::vec(any::<u8>(), 0..200),
        field in 0usize..8,
        replacement in hostile_json(),
    ) {
        let _ = StoryEvent::parse(&bytes);
        let mut good = json!({"event_id": "e", "type": "story.closed", "origin": "live",
            "data": {"story_id": "st_1", "version": 2,
                     "merged_into": {"id": "st_2", "version": 3, "ticker": "T"}}});
        let slot = match field {
            0 => &mut good["event_id"],
            1 => &mut good["type"],
            2 => &mut good["origin"],
            3 => &mut good["data"],
            4 => &mut good["data"]["story_id"],
            5 => &mut good["data"]["version"],
            6 => &mut good["data"]["merged_into"]["version"],
            _ => &mut good["data"]["merged_into"]["id"],
        };
        *slot = replacement;
        let bytes = good.to_string();
        if let Ok(event) = StoryEvent::parse(bytes.as_bytes()) {
            prop_assert_eq!(StoryEvent::from_value(&good), Ok(event.clone()));
            for id in stories_of(&event) {
                prop_assert!(!id.is_empty() && id.len() <= relay_wire::MAX_ID_BYTES);
                prop_assert!(!id.chars().any(char::is_control));
            }
            for write in snapshot_writes(&event) {
                if let StoryWrite::Close { version, .. } = write {
                    prop_assert!(version >= 0);
                }
            }
        }
    }
}

fn hostile_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,3}".prop_map(Value::String),
        Just(json!("x".repeat(201))),
        Just(json!("\u{0}")),
        Just(json!("live")),
        Just(json!("story.created")),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}|id|version|story|ticker", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

#[test]
fn an_owed_read_waits_longer_after_each_failure_up_to_the_most_plus_its_jitter() {
    use std::time::Duration as D;
    let (first, max) = (D::from_secs(60), D::from_secs(300));
    let pause = |attempts, jitter| relay_rules::owed_read_pause(attempts, first, max, jitter);
    assert_eq!(pause(0, 0.0), D::from_secs(60));
    assert_eq!(pause(1, 0.0), D::from_secs(120));
    assert_eq!(pause(2, 0.5), D::from_secs(360));
    assert_eq!(pause(3, 0.0), max);
    assert_eq!(pause(u32::MAX, 0.999), max + max.mul_f64(0.999));
    // A jitter out of its range is taken at its nearest end; one that is not a number as none.
    assert_eq!(pause(1, f64::NAN), D::from_secs(120));
    assert_eq!(pause(1, 7.0), D::from_secs(240));
}
