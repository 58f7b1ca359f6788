//! Each rewind refusal in the situation the wire file's reading rules name, and an accepted
//! rewind: a new generation, a resend from `since`, no reset. Pure core first, then over HTTP.

use std::time::Duration;

use relay_simulator::driver::Simulation;
use relay_simulator::model::{Access, ChangeKind};
use relay_simulator::upstream::{MessageKind, RewindRefusal, SenderConfig};
use relay_wire::{Cursor, ItemKind, Message};
use serde_json::{json, Value};

use crate::common::{self, drain, ok, KEY};

fn cursor(epoch: u64, seq: u64) -> Cursor {
    Cursor { epoch, seq }
}

#[test]
fn each_refusal_happens_in_its_situation() {
    let mut up = common::upstream(SenderConfig::default());
    // The endpoint starts with a reset (reason created), resume_from 1.1000.
    let id = common::endpoint(&mut up, "http://x/{id}", true);

    // reset_pending: a reset is queued and not yet delivered.
    assert_eq!(
        up.rewind(id, cursor(1, 1000), 0),
        Err(RewindRefusal::ResetPending)
    );
    let sent = drain(&mut up, id, 0, ok);
    assert_eq!(sent[0].kind, MessageKind::Reset);

    for n in 0..4 {
        up.create_item(
            ItemKind::Announcement,
            28,
            &format!("item {n}"),
            1_791_439_200_000 + n,
        )
        .unwrap();
    }
    drain(&mut up, id, 0, ok);
    assert_eq!(up.delivered_through(id), Some(cursor(1, 1004)));

    // before_reset: the backup is no newer than the last reset (resume_from 1.1000).
    assert_eq!(
        up.rewind(id, cursor(1, 1000), 0),
        Err(RewindRefusal::BeforeReset)
    );
    assert_eq!(
        up.rewind(id, cursor(1, 999), 0),
        Err(RewindRefusal::BeforeReset)
    );
    // cursor_ahead: past the feed's head.
    assert_eq!(
        up.rewind(id, cursor(1, 1005), 0),
        Err(RewindRefusal::CursorAhead)
    );
    // cursor_not_in_epoch: another epoch than the feed's.
    assert_eq!(
        up.rewind(id, cursor(2, 1002), 0),
        Err(RewindRefusal::CursorNotInEpoch)
    );
    assert_eq!(
        up.rewind(id, cursor(0, 1002), 0),
        Err(RewindRefusal::CursorNotInEpoch)
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
    up.change_item(
        "announcement:88001",
        ChangeKind::StoryAdded,
        "s",
        1_791_439_300_000,
        false,
    )
    .unwrap();
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
    let mut up = common::upstream(SenderConfig::default());
    let id = common::endpoint(&mut up, "http://x/{id}", true);
    drain(&mut up, id, 0, ok);
    for n in 0..4 {
        up.create_item(
            ItemKind::Announcement,
            28,
            &format!("item {n}"),
            1_791_439_200_000 + n,
        )
        .unwrap();
        drain(&mut up, id, 0, ok);
    }
    assert_eq!(up.delivered_through(id), Some(cursor(1, 1004)));
    let generation = up.generation(id).unwrap();

    // The upstream rewinds the track on its side; nothing is resent yet.
    assert_eq!(up.rewind(id, cursor(1, 1002), 0), Ok(generation + 1));
    assert_eq!(
        up.rewind(id, cursor(1, 1004), 0),
        Err(RewindRefusal::CursorAhead)
    );
    assert_eq!(
        up.rewind(id, cursor(1, 1003), 0),
        Err(RewindRefusal::CursorAhead)
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

async fn call(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, String) {
    let mut request = client.request(method, url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

#[tokio::test]
async fn the_api_answers_202_409_and_401() {
    let mut up = common::upstream(SenderConfig::default());
    let id = common::endpoint(&mut up, "http://x/{id}", true);
    drain(&mut up, id, 0, ok);
    for n in 0..3 {
        up.create_item(
            ItemKind::Announcement,
            28,
            &format!("item {n}"),
            1_791_439_200_000 + n,
        )
        .unwrap();
    }
    drain(&mut up, id, 0, ok);
    let sim = Simulation::new(up, Duration::from_secs(2));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = relay_simulator::api::serve(listener, sim.clone())
        .await
        .unwrap();
    let client = reqwest::Client::new();
    let rewind_url = format!("http://{addr}/v1/webhook-endpoints/{id}/tracks/feed/rewind");
    let post = reqwest::Method::POST;

    let (status, _) = call(
        &client,
        post.clone(),
        rewind_url.clone(),
        None,
        Some(json!({"since": "1.1002"})),
    )
    .await;
    assert_eq!(status, 401);
    let (status, _) = call(
        &client,
        post.clone(),
        rewind_url.clone(),
        Some("wrong"),
        Some(json!({"since": "1.1002"})),
    )
    .await;
    assert_eq!(status, 401);

    for (since, error) in [
        ("1.1000", "before_reset"),
        ("1.2000", "cursor_ahead"),
        ("7.1002", "cursor_not_in_epoch"),
    ] {
        let (status, text) = call(
            &client,
            post.clone(),
            rewind_url.clone(),
            Some(KEY),
            Some(json!({"since": since})),
        )
        .await;
        assert_eq!(status, 409, "{since}");
        assert_eq!(
            serde_json::from_str::<Value>(&text).unwrap(),
            json!({"error": error})
        );
    }
    let generation = sim.lock().generation(id).unwrap();
    let (status, text) = call(
        &client,
        post.clone(),
        rewind_url.clone(),
        Some(KEY),
        Some(json!({"since": "1.1002"})),
    )
    .await;
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
    let (status, text) = call(
        &client,
        post,
        rewind_url,
        Some(KEY),
        Some(json!({"since": "1.1003"})),
    )
    .await;
    assert_eq!(
        (status, text.as_str()),
        (409, r#"{"error":"reset_pending"}"#)
    );
}
