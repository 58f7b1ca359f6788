//! A hostile tenant against the control plane and the relay's outbound requests: upstream URLs
//! that point inside the relay's network are refused (at registration, and again when connecting,
//! after name resolution), no redirect is followed, and text no field takes (NUL, control
//! characters, a megabyte) is a 400 naming the field, with nothing written.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use relay_netguard::OutboundPolicy;
use relay_sequencer::{UpstreamClient, UpstreamError};
use relay_tests::random_secret;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use uuid::Uuid;

use crate::api::{keep_track, Answer, ApiApp};
use crate::stack::{assert_refused_field, Api};

/// A name other than `localhost` that this machine's hosts file maps to a loopback address (its
/// own name, usually): a name only resolution can tell is loopback.
fn loopback_alias() -> Option<String> {
    let hosts = std::fs::read_to_string("/etc/hosts").ok()?;
    hosts.lines().find_map(|line| {
        let mut words = line.split('#').next()?.split_whitespace();
        let address: std::net::IpAddr = words.next()?.parse().ok()?;
        if !address.is_loopback() {
            return None;
        }
        words
            .find(|name| !name.eq_ignore_ascii_case("localhost") && !name.ends_with(".localhost"))
            .map(str::to_owned)
    })
}

/// Counts every request it gets, and whether any carried an Authorization header.
#[derive(Clone, Default)]
struct Hits {
    requests: Arc<AtomicUsize>,
    with_key: Arc<AtomicUsize>,
}

