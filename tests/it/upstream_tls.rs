//! The upstream over HTTPS: the simulator serves its API under a CA the test makes, and the
//! relay trusts that CA through the operator's CA file (`RELAY_TLS_CA_FILE`, here
//! `TestCa::trust()`). Reloads, refetches and a rewind go over TLS and the copy ends equal to the
//! simulator's oracle; an upstream whose certificate the relay refuses (another CA's, an expired
//! one, one for another name) shows in the endpoint's state as `failing`, with the check that
//! failed.
//!
//! Seeded: every run prints its seed; `RELAY_TEST_SEED=<seed>` replays one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_netguard::{OutboundPolicy, TrustRoots};
use relay_sequencer::{Sequencer, SequencerConfig, SequencerMetrics};
use relay_simulator::{EndpointInfo, Faults, Simulation, Workload};
use relay_store::PoolOptions;
use relay_tests::{printed_seed, RedisPrefix, TestApp};
use serde_json::Value;
use sqlx::PgPool;
use tokio::net::TcpListener;
use uuid::Uuid;

use crate::stack::{
    copy_items, create_endpoint, describe_difference, oracle, sequencer_config,
    start_sequencer_with, stop_simulation, tenant_of_key, Api, Items,
};
use crate::tls_support::{ServerIdentity, TestCa};

/// The relay's side: the front tier, a sequencer and the control plane, every upstream call
/// trusting `trust` and allowed to 127.0.0.1 only (https only: plain http stays refused).
struct Relay {
    app: TestApp,
    sequencer: Sequencer,
    api: Api,
    _prefix: RedisPrefix,
}

fn policy() -> OutboundPolicy {
    OutboundPolicy {
        allow_http: false,
        allow_private: false,
        allowed_networks: vec!["127.0.0.1/32".parse().unwrap()],
        ..OutboundPolicy::default()
    }
}

impl Relay {
    async fn start(trust: TrustRoots) -> Self {
        let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
        let app = TestApp::spawn_waking(&prefix.0).await;
        let sequencer = start_sequencer_with(
            &app.db.url,
            SequencerConfig {
                trust: trust.clone(),
                ..sequencer_config(&prefix.0, 8, policy())
            },
            SequencerMetrics::unregistered(),
        )
        .await;
        let api_pool = relay_store::connect(&app.db.url, &PoolOptions::default()).unwrap();
        let api = Api::serve(api_pool, |config| {
            config.upstream_timeout = Duration::from_secs(5);
            config.outbound = policy();
            config.trust = trust;
        })
        .await;
        Self {
            app,
            sequencer,
            api,
            _prefix: prefix,
        }
    }

    fn pool(&self) -> &PgPool {
        &self.app.db.pool
    }

    /// Registers the simulator's endpoints (one tenant per API key) reading `upstream`; the
    /// token of each endpoint's tenant.
    async fn register(&self, infos: &[EndpointInfo], upstream: &str) -> Vec<String> {
        let mut tokens = Vec::new();
        for info in infos {
            let tenant = tenant_of_key(self.pool(), &info.key_token, "over tls").await;
            create_endpoint(self.pool(), tenant, info, upstream).await;
            tokens.push(Api::tenant_token(tenant));
        }
        tokens
    }

    async fn state(&self, token: &str, endpoint: Uuid) -> Value {
        self.api
            .ok(
                200,
                "GET",
                &format!("/v1/endpoints/{endpoint}/state"),
                token,
                None,
            )
            .await
    }

    async fn stop(self) {
        self.sequencer.stop().await;
        self.api.stop().await;
        self.app.stop().await;
    }
}

/// A simulated upstream serving its API over HTTPS with `identity`'s certificate, sending its
/// messages to `receiver`: its endpoints, its workload and its API's base URL.
async fn simulator(
    identity: &ServerIdentity,
    receiver: &str,
    seed: u64,
    endpoints: usize,
    faults: &str,
) -> (Arc<Simulation>, Workload, Vec<EndpointInfo>, String) {
    let (upstream, workload, infos) =
        crate::stack::simulation(seed, receiver, endpoints, faults.parse().unwrap());
    let sim = Simulation::new(upstream, Duration::from_secs(2));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = relay_simulator::api::serve_tls(listener, sim.clone(), identity.server_config())
        .await
        .unwrap();
    (sim, workload, infos, format!("https://{address}"))
}

