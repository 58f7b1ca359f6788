//! The sequencer's apply transaction against a real Postgres: a worker whose fencing token moved
//! on writes nothing; a run of messages is applied once, in order, with its duplicates, older
//! generations and tests answered by the rules; runs of several endpoints in one transaction are
//! each answered for themselves; the wake-up reaches a running sequencer.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use relay_coord::Waker;
use relay_netguard::OutboundPolicy;
use relay_sequencer::UpstreamClient;
use relay_sequencer::{
    apply_runs, prepare_run, ApplyError, BatchReport, EndpointContext, PreparedRun,
};
use relay_sequencer::{Sequencer, SequencerConfig, SequencerMetrics};
use relay_store::cursors::{self, PendingMessage};
use relay_store::endpoints::EndpointRegistration;
use relay_store::messages::{store_batch, IncomingMessage, StoreOutcome};
use relay_store::tracks;
use relay_store::KeptConnection;
use relay_tests::{execute_for, random_secret, redis_url, TestDb};
use serde_json::{json, Value};
use time::OffsetDateTime;
use uuid::Uuid;

/// A v1 message of `endpoint`'s feed at `generation` under av1 with one update of
/// `announcement:n` at sequence `seq`, of event id `id`.
pub(crate) fn update(endpoint: Uuid, generation: u64, id: &str, n: u64, seq: u64) -> Value {
    let data = json!({"type": "item", "feed_item_id": format!("announcement:{n}"),
                      "item_kind": "announcement", "seq": seq, "first_seq": seq,
                      "parts": [{"part_id": format!("story:{n}"), "part_version": seq}]});
    one_event(endpoint, generation, id, n, seq, data)
}

/// As [`update`], of an item that must be read (a refetch).
pub(crate) fn refetch(endpoint: Uuid, generation: u64, id: &str, n: u64, seq: u64) -> Value {
    let data = json!({"type": "refetch", "feed_item_id": format!("announcement:{n}"),
                      "op": "new", "seq": seq});
    one_event(endpoint, generation, id, n, seq, data)
}

fn one_event(endpoint: Uuid, generation: u64, id: &str, n: u64, seq: u64, data: Value) -> Value {
    json!({
        "v": 1, "webhook_endpoint_id": endpoint.to_string(), "track": "feed",
        "generation": generation, "access_version": "av1",
        "since": format!("1.{}", seq - 1), "through": format!("1.{seq}"),
        "events": [{
            "id": id, "type": "announcement.updated",
            "subject": format!("announcement:{n}"),
            "sequence": relay_wire::Sequence::from_parts(1, seq).as_str(),
            "specversion": "1.0", "source": "https://api.quanor.com/v1/feed",
            "data": data,
        }],
    })
}

pub(crate) async fn store(db: &TestDb, tenant: Uuid, endpoint: Uuid, bodies: &[Value]) {
    let batch: Vec<IncomingMessage> = bodies
        .iter()
        .map(|body| {
            let generation = body["generation"].as_i64();
            incoming(
                tenant,
                endpoint,
                Some("feed".into()),
                generation,
                body.to_string(),
            )
        })
        .collect();
    store_batch(&db.pool, &batch).await.unwrap();
}

/// The last of `endpoint`'s messages applied (its apply cursor).
pub(crate) async fn applied_through(pool: &sqlx::PgPool, endpoint: Uuid) -> i64 {
    cursors::applied_through(pool, relay_store::EndpointId(endpoint))
        .await
        .unwrap()
}

/// Stores `batch` as the front tier does, every message of it new: their arrival numbers.
pub(crate) async fn store_new(pool: &sqlx::PgPool, batch: &[IncomingMessage]) -> Vec<i64> {
    store_batch(pool, batch)
        .await
        .unwrap()
        .into_iter()
        .map(|outcome| match outcome {
            StoreOutcome::Stored { arrival_seq } => arrival_seq,
            other => panic!("not stored: {other:?}"),
        })
        .collect()
}

