//! Deterministic replay (the same seed gives byte-identical bodies and webhook ids), and the
//! oracle agreeing with the messages: a simple in-order receiver ends with exactly
//! `expected_copy` for every endpoint.

use std::collections::BTreeMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_simulator::model::{Selection, World};
use relay_simulator::upstream::{Answer, ItemRead, SenderConfig, Upstream};
use relay_simulator::workload::{Workload, WorkloadConfig};
use relay_simulator::Faults;
use relay_wire::{EventBody, FeedData, Message, Sequence};
use serde_json::Value;
use uuid::Uuid;

use crate::common::WALL;

type Sent = Vec<(Uuid, String, Vec<u8>)>;

/// Runs `steps` workload steps on a virtual clock, sending everything due after each, the
/// receiver answering from a seeded pattern; then drains with 2xx until idle.
fn run(
    seed: u64,
    faults: Faults,
    steps: usize,
    on_message: &mut dyn FnMut(&mut Upstream, Uuid, &[u8]),
) -> (Sent, Upstream, Vec<Uuid>) {
    let mut up = Upstream::new(
        World::default(),
        SenderConfig::from_wire_limits(3600.0),
        faults.clone(),
        seed,
    );
    let mut workload = Workload::new(
        seed,
        WorkloadConfig {
            endpoints: 5,
            keys: 2,
            access_change: 0.02,
            refetch: faults.refetch,
            ..WorkloadConfig::default()
        },
    );
    let ids: Vec<Uuid> = workload
        .setup(&mut up, "http://receiver/webhooks/{id}", 0)
        .iter()
        .map(|e| e.id)
        .collect();
    let mut answers = ChaCha8Rng::seed_from_u64(seed.wrapping_add(1));
    let failing = faults != Faults::default();
    let mut sent = Sent::new();
    let mut now = 0u64;
    let mut pump =
        |up: &mut Upstream, now: u64, answers: &mut ChaCha8Rng, fail: bool, sent: &mut Sent| {
            for &id in &ids {
                while let Some(out) = up.poll_send(id, now, WALL) {
                    let answer = match (fail, answers.gen_range(0..100)) {
                        (true, 0..=7) => Answer::Status {
                            code: 503,
                            retry_after: Some("2".into()),
                        },
                        (true, 8..=11) => Answer::status(500),
                        (true, 12..=14) => Answer::status(413),
                        (true, 15..=16) => Answer::NoAnswer,
                        _ => Answer::status(200),
                    };
                    if answer == Answer::status(200) {
                        on_message(up, id, &out.body);
                    }
                    up.on_answer(id, out.serial, answer, now, WALL);
                    sent.push((id, out.webhook_id.clone(), out.body.to_vec()));
                    assert!(sent.len() < 100_000);
                }
            }
        };
    for _ in 0..steps {
        workload.step(&mut up, now);
        now += 250;
        pump(&mut up, now, &mut answers, failing, &mut sent);
    }
    for _ in 0..1000 {
        if ids.iter().all(|id| up.is_idle(*id) || up.is_paused(*id)) {
            break;
        }
        now += 1000;
        pump(&mut up, now, &mut answers, false, &mut sent);
    }
    assert!(
        ids.iter().all(|id| up.is_idle(*id)),
        "everything was delivered"
    );
    (sent, up, ids)
}

#[test]
fn the_same_seed_replays_byte_identical_messages() {
    let (first, _, _) = run(7, Faults::all(), 300, &mut |_, _, _| {});
    let (second, _, _) = run(7, Faults::all(), 300, &mut |_, _, _| {});
    assert!(first.len() > 100, "a busy run: {} messages", first.len());
    assert_eq!(first.len(), second.len());
    for (a, b) in first.iter().zip(&second) {
        assert_eq!(a.0, b.0);
        assert_eq!(a.1, b.1, "webhook ids");
        assert_eq!(a.2, b.2, "bodies");
    }
    let (other, _, _) = run(8, Faults::all(), 300, &mut |_, _, _| {});
    assert_ne!(
        first.iter().map(|m| &m.2).collect::<Vec<_>>(),
        other.iter().map(|m| &m.2).collect::<Vec<_>>()
    );
    // Every body parses as a v1 message.
    for (_, _, body) in &first {
        Message::parse(body).unwrap();
    }
}

