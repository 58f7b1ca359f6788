//! A stories message gets the feed's protections through the one worker: against real Postgres
//! and Redis with the real sequencer, a stored story event whose write Postgres refuses is tried
//! a bounded number of times, with another tenant's stories applying meanwhile, then
//! quarantined; the endpoint goes on with its next message, and the quarantined message is
//! listed, retried (it applies once Postgres takes it) and discarded as a feed's is.

use std::time::{Duration, Instant};

use relay_rules::{ApplyBackoff, StoriesMode};
use relay_sequencer::{Sequencer, SequencerConfig, SequencerMetrics};
use relay_store::endpoints::{self, Registration, Source, StoriesSettings};
use relay_store::quarantine::{self, Resolution};
use relay_store::{cursors, EndpointId, TenantId};
use relay_tests::{random_secret, redis_url, RedisPrefix, TestDb};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::sequencer_apply::{incoming, store_new};
use crate::sequencer_quarantine::refuse_poison;

/// A snapshot-mode stories endpoint of a new tenant, following `ALFA`, with no upstream (so no
/// sync runs: only its messages are applied).
async fn stories_endpoint(db: &TestDb) -> (TenantId, EndpointId) {
    let tenant = TenantId(db.tenant().await);
    let endpoint = EndpointId(Uuid::new_v4());
    endpoints::register(
        &db.pool,
        tenant,
        &Registration {
            id: endpoint,
            source: Source::Stories(StoriesSettings {
                mode: StoriesMode::Snapshot,
                tickers: vec!["ALFA".into()],
            }),
            lang: None,
            upstream_base_url: None,
            upstream_api_key: None,
            secrets: vec![random_secret()],
        },
    )
    .await
    .unwrap();
    (tenant, endpoint)
}

/// A live `story.updated` of `story_id` at `version`, as the upstream sends it.
fn story_updated(event_id: &str, story_id: &str, version: i64) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "event_id": event_id,
        "type": "story.updated",
        "origin": "live",
        "created_at": "2026-12-03T10:00:00.000000Z",
        "data": {"story": {"id": story_id, "ticker": "ALFA", "version": version,
                           "headline": "h", "articles": []}},
    }))
    .unwrap()
}

async fn store(
    db: &TestDb,
    (tenant, endpoint): (TenantId, EndpointId),
    bodies: &[Vec<u8>],
) -> Vec<i64> {
    let batch: Vec<_> = bodies
        .iter()
        .map(|body| incoming(tenant.0, endpoint.0, None, None, body.clone()))
        .collect();
    store_new(&db.pool, &batch).await
}

