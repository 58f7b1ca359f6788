//! A change to an endpoint's registration reaches the sequencer at once, through the control
//! plane: a PATCH of the upstream URL and key ends a failing reload's pause and its next read
//! uses the new values; an endpoint registered without upstream settings applies its messages,
//! reads nothing and keeps no worker busy until it has them, then reloads.
//!
//! The reload's pauses here are a minute long, so a reload that merges within seconds of the
//! PATCH can only have been woken by it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_netguard::{OutboundPolicy, RetryPolicy};
use relay_sequencer::{Sequencer, SequencerConfig, SequencerMetrics};
use relay_simulator::{EndpointInfo, Faults, Simulation, Workload};
use relay_tests::{printed_seed, RedisPrefix, TestApp};
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use crate::stack::{
    backlog, copy_items, describe_difference, metric, oracle, sequencer_config, serve_simulation,
    simulation, start_sequencer_with, upstream_listener, Api,
};

/// Longer than any wait below: a read after the PATCH within a wait came from the wake-up.
const LONG_PAUSE: Duration = Duration::from_secs(60);
/// How long the reload may take once it has the right settings (a slow machine's worst).
const MERGE_LIMIT: Duration = Duration::from_secs(30);

struct Relay {
    _prefix: RedisPrefix,
    app: TestApp,
    api: Api,
    token: String,
    sequencer: Option<Sequencer>,
    registry: prometheus::Registry,
    sim: Arc<Simulation>,
    upstream_api: String,
    info: EndpointInfo,
    seed: u64,
}

impl Relay {
    /// The front tier, the control plane and a sequencer whose reloads pause a minute after a
    /// failed read; a simulator with one endpoint, not yet registered; a tenant.
    async fn start(seed: u64) -> (Self, Workload) {
        let prefix = RedisPrefix(format!("relay-test-{}:", Uuid::new_v4().simple()));
        let app = TestApp::spawn_waking(&prefix.0).await;
        let api = Api::start(
            &app.db.url,
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            OutboundPolicy::ANY,
        )
        .await;
        let registry = prometheus::Registry::new();
        let config = SequencerConfig {
            reload_retry: RetryPolicy {
                first: LONG_PAUSE,
                max: LONG_PAUSE,
            },
            ..sequencer_config(&prefix.0, 8, OutboundPolicy::ANY)
        };
        let sequencer = start_sequencer_with(
            &app.db.url,
            config,
            SequencerMetrics::register(&registry).unwrap(),
        )
        .await;

        let (sim_listener, upstream_api) = upstream_listener("127.0.0.1").await;
        let (upstream, workload, infos) = simulation(seed, &app.base_url, 1, Faults::default());
        let (sim, _senders) =
            serve_simulation(upstream, Duration::from_secs(15), sim_listener).await;

        let (_, token) = api.tenant("registration changes").await;
        let relay = Self {
            _prefix: prefix,
            app,
            api,
            token,
            sequencer: Some(sequencer),
            registry,
            sim,
            upstream_api,
            info: infos.into_iter().next().unwrap(),
            seed,
        };
        (relay, workload)
    }

    fn pool(&self) -> &PgPool {
        &self.app.db.pool
    }

    fn endpoint(&self) -> Uuid {
        self.info.id
    }

    /// Registers the simulator's endpoint with `upstream` (base URL and key) merged in.
    async fn register(&self, upstream: Value) {
        let mut body = json!({
            "id": self.info.id, "lang": self.info.lang, "secrets": self.info.secrets,
        });
        body.as_object_mut()
            .unwrap()
            .extend(upstream.as_object().unwrap().clone());
        self.api
            .ok(201, "POST", "/v1/endpoints", &self.token, Some(&body))
            .await;
    }

    /// The right upstream settings, as a PATCH gives them.
    async fn patch_right_settings(&self) {
        self.api
            .ok(
                200,
                "PATCH",
                &format!("/v1/endpoints/{}", self.endpoint()),
                &self.token,
                Some(&json!({
                    "upstream_base_url": self.upstream_api,
                    "upstream_api_key": self.info.key_token,
                })),
            )
            .await;
    }

    /// Runs the workload to its end, then waits until every message is applied.
    async fn deliver(&self, workload: Workload) {
        self.sim
            .clone()
            .run_workload(workload, 20.0, Duration::from_secs(3))
            .await;
        self.wait_for("every message applied", MERGE_LIMIT, || async {
            self.sim.wait_idle(Duration::from_millis(10)).await
                && backlog(self.pool(), &[self.endpoint()]).await.waiting == 0
        })
        .await;
    }

    /// The endpoint's state, as the control plane shows it.
    async fn state(&self) -> Value {
        self.api
            .ok(
                200,
                "GET",
                &format!("/v1/endpoints/{}/state", self.endpoint()),
                &self.token,
                None,
            )
            .await
    }

