//! Each rewind refusal in the situation the wire file's reading rules name, and an accepted
//! rewind: a new generation, a resend from `since`, no reset. Pure core first, then over HTTP.

use relay_simulator::model::{Access, ChangeKind};
use relay_simulator::upstream::{MessageKind, RewindRefusal, Upstream};
use relay_wire::{Cursor, Message};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::common::{self, call, drain, ok, KEY};

fn cursor(epoch: u64, seq: u64) -> Cursor {
    Cursor { epoch, seq }
}

/// Each rewind to the cursor is refused for its reason, in order.
fn assert_refused(up: &mut Upstream, id: Uuid, cases: &[(Cursor, RewindRefusal)]) {
    for (since, refusal) in cases {
        assert_eq!(up.rewind(id, *since, 0), Err(*refusal), "{since:?}");
    }
}

#[test]
fn each_refusal_happens_in_its_situation() {
    // The endpoint starts with a reset (reason created), resume_from 1.1000.
    let (mut up, id) = common::upstream_with_endpoint(true);

    // reset_pending: a reset is queued and not yet delivered.
    assert_eq!(
        up.rewind(id, cursor(1, 1000), 0),
        Err(RewindRefusal::ResetPending)
    );
    let sent = drain(&mut up, id, 0, ok);
    assert_eq!(sent[0].kind, MessageKind::Reset);

    for n in 0..4 {
        common::create_item(&mut up, n);
    }
    drain(&mut up, id, 0, ok);
    assert_eq!(up.delivered_through(id), Some(cursor(1, 1004)));

    assert_refused(
        &mut up,
        id,
        &[
            // before_reset: the backup is no newer than the last reset (resume_from 1.1000).
            (cursor(1, 1000), RewindRefusal::BeforeReset),
            (cursor(1, 999), RewindRefusal::BeforeReset),
            // cursor_ahead: past the feed's head.
            (cursor(1, 1005), RewindRefusal::CursorAhead),
            // cursor_not_in_epoch: another epoch than the feed's.
            (cursor(2, 1002), RewindRefusal::CursorNotInEpoch),
            (cursor(0, 1002), RewindRefusal::CursorNotInEpoch),
        ],
    );

    // Accepted: generation + 1, resend from since, no reset.
    let before = up.generation(id).unwrap();
    assert_eq!(up.rewind(id, cursor(1, 1002), 0), Ok(before + 1));
    let resent = drain(&mut up, id, 0, ok);
    assert_eq!(resent.len(), 1);
    assert_eq!(resent[0].kind, MessageKind::Events);
    let message = Message::parse(&resent[0].body).unwrap();
    assert_eq!(message.generation, Some(before + 1));
    assert_eq!(message.since.as_deref(), Some("1.1002"));
    assert_eq!(message.through.as_deref(), Some("1.1004"));
    assert_eq!(message.events.len(), 2);

    // After a restore of the feed (new epoch), an old-epoch cursor is cursor_not_in_epoch.
    up.restore_feed(0);
    drain(&mut up, id, 0, ok);
    assert_eq!(
        up.rewind(id, cursor(1, 1003), 0),
        Err(RewindRefusal::CursorNotInEpoch)
    );

    // An access change queues a reset: reset_pending until it is delivered.
    common::change_item_88001(&mut up, ChangeKind::StoryAdded, "s");
    up.set_access(KEY, 31, Some(Access::Teaser), 0).unwrap();
    assert_eq!(
        up.rewind(id, up.world.head(), 0),
        Err(RewindRefusal::ResetPending)
    );
}

