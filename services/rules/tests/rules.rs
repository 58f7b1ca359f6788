//! One or more tests per reading rule of the wire file, named after the rule, on the wire file's
//! own example messages and on small hand-built ones. `RULES.md` beside the crate maps each rule
//! (by its id) to these tests.

mod common;
mod support;

use std::collections::{HashMap, HashSet};

use common::*;
use relay_rules::*;
use relay_wire::{EventBody, Sequence};
use serde_json::json;
use support::*;

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
    let first = apply_event(&mut copy, generation, &message.events[0]);
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

    let second = apply_event(&mut copy, generation, &message.events[1]);
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
        apply_event(&mut copy, 3, e);
    }
    assert_eq!(apply_event(&mut copy, 3, &message.events[0]), expected);
}

#[test]
fn wire_example_reset_begins_a_reload_at_generation_4_under_b4d934cf() {
    let (after_events, _) = step(&EndpointTrack::default(), &wire_example("events"));
    let first = after_events.reload.clone().unwrap();
    assert_eq!((first.round, after_events.reloads_begun), (1, 1));
    let merged = after_events.reload_merged(&first, 0, 3, "b4d934cf");
    assert_eq!(merged.reload, None);
    let (track, decision) = step(&merged, &wire_example("reset"));
    // The second reload begun on the track: round 2.
    let begun = Reload {
        generation: 4,
        access_version: Some("b4d934cf".into()),
        cause: ReloadCause::Reset {
            reason: "access_changed".into(),
        },
        read_again: 0,
        round: 2,
    };
    assert_eq!(decision, MessageDecision::BeginReload(begun.clone()));
    assert_eq!(track.reloads_begun, 2);
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
            assert_eq!(
                apply_event(&mut copy, 3, e),
                Decision::Ignore(IgnoreReason::Test)
            );
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
    let d = apply_event(&mut copy, 2, &event(removal_json("e1", "withdrawn", 7, 20)));
    assert!(matches!(
        d,
        Decision::Tombstone {
            removed_item: false,
            ..
        }
    ));
    assert!(!d.is_change());
    let late = event(plain_update_json("e0", 7, 19, "a"));
    assert_eq!(
        apply_event(&mut copy, 2, &late),
        Decision::Ignore(IgnoreReason::Older)
    );
    // At the same sequence, the removal wins too.
    let same = event(plain_update_json("e0b", 7, 20, "a"));
    assert_eq!(
        apply_event(&mut copy, 2, &same),
        Decision::Ignore(IgnoreReason::Older)
    );
    assert!(copy.get(&subject(7)).unwrap().is_tombstone());
    // The same tombstone again is already carried out.
    let again = event(removal_json("e1b", "hidden", 7, 20));
    assert_eq!(
        apply_event(&mut copy, 2, &again),
        Decision::Ignore(IgnoreReason::AlreadyRemoved)
    );
}

#[test]
fn feed_item_event_rule_at_an_equal_sequence_a_removal_wins_over_the_item() {
    let mut copy = FeedCopy::new();
    apply_event(&mut copy, 2, &event(plain_update_json("e1", 7, 20, "a")));
    let d = apply_event(&mut copy, 2, &event(removal_json("e2", "hidden", 7, 20)));
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
    apply_event(&mut copy, 3, &event(plain_update_json("e1", 7, 900, "a")));
    let newer = event(plain_update_json("e2", 7, 5, "b"));
    assert!(matches!(
        apply_event(&mut copy, 4, &newer),
        Decision::Store { generation: 4, .. }
    ));
    let older = event(removal_json("e3", "hidden", 7, 99_999));
    assert_eq!(
        apply_event(&mut copy, 3, &older),
        Decision::Ignore(IgnoreReason::OlderGeneration)
    );
}

