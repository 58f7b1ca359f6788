//! Each sender and API fault knob, turned fully on, does what it names.

use relay_simulator::model::{ChangeKind, Selection};
use relay_simulator::upstream::{ItemRead, MessageKind, SenderConfig};
use relay_simulator::Faults;
use relay_wire::ItemKind;

use crate::common::{self, drain, ok, KEY, WALL};

#[test]
fn duplicate_delivers_the_same_message_again() {
    let (mut up, id) = common::upstream_with_endpoint(false);
    up.set_faults(Faults {
        duplicate: 1.0,
        ..Faults::default()
    });
    common::create_item(&mut up, 1);
    let sent = drain(&mut up, id, 0, ok);
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[1].kind, MessageKind::Duplicate);
    assert_eq!(sent[1].webhook_id, sent[0].webhook_id);
    assert_eq!(sent[1].body, sent[0].body);
}

#[test]
fn redeliver_old_sends_an_older_message_after_newer_ones() {
    let (mut up, id) = common::upstream_with_endpoint(false);
    up.set_faults(Faults {
        redeliver_old: 1.0,
        ..Faults::default()
    });
    let mut sent = Vec::new();
    for n in 0..4 {
        common::create_item(&mut up, n);
        sent.extend(drain(&mut up, id, 0, ok));
    }
    let redelivery = sent
        .iter()
        .position(|m| m.kind == MessageKind::Redelivery)
        .expect("a redelivery");
    let original = sent
        .iter()
        .position(|m| m.kind == MessageKind::Events && m.webhook_id == sent[redelivery].webhook_id)
        .unwrap();
    assert!(original + 1 < redelivery, "sent after newer messages");
}

#[test]
fn rewind_fault_resends_under_a_new_generation_without_a_reset() {
    let (mut up, id) = common::upstream_with_endpoint(false);
    for n in 0..3 {
        common::create_item(&mut up, n);
        drain(&mut up, id, 0, ok);
    }
    let generation = up.generation(id).unwrap();
    up.set_faults(Faults {
        rewind: 1.0,
        ..Faults::default()
    });
    common::create_item(&mut up, 9);
    let out = up.poll_send(id, 0, WALL).unwrap();
    up.on_answer(
        id,
        out.serial,
        relay_simulator::Answer::status(200),
        0,
        WALL,
    );
    up.set_faults(Faults::default());
    assert_eq!(up.generation(id), Some(generation + 1));
    let resent = drain(&mut up, id, 0, ok);
    assert!(!resent.is_empty());
    assert!(resent.iter().all(|m| m.kind == MessageKind::Events));
}

#[test]
fn stale_reads_serve_a_snapshot_from_before_recent_changes() {
    let mut up = common::upstream(SenderConfig::default());
    common::create_item(&mut up, 1);
    common::create_item(&mut up, 2);
    up.set_faults(Faults {
        stale_reads: 1.0,
        ..Faults::default()
    });
    let mut sizes = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let page = up
            .feed_page(KEY, &Selection::all("en"), None, 100, 0)
            .unwrap();
        sizes.insert(page["data"].as_array().unwrap().len());
    }
    assert!(sizes.iter().all(|n| *n < 2), "never the latest: {sizes:?}");
}

#[test]
fn stale_reads_never_predate_what_the_keys_endpoints_were_sent() {
    let (mut up, id) = common::upstream_with_endpoint(false);
    let first = up
        .create_item(ItemKind::Announcement, 28, "gone soon", 1_791_439_200_000)
        .unwrap()
        .feed_item_id;
    for n in 1..4 {
        common::create_item(&mut up, n);
    }
    drain(&mut up, id, 0, ok);
    up.change_item(&first, ChangeKind::Withdrawn, "", 1_791_439_200_100, false)
        .unwrap();
    up.set_faults(Faults {
        stale_reads: 1.0,
        ..Faults::default()
    });
    let subjects = |up: &mut relay_simulator::Upstream| -> Vec<String> {
        let page = up
            .feed_page(KEY, &Selection::all("en"), None, 100, 0)
            .unwrap();
        page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|entry| entry["subject"].as_str().unwrap().to_owned())
            .collect()
    };
    // The withdrawal was not sent yet: a read may still be from before it.
    assert!((0..20).any(|_| subjects(&mut up).contains(&first)));
    // The backlog is replaced by a reset whose resume_from is past the withdrawal: once it is
    // sent, no read (page or item) is from before it.
    up.queue_reset(id, "behind", 0);
    let sent = drain(&mut up, id, 0, ok);
    assert_eq!(sent[0].kind, MessageKind::Reset);
    for _ in 0..20 {
        assert!(!subjects(&mut up).contains(&first));
        let read = up.item_read(KEY, &first, "en", None).unwrap();
        assert!(matches!(read, ItemRead::Gone(_)), "{read:?}");
    }
}

#[test]
fn reset_mid_reload_resets_the_keys_endpoints_between_pages() {
    let (mut up, id) = common::upstream_with_endpoint(false);
    for n in 0..4 {
        common::create_item(&mut up, n);
    }
    drain(&mut up, id, 0, ok);
    up.set_faults(Faults {
        reset_mid_reload: 1.0,
        ..Faults::default()
    });
    let generation = up.generation(id).unwrap();
    let first = up
        .feed_page(KEY, &Selection::all("en"), None, 2, 0)
        .unwrap();
    assert_eq!(up.generation(id), Some(generation), "not on the first page");
    up.feed_page(
        KEY,
        &Selection::all("en"),
        first["next_cursor"].as_str(),
        2,
        0,
    )
    .unwrap();
    assert_eq!(up.generation(id), Some(generation + 1));
    let sent = drain(&mut up, id, 0, ok);
    assert_eq!(sent[0].kind, MessageKind::Reset);
}

#[test]
fn slow_reads_ask_for_a_delay() {
    let mut up = common::upstream(SenderConfig::default());
    assert_eq!(up.api_delay_ms(), None);
    up.set_faults(Faults {
        slow_reads: 1.0,
        slow_read_ms: 40,
        ..Faults::default()
    });
    assert_eq!(up.api_delay_ms(), Some(40));
}
