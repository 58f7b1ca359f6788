//! The control plane's API (`relay_api`) served on port 0 against a database of its own.
//!
//! Here: the helpers, every route behind the right kind of token and scoped to its tenant, and
//! secrets and keys in no answer and no log line. Beside it: `api_input.rs` (bad input refused
//! with the field named, nothing written), `api_reads.rs` (the copy, state and messages written
//! through relay_store), `api_lifecycle.rs` (secrets, pause, destination, and the front tier
//! answering as the API's writes say) and `api_rewind.rs` (rewinds against the simulator).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use relay_api::{mint, JwtKeys, Subject};
use relay_netguard::OutboundPolicy;
use relay_rules::{DestinationPolicy, EndpointTrack};
use relay_store::cursors;
use relay_store::messages::IncomingMessage;
use relay_store::runs::{self, RunWrite};
use relay_store::tracks::{self, TrackClaim};
use relay_tests::{capture_logs, execute_for, random_secret, TestDb, Vhost};
use relay_wire::{Message, Sequence};
use serde_json::{json, Value};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::sequencer_apply::{incoming, store_new};
use crate::stack::{open_and_decide, relay_broker, Api, KEY};

#[path = "api_console_reads.rs"]
mod console_reads;
#[path = "api_input.rs"]
mod input;
#[path = "api_lifecycle.rs"]
mod lifecycle;
#[path = "api_outage.rs"]
mod outage;
#[path = "api_reads.rs"]
mod reads;
#[path = "api_rewind.rs"]
mod rewind;

const AUDIENCE: &str = "relay";

/// The API on 127.0.0.1, port 0, against a database of its own; calls go through its [`Api`].
pub(crate) struct ApiApp {
    pub db: TestDb,
    /// The relay broker's vhost, when the test makes broker users (deleted with the app).
    _vhost: Option<Vhost>,
    api: Api,
}

impl std::ops::Deref for ApiApp {
    type Target = Api;

    fn deref(&self) -> &Api {
        &self.api
    }
}

/// One answer: its status and body.
pub(crate) use crate::stack::Answer;

impl ApiApp {
    /// The API taking any upstream URL: the tests' upstreams are simulators on 127.0.0.1.
    pub async fn spawn() -> Self {
        Self::spawn_on(None, OutboundPolicy::ANY).await
    }

    /// The API with the relay's broker at a vhost of the test's own (for the routes that make
    /// broker users there).
    pub async fn spawn_with_vhost() -> Self {
        let vhost = tokio::task::spawn_blocking(Vhost::create).await.unwrap();
        Self::spawn_on(Some(vhost), OutboundPolicy::ANY).await
    }

    /// The API with the operator's policy for upstream URLs set to `outbound`.
    pub async fn spawn_with(outbound: OutboundPolicy) -> Self {
        Self::spawn_on(None, outbound).await
    }

    async fn spawn_on(vhost: Option<Vhost>, outbound: OutboundPolicy) -> Self {
        let db = TestDb::new().await;
        let api = Api::serve(db.pool.clone(), |config| {
            config.upstream_timeout = Duration::from_secs(5);
            config.outbound = outbound;
            if let Some(vhost) = &vhost {
                config.broker = relay_broker(&vhost.url(), DestinationPolicy::default());
            }
        })
        .await;
        Self {
            db,
            _vhost: vhost,
            api,
        }
    }

    /// An endpoint registered through the API with one fresh secret; returns its id and secret.
    pub async fn endpoint(&self, token: &str, extra: Value) -> (Uuid, String) {
        let (id, secret, answer) = self.try_endpoint(token, extra).await;
        assert_eq!(answer.status, 201, "POST /v1/endpoints: {}", answer.text);
        (id, secret)
    }

    /// A new endpoint with one fresh secret and the fields of `extra`, registered through the
    /// API whatever it answers: its id, its secret and the answer.
    pub async fn try_endpoint(&self, token: &str, extra: Value) -> (Uuid, String, Answer) {
        let id = Uuid::new_v4();
        let secret = random_secret().to_whsec();
        let body = merged(json!({"id": id, "lang": "en", "secrets": [secret]}), extra);
        let answer = self
            .call("POST", "/v1/endpoints", Some(token), Some(&body))
            .await;
        (id, secret, answer)
    }

    /// The rows of each of `tables`, with its name.
    pub async fn counts<'t>(&self, tables: &[&'t str]) -> Vec<(&'t str, i64)> {
        let mut counts = Vec::new();
        for &table in tables {
            counts.push((table, self.count(table).await));
        }
        counts
    }

    pub async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    pub async fn stop(self) {
        self.api.stop().await;
        self.db.pool.close().await;
    }
}

/// The endpoint's feed track as the sequencer keeps it with the copy (and a backup holds it),
/// through `through`, so that a rewind asks the upstream to resend from there (or, after a
/// reset, reads the feed again).
pub(crate) async fn keep_track(
    db: &TestDb,
    tenant: Uuid,
    endpoint: Uuid,
    through: &str,
    last_was_reset: bool,
) {
    sqlx::query(
        "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id, generation, access_version,
                                      through, last_was_reset)
         VALUES ($1, 'feed', $2, 3, 'av1', $3, $4)",
    )
    .bind(endpoint)
    .bind(tenant)
    .bind(through)
    .bind(last_was_reset)
    .execute(&db.pool)
    .await
    .unwrap();
}

