//! A hostile upstream (issue 38): what a tenant's upstream answers is bounded and checked like a
//! message before anything of it reaches Postgres, and a reload that keeps failing backs off,
//! shows in the endpoint's state, and never loops hot. Each test runs the real front tier, a
//! sequencer and the control plane against an upstream the test serves, and beside the hostile
//! tenant's endpoints another tenant's endpoint, whose messages keep being applied:
//! - an endless `/v1/feed` body is read no further than the answer's cap, the test process's
//!   memory stays where it was, and the reads come a handful of times, not hundreds;
//! - pages with a control character in a subject or a sequence, or U+0000 in an item's part id
//!   (kept in `jsonb`), fail as `invalid` naming the field, the failures in a row grow, the
//!   metric counts them; once the upstream answers good pages the reload merges and the state
//!   is `ok` again;
//! - a feed that answers `has_more: true` for ever fails as `too_large` at the pass's bound;
//! - the control plane's rewind reads its answer within the cap of one object, and checks it.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use relay_netguard::OutboundPolicy;
use relay_sequencer::{Sequencer, SequencerConfig, SequencerMetrics};
use relay_store::endpoints::{self, NewEndpoint};
use relay_store::PoolOptions;
use relay_tests::{feed_body, random_secret, RedisPrefix, Signed, TestApp};
use relay_wire::{Sequence, SigningSecret};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use uuid::Uuid;

use crate::ingest_envelope::ResidentPeak;
use crate::sequencer_apply::applied_through;
use crate::stack::{copy_items, sequencer_config, start_sequencer_with, Api};

/// The access_version every page is served under, and the reset's.
const AV: &str = "av1";

/// What the upstream's `/v1/feed` answers an endpoint (told apart by its API key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feed {
    /// A page that never ends: whitespace after its first bytes, for ever.
    Endless,
    /// Three good items, one page.
    Good,
    /// A page whose second entry's subject holds U+0000.
    NulInSubject,
    /// A page whose second entry's sequence holds a line feed.
    LineFeedInSequence,
    /// A page whose second item's part id (stored in `jsonb`) holds U+0000.
    NulInPartId,
    /// Pages of 20 good items of about 1 KB, each saying `has_more: true`, for ever.
    EndlessPages,
}

/// The upstream: every endpoint's feed by its API key, and the reads it was sent.
#[derive(Clone, Default)]
struct Upstream {
    feeds: Arc<Mutex<HashMap<String, Feed>>>,
    /// `/v1/feed` reads, by API key.
    feed_reads: Arc<Mutex<HashMap<String, usize>>>,
    /// `GET /v1/webhook-endpoints/{id}` reads (one per reload pass), by API key.
    endpoint_reads: Arc<Mutex<HashMap<String, usize>>>,
}

impl Upstream {
    fn set(&self, key: &str, feed: Feed) {
        self.feeds.lock().unwrap().insert(key.to_owned(), feed);
    }