/// `body` as the front tier hands it to the store for the endpoint: a new webhook id, signed
/// and received now, a first attempt, of `track` and `generation`.
pub(crate) fn incoming(
    tenant: Uuid,
    endpoint: Uuid,
    track: Option<String>,
    generation: Option<i64>,
    body: impl Into<Bytes>,
) -> IncomingMessage {
    let body: Bytes = body.into();
    IncomingMessage {
        endpoint_id: endpoint,
        tenant_id: tenant,
        webhook_id: format!("msg_{}", Uuid::new_v4().simple()),
        signed_at: OffsetDateTime::now_utc(),
        attempt: Some(1),
        received_at: OffsetDateTime::now_utc(),
        track,
        generation,
        // As the front tier counts them.
        events: relay_wire::Message::parse(&body)
            .ok()
            .map(|m| m.events.len() as i32),
        body,
    }
}

pub(crate) async fn pending(db: &TestDb, endpoint: Uuid) -> (i64, Vec<PendingMessage>) {
    let applied = applied_through(&db.pool, endpoint).await;
    let (_, messages) =
        cursors::pending_messages(&db.pool, relay_store::EndpointId(endpoint), applied, 100)
            .await
            .unwrap();
    (applied, messages)
}

/// Applies `pending`, the stored messages that follow `applied`, under fencing token `token`,
/// as a worker without a batcher does: one run prepared (its refetches read) and applied in a
/// transaction of its own.
pub(crate) async fn apply_messages(
    pool: &sqlx::PgPool,
    ctx: &Arc<EndpointContext>,
    token: i64,
    applied: i64,
    pending: &[PendingMessage],
    metrics: &SequencerMetrics,
) -> Result<BatchReport, ApplyError> {
    let through = pending.last().map_or(applied, |m| m.arrival_seq);
    let run = prepare_run(
        pool,
        ctx,
        token,
        (applied, through),
        pending.to_vec(),
        metrics,
    )
    .await?;
    apply_runs(&mut KeptConnection::new(pool.clone()), vec![run], metrics)
        .await
        .pop()
        .expect("one answer per run")
}

pub(crate) struct Setup {
    pub db: TestDb,
    pub tenant: Uuid,
    pub endpoint: Uuid,
    pub ctx: Arc<EndpointContext>,
}

async fn setup() -> Setup {
    setup_with_upstream(None).await
}

/// An endpoint whose track is in sync under av1 at generation 1, its upstream API at
/// `upstream_base_url` (none: no reload or refetch can read).
pub(crate) async fn setup_with_upstream(upstream_base_url: Option<String>) -> Setup {
    let db = TestDb::new().await;
    let tenant = db.tenant().await;
    let (endpoint, ctx) = add_endpoint(&db, tenant, upstream_base_url).await;
    Setup {
        db,
        tenant,
        endpoint,
        ctx,
    }
}

/// Registers an endpoint of `tenant` in sync under av1 at generation 1.
async fn add_endpoint(
    db: &TestDb,
    tenant: Uuid,
    upstream_base_url: Option<String>,
) -> (Uuid, Arc<EndpointContext>) {
    let endpoint = Uuid::new_v4();
    db.endpoint(tenant, endpoint, &random_secret()).await;
    // In sync under av1 already, so no reload begins until a message asks for one.
    execute_for(
        db,
        "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id, generation, access_version)
         VALUES ($1, 'feed', $2, 1, 'av1')",
        endpoint,
        tenant,
    )
    .await;
    let ctx = Arc::new(EndpointContext::new(
        EndpointRegistration {
            id: relay_store::EndpointId(endpoint),
            tenant_id: relay_store::TenantId(tenant),
            upstream_api_key: upstream_base_url.as_ref().map(|_| "key".into()),
            upstream_base_url,
            source: relay_store::endpoints::Source::Feed,
            // A feed endpoint's registration instant decides nothing.
            created_at: time::OffsetDateTime::UNIX_EPOCH,
        },
        UpstreamClient::http_client(
            Duration::from_secs(5),
            OutboundPolicy::ANY,
            &relay_netguard::TrustRoots::platform(),
        ),
    ));
    (endpoint, ctx)
}

