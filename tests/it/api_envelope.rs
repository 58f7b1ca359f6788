//! A tenant's share of the control plane (issue 38): a tenant's own calls, however slow its
//! upstream, hold no more than its bounds, so another tenant's reads are answered; endpoints per
//! tenant are bounded by a quota the operator sets, which holds under concurrent creates; and a
//! previous JWT key verifies only tokens issued before the rotation began, until its overlap
//! ends.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use relay_api::{mint, ApiConfig, EnvelopeLimits, JwtKeys, Rotation, Subject};
use relay_netguard::OutboundPolicy;
use relay_store::quotas::QuotaDefaults;
use relay_tests::{random_secret, TestDb};
use serde_json::{json, Value};
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use uuid::Uuid;

use crate::api::keep_track;
use crate::stack::{assert_refused_field, call_api, Api, KEY};

const OLD_KEY: &[u8] = b"the-control-planes-signing-key-of-before";

/// The control plane on 127.0.0.1, port 0, against a database of its own, with `configure`'s
/// settings; calls go through its [`Api`].
struct App {
    db: TestDb,
    api: Api,
}

impl std::ops::Deref for App {
    type Target = Api;

    fn deref(&self) -> &Api {
        &self.api
    }
}

impl App {
    async fn spawn(configure: impl FnOnce(&mut ApiConfig)) -> Self {
        let db = TestDb::new().await;
        let mut api = Api::serve(db.pool.clone(), |config| {
            // The tests' upstreams are on 127.0.0.1.
            config.outbound = OutboundPolicy::ANY;
            configure(config);
        })
        .await;
        api.client = client();
        Self { db, api }
    }

    /// An endpoint of `tenant` (whose token is `token`) reading `upstream`, with the track the
    /// sequencer keeps, so that a rewind asks the upstream: the URL of its rewind.
    async fn rewindable(&self, tenant: Uuid, token: &str, upstream: &str) -> String {
        let body = Self::new_endpoint(Some(upstream));
        let created = self
            .ok(201, "POST", "/v1/endpoints", token, Some(&body))
            .await;
        let endpoint: Uuid = created["id"].as_str().unwrap().parse().unwrap();
        keep_track(&self.db, tenant, endpoint, "1.990", false).await;
        format!(
            "{}/v1/endpoints/{endpoint}/tracks/feed/rewind",
            self.base_url
        )
    }

    /// The body of a new feed endpoint, pointing at `upstream` when given.
    fn new_endpoint(upstream: Option<&str>) -> Value {
        let mut body = json!({"id": Uuid::new_v4(), "lang": "en",
                              "secrets": [random_secret().to_whsec()]});
        if let Some(base_url) = upstream {
            body["upstream_base_url"] = json!(base_url);
            body["upstream_api_key"] = json!("qk_slow");
        }
        body
    }

    async fn stop(self) {
        self.api.stop().await;
        self.db.pool.close().await;
    }
}

/// The bounds of the tests: `requests` per tenant in flight, `rewinds` per tenant and
/// `all_rewinds` over every tenant, each rewind ending by [`REWIND_DEADLINE`].
fn envelope(requests: u32, rewinds: u32, all_rewinds: u32) -> EnvelopeLimits {
    EnvelopeLimits {
        max_requests_per_tenant: requests,
        max_rewinds_per_tenant: rewinds,
        max_rewinds: all_rewinds,
        rewind_timeout: REWIND_DEADLINE,
    }
}

/// A client that opens a connection of its own per request, as many tools do.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

/// A token of `subject` signed with `key`, issued at `iat`, living until an hour from now.
fn token(key: &[u8], subject: Subject, iat: OffsetDateTime) -> String {
    let ttl = (OffsetDateTime::now_utc() + Duration::from_secs(3600) - iat).unsigned_abs();
    mint(&JwtKeys::new(key).unwrap(), "relay", &subject, ttl, iat)
        .unwrap()
        .token
}

fn operator() -> String {
    token(
        KEY,
        Subject::Operator {
            name: "test".into(),
        },
        OffsetDateTime::now_utc(),
    )
}

/// One answer with its Retry-After header and how long it took.
struct Timed {
    status: u16,
    json: Value,
    retry_after: Option<u64>,
    took: Duration,
}

