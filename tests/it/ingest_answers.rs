//! Every answer of `POST /webhooks/{id}` against a real front tier and a real Postgres.

use std::time::Duration;

use relay_store::endpoints::{self, EndpointStatus};
use relay_store::EndpointId;
use relay_tests::{feed_body, random_secret, test_config, Signed, TestApp};
use reqwest::StatusCode;
use time::OffsetDateTime;
use uuid::Uuid;

#[tokio::test]
async fn a_verified_message_is_stored_exactly_as_received_then_answered_202() {
    let app = TestApp::spawn().await;
    let (endpoint, secret) = app.endpoint().await;
    // Odd but valid JSON spacing: the stored bytes must be these, not a re-serialisation.
    let mut body = b"{ \"v\" : 1 , ".to_vec();
    body.extend_from_slice(&feed_body(endpoint, 7)[1..]);
    let mut message = Signed::new(&[secret], body.clone());
    message.attempt = Some("3".into());

    let response = app.post(endpoint, &message).await;
    assert_eq!(response.status(), StatusCode::ACCEPTED);

    let stored = app.db.stored_messages(endpoint).await;
    assert_eq!(stored.len(), 1);
    let row = &stored[0];
    assert_eq!(row.body, body);
    assert_eq!(row.webhook_id, message.webhook_id);
    assert_eq!(row.signed_at.unix_timestamp(), message.timestamp);
    assert_eq!(row.attempt, Some(3));
    assert_eq!(row.track.as_deref(), Some("feed"));
    assert_eq!(row.generation, Some(1));
    assert!(
        (OffsetDateTime::now_utc() - row.received_at)
            .whole_seconds()
            .abs()
            < 60
    );
    assert_eq!(app.answered("accepted").await, 1.0);
    app.stop().await;
}

#[tokio::test]
async fn a_repeated_webhook_id_is_answered_2xx_and_stored_once() {
    let app = TestApp::spawn().await;
    let (endpoint, secret) = app.endpoint().await;
    let message = Signed::new(&[secret], feed_body(endpoint, 1));

    assert_eq!(
        app.post(endpoint, &message).await.status(),
        StatusCode::ACCEPTED
    );
    assert_eq!(app.post(endpoint, &message).await.status(), StatusCode::OK);
    // Many at once, as a retry racing a slow first attempt would: all 2xx, one row.
    let posts = (0..16).map(|_| app.post(endpoint, &message));
    for response in futures::future::join_all(posts).await {
        assert!(response.status().is_success(), "{}", response.status());
    }
    assert_eq!(
        app.stored_webhook_ids(endpoint).await,
        vec![message.webhook_id]
    );
    assert_eq!(app.answered("duplicate").await, 17.0);
    // Each repeat is counted on the stored message, for the tenant's listing.
    let (duplicates, last): (i32, Option<time::OffsetDateTime>) =
        sqlx::query_as("SELECT duplicates, last_duplicate_at FROM messages WHERE endpoint_id = $1")
            .bind(endpoint)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    assert_eq!(duplicates, 17);
    assert!(last.is_some());
    app.stop().await;
}

#[tokio::test]
async fn concurrent_first_attempts_of_one_new_webhook_id_store_it_once() {
    let app = TestApp::spawn().await;
    let (endpoint, secret) = app.endpoint().await;
    let message = Signed::new(&[secret], feed_body(endpoint, 1));
    let posts = (0..24).map(|_| app.post(endpoint, &message));
    let statuses: Vec<StatusCode> = futures::future::join_all(posts)
        .await
        .into_iter()
        .map(|r| r.status())
        .collect();
    assert_eq!(
        statuses
            .iter()
            .filter(|s| **s == StatusCode::ACCEPTED)
            .count(),
        1,
        "{statuses:?}"
    );
    assert!(statuses.iter().all(|s| s.is_success()));
    assert_eq!(app.stored_webhook_ids(endpoint).await.len(), 1);
    app.stop().await;
}

