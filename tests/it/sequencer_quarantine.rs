//! No message can wedge its endpoint, and no tenant can hold the sequencer: against real
//! Postgres and Redis with the real sequencer,
//! - a stored body that is not a v1 message is quarantined, a reload brings what it held, the
//!   endpoint's later messages apply, and its copy equals the simulator's oracle;
//! - a message whose apply fails is tried a bounded number of times (another tenant's messages
//!   apply meanwhile), then quarantined, and the endpoint goes on; through the API its tenant
//!   sees it, retries it (it applies) or discards one, and another tenant gets 404s;
//! - a NUL in an event id quarantines its message rather than failing for ever;
//! - one tenant whose upstream hangs holds at most its share of the workers while another
//!   tenant's messages apply.
//!
//! Seeded where random: the seed is printed; `RELAY_TEST_SEED=<seed>` replays it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_rules::ApplyBackoff;
use relay_sequencer::{SequencerConfig, SequencerMetrics};
use relay_simulator::model::ChangeKind;
use relay_store::endpoints::{self, NewEndpoint};
use relay_store::messages::IncomingMessage;
use relay_store::{tenants, tracks, PoolOptions};
use relay_tests::{printed_seed, random_secret, rows_of, RedisPrefix, TestApp, TestDb};
use serde_json::{json, Value};
use sqlx::PgPool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::sequencer_apply::{applied_through, incoming, refetch, store_new, update};
use crate::stack::{
    copy_items, create_endpoint, oracle, relay_backlog, serve_simulation, start_sequencer_with,
    upstream_listener, Api,
};

/// Polls `done` every 100 ms until it holds; past `limit`, fails with `what` (and the seed).
async fn wait_until<F, Fut>(limit: Duration, what: impl Fn() -> String, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !done().await {
        assert!(started.elapsed() < limit, "{}", what());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits up to a minute until `endpoint` has applied through the message `want`; fails with
/// `what`.
async fn wait_applied_through(db: &TestDb, endpoint: Uuid, want: i64, what: &str) {
    let pool = &db.pool;
    wait_until(
        Duration::from_secs(60),
        || what.to_owned(),
        || async move { applied_through(pool, endpoint).await == want },
    )
    .await;
}

/// The quarantine tests' sequencer settings under `prefix`: the whole-relay tests' (every
/// upstream allowed: the simulator and the hanging upstream are on this machine).
pub(crate) fn sequencer_config(prefix: &str) -> SequencerConfig {
    crate::stack::sequencer_config(prefix, 16, relay_netguard::OutboundPolicy::ANY)
}

/// Stores `bodies` for the endpoint as the front tier does (track and generation copied out
/// when the body has them); their arrival numbers.
async fn store_raw(pool: &PgPool, tenant: Uuid, endpoint: Uuid, bodies: &[Vec<u8>]) -> Vec<i64> {
    let batch: Vec<IncomingMessage> = bodies
        .iter()
        .map(|body| {
            let parsed: Option<Value> = serde_json::from_slice(body).ok();
            let track = parsed
                .as_ref()
                .and_then(|b| b["track"].as_str().map(str::to_owned));
            let generation = parsed.as_ref().and_then(|b| b["generation"].as_i64());
            incoming(tenant, endpoint, track, generation, body.clone())
        })
        .collect();
    store_new(pool, &batch).await
}

/// [`store_raw`] of one [`update`] of `endpoint` at generation 1 per (event id, item number,
/// sequence).
pub(crate) async fn store_updates(
    pool: &PgPool,
    tenant: Uuid,
    endpoint: Uuid,
    updates: &[(&str, u64, u64)],
) -> Vec<i64> {
    let bodies: Vec<Vec<u8>> = updates
        .iter()
        .map(|&(id, n, seq)| update(endpoint, 1, id, n, seq).to_string().into_bytes())
        .collect();
    store_raw(pool, tenant, endpoint, &bodies).await
}

/// Registers an endpoint of `tenant` in sync under av1 at generation 1 (no reload begins until
/// a message asks for one), its upstream at `upstream` if given.
pub(crate) async fn in_sync_endpoint(pool: &PgPool, tenant: Uuid, upstream: Option<&str>) -> Uuid {
    let endpoint = Uuid::new_v4();
    endpoints::create(
        pool,
        &relay_tests::keys(),
        &NewEndpoint {
            id: endpoint,
            tenant_id: tenant,
            secret: random_secret(),
            upstream_base_url: upstream.map(str::to_owned),
            upstream_api_key: upstream.map(|_| "key".into()),
        },
    )
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id, generation, access_version)
         VALUES ($1, 'feed', $2, 1, 'av1')",
    )
    .bind(endpoint)
    .bind(tenant)
    .execute(pool)
    .await
    .unwrap();
    endpoint
}

