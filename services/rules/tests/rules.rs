//! One or more tests per reading rule of the wire file, named after the rule, on the wire file's
//! own example messages and on small hand-built ones.

mod common;

use common::*;
use relay_rules::*;
use relay_wire::{EventBody, Sequence};
use serde_json::json;

// ---- The wire file's examples ----

#[test]
fn wire_example_events_on_an_empty_copy_store_the_item_then_the_hidden_event_tombstones_it() {
    let message = wire_example("events");
    let (track, decision) = step(&EndpointTrack::default(), &message);
    // An empty copy holds no access_version: the message begins its reload and is applied too.
    let MessageDecision::ApplyEvents { generation, reload } = decision else {
        panic!("{decision:?}")
    };
    assert_eq!(generation, 3);
    assert!(matches!(reload, Some(ReloadStart::Begin(ref r)) if r.generation == 3));
    assert_eq!(track.through.as_deref(), Some("1.1050"));

    let mut copy = FeedCopy::new();
    let first = copy.apply_event(generation, &message.events[0]);
    let Decision::Store {
        subject,
        generation: g,
        sequence,
        item,
        diff,
    } = &first
    else {
        panic!("{first:?}")
    };
    assert_eq!(subject, "announcement:88001");
    assert_eq!(*g, 3);
    assert_eq!(sequence.as_str(), "0000000001.0000000000000001045");
    assert_eq!(item.feed_item_id, "announcement:88001");
    assert_eq!(diff.added, vec!["flash:11", "flash:12", "story:7101"]);

    let second = copy.apply_event(generation, &message.events[1]);
    assert_eq!(
        second,
        Decision::Tombstone {
            subject: "announcement:88001".into(),
            generation: 3,
            sequence: Sequence::new("0000000001.0000000000000001048"),
            removed_item: true,
        }
    );
    let held = copy.get("announcement:88001").unwrap();
    assert!(held.is_tombstone());
    assert_eq!(held.sequence.as_str(), "0000000001.0000000000000001048");
}

#[test]
fn wire_example_refetch_yields_refetch_at_generation_3_and_its_sequence() {
    let message = wire_example("events with a refetch");
    let expected = Decision::Refetch {
        subject: "announcement:88001".into(),
        feed_item_id: "announcement:88001".into(),
        generation: 3,
        sequence: Sequence::new("0000000001.0000000000000001052"),
    };
    assert_eq!(decide_event(None, 3, &message.events[0]), expected);
    // Also after the "events" example: 1052 is above the tombstone's 1048.
    let mut copy = FeedCopy::new();
    for e in &wire_example("events").events {
        copy.apply_event(3, e);
    }
    assert_eq!(copy.apply_event(3, &message.events[0]), expected);
}

#[test]
fn wire_example_reset_begins_a_reload_at_generation_4_under_b4d934cf() {
    let (after_events, _) = step(&EndpointTrack::default(), &wire_example("events"));
    let merged = after_events.reload_merged(after_events.reload.as_ref().unwrap(), "b4d934cf");
    let (track, decision) = step(&merged, &wire_example("reset"));
    let begun = Reload {
        generation: 4,
        access_version: Some("b4d934cf".into()),
        cause: ReloadCause::Reset {
            reason: "access_changed".into(),
        },
        read_again: 0,
    };
    assert_eq!(decision, MessageDecision::BeginReload(begun.clone()));
    assert_eq!(track.generation, Some(4));
    assert_eq!(track.access_version.as_deref(), Some("b4d934cf"));
    assert_eq!(track.reload, Some(begun));
    assert!(track.last_was_reset);
    assert_eq!(track.through.as_deref(), Some("1.1050"));
}