/// `body` with the fields of `extra` set in it, those null in `extra` taken out.
pub(crate) fn merged(mut body: Value, extra: Value) -> Value {
    let fields = body.as_object_mut().unwrap();
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            fields.remove(k);
        } else {
            fields.insert(k.clone(), v.clone());
        }
    }
    body
}

// ---- copy rows and messages written as the sequencer and the front tier write them ----------

fn item_event(subject: &str, kind: &str, company: i64, n: u64) -> Value {
    json!({"id": format!("evt_{subject}_{n}"), "type": format!("{kind}.updated"),
           "subject": subject, "sequence": Sequence::from_parts(1, n).as_str(),
           "specversion": "1.0",
           "data": {"type": "item", "feed_item_id": subject, "item_kind": kind, "seq": n,
                    "first_seq": n, "op": "new", "changes": [], "lang": "en",
                    "parts": [{"kind": "flash", "part_id": format!("flash:{n}"), "part_version": 1}],
                    "company": {"company_id": company, "name": "Alfa Group AB"},
                    "head": {"title": format!("{subject} at {n}")}}})
}

fn hidden_event(subject: &str, n: u64) -> Value {
    json!({"id": format!("evt_{subject}_{n}_hidden"), "type": "announcement.hidden",
           "subject": subject, "sequence": Sequence::from_parts(1, n).as_str(),
           "specversion": "1.0",
           "data": {"type": "hidden", "feed_item_id": subject, "seq": n}})
}

fn message_body(endpoint: Uuid, events: &[Value], through: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "v": 1, "webhook_endpoint_id": endpoint, "track": "feed", "generation": 1,
        "access_version": "av1", "since": "1.0", "through": format!("1.{through}"),
        "complete": true, "events": events}))
    .unwrap()
}

/// Applies `events` to the endpoint's copy as the sequencer does: one message of generation 1
/// under av1, decided whole by relay-rules' `decide_run` against what relay-store's
/// `runs::open_runs` read under the endpoint's locks, and written by `runs::write_runs`, in one
/// transaction. The track is held under av1 at generation 1 first, so no reload begins. No
/// message is stored, so none is noted, the apply cursor stays where it is, and the message
/// names no `through` (the track keeps none: a rewind reads the feed again without a call).
pub async fn apply_events(db: &TestDb, tenant: Uuid, endpoint: Uuid, events: &[Value]) {
    let body = json!({"v": 1, "webhook_endpoint_id": endpoint, "track": "feed", "generation": 1,
                      "access_version": "av1", "events": events});
    let messages = [Ok(Message::parse(body.to_string().as_bytes()).unwrap())];
    tracks::transition(
        &db.pool,
        relay_store::TenantId(tenant),
        relay_store::EndpointId(endpoint),
        |track| {
            (track.generation.is_none()).then(|| EndpointTrack {
                generation: Some(1),
                access_version: Some("av1".to_owned()),
                ..track.clone()
            })
        },
    )
    .await
    .unwrap();
    let token = db.claim_fence(endpoint).await;
    let mut tx = db.pool.begin().await.unwrap();
    let claim = TrackClaim {
        endpoint: relay_store::EndpointId(endpoint),
        tenant: relay_store::TenantId(tenant),
        token,
    };
    let plan = open_and_decide(&mut tx, claim, &messages, &HashMap::new()).await;
    assert!(plan.events.iter().all(|e| e.applied()), "{plan:?}");
    let cursor = cursors::applied_through(&mut *tx, relay_store::EndpointId(endpoint))
        .await
        .unwrap();
    let write = RunWrite {
        endpoint: relay_store::EndpointId(endpoint),
        tenant: relay_store::TenantId(tenant),
        plan: &plan,
        from: cursor,
        to: cursor,
        arrival_seqs: &[],
        last_received_at: None,
    };
    let written = runs::write_runs(&mut tx, &[write]).await.unwrap();
    assert_eq!(written[0].rows, plan.rows.len() as i64, "{plan:?}");
    tx.commit().await.unwrap();
}

/// Stores `n` messages for the endpoint as the front tier does; returns their arrival numbers.
pub async fn store_messages(db: &TestDb, tenant: Uuid, endpoint: Uuid, n: u64) -> Vec<i64> {
    let now = OffsetDateTime::now_utc();
    let batch: Vec<IncomingMessage> = (0..n)
        .map(|i| {
            let events = [item_event("announcement:9", "announcement", 28, i + 1)];
            let body = message_body(endpoint, &events, i + 1);
            IncomingMessage {
                received_at: now - Duration::from_secs(60 - i),
                ..incoming(tenant, endpoint, Some("feed".into()), Some(1), body)
            }
        })
        .collect();
    store_new(&db.pool, &batch).await
}

// ---- every route, every kind of bad token ----------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Needs {
    Operator,
    Tenant,
}

/// How tenant B's token fares on the route as used for tenant A.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ForOtherTenant {
    /// A's resource in the path: 404.
    NotFound,
    /// The route names no resource of A's: B gets its own (checked to hold none of A's data).
    OwnOnly,
    /// An operator route: no tenant dimension.
    NotApplicable,
}

