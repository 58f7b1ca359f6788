//! The simulator's messages verify with relay_wire, parse with relay_wire, and have the shapes of
//! the wire file's five examples, compared field by field.

use std::collections::BTreeSet;

use relay_simulator::model::{Access, ChangeKind};
use relay_simulator::upstream::{MessageKind, Outgoing, SenderConfig};
use relay_wire::{verify, EventBody, ItemKind, Message, SignatureHeaders};
use serde_json::Value;

use crate::common::{self, drain, ok, secret, WALL};

const WIRE_FILE: &str = include_str!("../../../wire/tests/fixtures/wire-v1.json");

fn wire_example(name: &str) -> (Value, Value) {
    let wire: Value = serde_json::from_str(WIRE_FILE).unwrap();
    let message = &wire["messages"][name];
    (message["headers"].clone(), message["body"].clone())
}

fn keys(value: &Value) -> BTreeSet<String> {
    value
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {value}"))
        .keys()
        .cloned()
        .collect()
}

fn header<'a>(out: &'a Outgoing, name: &str) -> &'a str {
    &out.headers.iter().find(|(n, _)| *n == name).unwrap().1
}

fn body(out: &Outgoing) -> Value {
    serde_json::from_slice(&out.body).unwrap()
}

/// Header names equal the example's; each value has the example's form.
fn assert_headers_like(out: &Outgoing, example_headers: &Value) {
    let names: BTreeSet<String> = out.headers.iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(names, keys(example_headers));
    let id = header(out, "webhook-id");
    assert!(
        id.starts_with("msg_") && id.len() == 36 && id[4..].bytes().all(|b| b.is_ascii_hexdigit()),
        "{id}"
    );
    assert!(header(out, "webhook-timestamp")
        .bytes()
        .all(|b| b.is_ascii_digit()));
    let sig = header(out, "webhook-signature");
    let example_sig = example_headers["webhook-signature"].as_str().unwrap();
    assert!(
        sig.starts_with("v1,") && sig.len() == example_sig.len(),
        "{sig}"
    );
    assert!(
        header(out, "quanor-webhook-attempt")
            .parse::<u32>()
            .unwrap()
            >= 1
    );
    assert_eq!(header(out, "content-type"), example_headers["content-type"]);
    assert_eq!(header(out, "user-agent"), example_headers["user-agent"]);
}

fn assert_verifies_and_parses(out: &Outgoing) -> Message {
    let headers = SignatureHeaders {
        webhook_id: Some(header(out, "webhook-id")),
        webhook_timestamp: Some(header(out, "webhook-timestamp")),
        webhook_signature: Some(header(out, "webhook-signature")),
    };
    assert_eq!(verify(headers, &out.body, &[secret()], WALL), Ok(WALL));
    Message::parse(&out.body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.body)))
}

