//! The wire file's five signed example messages (tests/fixtures/wire-v1.json is the upstream's
//! wire file, kept verbatim as a test vector) verified with its example_secret at their own
//! timestamp, and refused after any single change.

use relay_wire::{
    sign, verify, EventBody, FeedAction, FeedData, ItemKind, Message, SignatureHeaders,
    SigningSecret, Track, VerifyError,
};
use serde_json::Value;

const WIRE_FILE: &str = include_str!("fixtures/wire-v1.json");

struct Example {
    name: String,
    id: String,
    timestamp: String,
    signature: String,
    body: Vec<u8>,
    body_json: Value,
}

impl Example {
    fn headers(&self) -> SignatureHeaders<'_> {
        SignatureHeaders {
            webhook_id: Some(&self.id),
            webhook_timestamp: Some(&self.timestamp),
            webhook_signature: Some(&self.signature),
        }
    }

    fn now(&self) -> i64 {
        self.timestamp.parse().unwrap()
    }
}

fn wire() -> Value {
    serde_json::from_str(WIRE_FILE).unwrap()
}

fn example_secret() -> SigningSecret {
    SigningSecret::parse(wire()["example_secret"].as_str().unwrap()).unwrap()
}

fn examples() -> Vec<Example> {
    let wire = wire();
    let messages = wire["messages"].as_object().unwrap();
    let examples: Vec<Example> = messages
        .iter()
        .map(|(name, m)| Example {
            name: name.clone(),
            id: m["headers"]["webhook-id"].as_str().unwrap().to_owned(),
            timestamp: m["headers"]["webhook-timestamp"]
                .as_str()
                .unwrap()
                .to_owned(),
            signature: m["headers"]["webhook-signature"]
                .as_str()
                .unwrap()
                .to_owned(),
            body: m["body_bytes"].as_str().unwrap().as_bytes().to_vec(),
            body_json: m["body"].clone(),
        })
        .collect();
    assert_eq!(examples.len(), 5, "the wire file has five example messages");
    examples
}

fn other_secret() -> SigningSecret {
    SigningSecret::from_bytes(b"a different secret entirely!".to_vec()).unwrap()
}

#[test]
fn every_example_verifies_with_the_example_secret_at_its_own_time() {
    let secret = example_secret();
    for ex in examples() {
        assert_eq!(
            verify(
                ex.headers(),
                &ex.body,
                std::slice::from_ref(&secret),
                ex.now()
            ),
            Ok(ex.now()),
            "{}",
            ex.name
        );
        // Our signer produces the upstream's exact header for the same input.
        assert_eq!(
            sign(&ex.id, ex.now(), &ex.body, std::slice::from_ref(&secret)),
            ex.signature,
            "{}",
            ex.name
        );
    }
}

#[test]
fn a_flipped_byte_in_the_body_is_refused_wherever_it_is() {
    let secret = [example_secret()];
    for ex in examples() {
        // Every position is cheap enough to try: bodies are a few KB.
        for i in 0..ex.body.len() {
            let mut body = ex.body.clone();
            body[i] ^= 0x01;
            assert_eq!(
                verify(ex.headers(), &body, &secret, ex.now()),
                Err(VerifyError::NoMatchingSignature),
                "{} with byte {i} flipped",
                ex.name
            );
        }
    }
}

fn flip_char(text: &str, at: usize) -> String {
    let mut bytes = text.as_bytes().to_vec();
    // Flip to another printable character of the same class so the header stays well-formed.
    bytes[at] = match bytes[at] {
        b'0'..=b'8' | b'a'..=b'y' | b'A'..=b'Y' => bytes[at] + 1,
        b'9' => b'0',
        b'z' => b'a',
        b'Z' => b'A',
        b'+' => b'/',
        b'/' => b'+',
        other => other ^ 0x01,
    };
    String::from_utf8(bytes).unwrap()
}

#[test]
fn a_changed_id_timestamp_or_signature_is_refused() {
    let secret = [example_secret()];
    for ex in examples() {
        for i in 0..ex.id.len() {
            let id = flip_char(&ex.id, i);
            let h = SignatureHeaders {
                webhook_id: Some(&id),
                ..ex.headers()
            };
            assert_eq!(
                verify(h, &ex.body, &secret, ex.now()),
                Err(VerifyError::NoMatchingSignature),
                "{}: id char {i}",
                ex.name
            );
        }
        for i in 0..ex.timestamp.len() {
            let ts = flip_char(&ex.timestamp, i);
            let h = SignatureHeaders {
                webhook_timestamp: Some(&ts),
                ..ex.headers()
            };
            // Even a timestamp we would accept as "now" fails: it is part of what is signed.
            let now = ts.parse().unwrap();
            assert_eq!(
                verify(h, &ex.body, &secret, now),
                Err(VerifyError::NoMatchingSignature),
                "{}: timestamp char {i}",
                ex.name
            );
        }
        // Skip "v1," and the base64 padding, whose low bits a decoder may ignore.
        let sig_chars = ex.signature.trim_end_matches('=').len();
        for i in 3..sig_chars {
            let sig = flip_char(&ex.signature, i);
            let h = SignatureHeaders {
                webhook_signature: Some(&sig),
                ..ex.headers()
            };
            assert_eq!(
                verify(h, &ex.body, &secret, ex.now()),
                Err(VerifyError::NoMatchingSignature),
                "{}: signature char {i}",
                ex.name
            );
        }
    }
}