async fn timed(
    client: &reqwest::Client,
    url: String,
    method: reqwest::Method,
    token: &str,
) -> Timed {
    let started = Instant::now();
    let response = match client.request(method, url).bearer_auth(token).send().await {
        Ok(response) => response,
        // No answer at all (a connection refused or reset): status 0, the error as the body.
        Err(error) => {
            return Timed {
                status: 0,
                json: json!(error.to_string()),
                retry_after: None,
                took: started.elapsed(),
            }
        }
    };
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    let json = response.json().await.unwrap_or(Value::Null);
    Timed {
        status,
        json,
        retry_after,
        took: started.elapsed(),
    }
}

/// An upstream whose rewind answers after `delay` (longer than any deadline here): counts the
/// rewinds it is asked for, and the most it held at once.
#[derive(Clone, Default)]
struct SlowUpstream {
    asked: Arc<AtomicUsize>,
    holding: Arc<AtomicUsize>,
    most_held: Arc<AtomicUsize>,
}

/// Gives back a held rewind when its request ends, answered or dropped by the relay.
struct Held(Arc<AtomicUsize>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl SlowUpstream {
    async fn start(delay: Duration) -> (Self, String) {
        let upstream = Self::default();
        let state = upstream.clone();
        let app = Router::new().route(
            "/v1/webhook-endpoints/{endpoint}/tracks/{track}/rewind",
            post(move || {
                let state = state.clone();
                async move {
                    state.asked.fetch_add(1, Ordering::SeqCst);
                    let now = state.holding.fetch_add(1, Ordering::SeqCst) + 1;
                    state.most_held.fetch_max(now, Ordering::SeqCst);
                    let _held = Held(state.holding.clone());
                    tokio::time::sleep(delay).await;
                    (StatusCode::ACCEPTED, Json(json!({"generation": 2})))
                }
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (upstream, format!("http://{address}"))
    }

    fn asked(&self) -> usize {
        self.asked.load(Ordering::SeqCst)
    }
}

const REWIND_DEADLINE: Duration = Duration::from_secs(2);
/// What a timely answer may take beyond its deadline on a loaded test machine.
const SLACK: Duration = Duration::from_millis(1500);

#[tokio::test]
async fn a_tenants_rewinds_against_its_slow_upstream_leave_another_tenants_reads_answered() {
    let (upstream, upstream_url) = SlowUpstream::start(Duration::from_secs(60)).await;
    let app = App::spawn(|config| {
        config.envelope = envelope(32, 2, 16);
        // The HTTP client's own timeout is longer: the rewind's deadline is what ends it.
        config.upstream_timeout = Duration::from_secs(30);
        // Few enough that A's waves of rewinds would hold every connection if they were let
        // through to the upstream, as they were before the bound.
        config.listener.max_connections = 32;
    })
    .await;
    let (tenant_a, token_a) = app.tenant("A, hostile").await;
    let (_tenant_b, token_b) = app.tenant("B, good").await;
    let rewind_url = app.rewindable(tenant_a, &token_a, &upstream_url).await;
    let endpoint_b = app
        .ok(
            201,
            "POST",
            "/v1/endpoints",
            &token_b,
            Some(&App::new_endpoint(None)),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();

    // A: three waves of 24 rewinds at once, 300 ms apart, each on a connection of its own.
    let mut rewinds = Vec::new();
    for wave in 0..3u64 {
        for _ in 0..24 {
            let (url, token) = (rewind_url.clone(), token_a.clone());
            rewinds.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300 * wave)).await;
                timed(&client(), url, reqwest::Method::POST, &token).await
            }));
        }
    }
    // B, meanwhile: 23 reads, one after the other, while A's rewinds wait on its upstream.
    let reads = [
        "/v1/tenant".to_owned(),
        "/v1/endpoints".to_owned(),
        format!("/v1/endpoints/{endpoint_b}"),
        format!("/v1/endpoints/{endpoint_b}/state"),
    ];
    let b_client = client();
    let mut b_answers = Vec::new();
    for i in 0..23 {
        tokio::time::sleep(Duration::from_millis(60)).await;
        let url = format!("{}{}", app.base_url, reads[i % reads.len()]);
        b_answers.push(timed(&b_client, url, reqwest::Method::GET, &token_b).await);
    }
    let mut a_answers = Vec::new();
    for rewind in rewinds {
        a_answers.push(rewind.await.unwrap());
    }

    for (i, answer) in b_answers.iter().enumerate() {
        assert_eq!(answer.status, 200, "B's read {i}: {}", answer.json);
    }
    let (refused, let_in): (Vec<&Timed>, Vec<&Timed>) =
        a_answers.iter().partition(|a| a.status == 429);
    assert!(
        upstream.most_held.load(Ordering::SeqCst) <= 2,
        "at most A's 2 rewinds wait on its upstream at once"
    );
    assert_eq!(
        let_in.len(),
        upstream.asked(),
        "every rewind let in asked the upstream"
    );
    assert!((2..=4).contains(&let_in.len()), "{} let in", let_in.len());
    for answer in &refused {
        assert_eq!(answer.json["error"], "too_many_requests", "{}", answer.json);
        assert_eq!(answer.retry_after, Some(REWIND_DEADLINE.as_secs()));
        assert!(
            answer.took < SLACK,
            "a refusal is answered at once: {:?}",
            answer.took
        );
    }
    for answer in &let_in {
        assert_eq!(answer.status, 502, "{}", answer.json);
        assert_eq!(answer.json["error"], "upstream_failed");
        let detail = answer.json["detail"].as_str().unwrap();
        assert!(detail.contains("timed out"), "{detail}");
        assert!(
            answer.took >= REWIND_DEADLINE - Duration::from_millis(100)
                && answer.took < REWIND_DEADLINE + SLACK,
            "a rewind ends by its deadline: {:?}",
            answer.took
        );
    }
    assert_eq!(
        app.counter("relay_api_throttled_total", "bound", "rewinds"),
        refused.len() as u64
    );
    assert_eq!(
        app.counter("relay_api_rewinds_total", "outcome", "upstream_failed"),
        let_in.len() as u64
    );

    // Nothing is held once they ended: A's next rewind asks the upstream again.
    let asked = upstream.asked();
    let again = timed(&client(), rewind_url, reqwest::Method::POST, &token_a).await;
    assert_eq!(again.status, 502, "{}", again.json);
    assert_eq!(upstream.asked(), asked + 1);
    app.stop().await;
}

