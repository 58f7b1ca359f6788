//! Bad input: every field the API checks, refused with 400 and a JSON error that names it, and
//! nothing written (the database's own refusals included: they roll the transaction back).

use relay_tests::random_secret;
use serde_json::{json, Value};
use time::OffsetDateTime;
use uuid::Uuid;

use super::{merged, ApiApp};
use crate::stack::{assert_refused_field, Api};

#[tokio::test]
async fn bad_input_names_the_field_and_writes_nothing() {
    let app = ApiApp::spawn().await;
    let operator = Api::operator_token();
    let (tenant, token) = app.tenant("careful").await;
    let (endpoint, _) = app.endpoint(&token, json!({})).await;
    let secret = random_secret().to_whsec();
    let new = |extra: Value| {
        let body = json!({"id": Uuid::new_v4(), "lang": "en",
                          "secrets": [random_secret().to_whsec()]});
        merged(body, extra)
    };
    let e = |suffix: &str| format!("/v1/endpoints/{endpoint}{suffix}");
    let cases: Vec<(&str, String, &str, Option<Value>, &str)> = vec![
        (
            "POST",
            "/v1/tenants".into(),
            "op",
            Some(json!({"name": "  "})),
            "name",
        ),
        (
            "POST",
            "/v1/tenants".into(),
            "op",
            Some(json!({"nam": "x"})),
            "nam",
        ),
        (
            "POST",
            "/v1/tenants".into(),
            "op",
            Some(json!({"name": "x", "id": "no"})),
            "id",
        ),
        (
            "POST",
            format!("/v1/tenants/{tenant}/tokens"),
            "op",
            Some(json!({"ttl_s": 0})),
            "ttl_s",
        ),
        ("GET", "/v1/tenants?limit=0".into(), "op", None, "limit"),
        ("GET", "/v1/tenants?after=x".into(), "op", None, "after"),
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(json!({"id": null}))),
            "id",
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(json!({"id": "not-a-uuid"}))),
            "id",
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(json!({"lang": "English"}))),
            "lang",
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(json!({"lang": null}))),
            "lang",
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(json!({"upstream_base_url": "ftp://upstream.example"}))),
            "upstream_base_url",
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(
                json!({"upstream_base_url": "https://u:p@upstream.example"}),
            )),
            "upstream_base_url",
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(json!({"upstream_api_key": "two words"}))),
            "upstream_api_key",
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(json!({"secrets": []}))),
            "secrets",
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(json!({"secrets": ["whsec_"]}))),
            "secrets[0]",
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(
                json!({"secrets": [random_secret().to_whsec(), "nope"]}),
            )),
            "secrets[1]",
        ),
        // Valid each, refused by the table's unique key on the second insert: the endpoint,
        // its counter and the first secret written before it are rolled back.
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(json!({"secrets": [secret, secret]}))),
            "secrets[1]",
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(json!({"colour": "red"}))),
            "colour",
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            "t",
            Some(new(json!({"secrets": [5]}))),
            "secrets[0]",
        ),
        ("PATCH", e(""), "t", Some(json!({})), "body"),
        ("PATCH", e(""), "t", Some(json!({"lang": "EN"})), "lang"),
        (
            "POST",
            e("/secrets"),
            "t",
            Some(json!({"secret": "whsec_!!!"})),
            "secret",
        ),
        (
            "POST",
            e("/secrets"),
            "t",
            Some(json!({"secret": secret, "expires_in_s": -1})),
            "expires_in_s",
        ),
        (
            "POST",
            e("/secrets/rotate"),
            "t",
            Some(json!({"secret": secret, "overlap_s": 604_801})),
            "overlap_s",
        ),
        (
            "POST",
            e("/secrets/1/expire"),
            "t",
            Some(json!({"after_s": 604_801})),
            "after_s",
        ),
        (
            "POST",
            e("/secrets/x/expire"),
            "t",
            Some(json!({})),
            "secret_id",
        ),
        (
            "GET",
            "/v1/endpoints/not-a-uuid".into(),
            "t",
            None,
            "endpoint_id",
        ),
        (
            "PUT",
            "/v1/destination".into(),
            "t",
            Some(json!({"kind": "kafka"})),
            "kind",
        ),
        (
            "PUT",
            "/v1/destination".into(),
            "t",
            Some(json!({"kind": "own_exchange", "exchange": "x", "routing_key": "k"})),
            "amqp_url",
        ),
        (
            "PUT",
            "/v1/destination".into(),
            "t",
            Some(
                json!({"kind": "own_exchange", "amqp_url": "http://broker", "exchange": "x",
                     "routing_key": "k"}),
            ),
            "amqp_url",
        ),
        (
            "PUT",
            "/v1/destination".into(),
            "t",
            Some(json!({"kind": "own_exchange", "amqp_url": "amqp://broker", "routing_key": "k"})),
            "exchange",
        ),
        (
            "PUT",
            "/v1/destination".into(),
            "t",
            Some(json!({"kind": "relay_queue", "exchange": "x"})),
            "exchange",
        ),
        ("GET", e("/copy?limit=0"), "t", None, "limit"),
        ("GET", e("/copy?item_kind=tweet"), "t", None, "item_kind"),
        ("GET", e("/copy?company_id=abc"), "t", None, "company_id"),
        (
            "GET",
            e("/copy?include_tombstones=maybe"),
            "t",
            None,
            "include_tombstones",
        ),
        ("GET", e("/copy?colour=red"), "t", None, "colour"),
        ("GET", e("/messages?order=sideways"), "t", None, "order"),
        ("GET", e("/messages?cursor=x"), "t", None, "cursor"),
        ("POST", e("/tracks/FEED/rewind"), "t", None, "track"),
    ];
    let tables = [
        "tenants",
        "webhook_endpoints",
        "endpoint_arrival_counters",
        "endpoint_secrets",
        "tenant_destinations",
        "endpoint_tracks",
    ];
    let before = app.counts(&tables).await;
    let secret_rows: Vec<(i64, Option<OffsetDateTime>)> =
        sqlx::query_as("SELECT id, expires_at FROM endpoint_secrets ORDER BY id")
            .fetch_all(&app.db.pool)
            .await
            .unwrap();
    for (method, path, who, body, field) in &cases {
        let token = if *who == "op" { &operator } else { &token };
        let answer = app.call(method, path, Some(token), body.as_ref()).await;
        assert_refused_field(&answer, field, &format!("{method} {path} {body:?}"));
        assert!(
            answer.json["detail"]
                .as_str()
                .is_some_and(|d| !d.is_empty()),
            "{}",
            answer.text
        );
    }
    // A body that is not JSON at all.
    let response = reqwest::Client::new()
        .post(format!("{}/v1/endpoints", app.base_url))
        .bearer_auth(&token)
        .header("content-type", "application/json")
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["field"], "body", "{answer}");

    assert_eq!(app.counts(&tables).await, before, "something was written");
    let after: Vec<(i64, Option<OffsetDateTime>)> =
        sqlx::query_as("SELECT id, expires_at FROM endpoint_secrets ORDER BY id")
            .fetch_all(&app.db.pool)
            .await
            .unwrap();
    assert_eq!(after, secret_rows, "no secret's expiry changed");
    let view = app.ok(200, "GET", &e(""), &token, None).await;
    assert_eq!(view["lang"], "en");
    app.stop().await;
}

