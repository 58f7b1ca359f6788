//! What a stories endpoint's reads say about it, through the API: its state (catch-up cursor
//! and last catch-up, the reload in full owed, running, then finished, tickers loading and
//! dropping), its rows with `merged_into`, its notifications with story, ticker and event; the
//! sequencer's gauges counting the same; and another tenant seeing none of it.
//!
//! The sync's steps are written through relay_store as the sequencer writes them (its round,
//! writer, cursor and reload statements), so each state between them can be read.

use relay_rules::{plan_writes, PlannedClaim, StoryWrite};
use relay_sequencer::SequencerMetrics;
use relay_store::stories::{self as store, PlanCause, PlanWritten};
use relay_store::{EndpointId, TenantId};
use relay_tests::random_secret;
use relay_wire::Story;
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use crate::api::ApiApp;

fn snapshot(id: &str, ticker: &str, version: i64) -> Value {
    json!({"id": id, "ticker": ticker, "version": version, "headline": format!("{id} at {version}")})
}

fn story(id: &str, ticker: &str, version: i64) -> Story {
    Story::from_value(&snapshot(id, ticker, version)).unwrap()
}

/// The sequencer's stories gauges after one count of the database's syncs: (running, owed,
/// tickers loading, endpoints never caught up, endpoints caught up at any age).
async fn gauges(pool: &PgPool) -> (i64, i64, i64, i64, i64) {
    let metrics = SequencerMetrics::unregistered();
    metrics.observe_stories(&store::sync_summary(pool).await.unwrap());
    let pending = |label: &str| {
        metrics
            .stories_reloads_pending
            .with_label_values(&[label])
            .get()
    };
    let age = |label: &str| {
        metrics
            .stories_catch_up_age
            .with_label_values(&[label])
            .get()
    };
    let caught_up = ["within_1m", "within_5m", "within_1h", "older"]
        .into_iter()
        .map(age)
        .sum();
    (
        pending("running"),
        pending("owed"),
        metrics.stories_tickers_loading.get(),
        age("never"),
        caught_up,
    )
}

