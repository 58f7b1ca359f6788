//! The wire file's five signed examples, sent over HTTP exactly as the upstream sent them, to a
//! front tier whose clock stands at the examples' signing time.

use std::sync::Arc;

use relay_ingest::FixedClock;
use relay_tests::{test_config, TestApp};
use relay_wire::SigningSecret;
use reqwest::StatusCode;
use serde_json::Value;
use time::OffsetDateTime;
use uuid::Uuid;

const WIRE_FILE: &str = include_str!("../../services/wire/tests/fixtures/wire-v1.json");

async fn app_at(unix_s: i64) -> (TestApp, Value) {
    let wire: Value = serde_json::from_str(WIRE_FILE).unwrap();
    let clock = FixedClock(OffsetDateTime::from_unix_timestamp(unix_s).unwrap());
    let app = TestApp::spawn_with(test_config(), Arc::new(clock), None).await;
    let secret = SigningSecret::parse(wire["example_secret"].as_str().unwrap()).unwrap();
    let tenant = app.db.tenant().await;
    let endpoint = Uuid::parse_str("8d2f0c39-2b63-4c55-9a8a-3f5b1d7c1e20").unwrap();
    app.db.endpoint(tenant, endpoint, &secret).await;
    (app, wire)
}

async fn send_example(app: &TestApp, example: &Value) -> reqwest::Response {
    let mut request = app.client.post(format!(
        "{}/webhooks/8d2f0c39-2b63-4c55-9a8a-3f5b1d7c1e20",
        app.base_url
    ));
    for (name, value) in example["headers"].as_object().unwrap() {
        request = request.header(name, value.as_str().unwrap());
    }
    request
        .body(example["body_bytes"].as_str().unwrap().to_owned())
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn the_five_examples_are_taken_and_stored_byte_for_byte() {
    let (app, wire) = app_at(1_791_439_212).await;
    let endpoint = Uuid::parse_str("8d2f0c39-2b63-4c55-9a8a-3f5b1d7c1e20").unwrap();
    let examples = wire["messages"].as_object().unwrap();
    for (name, example) in examples {
        let response = send_example(&app, example).await;
        assert_eq!(response.status(), StatusCode::ACCEPTED, "{name}");
    }
    let stored = app.db.stored_messages(endpoint).await;
    assert_eq!(stored.len(), 5);
    for (row, (name, example)) in stored.iter().zip(examples) {
        assert_eq!(
            row.body,
            example["body_bytes"].as_str().unwrap().as_bytes(),
            "{name}"
        );
        assert_eq!(row.webhook_id, example["headers"]["webhook-id"], "{name}");
        assert_eq!(row.attempt, Some(1), "{name}");
        assert_eq!(row.signed_at.unix_timestamp(), 1_791_439_212, "{name}");
    }
    // Test messages belong to no track; the others are on `feed`.
    let tracks: Vec<Option<&str>> = stored.iter().map(|m| m.track.as_deref()).collect();
    assert_eq!(tracks.iter().filter(|t| t.is_none()).count(), 2);
    // Sent again, each is a duplicate: 2xx, nothing more stored.
    for example in examples.values() {
        assert_eq!(send_example(&app, example).await.status(), StatusCode::OK);
    }
    app.stop().await;
}

#[tokio::test]
async fn the_examples_are_refused_once_outside_the_tolerance() {
    for now in [1_791_439_212 + 301, 1_791_439_212 - 301] {
        let (app, wire) = app_at(now).await;
        for (name, example) in wire["messages"].as_object().unwrap() {
            let response = send_example(&app, example).await;
            assert_eq!(
                response.status(),
                StatusCode::UNAUTHORIZED,
                "{name} at {now}"
            );
        }
        app.stop().await;
    }
}