/// `changes` steps of the workload, a few milliseconds apart so that messages interleave with
/// the relay's reads.
async fn drive(sim: &Simulation, workload: &mut Workload, changes: usize) {
    for _ in 0..changes {
        sim.change(|upstream, now_ms| workload.step(upstream, now_ms));
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
}

/// Waits until the simulator has sent everything and each endpoint's copy equals the oracle
/// with nothing waiting and no reload running, three looks in a row; panics after 90 s with
/// what differs.
async fn converge(pool: &PgPool, sim: &Simulation, ids: &[Uuid], seed: u64) {
    let started = Instant::now();
    let mut stable = 0;
    loop {
        let idle = sim.wait_idle(Duration::from_millis(10)).await;
        let (waiting, reloading): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM messages m
                     LEFT JOIN endpoint_apply_cursors c ON c.endpoint_id = m.endpoint_id
                     WHERE m.arrival_seq > coalesce(c.applied_arrival_seq, 0)
                       AND m.endpoint_id = ANY($1)),
                    (SELECT count(*) FROM endpoint_tracks
                     WHERE reload IS NOT NULL AND endpoint_id = ANY($1))",
        )
        .bind(ids)
        .fetch_one(pool)
        .await
        .unwrap();
        let mut equal = true;
        for &id in ids {
            if copy_items(pool, id).await != oracle(sim, id) {
                equal = false;
            }
        }
        if idle && waiting == 0 && reloading == 0 && equal {
            stable += 1;
            if stable == 3 {
                return;
            }
        } else {
            stable = 0;
        }
        if started.elapsed() > Duration::from_secs(90) {
            let mut report = Vec::new();
            for &id in ids {
                let (copy, truth): (Items, Items) = (copy_items(pool, id).await, oracle(sim, id));
                report.push(format!(
                    "{id}: {} items, oracle {}: {}",
                    copy.len(),
                    truth.len(),
                    describe_difference(&copy, &truth)
                ));
            }
            panic!(
                "seed {seed}: no convergence over TLS within 90 s (idle {idle}, waiting \
                 {waiting}, reloading {reloading}): {}",
                report.join(" | ")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Events of `kind` the relay stored for `ids` (`reset`: the endpoint events that begin a
/// reload; `refetch`: feed events the relay reads the item for).
async fn stored_events(pool: &PgPool, ids: &[Uuid], kind: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM messages m
         CROSS JOIN LATERAL jsonb_array_elements(convert_from(m.body, 'UTF8')::jsonb -> 'events') e
         WHERE m.endpoint_id = ANY($1)
           AND CASE $2 WHEN 'reset' THEN e->>'type' = 'webhook_endpoint.reset'
                       ELSE e #>> '{data,type}' = 'refetch' END",
    )
    .bind(ids)
    .bind(kind)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_refetches_and_a_rewind_over_tls_leave_the_copy_equal_to_the_oracle() {
    let seed = printed_seed("upstream_tls");
    let ca = TestCa::new("upstream");
    let relay = Relay::start(ca.trust()).await;
    // Refetch events (the relay reads the item), resets in the middle of a reload and expired
    // cursors (the reload reads again): more reads over TLS.
    let faults = "refetch=0.4,reset_mid_reload=0.05,cursor_expired=0.05";
    let (sim, mut workload, infos, upstream) = simulator(
        &ca.issue(&["127.0.0.1", "localhost"]),
        &relay.app.base_url,
        seed,
        2,
        faults,
    )
    .await;
    let tokens = relay.register(&infos, &upstream).await;
    let ids: Vec<Uuid> = infos.iter().map(|i| i.id).collect();
    let senders = sim.spawn_senders();

    drive(&sim, &mut workload, 60).await;
    sim.change(|up, _| up.set_faults(Faults::default()));
    converge(relay.pool(), &sim, &ids, seed).await;
    // The copy could only come from https reads: the policy refuses plain http.
    assert!(
        stored_events(relay.pool(), &ids, "reset").await > 0,
        "seed {seed}: no reload ran"
    );
    assert!(
        stored_events(relay.pool(), &ids, "refetch").await > 0,
        "seed {seed}: no refetch was read"
    );

    // A rewind after a restore: the control plane calls the upstream over TLS. The last message
    // taken is a feed message (changes after the resets), so the plan is a rewind.
    drive(&sim, &mut workload, 10).await;
    converge(relay.pool(), &sim, &ids, seed).await;
    let rewound = relay
        .api
        .ok(
            200,
            "POST",
            &format!("/v1/endpoints/{}/tracks/feed/rewind", ids[0]),
            &tokens[0],
            None,
        )
        .await;
    assert_eq!(rewound["plan"], "rewind", "seed {seed}: {rewound}");
    assert_eq!(rewound["upstream"]["status"], 202, "seed {seed}: {rewound}");
    drive(&sim, &mut workload, 10).await;
    converge(relay.pool(), &sim, &ids, seed).await;

    for (id, token) in ids.iter().zip(&tokens) {
        let state = relay.state(token, *id).await;
        assert_eq!(state["upstream"]["status"], "ok", "seed {seed}: {state}");
        assert_eq!(
            relay.api.copy(token, *id).await,
            oracle(&sim, *id),
            "seed {seed}: {id}'s copy read through the API"
        );
    }

    stop_simulation(&sim, senders).await;
    relay.stop().await;
}

/// Waits until the endpoint's state says its upstream is failing; the state.
async fn failing_state(relay: &Relay, token: &str, endpoint: Uuid) -> Value {
    let started = Instant::now();
    loop {
        let state = relay.state(token, endpoint).await;
        if state["upstream"]["status"] == "failing" {
            return state;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the upstream never showed failing: {state}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_certificate_the_relay_refuses_shows_in_the_endpoints_state() {
    let seed = printed_seed("upstream_tls");
    let ca = TestCa::new("trusted");
    let other = TestCa::new("other");
    let relay = Relay::start(ca.trust()).await;
    let cases = [
        (
            other.issue(&["127.0.0.1", "localhost"]),
            "certificate_unknown_issuer",
        ),
        (
            ca.issue_expired(&["127.0.0.1", "localhost"]),
            "certificate_expired",
        ),
        (ca.issue(&["upstream.example"]), "certificate_name_mismatch"),
    ];
    let mut running = Vec::new();
    for (i, (identity, kind)) in cases.into_iter().enumerate() {
        // Each simulator's endpoints differ: their ids come from the seed.
        let (sim, _, infos, upstream) = simulator(
            &identity,
            &relay.app.base_url,
            seed.wrapping_add(i as u64),
            1,
            "none",
        )
        .await;
        let tokens = relay.register(&infos, &upstream).await;
        // The endpoint's first message is a reset: its reload reads the feed, and fails.
        let senders = sim.spawn_senders();
        let state = failing_state(&relay, &tokens[0], infos[0].id).await;
        let upstream_state = &state["upstream"];
        assert_eq!(upstream_state["last_error_kind"], kind, "{state}");
        let error = upstream_state["last_error"].as_str().unwrap();
        assert!(error.contains(&upstream), "{error}");
        assert!(
            error.contains("certificate"),
            "the error names its cause: {error}"
        );
        assert!(upstream_state["failing_since"].is_string(), "{state}");
        assert!(upstream_state["last_failure_at"].is_string(), "{state}");
        assert_eq!(state["reload_running"], true, "{state}");
        running.push((sim, senders));
    }

    for (sim, senders) in running {
        stop_simulation(&sim, senders).await;
    }
    relay.stop().await;
}
