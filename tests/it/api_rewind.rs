//! Rewind after a restore, against the project's upstream simulator over real HTTP: the API
//! calls the upstream's rewind with the kept `through` and carries out what relay-rules decides
//! for each answer, and the simulator refuses by its own state (a reset it is sending, a reset
//! delivered after the kept position, a restore of its feed, a position past its head).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use relay_simulator::model::{Filter, World};
use relay_simulator::{
    Answer as SimAnswer, EndpointSpec, Faults, LogEntry, SenderConfig, Simulation, Upstream,
};
use relay_tests::{execute_for, random_secret};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use uuid::Uuid;

use super::{keep_track, Answer, ApiApp};

/// The simulator's API on 127.0.0.1, port 0, with one API key for every endpoint it holds. Its
/// feed's head is 1.1000 (the simulator's default world), and it sends no messages: no sender
/// runs, so its tracks change only when a test says.
pub struct SimUpstream {
    pub sim: Arc<Simulation>,
    pub base_url: String,
    pub key: String,
}

impl SimUpstream {
    pub async fn start(endpoints: &[Uuid]) -> Self {
        let mut upstream = Upstream::new(
            World::default(),
            SenderConfig::default(),
            Faults::default(),
            7,
        );
        let key = format!("qk_{}", Uuid::new_v4().simple());
        upstream.world.add_key(&key, BTreeMap::new());
        let sim = Simulation::new(upstream, Duration::from_secs(2));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = relay_simulator::api::serve(listener, sim.clone())
            .await
            .unwrap();
        let upstream = Self {
            sim,
            base_url: format!("http://{address}"),
            key,
        };
        for id in endpoints {
            upstream.add_endpoint(*id);
        }
        upstream
    }

    pub fn add_endpoint(&self, id: Uuid) {
        let spec = EndpointSpec {
            key_token: self.key.clone(),
            lang: "en".into(),
            filter: Filter::default(),
            url: "http://127.0.0.1:9/webhooks/{id}".into(),
            secrets: vec![random_secret()],
            id: Some(id),
            initial_reset: false,
        };
        self.sim.change(|up, now| up.add_endpoint(spec, now));
    }

    /// Each rewind the upstream carried out: (since, generation).
    pub fn rewinds(&self, id: Uuid) -> Vec<(String, u64)> {
        self.sim
            .lock()
            .log(id)
            .iter()
            .filter_map(|entry| match entry {
                LogEntry::Rewound {
                    since, generation, ..
                } => Some((since.to_string(), *generation)),
                _ => None,
            })
            .collect()
    }

    /// Queues a reset and has the receiver take it (answered 202), as if delivered: the
    /// upstream then refuses a rewind to a position at or before the reset's resume_from.
    pub fn deliver_reset(&self, id: Uuid) {
        let wall = time::OffsetDateTime::now_utc().unix_timestamp();
        self.sim.change(|up, now| {
            up.queue_reset(id, "access_changed", now);
            let sent = up.poll_send(id, now, wall).expect("the reset is due");
            up.on_answer(id, sent.serial, SimAnswer::status(202), now, wall);
        });
        assert!(self.sim.lock().is_idle(id), "the reset was taken");
    }
}

/// One endpoint of a new tenant, on an upstream of its own, with the track it kept through
/// 1.990 (a restore's): the upstream, the tenant, its token and the endpoint.
async fn kept_endpoint(app: &ApiApp) -> (SimUpstream, Uuid, String, Uuid) {
    let endpoint = Uuid::new_v4();
    let upstream = SimUpstream::start(&[endpoint]).await;
    let (tenant, token) = register(app, &upstream, &[endpoint]).await;
    keep_track(&app.db, tenant, endpoint, "1.990", false).await;
    (upstream, tenant, token, endpoint)
}

/// A tenant, and `ids` registered with the relay pointing at `upstream` with its key.
async fn register(app: &ApiApp, upstream: &SimUpstream, ids: &[Uuid]) -> (Uuid, String) {
    let (tenant, token) = app.tenant("rewinding").await;
    for &id in ids {
        add_endpoint(app, &token, id, Some((&upstream.base_url, &upstream.key))).await;
    }
    (tenant, token)
}