/// Stories endpoints: the fields of each kind refused on the other with a 400 naming them, bad
/// tickers and modes refused, nothing written; a good one registered, read and changed.
#[tokio::test]
async fn stories_endpoints_take_their_own_fields_and_refuse_the_others() {
    let app = ApiApp::spawn().await;
    let (_, token) = app.tenant("stories").await;
    let (feed, _) = app.endpoint(&token, json!({})).await;
    let stories = |extra: Value| {
        let body = json!({"id": Uuid::new_v4(), "source": "stories",
                          "tickers": ["ALFA B", "BETA"],
                          "secrets": [random_secret().to_whsec()]});
        merged(body, extra)
    };
    let long = "X".repeat(33);
    let too_many: Vec<String> = (0..101).map(|i| format!("T{i}")).collect();
    let created = [
        (stories(json!({"source": "news"})), "source"),
        (stories(json!({"lang": "en"})), "lang"),
        (stories(json!({"tickers": null})), "tickers"),
        (stories(json!({"tickers": []})), "tickers"),
        (stories(json!({"tickers": too_many})), "tickers"),
        (stories(json!({"tickers": ["ALFA", "ALFA"]})), "tickers[1]"),
        (stories(json!({"tickers": ["ALFA", long]})), "tickers[1]"),
        (stories(json!({"tickers": [" ALFA"]})), "tickers[0]"),
        (stories(json!({"tickers": ["AL\u{1b}FA"]})), "tickers[0]"),
        (stories(json!({"tickers": [""]})), "tickers[0]"),
        (stories(json!({"stories_mode": "push"})), "stories_mode"),
        (
            json!({"id": Uuid::new_v4(), "lang": "en", "tickers": ["ALFA"],
                   "secrets": [random_secret().to_whsec()]}),
            "tickers",
        ),
        (
            json!({"id": Uuid::new_v4(), "lang": "en", "stories_mode": "snapshot",
                   "secrets": [random_secret().to_whsec()]}),
            "stories_mode",
        ),
    ];
    let before = app.count("webhook_endpoints").await;
    for (body, field) in &created {
        let answer = app
            .call("POST", "/v1/endpoints", Some(&token), Some(body))
            .await;
        assert_refused_field(&answer, field, &body.to_string());
    }
    assert_eq!(
        app.count("webhook_endpoints").await,
        before,
        "nothing was written"
    );

    // A good one: its kind, mode and tickers read back; the feed's language is not its.
    let body = stories(json!({"stories_mode": "fetch_on_notify"}));
    let view = app
        .ok(201, "POST", "/v1/endpoints", &token, Some(&body))
        .await;
    assert_eq!(view["source"], "stories");
    assert_eq!(view["stories_mode"], "fetch_on_notify");
    assert_eq!(view["tickers"], json!(["ALFA B", "BETA"]));
    assert!(view["lang"].is_null(), "{view}");
    let id = view["id"].as_str().unwrap().to_owned();
    let path = format!("/v1/endpoints/{id}");
    for (change, field) in [
        (json!({"lang": "en"}), "lang"),
        (json!({"tickers": []}), "tickers"),
        (json!({"stories_mode": "sometimes"}), "stories_mode"),
    ] {
        let answer = app.call("PATCH", &path, Some(&token), Some(&change)).await;
        assert_refused_field(&answer, field, &change.to_string());
    }
    let changed = app
        .ok(
            200,
            "PATCH",
            &path,
            &token,
            Some(&json!({"tickers": ["GAMMA"], "stories_mode": "snapshot"})),
        )
        .await;
    assert_eq!(changed["tickers"], json!(["GAMMA"]));
    assert_eq!(changed["stories_mode"], "snapshot");
    // A feed endpoint has neither.
    for change in [
        json!({"tickers": ["ALFA"]}),
        json!({"stories_mode": "snapshot"}),
    ] {
        let answer = app
            .call(
                "PATCH",
                &format!("/v1/endpoints/{feed}"),
                Some(&token),
                Some(&change),
            )
            .await;
        assert_eq!(answer.status, 400, "{change}: {}", answer.text);
    }
    let feed_view = app
        .ok(200, "GET", &format!("/v1/endpoints/{feed}"), &token, None)
        .await;
    assert_eq!(feed_view["source"], "feed");
    assert!(feed_view.get("tickers").is_none(), "{feed_view}");
    // Its copy and notifications read, empty.
    let copy = app
        .ok(
            200,
            "GET",
            &format!("{path}/stories?include_closed=true"),
            &token,
            None,
        )
        .await;
    assert_eq!(copy["data"], json!([]));
    let notifications = app
        .ok(200, "GET", &format!("{path}/notifications"), &token, None)
        .await;
    assert_eq!(notifications["data"], json!([]));
    let missing = app
        .call("GET", &format!("{path}/stories/st_1"), Some(&token), None)
        .await;
    assert_eq!(missing.status, 404, "{}", missing.text);
    app.stop().await;
}