/// cursor_ahead also when `since` is past the position the track sends from next: after the
/// upstream rewound the track on its side, a copy kept through a later position (a backup taken
/// before) is ahead, and the messages that follow overlap it.
#[test]
fn a_rewind_past_where_the_track_sends_from_is_cursor_ahead() {
    let (mut up, id) = common::upstream_with_endpoint(true);
    drain(&mut up, id, 0, ok);
    for n in 0..4 {
        common::create_item(&mut up, n);
        drain(&mut up, id, 0, ok);
    }
    assert_eq!(up.delivered_through(id), Some(cursor(1, 1004)));
    let generation = up.generation(id).unwrap();

    // The upstream rewinds the track on its side; nothing is resent yet.
    assert_eq!(up.rewind(id, cursor(1, 1002), 0), Ok(generation + 1));
    assert_refused(
        &mut up,
        id,
        &[
            (cursor(1, 1004), RewindRefusal::CursorAhead),
            (cursor(1, 1003), RewindRefusal::CursorAhead),
        ],
    );
    assert_eq!(up.generation(id), Some(generation + 1), "nothing changed");

    // What follows resends from 1.1002: it overlaps a copy kept through 1.1004.
    let resent = drain(&mut up, id, 0, ok);
    assert_eq!(resent.len(), 1);
    let message = Message::parse(&resent[0].body).unwrap();
    assert_eq!(message.since.as_deref(), Some("1.1002"));
    assert_eq!(message.through.as_deref(), Some("1.1004"));
    assert_eq!(message.generation, Some(generation + 1));

    // Sent through 1.1004 again: a rewind to it is taken.
    assert_eq!(up.rewind(id, cursor(1, 1004), 0), Ok(generation + 2));
}

#[tokio::test]
async fn the_api_answers_202_409_and_401() {
    let (mut up, id) = common::upstream_with_endpoint(true);
    drain(&mut up, id, 0, ok);
    for n in 0..3 {
        common::create_item(&mut up, n);
    }
    drain(&mut up, id, 0, ok);
    let (sim, addr) = common::serve(up).await;
    let client = reqwest::Client::new();
    let rewind_url = format!("http://{addr}/v1/webhook-endpoints/{id}/tracks/feed/rewind");
    let rewind = |token: Option<&'static str>, since: &str| {
        call(
            &client,
            reqwest::Method::POST,
            rewind_url.clone(),
            token,
            Some(json!({"since": since})),
        )
    };

    let (status, _) = rewind(None, "1.1002").await;
    assert_eq!(status, 401);
    let (status, _) = rewind(Some("wrong"), "1.1002").await;
    assert_eq!(status, 401);

    for (since, error) in [
        ("1.1000", "before_reset"),
        ("1.2000", "cursor_ahead"),
        ("7.1002", "cursor_not_in_epoch"),
    ] {
        let (status, text) = rewind(Some(KEY), since).await;
        assert_eq!(status, 409, "{since}");
        assert_eq!(
            serde_json::from_str::<Value>(&text).unwrap(),
            json!({"error": error})
        );
    }
    let generation = sim.lock().generation(id).unwrap();
    let (status, text) = rewind(Some(KEY), "1.1002").await;
    assert_eq!(status, 202);
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap(),
        json!({"generation": generation + 1})
    );

    // The endpoint read shows the new generation.
    let (status, text) = call(
        &client,
        reqwest::Method::GET,
        format!("http://{addr}/v1/webhook-endpoints/{id}"),
        Some(KEY),
        None,
    )
    .await;
    assert_eq!(status, 200);
    let view: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(view["tracks"]["feed"]["generation"], json!(generation + 1));
    assert_eq!(view["lang"], "en");
    assert_eq!(view["status"], "active");
    for field in [
        "companies",
        "markets",
        "part_kinds",
        "teasers",
        "event_types",
    ] {
        assert!(view["filter"].get(field).is_some(), "{field}");
    }

    sim.change(|up, now| up.set_access(KEY, 31, None, now))
        .unwrap();
    let (status, text) = rewind(Some(KEY), "1.1003").await;
    assert_eq!(
        (status, text.as_str()),
        (409, r#"{"error":"reset_pending"}"#)
    );
}