#[test]
fn the_tolerance_is_300_seconds_either_way() {
    let secret = [example_secret()];
    for ex in examples() {
        for now in [ex.now() - 300, ex.now() + 300] {
            assert!(verify(ex.headers(), &ex.body, &secret, now).is_ok());
        }
        assert_eq!(
            verify(ex.headers(), &ex.body, &secret, ex.now() + 301),
            Err(VerifyError::TimestampOutsideTolerance { skew_s: 301 }),
            "{}: signed too long ago",
            ex.name
        );
        assert_eq!(
            verify(ex.headers(), &ex.body, &secret, ex.now() - 301),
            Err(VerifyError::TimestampOutsideTolerance { skew_s: -301 }),
            "{}: signed in the future",
            ex.name
        );
    }
}

#[test]
fn the_wrong_secret_is_refused() {
    for ex in examples() {
        assert_eq!(
            verify(ex.headers(), &ex.body, &[other_secret()], ex.now()),
            Err(VerifyError::NoMatchingSignature),
            "{}",
            ex.name
        );
    }
}

#[test]
fn the_right_signature_may_be_second_of_several() {
    for ex in examples() {
        let forged = sign(&ex.id, ex.now(), &ex.body, &[other_secret()]);
        let header = format!("{forged} {}", ex.signature);
        let h = SignatureHeaders {
            webhook_signature: Some(&header),
            ..ex.headers()
        };
        assert!(
            verify(h, &ex.body, &[example_secret()], ex.now()).is_ok(),
            "{}",
            ex.name
        );
    }
}

#[test]
fn the_older_secret_of_a_rotation_still_verifies() {
    // During a rotation the endpoint holds the new secret and the old one until the overlap
    // ends; a message signed only with the old one (sent before the upstream rotated) verifies.
    let held = [other_secret(), example_secret()];
    for ex in examples() {
        assert!(
            verify(ex.headers(), &ex.body, &held, ex.now()).is_ok(),
            "{}",
            ex.name
        );
    }
}

#[test]
fn every_example_body_parses_and_matches_its_json() {
    for ex in examples() {
        let parsed: Value = serde_json::from_slice(&ex.body).unwrap();
        assert_eq!(
            parsed, ex.body_json,
            "{}: body_bytes and body agree",
            ex.name
        );
        let message = Message::parse(&ex.body).unwrap();
        assert_eq!(
            message.webhook_endpoint_id.to_string(),
            "8d2f0c39-2b63-4c55-9a8a-3f5b1d7c1e20"
        );
        assert!(message.ignored.is_empty(), "{}: no unnamed fields", ex.name);
    }
}

#[test]
fn example_events_are_routed_by_type() {
    let by_name = |name: &str| {
        let ex = examples().into_iter().find(|e| e.name == name).unwrap();
        Message::parse(&ex.body).unwrap()
    };

    let events = by_name("events");
    assert_eq!(events.track, Some(Track::Feed));
    assert_eq!(events.generation, Some(3));
    assert_eq!(events.through.as_deref(), Some("1.1050"));
    match &events.events[0].body {
        EventBody::Feed {
            kind: ItemKind::Announcement,
            action: FeedAction::Updated,
            subject,
            sequence,
            data: FeedData::Item(item),
        } => {
            assert_eq!(subject, "announcement:88001");
            assert_eq!(sequence.as_str(), "0000000001.0000000000000001045");
            assert_eq!(item.seq, 1045);
            assert_eq!(item.company_id, Some(28));
            assert_eq!(item.parts.len(), 3);
            assert_eq!(item.parts[0].part_version, 1_791_439_200_351_000);
            assert_eq!(item.raw["head"]["title"], "Alfa wins order");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(matches!(
        events.events[1].body,
        EventBody::Feed {
            action: FeedAction::Hidden,
            data: FeedData::Removal { seq: 1048, .. },
            ..
        }
    ));

    let refetch = by_name("events with a refetch");
    assert!(matches!(
        refetch.events[0].body,
        EventBody::Feed {
            data: FeedData::Refetch { seq: 1052, .. },
            ..
        }
    ));

    let reset = by_name("reset");
    match &reset.events[0].body {
        EventBody::Reset(data) => {
            assert_eq!(data.generation, 4);
            assert_eq!(data.reason, "access_changed");
            assert_eq!(data.resume_from.as_deref(), Some("1.1052"));
            assert_eq!(data.track, Track::Feed);
        }
        other => panic!("unexpected {other:?}"),
    }

    for name in ["test", "test of a type"] {
        let test = by_name(name);
        assert!(test.is_test(), "{name}");
        assert_eq!(test.track, None);
    }
    match &by_name("test of a type").events[0].body {
        EventBody::Tested(data) => {
            assert_eq!(
                data.example.as_ref().unwrap()["type"],
                "announcement.updated"
            )
        }
        other => panic!("unexpected {other:?}"),
    }
}