#[test]
fn feed_item_event_rule_compare_parts_an_identical_item_is_unchanged_and_writes_no_outbox_row() {
    let mut copy = FeedCopy::new();
    let body = item_json(7, 10, &[("flash:1", 1), ("story:2", 1)], "a");
    apply_event(&mut copy, 2, &event(update_json("e1", 7, 10, body.clone())));
    let d = apply_event(&mut copy, 2, &event(update_json("e2", 7, 12, body)));
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
    let between = event(plain_update_json("e3", 7, 11, "z"));
    assert_eq!(
        apply_event(&mut copy, 2, &between),
        Decision::Ignore(IgnoreReason::Older)
    );

    // Same parts, other JSON: a real change with an empty parts diff.
    let other = item_json(7, 10, &[("flash:1", 1), ("story:2", 1)], "b");
    let d = apply_event(&mut copy, 2, &event(update_json("e4", 7, 13, other)));
    assert!(matches!(&d, Decision::Store { diff, .. } if diff.is_empty()));
    // A part version rises, one appears, one goes.
    let next = item_json(7, 10, &[("story:2", 2), ("flash:3", 1)], "b");
    let d = apply_event(&mut copy, 2, &event(update_json("e5", 7, 14, next)));
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
    apply_event(&mut copy, 3, &event(plain_update_json("e1", 7, 60, "a")));
    let e = event(refetch_json("e2", 7, 52));
    assert_eq!(
        apply_event(&mut copy, 3, &e),
        Decision::Ignore(IgnoreReason::Older)
    );
    // At an equal sequence the answer may be a 404 (a removal wins there): read it.
    let e = event(refetch_json("e3", 7, 60));
    assert!(matches!(
        apply_event(&mut copy, 3, &e),
        Decision::Refetch { .. }
    ));
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
    let e = plain_update_json("evt_same", 7, 10, "a");
    let m = [Ok(message(2, "av", "1.10", vec![e.clone()]))];
    let track = loaded(2, "av");
    let no_reads = HashMap::new();
    let decide = |seen: &HashSet<String>| {
        decide_run(
            Run {
                track: &track,
                messages: &m,
                seen,
                refetches: &no_reads,
            },
            Default::default(),
        )
    };
    // Applied before (the id is kept with the copy): ignored, nothing written, nothing kept again.
    let plan = decide(&HashSet::from(["evt_same".to_owned()]));
    assert_eq!(
        plan.events,
        vec![EventOutcome::Ignored(IgnoreReason::Duplicate)]
    );
    assert!(plan.rows.is_empty() && plan.changes.is_empty() && plan.keep.is_empty());
    assert_eq!(
        (
            plan.messages[0].events_applied,
            plan.messages[0].events_ignored
        ),
        (0, 1)
    );
    // Not applied before: stored, and its id kept in the same plan as the row.
    let plan = decide(&HashSet::new());
    assert_eq!(plan.events, vec![EventOutcome::Stored]);
    assert_eq!(plan.keep, vec!["evt_same".to_owned()]);
    assert_eq!(plan.rows.len(), 1);
}