#[test]
fn tested_rule_the_wire_files_tests_are_answered_and_never_applied() {
    for name in ["test", "test of a type"] {
        let message = wire_example(name);
        let state = EndpointTrack {
            generation: Some(3),
            access_version: Some("b4d934cf".into()),
            ..Default::default()
        };
        assert_eq!(
            step(&state, &message),
            (state.clone(), MessageDecision::Test)
        );
        let mut copy = FeedCopy::new();
        for e in &message.events {
            assert_eq!(copy.apply_event(3, e), Decision::Ignore(IgnoreReason::Test));
        }
        assert_eq!(
            copy,
            FeedCopy::new(),
            "{name}: the example is never a change"
        );
    }
}

// ---- "On a feed item's event" ----

#[test]
fn feed_item_event_rule_updated_stores_with_the_events_sequence_not_the_items_seq() {
    let e = event(update_json(
        "e1",
        7,
        1050,
        item_json(7, 1045, &[("flash:1", 1)], "a"),
    ));
    let d = decide_event(None, 2, &e);
    let Decision::Store { sequence, item, .. } = &d else {
        panic!("{d:?}")
    };
    assert_eq!(*sequence, seq(1050));
    assert_eq!(item.seq, 1045);
}

#[test]
fn feed_item_event_rule_a_removal_with_nothing_held_keeps_a_tombstone_an_older_update_cannot_undo()
{
    let mut copy = FeedCopy::new();
    let d = copy.apply_event(2, &event(removal_json("e1", "withdrawn", 7, 20)));
    assert!(matches!(
        d,
        Decision::Tombstone {
            removed_item: false,
            ..
        }
    ));
    assert!(!d.is_change());
    let late = event(update_json("e0", 7, 19, item_json(7, 19, &[], "a")));
    assert_eq!(
        copy.apply_event(2, &late),
        Decision::Ignore(IgnoreReason::Older)
    );
    // At the same sequence, the removal wins too.
    let same = event(update_json("e0b", 7, 20, item_json(7, 20, &[], "a")));
    assert_eq!(
        copy.apply_event(2, &same),
        Decision::Ignore(IgnoreReason::Older)
    );
    assert!(copy.get(&subject(7)).unwrap().is_tombstone());
    // The same tombstone again is already carried out.
    let again = event(removal_json("e1b", "hidden", 7, 20));
    assert_eq!(
        copy.apply_event(2, &again),
        Decision::Ignore(IgnoreReason::AlreadyRemoved)
    );
}

#[test]
fn feed_item_event_rule_at_an_equal_sequence_a_removal_wins_over_the_item() {
    let mut copy = FeedCopy::new();
    copy.apply_event(
        2,
        &event(update_json("e1", 7, 20, item_json(7, 20, &[], "a"))),
    );
    let d = copy.apply_event(2, &event(removal_json("e2", "hidden", 7, 20)));
    assert!(matches!(
        d,
        Decision::Tombstone {
            removed_item: true,
            ..
        }
    ));
}

#[test]
fn feed_item_event_rule_a_newer_generation_wins_an_older_one_is_ignored() {
    let mut copy = FeedCopy::new();
    copy.apply_event(
        3,
        &event(update_json("e1", 7, 900, item_json(7, 900, &[], "a"))),
    );
    let newer = event(update_json("e2", 7, 5, item_json(7, 5, &[], "b")));
    assert!(matches!(
        copy.apply_event(4, &newer),
        Decision::Store { generation: 4, .. }
    ));
    let older = event(removal_json("e3", "hidden", 7, 99_999));
    assert_eq!(
        copy.apply_event(3, &older),
        Decision::Ignore(IgnoreReason::OlderGeneration)
    );
}

