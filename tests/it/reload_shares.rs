//! One tenant's failing reloads never hold another tenant's (issue 54). Against the real front
//! tier, sequencer and control plane, with the process's default reload slots (two, each tenant
//! at most half of them) and an upstream the test serves:
//! - tenant B's reset is read and merged, alone, and the time it took is measured;
//! - tenant A then has many more endpoints in failing reloads than the process has slots:
//!   upstreams that answer a byte a second (each read held until its timeout), pages that never
//!   end, pages with U+0000 in a subject, a sequence or an access_version, and an endpoint view
//!   with one, mixed by a seeded draw;
//! - A's endpoints wait for A's share of the slots, and their state and the metrics say so;
//! - another of B's endpoints is reset: its reload merges within a few seconds of B's time
//!   alone;
//!
//! and the same for stories endpoints' syncs (their reads slow, endless or refused).
//!
//! Seeded: every run prints its seed; `RELAY_TEST_SEED=<seed>` replays one.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_netguard::OutboundPolicy;
use relay_rules::StoriesMode;
use relay_sequencer::{Sequencer, SequencerMetrics};
use relay_store::endpoints::{self, Registration, Source, StoriesSettings};
use relay_store::{EndpointId, PoolOptions, TenantId};
use relay_tests::{printed_seed, random_secret, RedisPrefix, Signed, TestApp};
use relay_wire::{Sequence, SigningSecret};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use uuid::Uuid;

use crate::stack::{copy_items, sequencer_config, start_sequencer_with, Api};

/// The access_version every good page is served under, and the resets'.
const AV: &str = "av1";

/// A's endpoints in failing reloads: many times the process's two reload slots.
const HOSTILE_ENDPOINTS: usize = 24;

/// How much longer than alone B's reload may take beside A's: a few seconds, far below a
/// read's timeout held for each of A's slow endpoints in turn (5 s each, 24 of them).
const SLACK: Duration = Duration::from_secs(4);

/// What the test's upstream answers an endpoint, told apart by its API key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answers {
    /// Feed: three items, one page. Stories: one story for each ticker, no events.
    Good,
    /// Every answer a byte a second, for ever.
    Slow,
    /// A `/v1/feed` page (or a stories listing) that never ends.
    Endless,
    /// A feed page whose second entry's subject holds U+0000.
    NulInSubject,
    /// A feed page whose second entry's sequence holds U+0000.
    NulInSequence,
    /// A feed page whose access_version holds U+0000.
    NulInAccessVersion,
    /// An endpoint view whose language holds U+0000.
    NulInView,
    /// A stories listing whose story's headline holds U+0000.
    NulInStory,
}

/// The hostile answers a feed endpoint of A's may get.
const HOSTILE_FEEDS: [Answers; 6] = [
    Answers::Slow,
    Answers::Endless,
    Answers::NulInSubject,
    Answers::NulInSequence,
    Answers::NulInAccessVersion,
    Answers::NulInView,
];

/// The hostile answers a stories endpoint of A's may get.
const HOSTILE_STORIES: [Answers; 3] = [Answers::Slow, Answers::Endless, Answers::NulInStory];

/// `n` hostile answers: each of `kinds` once, then a seeded draw, half of them slow (the slow
/// ones hold a slot longest).
fn hostile_mix(rng: &mut ChaCha8Rng, kinds: &[Answers], n: usize) -> Vec<Answers> {
    let mut mix: Vec<Answers> = kinds.to_vec();
    while mix.len() < n {
        mix.push(if rng.gen_bool(0.5) {
            Answers::Slow
        } else {
            kinds[rng.gen_range(0..kinds.len())]
        });
    }
    mix
}

/// The upstream: every endpoint's answers by its API key.
#[derive(Clone, Default)]
struct Upstream {
    answers: Arc<Mutex<HashMap<String, Answers>>>,
}

impl Upstream {
    fn set(&self, key: &str, answers: Answers) {
        self.answers.lock().unwrap().insert(key.to_owned(), answers);
    }

    fn of(&self, headers: &HeaderMap) -> Option<Answers> {
        let key = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        self.answers.lock().unwrap().get(key).copied()
    }