    fn feed_reads(&self, key: &str) -> usize {
        self.feed_reads
            .lock()
            .unwrap()
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    fn passes(&self, key: &str) -> usize {
        self.endpoint_reads
            .lock()
            .unwrap()
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    async fn serve(&self) -> String {
        let app = Router::new()
            .route("/v1/webhook-endpoints/{id}", get(endpoint_view))
            .route("/v1/feed", get(feed_page))
            .route(
                "/v1/webhook-endpoints/{id}/tracks/{track}/rewind",
                post(rewind_answer),
            )
            .with_state(self.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{address}")
    }
}

fn key_of(headers: &HeaderMap) -> String {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default()
        .to_owned()
}

async fn endpoint_view(
    State(up): State<Upstream>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Json<Value> {
    *up.endpoint_reads
        .lock()
        .unwrap()
        .entry(key_of(&headers))
        .or_default() += 1;
    Json(
        json!({"id": id, "lang": "en", "status": "active", "filter": null,
                "tracks": {"feed": {"generation": 1}}}),
    )
}

/// An item of about 1 KB.
fn item(n: u64) -> Value {
    json!({"type": "item", "feed_item_id": format!("announcement:{n}"),
           "item_kind": "announcement", "seq": n, "first_seq": n, "op": "new", "changes": [],
           "headline": "x".repeat(800),
           "parts": [{"part_id": format!("story:{n}"), "part_version": 1}]})
}

fn entry(n: u64) -> Value {
    json!({"subject": format!("announcement:{n}"),
           "sequence": Sequence::from_parts(1, n).as_str(), "item": item(n)})
}

fn page(entries: Vec<Value>, next: Option<u64>) -> Value {
    json!({"access_version": AV, "data": entries,
           "next_cursor": next.map(|n| n.to_string()), "has_more": next.is_some()})
}

/// Whitespace: what the endless body repeats, from static memory (the test allocates nothing
/// for it).
static SPACES: [u8; 65_536] = [b' '; 65_536];

async fn feed_page(
    State(up): State<Upstream>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let key = key_of(&headers);
    *up.feed_reads
        .lock()
        .unwrap()
        .entry(key.clone())
        .or_default() += 1;
    let feed = up.feeds.lock().unwrap().get(&key).copied();
    let good = || vec![entry(1), entry(2), entry(3)];
    let bad = |change: &dyn Fn(&mut Value)| {
        let mut entries = good();
        change(&mut entries[1]);
        Json(page(entries, None)).into_response()
    };
    match feed {
        Some(Feed::Endless) => (
            [(header::CONTENT_TYPE, "application/json")],
            endless(b"{\"access_version\": \"av1\", \"data\": ["),
        )
            .into_response(),
        Some(Feed::Good) => Json(page(good(), None)).into_response(),
        Some(Feed::NulInSubject) => bad(&|e| e["subject"] = json!("announcement:2\u{0}")),
        Some(Feed::LineFeedInSequence) => {
            bad(&|e| e["sequence"] = json!("0000000001.000000000000000\n0002"))
        }
        Some(Feed::NulInPartId) => {
            bad(&|e| e["item"]["parts"][0]["part_id"] = json!("story:\u{0}2"))
        }
        Some(Feed::EndlessPages) => {
            let n: u64 = query.get("cursor").map_or(0, |c| c.parse().unwrap());
            let entries = (0..20).map(|i| entry(n * 20 + i + 1)).collect();
            Json(page(entries, Some(n + 1))).into_response()
        }
        None => (axum::http::StatusCode::NOT_FOUND, "no such key").into_response(),
    }
}

/// A body of `start` and then whitespace for ever, from static memory.
fn endless(start: &'static [u8]) -> Body {
    let start =
        futures::stream::once(async move { Ok::<_, Infallible>(Bytes::from_static(start)) });
    let rest = futures::stream::repeat_with(|| Ok::<_, Infallible>(Bytes::from_static(&SPACES)));
    Body::from_stream(futures::StreamExt::chain(start, rest))
}

/// A rewind's answer: `202` with a body that never ends to an endpoint whose feed is endless,
/// `409` with an escape sequence as its refusal's code to any other.
async fn rewind_answer(State(up): State<Upstream>, headers: HeaderMap) -> Response {
    let feed = up.feeds.lock().unwrap().get(&key_of(&headers)).copied();
    match feed {
        Some(Feed::Endless) => (
            axum::http::StatusCode::ACCEPTED,
            [(header::CONTENT_TYPE, "application/json")],
            endless(b"{\"generation\": 5"),
        )
            .into_response(),
        _ => (
            axum::http::StatusCode::CONFLICT,
            Json(json!({"error": "cursor_ahead\u{1b}[2J"})),
        )
            .into_response(),
    }
}

/// The front tier, a sequencer with `config`, the control plane and the test's upstream.
struct Relay {
    app: TestApp,
    sequencer: Sequencer,
    api: Api,
    metrics: SequencerMetrics,
    upstream: Upstream,
    upstream_url: String,
    _prefix: RedisPrefix,
}

/// An endpoint of the test's, with its tenant and its signing secret.
struct Endpoint {
    tenant: Uuid,
    id: Uuid,
    secret: SigningSecret,
}

impl Endpoint {
    fn key(&self) -> String {
        self.id.to_string()
    }
}

impl Relay {
    async fn start(configure: impl FnOnce(&mut SequencerConfig)) -> Self {
        let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
        let app = TestApp::spawn_waking(&prefix.0).await;
        let metrics = SequencerMetrics::unregistered();
        let mut config = sequencer_config(&prefix.0, 8, OutboundPolicy::ANY);
        configure(&mut config);
        let sequencer = start_sequencer_with(&app.db.url, config, metrics.clone()).await;
        let api_pool = relay_store::connect(&app.db.url, &PoolOptions::default()).unwrap();
        let api = Api::serve(api_pool, |config| config.outbound = OutboundPolicy::ANY).await;
        let upstream = Upstream::default();
        let upstream_url = upstream.serve().await;
        Self {
            app,
            sequencer,
            api,
            metrics,
            upstream,
            upstream_url,
            _prefix: prefix,
        }
    }

    /// An endpoint of `tenant` (a new tenant when `None`) reading the test's upstream, which
    /// answers it `feed`.
    async fn endpoint(&self, tenant: Option<Uuid>, feed: Feed) -> Endpoint {
        let tenant = match tenant {
            Some(tenant) => tenant,
            None => self.app.db.tenant().await,
        };
        let (id, secret) = (Uuid::new_v4(), random_secret());
        endpoints::create(
            &self.app.db.pool,
            &relay_tests::keys(),
            &NewEndpoint {
                id,
                tenant_id: tenant,
                secret: secret.clone(),
                upstream_base_url: Some(self.upstream_url.clone()),
                upstream_api_key: Some(id.to_string().into()),
            },
        )
        .await
        .unwrap();
        self.upstream.set(&id.to_string(), feed);
        Endpoint { tenant, id, secret }
    }

    /// Another tenant's endpoint, with no upstream: it only applies messages.
    async fn bystander(&self) -> Endpoint {
        let tenant = self.app.db.tenant().await;
        let (id, secret) = (Uuid::new_v4(), random_secret());
        self.app.db.endpoint(tenant, id, &secret).await;
        Endpoint { tenant, id, secret }
    }

    async fn post(&self, endpoint: &Endpoint, body: Vec<u8>) {
        let message = Signed::new(std::slice::from_ref(&endpoint.secret), body);
        let answer = self.app.post(endpoint.id, &message).await;
        assert_eq!(answer.status(), 202, "{}", answer.text().await.unwrap());
    }

    /// A reset of generation 1 sent to `endpoint`: its copy is read from the upstream.
    async fn reset(&self, endpoint: &Endpoint) {
        let body = json!({"v": 1, "webhook_endpoint_id": endpoint.id, "track": "feed",
            "generation": 1, "access_version": AV,
            "events": [{"id": "evt_reset_1", "type": "webhook_endpoint.reset",
                        "specversion": "1.0",
                        "source": "https://api.quanor.com/v1/webhook-endpoints",
                        "data": {"access_version": AV, "generation": 1, "reason": "behind",
                                 "resume_from": "1.0", "track": "feed"}}]});
        self.post(endpoint, serde_json::to_vec(&body).unwrap())
            .await;
    }

    /// `GET /v1/endpoints/{id}/state` as its tenant.
    async fn state(&self, endpoint: &Endpoint) -> Value {
        let token = Api::tenant_token(endpoint.tenant);
        self.api
            .ok(
                200,
                "GET",
                &format!("/v1/endpoints/{}/state", endpoint.id),
                &token,
                None,
            )
            .await
    }

    /// Waits up to a minute until the endpoint's state's `upstream` object satisfies `wanted`;
    /// the state then.
    async fn wait_upstream(
        &self,
        endpoint: &Endpoint,
        what: &str,
        wanted: impl Fn(&Value) -> bool,
    ) -> Value {
        let started = Instant::now();
        loop {
            let state = self.state(endpoint).await;
            if wanted(&state["upstream"]) {
                return state;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{what}: the state after a minute: {state}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `relay_sequencer_upstream_failures_total{call="reload", kind}`.
    fn reload_failures(&self, kind: &str) -> u64 {
        self.metrics
            .upstream_failures
            .with_label_values(&["reload", kind])
            .get()
    }

    /// Sends `count` messages to the bystander (numbered from `from`) and waits until they are
    /// applied: its work goes on whatever the hostile endpoints' upstream does.
    async fn bystander_applies(&self, bystander: &Endpoint, from: u64, count: u64) {
        let before = applied_through(&self.app.db.pool, bystander.id).await;
        let sent = Instant::now();
        for n in from..from + count {
            self.post(bystander, feed_body(bystander.id, n)).await;
        }
        let want = before + count as i64;
        loop {
            let applied = applied_through(&self.app.db.pool, bystander.id).await;
            if applied >= want {
                break;
            }
            assert!(
                sent.elapsed() < Duration::from_secs(20),
                "the other tenant's messages were not applied: through {applied} of {want}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let copy = copy_items(&self.app.db.pool, bystander.id).await;
        for n in from..from + count {
            assert!(
                copy.contains_key(&format!("announcement:{n}")),
                "the other tenant's item {n} is not in its copy: {copy:?}"
            );
        }
    }

    /// A hostile endpoint answered `feed`, a bystander of another tenant, and the hostile one's
    /// reload begun, until its reads fail as too large, the error naming `bound`: the two
    /// endpoints and the hostile one's state.
    async fn too_large(&self, feed: Feed, bound: &str) -> (Endpoint, Endpoint, Value) {
        let hostile = self.endpoint(None, feed).await;
        let bystander = self.bystander().await;
        self.reset(&hostile).await;
        let state = self
            .wait_upstream(&hostile, "too_large", is_failing("too_large"))
            .await;
        let error = state["upstream"]["last_error"].as_str().unwrap();
        assert!(error.contains(bound), "the bound is named: {error}");
        (hostile, bystander, state)
    }

    async fn stop(self) {
        self.sequencer.stop().await;
        self.api.stop().await;
        self.app.stop().await;
    }
}

/// Resident memory grew by less than 300 MiB while `memory` watched.
async fn assert_grew_little(memory: ResidentPeak) {
    let grown = memory.grown().await;
    assert!(
        grown < 300 * 1024 * 1024,
        "resident memory grew by {grown} bytes"
    );
}

fn is_failing(kind: &'static str) -> impl Fn(&Value) -> bool {
    move |upstream| upstream["status"] == "failing" && upstream["last_error_kind"] == kind
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_endless_feed_body_is_read_no_further_than_the_cap_and_read_again_after_pauses() {
    relay_tests::init_logging();
    // The default cap (32 MiB): what a release build runs with.
    let relay = Relay::start(|_| {}).await;
    let memory = ResidentPeak::watch();
    let (hostile, bystander, state) = relay
        .too_large(Feed::Endless, "larger than 33554432 bytes")
        .await;
    assert!(relay.reload_failures("too_large") >= 1);

    // The reads back off: over six seconds a handful, not hundreds.
    let (reads, failures) = (
        relay.upstream.feed_reads(&hostile.key()),
        state["upstream"]["consecutive_failures"].as_i64().unwrap(),
    );
    relay.bystander_applies(&bystander, 1, 10).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let reads_after = relay.upstream.feed_reads(&hostile.key());
    assert!(
        reads_after - reads <= 8,
        "{} reads of the endless feed in six seconds",
        reads_after - reads
    );
    let state = relay.state(&hostile).await;
    assert_eq!(state["upstream"]["status"], "failing", "{state}");
    assert!(
        state["upstream"]["consecutive_failures"].as_i64().unwrap() > failures,
        "the reload keeps trying, each failure counted: {state}"
    );
    assert_eq!(state["reload_running"], true, "{state}");
    relay.bystander_applies(&bystander, 11, 10).await;

    // Each read held 32 MiB at most; the endless body, read whole, would have taken gigabytes
    // within the request's timeout.
    assert_grew_little(memory).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn answers_with_control_characters_back_off_show_why_and_merge_once_the_upstream_is_good() {
    relay_tests::init_logging();
    let relay = Relay::start(|_| {}).await;
    let tenant = relay.app.db.tenant().await;
    let cases = [
        (
            Feed::NulInSubject,
            "data[1].subject holds a control character (U+0000)",
        ),
        (
            Feed::LineFeedInSequence,
            "data[1].sequence holds a control character (U+000A)",
        ),
        (
            Feed::NulInPartId,
            "data[1].item.parts[0].part_id holds a control character (U+0000)",
        ),
    ];
    let mut hostile = Vec::new();
    for (feed, _) in cases {
        hostile.push(relay.endpoint(Some(tenant), feed).await);
    }
    let bystander = relay.bystander().await;
    for endpoint in &hostile {
        relay.reset(endpoint).await;
    }

    let mut seen = Vec::new();
    for (endpoint, (_, why)) in hostile.iter().zip(cases) {
        let state = relay
            .wait_upstream(endpoint, "invalid", is_failing("invalid"))
            .await;
        let error = state["upstream"]["last_error"].as_str().unwrap();
        assert!(error.contains(why), "{why}: {state}");
        seen.push((
            relay.upstream.feed_reads(&endpoint.key()),
            state["upstream"]["consecutive_failures"].as_i64().unwrap(),
        ));
    }
    let counted = relay.reload_failures("invalid");
    assert!(counted >= 3, "{counted}");

    // Meanwhile another tenant's messages are applied, and the hostile reloads do not loop.
    relay.bystander_applies(&bystander, 1, 10).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    for (endpoint, (reads, failures)) in hostile.iter().zip(&seen) {
        let reads_after = relay.upstream.feed_reads(&endpoint.key());
        assert!(
            reads_after - reads <= 8,
            "{} reads of a refused feed in about six seconds",
            reads_after - reads
        );
        let state = relay.state(endpoint).await;
        let upstream = &state["upstream"];
        assert_eq!(upstream["status"], "failing", "{state}");
        assert!(
            upstream["consecutive_failures"].as_i64().unwrap() > *failures,
            "the failures in a row grow: {state}"
        );
        // Nothing of the refused pages reached the copy.
        assert!(copy_items(&relay.app.db.pool, endpoint.id).await.is_empty());
    }
    assert!(relay.reload_failures("invalid") > counted);
    assert_eq!(
        relay.reload_failures("store"),
        0,
        "nothing reached Postgres"
    );

    // The upstream answers well again: each reload merges, and its state is ok.
    for endpoint in &hostile {
        relay.upstream.set(&endpoint.key(), Feed::Good);
    }
    for endpoint in &hostile {
        let state = relay
            .wait_upstream(endpoint, "ok again", |u| {
                u["status"] == "ok" && u["consecutive_failures"] == 0
            })
            .await;
        assert_eq!(state["upstream"]["last_error_kind"], "invalid", "{state}");
        let started = Instant::now();
        loop {
            let state = relay.state(endpoint).await;
            let copy = copy_items(&relay.app.db.pool, endpoint.id).await;
            if state["reload_running"] == false && copy.len() == 3 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the good pages were not merged: {state}, {copy:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    relay.bystander_applies(&bystander, 11, 5).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_feed_that_always_has_more_fails_at_the_passs_bound() {
    relay_tests::init_logging();
    const PASS_BOUND: u64 = 2 * 1024 * 1024;
    let relay = Relay::start(|config| config.max_reload_bytes = PASS_BOUND).await;
    let memory = ResidentPeak::watch();
    let (hostile, bystander, _) = relay
        .too_large(Feed::EndlessPages, "RELAY_SEQUENCER_MAX_RELOAD_BYTES")
        .await;
    let (passes, pages) = (
        relay.upstream.passes(&hostile.key()),
        relay.upstream.feed_reads(&hostile.key()),
    );
    // Each page is 20 items of about 1 KB: a pass stops within its bound's worth of pages.
    assert!(pages > 0 && passes > 0);
    let most_pages = (PASS_BOUND / (20 * 1024)) as usize + 1;
    assert!(
        pages <= passes * most_pages,
        "{pages} pages in {passes} passes"
    );

    relay.bystander_applies(&bystander, 1, 10).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let passes_after = relay.upstream.passes(&hostile.key());
    assert!(
        passes_after - passes <= 8,
        "{} passes of the endless feed in about six seconds",
        passes_after - passes
    );
    assert!(relay.reload_failures("too_large") >= 2);
    assert!(copy_items(&relay.app.db.pool, hostile.id).await.is_empty());
    assert_grew_little(memory).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rewinds_answer_is_read_within_the_cap_of_one_object_and_checked() {
    relay_tests::init_logging();
    let relay = Relay::start(|_| {}).await;
    let endless = relay.endpoint(None, Feed::Endless).await;
    let escaped = relay.endpoint(None, Feed::Good).await;
    for (endpoint, kind) in [(&endless, "too_large"), (&escaped, "invalid")] {
        // The backup kept the track through 1.990: a rewind asks the upstream to resend.
        sqlx::query(
            "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id, generation,
                                          access_version, through)
             VALUES ($1, 'feed', $2, 3, 'av1', '1.990')",
        )
        .bind(endpoint.id)
        .bind(endpoint.tenant)
        .execute(&relay.app.db.pool)
        .await
        .unwrap();
        let token = Api::tenant_token(endpoint.tenant);
        let answer = relay
            .api
            .call(
                "POST",
                &format!("/v1/endpoints/{}/tracks/feed/rewind", endpoint.id),
                Some(&token),
                None,
            )
            .await;
        assert_eq!(answer.status, 502, "{}", answer.text);
        assert_eq!(answer.json["error"], "upstream_failed", "{}", answer.text);
        let detail = answer.json["detail"].as_str().unwrap();
        assert!(detail.starts_with(&format!("{kind}: ")), "{detail}");
        // Nothing of the answer was taken: no reload begun.
        let reload: Option<String> =
            sqlx::query_scalar("SELECT reload::text FROM endpoint_tracks WHERE endpoint_id = $1")
                .bind(endpoint.id)
                .fetch_one(&relay.app.db.pool)
                .await
                .unwrap();
        assert_eq!(reload, None);
    }
    relay.stop().await;
}
