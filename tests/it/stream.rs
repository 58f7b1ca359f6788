//! Replay and resync through the API, while the simulator's workload flows with every fault:
//! - a consumer that lost everything and starts empty just after `POST .../resync` rebuilds the
//!   resynced endpoint's copy from the queue alone, equal to the oracle;
//! - `POST .../replay` from a `change_seq` sends those changes again under their own message
//!   ids: a consumer that drops the ids it has seen is left with the same copy, the oracle's.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use relay_publisher::{ChangeMessage, ReferenceConsumer};
use relay_simulator::cli::prepare;
use relay_simulator::Faults;
use relay_tests::printed_seed;
use serde_json::json;
use uuid::Uuid;

use crate::publisher::{Collector, Delivered};
use crate::stack::{
    assert_refused_field, connect_broker, oracle, quiesce, serve_simulation, simulate_args,
    stop_simulation, upstream_listener, without_positions, Relay, Room,
};

/// A consumer that drops every message id it has seen, and applies the rest in order.
struct SetDeduplicating {
    seen: HashSet<String>,
    copy: ReferenceConsumer,
    dropped: usize,
}

impl SetDeduplicating {
    fn new(tenant: Uuid) -> Self {
        Self {
            seen: HashSet::new(),
            copy: ReferenceConsumer::new(tenant),
            dropped: 0,
        }
    }