#[tokio::test]
async fn all_tenants_rewinds_together_are_bounded_so_their_answers_memory_is() {
    let (upstream, upstream_url) = SlowUpstream::start(Duration::from_secs(60)).await;
    let app = App::spawn(|config| {
        config.envelope = envelope(32, 2, 3);
        config.upstream_timeout = Duration::from_secs(30);
    })
    .await;
    let mut rewind_urls = Vec::new();
    let mut tokens = Vec::new();
    for name in ["A", "B"] {
        let (tenant, token) = app.tenant(name).await;
        rewind_urls.push(app.rewindable(tenant, &token, &upstream_url).await);
        tokens.push(token);
    }
    // A's two rewinds wait on the upstream; then B's two, of which only one finds room.
    let mut rewinds = Vec::new();
    for (i, delay) in [0u64, 0, 300, 300].into_iter().enumerate() {
        let (url, token) = (rewind_urls[i / 2].clone(), tokens[i / 2].clone());
        rewinds.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            timed(&client(), url, reqwest::Method::POST, &token).await
        }));
    }
    let mut answers = Vec::new();
    for rewind in rewinds {
        answers.push(rewind.await.unwrap());
    }
    assert_eq!(upstream.asked(), 3);
    assert!(upstream.most_held.load(Ordering::SeqCst) <= 3);
    let refused: Vec<&Timed> = answers.iter().filter(|a| a.status == 429).collect();
    assert_eq!(
        refused.len(),
        1,
        "{:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    let detail = refused[0].json["detail"].as_str().unwrap();
    assert!(detail.contains("RELAY_API_MAX_REWINDS"), "{detail}");
    assert_eq!(refused[0].retry_after, Some(REWIND_DEADLINE.as_secs()));
    assert_eq!(
        app.counter("relay_api_throttled_total", "bound", "all_rewinds"),
        1
    );
    app.stop().await;
}