async fn wait_applied_through(pool: &PgPool, endpoint: EndpointId, want: i64, what: &str) {
    let started = Instant::now();
    while cursors::applied_through(pool, endpoint).await.unwrap() < want {
        assert!(started.elapsed() < Duration::from_secs(60), "{what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn story_version(pool: &PgPool, endpoint: EndpointId, id: &str) -> Option<i64> {
    sqlx::query_scalar("SELECT version FROM stories WHERE endpoint_id = $1 AND id = $2")
        .bind(endpoint)
        .bind(id)
        .fetch_optional(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_stories_message_postgres_refuses_is_tried_then_quarantined_and_the_endpoint_goes_on() {
    let db = TestDb::new().await;
    let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
    let poisoned = stories_endpoint(&db).await;
    let other = stories_endpoint(&db).await;
    // A story id starting "poison" makes its write fail, as a value Postgres refuses would,
    // until the test lifts it.
    refuse_poison(&db.pool, ("stories", "id"), "story").await;
    let metrics = SequencerMetrics::unregistered();
    let sequencer = Sequencer::start(
        db.pool.clone(),
        SequencerConfig {
            redis_url: redis_url(),
            key_prefix: prefix.0.clone(),
            lease: Duration::from_millis(1500),
            sweep_interval: Duration::from_millis(200),
            idle_linger: Duration::from_millis(100),
            // Five tries over about a second.
            apply_attempts: 5,
            apply_backoff: ApplyBackoff {
                first: Duration::from_millis(100),
                max: Duration::from_millis(400),
            },
            ..SequencerConfig::default()
        },
        metrics.clone(),
    )
    .await
    .unwrap();

    let seqs = store(
        &db,
        poisoned,
        &[
            story_updated("evt_1", "st_1", 1),
            story_updated("evt_2", "poison_2", 1),
            story_updated("evt_3", "st_3", 1),
            story_updated("evt_4", "poison_4", 1),
        ],
    )
    .await;
    // While the poisoned messages are tried again and again, another tenant's stories apply.
    let other_seqs = store(&db, other, &[story_updated("evt_9", "st_9", 4)]).await;
    wait_applied_through(
        &db.pool,
        other.1,
        other_seqs[0],
        "the other tenant's story never applied",
    )
    .await;
    assert_eq!(story_version(&db.pool, other.1, "st_9").await, Some(4));

    wait_applied_through(
        &db.pool,
        poisoned.1,
        seqs[3],
        "the poisoned messages were never set aside",
    )
    .await;
    // The messages around them applied; each was tried as often as configured.
    assert_eq!(story_version(&db.pool, poisoned.1, "st_1").await, Some(1));
    assert_eq!(story_version(&db.pool, poisoned.1, "st_3").await, Some(1));
    assert_eq!(story_version(&db.pool, poisoned.1, "poison_2").await, None);
    assert_eq!(
        metrics.apply_failures.get(),
        2 * 5,
        "tries before the quarantines"
    );
    assert_eq!(
        metrics.messages.with_label_values(&["quarantined"]).get(),
        2
    );

    // Listed for its tenant as a feed's quarantined messages are, to it alone.
    let (tenant, endpoint) = poisoned;
    let listed = quarantine::list(&db.pool, tenant, endpoint, None, None, 10)
        .await
        .unwrap();
    let listed: Vec<(i64, &str, i32)> = listed
        .iter()
        .map(|q| (q.arrival_seq, q.status.as_str(), q.attempts))
        .collect();
    assert_eq!(
        listed,
        [(seqs[1], "quarantined", 5), (seqs[3], "quarantined", 5)]
    );
    let outcomes: Vec<String> = sqlx::query_scalar(
        "SELECT outcome FROM message_applications
         WHERE endpoint_id = $1 AND arrival_seq = ANY($2) ORDER BY arrival_seq",
    )
    .bind(endpoint)
    .bind([seqs[1], seqs[3]])
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(outcomes, ["quarantined", "quarantined"]);
    assert!(quarantine::list(&db.pool, other.0, other.1, None, None, 10)
        .await
        .unwrap()
        .is_empty());

    // Once Postgres takes it, a retried message applies; a discarded one never does.
    sqlx::raw_sql("DROP TRIGGER refuse_poison ON stories")
        .execute(&db.pool)
        .await
        .unwrap();
    let retried = match quarantine::retry(&db.pool, tenant, endpoint, seqs[1])
        .await
        .unwrap()
    {
        Resolution::Done(retried) => retried.retried_as.expect("stored again"),
        other => panic!("not retried: {other:?}"),
    };
    assert!(matches!(
        quarantine::discard(&db.pool, tenant, endpoint, seqs[3])
            .await
            .unwrap(),
        Resolution::Done(_)
    ));
    wait_applied_through(
        &db.pool,
        endpoint,
        retried,
        "the retried message never applied",
    )
    .await;
    sequencer.stop().await;
    assert_eq!(story_version(&db.pool, endpoint, "poison_2").await, Some(1));
    assert_eq!(story_version(&db.pool, endpoint, "poison_4").await, None);
    let open: Vec<i64> =
        quarantine::list(&db.pool, tenant, endpoint, Some("quarantined"), None, 10)
            .await
            .unwrap()
            .iter()
            .map(|q| q.arrival_seq)
            .collect();
    assert!(open.is_empty(), "{open:?}");
}