#[tokio::test]
async fn a_worker_whose_fence_moved_on_writes_nothing() {
    let s = setup().await;
    store(
        &s.db,
        s.tenant,
        s.endpoint,
        &[update(s.endpoint, 1, "evt_a", 1, 10)],
    )
    .await;
    let stale = s.db.claim_fence(s.endpoint).await;
    // Another worker takes the endpoint over (its lock expired under us, say).
    let current = s.db.claim_fence(s.endpoint).await;
    assert!(current > stale);

    let (applied, messages) = pending(&s.db, s.endpoint).await;
    let metrics = SequencerMetrics::unregistered();
    let refused = apply_messages(&s.db.pool, &s.ctx, stale, applied, &messages, &metrics).await;
    assert!(matches!(refused, Err(ApplyError::Fenced)), "{refused:?}");
    assert!(relay_tests::readback::copy_rows(&s.db.pool, s.endpoint)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(applied_through(&s.db.pool, s.endpoint).await, 0);

    // The current owner applies it, once.
    apply_messages(&s.db.pool, &s.ctx, current, applied, &messages, &metrics)
        .await
        .unwrap();
    assert_eq!(
        relay_tests::readback::copy_rows(&s.db.pool, s.endpoint)
            .await
            .unwrap()
            .len(),
        1
    );
    // The same run again from the same cursor is refused by the cursor's own condition.
    let again = apply_messages(&s.db.pool, &s.ctx, current, applied, &messages, &metrics).await;
    assert!(matches!(again, Err(ApplyError::CursorMoved)), "{again:?}");
    assert_eq!(
        relay_tests::readback::list_changes(&s.db.pool, s.endpoint)
            .await
            .unwrap()
            .len(),
        1
    );
}

#[tokio::test]
async fn a_run_of_messages_applies_in_order_with_duplicates_and_older_generations_ignored() {
    let s = setup().await;
    let token = s.db.claim_fence(s.endpoint).await;
    store(
        &s.db,
        s.tenant,
        s.endpoint,
        &[
            update(s.endpoint, 1, "evt_1", 1, 10),
            // The same event again (a rewind resends it): a duplicate by id.
            update(s.endpoint, 1, "evt_1", 1, 10),
            update(s.endpoint, 2, "evt_2", 1, 5),
            // Generation 1 after generation 2 was taken: older, skipped whatever its sequence.
            update(s.endpoint, 1, "evt_3", 1, 99),
            update(s.endpoint, 2, "evt_4", 2, 6),
        ],
    )
    .await;
    let (applied, messages) = pending(&s.db, s.endpoint).await;
    assert_eq!(messages.len(), 5);
    let metrics = SequencerMetrics::unregistered();
    apply_messages(&s.db.pool, &s.ctx, token, applied, &messages, &metrics)
        .await
        .unwrap();

    let rows = relay_tests::readback::copy_rows(&s.db.pool, s.endpoint)
        .await
        .unwrap();
    let one = &rows["announcement:1"];
    // Generation 2 wins over generation 1 although its sequence is lower.
    assert_eq!(
        (one.generation, one.sequence.as_str()),
        (2, "0000000001.0000000000000000005")
    );
    assert_eq!(rows["announcement:2"].generation, 2);
    let changes = relay_tests::readback::list_changes(&s.db.pool, s.endpoint)
        .await
        .unwrap();
    let seqs: Vec<i64> = changes.iter().map(|c| c.change_seq).collect();
    assert_eq!(
        seqs,
        vec![1, 2, 3],
        "one change per event that changed the copy"
    );
    let outcomes: Vec<String> = relay_tests::readback::message_outcomes(&s.db.pool, s.endpoint)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|(_, outcome, _, _)| outcome)
        .collect();
    assert_eq!(
        outcomes,
        [
            "applied",
            "applied",
            "applied",
            "older_generation",
            "applied"
        ]
    );
    let duplicates = metrics
        .events
        .with_label_values(&["ignored_duplicate"])
        .get();
    assert_eq!(duplicates, 1);
    let track = tracks::peek(&s.db.pool, relay_store::EndpointId(s.endpoint))
        .await
        .unwrap();
    assert_eq!(track.generation, Some(2));
    assert_eq!(
        track.through.as_deref(),
        Some("1.6"),
        "the through of the last applied"
    );
}