/// An item's keys, its company's, head's, flags' and each part's (by kind) equal the example's.
fn assert_item_like(item: &Value, example_item: &Value) {
    assert_eq!(keys(item), keys(example_item), "item keys");
    for field in ["company", "head", "flags"] {
        assert_eq!(
            keys(&item[field]),
            keys(&example_item[field]),
            "{field} keys"
        );
    }
    for part in item["parts"].as_array().unwrap() {
        let example_part = example_item["parts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["kind"] == part["kind"])
            .unwrap();
        assert_eq!(keys(part), keys(example_part), "{} part keys", part["kind"]);
    }
    assert_eq!(item["type"], "item");
    assert_eq!(item["changes"], serde_json::json!([]));
}

fn assert_event_like(event: &Value, example_event: &Value) {
    assert_eq!(
        keys(event),
        keys(example_event),
        "event keys of {}",
        event["type"]
    );
    assert_eq!(
        keys(&event["data"]),
        keys(&example_event["data"]),
        "data keys of {}",
        event["type"]
    );
    for field in ["datacontenttype", "source", "specversion"] {
        assert_eq!(event[field], example_event[field], "{field}");
    }
    let id = event["id"].as_str().unwrap();
    assert_eq!(
        id.len(),
        example_event["id"].as_str().unwrap().len(),
        "{id}"
    );
    assert!(id.starts_with("evt_"));
    assert_eq!(
        event["dataschema"].as_str().unwrap(),
        format!(
            "https://api.quanor.com/api/docs/events/{}.v1.data.schema.json",
            event["type"].as_str().unwrap()
        )
    );
    if let Some(sequence) = event.get("sequence") {
        assert_eq!(sequence.as_str().unwrap().len(), 30);
    }
}

/// Runs a scenario and returns (events message, refetch message, reset message, test, typed test).
fn scenario() -> [Outgoing; 5] {
    let mut up = common::upstream(SenderConfig::default());
    let id = common::endpoint(&mut up, "http://127.0.0.1:1/webhooks/{id}", false);
    // An item with a corrected story and a superseded flash, then a second item hidden.
    let item = up
        .create_item(
            ItemKind::Announcement,
            28,
            "Alfa wins order",
            1_791_439_200_300,
        )
        .unwrap();
    let fid = item.feed_item_id;
    up.change_item(
        &fid,
        ChangeKind::FlashAdded,
        "Deliveries start",
        1_791_439_200_352,
        false,
    )
    .unwrap();
    up.change_item(
        &fid,
        ChangeKind::StoryAdded,
        "Alfa wins its largest order",
        1_791_439_212_300,
        false,
    )
    .unwrap();
    up.change_item(
        &fid,
        ChangeKind::Corrected,
        "Alfa wins its largest order",
        1_791_441_600_300,
        false,
    )
    .unwrap();
    up.change_item(
        &fid,
        ChangeKind::FlashReplaced,
        "Alfa wins SEK 500M order",
        1_791_441_601_000,
        false,
    )
    .unwrap();
    let other = up
        .create_item(ItemKind::Announcement, 31, "Beta news", 1_791_441_602_000)
        .unwrap();
    up.change_item(
        &other.feed_item_id,
        ChangeKind::Hidden,
        "",
        1_791_441_603_000,
        false,
    )
    .unwrap();
    let events = drain(&mut up, id, 0, ok);
    assert_eq!(events.len(), 1);
    up.change_item(
        &fid,
        ChangeKind::StoryRevised,
        "Alfa wins more",
        1_791_441_700_000,
        true,
    )
    .unwrap();
    let refetch = drain(&mut up, id, 0, ok);
    up.set_access(common::KEY, 31, Some(Access::Teaser), 0)
        .unwrap();
    let reset = drain(&mut up, id, 0, ok);
    up.send_test(id, None).unwrap();
    let test = drain(&mut up, id, 0, ok);
    up.send_test(id, Some("announcement.updated")).unwrap();
    let typed = drain(&mut up, id, 0, ok);
    [&events, &refetch, &reset, &test, &typed].map(|v| {
        assert_eq!(v.len(), 1);
        v[0].clone()
    })
}

#[test]
fn messages_verify_with_relay_wire_and_parse() {
    for out in scenario() {
        let message = assert_verifies_and_parses(&out);
        assert_eq!(message.webhook_endpoint_id, out.endpoint_id);
    }
}

#[test]
fn every_message_has_its_wire_example_shape() {
    let [events, refetch, reset, test, typed] = scenario();
    assert_eq!(
        [events.kind, refetch.kind, reset.kind, test.kind, typed.kind],
        [
            MessageKind::Events,
            MessageKind::Events,
            MessageKind::Reset,
            MessageKind::Test,
            MessageKind::Test
        ]
    );

    // events: body keys, each updated event and its item, the hidden event.
    let (headers, example) = wire_example("events");
    assert_headers_like(&events, &headers);
    let got = body(&events);
    assert_eq!(keys(&got), keys(&example));
    let example_updated = &example["events"][0];
    let example_hidden = &example["events"][1];
    let got_events = got["events"].as_array().unwrap();
    assert_eq!(got_events.len(), 7, "six updates and a hide");
    for event in got_events {
        match event["type"].as_str().unwrap() {
            "announcement.updated" => {
                assert_event_like(event, example_updated);
                assert_item_like(&event["data"], &example_updated["data"]);
            }
            "announcement.hidden" => assert_event_like(event, example_hidden),
            other => panic!("unexpected type {other}"),
        }
    }
    // The last update of the first item is corrected, has a superseded flash, both part kinds.
    let last = &got_events[4]["data"];
    assert_eq!(last["flags"]["corrected"], true);
    assert_eq!(last["op"], "changed");
    assert_eq!(last["superseded_parts"].as_array().unwrap().len(), 1);
    assert_eq!(got_events[0]["data"]["op"], "new");
    assert_eq!(got["complete"], true);
    assert_eq!(got["v"], 1);
    assert_eq!(got["track"], "feed");

    let (headers, example) = wire_example("events with a refetch");
    assert_headers_like(&refetch, &headers);
    let got = body(&refetch);
    assert_eq!(keys(&got), keys(&example));
    assert_event_like(&got["events"][0], &example["events"][0]);
    assert_eq!(got["events"][0]["data"]["type"], "refetch");
    assert_eq!(
        got["since"],
        body(&events)["through"],
        "the next message follows on"
    );

    let (headers, example) = wire_example("reset");
    assert_headers_like(&reset, &headers);
    let got = body(&reset);
    assert_eq!(keys(&got), keys(&example));
    assert_event_like(&got["events"][0], &example["events"][0]);
    assert_eq!(got["events"][0]["data"]["reason"], "access_changed");
    assert_eq!(got["events"][0]["data"]["generation"], got["generation"]);
    assert_eq!(
        got["events"][0]["data"]["access_version"],
        got["access_version"]
    );
    assert_ne!(got["access_version"], body(&events)["access_version"]);

    let (headers, example) = wire_example("test");
    assert_headers_like(&test, &headers);
    let got = body(&test);
    assert_eq!(keys(&got), keys(&example));
    assert_event_like(&got["events"][0], &example["events"][0]);

    let (headers, example) = wire_example("test of a type");
    assert_headers_like(&typed, &headers);
    let got = body(&typed);
    assert_eq!(keys(&got), keys(&example));
    assert_event_like(&got["events"][0], &example["events"][0]);
    let got_example = &got["events"][0]["data"]["example"];
    let want_example = &example["events"][0]["data"]["example"];
    assert_event_like(got_example, want_example);
    assert_item_like(&got_example["data"], &want_example["data"]);
    let parsed = Message::parse(&typed.body).unwrap();
    assert!(parsed.is_test());
    assert!(matches!(&parsed.events[0].body, EventBody::Tested(t) if t.example.is_some()));
}

#[test]
fn event_ids_name_a_change_under_one_access_and_language() {
    let (mut up, id) = common::upstream_with_endpoint(false);
    up.create_item(ItemKind::Announcement, 28, "A", 1_791_439_200_000)
        .unwrap();
    let first = drain(&mut up, id, 0, ok);
    let first_id = body(&first[0])["events"][0]["id"].clone();
    // A rewind resends the change under the same id (and a new generation).
    let since = relay_wire::Cursor {
        epoch: 1,
        seq: 1000,
    };
    up.rewind(id, since, 0).unwrap();
    let again = drain(&mut up, id, 0, ok);
    assert_eq!(body(&again[0])["events"][0]["id"], first_id);
    assert_ne!(body(&again[0])["generation"], body(&first[0])["generation"]);
    assert_ne!(again[0].webhook_id, first[0].webhook_id);
    // /v1/feed/since with include_event_ids gives the same id.
    let since = up
        .feed_since(
            common::KEY,
            &relay_simulator::model::Selection::all("en"),
            "1.1000",
            true,
            None,
            100,
        )
        .unwrap();
    assert_eq!(since["event_ids"][0], first_id);
    // In another language it is another event.
    let sv = up
        .feed_since(
            common::KEY,
            &relay_simulator::model::Selection::all("sv"),
            "1.1000",
            true,
            None,
            100,
        )
        .unwrap();
    assert_ne!(sv["event_ids"][0], first_id);
}
