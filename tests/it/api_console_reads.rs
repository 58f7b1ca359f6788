//! What the console reads and does beyond the lists: a message found by its arrival number or
//! its webhook-id with its body, headers and the changes its events made; a search of bodies
//! that pages through a bounded read; quarantined messages retried and discarded many at once;
//! endpoints with names; activity over a day and a week from the sequencers' samples.

use relay_store::messages::SEARCH_SCAN;
use serde_json::{json, Value};
use time::OffsetDateTime;

use super::{apply_events, item_event, message_body, store_messages, ApiApp};
use crate::sequencer_apply::{incoming, store_new};
use crate::stack::assert_refused_field;

#[tokio::test]
async fn a_message_is_found_by_arrival_and_webhook_id_with_its_body_headers_and_changes() {
    let app = ApiApp::spawn().await;
    let (tenant, token) = app.tenant("finder").await;
    let (endpoint, _) = app.endpoint(&token, json!({})).await;
    let (_, other_token) = app.tenant("stranger").await;
    let seqs = store_messages(&app.db, tenant, endpoint, 2).await;
    // The events the first message carries, applied as the sequencer applies them.
    apply_events(
        &app.db,
        tenant,
        endpoint,
        &[item_event("announcement:9", "announcement", 28, 1)],
    )
    .await;
    let e = |suffix: &str| format!("/v1/endpoints/{endpoint}{suffix}");

    let by_seq = app
        .ok(
            200,
            "GET",
            &e(&format!("/messages/{}", seqs[0])),
            &token,
            None,
        )
        .await;
    assert_eq!(by_seq["message"]["arrival_seq"], seqs[0]);
    let webhook_id = by_seq["message"]["webhook_id"].as_str().unwrap().to_owned();
    assert_eq!(by_seq["headers"]["webhook-id"], webhook_id.as_str());
    assert!(by_seq["headers"]["webhook-timestamp"]
        .as_str()
        .unwrap()
        .parse::<i64>()
        .is_ok());
    let body: Value = serde_json::from_str(by_seq["body"].as_str().unwrap()).unwrap();
    assert_eq!(body["events"][0]["id"], "evt_announcement:9_1");
    assert_eq!(by_seq["message"].get("body"), None, "{by_seq}");
    let changes = by_seq["changes"].as_array().unwrap();
    assert_eq!(changes.len(), 1, "{by_seq}");
    assert_eq!(changes[0]["subject"], "announcement:9");
    assert_eq!(changes[0]["event_id"], "evt_announcement:9_1");
    assert_eq!(changes[0]["operation"], "upsert");
    assert_eq!(by_seq["changes_cut"], false);
    assert_eq!(by_seq["quarantine"], Value::Null);

    // The same message by the webhook-id it was sent with; the second made no change.
    let path = e(&format!("/messages/by-webhook-id/{webhook_id}"));
    let by_id = app.ok(200, "GET", &path, &token, None).await;
    assert_eq!(by_id, by_seq);
    let second = app
        .ok(
            200,
            "GET",
            &e(&format!("/messages/{}", seqs[1])),
            &token,
            None,
        )
        .await;
    assert_eq!(second["changes"], json!([]));

    // Not found, badly named, or another tenant's: nothing is told of it.
    for path in [
        e("/messages/by-webhook-id/msg_never_sent"),
        e("/messages/999999"),
    ] {
        let answer = app.call("GET", &path, Some(&token), None).await;
        assert_eq!(answer.status, 404, "{path}: {}", answer.text);
        assert_eq!(answer.json["detail"], "no such message");
    }
    for path in [e("/messages/abc"), e("/messages/0")] {
        let answer = app.call("GET", &path, Some(&token), None).await;
        assert_refused_field(&answer, "arrival_seq", &path);
    }
    let long = "x".repeat(300);
    let answer = app
        .call(
            "GET",
            &e(&format!("/messages/by-webhook-id/{long}")),
            Some(&token),
            None,
        )
        .await;
    assert_refused_field(&answer, "webhook_id", "a webhook-id longer than any stored");
    let answer = app.call("GET", &path, Some(&other_token), None).await;
    assert_eq!(answer.status, 404, "{}", answer.text);
    assert_eq!(answer.json["detail"], "no such webhook endpoint");
    app.stop().await;
}