impl Hits {
    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

/// A server on 127.0.0.1 that answers every request with `answer`, counting what it gets.
async fn serve(
    answer: impl Fn() -> axum::response::Response + Clone + Send + Sync + 'static,
) -> (String, Hits) {
    let hits = Hits::default();
    let counted = hits.clone();
    let app = Router::new().fallback(move |headers: HeaderMap| {
        let (hits, answer) = (counted.clone(), answer.clone());
        async move {
            hits.requests.fetch_add(1, Ordering::SeqCst);
            if headers.contains_key(header::AUTHORIZATION) {
                hits.with_key.fetch_add(1, Ordering::SeqCst);
            }
            answer()
        }
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{address}"), hits)
}

/// A target, and a server whose every answer is a 302 to it.
async fn redirect_pair() -> (String, Hits, String, Hits) {
    let (target, target_hits) = serve(|| (StatusCode::OK, "{}").into_response()).await;
    let location = format!("{target}/stolen");
    let (redirecting, redirect_hits) = serve(move || {
        (
            StatusCode::FOUND,
            [(header::LOCATION, location.clone())],
            "",
        )
            .into_response()
    })
    .await;
    (redirecting, redirect_hits, target, target_hits)
}

/// The rewind asked of the relay for `endpoint`, whatever it answers.
async fn call_rewind(app: &ApiApp, token: &str, endpoint: Uuid) -> Answer {
    let path = format!("/v1/endpoints/{endpoint}/tracks/feed/rewind");
    app.call("POST", &path, Some(token), None).await
}

#[tokio::test]
async fn upstream_urls_that_reach_inside_are_refused_at_registration_and_patch() {
    let app = ApiApp::spawn_with(OutboundPolicy::default()).await;
    let (_, token) = app.tenant("prying").await;
    let (existing, _) = app.endpoint(&token, json!({})).await;
    let mut refused = vec![
        "http://169.254.169.254",
        "https://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1",
        "https://10.0.0.1",
        "https://172.16.5.4",
        "https://192.168.1.1",
        "https://100.64.0.1",
        "http://[fd00::1]",
        "https://[fd00::1]",
        "https://[fe80::1]",
        "https://[::1]",
        "https://[::ffff:127.0.0.1]",
        "https://[::ffff:a9fe:a9fe]",
        "http://localhost:6379",
        "https://localhost:6379",
        "https://redis.localhost",
        "https://127.0.0.1",
        "https://0x7f000001",
        "https://2130706433",
        "https://0177.0.0.1",
        "https://127.1",
        "https://0.0.0.0",
        "https://0",
        "https://224.0.0.1",
        "https://255.255.255.255",
        "https://192.0.2.1",
        "http://api.quanor.com",
        "ftp://api.quanor.com",
    ];
    let alias = loopback_alias().map(|name| format!("https://{name}:6379"));
    if let Some(alias) = &alias {
        // Only resolution can tell: the API resolves the name at registration too.
        refused.push(alias);
    }
    let endpoints_before = app.count("webhook_endpoints").await;
    for url in &refused {
        let upstream = json!({"upstream_base_url": url, "upstream_api_key": "qk_key"});
        let (_, _, answer) = app.try_endpoint(&token, upstream).await;
        assert_refused_field(&answer, "upstream_base_url", url);
        let detail = answer.json["detail"].as_str().unwrap();
        assert!(
            detail.contains("public") || detail.contains("https://"),
            "{url}: the answer says why: {detail}"
        );
        let answer = app
            .call(
                "PATCH",
                &format!("/v1/endpoints/{existing}"),
                Some(&token),
                Some(&json!({"upstream_base_url": url})),
            )
            .await;
        assert_refused_field(&answer, "upstream_base_url", url);
    }
    assert_eq!(app.count("webhook_endpoints").await, endpoints_before);
    let stored = app
        .ok(
            200,
            "GET",
            &format!("/v1/endpoints/{existing}"),
            &token,
            None,
        )
        .await;
    assert_eq!(stored["upstream_base_url"], Value::Null);

    // A public address over https is what the default takes.
    let (public, _) = app
        .endpoint(
            &token,
            json!({"upstream_base_url": "https://8.8.8.8:8443/api", "upstream_api_key": "qk_key"}),
        )
        .await;
    let stored = app
        .ok(200, "GET", &format!("/v1/endpoints/{public}"), &token, None)
        .await;
    assert_eq!(stored["upstream_base_url"], "https://8.8.8.8:8443/api");
    app.stop().await;
}

/// The operator's policy allowing plain http, and public addresses only.
fn http_allowed() -> OutboundPolicy {
    OutboundPolicy {
        allow_http: true,
        allow_private: false,
        allowed_networks: Vec::new(),
        ..OutboundPolicy::default()
    }
}

#[tokio::test]
async fn the_operator_setting_allows_http_and_private_addresses() {
    let http_only = ApiApp::spawn_with(http_allowed()).await;
    let (_, token) = http_only.tenant("plain").await;
    http_only
        .endpoint(&token, json!({"upstream_base_url": "http://8.8.8.8"}))
        .await;
    let (_, _, answer) = http_only
        .try_endpoint(
            &token,
            json!({"upstream_base_url": "http://127.0.0.1:9700"}),
        )
        .await;
    assert_refused_field(&answer, "upstream_base_url", "loopback with http allowed");
    http_only.stop().await;

    let open = ApiApp::spawn_with(OutboundPolicy::ANY).await;
    let (_, token) = open.tenant("simulated").await;
    open.endpoint(
        &token,
        json!({"upstream_base_url": "http://127.0.0.1:9700"}),
    )
    .await;
    open.endpoint(
        &token,
        json!({"upstream_base_url": "http://localhost:9700"}),
    )
    .await;
    open.stop().await;
}

#[tokio::test]
async fn the_apis_rewind_follows_no_redirect() {
    let (redirecting, redirect_hits, _, target_hits) = redirect_pair().await;
    let app = ApiApp::spawn().await;
    let (tenant, token) = app.tenant("redirected").await;
    let (endpoint, _) = app
        .endpoint(
            &token,
            json!({"upstream_base_url": redirecting, "upstream_api_key": "qk_secret_key"}),
        )
        .await;
    keep_track(&app.db, tenant, endpoint, "1.990", false).await;
    let answer = call_rewind(&app, &token, endpoint).await;
    assert_eq!(answer.status, 502, "{}", answer.text);
    assert_eq!(answer.json["error"], "upstream_failed", "{}", answer.text);
    assert!(
        answer.json["detail"].as_str().unwrap().contains("302"),
        "{}",
        answer.text
    );
    assert_eq!(redirect_hits.requests(), 1);
    assert_eq!(target_hits.requests(), 0, "the redirect was not followed");
    app.stop().await;
}

#[tokio::test]
async fn a_stored_url_the_policy_refuses_is_refused_again_when_calling() {
    // As an endpoint registered before the operator tightened the policy: the URL is in the
    // table, and the call is refused before anything is sent.
    let (upstream, hits) =
        serve(|| (StatusCode::ACCEPTED, r#"{"generation": 4}"#).into_response()).await;
    // http allowed, so only the address (literal, or resolved) can refuse.
    let app = ApiApp::spawn_with(http_allowed()).await;
    let (tenant, token) = app.tenant("grandfathered").await;
    let (endpoint, _) = app
        .endpoint(&token, json!({"upstream_api_key": "qk_key"}))
        .await;
    let mut urls = vec![upstream.clone()];
    if let Some(alias) = loopback_alias() {
        urls.push(upstream.replace("127.0.0.1", &alias));
    }
    keep_track(&app.db, tenant, endpoint, "1.990", false).await;
    for url in urls {
        sqlx::query("UPDATE webhook_endpoints SET upstream_base_url = $2 WHERE id = $1")
            .bind(endpoint)
            .bind(&url)
            .execute(&app.db.pool)
            .await
            .unwrap();
        let answer = call_rewind(&app, &token, endpoint).await;
        assert_eq!(answer.status, 409, "{url}: {}", answer.text);
        assert_eq!(
            answer.json["field"], "upstream_base_url",
            "{url}: {}",
            answer.text
        );
        assert!(answer.text.contains("loopback"), "{url}: {}", answer.text);
    }
    assert_eq!(hits.requests(), 0, "nothing was sent");
    app.stop().await;
}

#[tokio::test]
async fn the_sequencers_reads_follow_no_redirect_and_reach_no_refused_address() {
    let endpoint = Uuid::new_v4();
    let (redirecting, redirect_hits, _, target_hits) = redirect_pair().await;
    let open = UpstreamClient::http_client(
        Duration::from_secs(5),
        OutboundPolicy::ANY,
        &relay_netguard::TrustRoots::platform(),
    );
    let client = UpstreamClient::new(
        open,
        Some(&redirecting),
        Some(&relay_store::SecretText::new("qk_secret_key")),
    )
    .unwrap();
    match client.selection(relay_store::EndpointId(endpoint)).await {
        Err(UpstreamError::Status { status, .. }) => assert_eq!(status.as_u16(), 302),
        other => panic!("{other:?}"),
    }
    assert_eq!(redirect_hits.requests(), 1);
    assert_eq!(redirect_hits.with_key.load(Ordering::SeqCst), 1);
    assert_eq!(target_hits.requests(), 0, "the redirect was not followed");

    // The default policy: the literal address is refused before sending, the name after
    // resolution.
    let (upstream, hits) = serve(|| (StatusCode::OK, "{}").into_response()).await;
    let http_only = OutboundPolicy {
        allow_http: true,
        allow_private: false,
        allowed_networks: Vec::new(),
        ..OutboundPolicy::default()
    };
    let mut urls = vec![upstream.clone()];
    if let Some(alias) = loopback_alias() {
        urls.push(upstream.replace("127.0.0.1", &alias));
    }
    for url in urls {
        let strict = UpstreamClient::http_client(
            Duration::from_secs(5),
            http_only.clone(),
            &relay_netguard::TrustRoots::platform(),
        );
        let client = UpstreamClient::new(
            strict,
            Some(&url),
            Some(&relay_store::SecretText::new("qk_secret_key")),
        )
        .unwrap();
        match client.selection(relay_store::EndpointId(endpoint)).await {
            Err(UpstreamError::Refused { refusal, .. }) => {
                assert!(refusal.to_string().contains("loopback"), "{url}: {refusal}")
            }
            other => panic!("{url}: {other:?}"),
        }
    }
    assert_eq!(hits.requests(), 0, "nothing was sent");
}

#[tokio::test]
async fn nul_control_characters_and_oversized_text_are_400s_naming_the_field() {
    let app = ApiApp::spawn().await;
    let operator = Api::operator_token();
    let (_, token) = app.tenant("careless").await;
    let (endpoint, _) = app.endpoint(&token, json!({})).await;
    let secret = || random_secret().to_whsec();
    let megabyte = format!("whsec_{}", "A".repeat(1 << 20));
    let e = |suffix: &str| format!("/v1/endpoints/{endpoint}{suffix}");
    let new_endpoint = |field: &str, value: Value| {
        let mut body = json!({"id": Uuid::new_v4(), "lang": "en", "secrets": [secret()],
                              "upstream_base_url": "http://127.0.0.1:9", "upstream_api_key": "k"});
        body[field] = value;
        body
    };
    type Case = (&'static str, String, bool, Option<Value>, &'static str);
    // One builder a kind of call: (method, path, as the operator, body, the field named).
    let tenant_name = |name: String| -> Case {
        let body = json!({"name": name});
        ("POST", "/v1/tenants".into(), true, Some(body), "name")
    };
    let register = |field: &str, value: Value, named: &'static str| -> Case {
        let body = new_endpoint(field, value);
        ("POST", "/v1/endpoints".into(), false, Some(body), named)
    };
    let patch = |field: &'static str, value: &str| -> Case {
        let mut body = json!({});
        body[field] = json!(value);
        ("PATCH", e(""), false, Some(body), field)
    };
    let add_secret = |suffix: &str, secret: String| -> Case {
        let body = json!({"secret": secret});
        ("POST", e(suffix), false, Some(body), "secret")
    };
    let destination = |body: Value, field: &'static str| -> Case {
        ("PUT", "/v1/destination".into(), false, Some(body), field)
    };
    let own_exchange = |amqp_url: &str, exchange: &str, routing_key: &str| {
        json!({"kind": "own_exchange", "amqp_url": amqp_url, "exchange": exchange,
               "routing_key": routing_key})
    };
    let get = |path: String, field: &'static str| -> Case { ("GET", path, false, None, field) };
    let broker = "amqp://u:p@broker.example/";
    let mut cases: Vec<Case> = vec![
        tenant_name("a\u{0}b".into()),
        tenant_name("a\nINFO forged".into()),
        tenant_name("\u{1b}[31mred".into()),
        tenant_name("n".repeat(1 << 20)),
        register("lang", json!("e\u{0}n"), "lang"),
        register(
            "upstream_base_url",
            json!("http://127.0.0.1:9/\u{0}"),
            "upstream_base_url",
        ),
        register("upstream_api_key", json!("k\u{0}"), "upstream_api_key"),
        register("secrets", json!([secret(), "whsec_\u{0}"]), "secrets[1]"),
        register("secrets", json!([megabyte.clone()]), "secrets[0]"),
        patch("lang", "e\u{0}n"),
        patch("upstream_base_url", "http://127.0.0.1:9\u{0}"),
        patch("upstream_api_key", "a\u{0}"),
        add_secret("/secrets", "whsec_\u{0}AAAA".into()),
        add_secret("/secrets", megabyte.clone()),
        // Under the generic bound, over the secret's own.
        add_secret("/secrets", format!("whsec_{}", "A".repeat(400))),
        add_secret("/secrets/rotate", "whsec_\u{0}".into()),
        destination(
            own_exchange("amqp://u:p@broker.example/\u{0}", "x", "r"),
            "amqp_url",
        ),
        destination(own_exchange(broker, "x\u{0}", "r"), "exchange"),
        destination(own_exchange(broker, "x", "r\u{0}"), "routing_key"),
        destination(json!({"kind": "relay_queue\u{0}"}), "kind"),
        get(e("/copy/announcement%3A1%00x"), "subject"),
        get(e("/copy/announcement%0A1"), "subject"),
        get(e("/copy?after=a%00b"), "after"),
        get(e("/messages?order=%1B%5B2K"), "order"),
        get("/v1/endpoints?after=%00".into(), "after"),
    ];
    let long_subject = format!("/copy/{}", "s".repeat(2000));
    cases.push(get(e(&long_subject), "subject"));
    let tables = [
        "tenants",
        "webhook_endpoints",
        "endpoint_secrets",
        "tenant_destinations",
    ];
    let before = app.counts(&tables).await;
    for (method, path, as_operator, body, field) in &cases {
        let who = if *as_operator { &operator } else { &token };
        let answer = app.call(method, path, Some(who), body.as_ref()).await;
        let what = format!("{method} {path} ({field})");
        assert_refused_field(&answer, field, &what);
        assert!(
            answer.text.len() < 1000,
            "{what}: the answer repeats no value"
        );
        assert!(!answer.text.contains("AAAAAAAA"), "{what}: {}", answer.text);
    }
    assert_eq!(app.counts(&tables).await, before, "nothing written");
    assert_eq!(
        app.counter("relay_api_requests_total", "status", "500"),
        0,
        "no answer was a 500"
    );
    app.stop().await;
}