struct Route {
    method: &'static str,
    template: &'static str,
    path: String,
    body: Option<Value>,
    needs: Needs,
    other: ForOtherTenant,
    /// What the right token's call answers.
    success: u16,
}

/// The answer tells every cache to keep nothing of it.
fn assert_no_store(answer: &Answer, what: &str) {
    assert_eq!(
        answer.cache_control.as_deref(),
        Some("no-store"),
        "{what} answered {}: {}",
        answer.status,
        answer.text
    );
}

/// `route` called with `authorization` as its Authorization header, bytes as given.
async fn call_authorized_as(app: &ApiApp, route: &Route, authorization: &[u8]) -> Answer {
    let method = reqwest::Method::from_bytes(route.method.as_bytes()).unwrap();
    let mut request = app
        .client
        .request(method, format!("{}{}", app.base_url, route.path))
        .header(
            reqwest::header::AUTHORIZATION,
            reqwest::header::HeaderValue::from_bytes(authorization).unwrap(),
        );
    if let Some(body) = &route.body {
        request = request.json(body);
    }
    crate::stack::answer_of(request.send().await.expect("the API answers")).await
}

/// Every documented route, with every kind of bad token and with the right one; every answer,
/// refusals included, says `Cache-Control: no-store`.
#[tokio::test]
async fn every_route_refuses_missing_expired_foreign_and_wrong_kind_tokens() {
    let app = ApiApp::spawn_with_vhost().await;
    let (tenant_a, token_a) = app.tenant("tenant A").await;
    let (tenant_b, token_b) = app.tenant("tenant B").await;
    let (endpoint_a, secret_a) = app.endpoint(&token_a, json!({})).await;
    let (endpoint_b, _) = app.endpoint(&token_b, json!({})).await;
    let extra_secret = random_secret().to_whsec();
    let added = app
        .ok(
            201,
            "POST",
            &format!("/v1/endpoints/{endpoint_a}/secrets"),
            &token_a,
            Some(&json!({"secret": extra_secret})),
        )
        .await;
    let secret_id = added["id"].as_i64().unwrap();
    let amqp_url = "amqps://tenant-a:hunter2-password@broker.example:5671/vhost";
    app.ok(
        200,
        "PUT",
        "/v1/destination",
        &token_a,
        Some(&json!({"kind": "own_exchange", "amqp_url": amqp_url,
                     "exchange": "a-exchange", "routing_key": "a-key"})),
    )
    .await;
    apply_events(
        &app.db,
        tenant_a,
        endpoint_a,
        &[item_event("announcement:4242", "announcement", 28, 5)],
    )
    .await;
    store_messages(&app.db, tenant_a, endpoint_a, 1).await;
    // A story in A's copy (the reads of a stories copy name the endpoint as every read does).
    sqlx::query(
        "INSERT INTO stories (endpoint_id, tenant_id, id, ticker, version, story)
         VALUES ($1, $2, 'st_4242', 'ALFA B', 1, '{\"id\": \"st_4242\"}')",
    )
    .bind(endpoint_a)
    .bind(tenant_a)
    .execute(&app.db.pool)
    .await
    .unwrap();
    // Two of A's messages set aside by the sequencer: one to retry, one to discard.
    let set_aside = store_messages(&app.db, tenant_a, endpoint_a, 2).await;
    sqlx::query(
        "INSERT INTO quarantined_messages (endpoint_id, tenant_id, arrival_seq, reason, attempts)
         SELECT $1, $2, unnest($3::int8[]), 'not a v1 message', 1",
    )
    .bind(endpoint_a)
    .bind(tenant_a)
    .bind(&set_aside)
    .execute(&app.db.pool)
    .await
    .unwrap();

    let webhook_id: String = sqlx::query_scalar(
        "SELECT webhook_id FROM messages WHERE endpoint_id = $1 AND arrival_seq = $2",
    )
    .bind(endpoint_a)
    .bind(set_aside[0])
    .fetch_one(&app.db.pool)
    .await
    .unwrap();
    let fill = |template: &str| {
        let set_aside = set_aside[usize::from(template.ends_with("/discard"))];
        template
            .replace("{arrival_seq}", &set_aside.to_string())
            .replace("{tenant_id}", &tenant_a.to_string())
            .replace("{endpoint_id}", &endpoint_a.to_string())
            .replace("{secret_id}", &secret_id.to_string())
            .replace("{track}", "feed")
            .replace("{subject}", "announcement:4242")
            .replace("{story_id}", "st_4242")
            .replace("{webhook_id}", &webhook_id)
    };
    let secret = || json!({"secret": random_secret().to_whsec()});
    let own_exchange = |exchange: &str| {
        json!({"kind": "own_exchange", "amqp_url": amqp_url, "exchange": exchange,
               "routing_key": "a-key"})
    };
    let new_endpoint =
        json!({"id": Uuid::new_v4(), "lang": "sv", "secrets": [random_secret().to_whsec()]});
    use ForOtherTenant::{NotApplicable as NA, NotFound, OwnOnly};
    use Needs::{Operator as Op, Tenant};
    let specs: Vec<(&str, Option<Value>, Needs, ForOtherTenant, u16)> = vec![
        ("POST /v1/tenants", Some(json!({"name": "C"})), Op, NA, 201),
        ("GET /v1/tenants", None, Op, NA, 200),
        ("GET /v1/tenants/{tenant_id}", None, Op, NA, 200),
        (
            "POST /v1/tenants/{tenant_id}/tokens",
            Some(json!({"ttl_s": 60})),
            Op,
            NA,
            201,
        ),
        ("GET /v1/keys", None, Op, NA, 200),
        ("GET /v1/tenants/{tenant_id}/quotas", None, Op, NA, 200),
        (
            "PUT /v1/tenants/{tenant_id}/quotas",
            Some(json!({"max_endpoints": 50})),
            Op,
            NA,
            200,
        ),
        ("GET /v1/tenant", None, Tenant, OwnOnly, 200),
        ("GET /v1/endpoints", None, Tenant, OwnOnly, 200),
        (
            "POST /v1/endpoints",
            Some(new_endpoint),
            Tenant,
            OwnOnly,
            201,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "PATCH /v1/endpoints/{endpoint_id}",
            Some(json!({"lang": "sv"})),
            Tenant,
            NotFound,
            200,
        ),
        (
            "POST /v1/endpoints/{endpoint_id}/pause",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "POST /v1/endpoints/{endpoint_id}/resume",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}/secrets",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "POST /v1/endpoints/{endpoint_id}/secrets",
            Some(secret()),
            Tenant,
            NotFound,
            201,
        ),
        (
            "POST /v1/endpoints/{endpoint_id}/secrets/rotate",
            Some(secret()),
            Tenant,
            NotFound,
            200,
        ),
        (
            "POST /v1/endpoints/{endpoint_id}/secrets/{secret_id}/expire",
            Some(json!({"after_s": 60})),
            Tenant,
            NotFound,
            200,
        ),
        ("GET /v1/destination", None, Tenant, OwnOnly, 200),
        (
            "PUT /v1/destination",
            Some(own_exchange("a-exchange-2")),
            Tenant,
            OwnOnly,
            200,
        ),
        ("DELETE /v1/destination", None, Tenant, OwnOnly, 200),
        // In this order for A's token: made, read, rotated, deleted (no user is left behind).
        ("POST /v1/broker/credentials", None, Tenant, OwnOnly, 201),
        // B has none of its own.
        ("GET /v1/broker/credentials", None, Tenant, NotFound, 200),
        (
            "POST /v1/broker/credentials/rotate",
            None,
            Tenant,
            OwnOnly,
            200,
        ),
        ("DELETE /v1/broker/credentials", None, Tenant, OwnOnly, 204),
        (
            "POST /v1/endpoints/{endpoint_id}/tracks/{track}/rewind",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}/copy",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}/copy/{subject}",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}/state",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}/activity",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}/messages",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}/messages/{arrival_seq}",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}/messages/by-webhook-id/{webhook_id}",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}/stories",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}/stories/{story_id}",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}/notifications",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "GET /v1/endpoints/{endpoint_id}/quarantine",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "POST /v1/endpoints/{endpoint_id}/quarantine/{arrival_seq}/retry",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "POST /v1/endpoints/{endpoint_id}/quarantine/{arrival_seq}/discard",
            None,
            Tenant,
            NotFound,
            200,
        ),
        (
            "POST /v1/endpoints/{endpoint_id}/quarantine/retry",
            Some(json!({"arrival_seqs": [set_aside[0]]})),
            Tenant,
            NotFound,
            200,
        ),
        (
            "POST /v1/endpoints/{endpoint_id}/quarantine/discard",
            Some(json!({"arrival_seqs": [set_aside[1]]})),
            Tenant,
            NotFound,
            200,
        ),
        (
            "POST /v1/endpoints/{endpoint_id}/replay",
            Some(json!({"from_change_seq": 1})),
            Tenant,
            NotFound,
            202,
        ),
        (
            "POST /v1/endpoints/{endpoint_id}/resync",
            None,
            Tenant,
            NotFound,
            202,
        ),
        // Last: each route is called with its own token in this order at the end.
        (
            "DELETE /v1/endpoints/{endpoint_id}",
            None,
            Tenant,
            NotFound,
            202,
        ),
        ("DELETE /v1/tenants/{tenant_id}", None, Op, NA, 202),
    ];
    let routes: Vec<Route> = specs
        .into_iter()
        .map(|(spec, body, needs, other, success)| {
            let (method, template) = spec.split_once(' ').unwrap();
            Route {
                method,
                template,
                path: fill(template),
                body,
                needs,
                other,
                success,
            }
        })
        .collect();

    // The matrix covers exactly the routes the OpenAPI document (built from the router's own
    // handlers) lists.
    let openapi = app.call("GET", "/openapi.json", None, None).await;
    assert_eq!(openapi.status, 200);
    let documented: BTreeSet<(String, String)> = openapi.json["paths"]
        .as_object()
        .unwrap()
        .iter()
        .flat_map(|(path, item)| {
            item.as_object()
                .unwrap()
                .keys()
                .map(move |m| (m.to_uppercase(), path.clone()))
        })
        .collect();
    let tested: BTreeSet<(String, String)> = routes
        .iter()
        .map(|r| (r.method.to_owned(), r.template.to_owned()))
        .collect();
    assert_eq!(
        documented, tested,
        "every documented route is in the matrix"
    );

    let expired = mint(
        &JwtKeys::new(KEY).unwrap(),
        AUDIENCE,
        &Subject::Tenant(tenant_a),
        Duration::from_secs(60),
        OffsetDateTime::now_utc() - Duration::from_secs(3600),
    )
    .unwrap()
    .token;
    let expired_operator = mint(
        &JwtKeys::new(KEY).unwrap(),
        AUDIENCE,
        &Subject::Operator { name: "x".into() },
        Duration::from_secs(60),
        OffsetDateTime::now_utc() - Duration::from_secs(3600),
    )
    .unwrap()
    .token;
    let wrong_audience = |subject: Subject| {
        mint(
            &JwtKeys::new(KEY).unwrap(),
            "another-service",
            &subject,
            Duration::from_secs(600),
            OffsetDateTime::now_utc(),
        )
        .unwrap()
        .token
    };
    let wrong_key = mint(
        &JwtKeys::new(vec![7; 32]).unwrap(),
        AUDIENCE,
        &Subject::Tenant(tenant_a),
        Duration::from_secs(600),
        OffsetDateTime::now_utc(),
    )
    .unwrap()
    .token;
    let operator = Api::operator_token();
    // Nothing of A's may show in an answer to anyone else.
    let a_data = [
        endpoint_a.to_string(),
        tenant_a.to_string(),
        "announcement:4242".to_owned(),
        "st_4242".to_owned(),
        "tenant A".to_owned(),
        "a-exchange".to_owned(),
        secret_a.clone(),
        extra_secret.clone(),
        amqp_url.to_owned(),
    ];
    let tables = [
        "tenants",
        "webhook_endpoints",
        "endpoint_secrets",
        "tenant_destinations",
        "endpoint_tracks",
    ];
    let before = app.counts(&tables).await;

    for r in &routes {
        let what = format!("{} {}", r.method, r.path);
        let body = r.body.as_ref();
        let no_token = app.call(r.method, &r.path, None, body).await;
        assert_eq!(
            no_token.status, 401,
            "{what} without a token: {}",
            no_token.text
        );
        assert_eq!(no_token.json["error"], "unauthorized", "{what}");
        assert_no_store(&no_token, &what);
        // A header that is not ASCII text is refused as such, not as missing or mistyped.
        let not_ascii = call_authorized_as(&app, r, b"Bearer \xe9t\xe9").await;
        assert_eq!(not_ascii.status, 401, "{what}: {}", not_ascii.text);
        assert_eq!(
            not_ascii.json["detail"], "the Authorization header is not ASCII text",
            "{what}"
        );
        assert_no_store(&not_ascii, &what);
        let (expired, wrong_audience) = match r.needs {
            Needs::Tenant => (&expired, wrong_audience(Subject::Tenant(tenant_a))),
            Needs::Operator => (
                &expired_operator,
                wrong_audience(Subject::Operator { name: "x".into() }),
            ),
        };
        for (label, token) in [
            ("an expired token", expired.as_str()),
            ("a token for another audience", wrong_audience.as_str()),
            ("a token signed with another key", wrong_key.as_str()),
            ("a token that is not a JWT", "not-a-jwt"),
        ] {
            let answer = app.call(r.method, &r.path, Some(token), body).await;
            assert_eq!(answer.status, 401, "{what} with {label}: {}", answer.text);
            assert_no_store(&answer, &what);
        }
        let wrong_kind = match r.needs {
            Needs::Tenant => operator.as_str(),
            Needs::Operator => token_a.as_str(),
        };
        let answer = app.call(r.method, &r.path, Some(wrong_kind), body).await;
        assert_eq!(
            answer.status, 403,
            "{what} with the wrong kind of token: {}",
            answer.text
        );
        assert_eq!(answer.json["error"], "forbidden");
        assert_no_store(&answer, &what);

        match r.other {
            ForOtherTenant::NotFound => {
                let answer = app.call(r.method, &r.path, Some(&token_b), body).await;
                assert_eq!(answer.status, 404, "{what} with B's token: {}", answer.text);
                assert_eq!(answer.json["error"], "not_found");
                assert_no_store(&answer, &what);
                for a in &a_data {
                    assert!(!answer.text.contains(a.as_str()), "{what} told B {a}");
                }
            }
            ForOtherTenant::OwnOnly if r.method == "GET" => {
                let answer = app.call(r.method, &r.path, Some(&token_b), body).await;
                assert_eq!(answer.status, 200, "{what} with B's token: {}", answer.text);
                assert_no_store(&answer, &what);
                for a in &a_data {
                    assert!(!answer.text.contains(a.as_str()), "{what} told B {a}");
                }
            }
            // Writes to B's own resources are B's business; A's rows are checked unchanged
            // below. Registering A's endpoint id again is refused without a word about A.
            ForOtherTenant::OwnOnly if r.template == "/v1/endpoints" => {
                let answer = app
                    .call(
                        "POST",
                        "/v1/endpoints",
                        Some(&token_b),
                        Some(&json!({"id": endpoint_a, "lang": "en",
                                     "secrets": [random_secret().to_whsec()]})),
                    )
                    .await;
                assert_eq!(answer.status, 409, "{}", answer.text);
                assert!(!answer.text.contains(&tenant_a.to_string()));
            }
            _ => {}
        }
    }

    // B naming its own endpoint with A's secret or A's subject finds neither.
    for (method, path, body) in [
        (
            "POST",
            format!("/v1/endpoints/{endpoint_b}/secrets/{secret_id}/expire"),
            Some(json!({"after_s": 0})),
        ),
        (
            "GET",
            format!("/v1/endpoints/{endpoint_b}/copy/announcement:4242"),
            None,
        ),
    ] {
        let answer = app.call(method, &path, Some(&token_b), body.as_ref()).await;
        assert_eq!(answer.status, 404, "{method} {path}: {}", answer.text);
        for a in &a_data {
            assert!(!answer.text.contains(a.as_str()), "{path} told B {a}");
        }
    }
    let a_secret_expiry: Option<OffsetDateTime> =
        sqlx::query_scalar("SELECT expires_at FROM endpoint_secrets WHERE id = $1")
            .bind(secret_id)
            .fetch_one(&app.db.pool)
            .await
            .unwrap();
    assert_eq!(a_secret_expiry, None, "A's secret keeps verifying");

    // None of those calls changed anything.
    assert_eq!(app.counts(&tables).await, before, "a table changed");
    let a = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{endpoint_a}"),
            &token_a,
            None,
        )
        .await;
    assert_eq!(
        (a["status"].as_str(), a["lang"].as_str()),
        (Some("active"), Some("en"))
    );
    let b_list = app.ok(200, "GET", "/v1/endpoints", &token_b, None).await;
    let b_ids: Vec<&str> = b_list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(b_ids, vec![endpoint_b.to_string().as_str()]);
    let b = app.ok(200, "GET", "/v1/tenant", &token_b, None).await;
    assert_eq!(b["id"], tenant_b.to_string());

    // And each route works for the token it is for: its answer (the tenant's reads, a secret
    // added or rotated, broker credentials with their password, a minted token) kept by no
    // cache.
    for r in &routes {
        let token = match r.needs {
            Needs::Tenant => token_a.as_str(),
            Needs::Operator => operator.as_str(),
        };
        let answer = app
            .call(r.method, &r.path, Some(token), r.body.as_ref())
            .await;
        assert_eq!(
            answer.status, r.success,
            "{} {}: {}",
            r.method, r.path, answer.text
        );
        assert_no_store(&answer, &format!("{} {}", r.method, r.path));
    }
    // The console's files keep their own rule: stored, but checked again before each use.
    let console = app
        .client
        .get(format!("{}/console/", app.base_url))
        .send()
        .await
        .unwrap();
    assert_eq!(console.status(), 200);
    assert_eq!(console.headers()["cache-control"], "no-cache");
    // Requests are counted by route template, never by path (paths hold ids).
    assert!(app.counter("relay_api_requests_total", "status", "401") >= 4 * routes.len() as u64);
    assert!(
        app.counter(
            "relay_api_requests_total",
            "route",
            "/v1/endpoints/{endpoint_id}"
        ) > 0
    );
    assert_eq!(
        app.counter(
            "relay_api_requests_total",
            "route",
            &format!("/v1/endpoints/{endpoint_a}")
        ),
        0
    );
    app.stop().await;
}

