//! An endpoint's life through the API: secrets rotated, expired, the endpoint paused and
//! resumed, the destination set and reset, and the front tier answering as those writes say.

use std::sync::Arc;
use std::time::Duration;

use relay_tests::random_secret;
use serde_json::json;
use time::OffsetDateTime;

use super::ApiApp;
use crate::stack::Api;

#[tokio::test]
async fn secrets_rotate_with_an_overlap_and_pause_writes_the_status_the_front_tier_reads() {
    let app = ApiApp::spawn().await;
    let (_, token) = app.tenant("rotating").await;
    let (endpoint, first) = app.endpoint(&token, json!({})).await;
    let e = |suffix: &str| format!("/v1/endpoints/{endpoint}{suffix}");

    let rotated = app
        .ok(
            200,
            "POST",
            &e("/secrets/rotate"),
            &token,
            Some(&json!({"secret": random_secret().to_whsec(), "overlap_s": 3600})),
        )
        .await;
    assert_eq!(rotated["old_secrets"], 1);
    let auth = relay_store::endpoints::load_auth(&app.db.pool, &relay_tests::keys(), endpoint)
        .await
        .unwrap()
        .unwrap();
    let now = OffsetDateTime::now_utc();
    assert_eq!(
        auth.secrets_at(now).count(),
        2,
        "both verify during the overlap"
    );
    assert_eq!(
        auth.secrets_at(now + Duration::from_secs(3601)).count(),
        1,
        "only the new one after it"
    );
    assert!(!auth
        .secrets_at(now + Duration::from_secs(3601))
        .any(|s| s.to_whsec() == first));

    // Expire the new one at once: none verifies.
    let secrets = app.ok(200, "GET", &e("/secrets"), &token, None).await;
    let newest = secrets.as_array().unwrap().last().unwrap()["id"]
        .as_i64()
        .unwrap();
    let expired = app
        .ok(
            200,
            "POST",
            &e(&format!("/secrets/{newest}/expire")),
            &token,
            None,
        )
        .await;
    assert_eq!(expired["active"], false);
    // A secret the endpoint holds already is a conflict.
    let again = app
        .call(
            "POST",
            &e("/secrets"),
            Some(&token),
            Some(&json!({"secret": first})),
        )
        .await;
    assert_eq!(again.status, 409, "{}", again.text);

    let paused = app.ok(200, "POST", &e("/pause"), &token, None).await;
    assert_eq!(paused["status"], "paused");
    let auth = relay_store::endpoints::load_auth(&app.db.pool, &relay_tests::keys(), endpoint)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(auth.status, relay_store::endpoints::EndpointStatus::Paused);
    let resumed = app.ok(200, "POST", &e("/resume"), &token, None).await;
    assert_eq!(resumed["status"], "active");

    // The destination: the default, then the tenant's own exchange (URL never shown), then back.
    let default = app.ok(200, "GET", "/v1/destination", &token, None).await;
    assert_eq!(
        (default["kind"].as_str(), default["default"].as_bool()),
        (Some("relay_queue"), Some(true))
    );
    let own = app
        .ok(
            200,
            "PUT",
            "/v1/destination",
            &token,
            Some(
                &json!({"kind": "own_exchange", "amqp_url": "amqp://u:p@broker",
                         "exchange": "feed", "routing_key": "copy"}),
            ),
        )
        .await;
    assert_eq!(own["amqp_url_set"], true);
    assert_eq!(own["exchange"], "feed");
    assert!(own.get("amqp_url").is_none());
    let reset = app.ok(200, "DELETE", "/v1/destination", &token, None).await;
    assert_eq!(reset["default"], true);
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM tenant_destinations")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(stored, 0);

    // A token minted by the operator route works for the tenant.
    let (tenant2, _) = app.tenant("second").await;
    let minted = app
        .ok(
            201,
            "POST",
            &format!("/v1/tenants/{tenant2}/tokens"),
            &Api::operator_token(),
            Some(&json!({"ttl_s": 60})),
        )
        .await;
    let own_tenant = app
        .ok(
            200,
            "GET",
            "/v1/tenant",
            minted["token"].as_str().unwrap(),
            None,
        )
        .await;
    assert_eq!(own_tenant["id"], tenant2.to_string());
    app.stop().await;
}

