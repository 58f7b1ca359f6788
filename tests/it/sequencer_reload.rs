//! A reload against an upstream whose timing the test holds: what the sequencer's reload and
//! refetch code does when a change is made after a reload read its pages and before it merged.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use relay_netguard::RetryPolicy;
use relay_sequencer::apply::{apply_messages, EndpointContext};
use relay_sequencer::reload::{run_reload, ReloadEnd};
use relay_sequencer::state::{self, FEED_TRACK};
use relay_sequencer::SequencerMetrics;
use relay_store::copy;
use relay_tests::TestDb;
use relay_wire::Sequence;
use serde_json::{json, Value};
use tokio::sync::{Notify, Semaphore};
use uuid::Uuid;

use crate::sequencer_apply::{pending, setup_with_upstream, store, Setup};

/// The access_version the upstream serves, and the one `setup_with_upstream` holds the track
/// under.
const AV: &str = "av1";

fn item(n: u64, seq: u64) -> Value {
    json!({"type": "item", "feed_item_id": format!("announcement:{n}"),
           "item_kind": "announcement", "seq": seq, "first_seq": seq, "op": "new",
           "changes": [], "parts": [{"part_id": format!("story:{n}"), "part_version": seq}]})
}

/// An upstream of one endpoint: its feed is `items`; an item read always fails as a load
/// balancer's 404 would; a feed read can be held after it took its snapshot.
#[derive(Clone)]
struct HeldUpstream {
    endpoint: Uuid,
    items: Arc<Mutex<Vec<(u64, u64)>>>,
    hold_next_page: Arc<AtomicBool>,
    page_read: Arc<Notify>,
    release: Arc<Semaphore>,
}

async fn endpoint_view(State(up): State<HeldUpstream>) -> Json<Value> {
    Json(
        json!({"id": up.endpoint, "lang": "en", "status": "active", "filter": null,
                "tracks": {"feed": {"generation": 2}}}),
    )
}

async fn feed_page(State(up): State<HeldUpstream>) -> Json<Value> {
    let data: Vec<Value> = up
        .items
        .lock()
        .unwrap()
        .iter()
        .map(|&(n, seq)| {
            json!({"subject": format!("announcement:{n}"),
                   "sequence": Sequence::from_parts(1, seq).as_str(), "item": item(n, seq)})
        })
        .collect();
    if up.hold_next_page.swap(false, Ordering::SeqCst) {
        up.page_read.notify_one();
        up.release.acquire().await.unwrap().forget();
    }
    Json(json!({"access_version": AV, "data": data, "next_cursor": null, "has_more": false}))
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
    store(db, ctx.tenant(), ctx.id(), std::slice::from_ref(message)).await;
    let (applied, messages) = pending(db, ctx.id()).await;
    apply_messages(&db.pool, ctx, token, applied, &messages, metrics)
        .await
        .unwrap();
}

/// Rule "a 404 that carries none (a load balancer's) is a read that failed: try it again a few
/// times, then read /v1/feed again": when a reload is already running, its pages may have been
/// read before the item the refetch names was created. Merging them would leave that item out
/// for good (the refetch's event id is applied, so nothing brings it back); the reload must
/// read again.
#[tokio::test]
async fn a_refetch_that_reads_the_feed_again_restarts_a_reload_whose_pages_are_older() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base_url = format!("http://{}", listener.local_addr().unwrap());
    let Setup {
        db, endpoint, ctx, ..
    } = setup_with_upstream(Some(base_url)).await;

    let upstream = HeldUpstream {
        endpoint,
        items: Arc::new(Mutex::new(vec![(1, 10)])),
        hold_next_page: Arc::new(AtomicBool::new(true)),
        page_read: Arc::new(Notify::new()),
        release: Arc::new(Semaphore::new(0)),
    };
    let app = Router::new()
        .route("/v1/webhook-endpoints/{id}", get(endpoint_view))
        .route("/v1/feed", get(feed_page))
        .route("/v1/feed/items/{id}", get(item_read))
        .with_state(upstream.clone());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let metrics = SequencerMetrics::unregistered();
    let token = db.claim_fence(endpoint).await;
    let backoff = RetryPolicy {
        first: Duration::from_millis(10),
        max: Duration::from_millis(50),
    };

    // A reset begins a reload; it reads its one page (item 1 only) and is held there.
    store_and_apply(&db, &ctx, token, &reset(endpoint, 2, 10), &metrics).await;
    let first = state::peek_track(&db.pool, endpoint, FEED_TRACK)
        .await
        .unwrap()
        .reload
        .expect("the reset began a reload");
    let reading = {
        let (pool, ctx, metrics, first) =
            (db.pool.clone(), ctx.clone(), metrics.clone(), first.clone());
        tokio::spawn(async move { run_reload(&pool, &ctx, token, &first, backoff, &metrics).await })
    };
    upstream.page_read.notified().await;

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

    // The held pass may not merge: the reload it belongs to was begun again.
    upstream.release.add_permits(1);
    let end = reading.await.unwrap().unwrap();
    assert_eq!(end, ReloadEnd::Superseded);
    let again = state::peek_track(&db.pool, endpoint, FEED_TRACK)
        .await
        .unwrap()
        .reload
        .expect("a reload reads the feed again");
    assert_eq!(
        (again.generation, &again.access_version, again.read_again),
        (first.generation, &first.access_version, 1)
    );

    // Its read sees item 2, and the merge keeps it.
    let end = run_reload(&db.pool, &ctx, token, &again, backoff, &metrics)
        .await
        .unwrap();
    assert!(matches!(end, ReloadEnd::Merged { .. }), "{end:?}");
    let rows = copy::copy_rows(&db.pool, endpoint).await.unwrap();
    let held: Vec<&String> = rows
        .iter()
        .filter(|(_, row)| !row.is_tombstone())
        .map(|(subject, _)| subject)
        .collect();
    assert_eq!(held, ["announcement:1", "announcement:2"], "{rows:?}");
    server.abort();
}
