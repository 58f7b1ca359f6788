//! Bounded storage. On a virtual clock (the cutoff the retention statements are given is the
//! clock's reading less the retention): applied messages (with how they applied) and published
//! changes go once past their retention; messages not yet applied, changes not yet published
//! and a quarantined message not yet acted on stay; a replay cannot reach what went; the
//! endpoint applies on as before. Then the sequencer's own retention task, on the real clock
//! with a retention of a second, empties the tables and reports their sizes.

use std::time::{Duration, Instant};

use relay_netguard::OutboundPolicy;
use relay_sequencer::SequencerMetrics;
use relay_simulator::cli::prepare;
use relay_store::{changes, messages, EndpointId, StoreError};
use relay_tests::{printed_seed, Signed, TestApp};
use serde_json::json;
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::stack::{
    assert_refused_field, metric, oracle, publisher_config, quiesce, sequencer_config,
    serve_simulation, simulate_args, start_publisher, start_sequencer_with, stop_simulation,
    upstream_listener, Api, Room,
};

async fn count(pool: &PgPool, table: &str, endpoint: Uuid) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {table} WHERE endpoint_id = $1"
    ))
    .bind(endpoint)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Every message and change past `cutoff` deleted, as the retention task's passes do: how many
/// of each went.
async fn forget_all(pool: &PgPool, cutoff: OffsetDateTime) -> (u64, u64) {
    let messages_gone =
        in_passes(|after| messages::forget_applied(pool, cutoff, after, 2, 3)).await;
    let changes_gone =
        in_passes(|after| changes::forget_published(pool, cutoff, after, 2, 3)).await;
    (messages_gone, changes_gone)
}