    async fn serve(&self) -> String {
        let app = Router::new()
            .route("/v1/webhook-endpoints/{id}", get(endpoint_view))
            .route("/v1/feed", get(feed_page))
            .route("/v1/stories", get(stories_page))
            .route("/v1/stories/{id}", get(story))
            .route("/v1/events", get(events_page))
            .with_state(self.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{address}")
    }
}

/// A body of `{` and then a space a second, for ever.
fn trickle() -> Response {
    let bytes = futures::stream::unfold(true, |first| async move {
        if !first {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let byte: &'static [u8] = if first { b"{" } else { b" " };
        Some((Ok::<_, Infallible>(Bytes::from_static(byte)), false))
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(bytes),
    )
        .into_response()
}

/// Whitespace: what an endless body repeats, from static memory.
static SPACES: [u8; 65_536] = [b' '; 65_536];

/// A body of `start` and then whitespace for ever.
fn endless(start: &'static [u8]) -> Response {
    let start =
        futures::stream::once(async move { Ok::<_, Infallible>(Bytes::from_static(start)) });
    let rest = futures::stream::repeat_with(|| Ok::<_, Infallible>(Bytes::from_static(&SPACES)));
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(futures::StreamExt::chain(start, rest)),
    )
        .into_response()
}

async fn endpoint_view(
    State(up): State<Upstream>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let lang = match up.of(&headers) {
        Some(Answers::Slow) => return trickle(),
        Some(Answers::NulInView) => "e\u{0}n",
        _ => "en",
    };
    Json(
        json!({"id": id, "lang": lang, "status": "active", "filter": null,
                "tracks": {"feed": {"generation": 1}}}),
    )
    .into_response()
}

fn entry(n: u64) -> Value {
    json!({"subject": format!("announcement:{n}"),
           "sequence": Sequence::from_parts(1, n).as_str(),
           "item": {"type": "item", "feed_item_id": format!("announcement:{n}"),
                    "item_kind": "announcement", "seq": n, "first_seq": n, "op": "new",
                    "changes": [], "headline": "h",
                    "parts": [{"part_id": format!("story:{n}"), "part_version": 1}]}})
}

async fn feed_page(State(up): State<Upstream>, headers: HeaderMap) -> Response {
    let mut entries = vec![entry(1), entry(2), entry(3)];
    let mut access_version = AV.to_owned();
    match up.of(&headers) {
        Some(Answers::Slow) => return trickle(),
        Some(Answers::Endless) => return endless(b"{\"access_version\": \"av1\", \"data\": ["),
        // A view the checks would let through still leads to a page they refuse.
        Some(Answers::NulInSubject | Answers::NulInView) => {
            entries[1]["subject"] = json!("announcement:2\u{0}")
        }
        Some(Answers::NulInSequence) => {
            entries[1]["sequence"] = json!("0000000001.000000000000000\u{0}002")
        }
        Some(Answers::NulInAccessVersion) => access_version = "av\u{0}1".to_owned(),
        Some(_) => {}
        None => return (StatusCode::NOT_FOUND, "no such key").into_response(),
    }
    Json(json!({"access_version": access_version, "data": entries,
                "next_cursor": null, "has_more": false}))
    .into_response()
}

async fn stories_page(
    State(up): State<Upstream>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let ticker = query.get("ticker").cloned().unwrap_or_default();
    let headline = match up.of(&headers) {
        Some(Answers::Slow) => return trickle(),
        Some(Answers::Endless) => return endless(b"{\"data\": ["),
        Some(Answers::NulInStory) => "h\u{0}",
        Some(_) => "h",
        None => return (StatusCode::NOT_FOUND, "no such key").into_response(),
    };
    let story = json!({"id": format!("st_{ticker}"), "ticker": ticker, "version": 1,
                       "headline": headline, "articles": []});
    Json(json!({"data": [story], "next_cursor": null, "has_more": false})).into_response()
}

async fn story(State(up): State<Upstream>, headers: HeaderMap) -> Response {
    match up.of(&headers) {
        Some(Answers::Slow) => trickle(),
        _ => (StatusCode::NOT_FOUND, Json(json!({"error": "not_found"}))).into_response(),
    }
}

async fn events_page(State(up): State<Upstream>, headers: HeaderMap) -> Response {
    match up.of(&headers) {
        Some(Answers::Slow) => trickle(),
        Some(Answers::Endless) => endless(b"{\"data\": ["),
        _ => Json(json!({"data": [], "next_cursor": null, "has_more": false})).into_response(),
    }
}

/// An endpoint of the test's, with its tenant and its signing secret.
struct Endpoint {
    tenant: Uuid,
    id: Uuid,
    secret: SigningSecret,
}

/// The front tier, a sequencer with the default reload slots, the control plane and the
/// test's upstream.
struct Relay {
    app: TestApp,
    sequencer: Sequencer,
    api: Api,
    metrics: SequencerMetrics,
    upstream: Upstream,
    upstream_url: String,
    seed: u64,
    _prefix: RedisPrefix,
}

impl Relay {
    async fn start(seed: u64) -> Self {
        let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
        let app = TestApp::spawn_waking(&prefix.0).await;
        let metrics = SequencerMetrics::unregistered();
        // More worker slots than the test's endpoints: what is measured is the reload slots.
        let config = sequencer_config(&prefix.0, 64, OutboundPolicy::ANY);
        assert_eq!(config.max_concurrent_reloads, 2, "the default slots");
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
            seed,
            _prefix: prefix,
        }
    }

    /// An endpoint of `tenant` with `source`, reading the test's upstream, which answers it
    /// `answers`.
    async fn endpoint(&self, tenant: Uuid, source: Source, answers: Answers) -> Endpoint {
        let (id, secret) = (Uuid::new_v4(), random_secret());
        let feed = matches!(source, Source::Feed);
        endpoints::register(
            &self.app.db.pool,
            &relay_tests::keys(),
            TenantId(tenant),
            &Registration {
                id: EndpointId(id),
                name: None,
                source,
                lang: feed.then(|| "en".to_owned()),
                upstream_base_url: Some(self.upstream_url.clone()),
                upstream_api_key: Some(id.to_string().into()),
                secrets: vec![secret.clone()],
            },
        )
        .await
        .unwrap();
        self.upstream.set(&id.to_string(), answers);
        Endpoint { tenant, id, secret }
    }

    async fn feed(&self, tenant: Uuid, answers: Answers) -> Endpoint {
        self.endpoint(tenant, Source::Feed, answers).await
    }

    async fn stories(&self, tenant: Uuid, answers: Answers) -> Endpoint {
        let settings = StoriesSettings {
            mode: StoriesMode::Snapshot,
            tickers: vec!["ALFA".to_owned()],
        };
        self.endpoint(tenant, Source::Stories(settings), answers)
            .await
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
        let message = Signed::new(
            std::slice::from_ref(&endpoint.secret),
            serde_json::to_vec(&body).unwrap(),
        );
        let answer = self.app.post(endpoint.id, &message).await;
        assert_eq!(answer.status(), 202, "{}", answer.text().await.unwrap());
    }

    /// How long `done` took to hold, checked every 20 ms, at most two minutes.
    async fn time_until<F, Fut>(&self, what: &str, started: Instant, done: F) -> Duration
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        loop {
            if done().await {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "seed {}: {what} did not happen within two minutes",
                self.seed
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Resets a new feed endpoint of `tenant` and times its reload until it is merged.
    async fn feed_reset_merged_in(&self, tenant: Uuid) -> Duration {
        let endpoint = self.feed(tenant, Answers::Good).await;
        let started = Instant::now();
        self.reset(&endpoint).await;
        let (pool, id) = (&self.app.db.pool, endpoint.id);
        self.time_until("B's reload merged", started, || async move {
            copy_items(pool, id).await.len() == 3
        })
        .await
    }

    /// Registers a new stories endpoint of `tenant` and times its first sync until it caught
    /// up, its ticker's story saved.
    async fn stories_synced_in(&self, tenant: Uuid) -> Duration {
        let started = Instant::now();
        let endpoint = self.stories(tenant, Answers::Good).await;
        let (pool, id) = (&self.app.db.pool, endpoint.id);
        self.time_until("B's stories sync", started, || async move {
            let caught_up: Option<bool> = sqlx::query_scalar(
                "SELECT caught_up_at IS NOT NULL FROM stories_sync WHERE endpoint_id = $1",
            )
            .bind(id)
            .fetch_optional(pool)
            .await
            .unwrap();
            let saved: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM stories WHERE endpoint_id = $1 AND id = 'st_ALFA'",
            )
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
            caught_up == Some(true) && saved == 1
        })
        .await
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

    fn failures(&self, call: &str, kind: &str) -> u64 {
        self.metrics
            .upstream_failures
            .with_label_values(&[call, kind])
            .get()
    }

    /// Waits until `call`'s failures of each of `kinds` were counted (A's endpoints wait for
    /// its one slot in turn, each slow one holding it to its read's timeout, so this may take
    /// a while).
    async fn wait_failures(&self, call: &str, kinds: &[&str]) {
        let started = Instant::now();
        self.time_until(
            &format!("A's {call} failures {kinds:?}"),
            started,
            || async move { kinds.iter().all(|kind| self.failures(call, kind) > 0) },
        )
        .await;
    }

    /// Waits until one of `hostile`'s endpoints says, in its state, that its reload waits for
    /// a slot, and since when; checks the metrics say so too.
    async fn wait_one_waits(&self, hostile: &[Endpoint]) {
        let started = Instant::now();
        loop {
            for endpoint in hostile {
                let state = self.state(endpoint).await;
                if let Some(since) = state["reload_waiting_since"].as_str() {
                    assert!(
                        state["reload_wait_s"].as_f64().unwrap() >= 0.0,
                        "seed {}: {state}",
                        self.seed
                    );
                    assert!(!since.is_empty());
                    assert!(
                        self.metrics.reload_slot_waiting.get() > 0
                            || self.metrics.reload_slot_wait.get_sample_count() > 0,
                        "seed {}: the metrics say nothing of the waits",
                        self.seed
                    );
                    return;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "seed {}: no endpoint of A's said its reload waits for a slot",
                self.seed
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn stop(self) {
        self.sequencer.stop().await;
        self.api.stop().await;
        self.app.stop().await;
    }
}

/// B's time beside A's is at most [`SLACK`] more than alone.
fn assert_within_slack(seed: u64, what: &str, alone: Duration, beside: Duration) {
    eprintln!("{what}: B alone {alone:?}, B beside A's failing endpoints {beside:?}");
    assert!(
        beside <= alone + SLACK,
        "seed {seed}: {what} took {beside:?} beside A's failing endpoints, {alone:?} alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenants_failing_reloads_never_hold_another_tenants_reload() {
    relay_tests::init_logging();
    let seed = printed_seed("reload shares, feed");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let relay = Relay::start(seed).await;
    let (a, b) = (relay.app.db.tenant().await, relay.app.db.tenant().await);

    let alone = relay.feed_reset_merged_in(b).await;

    let mut hostile = Vec::new();
    for answers in hostile_mix(&mut rng, &HOSTILE_FEEDS, HOSTILE_ENDPOINTS) {
        let endpoint = relay.feed(a, answers).await;
        relay.reset(&endpoint).await;
        hostile.push(endpoint);
    }
    // A slow upstream holds A's slot to its timeout, and A's other endpoints wait for it.
    relay.wait_failures("reload", &["timeout"]).await;
    relay.wait_one_waits(&hostile).await;

    let beside = relay.feed_reset_merged_in(b).await;
    assert_within_slack(seed, "a reset's reload", alone, beside);
    // Every kind of A's answers was read and refused meanwhile or since.
    relay
        .wait_failures("reload", &["timeout", "too_large", "invalid"])
        .await;
    // A's reloads were still failing all along: none of its endpoints got a copy.
    for endpoint in &hostile {
        assert!(copy_items(&relay.app.db.pool, endpoint.id).await.is_empty());
    }
    relay.stop().await;
}

/// Two tenants, A and C, whose upstreams hang (each read held to its timeout) would hold both
/// of the process's reload slots, one each within their shares: in the failing lane they share
/// one, and B's reset still merges about as soon as alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_tenants_failing_reloads_never_hold_a_third_tenants_reload() {
    relay_tests::init_logging();
    let seed = printed_seed("reload shares, two hostile tenants");
    let relay = Relay::start(seed).await;
    let (a, b, c) = (
        relay.app.db.tenant().await,
        relay.app.db.tenant().await,
        relay.app.db.tenant().await,
    );

    let alone = relay.feed_reset_merged_in(b).await;

    let mut hostile = Vec::new();
    for tenant in [a, c] {
        for _ in 0..HOSTILE_ENDPOINTS / 2 {
            let endpoint = relay.feed(tenant, Answers::Slow).await;
            relay.reset(&endpoint).await;
            hostile.push(endpoint);
        }
    }
    // Both have had a read held to its timeout, and their other endpoints wait.
    let relay_ref = &relay;
    relay
        .time_until(
            "A's and C's first timeouts",
            Instant::now(),
            || async move { relay_ref.failures("reload", "timeout") >= 2 },
        )
        .await;
    relay.wait_one_waits(&hostile).await;

    let beside = relay.feed_reset_merged_in(b).await;
    assert_within_slack(seed, "a reset's reload beside two tenants'", alone, beside);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenants_failing_stories_syncs_never_hold_another_tenants_sync() {
    relay_tests::init_logging();
    let seed = printed_seed("reload shares, stories");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let relay = Relay::start(seed).await;
    let (a, b) = (relay.app.db.tenant().await, relay.app.db.tenant().await);

    let alone = relay.stories_synced_in(b).await;

    let mut hostile = Vec::new();
    for answers in hostile_mix(&mut rng, &HOSTILE_STORIES, HOSTILE_ENDPOINTS) {
        hostile.push(relay.stories(a, answers).await);
    }
    relay.wait_failures("stories", &["timeout"]).await;
    relay.wait_one_waits(&hostile).await;

    let beside = relay.stories_synced_in(b).await;
    assert_within_slack(seed, "a stories sync", alone, beside);
    relay
        .wait_failures("stories", &["timeout", "too_large", "invalid"])
        .await;
    relay.stop().await;
}