/// `id` registered for the tenant of `token`, with a new secret, and with `upstream`'s (base URL,
/// key) where given.
async fn add_endpoint(app: &ApiApp, token: &str, id: Uuid, upstream: Option<(&str, &str)>) {
    let mut body = json!({"id": id, "lang": "en", "secrets": [random_secret().to_whsec()]});
    if let Some((base_url, key)) = upstream {
        body["upstream_base_url"] = json!(base_url);
        body["upstream_api_key"] = json!(key);
    }
    app.ok(201, "POST", "/v1/endpoints", token, Some(&body))
        .await;
}

async fn stored_reload(app: &ApiApp, endpoint: Uuid) -> Option<Value> {
    let text: Option<Option<String>> = sqlx::query_scalar(
        "SELECT reload::text FROM endpoint_tracks WHERE endpoint_id = $1 AND track = 'feed'",
    )
    .bind(endpoint)
    .fetch_optional(&app.db.pool)
    .await
    .unwrap();
    text.flatten().map(|t| serde_json::from_str(&t).unwrap())
}

/// The rewind asked of the relay for `endpoint`, whatever it answers.
async fn call_rewind(app: &ApiApp, token: &str, endpoint: Uuid) -> Answer {
    let path = format!("/v1/endpoints/{endpoint}/tracks/feed/rewind");
    app.call("POST", &path, Some(token), None).await
}

async fn rewind(app: &ApiApp, token: &str, endpoint: Uuid) -> Value {
    app.ok(
        200,
        "POST",
        &format!("/v1/endpoints/{endpoint}/tracks/feed/rewind"),
        token,
        None,
    )
    .await
}

/// What relay-rules' `read_feed_again` begins on a track held at `generation` that never began a
/// reload before: the track's first (`round` 1).
fn read_again_at(generation: u64) -> Value {
    json!({"generation": generation, "access_version": null, "cause": "ReadAgain", "round": 1})
}

#[tokio::test]
async fn an_accepted_rewind_resends_from_the_kept_through_and_changes_nothing_here() {
    let app = ApiApp::spawn().await;
    let (upstream, _, token, endpoint) = kept_endpoint(&app).await;

    let answer = rewind(&app, &token, endpoint).await;
    assert_eq!(answer["plan"], "rewind");
    assert_eq!(answer["since"], "1.990");
    assert_eq!(
        answer["upstream"],
        json!({"status": 202, "generation": 2, "refusal": null})
    );
    assert_eq!(answer["outcome"], "nothing");
    assert_eq!(answer["reload"], Value::Null);
    assert_eq!(upstream.rewinds(endpoint), [("1.990".to_owned(), 2)]);
    assert_eq!(stored_reload(&app, endpoint).await, None);
    app.stop().await;
}

#[tokio::test]
async fn each_refusal_is_handled_as_the_wire_file_says() {
    let app = ApiApp::spawn().await;
    let (ahead, pending, before_reset, not_in_epoch) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    let upstream = SimUpstream::start(&[ahead, pending, before_reset]).await;
    // A restore of the feed starts a new epoch for every endpoint of that upstream: its own.
    let restored = SimUpstream::start(&[not_in_epoch]).await;
    let (tenant, token) = register(&app, &upstream, &[ahead, pending, before_reset]).await;
    add_endpoint(
        &app,
        &token,
        not_in_epoch,
        Some((&restored.base_url, &restored.key)),
    )
    .await;

    // cursor_ahead: the backup's position is past the upstream's head. Nothing to do.
    keep_track(&app.db, tenant, ahead, "1.2000", false).await;
    // reset_pending: a reset is queued; it will read everything again. Nothing to do.
    keep_track(&app.db, tenant, pending, "1.990", false).await;
    upstream
        .sim
        .change(|up, now| up.queue_reset(pending, "access_changed", now));
    // before_reset: a reset delivered after the backup's position. Read /v1/feed again.
    keep_track(&app.db, tenant, before_reset, "1.990", false).await;
    upstream.deliver_reset(before_reset);
    // cursor_not_in_epoch: the upstream restored its feed since. Read /v1/feed again.
    keep_track(&app.db, tenant, not_in_epoch, "1.990", false).await;
    restored.sim.change(|up, now| up.restore_feed(now));

    for (endpoint, refusal, outcome) in [
        (ahead, "cursor_ahead", "nothing"),
        (pending, "reset_pending", "nothing"),
        (before_reset, "before_reset", "reload_begun"),
        (not_in_epoch, "cursor_not_in_epoch", "reload_begun"),
    ] {
        let answer = rewind(&app, &token, endpoint).await;
        assert_eq!(answer["plan"], "rewind", "{refusal}: {answer}");
        assert_eq!(
            answer["upstream"],
            json!({"status": 409, "generation": null, "refusal": refusal}),
            "{answer}"
        );
        assert_eq!(answer["outcome"], outcome, "{refusal}: {answer}");
        let expected = (outcome == "reload_begun").then(|| read_again_at(3));
        assert_eq!(
            answer["reload"],
            expected.clone().unwrap_or(Value::Null),
            "{refusal}"
        );
        assert_eq!(stored_reload(&app, endpoint).await, expected, "{refusal}");
        assert_eq!(
            upstream.rewinds(endpoint),
            [],
            "{refusal}: nothing was rewound"
        );
    }

    // The sequencer sees the reloads through the state route too.
    let state = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{before_reset}/state"),
            &token,
            None,
        )
        .await;
    assert_eq!(state["reload_running"], true);
    assert_eq!(state["tracks"][0]["reload"], read_again_at(3));

    // Asked again while that reload runs: refused again, and the running reload is left alone.
    let again = rewind(&app, &token, before_reset).await;
    assert_eq!(again["outcome"], "reload_already_running");
    assert_eq!(
        app.counter("relay_api_rewinds_total", "outcome", "reload_begun"),
        2
    );
    assert_eq!(
        app.counter("relay_api_rewinds_total", "outcome", "nothing"),
        2
    );
    assert_eq!(
        app.counter(
            "relay_api_rewinds_total",
            "outcome",
            "reload_already_running"
        ),
        1
    );
    assert_eq!(
        stored_reload(&app, before_reset).await,
        Some(read_again_at(3))
    );
    app.stop().await;
}