#[derive(Default)]
struct Copy {
    items: BTreeMap<String, (Sequence, Value)>,
    tombstones: BTreeMap<String, Sequence>,
}

fn held(copy: &Copy, subject: &str) -> Option<Sequence> {
    copy.items
        .get(subject)
        .map(|(s, _)| s.clone())
        .or_else(|| copy.tombstones.get(subject).cloned())
}

/// Applies one delivered message in order (no faults, so no generations to compare).
fn apply(copies: &mut BTreeMap<Uuid, Copy>, up: &mut Upstream, id: Uuid, body: &[u8]) {
    let message = Message::parse(body).unwrap();
    let endpoint = up.endpoint(id).unwrap().clone();
    let copy = copies.entry(id).or_default();
    for event in message.events {
        match event.body {
            EventBody::Reset(_) => {
                let selection = Selection::for_endpoint(&endpoint);
                let mut fresh = Copy::default();
                let mut cursor: Option<String> = None;
                loop {
                    let page = up
                        .feed_page(&endpoint.key_token, &selection, cursor.as_deref(), 7, 0)
                        .unwrap();
                    for entry in page["data"].as_array().unwrap() {
                        fresh.items.insert(
                            entry["subject"].as_str().unwrap().to_owned(),
                            (
                                Sequence::new(entry["sequence"].as_str().unwrap()),
                                entry["item"].clone(),
                            ),
                        );
                    }
                    if page["has_more"] != true {
                        break;
                    }
                    cursor = page["next_cursor"].as_str().map(str::to_owned);
                }
                *copy = fresh;
            }
            EventBody::Feed {
                subject,
                sequence,
                data,
                action,
                ..
            } => {
                let newer = held(copy, &subject)
                    .is_none_or(|h| sequence > h || (sequence == h && action.is_removal()));
                if !newer {
                    continue;
                }
                match data {
                    FeedData::Item(item) => {
                        copy.tombstones.remove(&subject);
                        copy.items.insert(subject, (sequence, item.raw));
                    }
                    FeedData::Removal { .. } => {
                        copy.items.remove(&subject);
                        copy.tombstones.insert(subject, sequence);
                    }
                    FeedData::Refetch { feed_item_id, .. } => {
                        match up
                            .item_read(&endpoint.key_token, &feed_item_id, &endpoint.lang, None)
                            .unwrap()
                        {
                            ItemRead::Found(found) => {
                                copy.tombstones.remove(&subject);
                                copy.items
                                    .insert(subject, (sequence, found["item"].clone()));
                            }
                            _ => {
                                copy.items.remove(&subject);
                                copy.tombstones.insert(subject, sequence);
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
}

#[test]
fn an_in_order_receiver_ends_with_the_oracle() {
    let mut copies: BTreeMap<Uuid, Copy> = BTreeMap::new();
    let faults = Faults {
        refetch: 0.3,
        ..Faults::default()
    };
    let (sent, up, ids) = run(11, faults, 250, &mut |up, id, body| {
        apply(&mut copies, up, id, body)
    });
    assert!(sent.len() > 50);
    for id in ids {
        let expected = up.expected_copy(id);
        let copy = &copies[&id];
        assert_eq!(
            copy.items.keys().collect::<Vec<_>>(),
            expected.keys().collect::<Vec<_>>(),
            "subjects of {id}"
        );
        for (subject, (sequence, item)) in &expected {
            let (held_seq, held_item) = &copy.items[subject];
            // A refetch stores the item read at the event's sequence; the item is the same.
            assert!(held_seq <= sequence, "{subject}");
            assert_eq!(held_item, item, "{subject} of {id}");
        }
    }
}