    fn take(&mut self, delivered: &[Delivered]) {
        for message in delivered {
            if !self.seen.insert(message.message_id.clone()) {
                self.dropped += 1;
                continue;
            }
            self.copy
                .receive(&ChangeMessage::decode(&message.body).unwrap());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_rebuilds_an_empty_consumer_and_a_replay_changes_no_deduplicating_one() {
    let seed = printed_seed("stream");
    let room = Room::new().await;
    let mut relay = Relay::start(&room).await;
    let (pool, api) = (relay.pool().clone(), &relay.api);

    let (sim_listener, upstream_api) = upstream_listener("127.0.0.1").await;
    let mut args = simulate_args(&relay.app.base_url, 2, 1, seed, 30.0, 8);
    args.select_all = true;
    let (mut upstream, workload, infos) = prepare(&args).unwrap();
    upstream.set_faults(Faults::all());
    let (tenant, token) = api.tenant("stream").await;
    for info in &infos {
        api.register(&token, info, &upstream_api).await;
    }
    let (resynced, replayed) = (infos[0].id, infos[1].id);
    api.use_relay_queue(&token).await;

    // The consumer that keeps its state all along, reading the queue from the start.
    let broker = connect_broker(&room.vhost.url(), "stream").await;
    let queue = relay_publisher::tenant_queue(tenant);
    // Declared as the publisher declares it, so the consumer can start before the first change.
    let channel = broker.create_channel().await.unwrap();
    let mut arguments = relay_publisher::lapin::types::FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        relay_publisher::lapin::types::AMQPValue::LongString("quorum".into()),
    );
    channel
        .queue_declare(
            &queue,
            relay_publisher::lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            arguments,
        )
        .await
        .unwrap();
    let collector = Collector::start(&broker, &queue).await;

    let (sim, senders) = serve_simulation(upstream, Duration::from_secs(2), sim_listener).await;
    let workload = tokio::spawn(
        sim.clone()
            .run_workload(workload, 30.0, Duration::from_secs(8)),
    );

    // Mid-stream, a consumer loses everything: it asks for a resync and reads on from there.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let before_resync = collector.received().len();
    let answer = api
        .ok(
            202,
            "POST",
            &format!("/v1/endpoints/{resynced}/resync"),
            &token,
            None,
        )
        .await;
    let epoch = answer["epoch"].as_u64().unwrap();
    assert!(epoch > 1, "{answer}");
    workload.await.unwrap();
    sim.change(|upstream, _| upstream.set_faults(Faults::default()));
    let ids: Vec<Uuid> = infos.iter().map(|i| i.id).collect();
    quiesce(&pool, &sim, &ids, Duration::from_secs(180), seed).await;
    let (resynced_truth, replayed_truth) = (oracle(&sim, resynced), oracle(&sim, replayed));

    // Everything published has come: the outbox's last change of each endpoint is in.
    let wait_for_queue = |what: &'static str, done: &dyn Fn(&[Delivered]) -> bool| {
        let started = Instant::now();
        loop {
            let received = collector.received();
            if done(&received) {
                return received;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "seed {seed}: {what}: {} messages",
                received.len()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let last_ids: Vec<String> = {
        let mut last = Vec::new();
        for &id in &ids {
            let (epoch, seq) = crate::stack::stream_position(&pool, id).await;
            last.push(format!("{id}:{epoch}:{seq}"));
        }
        last
    };
    let received = tokio::task::block_in_place(|| {
        wait_for_queue("the last changes", &|received| {
            last_ids
                .iter()
                .all(|id| received.iter().any(|d| &d.message_id == id))
        })
    });

    // The consumer that started empty at the resync: only what came after it.
    let mut fresh = ReferenceConsumer::new(tenant);
    for message in &received[before_resync..] {
        fresh.receive(&ChangeMessage::decode(&message.body).unwrap());
    }
    assert_eq!(
        fresh.items(resynced),
        without_positions(&resynced_truth),
        "seed {seed}: the copy rebuilt after the resync"
    );
    // (It joined the other endpoint's stream in the middle: that one waits for changes it will
    // never see, as it should.)
    let missing: Vec<_> = fresh
        .missing()
        .into_iter()
        .filter(|(endpoint, _, _)| *endpoint == resynced)
        .collect();
    assert!(missing.is_empty(), "seed {seed}: {missing:?}");
    assert!(fresh.stats().snapshots >= 1, "{:?}", fresh.stats());

    // The consumer that kept its state all along has both copies.
    let mut kept = SetDeduplicating::new(tenant);
    kept.take(&received);
    assert_eq!(
        kept.copy.items(resynced),
        without_positions(&resynced_truth)
    );
    assert_eq!(
        kept.copy.items(replayed),
        without_positions(&replayed_truth)
    );

    // A replay of the other endpoint from its middle: the same changes, the same ids.
    let (_, last) = crate::stack::stream_position(&pool, replayed).await;
    let from = (last / 2).max(1);
    let answer = api
        .ok(
            202,
            "POST",
            &format!("/v1/endpoints/{replayed}/replay"),
            &token,
            Some(&json!({"from_change_seq": from})),
        )
        .await;
    assert_eq!(answer["from_change_seq"], from);
    let replayed_epoch = answer["epoch"].as_u64().unwrap();
    assert_eq!(answer["through_change_seq"], last);
    let before_replay = received.len();
    let replayed_ids: Vec<String> = (from..=last)
        .map(|seq| format!("{replayed}:{replayed_epoch}:{seq}"))
        .collect();
    let received = tokio::task::block_in_place(|| {
        wait_for_queue("the replayed changes", &|received| {
            let again: HashSet<&str> = received[before_replay..]
                .iter()
                .map(|d| d.message_id.as_str())
                .collect();
            replayed_ids.iter().all(|id| again.contains(id.as_str()))
        })
    });
    kept.take(&received[before_replay..]);
    assert!(
        kept.dropped >= replayed_ids.len(),
        "seed {seed}: {} dropped",
        kept.dropped
    );
    assert_eq!(
        kept.copy.items(replayed),
        without_positions(&replayed_truth),
        "seed {seed}: the replay changed a deduplicating consumer's copy"
    );
    // Past the last change: refused, naming the field.
    let refused = api
        .call(
            "POST",
            &format!("/v1/endpoints/{replayed}/replay"),
            Some(&token),
            Some(&json!({"from_change_seq": last + 1})),
        )
        .await;
    assert_refused_field(&refused, "from_change_seq", "a replay past the last change");

    stop_simulation(&sim, senders).await;
    collector.finish().await;
    relay.stop_publisher().await;
    // With nothing publishing, a resync's snapshot stays unsent: asking again is refused
    // rather than writing the whole copy once more.
    let resync = format!("/v1/endpoints/{replayed}/resync");
    relay.api.ok(202, "POST", &resync, &token, None).await;
    let again = relay.api.call("POST", &resync, Some(&token), None).await;
    assert_eq!(again.status, 409, "{}", again.text);
    let _ = broker.close(200, "done").await;
    relay.stop().await;
}