// ---- what the front tier does with what the API writes ---------------------------------------

/// The front tier on the API's database answers as the API's writes say, at once (its cache
/// hears of each change by the tables' NOTIFY triggers): 410 once paused, 202 again once
/// resumed, and a secret rotated in verifies the next message.
#[tokio::test]
async fn the_front_tier_follows_pause_resume_and_rotation_made_through_the_api() {
    use relay_tests::{feed_body, post_to, start_front_tier, test_config, Signed};
    use relay_wire::SigningSecret;

    let app = ApiApp::spawn().await;
    let (_, token) = app.tenant("front").await;
    let (endpoint, first) = app.endpoint(&token, json!({})).await;
    let first = SigningSecret::parse(&first).unwrap();
    let ingest = start_front_tier(
        &app.db.url,
        test_config(),
        Arc::new(relay_ingest::SystemClock),
    )
    .await;
    let (client, base_url) = (reqwest::Client::new(), format!("http://{}", ingest.address));
    // The endpoint's message `n`, signed with `secret`, posted: the answer's status.
    let post = |secret: &SigningSecret, n: u64| {
        let (client, base_url) = (client.clone(), base_url.clone());
        let message = Signed::new(std::slice::from_ref(secret), feed_body(endpoint, n));
        async move {
            let answer = post_to(&client, &base_url, endpoint, &message).await;
            answer.unwrap().status().as_u16()
        }
    };
    let e = |suffix: &str| format!("/v1/endpoints/{endpoint}{suffix}");
    assert_eq!(post(&first, 1).await, 202);

    app.ok(200, "POST", &e("/pause"), &token, None).await;
    let paused = wait_for_answer(|| post(&first, 2), 410).await;
    assert_eq!(
        paused, 410,
        "paused through the API: the front tier answers 410"
    );
    app.ok(200, "POST", &e("/resume"), &token, None).await;
    let resumed = wait_for_answer(|| post(&first, 3), 202).await;
    assert_eq!(resumed, 202);

    // A secret rotated in through the API verifies; so does the old one, for the overlap.
    let second = random_secret();
    app.ok(
        200,
        "POST",
        &e("/secrets/rotate"),
        &token,
        Some(&json!({"secret": second.to_whsec(), "overlap_s": 600})),
    )
    .await;
    let rotated = wait_for_answer(|| post(&second, 4), 202).await;
    assert_eq!(rotated, 202);
    assert_eq!(post(&first, 5).await, 202);
    // Expired through the API: the old secret no longer verifies.
    let secrets = app.ok(200, "GET", &e("/secrets"), &token, None).await;
    let first_id = secrets[0]["id"].as_i64().unwrap();
    app.ok(
        200,
        "POST",
        &e(&format!("/secrets/{first_id}/expire")),
        &token,
        None,
    )
    .await;
    let refused = wait_for_answer(|| post(&first, 6), 401).await;
    assert_eq!(refused, 401);

    let state = app.ok(200, "GET", &e("/state"), &token, None).await;
    // Every message answered 202 was stored (a post racing the pause may have been taken too).
    let stored = app.db.stored_messages(endpoint).await;
    assert!(stored.len() >= 4);
    assert_eq!(state["last_arrival_seq"], stored.len());
    assert_eq!(
        state["messages_waiting"],
        stored.len(),
        "no sequencer runs here"
    );
    ingest.stop().await.unwrap();
    app.stop().await;
}

/// Posts until the answer is `want` (the front tier's cache hears of a change a moment after
/// it commits), at most for ten seconds (the suite shares two cores); returns the last answer.
async fn wait_for_answer<F, Fut>(mut post: F, want: u16) -> u16
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = u16>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = post().await;
        if status == want || tokio::time::Instant::now() > deadline {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