#[test]
fn feed_item_event_rule_compare_parts_an_identical_item_is_unchanged_and_writes_no_outbox_row() {
    let mut copy = FeedCopy::new();
    let body = item_json(7, 10, &[("flash:1", 1), ("story:2", 1)], "a");
    copy.apply_event(2, &event(update_json("e1", 7, 10, body.clone())));
    let d = copy.apply_event(2, &event(update_json("e2", 7, 12, body)));
    assert_eq!(
        d,
        Decision::Unchanged {
            subject: subject(7),
            generation: 2,
            sequence: seq(12),
        }
    );
    assert!(!d.is_change());
    // The position rose all the same: an update at 11 arriving now is older.
    let between = event(update_json("e3", 7, 11, item_json(7, 11, &[], "z")));
    assert_eq!(
        copy.apply_event(2, &between),
        Decision::Ignore(IgnoreReason::Older)
    );

    // Same parts, other JSON: a real change with an empty parts diff.
    let other = item_json(7, 10, &[("flash:1", 1), ("story:2", 1)], "b");
    let d = copy.apply_event(2, &event(update_json("e4", 7, 13, other)));
    assert!(matches!(&d, Decision::Store { diff, .. } if diff.is_empty()));
    // A part version rises, one appears, one goes.
    let next = item_json(7, 10, &[("story:2", 2), ("flash:3", 1)], "b");
    let d = copy.apply_event(2, &event(update_json("e5", 7, 14, next)));
    let Decision::Store { diff, .. } = d else {
        panic!()
    };
    assert_eq!(
        diff,
        PartsDiff {
            added: vec!["flash:3".into()],
            changed: vec!["story:2".into()],
            removed: vec!["flash:1".into()],
        }
    );
}

#[test]
fn feed_item_event_rule_a_refetch_that_held_already_beats_is_not_read() {
    let mut copy = FeedCopy::new();
    copy.apply_event(
        3,
        &event(update_json("e1", 7, 60, item_json(7, 60, &[], "a"))),
    );
    let e = event(refetch_json("e2", 7, 52));
    assert_eq!(
        copy.apply_event(3, &e),
        Decision::Ignore(IgnoreReason::Older)
    );
    // At an equal sequence the answer may be a 404 (a removal wins there): read it.
    let e = event(refetch_json("e3", 7, 60));
    assert!(matches!(copy.apply_event(3, &e), Decision::Refetch { .. }));
}

// ---- Routing, unknown types, de-duplication ----

#[test]
fn ignore_unnamed_rule_unknown_event_types_and_feed_actions_are_ignored() {
    let m = message(
        2,
        "av",
        "1.2",
        vec![
            json!({"id": "x1", "type": "story.created", "data": {}}),
            json!({"id": "x2", "type": "announcement.promoted", "subject": "announcement:1",
                   "sequence": seq(1).as_str(), "data": {}}),
        ],
    );
    for e in &m.events {
        assert_eq!(
            decide_event(None, 2, e),
            Decision::Ignore(IgnoreReason::UnknownType)
        );
    }
}

#[test]
fn route_by_type_rule_a_reset_event_is_the_messages_business_not_a_subjects() {
    let m = reset(4, "av", "behind");
    assert!(matches!(m.events[0].body, EventBody::Reset(_)));
    assert_eq!(
        decide_event(None, 4, &m.events[0]),
        Decision::Ignore(IgnoreReason::Reset)
    );
}

#[test]
fn dedup_by_id_rule_an_applied_event_id_is_ignored_as_duplicate() {
    let e = event(update_json("evt_same", 7, 10, item_json(7, 10, &[], "a")));
    let applied = |id: &str| id == "evt_same";
    assert!(is_duplicate(applied, &e));
    assert_eq!(
        decide_event_dedup(applied, None, 2, &e),
        Decision::Ignore(IgnoreReason::Duplicate)
    );
    assert!(matches!(
        decide_event_dedup(|_| false, None, 2, &e),
        Decision::Store { .. }
    ));
}

// ---- Messages: generations, access versions, resets, order ----

fn loaded(generation: u64, av: &str) -> EndpointTrack {
    EndpointTrack {
        generation: Some(generation),
        access_version: Some(av.into()),
        through: Some("1.10".into()),
        ..Default::default()
    }
}