/// The apply transaction records every event id of a run before it knows which messages apply
/// (the track it reads in the same statement decides that), and forgets those of messages that
/// do not: an event skipped with its message is applied when it comes again in one that applies.
#[tokio::test]
async fn the_ids_of_messages_that_do_not_apply_are_not_kept() {
    let s = setup().await;
    let token = s.db.claim_fence(s.endpoint).await;
    let tested = json!({
        "v": 1, "webhook_endpoint_id": s.endpoint.to_string(),
        "events": [{"id": "evt_test", "type": "webhook_endpoint.tested",
                    "data": {"test_send_id": "5f0e3c1a-7b2d-4e8f-9a6b-1c2d3e4f5a6b"}}],
    });
    store(
        &s.db,
        s.tenant,
        s.endpoint,
        &[
            update(s.endpoint, 2, "evt_2", 1, 5),
            // Older than the generation just taken: skipped, and so is its event.
            update(s.endpoint, 1, "evt_old", 2, 7),
            tested,
        ],
    )
    .await;
    let (applied, messages) = pending(&s.db, s.endpoint).await;
    let metrics = SequencerMetrics::unregistered();
    apply_messages(&s.db.pool, &s.ctx, token, applied, &messages, &metrics)
        .await
        .unwrap();
    let recorded = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT event_id FROM applied_events WHERE endpoint_id = $1 ORDER BY event_id",
        )
        .bind(s.endpoint)
        .fetch_all(&s.db.pool)
        .await
        .unwrap()
    };
    assert_eq!(recorded().await, ["evt_2"]);

    // The skipped event again, in a message of the generation held: not a duplicate.
    store(
        &s.db,
        s.tenant,
        s.endpoint,
        &[update(s.endpoint, 2, "evt_old", 2, 7)],
    )
    .await;
    let (applied, messages) = pending(&s.db, s.endpoint).await;
    apply_messages(&s.db.pool, &s.ctx, token, applied, &messages, &metrics)
        .await
        .unwrap();
    assert_eq!(recorded().await, ["evt_2", "evt_old"]);
    let rows = relay_tests::readback::copy_rows(&s.db.pool, s.endpoint)
        .await
        .unwrap();
    assert_eq!(rows["announcement:2"].generation, 2);
    assert_eq!(
        metrics
            .events
            .with_label_values(&["ignored_duplicate"])
            .get(),
        0
    );
}

/// A run prepared from what is stored past the endpoint's cursor.
async fn prepared(db: &TestDb, ctx: &Arc<EndpointContext>, token: i64) -> PreparedRun {
    let (applied, messages) = pending(db, ctx.id().0).await;
    let through = messages.last().map_or(applied, |m| m.arrival_seq);
    let metrics = SequencerMetrics::unregistered();
    prepare_run(&db.pool, ctx, token, (applied, through), messages, &metrics)
        .await
        .unwrap()
}

/// What runs have written for `endpoint`: its copy's rows, its outbox's change numbers, and
/// the message its cursor has applied through.
async fn written(db: &TestDb, endpoint: Uuid) -> (usize, Vec<i64>, i64) {
    let rows = relay_tests::readback::copy_rows(&db.pool, endpoint)
        .await
        .unwrap();
    let changes = relay_tests::readback::list_changes(&db.pool, endpoint)
        .await
        .unwrap();
    let applied = applied_through(&db.pool, endpoint).await;
    let seqs = changes.iter().map(|c| c.change_seq).collect();
    (rows.len(), seqs, applied)
}