#[tokio::test]
async fn after_a_reset_or_with_no_track_kept_the_feed_is_read_again_without_a_call() {
    let app = ApiApp::spawn().await;
    let (after_reset, no_track) = (Uuid::new_v4(), Uuid::new_v4());
    let upstream = SimUpstream::start(&[after_reset, no_track]).await;
    let (tenant, token) = register(&app, &upstream, &[after_reset, no_track]).await;
    keep_track(&app.db, tenant, after_reset, "1.990", true).await;

    let answer = rewind(&app, &token, after_reset).await;
    assert_eq!(answer["plan"], "read_feed_again");
    assert_eq!(answer["upstream"], Value::Null);
    assert_eq!(answer["outcome"], "reload_begun");
    assert_eq!(
        stored_reload(&app, after_reset).await,
        Some(read_again_at(3))
    );

    // No row: the copy took no message on the track. The row is made, holding the reload.
    let answer = rewind(&app, &token, no_track).await;
    assert_eq!(answer["plan"], "read_feed_again");
    assert_eq!(answer["outcome"], "reload_begun");
    assert_eq!(stored_reload(&app, no_track).await, Some(read_again_at(0)));
    let tenant_of_row: Uuid =
        sqlx::query_scalar("SELECT tenant_id FROM endpoint_tracks WHERE endpoint_id = $1")
            .bind(no_track)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    assert_eq!(tenant_of_row, tenant);
    assert_eq!(upstream.rewinds(after_reset), []);
    assert_eq!(upstream.rewinds(no_track), []);
    app.stop().await;
}

#[tokio::test]
async fn a_failed_rewind_call_changes_nothing() {
    let app = ApiApp::spawn().await;
    let (wrong_key, no_upstream, gone) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let upstream = SimUpstream::start(&[wrong_key]).await;
    let (tenant, token) = register(&app, &upstream, &[wrong_key]).await;
    app.ok(
        200,
        "PATCH",
        &format!("/v1/endpoints/{wrong_key}"),
        &token,
        Some(&json!({"upstream_api_key": "qk_not_the_key"})),
    )
    .await;
    keep_track(&app.db, tenant, wrong_key, "1.990", false).await;
    let answer = call_rewind(&app, &token, wrong_key).await;
    assert_eq!(answer.status, 502, "{}", answer.text);
    assert_eq!(answer.json["error"], "upstream_failed");
    assert!(answer.text.contains("401"), "{}", answer.text);
    assert_eq!(stored_reload(&app, wrong_key).await, None);

    // No upstream settings: the rewind cannot be asked for.
    add_endpoint(&app, &token, no_upstream, None).await;
    keep_track(&app.db, tenant, no_upstream, "1.990", false).await;
    let answer = call_rewind(&app, &token, no_upstream).await;
    assert_eq!(answer.status, 409, "{}", answer.text);
    assert_eq!(answer.json["field"], "upstream_base_url");

    // An upstream that is not listening.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let closed_url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    add_endpoint(&app, &token, gone, Some((&closed_url, "qk_x"))).await;
    keep_track(&app.db, tenant, gone, "1.990", false).await;
    let answer = call_rewind(&app, &token, gone).await;
    assert_eq!(answer.status, 502, "{}", answer.text);
    assert_eq!(stored_reload(&app, gone).await, None);
    app.stop().await;
}