#[tokio::test]
async fn arrival_order_follows_the_order_messages_were_answered() {
    let app = TestApp::spawn().await;
    let (endpoint, secret) = app.endpoint().await;
    let (other, other_secret) = app.endpoint().await;
    let mut sent = Vec::new();
    for n in 0..20 {
        let message = Signed::new(std::slice::from_ref(&secret), feed_body(endpoint, n));
        // Interleave another endpoint's traffic: its numbers must not disturb this one's.
        let noise = Signed::new(std::slice::from_ref(&other_secret), feed_body(other, n));
        let (a, b) = tokio::join!(app.post(endpoint, &message), app.post(other, &noise));
        assert_eq!(a.status(), StatusCode::ACCEPTED);
        assert_eq!(b.status(), StatusCode::ACCEPTED);
        sent.push(message.webhook_id);
    }
    let stored = app.db.stored_messages(endpoint).await;
    let ids: Vec<String> = stored.iter().map(|m| m.webhook_id.clone()).collect();
    assert_eq!(ids, sent);
    assert!(stored
        .windows(2)
        .all(|w| w[0].arrival_seq < w[1].arrival_seq));
    app.stop().await;
}

#[tokio::test]
async fn bodies_up_to_the_limit_are_taken_and_one_byte_more_is_refused_413() {
    let app = TestApp::spawn().await;
    let (endpoint, secret) = app.endpoint().await;
    let limit = relay_wire::limits::MAX_BODY_BYTES;
    let body_of_len = |len: usize| {
        // A valid message padded with a field version 1 does not name (so it is ignored).
        let base = feed_body(endpoint, 1);
        let filler = len - base.len() - r#","padding":"""#.len();
        let mut body = base[..base.len() - 1].to_vec();
        body.extend_from_slice(br#","padding":""#);
        body.extend(std::iter::repeat_n(b'x', filler));
        body.extend_from_slice(b"\"}");
        assert_eq!(body.len(), len);
        body
    };

    let exact = Signed::new(std::slice::from_ref(&secret), body_of_len(limit));
    assert_eq!(
        app.post(endpoint, &exact).await.status(),
        StatusCode::ACCEPTED
    );

    let over = Signed::new(std::slice::from_ref(&secret), body_of_len(limit + 1));
    assert_eq!(
        app.post(endpoint, &over).await.status(),
        StatusCode::PAYLOAD_TOO_LARGE
    );

    // Without a Content-Length (chunked), the body is read only up to the limit.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = over
        .body
        .chunks(64 * 1024)
        .map(|c| Ok(c.to_vec()))
        .collect();
    let response = app
        .client
        .post(format!("{}/webhooks/{endpoint}", app.base_url))
        .header("webhook-id", &over.webhook_id)
        .header("webhook-timestamp", over.timestamp.to_string())
        .header("webhook-signature", &over.signature)
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);

    // A 5 MB body declared up front is refused before anything is read or looked up.
    let huge = Signed::new(&[secret], vec![b' '; 5 * 1024 * 1024]);
    assert_eq!(
        app.post(Uuid::new_v4(), &huge).await.status(),
        StatusCode::PAYLOAD_TOO_LARGE
    );

    assert_eq!(
        app.stored_webhook_ids(endpoint).await,
        vec![exact.webhook_id]
    );
    assert_eq!(app.answered("too_large").await, 3.0);
    app.stop().await;
}

#[tokio::test]
async fn an_unknown_endpoint_is_404() {
    let app = TestApp::spawn().await;
    let (_, secret) = app.endpoint().await;
    let unknown = Uuid::new_v4();
    let message = Signed::new(&[secret], feed_body(unknown, 1));
    let response = app.post(unknown, &message).await;
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"], "unknown_endpoint");
    assert_eq!(
        app.post("not-a-uuid", &message).await.status(),
        StatusCode::NOT_FOUND
    );
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM messages")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(count, 0);
    app.stop().await;
}