#[tokio::test]
async fn a_stories_endpoint_shows_its_sync_rows_and_notifications_to_its_tenant_only() {
    let app = ApiApp::spawn().await;
    let (tenant, token) = app.tenant("stories-reader").await;
    let (_, other) = app.tenant("stories-neighbour").await;
    let endpoint = Uuid::new_v4();
    app.ok(
        201,
        "POST",
        "/v1/endpoints",
        &token,
        Some(
            &json!({"id": endpoint, "source": "stories", "stories_mode": "snapshot",
                     "tickers": ["ALFA B", "BETA"], "secrets": [random_secret().to_whsec()]}),
        ),
    )
    .await;
    let (feed, _) = app.endpoint(&token, json!({})).await;
    let e = |suffix: &str| format!("/v1/endpoints/{endpoint}{suffix}");
    let (tenant, id) = (TenantId(tenant), EndpointId(endpoint));

    // A feed endpoint's state is as before: its tracks, and no stories object.
    let feed_state = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{feed}/state"),
            &token,
            None,
        )
        .await;
    assert_eq!(feed_state["source"], "feed", "{feed_state}");
    assert!(feed_state["tracks"].is_array(), "{feed_state}");
    assert_eq!(feed_state["reload_running"], false, "{feed_state}");
    assert_eq!(feed_state["stories"], Value::Null, "{feed_state}");

    // A stories endpoint has no feed track to rewind: after a restore it catches up by itself.
    let rewind = app
        .call("POST", &e("/tracks/feed/rewind"), Some(&token), None)
        .await;
    assert_eq!(rewind.status, 409, "{}", rewind.text);
    assert_eq!(rewind.json["field"], "source", "{}", rewind.text);

    // Before the first sync: everything owed, nothing the feed's.
    let before = app.ok(200, "GET", &e("/state"), &token, None).await;
    assert_eq!(before["source"], "stories", "{before}");
    assert_eq!(before["tracks"], Value::Null, "{before}");
    assert_eq!(before["reload_running"], Value::Null, "{before}");
    assert_eq!(before["upstream"]["status"], "needs_settings", "{before}");
    assert_eq!(
        before["stories"],
        json!({"loaded": false, "catch_up_cursor": null, "caught_up_at": null,
               "reload": {"status": "owed", "round": null, "reloaded_at": null},
               "tickers_loading": ["ALFA B", "BETA"], "tickers_dropping": [], "rounds": 0,
               "reads_owed": 0, "reads_owed_since": null}),
        "{before}"
    );
    assert_eq!(gauges(&app.db.pool).await, (0, 1, 2, 1, 0));

    // The first sync, as the sequencer runs it: its row, the reload's round begun ...
    store::sync_state(&app.db.pool, tenant, id).await.unwrap();
    let round = store::begin_round(&app.db.pool, id, true).await.unwrap();
    let running = app.ok(200, "GET", &e("/state"), &token, None).await;
    assert_eq!(
        running["stories"]["reload"],
        json!({"status": "running", "round": round, "reloaded_at": null}),
        "{running}"
    );
    assert_eq!(running["stories"]["loaded"], false, "{running}");
    assert_eq!(gauges(&app.db.pool).await, (1, 0, 2, 1, 0));

    // ... each ticker's stories saved, one closed by a merge and one closed otherwise ...
    let fence = app.db.claim_fence(endpoint).await;
    let alfa = story("st_1", "ALFA B", 3);
    let mut writer = store::open(&app.db.pool, tenant, id, fence)
        .await
        .unwrap()
        .expect("the fence is ours");
    let close = |id: &str, version, merged_into: Option<&str>| StoryWrite::Close {
        story_id: id.to_owned(),
        version,
        merged_into: merged_into.map(str::to_owned),
    };
    let ids = ["st_1", "st_2", "st_4"].map(str::to_owned);
    let held = writer.held(&ids).await.unwrap();
    let listed = plan_writes(
        &held,
        [
            StoryWrite::Save(alfa.clone()),
            StoryWrite::Save(story("st_2", "BETA", 1)),
            StoryWrite::Save(story("st_4", "BETA", 1)),
            close("st_4", 2, None),
        ],
    );
    writer
        .write_plan(&listed, PlanCause::Round(round))
        .await
        .unwrap();
    writer
        .set_loaded_tickers(&["ALFA B".to_owned(), "BETA".to_owned()])
        .await
        .unwrap();
    assert!(writer.finish_reload(round).await.unwrap());
    writer.commit().await.unwrap();

    // ... then a catch-up page to the end: st_2 merges into st_1, st_1 is claimed.
    let mut writer = store::open(&app.db.pool, tenant, id, fence)
        .await
        .unwrap()
        .expect("the fence is ours");
    let held = writer.held(&["st_2".to_owned()]).await.unwrap();
    // A late close of an older version changes nothing, the merge it named included.
    let mut page = plan_writes(
        &held,
        [close("st_2", 2, Some("st_1")), close("st_2", 1, None)],
    );
    page.writes[0].event_id = Some("ev_close_2".into());
    page.writes[1].event_id = Some("ev_close_2_late".into());
    let claim = |story: Story, event_id: &str, notify| PlannedClaim {
        key: format!("strong:{}", story.id),
        story,
        event_id: event_id.to_owned(),
        notify,
    };
    // st_9 became strong before the endpoint was registered: claimed, and listed as not sent.
    page.claims = vec![
        claim(alfa, "ev_strong_1", true),
        claim(story("st_9", "ALFA B", 1), "ev_strong_9", false),
    ];
    assert_eq!(
        writer.write_plan(&page, PlanCause::Events).await.unwrap(),
        PlanWritten {
            closed: 1,
            already_closed: 1,
            notified: 1,
            claimed_silently: 1,
            changes: 2,
            ..PlanWritten::default()
        }
    );
    assert!(writer
        .move_cursor(None, Some("cur_after_ev_strong_1"), true)
        .await
        .unwrap());
    writer.commit().await.unwrap();

    let after = app.ok(200, "GET", &e("/state"), &token, None).await;
    let synced = &after["stories"];
    assert_eq!(synced["loaded"], true, "{after}");
    assert_eq!(
        synced["catch_up_cursor"], "cur_after_ev_strong_1",
        "{after}"
    );
    assert!(synced["caught_up_at"].is_string(), "{after}");
    assert_eq!(synced["reload"]["status"], "none", "{after}");
    assert!(synced["reload"]["reloaded_at"].is_string(), "{after}");
    assert_eq!(synced["tickers_loading"], json!([]), "{after}");
    assert_eq!(synced["rounds"], round, "{after}");
    assert_eq!(synced["reads_owed"], 0, "{after}");
    assert_eq!(after["tracks"], Value::Null, "{after}");
    assert_eq!(gauges(&app.db.pool).await, (0, 0, 0, 0, 1));

    // A read owed (a fetch-on-notify read that still failed), shown until a sync pays it.
    let mut writer = store::open(&app.db.pool, tenant, id, fence)
        .await
        .unwrap()
        .expect("the fence is ours");
    writer
        .owe_reads(&["st_1".to_owned()], "timeout")
        .await
        .unwrap();
    writer.commit().await.unwrap();
    let owing = app.ok(200, "GET", &e("/state"), &token, None).await;
    assert_eq!(owing["stories"]["reads_owed"], 1, "{owing}");
    assert!(owing["stories"]["reads_owed_since"].is_string(), "{owing}");
    let summary = store::sync_summary(&app.db.pool).await.unwrap();
    assert_eq!(summary.reads_owed, 1, "{summary:?}");
    let metrics = SequencerMetrics::unregistered();
    metrics.observe_stories(&summary);
    assert_eq!(metrics.stories_reads_owed.get(), 1);

    // Rows: the merge read back on the row, null elsewhere.
    let merged = app.ok(200, "GET", &e("/stories/st_2"), &token, None).await;
    assert_eq!(merged["closed"], true, "{merged}");
    assert_eq!(merged["version"], 2, "{merged}");
    assert_eq!(merged["merged_into"], "st_1", "{merged}");
    let page = app
        .ok(200, "GET", &e("/stories?include_closed=true"), &token, None)
        .await;
    let merged_into: Vec<(&str, &Value)> = page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["id"].as_str().unwrap(), &s["merged_into"]))
        .collect();
    assert_eq!(
        merged_into,
        [
            ("st_1", &Value::Null),
            ("st_2", &json!("st_1")),
            ("st_4", &Value::Null)
        ],
        "{page}"
    );

    // Notifications: the story, its ticker, the event that claimed it and when.
    let notifications = app.ok(200, "GET", &e("/notifications"), &token, None).await;
    let data = notifications["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "{notifications}");
    assert_eq!(data[1]["key"], "strong:st_9", "{notifications}");
    assert_eq!(data[1]["notified"], false, "{notifications}");
    assert_eq!(data[0]["key"], "strong:st_1", "{notifications}");
    assert_eq!(data[0]["story_id"], "st_1", "{notifications}");
    assert_eq!(data[0]["ticker"], "ALFA B", "{notifications}");
    assert_eq!(data[0]["event_id"], "ev_strong_1", "{notifications}");
    assert!(data[0]["claimed_at"].is_string(), "{notifications}");
    assert_eq!(data[0]["notified"], true, "{notifications}");

    // A ticker swapped: one to load, one whose stories are still to drop.
    app.ok(
        200,
        "PATCH",
        &e(""),
        &token,
        Some(&json!({"tickers": ["ALFA B", "GAMMA"]})),
    )
    .await;
    let swapped = app.ok(200, "GET", &e("/state"), &token, None).await;
    assert_eq!(swapped["stories"]["loaded"], false, "{swapped}");
    assert_eq!(swapped["stories"]["tickers_loading"], json!(["GAMMA"]));
    assert_eq!(swapped["stories"]["tickers_dropping"], json!(["BETA"]));
    assert_eq!(gauges(&app.db.pool).await, (0, 0, 1, 0, 1));

    // Another tenant's token: none of it exists.
    for path in [
        e("/state"),
        e("/stories?include_closed=true"),
        e("/stories/st_2"),
        e("/notifications"),
    ] {
        let answer = app.call("GET", &path, Some(&other), None).await;
        assert_eq!(answer.status, 404, "{path}: {}", answer.text);
        assert!(!answer.text.contains("st_1"), "{path}: {}", answer.text);
    }
    app.stop().await;
}