#[test]
fn older_generation_rule_a_message_of_an_older_generation_is_skipped() {
    let state = loaded(4, "av");
    let (next, d) = step(&state, &message(3, "av", "1.20", vec![]));
    assert_eq!(
        d,
        MessageDecision::SkipOlderGeneration {
            generation: 3,
            held: 4
        }
    );
    assert_eq!(next, state);
}

#[test]
fn apply_in_order_rule_a_reset_applied_after_a_newer_message_reads_as_older_and_is_skipped() {
    // The reset of generation 5 was received first but a message sent after it was applied first.
    let (after, d) = step(&loaded(4, "av"), &message(5, "av", "1.30", vec![]));
    assert!(matches!(
        d,
        MessageDecision::ApplyEvents {
            generation: 5,
            reload: None
        }
    ));
    let (next, d) = step(&after, &reset(5, "av", "behind"));
    assert_eq!(
        d,
        MessageDecision::SkipOlderGeneration {
            generation: 5,
            held: 5
        }
    );
    assert_eq!(next, after);
    // An older one too.
    let (_, d) = step(&after, &reset(4, "av", "behind"));
    assert!(matches!(d, MessageDecision::SkipOlderGeneration { .. }));
}

#[test]
fn reset_rule_every_reason_is_handled_the_same_way() {
    for reason in [
        "access_changed",
        "behind",
        "filter_changed",
        "something_new",
    ] {
        let (next, d) = step(&loaded(4, "av"), &reset(5, "av2", reason));
        let MessageDecision::BeginReload(r) = d else {
            panic!("{d:?}")
        };
        assert_eq!(
            (r.generation, r.access_version.as_deref()),
            (5, Some("av2"))
        );
        assert_eq!(next.access_version.as_deref(), Some("av2"));
        assert_eq!(next.reload, Some(r));
    }
}

#[test]
fn merge_rule_a_newer_reset_during_the_read_supersedes_the_running_reload() {
    let (running, _) = step(&loaded(4, "av"), &reset(5, "av", "behind"));
    let (next, d) = step(&running, &reset(6, "av", "behind"));
    let MessageDecision::SupersedeReload { stopped, begun } = d else {
        panic!("{d:?}")
    };
    assert_eq!((stopped.generation, begun.generation), (5, 6));
    assert_eq!(next.reload.as_ref(), Some(&begun));
    // The stopped reload's merge changes nothing about the track.
    assert_eq!(next.reload_merged(&stopped, "av"), next);
    // The running one's merge ends it.
    let done = next.reload_merged(&begun, "av");
    assert_eq!(done.reload, None);
}

#[test]
fn merge_rule_a_rewinds_newer_generation_without_a_reset_leaves_the_reload_going() {
    let (running, _) = step(&loaded(4, "av"), &reset(5, "av", "behind"));
    let (next, d) = step(&running, &message(6, "av", "1.40", vec![]));
    assert_eq!(
        d,
        MessageDecision::ApplyEvents {
            generation: 6,
            reload: None
        }
    );
    assert_eq!(next.reload, running.reload);
    assert_eq!(next.generation, Some(6));
}

#[test]
fn access_version_rule_a_message_under_another_access_version_begins_a_reload_at_its_generation() {
    let (next, d) = step(&loaded(4, "old"), &message(4, "new", "1.20", vec![]));
    let expected = Reload {
        generation: 4,
        access_version: Some("new".into()),
        cause: ReloadCause::AccessVersion,
        read_again: 0,
    };
    assert_eq!(
        d,
        MessageDecision::ApplyEvents {
            generation: 4,
            reload: Some(ReloadStart::Begin(expected.clone())),
        }
    );
    assert_eq!(next.access_version.as_deref(), Some("new"));
    assert_eq!(next.reload, Some(expected));
    // The next message under the same new access_version begins nothing more.
    let (_, d) = step(&next, &message(4, "new", "1.21", vec![]));
    assert_eq!(
        d,
        MessageDecision::ApplyEvents {
            generation: 4,
            reload: None
        }
    );
    // One under yet another replaces the running reload.
    let (_, d) = step(&next, &message(4, "newer", "1.22", vec![]));
    assert!(matches!(
        d,
        MessageDecision::ApplyEvents {
            reload: Some(ReloadStart::Supersede { .. }),
            ..
        }
    ));
}

