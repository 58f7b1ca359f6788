//! A reload against an upstream whose timing the test holds: what the sequencer's reload and
//! refetch code does when a change is made after a reload read its pages and before it merged,
//! when refetches keep failing while a reload reads, and what a reload under the generation the
//! copy already holds leaves of the items the upstream no longer serves.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use relay_netguard::{OutboundPolicy, RetryPolicy};
use relay_sequencer::SequencerMetrics;
use relay_sequencer::UpstreamClient;
use relay_sequencer::{run_reload, ReloadEnd, StopReload};
use relay_sequencer::{ApplyError, EndpointContext};
use relay_store::copy;
use relay_store::endpoints::EndpointRegistration;
use relay_store::tracks;
use relay_tests::readback::Operation;
use relay_tests::{capture_logs, TestDb};
use relay_wire::Sequence;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::sequencer_apply::{
    applied_through, apply_messages, pending, setup_with_upstream, store, Setup,
};
use crate::stack::upstream_listener;

/// The access_version the upstream serves, and the one `setup_with_upstream` holds the track
/// under.
const AV: &str = "av1";

fn item(n: u64, seq: u64) -> Value {
    json!({"type": "item", "feed_item_id": format!("announcement:{n}"),
           "item_kind": "announcement", "seq": seq, "first_seq": seq, "op": "new",
           "changes": [], "parts": [{"part_id": format!("story:{n}"), "part_version": seq}]})
}

/// An upstream of one endpoint: its feed is `items`, paged as the reader asks (`limit`, and an
/// offset as the cursor); an item read always fails as a load balancer's 404 would; the next
/// `hold_pages` page reads are held after they took their snapshot, until the test releases
/// each.
#[derive(Clone)]
struct HeldUpstream {
    endpoint: Uuid,
    /// The track's generation the endpoint read gives.
    generation: u64,
    /// (n, seq) of each item, in feed order.
    items: Arc<Mutex<Vec<(u64, u64)>>>,
    hold_pages: Arc<AtomicUsize>,
    page_read: Arc<Notify>,
    release: Arc<Semaphore>,
    pages_served: Arc<AtomicUsize>,
}

