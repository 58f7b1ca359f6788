//! A hostile tenant beside a good one. Tenant B's endpoints take the simulator's workload
//! (faults on) through the real front tier, sequencer and publisher, onboarded through the API,
//! while tenant A — with nothing but its own API token and its own endpoints' secrets — tries
//! every attack the relay defends against, and a stranger holds slow connections open on the
//! ingest port. At quiescence:
//! - every message the simulator sent B was answered 2xx;
//! - B's copies, read through the API, and B's queue, rebuilt by the reference consumer, equal
//!   the oracle, with nothing of A's in B's queue;
//! - A's poison messages were answered 2xx, stored, quarantined and listed through the API, and
//!   A's good message after them applied;
//! - the slow connections were refused or timed out while B's messages got through;
//! - A's private upstream URLs and its own-exchange destination at the relay's broker were
//!   refused;
//! - B's broker credentials are refused by the broker itself on A's queue (consume, declare,
//!   bind, publish) and let B consume its own.
//!
//! Seeded: every run prints its seed; `RELAY_TEST_SEED=<seed>` replays one.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay::bench::{slow_connection, SlowEnd};
use relay_api::BrokerAccess;
use relay_coord::Waker;
use relay_ingest::SystemClock;
use relay_netguard::OutboundPolicy;
use relay_simulator::cli::prepare;
use relay_simulator::upstream::{Answer as SimAnswer, LogEntry};
use relay_simulator::{Faults, Simulation};
use relay_store::PoolOptions;
use relay_tests::{
    feed_body, random_secret, redis_url, seed, test_config, RedisPrefix, Signed, TestApp, Vhost,
};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::stack::{
    check_tenant_queue, connect_broker, copy_items, oracle, publisher_config, quiesce,
    simulate_args, start_publisher, start_sequencer, stop_simulation, Api,
};
use crate::tenant_broker::{assert_refused_but_own_queue, connect, tenant_url, UsersGuard};

/// Where the simulator serves the upstream's API: the one non-public network the operator
/// allows in this test, so every other loopback address stays refused.
const UPSTREAM_HOST: &str = "127.0.0.2";
/// The stranger's own address: its slow connections are bounded per address.
const STRANGER_HOST: &str = "127.0.0.3";
/// The front tier's bound on connections without a request head from one address.
const HEADLESS_PER_ADDRESS: usize = 16;
/// More than that.
const SLOW_CONNECTIONS: usize = 60;

/// A's poison: each body is signed with A's own secret, so the relay must take it as genuine.
fn poison_bodies(endpoint: Uuid, n: u64) -> Vec<(&'static str, Value)> {
    let event = |id: String, data: Value| {
        json!({
            "id": id, "type": "announcement.updated", "specversion": "1.0",
            "source": "https://api.quanor.com/v1/feed",
            "subject": format!("announcement:{n}"),
            "sequence": relay_wire::Sequence::from_parts(1, n).as_str(),
            "data": data,
        })
    };
    let item = json!({"type": "item", "feed_item_id": format!("announcement:{n}"), "seq": n,
                      "item_kind": "announcement", "parts": []});
    let message = |track: &str, generation: Value, events: Value| {
        json!({"v": 1, "webhook_endpoint_id": endpoint, "track": track, "generation": generation,
               "access_version": "hostile1", "since": format!("1.{n}"),
               "through": format!("1.{n}"), "events": events})
    };
    vec![
        ("nul_track", message("feed\u{0}x", json!(1), json!([]))),
        (
            "nul_event_id",
            message(
                "feed",
                json!(1),
                json!([event(format!("evt_{n}\u{0}"), item.clone())]),
            ),
        ),
        (
            "nul_part_id",
            message(
                "feed",
                json!(1),
                json!([event(
                    format!("evt_part_{n}"),
                    json!({"type": "item", "feed_item_id": format!("announcement:{n}"),
                           "seq": n, "parts": [{"part_id": "flash:\u{0}", "part_version": 1}]})
                )]),
            ),
        ),
        ("unparseable", message("feed", json!("one"), json!({}))),
        (
            "unknown_data_type",
            message(
                "feed",
                json!(1),
                json!([event(format!("evt_type_{n}"), json!({"type": "hologram"}))]),
            ),
        ),
    ]
}