#[test]
fn ignore_unnamed_rule_a_track_version_1_does_not_name_is_ignored() {
    let m = parse(
        json!({"v": 1, "webhook_endpoint_id": ENDPOINT, "track": "stories",
                         "generation": 9, "events": []}),
    );
    let state = loaded(4, "av");
    assert_eq!(
        step(&state, &m),
        (state.clone(), MessageDecision::IgnoredTrack)
    );
}

#[test]
fn older_generation_rule_a_feed_message_without_a_generation_is_quarantined_and_read_again() {
    let m = parse(
        json!({"v": 1, "webhook_endpoint_id": ENDPOINT, "track": "feed",
                         "events": []}),
    );
    let (track, d) = step(&loaded(4, "av"), &m);
    let MessageDecision::Quarantine { why, reload } = d else {
        panic!("{d:?}")
    };
    assert_eq!(why, Unapplicable::MissingGeneration);
    assert!(matches!(reload, ReloadStart::Begin(ref r) if r.generation == 4));
    assert_eq!(track.reload.map(|r| r.generation), Some(4));
}

#[test]
fn through_rule_messages_of_events_keep_their_through_a_reset_marks_the_last_taken() {
    let (a, _) = step(&loaded(4, "av"), &message(4, "av", "1.20", vec![]));
    assert_eq!(
        (a.through.as_deref(), a.last_was_reset),
        (Some("1.20"), false)
    );
    let (b, _) = step(&a, &reset(5, "av", "behind"));
    assert_eq!(
        (b.through.as_deref(), b.last_was_reset),
        (Some("1.20"), true)
    );
    assert_eq!(restore_plan(&b), RestorePlan::Reload);
    let (c, _) = step(&b, &message(5, "av", "1.25", vec![]));
    assert_eq!(
        restore_plan(&c),
        RestorePlan::Rewind {
            since: "1.25".into()
        }
    );
}

#[test]
fn reload_rule_a_reload_begun_and_not_merged_survives_a_restart_as_json() {
    let (running, _) = step(&loaded(4, "av"), &reset(5, "av", "behind"));
    let text = serde_json::to_string(&running).unwrap();
    let back: EndpointTrack = serde_json::from_str(&text).unwrap();
    assert_eq!(back, running);
    assert!(back.reload.is_some());
}

#[test]
fn read_again_rules_a_reload_no_message_began_takes_the_pages_access_version() {
    let (next, start) = loaded(4, "av").read_feed_again();
    let ReloadStart::Begin(r) = start else {
        panic!("{start:?}")
    };
    assert_eq!((r.generation, r.access_version.clone()), (4, None));
    assert_eq!(
        check_pages(r.access_version.as_deref(), ["x", "x"]),
        PagesCheck::Agree
    );
    assert_eq!(
        next.reload_merged(&r, "x").access_version.as_deref(),
        Some("x")
    );
}

