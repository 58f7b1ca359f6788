//! The whole pipeline end to end, onboarded through the control plane only: the simulated
//! upstream (every fault on) sends signed webhooks over real HTTP to the real front tier; an
//! in-process sequencer applies them into Postgres (real Redis locks and wake-ups); the
//! publisher sends the outbox to each tenant's RabbitMQ queue through a TCP proxy that takes the
//! broker away mid-run, and is killed (aborted) once and replaced. At quiescence:
//! - every endpoint's copy read back through the API equals the simulator's oracle;
//! - each tenant's queue, rebuilt by the reference consumer, equals the oracle per endpoint, with
//!   no change sequence missing, nothing of another tenant, and any repeat only of the same
//!   message_id (and the same message);
//! - tenant B's token on tenant A's endpoint gets a 404.
//!
//! Seeded: every run prints its seed; `RELAY_TEST_SEED=<seed>` replays one.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_netguard::OutboundPolicy;
use relay_simulator::cli::prepare;
use relay_simulator::Faults;
use relay_store::PoolOptions;
use relay_tests::{amqp_addr, printed_seed, PgProxy, ProxyMode, TestApp, TestDb};
use uuid::Uuid;

use crate::stack::{
    change_count, check_tenant_queue, connect_broker, describe_difference, labelled, metric,
    oracle, publisher_config, quiesce, sequencer_config, serve_simulation, simulate_args,
    start_publisher, start_sequencer_with, stop_simulation, upstream_listener, Api, Relay, Room,
};
use relay_publisher::PublisherConfig;
use relay_sequencer::{SequencerConfig, SequencerMetrics};

// ---- The run ----