#[tokio::test]
async fn each_caller_has_its_own_bound_on_requests_in_flight() {
    let (upstream, upstream_url) = SlowUpstream::start(Duration::from_secs(60)).await;
    let app = App::spawn(|config| {
        // The rewinds' own bounds are not the ones met here.
        config.envelope = envelope(4, 100, 100);
    })
    .await;
    let (tenant_a, token_a) = app.tenant("A").await;
    let (_, token_b) = app.tenant("B").await;
    let url = app.rewindable(tenant_a, &token_a, &upstream_url).await;

    // A's 4 slow rewinds hold its 4 places until their deadline.
    let held: Vec<_> = (0..4)
        .map(|_| {
            let (url, token) = (url.clone(), token_a.clone());
            tokio::spawn(async move { timed(&client(), url, reqwest::Method::POST, &token).await })
        })
        .collect();
    let started = Instant::now();
    while upstream.asked() < 4 {
        assert!(
            started.elapsed() < REWIND_DEADLINE,
            "the 4 rewinds reach the upstream"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Then any call of A's is refused, on any route, before its handler runs...
    let own = timed(
        &client(),
        format!("{}/v1/tenant", app.base_url),
        reqwest::Method::GET,
        &token_a,
    )
    .await;
    assert_eq!(own.status, 429, "{}", own.json);
    assert_eq!(own.json["error"], "too_many_requests");
    assert!(own.json["detail"]
        .as_str()
        .unwrap()
        .contains("RELAY_API_MAX_REQUESTS_PER_TENANT"));
    assert_eq!(own.retry_after, Some(1));
    let create = app
        .call(
            "POST",
            "/v1/endpoints",
            Some(&token_a),
            Some(&App::new_endpoint(None)),
        )
        .await;
    assert_eq!(create.status, 429, "{}", create.text);
    // Refused before the router, still kept by no cache.
    assert_eq!(create.cache_control.as_deref(), Some("no-store"));
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM webhook_endpoints WHERE tenant_id = $1")
            .bind(tenant_a)
            .fetch_one(&app.db.pool)
            .await
            .unwrap(),
        1,
        "the refused create wrote nothing"
    );
    // ... and its connection closed: the answer is followed by the end of the stream.
    let mut stream = TcpStream::connect(app.base_url.trim_start_matches("http://"))
        .await
        .unwrap();
    let head = format!(
        "GET /v1/tenant HTTP/1.1\r\nhost: relay\r\nauthorization: Bearer {token_a}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(1), stream.read_to_end(&mut raw))
        .await
        .expect("the connection is closed after the 429")
        .unwrap();
    let raw = String::from_utf8_lossy(&raw).to_lowercase();
    assert!(raw.starts_with("http/1.1 429"), "{raw}");
    assert!(raw.contains("connection: close"), "{raw}");

    // B and the operators have shares of their own.
    app.ok(200, "GET", "/v1/tenant", &token_b, None).await;
    app.ok(200, "GET", "/v1/tenants", &operator(), None).await;
    // A token that does not verify is no one's: a 401, whatever A holds.
    let forged = app.call("GET", "/v1/tenant", Some("not-a-jwt"), None).await;
    assert_eq!(forged.status, 401);

    for answer in held {
        let answer = answer.await.unwrap();
        assert_eq!(answer.status, 502, "{}", answer.json);
    }
    assert_eq!(
        app.counter("relay_api_throttled_total", "bound", "requests"),
        3
    );
    // The places are given back: A is served again.
    app.ok(200, "GET", "/v1/tenant", &token_a, None).await;
    app.stop().await;
}

#[tokio::test]
async fn the_endpoints_quota_holds_under_concurrent_creates_and_the_operator_sets_it() {
    let app = App::spawn(|config| {
        config.quotas = QuotaDefaults {
            max_endpoints: 4,
            messages_per_second: 500,
        };
    })
    .await;
    let (tenant_a, token_a) = app.tenant("A").await;
    let (tenant_b, token_b) = app.tenant("B").await;
    let quotas_a = format!("/v1/tenants/{tenant_a}/quotas");
    let op = operator();

    let view = app.ok(200, "GET", &quotas_a, &op, None).await;
    assert_eq!(
        view,
        json!({
            "tenant_id": tenant_a,
            "overrides": {"max_endpoints": null, "max_messages_per_second": null},
            "defaults": {"max_endpoints": 4, "max_messages_per_second": 500},
            "in_force": {"max_endpoints": 4, "max_messages_per_second": 500},
            "usage": {"endpoints": 0},
        })
    );
    let set = app
        .ok(
            200,
            "PUT",
            &quotas_a,
            &op,
            Some(&json!({"max_endpoints": 3})),
        )
        .await;
    assert_eq!(set["overrides"]["max_endpoints"], 3);
    assert_eq!(
        set["in_force"],
        json!({"max_endpoints": 3, "max_messages_per_second": 500})
    );

    // Ten creates at once: exactly three are registered.
    let creates: Vec<_> = (0..10)
        .map(|_| {
            let (client, base_url, token) =
                (app.client.clone(), app.base_url.clone(), token_a.clone());
            tokio::spawn(async move {
                let body = App::new_endpoint(None);
                call_api(
                    &client,
                    &base_url,
                    "POST",
                    "/v1/endpoints",
                    Some(&token),
                    Some(&body),
                )
                .await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for create in creates {
        answers.push(create.await.unwrap());
    }
    let created = answers.iter().filter(|a| a.status == 201).count();
    assert_eq!(
        created,
        3,
        "{:?}",
        answers.iter().map(|a| &a.text).collect::<Vec<_>>()
    );
    for refused in answers.iter().filter(|a| a.status != 201) {
        assert_eq!(refused.status, 409, "{}", refused.text);
        assert_eq!(refused.json["error"], "conflict");
        let detail = refused.json["detail"].as_str().unwrap();
        assert!(
            detail.contains("max_endpoints quota (3 endpoints)"),
            "{detail}"
        );
    }
    for table in ["webhook_endpoints", "endpoint_secrets"] {
        let rows: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {table} WHERE tenant_id = $1"
        ))
        .bind(tenant_a)
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
        assert_eq!(rows, 3, "{table}: nothing written for a refused create");
    }
    assert_eq!(
        app.counter("relay_api_quota_refusals_total", "quota", "max_endpoints"),
        7
    );

    // The tenant sees its quotas in force and what it uses.
    let own = app.ok(200, "GET", "/v1/tenant", &token_a, None).await;
    assert_eq!(
        (&own["quotas"], &own["usage"]),
        (
            &json!({"max_endpoints": 3, "max_messages_per_second": 500,
                    "max_events_per_message": 200}),
            &json!({"endpoints": 3})
        )
    );

    // An endpoint being deleted no longer counts.
    let first = answers.iter().find(|a| a.status == 201).unwrap().json["id"]
        .as_str()
        .unwrap()
        .to_owned();
    app.ok(
        202,
        "DELETE",
        &format!("/v1/endpoints/{first}"),
        &token_a,
        None,
    )
    .await;
    app.ok(
        201,
        "POST",
        "/v1/endpoints",
        &token_a,
        Some(&App::new_endpoint(None)),
    )
    .await;

    // B has the operator's default, 4, and its own count.
    for _ in 0..4 {
        app.ok(
            201,
            "POST",
            "/v1/endpoints",
            &token_b,
            Some(&App::new_endpoint(None)),
        )
        .await;
    }
    let over = app
        .call(
            "POST",
            "/v1/endpoints",
            Some(&token_b),
            Some(&App::new_endpoint(None)),
        )
        .await;
    assert_eq!(over.status, 409, "{}", over.text);
    assert!(
        over.text.contains("max_endpoints quota (4 endpoints)"),
        "{}",
        over.text
    );
    let b = app
        .ok(
            200,
            "GET",
            &format!("/v1/tenants/{tenant_b}/quotas"),
            &op,
            None,
        )
        .await;
    assert_eq!(b["usage"]["endpoints"], 4);

    // Overrides are whole numbers from 1 to 1000000, or null; the error names the field.
    for (body, field) in [
        (json!({"max_endpoints": 0}), "max_endpoints"),
        (
            json!({"max_messages_per_second": -5}),
            "max_messages_per_second",
        ),
        (json!({"max_endpoints": 1_000_001}), "max_endpoints"),
        (json!({"max_endpoints": 2.5}), "max_endpoints"),
        (json!({"max_endpoints": "3"}), "max_endpoints"),
        (json!({"max_endpints": 3}), "max_endpints"),
    ] {
        let answer = app.call("PUT", &quotas_a, Some(&op), Some(&body)).await;
        assert_refused_field(&answer, field, &body.to_string());
    }
    let unchanged = app.ok(200, "GET", &quotas_a, &op, None).await;
    assert_eq!(unchanged["overrides"]["max_endpoints"], 3);
    let unknown = app
        .call(
            "PUT",
            &format!("/v1/tenants/{}/quotas", Uuid::new_v4()),
            Some(&op),
            Some(&json!({"max_endpoints": 3})),
        )
        .await;
    assert_eq!(unknown.status, 404, "{}", unknown.text);
    let tenants_token = app
        .call(
            "PUT",
            &quotas_a,
            Some(&token_a),
            Some(&json!({"max_endpoints": 100})),
        )
        .await;
    assert_eq!(
        tenants_token.status, 403,
        "a tenant cannot raise its own quota"
    );

    // Cleared: the defaults again.
    let cleared = app
        .ok(
            200,
            "PUT",
            &quotas_a,
            &op,
            Some(&json!({"max_endpoints": null})),
        )
        .await;
    assert_eq!(
        (&cleared["overrides"], &cleared["in_force"]),
        (
            &json!({"max_endpoints": null, "max_messages_per_second": null}),
            &json!({"max_endpoints": 4, "max_messages_per_second": 500})
        )
    );
    let overrides: i64 = sqlx::query_scalar("SELECT count(*) FROM tenant_quotas")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(overrides, 0, "no row is kept for a tenant on the defaults");
    app.stop().await;
}

#[tokio::test]
async fn a_previous_key_verifies_only_tokens_issued_before_the_rotation_until_the_overlap_ends() {
    let now = OffsetDateTime::now_utc();
    let started_at = now - Duration::from_secs(600);
    let app = App::spawn(|config| {
        config.keys = JwtKeys::new(KEY)
            .unwrap()
            .with_previous(
                OLD_KEY,
                Rotation {
                    started_at,
                    overlap: Duration::from_secs(3600),
                },
            )
            .unwrap();
    })
    .await;
    let (tenant, _) = app.tenant("rotating").await;
    let before = started_at - Duration::from_secs(600);
    let ops = || Subject::Operator { name: "ops".into() };

    // Handed out before the rotation: still taken.
    let old_tenant = token(OLD_KEY, Subject::Tenant(tenant), before);
    let own = app.ok(200, "GET", "/v1/tenant", &old_tenant, None).await;
    assert_eq!(own["id"], tenant.to_string());
    app.ok(
        200,
        "GET",
        "/v1/tenants",
        &token(OLD_KEY, ops(), before),
        None,
    )
    .await;

    // Signed with the previous key since: refused, operators' tokens too.
    for (path, subject) in [
        ("/v1/tenant", Subject::Tenant(tenant)),
        ("/v1/tenants", ops()),
    ] {
        let minted_now = token(OLD_KEY, subject, OffsetDateTime::now_utc());
        let answer = app.call("GET", path, Some(&minted_now), None).await;
        assert_eq!(answer.status, 401, "{path}: {}", answer.text);
        assert!(
            answer.text.contains("after the key rotation began"),
            "{}",
            answer.text
        );
    }
    // The signing key's own tokens are taken, whenever issued.
    app.ok(
        200,
        "GET",
        "/v1/tenant",
        &token(KEY, Subject::Tenant(tenant), before),
        None,
    )
    .await;
    app.stop().await;

    // Past the overlap, the previous key verifies nothing, whatever its tokens say.
    let ended = App::spawn(|config| {
        config.keys = JwtKeys::new(KEY)
            .unwrap()
            .with_previous(
                OLD_KEY,
                Rotation {
                    started_at: now - Duration::from_secs(7200),
                    overlap: Duration::from_secs(3600),
                },
            )
            .unwrap();
    })
    .await;
    let (tenant, _) = ended.tenant("rotated").await;
    let long_ago = now - Duration::from_secs(3 * 3600);
    let answer = ended
        .call(
            "GET",
            "/v1/tenant",
            Some(&token(OLD_KEY, Subject::Tenant(tenant), long_ago)),
            None,
        )
        .await;
    assert_eq!(answer.status, 401, "{}", answer.text);
    ended.stop().await;
}