/// The event ids the copy of `endpoint` holds as applied.
async fn applied_ids(app: &ApiApp, endpoint: Uuid) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT event_id FROM applied_events WHERE endpoint_id = $1 ORDER BY event_id",
    )
    .bind(endpoint)
    .fetch_all(&app.db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_restore_is_held_until_the_rewind_is_answered_whatever_came_since() {
    let app = ApiApp::spawn().await;
    let (upstream, tenant, token, endpoint) = kept_endpoint(&app).await;
    // An event the backup applied (an hour before the restore).
    execute_for(
        &app.db,
        "INSERT INTO applied_events (endpoint_id, event_id, tenant_id, applied_at)
         VALUES ($1, 'evt_in_the_backup', $2, now() - interval '1 hour')",
        endpoint,
        tenant,
    )
    .await;

    // `relay restored`, then a message taken before the rewind: the track moves on, an event
    // id is applied.
    let mut out = Vec::new();
    let marked = relay::commands::mark_restored(&app.db.pool, &mut out)
        .await
        .unwrap();
    assert_eq!(marked, 1);
    let line: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        (&line["plan"], &line["since"]),
        (&json!("rewind"), &json!("1.990"))
    );
    sqlx::query("UPDATE endpoint_tracks SET through = '1.995' WHERE endpoint_id = $1")
        .bind(endpoint)
        .execute(&app.db.pool)
        .await
        .unwrap();
    execute_for(
        &app.db,
        "INSERT INTO applied_events (endpoint_id, event_id, tenant_id)
         VALUES ($1, 'evt_after_the_restore', $2)",
        endpoint,
        tenant,
    )
    .await;
    let state_path = format!("/v1/endpoints/{endpoint}/state");
    let state = app.ok(200, "GET", &state_path, &token, None).await;
    assert_eq!(state["restore"]["through"], "1.990", "{state}");
    assert_eq!(state["restore"]["last_was_reset"], false, "{state}");
    assert_eq!(state["change_epoch"], line["change_epoch"], "{state}");
    assert_eq!(state["last_change_seq"], 2, "an empty snapshot: {state}");

    // A failed call keeps the restore held.
    app.ok(
        200,
        "PATCH",
        &format!("/v1/endpoints/{endpoint}"),
        &token,
        Some(&json!({"upstream_api_key": "qk_not_the_key"})),
    )
    .await;
    assert_eq!(call_rewind(&app, &token, endpoint).await.status, 502);
    let state = app.ok(200, "GET", &state_path, &token, None).await;
    assert_eq!(state["restore"]["through"], "1.990", "{state}");

    // Answered: asked from the backup's through, not the track's; the restore let go, and the
    // id applied since it forgotten (the rewind resends its event), the backup's kept.
    app.ok(
        200,
        "PATCH",
        &format!("/v1/endpoints/{endpoint}"),
        &token,
        Some(&json!({"upstream_api_key": upstream.key})),
    )
    .await;
    let answer = rewind(&app, &token, endpoint).await;
    assert_eq!(answer["since"], "1.990", "{answer}");
    assert_eq!(answer["restore"]["through"], "1.990", "{answer}");
    assert_eq!(answer["outcome"], "nothing", "{answer}");
    assert_eq!(upstream.rewinds(endpoint), [("1.990".to_owned(), 2)]);
    let state = app.ok(200, "GET", &state_path, &token, None).await;
    assert_eq!(state["restore"], Value::Null, "{state}");
    assert_eq!(applied_ids(&app, endpoint).await, ["evt_in_the_backup"]);

    // Asked again, with no restore held: from the track as it is.
    let answer = rewind(&app, &token, endpoint).await;
    assert_eq!(answer["since"], "1.995", "{answer}");
    assert_eq!(answer["restore"], Value::Null, "{answer}");
    app.stop().await;
}
