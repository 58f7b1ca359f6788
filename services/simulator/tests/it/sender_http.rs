//! The sender against a tiny in-process axum receiver that answers 503 + Retry-After, 413, 500,
//! 2xx and 410; and, on the pure core, 413 of a single item, the reset after long failing, and a
//! failed reset sent again in the next generation.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use relay_simulator::driver::Simulation;
use relay_simulator::upstream::{Answer, MessageKind, SenderConfig};
use relay_wire::{verify, EventBody, FeedData, ItemKind, Message, SignatureHeaders};

use crate::common::{self, drain, secret};

#[derive(Debug, Clone)]
struct Received {
    at: Instant,
    headers: HeaderMap,
    body: Vec<u8>,
}

#[derive(Default)]
struct Receiver {
    script: Mutex<VecDeque<(u16, Option<&'static str>)>>,
    received: Mutex<Vec<Received>>,
}

async fn receive(
    State(receiver): State<Arc<Receiver>>,
    Path(_id): Path<String>,
    headers: HeaderMap,
    body: bytes::Bytes,
) -> Response {
    receiver.received.lock().unwrap().push(Received {
        at: Instant::now(),
        headers,
        body: body.to_vec(),
    });
    let (status, retry_after) = receiver
        .script
        .lock()
        .unwrap()
        .pop_front()
        .unwrap_or((200, None));
    let status = StatusCode::from_u16(status).unwrap();
    match retry_after {
        Some(value) => (status, [("retry-after", value)], "").into_response(),
        None => (status, "").into_response(),
    }
}

fn header<'a>(r: &'a Received, name: &str) -> &'a str {
    r.headers.get(name).unwrap().to_str().unwrap()
}

fn event_count(r: &Received) -> usize {
    Message::parse(&r.body).unwrap().events.len()
}

