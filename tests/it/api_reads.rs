//! Reads of a copy, its state and its stored messages, written through relay_store as the
//! sequencer and the front tier write them.

use relay_tests::execute_for;
use relay_wire::Sequence;
use serde_json::{json, Value};

use super::{apply_events, hidden_event, item_event, store_messages, ApiApp};
use crate::stack::assert_refused_field;

#[tokio::test]
async fn reads_page_and_filter_the_copy_and_show_state_and_messages() {
    let app = ApiApp::spawn().await;
    let (tenant, token) = app.tenant("reader").await;
    let (endpoint, _) = app.endpoint(&token, json!({})).await;
    let e = |suffix: &str| format!("/v1/endpoints/{endpoint}{suffix}");

    // Five items and a tombstone, through relay_store as the sequencer writes them.
    apply_events(
        &app.db,
        tenant,
        endpoint,
        &[
            item_event("announcement:1", "announcement", 28, 10),
            item_event("announcement:2", "announcement", 31, 11),
            item_event("announcement:3", "announcement", 28, 12),
            item_event("announcement:4", "announcement", 31, 13),
            item_event("pre_earnings_analysis:5", "pre_earnings_analysis", 28, 14),
            item_event("announcement:6", "announcement", 28, 15),
        ],
    )
    .await;
    apply_events(
        &app.db,
        tenant,
        endpoint,
        &[hidden_event("announcement:6", 16)],
    )
    .await;

    // Page through the copy two at a time.
    let mut subjects = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => e(&format!("/copy?limit=2&after={c}")),
            None => e("/copy?limit=2"),
        };
        let page = app.ok(200, "GET", &path, &token, None).await;
        for item in page["data"].as_array().unwrap() {
            assert_eq!(item["tombstone"], false);
            subjects.push(item["subject"].as_str().unwrap().to_owned());
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    assert_eq!(
        subjects,
        [
            "announcement:1",
            "announcement:2",
            "announcement:3",
            "announcement:4",
            "pre_earnings_analysis:5"
        ]
    );
    let subjects_of = |page: &Value| -> Vec<String> {
        page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["subject"].as_str().unwrap().to_owned())
            .collect()
    };
    let kind = app
        .ok(
            200,
            "GET",
            &e("/copy?item_kind=pre_earnings_analysis"),
            &token,
            None,
        )
        .await;
    assert_eq!(subjects_of(&kind), ["pre_earnings_analysis:5"]);
    let company = app
        .ok(
            200,
            "GET",
            &e("/copy?company_id=31&item_kind=announcement"),
            &token,
            None,
        )
        .await;
    assert_eq!(subjects_of(&company), ["announcement:2", "announcement:4"]);
    let all = app
        .ok(
            200,
            "GET",
            &e("/copy?include_tombstones=true"),
            &token,
            None,
        )
        .await;
    assert_eq!(subjects_of(&all).len(), 6);
    let tombstone = all["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["subject"] == "announcement:6")
        .unwrap();
    assert_eq!(tombstone["tombstone"], true);
    assert_eq!(tombstone["item"], Value::Null);

    // One item, as stored.
    let one = app
        .ok(200, "GET", &e("/copy/announcement:3"), &token, None)
        .await;
    assert_eq!(
        one["item"],
        item_event("announcement:3", "announcement", 28, 12)["data"]
    );
    assert_eq!(one["sequence"], Sequence::from_parts(1, 12).as_str());
    assert_eq!(one["company_id"], 28);
    assert_eq!(
        one["parts"],
        json!([{"part_id": "flash:12", "part_version": 1}])
    );
    let missing = app
        .call("GET", &e("/copy/announcement:999"), Some(&token), None)
        .await;
    assert_eq!(missing.status, 404);

    // Messages: three stored, two applied (one with its outcome recorded), one waiting.
    let seqs = store_messages(&app.db, tenant, endpoint, 3).await;
    assert_eq!(seqs, [1, 2, 3]);
    // The events above were written as the sequencer writes them, which keeps a cursor and a
    // track row: set both as the messages would have left them, with message 2's outcome; and
    // two of the outbox's changes are published.
    for statement in [
        "INSERT INTO endpoint_apply_cursors
             (endpoint_id, tenant_id, applied_arrival_seq, last_received_at, last_applied_at)
         VALUES ($1, $2, 2, now() - interval '59 s', now())
         ON CONFLICT (endpoint_id) DO UPDATE
         SET applied_arrival_seq = excluded.applied_arrival_seq,
             last_received_at = excluded.last_received_at,
             last_applied_at = excluded.last_applied_at",
        "INSERT INTO message_applications (endpoint_id, arrival_seq, tenant_id, outcome,
                                           events_applied, events_ignored)
         VALUES ($1, 2, $2, 'applied', 1, 0)",
        "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id, generation, access_version,
                                      through, last_was_reset)
         VALUES ($1, 'feed', $2, 1, 'av1', '1.16', false)
         ON CONFLICT (endpoint_id, track) DO UPDATE
         SET generation = excluded.generation, access_version = excluded.access_version,
             through = excluded.through, last_was_reset = excluded.last_was_reset",
        "INSERT INTO endpoint_publish_cursors (endpoint_id, tenant_id, published_through)
         VALUES ($1, $2, 2)",
    ] {
        execute_for(&app.db, statement, endpoint, tenant).await;
    }
    let changes = relay_tests::readback::list_changes(&app.db.pool, endpoint)
        .await
        .unwrap();
    assert_eq!(changes.len(), 7, "six upserts and a removal");

    let newest = app.ok(200, "GET", &e("/messages"), &token, None).await;
    let data = newest["data"].as_array().unwrap();
    let arrival: Vec<i64> = data
        .iter()
        .map(|m| m["arrival_seq"].as_i64().unwrap())
        .collect();
    assert_eq!(arrival, [3, 2, 1]);
    assert!(data
        .iter()
        .all(|m| m["answered"] == 202 && m.get("body").is_none()));
    assert_eq!(data[0]["applied"], Value::Null, "message 3 waits");
    assert_eq!(data[1]["applied"]["outcome"], "applied");
    assert_eq!(data[1]["applied"]["events_applied"], 1);
    // Passed by the cursor with no row of its own: applied with all its events (the common
    // outcome needs no row; the message's event count says how many).
    assert_eq!(
        data[2]["applied"]["outcome"], "applied",
        "passed by the cursor"
    );
    assert_eq!(data[2]["applied"]["events_applied"], 1);
    assert_eq!(data[2]["applied"]["events_ignored"], 0);
    // One stored before event counts were kept says it does not know.
    execute_for(
        &app.db,
        "UPDATE messages SET events = NULL WHERE endpoint_id = $1 AND arrival_seq = 1
             AND tenant_id = $2",
        endpoint,
        tenant,
    )
    .await;
    let older = app.ok(200, "GET", &e("/messages"), &token, None).await;
    assert_eq!(older["data"][2]["applied"]["outcome"], "unrecorded");
    assert_eq!(older["data"][2]["status"], "applied");
    assert_eq!(data[0]["track"], "feed");
    let first_page = app
        .ok(
            200,
            "GET",
            &e("/messages?order=arrival&limit=2&include_body=true"),
            &token,
            None,
        )
        .await;
    let arrival: Vec<i64> = first_page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["arrival_seq"].as_i64().unwrap())
        .collect();
    assert_eq!(arrival, [1, 2]);
    assert!(first_page["data"][0]["body"]
        .as_str()
        .unwrap()
        .contains("announcement:9"));
    let next = first_page["next_cursor"].as_str().unwrap();
    let second_page = app
        .ok(
            200,
            "GET",
            &e(&format!("/messages?order=arrival&limit=2&cursor={next}")),
            &token,
            None,
        )
        .await;
    assert_eq!(second_page["data"][0]["arrival_seq"], 3);
    assert_eq!(second_page["next_cursor"], Value::Null);

    // Each message says what became of it, and the listing filters by that and by time.
    let statuses: Vec<&str> = data.iter().map(|m| m["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, ["waiting", "applied", "applied"]);
    execute_for(
        &app.db,
        "INSERT INTO message_applications (endpoint_id, arrival_seq, tenant_id, outcome)
         VALUES ($1, 1, $2, 'older_generation')",
        endpoint,
        tenant,
    )
    .await;
    let listed = |query: &'static str| {
        let (app, token, path) = (&app, &token, e(&format!("/messages?order=arrival&{query}")));
        async move {
            let page = app.ok(200, "GET", &path, token, None).await;
            page["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["arrival_seq"].as_i64().unwrap())
                .collect::<Vec<i64>>()
        }
    };
    assert_eq!(listed("status=waiting").await, [3]);
    assert_eq!(listed("status=applied").await, [2]);
    assert_eq!(listed("status=ignored").await, [1]);
    assert_eq!(listed("status=quarantined").await, Vec::<i64>::new());
    assert_eq!(
        listed("received_before=2100-01-01T00:00:00Z").await,
        [1, 2, 3]
    );
    assert_eq!(
        listed("received_from=2100-01-01T00:00:00Z").await,
        Vec::<i64>::new()
    );
    assert_eq!(
        listed("status=applied&received_from=2000-01-01T00:00:00Z").await,
        [2]
    );
    sqlx::query(
        "UPDATE messages SET duplicates = 2, last_duplicate_at = now()
         WHERE endpoint_id = $1 AND arrival_seq = 2",
    )
    .bind(endpoint)
    .execute(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(listed("status=duplicate").await, [2]);
    let twice = app
        .ok(200, "GET", &e("/messages?status=duplicate"), &token, None)
        .await;
    assert_eq!(twice["data"][0]["duplicates"], 2, "{twice}");
    assert!(twice["data"][0]["last_duplicate_at"].is_string(), "{twice}");
    for (query, field) in [
        ("status=repeated", "status"),
        ("received_from=yesterday", "received_from"),
        ("received_before=2100-13-01T00:00:00Z", "received_before"),
    ] {
        let refused = app
            .call("GET", &e(&format!("/messages?{query}")), Some(&token), None)
            .await;
        assert_refused_field(&refused, field, query);
    }

    let state = app.ok(200, "GET", &e("/state"), &token, None).await;
    assert_eq!(state["status"], "active");
    assert_eq!(state["last_arrival_seq"], 3);
    assert_eq!(state["applied_arrival_seq"], 2);
    assert_eq!(state["messages_waiting"], 1);
    assert!(state["apply_lag_s"].as_f64().unwrap() >= 50.0, "{state}");
    assert_eq!(state["outbox_backlog"], 5);
    assert_eq!(state["last_change_seq"], 7);
    assert_eq!(state["reload_running"], false);
    let track = &state["tracks"][0];
    assert_eq!(track["track"], "feed");
    assert_eq!(track["generation"], 1);
    assert_eq!(track["access_version"], "av1");
    assert_eq!(track["through"], "1.16");
    assert_eq!(track["reload_running"], false);

    // An endpoint with nothing applied yet reads as empty, not missing.
    let (fresh, _) = app.endpoint(&token, json!({})).await;
    let state = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{fresh}/state"),
            &token,
            None,
        )
        .await;
    assert_eq!(
        (
            state["messages_waiting"].as_i64(),
            state["outbox_backlog"].as_i64()
        ),
        (Some(0), Some(0))
    );
    assert_eq!(state["tracks"], json!([]));
    let copy = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{fresh}/copy"),
            &token,
            None,
        )
        .await;
    assert_eq!(copy["data"], json!([]));
    app.stop().await;
}