/// (status, reason, attempts) of each quarantine row of the endpoint, by arrival number.
async fn quarantine_rows(pool: &PgPool, endpoint: Uuid) -> Vec<(i64, String, String, i32)> {
    rows_of(
        pool,
        "SELECT arrival_seq, status, reason, attempts FROM quarantined_messages
         WHERE endpoint_id = $1 ORDER BY arrival_seq",
        endpoint,
    )
    .await
}

#[tokio::test]
async fn an_unparseable_stored_message_is_quarantined_and_the_copy_still_equals_the_oracle() {
    let seed = printed_seed("quarantine");
    let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
    let app = TestApp::spawn_waking(&prefix.0).await;
    let pool = app.db.pool.clone();
    let (api_listener, api) = upstream_listener("127.0.0.1").await;
    let rate = 20.0;
    let duration = Duration::from_secs(3);
    let (upstream, workload, infos) =
        crate::stack::simulation(seed, &app.base_url, 2, relay_simulator::Faults::default());
    let tenant = Uuid::new_v4();
    tenants::create(&pool, tenant, "simulated").await.unwrap();
    for info in &infos {
        create_endpoint(&pool, tenant, info, &api).await;
    }
    let (sim, _senders) = serve_simulation(upstream, Duration::from_secs(2), api_listener).await;
    let ids: Vec<Uuid> = infos.iter().map(|i| i.id).collect();
    let (poisoned, healthy) = (ids[0], ids[1]);
    let converged = || {
        let (pool, sim, ids) = (pool.clone(), sim.clone(), ids.clone());
        move || {
            let (pool, sim, ids) = (pool.clone(), sim.clone(), ids.clone());
            async move {
                if !sim.wait_idle(Duration::from_millis(10)).await {
                    return false;
                }
                for &id in &ids {
                    if copy_items(&pool, id).await != oracle(&sim, id) {
                        return false;
                    }
                }
                relay_backlog(&pool).await == (0, 0)
            }
        }
    };

    // 1. The workload, applied as it comes.
    let sequencer = start_sequencer_with(
        &app.db.url,
        sequencer_config(&prefix.0),
        SequencerMetrics::unregistered(),
    )
    .await;
    sim.clone().run_workload(workload, rate, duration).await;
    wait_until(
        Duration::from_secs(90),
        || format!("seed {seed}: the workload's copies never equalled the oracle"),
        converged(),
    )
    .await;
    sequencer.stop().await;

    // 2. One more change, stored while no sequencer runs; the poisoned endpoint's copy of it is
    // then a body that is not a v1 message (as the front tier stores what the upstream signed).
    let subject = copy_items(&pool, poisoned)
        .await
        .into_keys()
        .next()
        .unwrap_or_else(|| panic!("seed {seed}: the workload made no item"));
    let change = |headline: &'static str| {
        let subject = subject.clone();
        move |upstream: &mut relay_simulator::upstream::Upstream, _: u64| {
            // Item timestamps after the workload's virtual ones.
            let at_ms = OffsetDateTime::now_utc().unix_timestamp() * 1000;
            upstream
                .change_item(&subject, ChangeKind::StoryAdded, headline, at_ms, false)
                .unwrap_or_else(|e| panic!("seed {seed}: changing {subject}: {e}"));
        }
    };
    let before = applied_through(&pool, poisoned).await;
    sim.change(change("while the sequencer was away"));
    wait_until(
        Duration::from_secs(30),
        || format!("seed {seed}: the upstream never sent its change"),
        || {
            let sim = sim.clone();
            async move { sim.wait_idle(Duration::from_millis(10)).await }
        },
    )
    .await;
    let stored: Vec<i64> = sqlx::query_scalar(
        "SELECT arrival_seq FROM messages WHERE endpoint_id = $1 AND arrival_seq > $2
         ORDER BY arrival_seq",
    )
    .bind(poisoned)
    .bind(before)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(stored.len(), 1, "seed {seed}: one message of the change");
    let not_v1 = format!(
        r#"{{"v": 1, "webhook_endpoint_id": "{poisoned}", "track": "feed", "generation": 1,
            "events": {{"not": "a list"}}}}"#
    );
    sqlx::query("UPDATE messages SET body = $3 WHERE endpoint_id = $1 AND arrival_seq = $2")
        .bind(poisoned)
        .bind(stored[0])
        .bind(not_v1.as_bytes())
        .execute(&pool)
        .await
        .unwrap();
    assert_ne!(
        copy_items(&pool, poisoned).await,
        oracle(&sim, poisoned),
        "seed {seed}: the change is not in the copy yet"
    );

    // 3. The sequencer again: the message is quarantined, the reload brings the change, and the
    // endpoint's later messages apply.
    let metrics = SequencerMetrics::unregistered();
    let sequencer =
        start_sequencer_with(&app.db.url, sequencer_config(&prefix.0), metrics.clone()).await;
    wait_until(
        Duration::from_secs(60),
        || format!("seed {seed}: the copies never equalled the oracle after the quarantine"),
        converged(),
    )
    .await;
    sim.change(change("after the quarantine"));
    wait_until(
        Duration::from_secs(60),
        || format!("seed {seed}: the change after the quarantine never reached the copy"),
        converged(),
    )
    .await;
    sequencer.stop().await;

    let rows = quarantine_rows(&pool, poisoned).await;
    assert_eq!(rows.len(), 1, "seed {seed}: {rows:?}");
    let (seq, status, reason, attempts) = &rows[0];
    assert_eq!(*seq, stored[0]);
    assert_eq!(status, "quarantined");
    assert!(reason.starts_with("not a v1 message"), "{reason}");
    assert_eq!(*attempts, 1);
    assert!(quarantine_rows(&pool, healthy).await.is_empty());
    let outcome: String = sqlx::query_scalar(
        "SELECT outcome FROM message_applications WHERE endpoint_id = $1 AND arrival_seq = $2",
    )
    .bind(poisoned)
    .bind(stored[0])
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(outcome, "quarantined");
    assert!(
        applied_through(&pool, poisoned).await > stored[0],
        "seed {seed}: later messages applied"
    );
    let quarantined = metrics.messages.with_label_values(&["quarantined"]).get();
    assert_eq!(quarantined, 1, "seed {seed}");
    app.stop().await;
}