#[tokio::test]
async fn a_search_of_bodies_pages_on_through_a_bounded_read() {
    let app = ApiApp::spawn().await;
    let (tenant, token) = app.tenant("searcher").await;
    let (endpoint, _) = app.endpoint(&token, json!({})).await;
    // More messages than one page reads; the one sought is among the oldest.
    let total = SEARCH_SCAN as u64 + 100;
    let now = OffsetDateTime::now_utc();
    let batch: Vec<_> = (1..=total)
        .map(|n| {
            let title = format!("headline number {n}.");
            let mut event = item_event("announcement:9", "announcement", 28, n);
            event["data"]["head"]["title"] = json!(title);
            let mut message = incoming(
                tenant,
                endpoint,
                Some("feed".into()),
                Some(1),
                message_body(endpoint, &[event], n),
            );
            message.received_at = now;
            message
        })
        .collect();
    let seqs = store_new(&app.db.pool, &batch).await;
    let sought = seqs[6];
    let e = |query: &str| format!("/v1/endpoints/{endpoint}/messages?{query}");

    // Newest first: the first page reads the newest SEARCH_SCAN and finds nothing, yet says
    // where to go on; the second finds it and is the last.
    let first = app
        .ok(200, "GET", &e("contains=number%207."), &token, None)
        .await;
    assert_eq!(first["data"], json!([]), "{first}");
    let cursor = first["next_cursor"]
        .as_str()
        .expect("a next page")
        .to_owned();
    let second = app
        .ok(
            200,
            "GET",
            &e(&format!("contains=number%207.&cursor={cursor}")),
            &token,
            None,
        )
        .await;
    let found: Vec<i64> = second["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["arrival_seq"].as_i64().unwrap())
        .collect();
    assert_eq!(found, [sought], "{second}");
    assert_eq!(second["next_cursor"], Value::Null);

    // In arrival order it is on the first page, which is full (limit 1): it goes on from it.
    let page = app
        .ok(
            200,
            "GET",
            &e("contains=number%207.&order=arrival&limit=1"),
            &token,
            None,
        )
        .await;
    assert_eq!(page["data"][0]["arrival_seq"], sought);
    assert_eq!(page["next_cursor"], sought.to_string());
    // Found with the other filters too; too long a text is refused.
    let waiting = app
        .ok(
            200,
            "GET",
            &e("contains=number%2012.&order=arrival&status=waiting"),
            &token,
            None,
        )
        .await;
    assert_eq!(waiting["data"][0]["arrival_seq"], seqs[11]);
    let answer = app
        .call(
            "GET",
            &e(&format!("contains={}", "y".repeat(201))),
            Some(&token),
            None,
        )
        .await;
    assert_refused_field(&answer, "contains", "a search text over 200 bytes");
    app.stop().await;
}

#[tokio::test]
async fn quarantined_messages_are_retried_and_discarded_many_at_once() {
    let app = ApiApp::spawn().await;
    let (tenant, token) = app.tenant("bulk").await;
    let (endpoint, _) = app.endpoint(&token, json!({})).await;
    let (_, other_token) = app.tenant("stranger").await;
    let seqs = store_messages(&app.db, tenant, endpoint, 4).await;
    sqlx::query(
        "INSERT INTO quarantined_messages (endpoint_id, tenant_id, arrival_seq, reason, attempts)
         SELECT $1, $2, unnest($3::int8[]), 'not a v1 message', 1",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(&seqs)
    .execute(&app.db.pool)
    .await
    .unwrap();
    let retry = format!("/v1/endpoints/{endpoint}/quarantine/retry");
    let discard = format!("/v1/endpoints/{endpoint}/quarantine/discard");

    // Another tenant's token reaches none of them.
    let body = json!({"arrival_seqs": &seqs[..3]});
    let answer = app
        .call("POST", &retry, Some(&other_token), Some(&body))
        .await;
    assert_eq!(answer.status, 404, "{}", answer.text);

    let answer = app.ok(200, "POST", &retry, &token, Some(&body)).await;
    let results = answer["results"].as_array().unwrap();
    assert_eq!(results.len(), 3);
    let mut retried_as = Vec::new();
    for (result, seq) in results.iter().zip(&seqs) {
        assert_eq!(result["arrival_seq"], *seq);
        assert_eq!(result["result"], "done", "{answer}");
        assert_eq!(result["quarantined"]["status"], "retried");
        retried_as.push(result["quarantined"]["retried_as"].as_i64().unwrap());
    }
    // Each stored again at the end of the endpoint's order, in the order given.
    assert!(retried_as.windows(2).all(|w| w[0] < w[1]), "{retried_as:?}");
    assert!(retried_as[0] > seqs[3]);

    // Again, with one never quarantined: told apart, nothing changed.
    let again = json!({"arrival_seqs": [seqs[0], 999_999]});
    let answer = app.ok(200, "POST", &retry, &token, Some(&again)).await;
    assert_eq!(answer["results"][0]["result"], "already_resolved");
    assert_eq!(answer["results"][0]["quarantined"]["status"], "retried");
    assert_eq!(answer["results"][1]["result"], "not_found");
    assert_eq!(answer["results"][1]["quarantined"], Value::Null);

    let answer = app
        .ok(
            200,
            "POST",
            &discard,
            &token,
            Some(&json!({"arrival_seqs": [seqs[3], seqs[1]]})),
        )
        .await;
    assert_eq!(answer["results"][0]["result"], "done");
    assert_eq!(answer["results"][0]["quarantined"]["status"], "discarded");
    assert_eq!(answer["results"][1]["result"], "already_resolved");
    let statuses: Vec<String> = sqlx::query_scalar(
        "SELECT status FROM quarantined_messages WHERE endpoint_id = $1 ORDER BY arrival_seq",
    )
    .bind(endpoint)
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(statuses, ["retried", "retried", "retried", "discarded"]);

    // Bounded and checked before anything is done.
    for (body, field) in [
        (json!({"arrival_seqs": []}), "arrival_seqs"),
        (
            json!({"arrival_seqs": (1..=101).collect::<Vec<i64>>()}),
            "arrival_seqs",
        ),
        (json!({"arrival_seqs": [5, 6, 5]}), "arrival_seqs[2]"),
        (json!({"arrival_seqs": [1], "all": true}), "all"),
    ] {
        let answer = app.call("POST", &retry, Some(&token), Some(&body)).await;
        assert_refused_field(&answer, field, &body.to_string());
    }
    app.stop().await;
}

#[tokio::test]
async fn endpoints_carry_the_names_their_tenants_give_them() {
    let app = ApiApp::spawn().await;
    let (_, token) = app.tenant("namer").await;
    let (endpoint, _) = app
        .endpoint(&token, json!({"name": "  Nordic filings  "}))
        .await;
    let path = format!("/v1/endpoints/{endpoint}");
    let read = app.ok(200, "GET", &path, &token, None).await;
    assert_eq!(read["name"], "Nordic filings");
    let listed = app.ok(200, "GET", "/v1/endpoints", &token, None).await;
    assert_eq!(listed["data"][0]["name"], "Nordic filings");

    let renamed = app
        .ok(
            200,
            "PATCH",
            &path,
            &token,
            Some(&json!({"name": "Filings \u{202e}gnp.exe"})),
        )
        .await;
    assert_eq!(renamed["name"], "Filings \u{202e}gnp.exe");
    let long = "n".repeat(200);
    let renamed = app
        .ok(200, "PATCH", &path, &token, Some(&json!({"name": long})))
        .await;
    assert_eq!(renamed["name"], long.as_str());
    let cleared = app
        .ok(200, "PATCH", &path, &token, Some(&json!({"name": ""})))
        .await;
    assert_eq!(cleared["name"], Value::Null);
    let (unnamed, _) = app.endpoint(&token, json!({})).await;
    let read = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{unnamed}"),
            &token,
            None,
        )
        .await;
    assert_eq!(read["name"], Value::Null);

    for name in ["n".repeat(201), "   ".to_owned(), "line\nbreak".to_owned()] {
        let answer = app
            .call("PATCH", &path, Some(&token), Some(&json!({"name": name})))
            .await;
        assert_refused_field(&answer, "name", &name);
        let (_, _, answer) = app.try_endpoint(&token, json!({"name": name})).await;
        assert_refused_field(&answer, "name", &name);
    }
    let read = app.ok(200, "GET", &path, &token, None).await;
    assert_eq!(read["name"], Value::Null, "a refused name changed nothing");
    app.stop().await;
}

#[tokio::test]
async fn a_day_and_a_week_of_activity_come_from_the_sequencers_samples() {
    let app = ApiApp::spawn().await;
    let (tenant, token) = app.tenant("watcher").await;
    let (endpoint, _) = app.endpoint(&token, json!({})).await;
    let activity = |window: &str| format!("/v1/endpoints/{endpoint}/activity?window={window}");
    let sample = || async {
        relay_store::lag_samples::sample(&app.db.pool)
            .await
            .unwrap();
    };
    // Registered, sampled before anything came: a row of zeros.
    sample().await;
    store_messages(&app.db, tenant, endpoint, 5).await;
    apply_events(
        &app.db,
        tenant,
        endpoint,
        &[
            item_event("announcement:1", "announcement", 28, 1),
            item_event("announcement:2", "announcement", 28, 2),
        ],
    )
    .await;
    sample().await;
    store_messages(&app.db, tenant, endpoint, 3).await;
    sample().await;
    // Sampled again with nothing new: nothing more is counted.
    sample().await;

    let sum = |view: &Value, key: &str| -> f64 {
        view["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b[key].as_f64().unwrap())
            .sum()
    };
    for (window, bucket_s, count) in [("day", 900, 96), ("week", 3600, 168)] {
        let view = app.ok(200, "GET", &activity(window), &token, None).await;
        assert_eq!(view["window"], window);
        assert_eq!(view["bucket_s"], bucket_s);
        assert_eq!(view["buckets"].as_array().unwrap().len(), count);
        assert_eq!(view.get("minutes"), None);
        assert_eq!(sum(&view, "received"), 8.0, "{window}: {view}");
        assert_eq!(sum(&view, "written"), 2.0, "{window}: {view}");
        // Eight messages wait: the lag was sampled.
        assert!(sum(&view, "apply_lag_s") > 0.0, "{window}: {view}");
    }
    let hour = app.ok(200, "GET", &activity("hour"), &token, None).await;
    assert_eq!(hour["bucket_s"], 60);
    assert_eq!(hour["buckets"], hour["minutes"]);
    assert_eq!(sum(&hour, "received"), 8.0, "{hour}");
    let answer = app
        .call("GET", &activity("month"), Some(&token), None)
        .await;
    assert_refused_field(&answer, "window", "an unknown window");
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM endpoint_activity_samples WHERE endpoint_id = $1")
            .bind(endpoint)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    assert!(rows <= 2, "one row per quarter hour: {rows}");
    app.stop().await;
}