// ---- the document's fixed sets of values ----------------------------------------------------

/// The `enum` of a schema the document gives: the schema itself, or the one it refers to
/// (directly, or as the non-null branch of an optional field's `oneOf`).
fn enum_of(doc: &Value, schema: &Value) -> Vec<String> {
    if let Some(values) = schema["enum"].as_array() {
        return values
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect();
    }
    if let Some(target) = schema["$ref"].as_str() {
        let name = target.strip_prefix("#/components/schemas/").unwrap();
        return enum_of(doc, &doc["components"]["schemas"][name]);
    }
    let branches = schema["oneOf"]
        .as_array()
        .expect("an enum, a $ref or a oneOf");
    let typed: Vec<&Value> = branches.iter().filter(|b| b["type"] != "null").collect();
    assert_eq!(typed.len(), 1, "{schema}");
    enum_of(doc, typed[0])
}

/// Every field and query parameter that takes or answers a fixed set of values is an enum in
/// the OpenAPI document, with exactly those values; and what the API answers is among them.
#[tokio::test]
async fn the_document_gives_every_fixed_set_of_values_as_an_enum() {
    let app = ApiApp::spawn().await;
    let answer = app.call("GET", "/openapi.json", None, None).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    let doc = answer.json;
    let field = |schema: &str, field: &str| {
        let property = &doc["components"]["schemas"][schema]["properties"][field];
        assert_ne!(property, &Value::Null, "{schema}.{field}");
        enum_of(&doc, property)
    };
    let param = |path: &str, name: &str| {
        let parameters = doc["paths"][path]["get"]["parameters"].as_array().unwrap();
        let parameter = parameters.iter().find(|p| p["name"] == name).unwrap();
        assert_eq!(parameter["in"], "query", "{path} {name}");
        enum_of(&doc, &parameter["schema"])
    };
    let source = ["feed", "stories"];
    let endpoint_status = ["active", "paused"];
    let stories_mode = ["snapshot", "fetch_on_notify"];
    let item_kind = ["announcement", "pre_earnings_analysis"];
    let destination_kind = ["relay_queue", "own_exchange"];
    let fields: &[(&str, &str, &[&str])] = &[
        ("EndpointView", "source", &source),
        ("EndpointView", "status", &endpoint_status),
        ("EndpointView", "stories_mode", &stories_mode),
        ("NewEndpoint", "source", &source),
        ("NewEndpoint", "stories_mode", &stories_mode),
        ("EndpointUpdate", "stories_mode", &stories_mode),
        ("DeletionView", "status", &["deleting"]),
        ("StateView", "source", &source),
        ("StateView", "status", &endpoint_status),
        (
            "UpstreamStateView",
            "status",
            &["needs_settings", "failing", "ok"],
        ),
        ("StoriesReloadView", "status", &["running", "owed", "none"]),
        ("CopyItemView", "item_kind", &item_kind),
        (
            "MessageView",
            "status",
            &["waiting", "applied", "ignored", "quarantined"],
        ),
        (
            "ApplicationView",
            "outcome",
            &[
                "applied",
                "test",
                "ignored_track",
                "older_generation",
                "reload_begun",
                "reload_superseded",
                "quarantined",
                "ignored_type",
                "malformed",
                "read_owed",
                "unrecorded",
            ],
        ),
        (
            "QuarantinedView",
            "status",
            &["quarantined", "retried", "discarded"],
        ),
        ("RewindView", "plan", &["rewind", "read_feed_again"]),
        (
            "RewindView",
            "outcome",
            &["nothing", "reload_begun", "reload_already_running"],
        ),
        ("DestinationView", "kind", &destination_kind),
        ("DestinationUpdate", "kind", &destination_kind),
        (
            "ErrorBody",
            "error",
            &[
                "invalid_request",
                "unauthorized",
                "forbidden",
                "not_found",
                "conflict",
                "too_many_requests",
                "upstream_failed",
                "unavailable",
                "internal",
                "body_timeout",
                "too_many_connections",
                "body_budget_spent",
            ],
        ),
    ];
    for (schema, name, values) in fields {
        assert_eq!(field(schema, name), *values, "{schema}.{name}");
    }
    let messages = "/v1/endpoints/{endpoint_id}/messages";
    assert_eq!(
        param(messages, "status"),
        ["waiting", "applied", "ignored", "quarantined", "duplicate"]
    );
    assert_eq!(param(messages, "order"), ["newest", "arrival"]);
    assert_eq!(
        param("/v1/endpoints/{endpoint_id}/quarantine", "status"),
        ["quarantined", "retried", "discarded", "all"]
    );
    assert_eq!(
        param("/v1/endpoints/{endpoint_id}/copy", "item_kind"),
        item_kind
    );

    // What the API answers is spelt as the document says.
    let (_, token) = app.tenant("enums").await;
    let (id, _) = app.endpoint(&token, json!({})).await;
    let paused = app
        .ok(
            200,
            "POST",
            &format!("/v1/endpoints/{id}/pause"),
            &token,
            None,
        )
        .await;
    assert_eq!(
        (&paused["source"], &paused["status"]),
        (&json!("feed"), &json!("paused"))
    );
    let state = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{id}/state"),
            &token,
            None,
        )
        .await;
    assert_eq!(state["status"], "paused");
    assert_eq!(state["source"], "feed");
    assert_eq!(state["upstream"]["status"], "needs_settings");
    let destination = app.ok(200, "GET", "/v1/destination", &token, None).await;
    assert_eq!(destination["kind"], "relay_queue");
    let refused = app
        .call(
            "GET",
            &format!("/v1/endpoints/{id}/messages?order=sideways"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(
        (refused.status, &refused.json["error"]),
        (400, &json!("invalid_request"))
    );
    assert_eq!(refused.json["detail"], "newest or arrival");
    let deleted = app
        .ok(202, "DELETE", &format!("/v1/endpoints/{id}"), &token, None)
        .await;
    assert_eq!(deleted["status"], "deleting");
    app.stop().await;
}

// ---- secrets and keys in no answer and no log line -------------------------------------------

/// Every answer and every log line (at TRACE, of every crate, this thread's tasks included:
/// the test's runtime runs the server on this one thread) is free of every secret, API key and
/// broker URL given to the API, including those given in bad requests.
#[tokio::test(flavor = "current_thread")]
async fn secrets_and_keys_appear_in_no_answer_and_no_log_line() {
    let (logs, _guard) = capture_logs(tracing::Level::TRACE);

    let app = ApiApp::spawn().await;
    let upstream = rewind::SimUpstream::start(&[]).await;
    let (tenant, token) = app.tenant("secretive").await;
    let s1 = random_secret().to_whsec();
    let s2 = random_secret().to_whsec();
    let s3 = random_secret().to_whsec();
    let s_bad = random_secret().to_whsec();
    let key1 = format!("qk_first_{}", Uuid::new_v4().simple());
    let key2 = upstream.key.clone();
    let password = format!("pw{}", Uuid::new_v4().simple());
    let amqp_url = format!("amqp://tenant:{password}@broker.example:5672/%2f");
    let mut secrets: Vec<String> = vec![
        key1.clone(),
        key2.clone(),
        password.clone(),
        amqp_url.clone(),
    ];
    for s in [&s1, &s2, &s3, &s_bad] {
        secrets.push(s.clone());
        // The base64 part alone, too.
        secrets.push(s.trim_start_matches("whsec_").to_owned());
    }
    let mut answers: Vec<Answer> = Vec::new();

    let endpoint = Uuid::new_v4();
    upstream.add_endpoint(endpoint);
    let created = app
        .call(
            "POST",
            "/v1/endpoints",
            Some(&token),
            Some(&json!({"id": endpoint, "lang": "en", "secrets": [s1],
                         "upstream_base_url": upstream.base_url, "upstream_api_key": key1})),
        )
        .await;
    assert_eq!(created.status, 201, "{}", created.text);
    assert_eq!(created.json["upstream_api_key_set"], true);
    answers.push(created);
    let path = |suffix: &str| format!("/v1/endpoints/{endpoint}{suffix}");
    let calls: Vec<(&str, String, Option<Value>)> = vec![
        ("POST", path("/secrets"), Some(json!({"secret": s2}))),
        (
            "POST",
            path("/secrets/rotate"),
            Some(json!({"secret": s3, "overlap_s": 60})),
        ),
        ("PATCH", path(""), Some(json!({"upstream_api_key": key2}))),
        (
            "PUT",
            "/v1/destination".into(),
            Some(
                json!({"kind": "own_exchange", "amqp_url": amqp_url, "exchange": "x",
                     "routing_key": "k"}),
            ),
        ),
        // Bad requests that carry secrets: the errors must not repeat them.
        (
            "POST",
            "/v1/endpoints".into(),
            Some(json!({"id": Uuid::new_v4(), "lang": "en", "secrets": s_bad})),
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            Some(json!({"id": Uuid::new_v4(), "lang": "en", "secrets": [s_bad, s_bad]})),
        ),
        (
            "POST",
            "/v1/endpoints".into(),
            Some(
                json!({"id": Uuid::new_v4(), "lang": "en", "secrets": [s_bad],
                     "upstream_api_key": format!("{key1} with spaces")}),
            ),
        ),
        ("POST", path("/secrets"), Some(json!({"secret": s1}))),
        (
            "POST",
            path("/secrets"),
            Some(json!({"secret": format!("{s_bad}!")})),
        ),
        (
            "POST",
            path("/secrets"),
            Some(json!({"secret": 5, "expires_in_s": s_bad})),
        ),
        (
            "PUT",
            "/v1/destination".into(),
            Some(
                json!({"kind": "own_exchange", "amqp_url": format!("http://u:{password}@x"),
                     "exchange": "x", "routing_key": "k"}),
            ),
        ),
        (
            "PUT",
            "/v1/destination".into(),
            Some(json!({"kind": password, "amqp_url": amqp_url})),
        ),
        // Reads of everything.
        ("GET", path(""), None),
        ("GET", "/v1/endpoints".into(), None),
        ("GET", path("/secrets"), None),
        ("GET", "/v1/destination".into(), None),
        ("GET", path("/state"), None),
        ("GET", path("/messages?include_body=true"), None),
        ("GET", "/openapi.json".into(), None),
    ];
    for (method, path, body) in calls {
        let answer = app.call(method, &path, Some(&token), body.as_ref()).await;
        assert!(answer.status < 500, "{method} {path}: {}", answer.text);
        answers.push(answer);
    }
    // A rewind sends the key to the upstream (and a failing one, a wrong key).
    execute_for(
        &app.db,
        "INSERT INTO endpoint_tracks (endpoint_id, track, tenant_id, generation, through)
         VALUES ($1, 'feed', $2, 1, '1.1000')",
        endpoint,
        tenant,
    )
    .await;
    let rewound = app
        .call("POST", &path("/tracks/feed/rewind"), Some(&token), None)
        .await;
    assert_eq!(rewound.status, 200, "{}", rewound.text);
    assert_eq!(rewound.json["upstream"]["status"], 202, "{}", rewound.text);
    answers.push(rewound);
    app.call(
        "PATCH",
        &path(""),
        Some(&token),
        Some(&json!({"upstream_api_key": key1})),
    )
    .await;
    let refused = app
        .call("POST", &path("/tracks/feed/rewind"), Some(&token), None)
        .await;
    assert_eq!(refused.status, 502, "{}", refused.text);
    answers.push(refused);

    for answer in &answers {
        for secret in &secrets {
            assert!(
                !answer.text.contains(secret.as_str()),
                "an answer holds a secret: {}",
                answer.text
            );
        }
    }
    app.stop().await;
    let logs = logs.text();
    assert!(
        logs.contains("endpoint registered") && logs.contains("rewind after restore"),
        "the logs were captured"
    );
    for line in logs.lines() {
        for secret in &secrets {
            assert!(
                !line.contains(secret.as_str()),
                "a log line holds a secret: {line}"
            );
        }
    }
}
