//! A stories message gets the feed's protections through the one worker: against real Postgres
//! and Redis with the real sequencer, a stored story event whose write Postgres refuses is tried
//! a bounded number of times, with another tenant's stories applying meanwhile, then
//! quarantined; the endpoint goes on with its next message, and the quarantined message is
//! listed, retried (it applies once Postgres takes it) and discarded as a feed's is.
//! Stories runs of several endpoints share apply transactions, and a refused one fails alone.

use std::time::{Duration, Instant};

use relay_rules::ApplyBackoff;
use relay_sequencer::{Sequencer, SequencerConfig, SequencerMetrics};
use relay_store::quarantine::{self, Resolution};
use relay_store::{cursors, EndpointId, TenantId};
use relay_tests::{redis_url, RedisPrefix, TestDb};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::sequencer_apply::{incoming, store_new};
use crate::sequencer_quarantine::refuse_poison;
use crate::stories_copy::register_stories;

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

/// A sequencer on `prefix` that tries a failing message `attempts` times, pausing from `first`
/// to `max` milliseconds between tries.
fn tries(prefix: &RedisPrefix, attempts: u32, (first, max): (u64, u64)) -> SequencerConfig {
    SequencerConfig {
        redis_url: redis_url(),
        key_prefix: prefix.0.clone(),
        lease: Duration::from_millis(1500),
        sweep_interval: Duration::from_millis(200),
        idle_linger: Duration::from_millis(100),
        apply_attempts: attempts,
        apply_backoff: ApplyBackoff {
            first: Duration::from_millis(first),
            max: Duration::from_millis(max),
        },
        ..SequencerConfig::default()
    }
}

#[tokio::test]
async fn a_stories_message_postgres_refuses_is_tried_then_quarantined_and_the_endpoint_goes_on() {
    let db = TestDb::new().await;
    let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
    let poisoned = register_stories(&db, &["ALFA"]).await;
    let other = register_stories(&db, &["ALFA"]).await;
    // A story id starting "poison" makes its write fail, as a value Postgres refuses would,
    // until the test lifts it.
    refuse_poison(&db.pool, ("stories", "id"), "story").await;
    let metrics = SequencerMetrics::unregistered();
    // Five tries over about a second.
    let config = tries(&prefix, 5, (100, 400));
    let sequencer = Sequencer::start(
        db.pool.clone(),
        config,
        relay_tests::keys(),
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

/// Stories runs of many endpoints share apply transactions (group commit), each run in a
/// savepoint of its transaction: while one endpoint's message is refused again and again, the
/// runs that share its transactions still commit, and no transaction fails as a whole.
#[tokio::test]
async fn stories_runs_share_transactions_and_a_refused_run_fails_alone() {
    let db = TestDb::new().await;
    let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
    let poisoned = register_stories(&db, &["ALFA"]).await;
    let mut others = Vec::new();
    for _ in 0..12 {
        others.push(register_stories(&db, &["ALFA"]).await);
    }
    refuse_poison(&db.pool, ("stories", "id"), "story").await;
    let metrics = SequencerMetrics::unregistered();
    const ATTEMPTS: u32 = 8;
    let config = SequencerConfig {
        idle_linger: Duration::from_secs(5),
        // One applier: the runs that arrive while it commits wait for its next transaction.
        appliers: 1,
        ..tries(&prefix, ATTEMPTS, (100, 200))
    };
    let sequencer = Sequencer::start(
        db.pool.clone(),
        config,
        relay_tests::keys(),
        metrics.clone(),
    )
    .await
    .unwrap();

    let poisoned_seqs = store(
        &db,
        poisoned,
        &[
            story_updated("evt_p", "poison_1", 1),
            story_updated("evt_q", "st_q", 2),
        ],
    )
    .await;
    // Meanwhile every other endpoint gets a story's next version a round, all of a round's
    // stored at once, so their workers hand their runs over together.
    const ROUNDS: i64 = 20;
    let mut last = Vec::new();
    for round in 1..=ROUNDS {
        let batch: Vec<_> = others
            .iter()
            .enumerate()
            .map(|(i, (tenant, endpoint))| {
                let body = story_updated(&format!("evt_{i}_{round}"), &format!("st_{i}"), round);
                incoming(tenant.0, endpoint.0, None, None, body)
            })
            .collect();
        last = store_new(&db.pool, &batch).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (i, ((_, endpoint), seq)) in others.iter().zip(&last).enumerate() {
        wait_applied_through(
            &db.pool,
            *endpoint,
            *seq,
            "another endpoint's stories stalled",
        )
        .await;
        assert_eq!(
            story_version(&db.pool, *endpoint, &format!("st_{i}")).await,
            Some(ROUNDS)
        );
    }
    wait_applied_through(
        &db.pool,
        poisoned.1,
        poisoned_seqs[1],
        "the refused message was never set aside",
    )
    .await;
    sequencer.stop().await;
    assert_eq!(story_version(&db.pool, poisoned.1, "st_q").await, Some(2));
    assert_eq!(story_version(&db.pool, poisoned.1, "poison_1").await, None);
    assert_eq!(
        metrics.apply_failures.get(),
        u64::from(ATTEMPTS),
        "only the refused message's tries failed"
    );
    assert_eq!(
        metrics.messages.with_label_values(&["quarantined"]).get(),
        1
    );
    assert_eq!(
        metrics.apply_batches_split.get(),
        0,
        "a refused run rolls back its own savepoint, not its transaction"
    );
    let runs = metrics.apply_batch_runs.get_sample_sum();
    let transactions = metrics.apply_batch_runs.get_sample_count();
    assert!(
        (transactions as f64) < runs,
        "runs never shared a transaction: {runs} runs in {transactions} transactions"
    );
}