#[tokio::test]
async fn runs_of_several_endpoints_share_a_transaction_and_each_is_answered_for_itself() {
    let s = setup().await;
    let (a, a_ctx) = (s.endpoint, s.ctx.clone());
    let (b, b_ctx) = add_endpoint(&s.db, s.tenant, None).await;
    let (c, c_ctx) = add_endpoint(&s.db, s.tenant, None).await;
    // Event ids are de-duplicated per endpoint: B's "evt_1" is not A's.
    store(
        &s.db,
        s.tenant,
        a,
        &[update(a, 1, "evt_1", 1, 10), update(a, 1, "evt_2", 2, 11)],
    )
    .await;
    store(&s.db, s.tenant, b, &[update(b, 1, "evt_1", 1, 10)]).await;
    store(&s.db, s.tenant, c, &[update(c, 1, "evt_9", 9, 10)]).await;
    let a_token = s.db.claim_fence(a).await;
    let b_token = s.db.claim_fence(b).await;
    let c_stale = s.db.claim_fence(c).await;
    // C was taken over after its run was prepared: its fence moved on.
    s.db.claim_fence(c).await;

    let runs = vec![
        prepared(&s.db, &a_ctx, a_token).await,
        prepared(&s.db, &b_ctx, b_token).await,
        prepared(&s.db, &c_ctx, c_stale).await,
    ];
    let a_stale_run = prepared(&s.db, &a_ctx, a_token).await;
    let metrics = SequencerMetrics::unregistered();
    let answers = apply_runs(&mut KeptConnection::new(s.db.pool.clone()), runs, &metrics).await;
    assert_eq!(answers.len(), 3);
    assert_eq!(answers[0].as_ref().unwrap().changes, 2, "{answers:?}");
    assert_eq!(answers[1].as_ref().unwrap().changes, 1, "{answers:?}");
    assert!(matches!(answers[2], Err(ApplyError::Fenced)), "{answers:?}");

    // A's two events and B's one; nothing of C's.
    assert_eq!(written(&s.db, a).await, (2, vec![1, 2], 2));
    assert_eq!(written(&s.db, b).await, (1, vec![1], 1));
    assert_eq!(written(&s.db, c).await, (0, vec![], 0));
    let events = |label: &str| metrics.events.with_label_values(&[label]).get();
    assert_eq!(
        events("stored"),
        3,
        "A's two and B's one; C's run was never decided"
    );
    // One transaction took the three runs: each of its steps was timed once.
    for step in relay_sequencer::APPLY_STEPS {
        let timed = metrics.apply_step_duration.with_label_values(&[step]);
        assert_eq!(timed.get_sample_count(), 1, "step {step}");
    }

    // A's run again (its cursor has moved on) beside a new run of B's: the shared transaction
    // fails as a whole, and each run is tried alone, so B's still applies, once.
    store(&s.db, s.tenant, b, &[update(b, 1, "evt_3", 3, 12)]).await;
    let runs = vec![a_stale_run, prepared(&s.db, &b_ctx, b_token).await];
    let answers = apply_runs(&mut KeptConnection::new(s.db.pool.clone()), runs, &metrics).await;
    assert!(
        matches!(answers[0], Err(ApplyError::CursorMoved)),
        "{answers:?}"
    );
    assert_eq!(answers[1].as_ref().unwrap().changes, 1, "{answers:?}");
    // A's as it was; B's new event applied.
    assert_eq!(written(&s.db, a).await, (2, vec![1, 2], 2));
    assert_eq!(written(&s.db, b).await, (2, vec![1, 2], 2));
    // Counted as committed: B's new event once (it was decided twice), A's stale run not at all.
    assert_eq!(events("stored"), 4);
    assert_eq!(events("ignored_duplicate"), 0);
}

#[tokio::test]
async fn a_wake_up_reaches_a_running_sequencer() {
    let s = setup().await;
    let prefix = format!("relay-test:{}:", Uuid::new_v4().simple());
    let sequencer = Sequencer::start(
        s.db.pool.clone(),
        SequencerConfig {
            redis_url: redis_url(),
            key_prefix: prefix.clone(),
            // A sweep far in the future: only the wake-up can make it look.
            sweep_interval: Duration::from_secs(3600),
            outbound: OutboundPolicy::ANY,
            ..SequencerConfig::default()
        },
        relay_tests::keys(),
        SequencerMetrics::unregistered(),
    )
    .await
    .unwrap();
    // The first sweep runs at start; let it pass before storing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    store(
        &s.db,
        s.tenant,
        s.endpoint,
        &[update(s.endpoint, 1, "evt_w", 7, 3)],
    )
    .await;
    Waker::connect(
        &redis_url(),
        &relay_netguard::TrustRoots::platform(),
        &prefix,
    )
    .await
    .unwrap()
    .wake(&[s.endpoint])
    .await
    .unwrap();
    let mut applied = 0;
    for _ in 0..200 {
        applied = applied_through(&s.db.pool, s.endpoint).await;
        if applied == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sequencer.stop().await;
    assert_eq!(applied, 1, "the woken sequencer applied the message");
}