#[tokio::test]
async fn a_failing_message_is_tried_a_bounded_number_of_times_then_quarantined_and_retried() {
    let db = TestDb::new().await;
    let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
    let (a, b) = (db.tenant().await, db.tenant().await);
    let a_endpoint = in_sync_endpoint(&db.pool, a, None).await;
    let b_endpoint = in_sync_endpoint(&db.pool, b, None).await;
    // Any event id starting "poison" makes the apply transaction fail, as a value Postgres
    // refuses would, until the test lifts it.
    refuse_poison(&db.pool, ("applied_events", "event_id"), "event").await;

    let metrics = SequencerMetrics::unregistered();
    let attempts = 2;
    let sequencer = start_sequencer_with(
        &db.url,
        SequencerConfig {
            apply_attempts: attempts,
            // The one wait lasts at least 5 s: long enough that B's messages, stored with A's,
            // are applied while A's failing message still waits for its second try.
            apply_backoff: ApplyBackoff {
                first: Duration::from_secs(10),
                max: Duration::from_secs(10),
            },
            ..sequencer_config(&prefix.0)
        },
        metrics.clone(),
    )
    .await;
    let a_seqs = store_updates(
        &db.pool,
        a,
        a_endpoint,
        &[("evt_1", 1, 10), ("poison_2", 2, 11), ("evt_3", 3, 12)],
    )
    .await;
    let b_seqs = store_updates(
        &db.pool,
        b,
        b_endpoint,
        &[("evt_1", 1, 10), ("evt_2", 2, 11)],
    )
    .await;

    // B's messages apply while A's failing message waits (its first try failed, the message
    // before it applied alone).
    wait_applied_through(&db, b_endpoint, b_seqs[1], "B's messages never applied").await;
    wait_applied_through(
        &db,
        a_endpoint,
        a_seqs[0],
        "A's first message never applied",
    )
    .await;
    assert!(
        quarantine_rows(&db.pool, a_endpoint).await.is_empty(),
        "quarantined before its last try"
    );

    // Then, after its last try, quarantined; the endpoint goes on.
    wait_applied_through(
        &db,
        a_endpoint,
        a_seqs[2],
        "A's later message never applied",
    )
    .await;
    let rows = quarantine_rows(&db.pool, a_endpoint).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    let (seq, status, reason, tried) = &rows[0];
    assert_eq!((*seq, status.as_str()), (a_seqs[1], "quarantined"));
    assert_eq!(*tried, attempts as i32);
    assert!(reason.contains("refused event poison_2"), "{reason}");
    assert_eq!(metrics.apply_failures.get(), u64::from(attempts));
    assert_eq!(
        metrics.messages.with_label_values(&["quarantined"]).get(),
        1
    );
    let copy = copy_items(&db.pool, a_endpoint).await;
    assert!(copy.contains_key("announcement:1") && copy.contains_key("announcement:3"));
    assert!(!copy.contains_key("announcement:2"));
    // The quarantine began a reload ("read /v1/feed again"); with no upstream it cannot merge,
    // and it does not hold the endpoint's messages back.
    let track = tracks::peek(&db.pool, relay_store::EndpointId(a_endpoint))
        .await
        .unwrap();
    assert!(track.reload.is_some(), "{track:?}");

    // A body that is not a v1 message, to discard.
    let not_v1 = store_raw(&db.pool, a, a_endpoint, &[b"{\"v\": 1}".to_vec()]).await[0];
    wait_until(
        Duration::from_secs(30),
        || "the body that is not v1 was never quarantined".to_owned(),
        {
            let pool = &db.pool;
            move || async move { quarantine_rows(pool, a_endpoint).await.len() == 2 }
        },
    )
    .await;

    // The control plane: A sees both, in its state and its listing; B sees none of it.
    let api_pool = relay_store::connect(&db.url, &PoolOptions::default()).unwrap();
    let api = Api::serve(api_pool, |_| {}).await;
    let base = format!("/v1/endpoints/{a_endpoint}");
    // A's call of `method` on its endpoint's `suffix`: the status and JSON of the answer.
    let a_calls = |method: &'static str, suffix: &str| {
        let (api, path) = (&api, format!("{base}{suffix}"));
        async move { api.call_as(a, method, &path, None).await }
    };
    let retry = format!("/quarantine/{}/retry", a_seqs[1]);
    let discard = format!("/quarantine/{not_v1}/discard");
    let (status, state_view) = a_calls("GET", "/state").await;
    assert_eq!(status, 200, "{state_view}");
    assert_eq!(state_view["messages_quarantined"], 2, "{state_view}");
    assert!(
        state_view["last_quarantine_reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("not a v1 message")),
        "{state_view}"
    );
    let (status, listed) = a_calls("GET", "/quarantine").await;
    assert_eq!(status, 200, "{listed}");
    let seqs: Vec<i64> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["arrival_seq"].as_i64().unwrap())
        .collect();
    assert_eq!(seqs, [a_seqs[1], not_v1], "{listed}");
    let (_, messages) = a_calls("GET", "/messages?order=arrival").await;
    let poisoned = messages["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["arrival_seq"] == a_seqs[1])
        .unwrap();
    assert_eq!(poisoned["applied"]["outcome"], "quarantined", "{poisoned}");
    assert!(
        poisoned["applied"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("refused event")),
        "{poisoned}"
    );
    for (method, path) in [
        ("GET", format!("{base}/quarantine")),
        ("POST", format!("{base}{retry}")),
        ("POST", format!("{base}{discard}")),
    ] {
        let (status, body) = api.call_as(b, method, &path, None).await;
        assert_eq!(status, 404, "B on {method} {path}: {body}");
    }
    let under_b = format!("/v1/endpoints/{b_endpoint}{retry}");
    let (status, _) = api.call_as(b, "POST", &under_b, None).await;
    assert_eq!(status, 404, "A's number under B's endpoint");

    // Discarded: kept, never applied; a second discard conflicts.
    let (status, discarded) = a_calls("POST", &discard).await;
    assert_eq!((status, &discarded["status"]), (200, &json!("discarded")));
    let (status, _) = a_calls("POST", &discard).await;
    assert_eq!(status, 409);

    // Retried once what made it fail is gone: a new arrival, applied by the usual rules.
    sqlx::query("DROP TRIGGER refuse_poison ON applied_events")
        .execute(&db.pool)
        .await
        .unwrap();
    let (status, retried) = a_calls("POST", &retry).await;
    assert_eq!(status, 200, "{retried}");
    assert_eq!(retried["status"], "retried");
    let new_seq = retried["retried_as"].as_i64().unwrap();
    assert!(new_seq > not_v1, "{retried}");
    wait_until(
        Duration::from_secs(30),
        || "the retried message never applied".to_owned(),
        {
            let (pool, endpoint, want) = (&db.pool, a_endpoint, new_seq);
            move || async move { applied_through(pool, endpoint).await >= want }
        },
    )
    .await;
    assert!(copy_items(&db.pool, a_endpoint)
        .await
        .contains_key("announcement:2"));
    let (_, messages) = a_calls("GET", "/messages?order=arrival").await;
    let outcomes: Vec<(i64, Value)> = messages["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["arrival_seq"].as_i64().unwrap(),
                m["applied"]["outcome"].clone(),
            )
        })
        .collect();
    assert_eq!(
        outcomes,
        [
            (a_seqs[0], json!("applied")),
            (a_seqs[2], json!("applied")),
            (not_v1, json!("quarantined")),
            (new_seq, json!("applied")),
        ]
    );
    let (_, state_view) = a_calls("GET", "/state").await;
    assert_eq!(state_view["messages_quarantined"], 0, "{state_view}");
    let (status, _) = a_calls("POST", &retry).await;
    assert_eq!(status, 409, "retried twice");
    // Its webhook-id still marks it stored: a redelivery is a duplicate.
    let duplicates: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM messages WHERE endpoint_id = $1 AND arrival_seq = $2",
    )
    .bind(a_endpoint)
    .bind(new_seq)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(duplicates, 1);
    sequencer.stop().await;
}