/// What happens to the broker and the publisher while the workload runs, at seeded moments.
#[derive(Debug, Clone, Copy)]
enum Disruption {
    /// The proxy in front of the broker stops passing traffic.
    BrokerAway(ProxyMode),
    BrokerBack,
    /// The publisher is aborted (nothing finishes, no lease is released) and a new one started.
    KillPublisher,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn onboarded_through_the_api_each_tenants_queue_and_copy_equal_the_oracle() {
    let seed = printed_seed("pipeline");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let endpoint_count = 4;
    let rate = 30.0;
    let duration = Duration::from_secs(6);

    // 1. A database, a vhost, a Redis key prefix; the front tier with its waker.
    // As in `relay all`, the front tier hands the messages it stores to the sequencer's
    // workers in memory (those it cannot hand over are announced through Redis and read back).
    let room = Room::new().await;
    let (prefix, vhost) = (&room.prefix, &room.vhost);
    let messages = relay_coord::Handoff::new(4 << 20, 64 << 20);
    let app =
        TestApp::spawn_handing_on(TestDb::new().await, &prefix.0, Some(messages.clone())).await;
    let pool = app.db.pool.clone();

    // 2. The control plane, a sequencer and the publisher (its broker behind a proxy, on a pool
    // of its own). As in `relay all`, the sequencer hands the changes it commits to the
    // publisher in memory; the publisher killed below leaves its inboxes behind, and its
    // successor takes the tenants over from the outbox and the hand-over both.
    let changes = relay_coord::Handoff::new(8 << 20, 64 << 20);
    let sequencer_metrics = SequencerMetrics::unregistered();
    let relay = Relay {
        api: Api::start(&app.db.url, &vhost.url(), OutboundPolicy::ANY).await,
        sequencer: start_sequencer_with(
            &app.db.url,
            SequencerConfig {
                changes_handoff: Some(changes.clone()),
                messages_handoff: Some(messages),
                ..sequencer_config(&prefix.0, 16, OutboundPolicy::ANY)
            },
            sequencer_metrics.clone(),
        )
        .await,
        app,
        publisher: None,
    };
    let publisher_config = |amqp_url: String| PublisherConfig {
        changes_handoff: Some(changes.clone()),
        ..publisher_config(amqp_url, &prefix.0)
    };
    let (app, api) = (&relay.app, &relay.api);
    let proxy = PgProxy::start(amqp_addr()).await;
    let amqp_url = vhost.url_via(proxy.address);
    let publisher_pool = relay_store::connect(&app.db.url, &PoolOptions::default()).unwrap();
    let (mut publisher, first_registry) =
        start_publisher(&publisher_pool, publisher_config(amqp_url.clone())).await;

    // 3. Onboarding, through the API only.
    let (sim_listener, upstream_api) = upstream_listener("127.0.0.1").await;
    let args = simulate_args(
        &app.base_url,
        endpoint_count,
        2,
        seed,
        rate,
        duration.as_secs(),
    );
    let (mut upstream, workload, infos) = prepare(&args).unwrap();
    upstream.set_faults(Faults::all());
    let keys: BTreeSet<&str> = infos.iter().map(|i| i.key_token.as_str()).collect();
    assert_eq!(
        keys.len(),
        2,
        "seed {seed}: the endpoints are over two keys"
    );

    // Simulator key → (tenant, the tenant's token).
    let mut tenant_of_key: BTreeMap<&str, (Uuid, String)> = BTreeMap::new();
    for (i, key) in keys.iter().enumerate() {
        let (tenant, token) = api.tenant(&format!("pipeline tenant {i}")).await;
        let own = api.ok(200, "GET", "/v1/tenant", &token, None).await;
        assert_eq!(own["id"], tenant.to_string());
        let destination = api.use_relay_queue(&token).await;
        assert_eq!(destination["kind"], "relay_queue", "{destination}");
        assert_eq!(destination["default"], false, "{destination}");
        tenant_of_key.insert(key, (tenant, token));
    }
    // Endpoint → (tenant, token).
    let mut owner: BTreeMap<Uuid, (Uuid, String)> = BTreeMap::new();
    for info in &infos {
        let (tenant, token) = tenant_of_key[info.key_token.as_str()].clone();
        let created = api.register(&token, info, &upstream_api).await;
        assert_eq!(created["id"], info.id.to_string());
        assert_eq!(created["upstream_api_key_set"], true);
        owner.insert(info.id, (tenant, token));
    }
    let tenants: Vec<(Uuid, String)> = tenant_of_key.values().cloned().collect();

    // 4. The simulator: its API, a sender per endpoint, the workload; meanwhile the broker goes
    // away and comes back, and the publisher is killed and replaced, at seeded moments.
    let (sim, senders) = serve_simulation(upstream, Duration::from_secs(2), sim_listener).await;
    // The broker goes away while the first publisher runs (so it is felt), and the publisher is
    // killed after it came back, before the workload ends.
    let away_at = rng.gen_range(1_000..2_000u64);
    let away_for = rng.gen_range(1_800..2_500u64);
    let away_mode = if rng.gen_bool(0.5) {
        ProxyMode::Refuse
    } else {
        ProxyMode::Blackhole
    };
    let kill_at = rng.gen_range(away_at + away_for + 200..5_800u64);
    let mut plan = vec![
        (away_at, Disruption::BrokerAway(away_mode)),
        (away_at + away_for, Disruption::BrokerBack),
        (kill_at, Disruption::KillPublisher),
    ];
    plan.sort_by_key(|(at, _)| *at);
    eprintln!("pipeline: seed {seed}: disruptions (ms after the start) {plan:?}");
    let mut last_registry = prometheus::Registry::new();
    let started = Instant::now();
    let workload_task = tokio::spawn(sim.clone().run_workload(workload, rate, duration));
    for (at, disruption) in plan {
        tokio::time::sleep_until((started + Duration::from_millis(at)).into()).await;
        match disruption {
            Disruption::BrokerAway(mode) => proxy.set(mode),
            Disruption::BrokerBack => proxy.set(ProxyMode::Pass),
            Disruption::KillPublisher => {
                publisher.abort();
                (publisher, last_registry) =
                    start_publisher(&publisher_pool, publisher_config(amqp_url.clone())).await;
            }
        }
    }
    let steps = workload_task.await.unwrap();
    proxy.set(ProxyMode::Pass);
    // The outage was felt: the first publisher's connection was cut or its confirms never came.
    let broker_errors = metric(&first_registry, "relay_publisher_broker_errors_total");
    assert!(
        broker_errors > 0.0,
        "seed {seed}: the broker outage went unnoticed by the publisher"
    );

    // 5. Quiescence: the faults stop (so no new reset is provoked), the upstream sends what is
    // left, the relay applies it, merges its reloads and publishes every change.
    sim.change(|upstream, _| upstream.set_faults(Faults::default()));
    let ids: Vec<Uuid> = infos.iter().map(|i| i.id).collect();
    let quiesced_in = quiesce(&pool, &sim, &ids, Duration::from_secs(180), seed).await;
    // The publisher is done: stop it, so the queues' counts are final.
    publisher.stop().await;
    // Most changes were handed over; some were read (a tenant's first changes, those of the
    // publisher's outage and its successor's first).
    let taken = |registry: &prometheus::Registry, source: &str| {
        labelled(
            registry,
            "relay_publisher_changes_taken_total",
            "source",
            source,
        )
    };
    let handed = taken(&first_registry, "handed") + taken(&last_registry, "handed");
    let read = taken(&first_registry, "outbox") + taken(&last_registry, "outbox");
    eprintln!("pipeline: seed {seed}: changes handed over {handed}, read from the outbox {read}");
    assert!(handed > 0.0, "seed {seed}: nothing was handed over");
    // Most messages too; an endpoint's first messages, and those stored before its worker
    // took it after a lull, were read from Postgres.
    let messages_taken = |source: &str| {
        sequencer_metrics
            .messages_taken
            .with_label_values(&[source])
            .get()
    };
    eprintln!(
        "pipeline: seed {seed}: messages handed over {}, read from Postgres {}",
        messages_taken("handed"),
        messages_taken("postgres")
    );
    assert!(
        messages_taken("handed") > 0,
        "seed {seed}: no message was handed over"
    );

    // 6a. Each endpoint's copy, read through the API with its tenant's token, is the oracle's;
    // its state says nothing is left.
    let mut items_total = 0;
    for &id in &ids {
        let (_, token) = &owner[&id];
        let truth = oracle(&sim, id);
        let read = api.copy(token, id).await;
        assert!(
            read == truth,
            "seed {seed}: endpoint {id}'s copy through the API is not the oracle's ({} items, \
             oracle {}): {}",
            read.len(),
            truth.len(),
            describe_difference(&read, &truth)
        );
        items_total += read.len();
        let state = api
            .ok(
                200,
                "GET",
                &format!("/v1/endpoints/{id}/state"),
                token,
                None,
            )
            .await;
        assert_eq!(state["messages_waiting"], 0, "seed {seed}: {state}");
        assert_eq!(state["outbox_backlog"], 0, "seed {seed}: {state}");
        assert_eq!(state["reload_running"], false, "seed {seed}: {state}");
        assert_eq!(
            state["last_change_seq"].as_i64(),
            Some(change_count(&pool, id).await),
            "seed {seed}: {state}"
        );
    }

    // 6b. Each tenant's queue rebuilds each of its endpoints' copies: the oracle's items, every
    // change sequence once, none of another tenant, repeats only of the same message.
    let broker = connect_broker(&vhost.url(), "pipeline").await;
    let mut messages_total = 0;
    let mut repeats_total = 0;
    for (tenant, _) in &tenants {
        let own: Vec<Uuid> = ids
            .iter()
            .copied()
            .filter(|id| owner[id].0 == *tenant)
            .collect();
        let (messages, repeats) =
            check_tenant_queue(&broker, &pool, &sim, *tenant, &own, seed).await;
        messages_total += messages;
        repeats_total += repeats;
    }

    assert!(
        messages_total > 0,
        "seed {seed}: no change was published at all"
    );

    // 6c. A tenant's token on another tenant's endpoint: 404, never its data.
    for &id in &ids {
        let (tenant, _) = &owner[&id];
        for (other, token) in tenants.iter().filter(|(t, _)| t != tenant) {
            for path in [
                format!("/v1/endpoints/{id}/copy"),
                format!("/v1/endpoints/{id}/state"),
                format!("/v1/endpoints/{id}"),
            ] {
                let answer = api.call("GET", &path, Some(token), None).await;
                assert_eq!(
                    answer.status, 404,
                    "seed {seed}: tenant {other} on {tenant}'s {path}: {}",
                    answer.text
                );
                assert!(
                    !answer.text.contains("\"data\""),
                    "seed {seed}: {}",
                    answer.text
                );
            }
        }
    }

    eprintln!(
        "pipeline: seed {seed} passed: {} endpoints, {steps} workload steps, {items_total} items, \
         {messages_total} messages ({repeats_total} repeats), {broker_errors} broker errors before \
         the kill, {:.1} s to quiesce",
        ids.len(),
        quiesced_in.as_secs_f64()
    );

    // 7. Clean up: the servers stop; the vhost, the Redis keys and the database go when their
    // guards drop.
    let _ = broker.close(200, "done").await;
    stop_simulation(&sim, senders).await;
    relay.stop().await;
    drop(proxy);
    drop(room);
}