#[test]
fn read_again_rules_a_running_reload_reads_its_pages_again() {
    // A reset's reload runs; its pages may have been read before an item was created whose
    // refetch then failed. Reading again must not merge those pages: the running reload is
    // begun again, the same in all but its count, so its pass starts over.
    let (running, _) = step(&loaded(4, "av"), &reset(5, "av2", "behind"));
    let first = running.reload.clone().unwrap();
    let (next, start) = running.read_feed_again();
    let ReloadStart::Supersede { stopped, begun } = start else {
        panic!("{start:?}")
    };
    assert_eq!(stopped, first);
    assert_eq!(begun.read_again, 1);
    assert_eq!(
        (begun.generation, &begun.access_version, &begun.cause),
        (first.generation, &first.access_version, &first.cause)
    );
    assert_eq!(next.reload.as_ref(), Some(&begun));
    assert_eq!(next.access_version.as_deref(), Some("av2"));
    // The first read's merge changes nothing now; the restarted one's does.
    assert_eq!(next.reload_merged(&first, "av2"), next);
    let merged = next.reload_merged(&begun, "av2");
    assert_eq!(merged.reload, None);
    // Kept with the copy: it survives a restart as JSON, and one stored before the count
    // existed reads as never begun again.
    let text = serde_json::to_string(&next).unwrap();
    assert_eq!(serde_json::from_str::<EndpointTrack>(&text).unwrap(), next);
    let old: Reload =
        serde_json::from_str(r#"{"generation":5,"access_version":"av2","cause":"AccessVersion"}"#)
            .unwrap();
    assert_eq!(old.read_again, 0);
}

// ---- Merge ----

#[test]
fn merge_rule_keeps_events_that_arrived_while_reading_stores_the_rest_drops_older_generations() {
    let mut copy = FeedCopy::new();
    // Before the reset of generation 5: 1 and 2 items, 3 a tombstone, all generation 4.
    copy.apply_event(4, &feed_event(1, 4, 10, false));
    copy.apply_event(4, &feed_event(2, 4, 10, false));
    copy.apply_event(4, &feed_event(3, 4, 10, true));
    // While reading: 1 updated at generation 5 after the page read it; 4 removed at generation 5.
    copy.apply_event(5, &feed_event(1, 5, 30, false));
    copy.apply_event(5, &feed_event(4, 5, 30, true));
    // The pages: 1 at 20 (older than the event), 4 at 25 (before its removal), 5 new.
    let read = [read_item(1, 20), read_item(4, 25), read_item(5, 25)];
    let (decisions, removed) = copy.merge(5, &read);
    assert_eq!(decisions[0], Decision::Ignore(IgnoreReason::KeptByMerge));
    assert_eq!(decisions[1], Decision::Ignore(IgnoreReason::KeptByMerge));
    assert!(matches!(
        decisions[2],
        Decision::Store { generation: 5, .. }
    ));
    assert_eq!(removed, vec![subject(2)]);
    let rows: Vec<(String, u64, Sequence, bool)> = copy
        .rows()
        .iter()
        .map(|(s, h)| {
            (
                s.clone(),
                h.generation,
                h.sequence.clone(),
                h.is_tombstone(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            (subject(1), 5, seq(30), false),
            (subject(4), 5, seq(30), true),
            (subject(5), 5, seq(25), false),
        ]
    );
}

// ---- Refetch answers ----

fn pending() -> PendingRefetch {
    PendingRefetch {
        subject: subject(7),
        feed_item_id: subject(7),
        generation: 3,
        sequence: seq(1052),
    }
}

fn found(av: &str) -> RefetchAnswer {
    let item = relay_wire::FeedItem::from_value(item_json(7, 1045, &[("flash:1", 1)], "r"), "item")
        .unwrap();
    RefetchAnswer::Found {
        access_version: av.into(),
        sequence: seq(1045),
        item,
    }
}

#[test]
fn refetch_rule_an_answer_under_the_copys_access_version_applies_at_the_events_position() {
    let out = decide_refetch(Some("av"), None, &pending(), false, 1, &found("av"));
    let RefetchOutcome::Apply(decision) = out else {
        panic!("{out:?}")
    };
    let Decision::Store {
        generation,
        sequence,
        ..
    } = *decision
    else {
        panic!("{decision:?}")
    };
    assert_eq!((generation, sequence), (3, seq(1052)));
    // ... by the feed item rule: a held row at a later sequence wins.
    let mut copy = FeedCopy::new();
    copy.apply_event(
        3,
        &event(update_json("e", 7, 1060, item_json(7, 1060, &[], "a"))),
    );
    let out = decide_refetch(
        Some("av"),
        copy.get(&subject(7)),
        &pending(),
        false,
        1,
        &found("av"),
    );
    assert_eq!(
        out,
        RefetchOutcome::Apply(Box::new(Decision::Ignore(IgnoreReason::Older)))
    );
}

#[test]
fn refetch_rule_a_404_under_the_copys_access_version_removes_the_item_at_that_sequence() {
    let mut copy = FeedCopy::new();
    copy.apply_event(
        3,
        &event(update_json("e", 7, 1045, item_json(7, 1045, &[], "a"))),
    );
    let answer = RefetchAnswer::NotFound {
        access_version: "av".into(),
    };
    let out = decide_refetch(
        Some("av"),
        copy.get(&subject(7)),
        &pending(),
        false,
        1,
        &answer,
    );
    assert_eq!(
        out,
        RefetchOutcome::Apply(Box::new(Decision::Tombstone {
            subject: subject(7),
            generation: 3,
            sequence: seq(1052),
            removed_item: true,
        }))
    );
}

#[test]
fn refetch_rule_an_answer_under_another_access_version_404_included_means_read_the_feed_again() {
    let not_found = RefetchAnswer::NotFound {
        access_version: "other".into(),
    };
    for answer in [found("other"), not_found] {
        assert_eq!(
            decide_refetch(Some("av"), None, &pending(), false, 1, &answer),
            RefetchOutcome::Reload
        );
    }
    // A copy under no access_version yet has no answer "under the copy's".
    assert_eq!(
        decide_refetch(None, None, &pending(), false, 1, &found("av")),
        RefetchOutcome::Reload
    );
}

#[test]
fn refetch_rule_a_load_balancers_404_is_tried_again_a_few_times_then_the_feed_is_read_again() {
    for answer in [RefetchAnswer::LoadBalancer404, RefetchAnswer::Failed] {
        let outcomes: Vec<_> = (1..=REFETCH_ATTEMPTS)
            .map(|attempt| decide_refetch(Some("av"), None, &pending(), false, attempt, &answer))
            .collect();
        assert_eq!(
            outcomes,
            vec![
                RefetchOutcome::Retry { attempt: 2 },
                RefetchOutcome::Retry { attempt: 3 },
                RefetchOutcome::Reload,
            ]
        );
    }
}

#[test]
fn refetch_rule_the_answer_is_dropped_when_a_newer_reset_arrived_during_the_read() {
    let p = pending();
    assert!(p.overtaken_by(Some(4)));
    assert!(!p.overtaken_by(Some(3)));
    assert!(!p.overtaken_by(None));
    assert_eq!(
        decide_refetch(Some("av"), None, &p, true, 1, &found("av")),
        RefetchOutcome::Drop
    );
    let d = decide_event(None, 3, &event(refetch_json("e", 7, 1052)));
    assert_eq!(PendingRefetch::from_decision(&d), Some(p));
}

// ---- The wire file's examples in order, as the sequencer runs them ----

#[test]
fn wire_examples_in_order_events_refetch_reset_and_merge_through_an_endpoint() {
    let mut endpoint = Endpoint::new();
    let r = endpoint.receive(&wire_example("events"));
    assert!(matches!(
        r.message,
        MessageDecision::ApplyEvents { generation: 3, .. }
    ));
    assert!(matches!(
        r.events[..],
        [Decision::Store { .. }, Decision::Tombstone { .. }]
    ));
    // The empty copy's reload, read under b4d934cf with nothing in it.
    let reload = endpoint.track.reload.clone().unwrap();
    assert!(endpoint.merge(&reload, &["b4d934cf"], &[]).is_some());
    assert_eq!(endpoint.track.access_version.as_deref(), Some("b4d934cf"));

    let r = endpoint.receive(&wire_example("events with a refetch"));
    assert_eq!(
        r.message,
        MessageDecision::ApplyEvents {
            generation: 3,
            reload: None
        }
    );
    let pending = PendingRefetch::from_decision(&r.events[0]).unwrap();
    let item = relay_wire::FeedItem::from_value(
        item_json(88001, 1045, &[("flash:11", 1)], "read"),
        "item",
    )
    .unwrap();
    let answer = RefetchAnswer::Found {
        access_version: "b4d934cf".into(),
        sequence: seq(1045),
        item: item.clone(),
    };
    let RefetchOutcome::Apply(decision) = decide_refetch(
        endpoint.track.access_version.as_deref(),
        endpoint.copy.get(&pending.subject),
        &pending,
        pending.overtaken_by(endpoint.track.last_reset_generation),
        1,
        &answer,
    ) else {
        panic!()
    };
    endpoint.copy.apply(&decision);
    let held = endpoint.copy.get("announcement:88001").unwrap();
    assert_eq!(
        (held.generation, held.sequence.as_str()),
        (3, "0000000001.0000000000000001052")
    );

    // The refetch's id is kept: the same message again changes nothing.
    let r = endpoint.receive(&wire_example("events with a refetch"));
    assert_eq!(r.events, vec![Decision::Ignore(IgnoreReason::Duplicate)]);

    let r = endpoint.receive(&wire_example("reset"));
    let MessageDecision::BeginReload(reload) = r.message else {
        panic!("{:?}", r.message)
    };
    // The reset's pages hold the same item at the same sequence: only its generation rises.
    let read = [ReadItem {
        subject: "announcement:88001".into(),
        sequence: Sequence::new("0000000001.0000000000000001052"),
        item,
    }];
    let (decisions, removed) = endpoint.merge(&reload, &["b4d934cf"], &read).unwrap();
    assert!(matches!(
        decisions[..],
        [Decision::Unchanged { generation: 4, .. }]
    ));
    assert!(removed.is_empty());
    let rows: Vec<_> = endpoint
        .copy
        .rows()
        .values()
        .map(|h| h.generation)
        .collect();
    assert_eq!(rows, vec![4]);
    assert_eq!(restore_plan(&endpoint.track), RestorePlan::Reload);
}

#[test]
fn keep_event_ids_rule_after_a_restore_and_rewind_resent_events_apply_once() {
    let a = message(3, "av", "1.20", vec![feed_event_json(1, 3, 20, false)]);
    let mut endpoint = Endpoint::new();
    endpoint.receive(&a);
    let backup = endpoint.clone(); // the ids are in the same backup as the rows
    let b = message(3, "av", "1.30", vec![feed_event_json(1, 3, 30, true)]);
    endpoint.receive(&b);

    // Restored: rewind to the kept through; the track resends from there under generation 4.
    let mut restored = backup;
    assert_eq!(
        restore_plan(&restored.track),
        RestorePlan::Rewind {
            since: "1.20".into()
        }
    );
    assert_eq!(
        decide_rewind(&RewindAnswer::Accepted { generation: 4 }),
        RewindOutcome::Nothing
    );
    // An event the backup applied, resent under the newer generation, would otherwise win
    // whatever its sequence: its kept id stops it.
    let again_a = message(4, "av", "1.20", vec![feed_event_json(1, 3, 20, false)]);
    let r = restored.receive(&again_a);
    assert_eq!(r.events, vec![Decision::Ignore(IgnoreReason::Duplicate)]);
    // What was applied after the backup is applied again.
    let again_b = message(4, "av", "1.30", vec![feed_event_json(1, 3, 30, true)]);
    let r = restored.receive(&again_b);
    assert!(matches!(
        r.events[..],
        [Decision::Tombstone { generation: 4, .. }]
    ));
}