/// Runs `pass` (a retention statement, given where the last pass stopped) until it deletes
/// nothing and has nowhere to go on from: how many rows went.
async fn in_passes<Fut>(mut pass: impl FnMut(Option<EndpointId>) -> Fut) -> u64
where
    Fut: std::future::Future<Output = Result<(u64, Option<EndpointId>), StoreError>>,
{
    let (mut gone, mut after) = (0, None);
    loop {
        let (deleted, next) = pass(after).await.unwrap();
        gone += deleted;
        after = next;
        if after.is_none() && deleted == 0 {
            return gone;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_their_retention_applied_messages_and_published_changes_go_and_nothing_else() {
    let seed = printed_seed("retention");
    let room = Room::new().await;
    let (prefix, vhost) = (&room.prefix, &room.vhost);
    let app = TestApp::spawn_waking(&prefix.0).await;
    let pool = app.db.pool.clone();
    let api = Api::start(&app.db.url, &vhost.url(), OutboundPolicy::ANY).await;
    // Its own retention off: this test moves the clock itself.
    let mut config = sequencer_config(&prefix.0, 8, OutboundPolicy::ANY);
    config.message_retention = None;
    config.change_retention = None;
    let sequencer = start_sequencer_with(
        &app.db.url,
        config.clone(),
        SequencerMetrics::unregistered(),
    )
    .await;
    let (publisher, _) = start_publisher(&pool, publisher_config(vhost.url(), &prefix.0)).await;

    let (sim_listener, upstream_api) = upstream_listener("127.0.0.1").await;
    let mut args = simulate_args(&app.base_url, 1, 1, seed, 20.0, 3);
    args.select_all = true;
    let (upstream, workload, infos) = prepare(&args).unwrap();
    let (_, token) = api.tenant("retention").await;
    api.register(&token, &infos[0], &upstream_api).await;
    let endpoint = infos[0].id;
    let (sim, senders) = serve_simulation(upstream, Duration::from_secs(2), sim_listener).await;
    sim.clone()
        .run_workload(workload, 20.0, Duration::from_secs(3))
        .await;
    // A signed body that is no v1 message: stored, then quarantined by the sequencer.
    let secret = relay_wire::SigningSecret::parse(&infos[0].secrets[0]).unwrap();
    let poison = Signed::new(&[secret], b"{\"v\": 1}".to_vec());
    assert_eq!(app.post(endpoint, &poison).await.status(), 202);
    quiesce(&pool, &sim, &[endpoint], Duration::from_secs(120), seed).await;
    let base = format!("/v1/endpoints/{endpoint}");
    let state = api
        .ok(200, "GET", &format!("{base}/state"), &token, None)
        .await;
    assert_eq!(state["messages_quarantined"], 1, "{state}");

    let stored = count(&pool, "messages", endpoint).await;
    let outbox = count(&pool, "changes", endpoint).await;
    assert!(
        stored > 10 && outbox > 10,
        "{stored} messages, {outbox} changes"
    );
    // Every message has its outcome; only the exceptions (the quarantined one, a reload
    // begun, ...) have a row of their own, not the messages applied with all their events.
    let outcomes = relay_tests::readback::message_outcomes(&pool, endpoint)
        .await
        .unwrap();
    assert_eq!(outcomes.len() as i64, stored);
    assert!(
        outcomes.iter().all(|(_, outcome, _, _)| outcome.is_some()),
        "every message has its outcome: {outcomes:?}"
    );
    let exceptions = outcomes
        .iter()
        .filter(|(_, outcome, _, ignored)| {
            outcome.as_deref() != Some("applied") || *ignored != Some(0)
        })
        .count();
    assert!(exceptions >= 1, "the quarantined message");
    assert_eq!(
        count(&pool, "message_applications", endpoint).await,
        exceptions as i64
    );

    // Now: nothing is a week old.
    let week = time::Duration::days(7);
    assert_eq!(
        forget_all(&pool, OffsetDateTime::now_utc() - week).await,
        (0, 0)
    );

    // Messages that arrive while no sequencer runs are not applied: they must stay.
    sequencer.stop().await;
    publisher.stop().await;
    let items: Vec<String> = oracle(&sim, endpoint).into_keys().take(5).collect();
    assert!(!items.is_empty());
    for (i, item) in items.iter().enumerate() {
        sim.change(|upstream, _| {
            upstream
                .change_item(
                    item,
                    relay_simulator::model::ChangeKind::FlashAdded,
                    &format!("late {i}"),
                    // After every change the workload made (its clock is a second a step).
                    relay_simulator::workload::START_MS + 1_000_000 + i as i64 * 1_000,
                    false,
                )
                .unwrap();
        });
    }
    assert!(sim.wait_idle(Duration::from_secs(30)).await);
    let unapplied = count(&pool, "messages", endpoint).await - stored;
    assert!(unapplied > 0);

    // A week and a minute later.
    let later = OffsetDateTime::now_utc() + time::Duration::minutes(1);
    let (messages_gone, changes_gone) = forget_all(&pool, later).await;
    assert_eq!(
        messages_gone as i64,
        stored - 1,
        "all applied ones but the quarantined one"
    );
    assert_eq!(changes_gone as i64, outbox, "every published change");
    assert_eq!(count(&pool, "messages", endpoint).await, unapplied + 1);
    assert_eq!(count(&pool, "message_applications", endpoint).await, 1);
    assert_eq!(count(&pool, "quarantined_messages", endpoint).await, 1);
    assert_eq!(count(&pool, "changes", endpoint).await, 0);
    let listed = api
        .ok(
            200,
            "GET",
            &format!("{base}/messages?status=quarantined"),
            &token,
            None,
        )
        .await;
    let quarantined_seq = listed["data"][0]["arrival_seq"].as_i64().unwrap();
    // A replay cannot reach changes that went.
    let refused = api
        .call(
            "POST",
            &format!("{base}/replay"),
            Some(&token),
            Some(&json!({"from_change_seq": 1})),
        )
        .await;
    assert_refused_field(&refused, "from_change_seq", "a replay of changes that went");

    // Acted on, the quarantined message follows the others.
    api.ok(
        200,
        "POST",
        &format!("{base}/quarantine/{quarantined_seq}/discard"),
        &token,
        None,
    )
    .await;
    assert_eq!(forget_all(&pool, later).await, (1, 0));
    assert_eq!(count(&pool, "quarantined_messages", endpoint).await, 0);

    // The endpoint applies on: the late messages, into a copy still equal to the oracle.
    let registry = prometheus::Registry::new();
    let metrics = SequencerMetrics::register(&registry).unwrap();
    config.message_retention = Some(Duration::from_secs(1));
    config.change_retention = Some(Duration::from_secs(1));
    config.retention_interval = Duration::from_millis(300);
    let sequencer = start_sequencer_with(&app.db.url, config, metrics).await;
    let (publisher, _) = start_publisher(&pool, publisher_config(vhost.url(), &prefix.0)).await;
    quiesce(&pool, &sim, &[endpoint], Duration::from_secs(120), seed).await;

    // And the sequencer's own retention task (a second, here) empties both tables.
    let started = Instant::now();
    loop {
        let (left_messages, left_changes) = (
            count(&pool, "messages", endpoint).await,
            count(&pool, "changes", endpoint).await,
        );
        if left_messages == 0 && left_changes == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "seed {seed}: {left_messages} messages and {left_changes} changes left"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(metric(&registry, "relay_sequencer_messages_forgotten_total") >= unapplied as f64);
    assert!(metric(&registry, "relay_sequencer_changes_forgotten_total") > 0.0);
    let sizes: Vec<String> = registry
        .gather()
        .iter()
        .filter(|family| family.name() == "relay_table_bytes")
        .flat_map(|family| family.get_metric().iter())
        .filter(|metric| metric.get_gauge().get_value() > 0.0)
        .map(|metric| metric.get_label()[0].value().to_owned())
        .collect();
    assert!(sizes.contains(&"messages".to_owned()), "{sizes:?}");
    // The copy outlives them all.
    let state = api
        .ok(200, "GET", &format!("{base}/state"), &token, None)
        .await;
    assert!(state["last_change_seq"].as_i64().unwrap() > 0, "{state}");

    stop_simulation(&sim, senders).await;
    publisher.stop().await;
    sequencer.stop().await;
    app.stop().await;
}