    async fn reloading(&self) -> i64 {
        backlog(self.pool(), &[self.endpoint()]).await.reloading
    }

    async fn wait_for<F, Fut>(&self, what: &str, limit: Duration, mut done: F) -> Duration
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let started = Instant::now();
        while !done().await {
            assert!(
                started.elapsed() < limit,
                "seed {}: not {what} within {limit:?}",
                self.seed
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        started.elapsed()
    }

    /// The reload merged and the copy is the oracle's.
    async fn converged(&self) {
        let endpoint = self.endpoint();
        self.wait_for("converged", MERGE_LIMIT, || async {
            self.reloading().await == 0
                && copy_items(self.pool(), endpoint).await == oracle(&self.sim, endpoint)
        })
        .await;
        let (copy, truth) = (
            copy_items(self.pool(), endpoint).await,
            oracle(&self.sim, endpoint),
        );
        assert!(
            !truth.is_empty(),
            "seed {}: the workload made no item",
            self.seed
        );
        assert_eq!(
            copy,
            truth,
            "seed {}: {}",
            self.seed,
            describe_difference(&copy, &truth)
        );
    }

    async fn stop(mut self) {
        self.sequencer.take().unwrap().stop().await;
    }
}

#[tokio::test]
async fn a_patched_url_and_key_reach_the_failing_reload_at_once() {
    let seed = printed_seed("registration changes");
    let (relay, workload) = Relay::start(seed).await;
    // Nothing listens at port 9 of loopback: every read fails at connect, with a stale key.
    relay
        .register(json!({
            "upstream_base_url": "http://127.0.0.1:9", "upstream_api_key": "stale-key",
        }))
        .await;
    relay.deliver(workload).await;
    let failures = "relay_sequencer_upstream_failures_total";
    relay
        .wait_for("a failed reload read", MERGE_LIMIT, || async {
            metric(&relay.registry, failures) >= 1.0
        })
        .await;
    assert_eq!(relay.reloading().await, 1, "seed {seed}: the reload waits");
    let state = relay.state().await;
    assert_eq!(
        (
            &state["upstream"]["status"],
            &state["upstream"]["last_error_kind"]
        ),
        (&json!("failing"), &json!("connect")),
        "seed {seed}: {state}"
    );

    // The reload now pauses a minute; the PATCH ends the pause. (Messages that replaced the
    // reload while they were applied each began one that read at once, so there may have been
    // more than one failure before.)
    let failed_before = metric(&relay.registry, failures);
    let patched = Instant::now();
    relay.patch_right_settings().await;
    relay.converged().await;
    let took = patched.elapsed();
    assert!(
        took < LONG_PAUSE / 2,
        "seed {seed}: the reload merged {took:?} after the PATCH: it waited out its pause"
    );
    assert_eq!(
        metric(&relay.registry, failures),
        failed_before,
        "seed {seed}: a read failed after the PATCH"
    );
    let state = relay.state().await;
    assert_eq!(state["upstream"]["status"], "ok", "seed {seed}: {state}");
    relay.stop().await;
}

#[tokio::test]
async fn an_endpoint_without_upstream_settings_waits_for_them_without_spinning() {
    let seed = printed_seed("registration changes");
    let (relay, workload) = Relay::start(seed).await;
    relay.register(json!({})).await;
    relay.deliver(workload).await;
    // The first message asked for a reload, which cannot read anything yet; the state says why.
    assert_eq!(relay.reloading().await, 1, "seed {seed}");
    let state = relay.state().await;
    assert_eq!(
        (&state["reload_running"], &state["upstream"]["status"]),
        (&json!(true), &json!("needs_settings")),
        "seed {seed}: {state}"
    );

    // Nothing spins: once the worker that applied the messages let go, over two seconds (ten
    // sweeps) no reload runs, no upstream read is tried and no worker holds the endpoint.
    relay
        .wait_for("the worker idle", MERGE_LIMIT, || async {
            metric(&relay.registry, "relay_sequencer_endpoints_owned") == 0.0
        })
        .await;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(2) {
        assert_eq!(
            metric(&relay.registry, "relay_sequencer_reloads_running"),
            0.0,
            "seed {seed}"
        );
        assert_eq!(
            metric(&relay.registry, "relay_sequencer_endpoints_owned"),
            0.0,
            "seed {seed}: a worker holds an endpoint that has nothing it can do"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        metric(&relay.registry, "relay_sequencer_upstream_failures_total"),
        0.0,
        "seed {seed}"
    );

    // The settings arrive: the reload starts and merges without a restart.
    relay.patch_right_settings().await;
    relay.converged().await;
    let state = relay.state().await;
    assert_eq!(state["upstream"]["status"], "ok", "seed {seed}: {state}");
    relay.stop().await;
}