#[tokio::test]
async fn a_nul_in_an_event_id_quarantines_its_message_and_the_endpoint_goes_on() {
    let db = TestDb::new().await;
    let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
    let tenant = db.tenant().await;
    let endpoint = in_sync_endpoint(&db.pool, tenant, None).await;
    let sequencer = start_sequencer_with(
        &db.url,
        SequencerConfig {
            apply_backoff: ApplyBackoff {
                first: Duration::from_millis(20),
                max: Duration::from_millis(100),
            },
            ..sequencer_config(&prefix.0)
        },
        SequencerMetrics::unregistered(),
    )
    .await;
    let seqs = store_updates(
        &db.pool,
        tenant,
        endpoint,
        &[("evt\u{0}x", 1, 10), ("evt_2", 2, 11)],
    )
    .await;
    wait_applied_through(
        &db,
        endpoint,
        seqs[1],
        "the message after the NUL never applied",
    )
    .await;
    sequencer.stop().await;
    let rows = quarantine_rows(&db.pool, endpoint).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!((rows[0].0, rows[0].1.as_str()), (seqs[0], "quarantined"));
    assert!(!rows[0].2.contains('\0'));
    assert!(copy_items(&db.pool, endpoint)
        .await
        .contains_key("announcement:2"));
}

/// Makes every insert into `table` whose `column` starts with "poison" fail with "refused
/// `what` <value>" (trigger `refuse_poison`, dropped to lift it), as a value Postgres refuses
/// would.
pub(crate) async fn refuse_poison(pool: &PgPool, (table, column): (&str, &str), what: &str) {
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.{column} LIKE 'poison%' THEN
                 RAISE EXCEPTION 'refused {what} %', NEW.{column};
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse_poison BEFORE INSERT ON {table}
             FOR EACH ROW EXECUTE FUNCTION refuse_poison();"
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// An upstream that accepts connections and never answers, counting how many are open at once.
struct HangingUpstream {
    url: String,
    open: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

impl HangingUpstream {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let open = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let (o, m) = (open.clone(), most.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let (o, m) = (o.clone(), m.clone());
                tokio::spawn(async move {
                    let now = o.fetch_add(1, Ordering::SeqCst) + 1;
                    m.fetch_max(now, Ordering::SeqCst);
                    // Read the request, answer nothing; the client closes on its timeout.
                    let mut buffer = [0u8; 4096];
                    while let Ok(n) = tokio::io::AsyncReadExt::read(&mut stream, &mut buffer).await
                    {
                        if n == 0 {
                            break;
                        }
                    }
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Self { url, open, most }
    }
}

#[tokio::test]
async fn a_tenant_whose_upstream_hangs_holds_at_most_its_share_of_the_workers() {
    let db = TestDb::new().await;
    let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
    let hanging = HangingUpstream::start().await;
    let (a, b) = (db.tenant().await, db.tenant().await);
    let mut a_endpoints = Vec::new();
    for _ in 0..6 {
        a_endpoints.push(in_sync_endpoint(&db.pool, a, Some(&hanging.url)).await);
    }
    let mut b_endpoints = Vec::new();
    for _ in 0..3 {
        b_endpoints.push(in_sync_endpoint(&db.pool, b, None).await);
    }
    // Each of A's endpoints has a message whose item must be read from A's upstream, which
    // never answers: its worker waits on the read.
    for (i, &endpoint) in a_endpoints.iter().enumerate() {
        store_raw(
            &db.pool,
            a,
            endpoint,
            &[refetch(endpoint, 1, &format!("evt_{i}"), 1, 10)
                .to_string()
                .into_bytes()],
        )
        .await;
    }
    let max_concurrent = 4;
    let sequencer = start_sequencer_with(
        &db.url,
        SequencerConfig {
            max_concurrent_endpoints: max_concurrent,
            max_tenant_share: 0.5,
            upstream_timeout: Duration::from_secs(120),
            ..sequencer_config(&prefix.0)
        },
        SequencerMetrics::unregistered(),
    )
    .await;
    // A's workers are waiting on its upstream before B's messages arrive.
    wait_until(
        Duration::from_secs(30),
        || "A's workers never reached its upstream".to_owned(),
        || {
            let open = hanging.open.clone();
            async move { open.load(Ordering::SeqCst) >= 2 }
        },
    )
    .await;
    let mut last = Vec::new();
    for &endpoint in &b_endpoints {
        last.push(
            store_updates(&db.pool, b, endpoint, &[("evt_1", 1, 10), ("evt_2", 2, 11)]).await[1],
        );
    }
    // Far within A's upstream timeout: B's messages cannot be waiting for A's workers to give
    // their slots back.
    wait_until(
        Duration::from_secs(60),
        || {
            format!(
                "B's messages never applied while A's upstream hung (A's requests open at \
                 once, at most: {})",
                hanging.most.load(Ordering::SeqCst)
            )
        },
        || {
            let (pool, b_endpoints, last) = (db.pool.clone(), b_endpoints.clone(), last.clone());
            async move {
                for (endpoint, last) in b_endpoints.iter().zip(&last) {
                    if applied_through(&pool, *endpoint).await != *last {
                        return false;
                    }
                }
                true
            }
        },
    )
    .await;
    let most = hanging.most.load(Ordering::SeqCst);
    assert!(
        most <= max_concurrent / 2,
        "A held {most} of {max_concurrent} workers at once"
    );
    for &endpoint in &a_endpoints {
        assert_eq!(applied_through(&db.pool, endpoint).await, 0);
    }
    // Its workers wait on reads that never end: stopped as a killed process would be.
    sequencer.abort();
}