async fn wait_for(receiver: &Receiver, count: usize) {
    let started = Instant::now();
    while receiver.received.lock().unwrap().len() < count {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "waiting for request {count}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn retries_halves_and_pauses_as_the_wire_file_says() {
    let receiver = Arc::new(Receiver::default());
    receiver.script.lock().unwrap().extend([
        (503, Some("200")),
        (413, None),
        (500, None),
        (200, None),
        (200, None),
        (410, None),
    ]);
    let app = Router::new()
        .route("/webhooks/{id}", post(receive))
        .with_state(receiver.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    // 1000 upstream seconds a real second: Retry-After 200 s waits 200 ms.
    let mut up = common::upstream(SenderConfig::from_wire_limits(1000.0));
    let id = common::endpoint(&mut up, &format!("http://{addr}/webhooks/{{id}}"), false);
    for (n, company) in [28, 31, 44, 52].into_iter().enumerate() {
        up.create_item(
            ItemKind::Announcement,
            company,
            &format!("item {n}"),
            1_791_439_200_000 + n as i64,
        )
        .unwrap();
    }
    let sim = Simulation::new(up, Duration::from_secs(2));
    sim.spawn_senders();

    wait_for(&receiver, 5).await;
    let got = receiver.received.lock().unwrap().clone();
    // 1: all four events, answered 503 + Retry-After.
    assert_eq!(event_count(&got[0]), 4);
    assert_eq!(header(&got[0], "quanor-webhook-attempt"), "1");
    // 2: the identical body under the same webhook-id, not before the Retry-After.
    assert_eq!(got[1].body, got[0].body);
    assert_eq!(header(&got[1], "webhook-id"), header(&got[0], "webhook-id"));
    assert_eq!(header(&got[1], "quanor-webhook-attempt"), "2");
    assert!(
        got[1].at - got[0].at >= Duration::from_millis(190),
        "{:?}",
        got[1].at - got[0].at
    );
    // 3: after the 413, half the events: a new body, a new id, the attempt count kept.
    assert_eq!(event_count(&got[2]), 2);
    assert_ne!(header(&got[2], "webhook-id"), header(&got[0], "webhook-id"));
    assert_eq!(header(&got[2], "quanor-webhook-attempt"), "3");
    // 4: after the 500, a backoff, then the same half again.
    assert_eq!(got[3].body, got[2].body);
    assert_eq!(header(&got[3], "quanor-webhook-attempt"), "4");
    // 5: after the 2xx, the rest, counting from 1 again.
    assert_eq!(event_count(&got[4]), 2);
    assert_eq!(header(&got[4], "quanor-webhook-attempt"), "1");
    let first = Message::parse(&got[2].body).unwrap();
    let rest = Message::parse(&got[4].body).unwrap();
    assert_eq!(
        rest.since, first.through,
        "the rest follows the delivered half"
    );

    for r in &got {
        let headers = SignatureHeaders {
            webhook_id: Some(header(r, "webhook-id")),
            webhook_timestamp: Some(header(r, "webhook-timestamp")),
            webhook_signature: Some(header(r, "webhook-signature")),
        };
        let now = header(r, "webhook-timestamp").parse().unwrap();
        assert!(verify(headers, &r.body, &[secret()], now).is_ok());
        assert_eq!(header(r, "content-type"), "application/json");
        assert_eq!(header(r, "user-agent"), "Quanor-Webhooks/1");
    }

    // 6: a new change, answered 410: the endpoint is paused and nothing more is sent.
    sim.change(|up, _| up.create_item(ItemKind::Announcement, 28, "more", 1_791_439_300_000))
        .unwrap();
    wait_for(&receiver, 6).await;
    sim.change(|up, _| up.create_item(ItemKind::Announcement, 28, "even more", 1_791_439_400_000))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(receiver.received.lock().unwrap().len(), 6);
    assert!(sim.lock().is_paused(id));

    // Resumed: a reset (reason resumed) comes first.
    sim.change(|up, now| up.resume_endpoint(id, now));
    wait_for(&receiver, 7).await;
    let seventh = receiver.received.lock().unwrap()[6].clone();
    let message = Message::parse(&seventh.body).unwrap();
    assert!(matches!(&message.events[0].body, EventBody::Reset(r) if r.reason == "resumed"));
    sim.shutdown();
}

#[test]
fn a_single_items_413_is_sent_again_as_its_refetch() {
    let (mut up, id) = common::upstream_with_endpoint(false);
    up.create_item(ItemKind::Announcement, 28, "big", 1_791_439_200_000)
        .unwrap();
    let first = up.poll_send(id, 0, common::WALL).unwrap();
    up.on_answer(id, first.serial, Answer::status(413), 0, common::WALL);
    let second = up.poll_send(id, 0, common::WALL).unwrap();
    let message = Message::parse(&second.body).unwrap();
    assert!(matches!(
        &message.events[0].body,
        EventBody::Feed {
            data: FeedData::Refetch { .. },
            ..
        }
    ));
    assert_eq!(second.attempt, 2);
    assert_ne!(second.webhook_id, first.webhook_id);
}

#[test]
fn long_failing_replaces_the_backlog_with_a_reset_and_a_failed_reset_moves_to_the_next_generation()
{
    // 86 400 upstream seconds a real second: reset_after_failing is 1000 ms.
    let mut up = common::upstream(SenderConfig::from_wire_limits(86_400.0));
    let id = common::endpoint(&mut up, "http://x/{id}", false);
    up.create_item(ItemKind::Announcement, 28, "a", 1_791_439_200_000)
        .unwrap();
    let generation = up.generation(id).unwrap();
    let mut now = 0;
    let mut kinds = Vec::new();
    while now < 3_000 {
        if let Some(out) = up.poll_send(id, now, common::WALL) {
            kinds.push(out.kind);
            if out.kind == MessageKind::Reset {
                break;
            }
            up.on_answer(id, out.serial, Answer::status(500), now, common::WALL);
        }
        now += 10;
    }
    assert_eq!(kinds.last(), Some(&MessageKind::Reset), "{kinds:?}");
    assert!(now >= 1_000);
    let reset = up.log(id).iter().rev().find_map(|e| match e {
        relay_simulator::LogEntry::Sent { body, .. } => Some(body.clone()),
        _ => None,
    });
    let message = Message::parse(&reset.unwrap()).unwrap();
    let EventBody::Reset(data) = &message.events[0].body else {
        panic!()
    };
    assert_eq!(data.reason, "behind");
    assert_eq!(data.generation, generation + 1);

    // The reset fails too: it is sent again in the next generation.
    let serial = match up.log(id).iter().rev().find_map(|e| match e {
        relay_simulator::LogEntry::Sent { serial, .. } => Some(*serial),
        _ => None,
    }) {
        Some(s) => s,
        None => panic!(),
    };
    up.on_answer(id, serial, Answer::status(500), now, common::WALL);
    let again = drain(&mut up, id, now + 10_000, common::ok);
    let message = Message::parse(&again[0].body).unwrap();
    let EventBody::Reset(data) = &message.events[0].body else {
        panic!()
    };
    assert_eq!(data.generation, generation + 2);
    assert_eq!(up.delivered_through(id), Some(up.world.head()));
}