#[tokio::test]
async fn a_paused_endpoint_is_410_until_resumed() {
    let app = TestApp::spawn().await;
    let (endpoint, secret) = app.endpoint().await;
    let first = Signed::new(std::slice::from_ref(&secret), feed_body(endpoint, 1));
    assert_eq!(
        app.post(endpoint, &first).await.status(),
        StatusCode::ACCEPTED
    );

    let tenant = app.db.tenant_of(endpoint).await;
    endpoints::change_status(
        &app.db.pool,
        tenant,
        EndpointId(endpoint),
        EndpointStatus::Paused,
    )
    .await
    .unwrap();
    let during = Signed::new(std::slice::from_ref(&secret), feed_body(endpoint, 2));
    // The cache hears of the pause through LISTEN/NOTIFY; allow it a moment to arrive.
    let status = eventually(|| app.post(endpoint, &during), StatusCode::GONE).await;
    assert_eq!(status, StatusCode::GONE);

    endpoints::change_status(
        &app.db.pool,
        tenant,
        EndpointId(endpoint),
        EndpointStatus::Active,
    )
    .await
    .unwrap();
    let status = eventually(|| app.post(endpoint, &during), StatusCode::ACCEPTED).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert_eq!(
        app.stored_webhook_ids(endpoint).await,
        vec![first.webhook_id, during.webhook_id]
    );
    app.stop().await;
}