/// Posts a signed body to the front tier; the answer's status.
async fn post_signed(
    client: &reqwest::Client,
    base_url: &str,
    endpoint: Uuid,
    secret: &relay_wire::SigningSecret,
    body: &Value,
) -> u16 {
    let signed = Signed::new(
        std::slice::from_ref(secret),
        serde_json::to_vec(body).unwrap(),
    );
    client
        .post(format!("{base_url}/webhooks/{endpoint}"))
        .header("webhook-id", &signed.webhook_id)
        .header("webhook-timestamp", signed.timestamp.to_string())
        .header("webhook-signature", &signed.signature)
        .header("content-type", "application/json")
        .body(signed.body)
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_tenant_cannot_hurt_another() {
    let seed = seed();
    eprintln!("hostile tenant: seed {seed} (RELAY_TEST_SEED={seed} replays it)");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);

    // 1. A database, a vhost, a Redis key prefix; every tier in this process.
    let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
    let vhost = tokio::task::spawn_blocking(Vhost::create).await.unwrap();
    let waker = Waker::connect(
        &redis_url(),
        &relay_netguard::TrustRoots::platform(),
        &prefix.0,
    )
    .await
    .unwrap();
    let app = TestApp::spawn_with(
        relay_ingest::IngestConfig {
            waker: Some(waker),
            // The upstream's own send timeout is 15 s: answer well within it on a slow machine.
            answer_deadline: Duration::from_secs(10),
            listener: relay_listener::ListenerLimits {
                header_read_timeout: Duration::from_secs(2),
                max_headless_per_address: HEADLESS_PER_ADDRESS,
                ..relay_ingest::LISTENER_LIMITS
            },
            ..test_config()
        },
        Arc::new(SystemClock),
        None,
    )
    .await;
    let pool = app.db.pool.clone();
    // The operator allows the simulator's address and nothing else that is not public.
    let outbound = OutboundPolicy {
        allow_http: true,
        allow_private: false,
        allowed_networks: vec![format!("{UPSTREAM_HOST}/32").parse().unwrap()],
        ..OutboundPolicy::default()
    };
    let api = Api::start(&app.db.url, &vhost.url(), outbound.clone()).await;
    let sequencer = start_sequencer(&app.db.url, &prefix.0, 8, outbound).await;
    let publisher_pool = relay_store::connect(&app.db.url, &PoolOptions::default()).unwrap();
    let (publisher, _) =
        start_publisher(&publisher_pool, publisher_config(vhost.url(), &prefix.0)).await;

    // 2. Tenant B, onboarded through the API with the simulator's endpoints; tenant A with two
    // endpoints of its own.
    let sim_listener = tokio::net::TcpListener::bind(format!("{UPSTREAM_HOST}:0"))
        .await
        .unwrap();
    let upstream_api = format!("http://{}", sim_listener.local_addr().unwrap());
    let args = simulate_args(&app.base_url, 3, 1, seed, 20.0, 6);
    let (mut upstream, workload, infos) = prepare(&args).unwrap();
    upstream.set_faults(Faults::all());
    let (b, b_token) = api.tenant("tenant B").await;
    let (a, a_token) = api.tenant("tenant A").await;
    for info in &infos {
        api.register(&b_token, info, &upstream_api).await;
    }
    let b_ids: Vec<Uuid> = infos.iter().map(|i| i.id).collect();
    let mut a_endpoints = Vec::new();
    for _ in 0..2 {
        let (id, secret) = (Uuid::new_v4(), random_secret());
        api.ok(
            201,
            "POST",
            "/v1/endpoints",
            &a_token,
            Some(&json!({
                "id": id, "lang": "en", "upstream_base_url": upstream_api,
                "upstream_api_key": "a-key", "secrets": [secret.to_whsec()],
            })),
        )
        .await;
        a_endpoints.push((id, secret));
    }

    // 3. The workload for B; meanwhile A's poison, and the stranger's slow connections.
    let sim = Simulation::new(upstream, Duration::from_secs(15));
    relay_simulator::api::serve(sim_listener, sim.clone())
        .await
        .unwrap();
    let senders = sim.spawn_senders();
    let workload_task = tokio::spawn(sim.clone().run_workload(
        workload,
        args.rate,
        Duration::from_secs(6),
    ));

    let address = app.server.as_ref().unwrap().address;
    let stranger: std::net::IpAddr = STRANGER_HOST.parse().unwrap();
    let slow_tasks: Vec<_> = (0..SLOW_CONNECTIONS)
        .map(|_| {
            tokio::spawn(slow_connection(
                address,
                stranger,
                Duration::from_millis(500),
                Duration::from_secs(8),
            ))
        })
        .collect();

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .build()
        .unwrap();
    let mut poison_answers: BTreeMap<String, Vec<u16>> = BTreeMap::new();
    let mut poison_sent = 0;
    for round in 0..4u64 {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(200..1_200))).await;
        let mut sends = Vec::new();
        for (i, (endpoint, secret)) in a_endpoints.iter().enumerate() {
            for (label, body) in poison_bodies(*endpoint, 1_000 + round * 10 + i as u64) {
                let (client, base_url, secret) =
                    (client.clone(), app.base_url.clone(), secret.clone());
                let endpoint = *endpoint;
                sends.push(tokio::spawn(async move {
                    (
                        label,
                        post_signed(&client, &base_url, endpoint, &secret, &body).await,
                    )
                }));
                poison_sent += 1;
            }
        }
        for send in sends {
            let (label, status) = send.await.unwrap();
            poison_answers
                .entry(label.to_owned())
                .or_default()
                .push(status);
        }
    }
    let steps = workload_task.await.unwrap();
    let mut slow_ends = Vec::with_capacity(SLOW_CONNECTIONS);
    for task in slow_tasks {
        slow_ends.push(task.await.unwrap());
    }

    // A's endpoints go on after their poison: a good message of each applies.
    for (i, (endpoint, secret)) in a_endpoints.iter().enumerate() {
        let body: Value = serde_json::from_slice(&feed_body(*endpoint, 7_000 + i as u64)).unwrap();
        let status = post_signed(&client, &app.base_url, *endpoint, secret, &body).await;
        assert_eq!(status, 202, "seed {seed}: A's good message");
    }

    // 4. The control plane: A's upstreams at private addresses, and A's destination at the
    // relay's own broker, aimed at B's queue.
    for url in [
        "http://169.254.169.254/latest/meta-data",
        "http://10.0.0.1",
        "http://[fd00::1]",
        "http://localhost:6379",
        "http://0x7f000001:6379",
        "http://127.0.0.1:5672",
    ] {
        let answer = api
            .call(
                "POST",
                "/v1/endpoints",
                &a_token,
                Some(&json!({
                    "id": Uuid::new_v4(), "lang": "en", "upstream_base_url": url,
                    "upstream_api_key": "a-key", "secrets": [random_secret().to_whsec()],
                })),
            )
            .await;
        assert_eq!(answer.status, 400, "seed {seed}: {url}: {}", answer.text);
        assert_eq!(answer.json["field"], "upstream_base_url", "{}", answer.text);
    }
    let answer = api
        .call(
            "PUT",
            "/v1/destination",
            &a_token,
            Some(&json!({
                "kind": "own_exchange", "amqp_url": vhost.url(), "exchange": "",
                "routing_key": relay_publisher::tenant_queue(b),
            })),
        )
        .await;
    assert_eq!(answer.status, 400, "seed {seed}: {}", answer.text);
    assert_eq!(answer.json["field"], "amqp_url", "{}", answer.text);

    // 5. Quiescence for B; B's copies and queue against the oracle.
    sim.change(|upstream, _| upstream.set_faults(Faults::default()));
    let quiesced_in = quiesce(&pool, &sim, &b_ids, Duration::from_secs(180), seed).await;
    publisher.stop().await;
    for &id in &b_ids {
        let read = api.copy(&b_token, id).await;
        assert!(
            read == oracle(&sim, id),
            "seed {seed}: B's endpoint {id}'s copy is not the oracle's"
        );
    }
    let broker = connect_broker(&vhost.url(), "hostile tenant").await;
    let (b_messages, _) = check_tenant_queue(&broker, &pool, &sim, b, &b_ids, seed).await;

    // A's poison: stored, quarantined and listed; its good messages applied all the same.
    for (i, (endpoint, _)) in a_endpoints.iter().enumerate() {
        let path = format!("/v1/endpoints/{endpoint}/quarantine?limit=200");
        let mut listed = Value::Null;
        for _ in 0..300 {
            listed = api.ok(200, "GET", &path, &a_token, None).await;
            if listed["data"].as_array().unwrap().len() >= poison_sent / a_endpoints.len() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            listed["data"].as_array().unwrap().len(),
            poison_sent / a_endpoints.len(),
            "seed {seed}: A's endpoint {endpoint}: {listed}"
        );
        let subject = format!("announcement:{}", 7_000 + i as u64);
        let mut applied = false;
        for _ in 0..300 {
            if copy_items(&pool, *endpoint).await.contains_key(&subject) {
                applied = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            applied,
            "seed {seed}: A's endpoint {endpoint} is wedged behind its poison"
        );
        // B cannot see A's quarantine.
        let answer = api.call("GET", &path, &b_token, None).await;
        assert_eq!(answer.status, 404, "seed {seed}: {}", answer.text);
    }

    // B's broker credentials: the broker itself refuses them on A's queue.
    let _users = UsersGuard(vec![
        BrokerAccess::username(relay_store::TenantId(a)),
        BrokerAccess::username(relay_store::TenantId(b)),
    ]);
    api.ok(201, "POST", "/v1/broker/credentials", &a_token, None)
        .await;
    let made = api
        .ok(201, "POST", "/v1/broker/credentials", &b_token, None)
        .await;
    let as_b = connect(&tenant_url(&made, made["password"].as_str().unwrap()))
        .await
        .expect("B's credentials connect");
    assert_refused_but_own_queue(
        &as_b,
        &relay_publisher::tenant_queue(a),
        &relay_publisher::tenant_queue(b),
    )
    .await;
    let _ = as_b.close(200, "done").await;

    // Every message the upstream sent B was answered 2xx, attack or not.
    for &id in &b_ids {
        let upstream = sim.lock();
        for entry in upstream.log(id) {
            if let LogEntry::Answered {
                answer, webhook_id, ..
            } = entry
            {
                assert!(
                    matches!(answer, SimAnswer::Status { code, .. } if (200..300).contains(code)),
                    "seed {seed}: B's message {webhook_id} answered {answer:?}"
                );
            }
        }
    }
    for (label, answers) in &poison_answers {
        assert!(
            answers.iter().all(|s| *s == 202),
            "seed {seed}: A's {label} answered {answers:?}"
        );
    }
    let count = |end: SlowEnd| slow_ends.iter().filter(|e| **e == end).count();
    let (refused, closed, still_open) = (
        count(SlowEnd::Refused),
        count(SlowEnd::Closed),
        count(SlowEnd::StillOpen),
    );
    assert_eq!(
        refused + closed + still_open,
        SLOW_CONNECTIONS,
        "seed {seed}"
    );
    assert_eq!(
        still_open, 0,
        "seed {seed}: a slow connection outlived the header timeout"
    );
    assert!(
        refused > 0 && closed > 0,
        "seed {seed}: past the bound per address, slow connections are refused at once \
         ({refused}), and those admitted are cut at the header timeout ({closed})"
    );

    eprintln!(
        "hostile tenant: seed {seed} passed: {steps} workload steps, {b_messages} changes in B's \
         queue, {poison_sent} poison messages, {refused} slow connections refused and {closed} \
         cut, {:.1} s to quiesce",
        quiesced_in.as_secs_f64()
    );
    let _ = broker.close(200, "done").await;
    stop_simulation(&sim, senders).await;
    sequencer.stop().await;
    api.server.stop().await.unwrap();
    app.stop().await;
    drop(vhost);
    drop(prefix);
}