impl HeldUpstream {
    fn new(endpoint: Uuid, generation: u64, items: Vec<(u64, u64)>) -> Self {
        Self {
            endpoint,
            generation,
            items: Arc::new(Mutex::new(items)),
            hold_pages: Arc::new(AtomicUsize::new(0)),
            page_read: Arc::new(Notify::new()),
            release: Arc::new(Semaphore::new(0)),
            pages_served: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn serve(&self, listener: TcpListener) -> JoinHandle<std::io::Result<()>> {
        let app = Router::new()
            .route("/v1/webhook-endpoints/{id}", get(endpoint_view))
            .route("/v1/feed", get(feed_page))
            .route("/v1/feed/items/{id}", get(item_read))
            .with_state(self.clone());
        tokio::spawn(async move { axum::serve(listener, app).await })
    }

    /// Holds the next `pages` page reads.
    fn hold(&self, pages: usize) {
        self.hold_pages.store(pages, Ordering::SeqCst);
    }

    /// Lets one held page read answer.
    fn release_one(&self) {
        self.release.add_permits(1);
    }

    /// Waits until a page read is held; panics with `what` when the reload ends first.
    async fn held_page(&self, reading: &mut JoinHandle<Result<ReloadEnd, ApplyError>>, what: &str) {
        tokio::select! {
            _ = self.page_read.notified() => {}
            end = reading => panic!("the reload ended ({end:?}) before {what}"),
            _ = tokio::time::sleep(Duration::from_secs(30)) => panic!("no page read: {what}"),
        }
    }
}

async fn endpoint_view(State(up): State<HeldUpstream>) -> Json<Value> {
    Json(
        json!({"id": up.endpoint, "lang": "en", "status": "active", "filter": null,
                "tracks": {"feed": {"generation": up.generation}}}),
    )
}

async fn feed_page(
    State(up): State<HeldUpstream>,
    Query(query): Query<HashMap<String, String>>,
) -> Json<Value> {
    let offset: usize = query.get("cursor").map_or(0, |c| c.parse().unwrap());
    let limit: usize = query.get("limit").map_or(500, |l| l.parse().unwrap());
    let (data, more) = {
        let items = up.items.lock().unwrap();
        let page = items.iter().skip(offset).take(limit);
        let data: Vec<Value> = page
            .map(|&(n, seq)| {
                json!({"subject": format!("announcement:{n}"),
                       "sequence": Sequence::from_parts(1, seq).as_str(), "item": item(n, seq)})
            })
            .collect();
        (data, offset + limit < items.len())
    };
    up.pages_served.fetch_add(1, Ordering::SeqCst);
    let held = up
        .hold_pages
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if held {
        up.page_read.notify_one();
        up.release.acquire().await.unwrap().forget();
    }
    let next_cursor = more.then(|| (offset + limit).to_string());
    Json(json!({"access_version": AV, "data": data, "next_cursor": next_cursor, "has_more": more}))
}

async fn item_read() -> Response {
    (StatusCode::NOT_FOUND, "upstream unavailable").into_response()
}

fn body(endpoint: Uuid, generation: u64, events: Value, through: Option<u64>) -> Value {
    let mut body = json!({"v": 1, "webhook_endpoint_id": endpoint.to_string(), "track": "feed",
                          "generation": generation, "access_version": AV, "events": events});
    if let Some(through) = through {
        body["since"] = json!(format!("1.{}", through - 1));
        body["through"] = json!(format!("1.{through}"));
        body["complete"] = json!(true);
    }
    body
}

fn reset(endpoint: Uuid, generation: u64, resume_from: u64) -> Value {
    body(
        endpoint,
        generation,
        json!([{"id": format!("evt_reset_{generation}"), "type": "webhook_endpoint.reset",
                "specversion": "1.0", "source": "https://api.quanor.com/v1/webhook-endpoints",
                "data": {"access_version": AV, "generation": generation, "reason": "behind",
                         "resume_from": format!("1.{resume_from}"), "track": "feed"}}]),
        None,
    )
}

/// An update of item `n` at `seq`.
fn updated(n: u64, seq: u64) -> Value {
    json!({"id": format!("evt_{n}_{seq}"), "type": "announcement.updated",
           "subject": format!("announcement:{n}"),
           "sequence": Sequence::from_parts(1, seq).as_str(), "specversion": "1.0",
           "data": item(n, seq)})
}

fn refetch(endpoint: Uuid, generation: u64, id: &str, n: u64, seq: u64) -> Value {
    body(
        endpoint,
        generation,
        json!([{"id": id, "type": "announcement.updated",
                "subject": format!("announcement:{n}"),
                "sequence": Sequence::from_parts(1, seq).as_str(),
                "specversion": "1.0", "source": "https://api.quanor.com/v1/feed",
                "data": {"type": "refetch", "feed_item_id": format!("announcement:{n}"),
                         "op": "new", "seq": seq}}]),
        Some(seq),
    )
}

async fn store_and_apply(
    db: &TestDb,
    ctx: &Arc<EndpointContext>,
    token: i64,
    message: &Value,
    metrics: &SequencerMetrics,
) {
    store(
        db,
        ctx.tenant().0,
        ctx.id().0,
        std::slice::from_ref(message),
    )
    .await;
    let (applied, messages) = pending(db, ctx.id().0).await;
    apply_messages(&db.pool, ctx, token, applied, &messages, metrics)
        .await
        .unwrap();
}

/// A retry policy for reloads that keeps tests quick.
const BACKOFF: RetryPolicy = RetryPolicy {
    first: Duration::from_millis(10),
    max: Duration::from_millis(50),
};

/// The subjects the copy holds items of (tombstones left out), with their sequences.
async fn held_items(db: &TestDb, endpoint: Uuid) -> Vec<(String, String)> {
    relay_tests::readback::copy_rows(&db.pool, endpoint)
        .await
        .unwrap()
        .into_iter()
        .filter(|(_, row)| !row.is_tombstone())
        .map(|(subject, row)| (subject, row.sequence.as_str().to_owned()))
        .collect()
}

/// What the upstream's feed holds now, as [`held_items`] gives a copy.
fn served(up: &HeldUpstream) -> Vec<(String, String)> {
    let mut items: Vec<(String, String)> = up
        .items
        .lock()
        .unwrap()
        .iter()
        .map(|&(n, seq)| {
            let sequence = Sequence::from_parts(1, seq);
            (format!("announcement:{n}"), sequence.as_str().to_owned())
        })
        .collect();
    items.sort();
    items
}

/// Runs `reload` in a task of its own (`stop` kept by the caller: dropping it stops the reload).
fn spawn_reload(
    db: &TestDb,
    ctx: &Arc<EndpointContext>,
    token: i64,
    reload: &relay_rules::Reload,
    metrics: &SequencerMetrics,
) -> (StopReload, JoinHandle<Result<ReloadEnd, ApplyError>>) {
    let (stop, stopping) = StopReload::new();
    let (pool, ctx, metrics, reload) = (
        db.pool.clone(),
        ctx.clone(),
        metrics.clone(),
        reload.clone(),
    );
    let task = tokio::spawn(async move {
        run_reload(&pool, &ctx, token, &reload, BACKOFF, &metrics, stopping).await
    });
    (stop, task)
}

/// The endpoint's fence claimed, and a reset of generation 2 applied under it: the fencing token
/// and the reload the reset began.
async fn begin_reset_reload(
    db: &TestDb,
    ctx: &Arc<EndpointContext>,
    endpoint: Uuid,
    metrics: &SequencerMetrics,
) -> (i64, relay_rules::Reload) {
    let token = db.claim_fence(endpoint).await;
    store_and_apply(db, ctx, token, &reset(endpoint, 2, 10), metrics).await;
    let reload = running_reload(&db.pool, endpoint, "the reset began a reload").await;
    (token, reload)
}

/// A pass of one page under [`AV`] that reads item 1 at 1.10, the upstream at generation 2.
fn item_1_pass() -> relay_rules::Pass {
    relay_rules::Pass {
        page_access_versions: vec![AV.to_owned()],
        items: vec![relay_rules::ReadItem {
            subject: "announcement:1".to_owned(),
            sequence: Sequence::from_parts(1, 10),
            item: relay_wire::FeedItem::from_value(item(1, 10), "data[0].item").unwrap(),
        }],
        upstream_generation: Some(2),
        read_again_at_start: 0,
    }
}

/// What the copy holds of a subject: its item, or a tombstone.
#[derive(Debug, PartialEq, Eq)]
enum Held {
    Item,
    Tombstone,
}

/// The copy of `endpoint` holds `announcement:1` at `generation` and sequence `1.{seq}`, as
/// `held` says.
async fn assert_item_1(db: &TestDb, endpoint: Uuid, generation: u64, seq: u64, held: Held) {
    let rows = relay_tests::readback::copy_rows(&db.pool, endpoint)
        .await
        .unwrap();
    let one = &rows["announcement:1"];
    let found = if one.is_tombstone() {
        Held::Tombstone
    } else {
        Held::Item
    };
    assert_eq!(
        (one.generation, one.sequence.as_str(), found),
        (generation, Sequence::from_parts(1, seq).as_str(), held)
    );
}

/// The reload the endpoint's track holds; fails with `what` when none runs.
async fn running_reload(pool: &sqlx::PgPool, endpoint: Uuid, what: &str) -> relay_rules::Reload {
    tracks::peek(pool, relay_store::EndpointId(endpoint))
        .await
        .unwrap()
        .reload
        .expect(what)
}

/// Rule "a 404 that carries none (a load balancer's) is a read that failed: try it again a few
/// times, then read /v1/feed again": when a reload is already running, its pages may have been
/// read before the item the refetch names was created. Merging only them would leave that item
/// out for good (the refetch's event id is applied, so nothing brings it back): the pass being
/// read still merges (its items are no worse than what is held), and the reload then reads
/// another, which holds the item.
#[tokio::test]
async fn a_refetch_that_reads_the_feed_again_has_the_running_reload_read_another_pass() {
    let (listener, base_url) = upstream_listener("127.0.0.1").await;
    let Setup {
        db, endpoint, ctx, ..
    } = setup_with_upstream(Some(base_url)).await;
    let upstream = HeldUpstream::new(endpoint, 2, vec![(1, 10)]);
    let server = upstream.serve(listener);
    let metrics = SequencerMetrics::unregistered();

    // A reset begins a reload; it reads its one page (item 1 only) and is held there.
    let (token, first) = begin_reset_reload(&db, &ctx, endpoint, &metrics).await;
    upstream.hold(1);
    let (_stop, mut reading) = spawn_reload(&db, &ctx, token, &first, &metrics);
    upstream
        .held_page(&mut reading, "the first pass read its page")
        .await;

    // Item 2 is created after that read; its event comes as a refetch whose reads all fail.
    upstream.items.lock().unwrap().push((2, 12));
    store_and_apply(
        &db,
        &ctx,
        token,
        &refetch(endpoint, 2, "evt_item_2", 2, 12),
        &metrics,
    )
    .await;
    let asked = running_reload(&db.pool, endpoint, "a reload runs").await;
    assert!(asked.is(&first), "the running reload goes on: {asked:?}");
    assert_eq!(asked.read_again, 1, "and is asked for another pass");

    // The held pass merges; the next one is held in its turn.
    upstream.hold(1);
    upstream.release_one();
    upstream
        .held_page(&mut reading, "a second pass was read")
        .await;
    assert_eq!(
        held_items(&db, endpoint).await,
        [(
            "announcement:1".to_owned(),
            Sequence::from_parts(1, 10).as_str().to_owned()
        )],
        "the first pass merged"
    );

    // The second pass sees item 2, and the reload ends with it merged.
    upstream.release_one();
    let end = reading.await.unwrap().unwrap();
    assert!(matches!(end, ReloadEnd::Merged { .. }), "{end:?}");
    let track = tracks::peek(&db.pool, relay_store::EndpointId(endpoint))
        .await
        .unwrap();
    assert_eq!(track.reload, None, "{track:?}");
    assert_eq!(held_items(&db, endpoint).await, served(&upstream));
    assert_eq!(upstream.pages_served.load(Ordering::SeqCst), 2);
    server.abort();
}

/// The endpoint's context again, reading `/v1/feed` `limit` items per page.
fn paged(ctx: &EndpointContext, base_url: &str, limit: usize) -> Arc<EndpointContext> {
    let registration = EndpointRegistration {
        id: ctx.id(),
        tenant_id: ctx.tenant(),
        upstream_base_url: Some(base_url.to_owned()),
        upstream_api_key: Some("key".to_owned().into()),
        source: relay_store::endpoints::Source::Feed,
        // A feed endpoint's registration instant decides nothing.
        created_at: time::OffsetDateTime::UNIX_EPOCH,
    };
    let http = UpstreamClient::http_client(
        Duration::from_secs(5),
        OutboundPolicy::ANY,
        &relay_netguard::TrustRoots::platform(),
    );
    Arc::new(EndpointContext::new(registration, http).with_feed_page_limit(limit))
}

/// Rule "a 404 that carries none (a load balancer's) is a read that failed: try it again a few
/// times, then read /v1/feed again", while a reload of several pages runs and every item read
/// fails so: a refetch event comes during each page of two passes. Each pass the reload reads
/// still merges (the copy holds the reload's items while the 404s last), and once the refetches
/// stop the reload reads a last pass and ends. A refetch that keeps failing asks the running
/// reload for another pass; it never begins the reload again, which threw the pass being read
/// away and read from page 1, so a steady stream of failing refetches kept a large reload from
/// ever merging.
#[tokio::test]
async fn failing_refetches_during_a_reload_of_several_pages_do_not_keep_its_passes_from_merging() {
    let (listener, base_url) = upstream_listener("127.0.0.1").await;
    let Setup {
        db, endpoint, ctx, ..
    } = setup_with_upstream(Some(base_url.clone())).await;
    // Five items, two to a page: three pages a pass.
    let upstream = HeldUpstream::new(endpoint, 2, (1..=5).map(|n| (n, 9 + n)).collect());
    let server = upstream.serve(listener);
    let ctx = paged(&ctx, &base_url, 2);
    let metrics = SequencerMetrics::unregistered();
    let (token, reload) = begin_reset_reload(&db, &ctx, endpoint, &metrics).await;
    // Every page of the first two passes is held while a refetch comes.
    upstream.hold(6);
    let (_stop, mut reading) = spawn_reload(&db, &ctx, token, &reload, &metrics);
    for k in 0..6u64 {
        upstream
            .held_page(
                &mut reading,
                &format!("page {} of pass {}", k % 3 + 1, k / 3 + 1),
            )
            .await;
        if k == 3 {
            // The second pass began: the first merged, though refetches kept failing.
            assert_eq!(
                held_items(&db, endpoint).await.len(),
                5,
                "the first pass merged"
            );
            let running = tracks::peek(&db.pool, relay_store::EndpointId(endpoint))
                .await
                .unwrap()
                .reload;
            let running = running.expect("the reload reads another pass");
            assert!(running.is(&reload), "{running:?}");
            assert_eq!(running.read_again, 3, "one ask per failed refetch");
        }
        // An item changes upstream; its event comes as a refetch whose reads all fail.
        let (n, seq) = (k % 5 + 1, 100 + k);
        upstream.items.lock().unwrap()[n as usize - 1] = (n, seq);
        let id = format!("evt_refetch_{k}");
        store_and_apply(
            &db,
            &ctx,
            token,
            &refetch(endpoint, 2, &id, n, seq),
            &metrics,
        )
        .await;
        upstream.release_one();
    }

    // No more refetches: the pass read after the last of them merges, and the reload ends.
    let end = reading.await.unwrap().unwrap();
    assert!(matches!(end, ReloadEnd::Merged { .. }), "{end:?}");
    assert_eq!(
        upstream.pages_served.load(Ordering::SeqCst),
        9,
        "three passes: two read while refetches failed, one after"
    );
    let track = tracks::peek(&db.pool, relay_store::EndpointId(endpoint))
        .await
        .unwrap();
    assert_eq!(track.reload, None, "{track:?}");
    assert_eq!(held_items(&db, endpoint).await, served(&upstream));
    let failed = metrics
        .upstream_failures
        .with_label_values(&["refetch", "load_balancer_404"])
        .get();
    assert_eq!(
        failed, 18,
        "every item read of six refetches, three tries each"
    );
    server.abort();
}

/// Rule R-MERGE-SAME-GENERATION (services/rules/RULES.md): a reload under the generation the
/// copy already holds (here the one a restore begins, "read /v1/feed again") leaves no item the
/// upstream no longer serves. Item B, held from before the reload and not in its pass, becomes a
/// tombstone at its own position and the outbox gets its removal. Merging removed only rows of
/// an older generation before, so B stayed in the copy for good.
#[tokio::test]
async fn a_reload_under_the_held_generation_withdraws_what_the_upstream_no_longer_serves() {
    let (listener, base_url) = upstream_listener("127.0.0.1").await;
    let Setup {
        db,
        tenant,
        endpoint,
        ctx,
    } = setup_with_upstream(Some(base_url)).await;
    // The upstream serves A only, and its track is at generation 1, as the copy's.
    let upstream = HeldUpstream::new(endpoint, 1, vec![(1, 10)]);
    let server = upstream.serve(listener);
    let metrics = SequencerMetrics::unregistered();
    let token = db.claim_fence(endpoint).await;

    // The copy holds A and B at generation 1.
    let message = body(
        endpoint,
        1,
        json!([updated(1, 10), updated(2, 11)]),
        Some(11),
    );
    store_and_apply(&db, &ctx, token, &message, &metrics).await;
    assert_eq!(held_items(&db, endpoint).await.len(), 2);

    // The copy is restored: the feed is read again, under the generation it holds.
    let (track, begun) = tracks::transition(
        &db.pool,
        relay_store::TenantId(tenant),
        relay_store::EndpointId(endpoint),
        relay_rules::reload_after_restore,
    )
    .await
    .unwrap();
    assert!(begun);
    let reload = track.reload.expect("a reload begins");
    assert_eq!(reload.generation, 1);
    let (_stop, stopping) = StopReload::new();
    let end = run_reload(&db.pool, &ctx, token, &reload, BACKOFF, &metrics, stopping)
        .await
        .unwrap();
    assert!(matches!(end, ReloadEnd::Merged { .. }), "{end:?}");

    let rows = relay_tests::readback::copy_rows(&db.pool, endpoint)
        .await
        .unwrap();
    let b = &rows["announcement:2"];
    assert!(b.is_tombstone(), "B is withdrawn: {rows:?}");
    assert_eq!(
        (b.generation, b.sequence.as_str()),
        (1, Sequence::from_parts(1, 11).as_str()),
        "at its own position"
    );
    assert_eq!(held_items(&db, endpoint).await, served(&upstream));
    let changes = relay_tests::readback::list_changes(&db.pool, endpoint)
        .await
        .unwrap();
    let last = changes.last().expect("changes");
    assert_eq!(
        (last.operation, last.subject.as_str()),
        (Operation::Remove, "announcement:2"),
        "{changes:?}"
    );
    assert_eq!(
        changes
            .iter()
            .filter(|c| c.operation == Operation::Remove)
            .count(),
        1
    );
    let track = tracks::peek(&db.pool, relay_store::EndpointId(endpoint))
        .await
        .unwrap();
    assert_eq!(track.reload, None, "{track:?}");
    server.abort();
}

/// The statements of the test's database waiting for a lock.
async fn waiting_on_locks(db: &TestDb) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT query FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Polls `check` every 20 ms; panics with `what` after 20 s.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What [`apply_while_a_merge_holds_the_endpoint`] leaves to check.
struct MergeRace {
    db: TestDb,
    endpoint: Uuid,
    metrics: SequencerMetrics,
    /// Every log line from the sequencer's start to its stop.
    logs: String,
}

impl MergeRace {
    /// The sequencer lost no lock and logged nothing at ERROR.
    fn assert_no_loss_and_no_error(&self) {
        assert_eq!(self.metrics.lock_losses.get(), 0, "no lock was lost");
        assert!(!self.logs.contains("ERROR"), "{}", self.logs);
    }
}

/// A running sequencer owns an endpoint whose reset began a reload (generation 2); the reload's
/// merge (of item 1 at sequence 10) takes the endpoint's fence and writer lock and waits on the
/// track row, which a test transaction holds; `message` lands, and the sequencer's apply of it
/// waits on the writer lock; then the test lets the merge go and waits for the message to be
/// applied. The apply's first statement took its snapshot before the merge committed, so the
/// row the merge inserted is not among the rows it read.
async fn apply_while_a_merge_holds_the_endpoint(message: impl FnOnce(Uuid) -> Value) -> MergeRace {
    // Every log line of the test's thread (the runtime is this one thread: the sequencer's
    // tasks log here too).
    let (logs, guard) = capture_logs(tracing::Level::INFO);

    // No upstream: the worker's own reload waits for settings, and this test merges it.
    let Setup {
        db,
        tenant,
        endpoint,
        ..
    } = setup_with_upstream(None).await;
    let metrics = SequencerMetrics::unregistered();
    let prefix = relay_tests::RedisPrefix(format!("relay-test:{}:", Uuid::new_v4().simple()));
    let pool = relay_store::connect(
        &db.url,
        &relay_store::PoolOptions {
            max_connections: 8,
            ..relay_store::PoolOptions::default()
        },
    )
    .unwrap();
    let config = relay_sequencer::SequencerConfig {
        redis_url: relay_tests::redis_url(),
        key_prefix: prefix.0.clone(),
        sweep_interval: Duration::from_millis(100),
        // The worker keeps the endpoint (and its fence) from the reset to the end.
        idle_linger: Duration::from_secs(120),
        outbound: OutboundPolicy::ANY,
        ..relay_sequencer::SequencerConfig::default()
    };
    let sequencer =
        relay_sequencer::Sequencer::start(pool, config, relay_tests::keys(), metrics.clone())
            .await
            .unwrap();

    // A reset begins a reload; the sequencer applies it and owns the endpoint.
    store(&db, tenant, endpoint, &[reset(endpoint, 2, 10)]).await;
    eventually("the reset applied", || async {
        applied_through(&db.pool, endpoint).await == 1
    })
    .await;
    let reload = running_reload(&db.pool, endpoint, "the reset began a reload").await;
    let token: i64 = sqlx::query_scalar("SELECT token FROM endpoint_fences WHERE endpoint_id = $1")
        .bind(endpoint)
        .fetch_one(&db.pool)
        .await
        .unwrap();

    // The reload's merge takes the endpoint and waits on the track row the test holds.
    let mut held = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM endpoint_tracks WHERE endpoint_id = $1 FOR UPDATE")
        .bind(endpoint)
        .execute(&mut *held)
        .await
        .unwrap();
    let pass = item_1_pass();
    let claim = tracks::TrackClaim {
        endpoint: relay_store::EndpointId(endpoint),
        tenant: relay_store::TenantId(tenant),
        token,
    };
    let merging = {
        let pool = db.pool.clone();
        tokio::spawn(async move { copy::merge(&pool, claim, &reload, &pass).await })
    };
    eventually("the merge waits, holding the endpoint", || async {
        waiting_on_locks(&db).await.len() == 1
    })
    .await;

    // The message lands; the sequencer's apply waits for the merge.
    store(&db, tenant, endpoint, &[message(endpoint)]).await;
    eventually("the apply waits for the merge", || async {
        let waiting = waiting_on_locks(&db).await;
        // The apply's open statement (`runs::open_runs`) takes its claims from `$5`.
        waiting.len() == 2 && waiting.iter().any(|q| q.contains("unnest($5::uuid[]"))
    })
    .await;

    held.commit().await.unwrap();
    let merged = merging.await.unwrap().unwrap();
    assert!(matches!(merged, copy::Merged::Merged { .. }), "{merged:?}");
    eventually("the message applied", || async {
        applied_through(&db.pool, endpoint).await == 2
    })
    .await;
    sequencer.stop().await;
    drop(guard);
    MergeRace {
        db,
        endpoint,
        metrics,
        logs: logs.text(),
    }
}

/// A message that lands while a reload's merge holds the endpoint: the apply's first statement
/// waits for the writer lock with a snapshot taken before the merge committed, so the row the
/// merge inserts is not among the rows it reads (the run is found stale; a write of a plan made
/// from those rows would be refused). That is no lost lock: the run is decided again at once,
/// in a statement that sees the row, and applied, with no ERROR logged and no lock loss counted.
/// Before, the refusal was logged as an ERROR and answered as a moved cursor: the worker counted
/// a lock loss and let the endpoint go.
///
/// Made deterministic with a test transaction holding the track row: the merge takes the
/// endpoint's fence and writer lock and waits on that row; the sequencer's apply of the message
/// waits on the writer lock; then the test lets the merge go.
#[tokio::test(flavor = "current_thread")]
async fn a_message_that_lands_while_a_merge_holds_the_endpoint_is_applied_without_a_lock_loss() {
    // An update of the item the merge stores, at a sequence before the one the merge reads.
    let race = apply_while_a_merge_holds_the_endpoint(|endpoint| {
        body(endpoint, 2, json!([updated(1, 5)]), Some(5))
    })
    .await;
    let (db, endpoint, metrics) = (&race.db, race.endpoint, &race.metrics);

    // Applied against the merged row: the merge's item is kept, the update is older.
    assert_item_1(db, endpoint, 2, 10, Held::Item).await;
    let outcome: (String, i32) = sqlx::query_as(
        "SELECT outcome, events_ignored FROM message_applications
         WHERE endpoint_id = $1 AND arrival_seq = 2",
    )
    .bind(endpoint)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(outcome, ("applied".to_owned(), 1));
    assert_eq!(
        metrics.events.with_label_values(&["ignored_older"]).get(),
        1
    );
    // The run was opened twice: first from stale rows (nothing decided or written), then it
    // committed.
    let steps = |step: &str| {
        metrics
            .apply_step_duration
            .with_label_values(&[step])
            .get_sample_count()
    };
    assert_eq!(steps("open"), steps("commit") + 1, "one run decided again");
    race.assert_no_loss_and_no_error();
    assert!(!race.logs.contains("lost the endpoint"), "{}", race.logs);
}

/// A removal that lands while a reload's merge holds the endpoint, at a position that wins over
/// the item the merge stores: the copy keeps a tombstone, and the outbox gets the removal of the
/// item the merge stored, so the outbox replayed from nothing ends as the copy does. Decided
/// against the rows the apply's first statement read, the removal finds nothing held (the
/// merge's row came after that statement's snapshot): its tombstone still wins over the merge's
/// item in the write, but no removal is appended, and the outbox holds the item for good.
#[tokio::test(flavor = "current_thread")]
async fn a_removal_that_lands_while_a_merge_holds_the_endpoint_removes_the_merged_item() {
    let race = apply_while_a_merge_holds_the_endpoint(|endpoint| {
        let hidden = json!({"id": "evt_1_12_hidden", "type": "announcement.hidden",
                            "subject": "announcement:1",
                            "sequence": Sequence::from_parts(1, 12).as_str(),
                            "specversion": "1.0",
                            "data": {"type": "hidden", "feed_item_id": "announcement:1",
                                     "seq": 12}});
        body(endpoint, 2, json!([hidden]), Some(12))
    })
    .await;

    let (db, endpoint) = (&race.db, race.endpoint);
    assert_item_1(db, endpoint, 2, 12, Held::Tombstone).await;
    let changes = relay_tests::readback::list_changes(&db.pool, endpoint)
        .await
        .unwrap();
    let operations: Vec<(Operation, &str, Option<&str>)> = changes
        .iter()
        .map(|c| (c.operation, c.subject.as_str(), c.event_id.as_deref()))
        .collect();
    assert_eq!(
        operations,
        [
            (Operation::Upsert, "announcement:1", None),
            (Operation::Remove, "announcement:1", Some("evt_1_12_hidden")),
        ],
        "the merge's item, then its removal"
    );
    race.assert_no_loss_and_no_error();
}

/// Rule R-MERGE ("keep what the copy holds of its subject at that generation at the same
/// sequence or a later one, or at a newer generation ... Otherwise store the item read. Then
/// remove everything held from an older generation"): an item a newer reset's reload reads just
/// as the copy holds it is kept with its position raised to the reload's generation (an
/// `Unchanged` write: nothing is sent again), so the drop of the older generation leaves it.
#[tokio::test]
async fn a_reload_that_reads_an_item_as_held_raises_it_to_the_reloads_generation() {
    let db = TestDb::new().await;
    let tenant = db.tenant().await;
    let endpoint = Uuid::new_v4();
    let mut writer = crate::stack::CopyWriter::new(&db, tenant, endpoint).await;
    let parse = |body: Value| Ok(relay_wire::Message::parse(body.to_string().as_bytes()).unwrap());
    let none = HashMap::new();
    writer
        .run(
            &db.pool,
            &[parse(body(endpoint, 1, json!([updated(1, 10)]), Some(10)))],
            &none,
        )
        .await;
    let plan = writer
        .run(&db.pool, &[parse(reset(endpoint, 2, 10))], &none)
        .await;
    let reload = plan
        .track
        .and_then(|t| t.reload)
        .expect("the reset began a reload");
    // The pass reads item 1 as the copy holds it.
    let pass = item_1_pass();
    let merged = copy::merge(&db.pool, writer.claim, &reload, &pass).await;
    assert!(
        matches!(merged, Ok(copy::Merged::Merged { .. })),
        "{merged:?}"
    );
    assert_item_1(&db, endpoint, 2, 10, Held::Item).await;
    assert_eq!(
        relay_tests::readback::list_changes(&db.pool, endpoint)
            .await
            .unwrap()
            .len(),
        1
    );
}