/// Posts until the answer is `wanted` or two seconds pass; returns the last status.
async fn eventually<F, Fut>(post: F, wanted: StatusCode) -> StatusCode
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = reqwest::Response>,
{
    let give_up = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        let status = post().await.status();
        if status == wanted || tokio::time::Instant::now() > give_up {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn forged_stale_and_unsigned_messages_are_401_and_store_nothing() {
    // The front tier's clock stands still, so "301 s ahead" stays 301 s ahead while the test
    // runs (with the real clock a slow second made it 300, inside the tolerance).
    let at = OffsetDateTime::now_utc();
    let app = TestApp::spawn_with(
        test_config(),
        std::sync::Arc::new(relay_ingest::FixedClock(at)),
        None,
    )
    .await;
    let (endpoint, secret) = app.endpoint().await;
    let body = feed_body(endpoint, 1);
    let now = at.unix_timestamp();

    let wrong_secret = Signed::new(&[random_secret()], body.clone());
    let mut tampered = Signed::new(std::slice::from_ref(&secret), body.clone());
    tampered.body[10] ^= 1;
    let too_old = Signed::at(std::slice::from_ref(&secret), body.clone(), now - 301);
    let too_new = Signed::at(std::slice::from_ref(&secret), body.clone(), now + 301);
    for (case, message, outcome) in [
        ("wrong secret", &wrong_secret, "bad_signature"),
        ("tampered body", &tampered, "bad_signature"),
        ("signed 301 s ago", &too_old, "stale_timestamp"),
        ("signed 301 s ahead", &too_new, "stale_timestamp"),
    ] {
        let response = app.post(endpoint, message).await;
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{case}");
        let answer: serde_json::Value = response.json().await.unwrap();
        assert_eq!(answer["error"], outcome, "{case}");
    }

    let response = app
        .client
        .post(format!("{}/webhooks/{endpoint}", app.base_url))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let answer: serde_json::Value = response.json().await.unwrap();
    assert_eq!(answer["detail"], "the webhook-id header is missing");

    // A genuine signature beside an entry that is not ASCII text: the header is there, so it is
    // refused for what it is, not as missing.
    let genuine = Signed::at(std::slice::from_ref(&secret), body.clone(), now);
    let mut not_ascii = genuine.signature.clone().into_bytes();
    not_ascii.extend_from_slice(b" v1,\xe9t\xe9");
    let response = app
        .client
        .post(format!("{}/webhooks/{endpoint}", app.base_url))
        .header("content-type", "application/json")
        .header("webhook-id", &genuine.webhook_id)
        .header("webhook-timestamp", genuine.timestamp.to_string())
        .header(
            "webhook-signature",
            reqwest::header::HeaderValue::from_bytes(&not_ascii).unwrap(),
        )
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let answer: serde_json::Value = response.json().await.unwrap();
    assert_eq!(answer["error"], "bad_signature");
    assert_eq!(
        answer["detail"],
        "the webhook-signature header is not ASCII text"
    );

    assert!(app.stored_webhook_ids(endpoint).await.is_empty());
    assert_eq!(app.answered("bad_signature").await, 4.0);
    assert_eq!(app.answered("stale_timestamp").await, 2.0);
    // The same message with its signature as the upstream made it is stored: only the bytes
    // that are not ASCII refused it.
    assert_eq!(
        app.post(endpoint, &genuine).await.status(),
        StatusCode::ACCEPTED
    );
    assert_eq!(
        app.stored_webhook_ids(endpoint).await,
        vec![genuine.webhook_id]
    );
    app.stop().await;
}

#[tokio::test]
async fn a_signed_body_naming_another_endpoint_is_400() {
    // Bodies that are not v1 messages are stored and answered 202: see ingest_hostile.rs.
    let app = TestApp::spawn().await;
    let (endpoint, secret) = app.endpoint().await;
    let secrets = std::slice::from_ref(&secret);

    // Signed with this endpoint's secret, but naming another endpoint.
    let elsewhere = Uuid::new_v4();
    let misdirected = Signed::new(secrets, feed_body(elsewhere, 1));
    let response = app.post(endpoint, &misdirected).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let answer: serde_json::Value = response.json().await.unwrap();
    assert_eq!(answer["error"], "endpoint_mismatch");
    assert!(answer["detail"]
        .as_str()
        .unwrap()
        .contains(&elsewhere.to_string()));

    assert!(app.stored_webhook_ids(endpoint).await.is_empty());
    app.stop().await;
}

#[tokio::test]
async fn both_secrets_verify_during_a_rotation_and_the_old_one_stops_after_it() {
    let app = TestApp::spawn().await;
    let (endpoint, old) = app.endpoint().await;
    let new = random_secret();
    let tenant = app.db.tenant_of(endpoint).await;
    endpoints::rotate_secrets(
        &app.db.pool,
        &relay_tests::keys(),
        tenant,
        EndpointId(endpoint),
        &new,
        86_400.0,
    )
    .await
    .unwrap();

    // During the overlap the upstream signs with both; either alone also verifies.
    for (case, secrets) in [
        ("both", vec![new.clone(), old.clone()]),
        ("old only", vec![old.clone()]),
        ("new only", vec![new.clone()]),
    ] {
        let message = Signed::new(&secrets, feed_body(endpoint, 1));
        let status = eventually(|| app.post(endpoint, &message), StatusCode::ACCEPTED).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{case}");
    }

    // A second rotation with no overlap: everything held before it stops verifying at once.
    let newest = random_secret();
    endpoints::rotate_secrets(
        &app.db.pool,
        &relay_tests::keys(),
        tenant,
        EndpointId(endpoint),
        &newest,
        0.0,
    )
    .await
    .unwrap();
    let by_old = Signed::new(&[old], feed_body(endpoint, 2));
    assert_eq!(
        eventually(|| app.post(endpoint, &by_old), StatusCode::UNAUTHORIZED).await,
        StatusCode::UNAUTHORIZED
    );
    let by_new = Signed::new(&[new], feed_body(endpoint, 2));
    assert_eq!(
        app.post(endpoint, &by_new).await.status(),
        StatusCode::UNAUTHORIZED
    );
    let by_newest = Signed::new(&[newest], feed_body(endpoint, 2));
    assert_eq!(
        app.post(endpoint, &by_newest).await.status(),
        StatusCode::ACCEPTED
    );
    app.stop().await;
}

#[tokio::test]
async fn metrics_are_served_in_the_prometheus_text_format() {
    let app = TestApp::spawn().await;
    let response = app.client.get(&app.metrics_url).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    let text = response.text().await.unwrap();
    for outcome in [
        "accepted",
        "duplicate",
        "bad_signature",
        "stale_timestamp",
        "too_large",
        "unknown_endpoint",
        "paused",
        "unavailable",
    ] {
        assert!(
            text.contains(&format!(
                "relay_ingest_messages_total{{outcome=\"{outcome}\"}} 0"
            )),
            "{outcome} missing from:\n{text}"
        );
    }
    assert!(text.contains("# TYPE relay_ingest_answer_duration_seconds histogram"));
    assert!(text.contains("# TYPE relay_ingest_message_body_bytes histogram"));
    app.stop().await;
}

#[tokio::test]
async fn a_scan_of_random_endpoint_ids_is_404_and_cannot_grow_the_cache_past_its_bound() {
    let config = relay_ingest::IngestConfig {
        endpoint_cache_max_entries: 8,
        ..relay_tests::test_config()
    };
    let app =
        TestApp::spawn_with(config, std::sync::Arc::new(relay_ingest::SystemClock), None).await;
    let (endpoint, secret) = app.endpoint().await;
    let scan = |_| async {
        let id = Uuid::new_v4();
        let message = Signed::new(std::slice::from_ref(&secret), feed_body(id, 1));
        app.post(id, &message).await.status()
    };
    // Unknown ids are cached only once the change listener is up; wait for the first one.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(5);
    while app.metric("relay_ingest_endpoint_cache_entries").await == 0.0 {
        assert_eq!(scan(0).await, StatusCode::NOT_FOUND);
        assert!(
            tokio::time::Instant::now() < give_up,
            "the cache never took an entry"
        );
    }
    for n in 0..200 {
        assert_eq!(scan(n).await, StatusCode::NOT_FOUND);
    }
    assert_eq!(app.metric("relay_ingest_endpoint_cache_entries").await, 8.0);
    // A registered endpoint is still served while the cache is full.
    let message = Signed::new(&[secret], feed_body(endpoint, 1));
    assert_eq!(
        app.post(endpoint, &message).await.status(),
        StatusCode::ACCEPTED
    );
    app.stop().await;
}

#[tokio::test]
async fn the_metrics_name_the_build_and_the_process() {
    let app = TestApp::spawn().await;
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        app.metric(&format!(
            "relay_build_info{{tier=\"ingest\",version=\"{version}\"}}"
        ))
        .await,
        1.0
    );
    assert!(app.metric("process_resident_memory_bytes").await > 0.0);
    assert!(app.metric("process_start_time_seconds").await > 0.0);
    app.stop().await;
}

/// `/healthz` says the process answers; `/readyz` says whether what the tier needs answers,
/// each dependency checked on a connection of its own, and which one failed.
#[tokio::test]
async fn readiness_names_the_dependency_that_does_not_answer() {
    let app = TestApp::spawn().await;
    let probe = |path: &str| {
        let url = app.metrics_url.replace("/metrics", path);
        let client = app.client.clone();
        async move {
            let answer = client.get(url).send().await.unwrap();
            let status = answer.status().as_u16();
            (status, answer.json::<serde_json::Value>().await.ok())
        }
    };
    assert_eq!(probe("/healthz").await.0, 200);
    let (status, body) = probe("/readyz").await;
    assert_eq!(status, 200, "{body:?}");
    assert_eq!(
        body.unwrap(),
        serde_json::json!({"ready": true, "checks": {"postgres": "ok"}})
    );

    // A publisher's needs, one of them down: a broker port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_port = closed.local_addr().unwrap().port();
    drop(closed);
    let trust = relay_netguard::TrustRoots::platform();
    let pool = relay_store::connect(&app.db.url, &relay_store::PoolOptions::default()).unwrap();
    let readiness = relay::telemetry::Readiness::default()
        .postgres(&pool)
        .redis(&relay_tests::redis_url(), &trust)
        .broker(
            &format!("amqp://guest:guest@127.0.0.1:{closed_port}/%2f"),
            &trust,
        );
    let (ready, checks) = readiness.check().await;
    assert!(!ready, "{checks:?}");
    assert_eq!(checks["postgres"], "ok", "{checks:?}");
    assert_eq!(checks["redis"], "ok", "{checks:?}");
    assert_ne!(checks["broker"], "ok", "{checks:?}");
    assert!(
        !checks["broker"].as_str().unwrap().contains("guest:guest"),
        "no credentials in the answer: {checks:?}"
    );

    let readiness = relay::telemetry::Readiness::default()
        .postgres(&pool)
        .broker(relay_publisher::DEFAULT_AMQP_URL, &trust);
    let (ready, checks) = readiness.check().await;
    assert!(ready, "{checks:?}");
    app.stop().await;
}