#[test]
fn dedup_by_id_rule_an_id_repeated_within_one_run_applies_once() {
    // The same event id in two messages of one run (a retry the upstream rebuilt, say), and a
    // removal with the same id as an update: the id decides, not the content.
    let update = plain_update_json("evt_1", 7, 10, "a");
    let removal = removal_json("evt_1", "hidden", 7, 11);
    let mut endpoint = loaded_endpoint(2);
    let plan = run(
        &mut endpoint,
        &[
            message(2, "av", "1.10", vec![update.clone()]),
            message(2, "av", "1.11", vec![update, removal]),
        ],
    );
    assert_eq!(
        plan.events,
        vec![
            EventOutcome::Stored,
            EventOutcome::Ignored(IgnoreReason::Duplicate),
            EventOutcome::Ignored(IgnoreReason::Duplicate),
        ]
    );
    assert_eq!(plan.keep, vec!["evt_1".to_owned()]);
    assert!(is_item(endpoint.copy.get(&subject(7))));
    // The id is kept with the copy: a later run ignores it too.
    let again = run(
        &mut endpoint,
        &[message(
            2,
            "av",
            "1.12",
            vec![removal_json("evt_1", "hidden", 7, 12)],
        )],
    );
    assert_eq!(
        again.events,
        vec![EventOutcome::Ignored(IgnoreReason::Duplicate)]
    );
    assert!(is_item(endpoint.copy.get(&subject(7))));
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

/// An endpoint whose track is [`loaded`] at `generation` under "av", its copy empty.
fn loaded_endpoint(generation: u64) -> Endpoint {
    Endpoint {
        track: loaded(generation, "av"),
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
    assert_eq!((stopped.round, begun.round), (1, 2));
    assert_eq!(next.reload.as_ref(), Some(&begun));
    // The stopped reload's merge changes nothing about the track.
    assert_eq!(next.reload_merged(&stopped, 0, 5, "av"), next);
    // ... and its pass is not merged at all.
    assert_eq!(
        decide_merge(
            &next,
            &stopped,
            &pass("av", vec![], None, 0),
            &Default::default()
        ),
        MergePlan::Superseded
    );
    // The running one's merge ends it.
    let done = next.reload_merged(&begun, 0, 6, "av");
    assert_eq!(done.reload, None);
    assert_eq!(done.generation, Some(6));
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
        round: 1,
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
    assert_eq!(restore_plan(&b, None), RestorePlan::Reload);
    let (c, _) = step(&b, &message(5, "av", "1.25", vec![]));
    assert_eq!(
        restore_plan(&c, None),
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
    let merged = next.reload_merged(&r, 0, 4, "x");
    assert_eq!(merged.access_version.as_deref(), Some("x"));
    assert_eq!(merged.reload, None);
}

#[test]
fn read_again_rules_a_running_reload_reads_another_pass() {
    // A reset's reload runs; its pass may have been read before an item was created whose
    // refetch then failed. Reading again must not let that pass end the reload: the running
    // reload is asked to read another pass (the same reload, its count raised), and only a pass
    // begun after the ask ends it.
    let (running, _) = step(&loaded(4, "av"), &reset(5, "av2", "behind"));
    let first = running.reload.clone().unwrap();
    let (next, start) = running.read_feed_again();
    let ReloadStart::ReadAgain(again) = start else {
        panic!("{start:?}")
    };
    assert_eq!(again.read_again, 1);
    assert!(again.is(&first) && first.is(&again));
    assert_eq!(
        (
            again.generation,
            &again.access_version,
            &again.cause,
            again.round
        ),
        (
            first.generation,
            &first.access_version,
            &first.cause,
            first.round
        )
    );
    assert_eq!(next.reloads_begun, running.reloads_begun, "no reload begun");
    assert_eq!(next.reload.as_ref(), Some(&again));
    assert_eq!(next.access_version.as_deref(), Some("av2"));
    // The pass begun before the ask is merged, and the reload goes on.
    let after_stale = next.reload_merged(&first, 0, 5, "av2");
    assert_eq!(after_stale.reload.as_ref(), Some(&again));
    // A pass begun after it ends the reload.
    let merged = after_stale.reload_merged(&again, 1, 5, "av2");
    assert_eq!(merged.reload, None);
    // Asked again while running, the count rises again.
    let (twice, start) = next.read_feed_again();
    assert!(matches!(start, ReloadStart::ReadAgain(ref r) if r.read_again == 2));
    assert_eq!(twice.reloads_begun, next.reloads_begun);
    // Kept with the copy: it survives a restart as JSON, and one stored before the count and
    // the round existed reads as never begun again, round 0.
    let text = serde_json::to_string(&next).unwrap();
    assert_eq!(serde_json::from_str::<EndpointTrack>(&text).unwrap(), next);
    let old: Reload =
        serde_json::from_str(r#"{"generation":5,"access_version":"av2","cause":"AccessVersion"}"#)
            .unwrap();
    assert_eq!((old.read_again, old.round), (0, 0));
}

#[test]
fn read_again_rules_a_pass_begun_before_the_ask_is_merged_then_another_is_read() {
    // Through an endpoint: a reset's reload, a message that cannot be applied while it reads
    // (quarantined: read /v1/feed again), the pass begun before it merged, the reload still on.
    let mut endpoint = loaded_endpoint(4);
    run(&mut endpoint, &[reset(5, "av", "behind")]);
    let reload = endpoint.track.reload.clone().unwrap();
    let plan = endpoint.run(&[Err("not json".into())], &HashMap::new());
    assert_eq!(endpoint.outcomes.last(), Some(&Outcome::Quarantined));
    assert!(matches!(plan.reloads[..], [ReloadStart::ReadAgain(ref r)] if r.read_again == 1));
    let stale = pass("av", vec![read_item(1, 10)], None, 0);
    let merge = merged(endpoint.merge(&reload, &stale));
    assert_eq!(merge.generation, 5);
    assert!(endpoint.track.reload.is_some(), "another pass is read");
    assert!(is_item(endpoint.copy.get(&subject(1))));
    // The next pass (begun after the ask) lacks the item: a newer pass at the same generation.
    // The item was written by the reload's own earlier pass, in the same round: it is not an
    // item "held from before the reload", so it stays (the upstream's removal comes as an
    // event, or a later reload drops it).
    let running = endpoint.track.reload.clone().unwrap();
    let merge = merged(endpoint.merge(&running, &pass("av", vec![read_item(2, 11)], None, 1)));
    assert!(merge.withdrawn.is_empty());
    assert_eq!(endpoint.track.reload, None);
    assert_eq!(
        positions(&endpoint.copy),
        positions_of(&[(1, 5, 10, false), (2, 5, 11, false)])
    );
}

// ---- Merge ----

/// An endpoint at generation 4 holding the items 1 and 2 and the tombstone 3 (all at seq 10),
/// then a reset of generation 5 taken: the endpoint, and the reload the reset began.
fn reset_over_generation_4() -> (Endpoint, Reload) {
    let mut endpoint = loaded_endpoint(4);
    run_feed(
        &mut endpoint,
        4,
        "av",
        "1.10",
        &[(1, 4, 10, false), (2, 4, 10, false), (3, 4, 10, true)],
    );
    run(&mut endpoint, &[reset(5, "av", "behind")]);
    let reload = endpoint.track.reload.clone().unwrap();
    (endpoint, reload)
}

#[test]
fn merge_rule_keeps_events_that_arrived_while_reading_stores_the_rest_drops_older_generations() {
    // Before the reset of generation 5: 1 and 2 items, 3 a tombstone, all generation 4.
    let (mut endpoint, reload) = reset_over_generation_4();
    // While reading: 1 updated at generation 5 after the page read it; 4 removed at generation 5.
    run_feed(
        &mut endpoint,
        5,
        "av",
        "1.30",
        &[(1, 5, 30, false), (4, 5, 30, true)],
    );
    let changes_before = endpoint.changes.len();
    // The pages: 1 at 20 (older than the event), 4 at 25 (before its removal), 5 new.
    let read = vec![read_item(1, 20), read_item(4, 25), read_item(5, 25)];
    let merge = merged(endpoint.merge(&reload, &pass("av", read, Some(5), 0)));
    assert_eq!(merge.generation, 5);
    // 1 and 4: the copy's rows win and are not listed; 5 is stored.
    assert!(matches!(
        &merge.writes[..],
        [Decision::Store { subject: s, generation: 5, .. }] if *s == subject(5)
    ));
    // Everything of generation 4 goes: the item 2 (a removal change) and the tombstone 3.
    assert_eq!(merge.dropped, vec![(subject(2), true), (subject(3), false)]);
    assert!(merge.withdrawn.is_empty());
    assert_eq!(
        positions(&endpoint.copy),
        positions_of(&[(1, 5, 30, false), (4, 5, 30, true), (5, 5, 25, false)])
    );
    assert_eq!(
        endpoint.changes[changes_before..],
        [upsert(5, 25), remove(2)]
    );
    assert_replays(&endpoint);
    assert_eq!(endpoint.track.reload, None);
}

#[test]
fn merge_rule_an_item_held_from_an_older_generation_and_read_again_is_kept_from_the_read() {
    // The pages overlap what the copy held before the reset: the item read is stored (or only
    // its position raised, when it is the same item) at the reset's generation, and the drop of
    // the older generation must not then remove it.
    let (mut endpoint, reload) = reset_over_generation_4();
    // 1 read as it was held (same item), 2 read changed, 3 (a tombstone) read again.
    let read = vec![read_item(1, 10), read_item(2, 12), read_item(3, 14)];
    let merge = merged(endpoint.merge(&reload, &pass("av", read, Some(5), 0)));
    // Each is written at generation 5; none is among the rows dropped by generation.
    assert_eq!(merge.writes.len(), 3, "{merge:?}");
    assert!(merge.dropped.is_empty(), "{merge:?}");
    assert_eq!(
        positions(&endpoint.copy),
        positions_of(&[(1, 5, 10, false), (2, 5, 12, false), (3, 5, 14, false)]),
        "{merge:?}"
    );
    assert_replays(&endpoint);
}

#[test]
fn merge_same_generation_rule_an_item_the_pass_lacks_held_from_before_the_reload_is_withdrawn() {
    // The copy holds generation 3; a message that cannot be applied asks to read /v1/feed again
    // (a reload no message began, under generation 3: nothing is dropped by generation).
    let mut endpoint = loaded_endpoint(3);
    run_feed(
        &mut endpoint,
        3,
        "av",
        "1.10",
        &[
            (1, 3, 10, false),
            (2, 3, 10, false),
            (3, 3, 10, true),
            (5, 3, 10, false),
        ],
    );
    endpoint.run(&[Err("not json".into())], &HashMap::new());
    let reload = endpoint.track.reload.clone().unwrap();
    assert_eq!(
        (reload.generation, reload.cause.clone(), reload.round),
        (3, ReloadCause::ReadAgain, 1)
    );
    // While the pass is read: 4 created, and 5 updated (a message wrote it during the read).
    run_feed(
        &mut endpoint,
        3,
        "av",
        "1.20",
        &[(4, 3, 20, false), (5, 3, 20, false)],
    );
    let changes_before = endpoint.changes.len();
    // The pass holds 2 only: the upstream no longer serves 1 (and never served 4 and 5 when the
    // pages were read).
    let merge = merged(endpoint.merge(&reload, &pass("av", vec![read_item(2, 12)], Some(3), 0)));
    assert_eq!(merge.generation, 3);
    assert!(merge.dropped.is_empty());
    // 1: held from before the reload, not read: withdrawn at its own position. 3, a tombstone,
    // stays one; 4 and 5 were written while the pass was read: kept.
    assert_eq!(merge.withdrawn, vec![(subject(1), seq(10))]);
    assert_eq!(
        positions(&endpoint.copy),
        positions_of(&[
            (1, 3, 10, true),
            (2, 3, 12, false),
            (3, 3, 10, true),
            (4, 3, 20, false),
            (5, 3, 20, false)
        ])
    );
    assert_eq!(
        endpoint.changes[changes_before..],
        [upsert(2, 12), remove(1)]
    );
    assert_replays(&endpoint);
    assert_eq!(endpoint.track.access_version.as_deref(), Some("av"));
    // A late update of generation 3 does not bring 1 back; a newer one (or a newer sequence)
    // still wins.
    let plan = run_feed(&mut endpoint, 3, "av", "1.21", &[(1, 3, 9, false)]);
    assert_eq!(
        plan.events,
        vec![EventOutcome::Ignored(IgnoreReason::Older)]
    );
    let plan = run_feed(&mut endpoint, 3, "av", "1.22", &[(1, 3, 11, false)]);
    assert_eq!(plan.events, vec![EventOutcome::Stored]);
}

#[test]
fn merge_same_generation_rule_applies_to_a_reload_begun_under_another_access_version() {
    // A message under another access_version at the held generation begins a reload under that
    // same generation: items held from before it that its pass lacks go too.
    let mut endpoint = loaded_endpoint(3);
    run_feed(
        &mut endpoint,
        3,
        "av",
        "1.10",
        &[(1, 3, 10, false), (2, 3, 10, false)],
    );
    // The beginning message's own event is applied after the reload began: kept.
    let plan = run_feed(&mut endpoint, 3, "av2", "1.11", &[(6, 3, 11, false)]);
    let [ReloadStart::Begin(reload)] = &plan.reloads[..] else {
        panic!("{:?}", plan.reloads)
    };
    assert_eq!(
        (reload.generation, reload.cause.clone()),
        (3, ReloadCause::AccessVersion)
    );
    // Pages under another access_version than the reload's: not merged.
    assert_eq!(
        endpoint.merge(reload, &pass("av", vec![], Some(3), 0)),
        MergePlan::ReadAgain(PagesCheck::OtherAccessVersion { pages: "av".into() })
    );
    let merge = merged(endpoint.merge(reload, &pass("av2", vec![read_item(2, 10)], Some(3), 0)));
    assert_eq!(merge.withdrawn, vec![(subject(1), seq(10))]);
    assert_eq!(
        positions(&endpoint.copy),
        positions_of(&[(1, 3, 10, true), (2, 3, 10, false), (6, 3, 11, false)])
    );
    assert_eq!(endpoint.track.access_version.as_deref(), Some("av2"));
    assert_replays(&endpoint);
}

#[test]
fn merge_rule_a_reload_no_message_began_merges_under_the_upstreams_newer_generation() {
    // After a restore the upstream may be generations ahead: the endpoint read gives 5, so the
    // pass merges under 5 and everything held from before goes.
    let mut endpoint = loaded_endpoint(3);
    run_feed(
        &mut endpoint,
        3,
        "av",
        "1.10",
        &[(1, 3, 10, false), (2, 3, 10, true)],
    );
    endpoint.run(&[Err("not json".into())], &HashMap::new());
    let reload = endpoint.track.reload.clone().unwrap();
    assert_eq!(reload.merge_generation(Some(5)), 5);
    assert_eq!(reload.merge_generation(Some(2)), 3);
    assert_eq!(reload.merge_generation(None), 3);
    let merge = merged(endpoint.merge(&reload, &pass("av", vec![read_item(7, 40)], Some(5), 0)));
    assert_eq!(merge.generation, 5);
    assert_eq!(merge.dropped, vec![(subject(1), true), (subject(2), false)]);
    assert_eq!(
        positions(&endpoint.copy),
        positions_of(&[(7, 5, 40, false)])
    );
    assert_eq!(endpoint.track.generation, Some(5));
    // A message of generation 4 is now older than held.
    run(&mut endpoint, &[message(4, "av", "1.50", vec![])]);
    assert_eq!(endpoint.outcomes.last(), Some(&Outcome::OlderGeneration));
    // A reset's reload takes its own generation whatever the endpoint read says.
    let reset_reload = Reload {
        generation: 6,
        access_version: Some("av".into()),
        cause: ReloadCause::Reset {
            reason: "behind".into(),
        },
        read_again: 0,
        round: 1,
    };
    assert_eq!(reset_reload.merge_generation(Some(9)), 6);
}

#[test]
fn merge_rule_pages_that_disagree_are_read_again_and_write_nothing() {
    let mut endpoint = loaded_endpoint(3);
    run(&mut endpoint, &[reset(4, "av", "behind")]);
    let reload = endpoint.track.reload.clone().unwrap();
    let before = endpoint.clone();
    let two_pages = Pass {
        page_access_versions: vec!["av".into(), "av9".into()],
        ..pass("av", vec![read_item(1, 1)], Some(4), 0)
    };
    assert_eq!(
        endpoint.merge(&reload, &two_pages),
        MergePlan::ReadAgain(PagesCheck::ReadAgain)
    );
    assert_eq!(endpoint, before);
}

// ---- Runs: outcomes of whole messages ----

#[test]
fn route_by_type_rule_a_run_notes_each_messages_outcome() {
    let other_track = parse(
        json!({"v": 1, "webhook_endpoint_id": ENDPOINT, "track": "stories",
                                   "generation": 9, "events": []}),
    );
    let mut endpoint = loaded_endpoint(4);
    let messages: Vec<StoredMessage> = vec![
        Ok(wire_example("test")),
        Ok(other_track),
        Ok(feed_message(3, "av", "1.5", &[(1, 3, 5, false)])),
        Ok(feed_message(4, "av", "1.6", &[(1, 4, 6, false)])),
        Ok(reset(5, "av", "behind")),
        Ok(reset(6, "av", "behind")),
        Err("not a v1 message".into()),
    ];
    let plan = endpoint.run(&messages, &HashMap::new());
    assert_eq!(
        endpoint.outcomes,
        vec![
            Outcome::Test,
            Outcome::IgnoredTrack,
            Outcome::OlderGeneration,
            Outcome::Applied,
            Outcome::ReloadBegun,
            Outcome::ReloadSuperseded,
            Outcome::Quarantined,
        ]
    );
    assert_eq!(
        plan.messages[6].quarantined,
        Some(Unapplicable::NotV1("not a v1 message".into()))
    );
    // Only the message applied wrote; its event's id is kept, the skipped one's is not.
    assert_eq!(plan.events, vec![EventOutcome::Stored]);
    assert_eq!(plan.keep, vec!["evt_1_4_6_false".to_owned()]);
    assert_eq!(positions(&endpoint.copy), positions_of(&[(1, 4, 6, false)]));
    // The quarantine asked the running reload (generation 6) for another pass.
    assert!(matches!(plan.reloads.last(), Some(ReloadStart::ReadAgain(r)) if r.generation == 6));
    assert_eq!(
        endpoint.track.reload.as_ref().map(|r| r.read_again),
        Some(1)
    );
    assert_eq!(subjects(&messages), vec!["announcement:1"]);
    assert_eq!(
        Outcome::ALL.map(Outcome::as_str),
        [
            "applied",
            "test",
            "ignored_track",
            "older_generation",
            "reload_begun",
            "reload_superseded",
            "quarantined"
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
    let out = decide_refetch(Some("av"), None, &pending(), 1, &found("av"));
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
    apply_event(&mut copy, 3, &event(plain_update_json("e", 7, 1060, "a")));
    let out = decide_refetch(
        Some("av"),
        copy.get(&subject(7)),
        &pending(),
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
    apply_event(&mut copy, 3, &event(plain_update_json("e", 7, 1045, "a")));
    let answer = RefetchAnswer::NotFound {
        access_version: "av".into(),
    };
    let out = decide_refetch(Some("av"), copy.get(&subject(7)), &pending(), 1, &answer);
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
            decide_refetch(Some("av"), None, &pending(), 1, &answer),
            RefetchOutcome::Reload
        );
    }
    // A copy under no access_version yet has no answer "under the copy's".
    assert_eq!(
        decide_refetch(None, None, &pending(), 1, &found("av")),
        RefetchOutcome::Reload
    );
}

#[test]
fn refetch_rule_a_load_balancers_404_is_tried_again_a_few_times_then_the_feed_is_read_again() {
    for answer in [RefetchAnswer::LoadBalancer404, RefetchAnswer::Failed] {
        let outcomes: Vec<_> = (1..=REFETCH_ATTEMPTS)
            .map(|attempt| decide_refetch(Some("av"), None, &pending(), attempt, &answer))
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
fn refetch_rule_read_before_the_next_message_a_newer_resets_reload_reads_the_item() {
    // The relay reads each refetch before deciding the run (so before the message after it):
    // its answer is applied at the refetch's position, and a newer reset after it in the same
    // run begins the reload that reads the item again under the newer generation.
    let d = decide_event(None, 3, &event(refetch_json("e", 7, 1052)));
    assert_eq!(PendingRefetch::from_decision(&d), Some(pending()));
    let mut endpoint = loaded_endpoint(3);
    let messages = [
        Ok(message(
            3,
            "av",
            "1.1052",
            vec![refetch_json("rf", 7, 1052)],
        )),
        Ok(reset(4, "av", "behind")),
    ];
    let reads = HashMap::from([(
        "rf".to_owned(),
        RefetchRead {
            answer: found("av"),
            attempts: 1,
        },
    )]);
    assert_eq!(refetches_wanted(&messages), vec![("rf", "announcement:7")]);
    let plan = endpoint.run(&messages, &reads);
    assert_eq!(plan.events, vec![EventOutcome::Stored]);
    assert_eq!(
        endpoint.outcomes,
        vec![Outcome::Applied, Outcome::ReloadBegun]
    );
    let held = endpoint.copy.get(&subject(7)).unwrap();
    assert_eq!((held.generation, held.sequence.clone()), (3, seq(1052)));
    // The reset's reload (generation 4) reads the item again: whatever its pass holds of it
    // wins over the answer applied at generation 3 (`merge_rule_an_item_held_from_an_older_...`).
    let reload = endpoint.track.reload.clone().unwrap();
    assert_eq!(reload.generation, 4);
    assert_eq!(
        merge_read_item(Some(held), reload.generation, &seq(1)),
        MergeDecision::Store
    );
}

#[test]
fn refetch_rule_in_a_run_answers_apply_or_read_the_feed_again() {
    let answers = [
        // Under the copy's access_version: applied at the event's position.
        (found("av"), 1, EventOutcome::Stored, false),
        // A 404 under it: the item removed at that sequence (nothing held: a tombstone).
        (
            RefetchAnswer::NotFound {
                access_version: "av".into(),
            },
            1,
            EventOutcome::Removed,
            false,
        ),
        // Under another access_version: read /v1/feed again.
        (
            found("other"),
            1,
            EventOutcome::RefetchReload { answered: true },
            true,
        ),
        // A load balancer's 404 every time: read /v1/feed again.
        (
            RefetchAnswer::LoadBalancer404,
            REFETCH_ATTEMPTS,
            EventOutcome::RefetchReload { answered: false },
            true,
        ),
    ];
    for (answer, attempts, outcome, reloads) in answers {
        let mut endpoint = loaded_endpoint(3);
        let m = message(3, "av", "1.1052", vec![refetch_json("rf", 7, 1052)]);
        let plan = run_with(
            &mut endpoint,
            &m,
            &[("rf", RefetchRead { answer, attempts })],
        );
        assert_eq!(plan.events, vec![outcome]);
        assert_eq!(
            plan.keep,
            vec!["rf".to_owned()],
            "a refetch is an event of its own"
        );
        let reload = endpoint.track.reload.clone();
        assert_eq!(reload.is_some(), reloads, "{outcome:?}");
        if let Some(r) = reload {
            assert_eq!(r.cause, ReloadCause::ReadAgain);
            assert_eq!((r.generation, r.access_version), (3, None));
            assert!(endpoint.copy.rows().is_empty());
        }
        // Received again, the refetch's id is applied: no read, no change.
        let again = run_with(&mut endpoint, &m, &[]);
        assert_eq!(
            again.events,
            vec![EventOutcome::Ignored(IgnoreReason::Duplicate)]
        );
    }
    // A refetch not read at all (the driver gave up) is taken as reads that kept failing.
    let mut endpoint = loaded_endpoint(3);
    let m = message(3, "av", "1.1052", vec![refetch_json("rf", 7, 1052)]);
    let plan = run_with(&mut endpoint, &m, &[]);
    assert_eq!(
        plan.events,
        vec![EventOutcome::RefetchReload { answered: false }]
    );
}

// ---- The wire file's examples in order, as the sequencer runs them ----

/// The wire file's examples "events", "events with a refetch" (twice) and "reset", in order,
/// through an endpoint, the first reload merged empty: the endpoint, and the item the refetch
/// answered.
fn wire_examples_through_the_reset() -> (Endpoint, relay_wire::FeedItem) {
    let mut endpoint = Endpoint::new();
    let plan = run(&mut endpoint, &[wire_example("events")]);
    assert_eq!(endpoint.outcomes, vec![Outcome::Applied]);
    assert_eq!(
        plan.events,
        vec![EventOutcome::Stored, EventOutcome::Removed]
    );
    // One row for the subject, as the run left it: the tombstone.
    assert_eq!(plan.rows.len(), 1);
    assert!(plan.rows[0].held.is_tombstone());
    assert_eq!(endpoint.track.generation, Some(3));
    // The empty copy's reload, read under b4d934cf with nothing in it.
    let reload = endpoint.track.reload.clone().unwrap();
    assert!(matches!(plan.reloads[..], [ReloadStart::Begin(ref r)] if *r == reload));
    let merge = merged(endpoint.merge(&reload, &pass("b4d934cf", vec![], Some(3), 0)));
    assert!(merge.writes.is_empty() && merge.dropped.is_empty() && merge.withdrawn.is_empty());
    assert_eq!(endpoint.track.access_version.as_deref(), Some("b4d934cf"));
    assert_eq!(endpoint.track.reload, None);

    let item = relay_wire::FeedItem::from_value(
        item_json(88001, 1045, &[("flash:11", 1)], "read"),
        "item",
    )
    .unwrap();
    let answer = RefetchRead {
        answer: RefetchAnswer::Found {
            access_version: "b4d934cf".into(),
            sequence: seq(1045),
            item: item.clone(),
        },
        attempts: 1,
    };
    let refetch = wire_example("events with a refetch");
    let plan = run_with(
        &mut endpoint,
        &refetch,
        &[("evt_2xsn0jfd40kn2c51j0hmcpej9q", answer)],
    );
    assert_eq!(plan.track, Some(endpoint.track.clone()));
    assert_eq!(endpoint.track.through.as_deref(), Some("1.1052"));
    assert_eq!(plan.events, vec![EventOutcome::Stored]);
    let held = endpoint.copy.get("announcement:88001").unwrap();
    assert_eq!(
        (held.generation, held.sequence.as_str()),
        (3, "0000000001.0000000000000001052")
    );

    // The refetch's id is kept: the same message again changes nothing and reads nothing.
    let plan = run_with(&mut endpoint, &refetch, &[]);
    assert_eq!(
        plan.events,
        vec![EventOutcome::Ignored(IgnoreReason::Duplicate)]
    );
    assert!(plan.rows.is_empty() && plan.changes.is_empty());

    let plan = run(&mut endpoint, &[wire_example("reset")]);
    assert_eq!(endpoint.outcomes.last(), Some(&Outcome::ReloadBegun));
    assert!(matches!(plan.reloads[..], [ReloadStart::Begin(ref r)] if r.generation == 4));
    assert_eq!(restore_plan(&endpoint.track, None), RestorePlan::Reload);
    (endpoint, item)
}

#[test]
fn wire_examples_in_order_events_refetch_and_reset_through_an_endpoint() {
    let (endpoint, _) = wire_examples_through_the_reset();
    assert_eq!(
        endpoint.outcomes,
        vec![
            Outcome::Applied,
            Outcome::Applied,
            Outcome::Applied,
            Outcome::ReloadBegun
        ]
    );
    assert_eq!(endpoint.track.generation, Some(4));
    assert_replays(&endpoint);
}

#[test]
fn wire_examples_in_order_the_resets_merge_raises_the_held_item_to_generation_4() {
    let (mut endpoint, item) = wire_examples_through_the_reset();
    let reload = endpoint.track.reload.clone().unwrap();
    // The reset's pages hold the same item at the same sequence: only its generation rises.
    let read = vec![ReadItem {
        subject: "announcement:88001".into(),
        sequence: Sequence::new("0000000001.0000000000000001052"),
        item,
    }];
    let changes_before = endpoint.changes.len();
    let merge = merged(endpoint.merge(&reload, &pass("b4d934cf", read, Some(4), 0)));
    assert!(matches!(
        merge.writes[..],
        [Decision::Unchanged { generation: 4, .. }]
    ));
    assert!(merge.dropped.is_empty(), "{merge:?}");
    let rows: Vec<_> = endpoint
        .copy
        .rows()
        .values()
        .map(|h| (h.generation, h.is_tombstone()))
        .collect();
    assert_eq!(rows, vec![(4, false)], "{merge:?}");
    assert_eq!(
        endpoint.changes.len(),
        changes_before,
        "an unchanged item is no change"
    );
    assert_replays(&endpoint);
}

#[test]
fn keep_event_ids_rule_after_a_restore_and_rewind_resent_events_apply_once() {
    let a = feed_message(3, "av", "1.20", &[(1, 3, 20, false)]);
    let mut endpoint = Endpoint::new();
    run(&mut endpoint, std::slice::from_ref(&a));
    let backup = endpoint.clone(); // the ids are in the same backup as the rows
    let b = feed_message(3, "av", "1.30", &[(1, 3, 30, true)]);
    run(&mut endpoint, &[b]);

    // Restored: rewind to the kept through; the track resends from there under generation 4.
    let mut restored = backup;
    assert_eq!(
        restore_plan(&restored.track, None),
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
    let again_a = feed_message(4, "av", "1.20", &[(1, 3, 20, false)]);
    let plan = run(&mut restored, &[again_a]);
    assert_eq!(
        plan.events,
        vec![EventOutcome::Ignored(IgnoreReason::Duplicate)]
    );
    // What was applied after the backup is applied again.
    let again_b = feed_message(4, "av", "1.30", &[(1, 3, 30, true)]);
    let plan = run(&mut restored, &[again_b]);
    assert_eq!(plan.events, vec![EventOutcome::Removed]);
    let held = restored.copy.get(&subject(1)).unwrap();
    assert!(held.is_tombstone());
    assert_eq!(held.generation, 4);
}

#[test]
fn through_rule_a_message_taken_before_the_rewind_applies_again_when_the_rewind_resends_it() {
    // The backup holds subject 1 at 1.20; the old relay then took it at 1.25, lost with it.
    let mut endpoint = Endpoint::new();
    run(
        &mut endpoint,
        &[feed_message(3, "av", "1.20", &[(1, 3, 20, false)])],
    );
    let backup = endpoint.clone();
    let pending = PendingRestore {
        through: backup.track.through.clone(),
        last_was_reset: backup.track.last_was_reset,
    };

    // Restored; before the rewind is asked, the upstream's next message comes: 1.29.
    let mut restored = backup.clone();
    run(
        &mut restored,
        &[feed_message(3, "av", "1.29", &[(1, 3, 29, false)])],
    );
    assert_eq!(restored.track.through.as_deref(), Some("1.29"));
    assert_eq!(
        restore_plan(&restored.track, Some(&pending)),
        RestorePlan::Rewind {
            since: "1.20".into()
        },
        "the rewind starts from the backup's through, not the live message's"
    );
    let answered = answer_rewind(
        &restored.track,
        Some(&RewindAnswer::Accepted { generation: 4 }),
        true,
    );
    assert!(answered.release_restore);
    restored.track = answered
        .track
        .expect("the held generation rises to the rewind's");

    // A message of generation 3 still in flight is older now: the rewind sends it again.
    run(
        &mut restored,
        &[feed_message(3, "av", "1.31", &[(1, 3, 31, false)])],
    );
    assert_eq!(restored.outcomes.last(), Some(&Outcome::OlderGeneration));

    // The rewind resends 1.25 and 1.29 under generation 4.
    let resent = [
        feed_message(4, "av", "1.25", &[(1, 3, 25, false)]),
        feed_message(4, "av", "1.29", &[(1, 3, 29, false)]),
    ];
    // Kept, the live message's id would drop its resend after the older 1.25 won.
    let mut kept_ids = restored.clone();
    run(&mut kept_ids, &resent);
    assert_eq!(kept_ids.copy.get(&subject(1)).unwrap().sequence, seq(25));
    // Forgotten (every id applied since the restore), the copy ends on 1.29.
    restored.applied = backup.applied.clone();
    run(&mut restored, &resent);
    let held = restored.copy.get(&subject(1)).unwrap();
    assert_eq!((held.generation, &held.sequence), (4, &seq(29)));
}
