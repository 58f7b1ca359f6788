//! The restore story of the wire file's rule "Keep, with the copy, the through of the last
//! message of events applied on each track: after restoring the copy from a backup, rewind the
//! track to it ... — or, when the last message the copy took was a reset, read /v1/feed again",
//! end to end: the relay's tiers (front tier, sequencer, publisher, control plane) in this
//! process against the simulated upstream over real HTTP, and a real `pg_dump` / `pg_restore`.
//!
//! Each case:
//! 1. runs the relay with traffic until it is quiescent, and takes a backup (`pg_dump -Fc`);
//! 2. runs more traffic, until quiescent again: updates, new items, and removals of items the
//!    backup holds (so a copy that keeps what the backup held shows), with the case's own event
//!    upstream halfway (a reset, a restore of the feed);
//! 3. stops every tier, checks the tenant's queue so far, restores the backup into a fresh
//!    database (`pg_restore`) and starts the tiers on it. The upstream cannot reach the relay
//!    meanwhile: its URL still names the stopped front tier;
//! 4. rewinds each endpoint's track through the relay's API (the API calls the upstream's rewind
//!    with the kept through, or begins a read of /v1/feed when the backup's last message was a
//!    reset), and checks that the upstream gave the case's answer;
//! 5. lets the upstream reach the restored relay (its URL now names the new front tier), waits
//!    until nothing is left to send, apply, merge or publish, and then each copy, read through
//!    the API, must be the oracle's, and so must the copy the tenant's queue rebuilds.
//!
//! One case for each answer of the rewind, each given by the simulator from its own state:
//! - accepted: nothing happened upstream but the traffic;
//! - `before_reset`: the key's access changed after the backup, and the old relay took the
//!   reset;
//! - `cursor_not_in_epoch`: the upstream restored its feed after the backup (a new epoch), and
//!   the old relay took the reset that followed;
//! - `cursor_ahead`: while the relay was down, the upstream rewound the track on its side to a
//!   position before the backup's through: the messages that follow overlap the copy;
//! - `reset_pending`: while the relay was down, the key's access changed: its reset waits to be
//!   delivered;
//! - and a backup whose last message was a reset: the relay reads /v1/feed again, and asks the
//!   upstream nothing.
//!
//! Each case runs twice: as above, and with a live message between the restart and the rewind
//! (the upstream reaches the restored relay for a moment and sends an update of an item the old
//! relay had updated after the backup, then is cut off again). That message moves the track's
//! own `through` past the backup's; the rewind must still start from the backup's (held by
//! `relay restored`), and the events it applied, resent by the rewind under a newer generation,
//! must apply again after the older ones resent with them.
//!
//! The queue: the database is restored with `relay restored` (the operator's step,
//! `docs/restore.md`), which begins a new epoch of each endpoint's change stream, opened by a
//! snapshot of the copy. A consumer that drops the message ids it has seen (and follows the
//! change message's epochs) reads the tenant's queue across the restore, the old relay's changes
//! and then the restored relay's, and must end with the oracle's copy; no message id the old
//! relay sent comes again with the restored relay's.
//!
//! Seeded: every case prints its seed; `RELAY_TEST_SEED=<seed>` replays it.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_publisher::{Operation, ReferenceConsumer};
use relay_simulator::cli::url_template;
use relay_simulator::model::{Access, Change, ChangeKind};
use relay_simulator::workload::START_MS;
use relay_simulator::{EndpointInfo, Faults, Simulation};
use relay_tests::{printed_seed, TestDb};
use relay_wire::{Cursor, ItemKind};
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use crate::stack::{
    check_tenant_queue_from, connect_broker, copy_items, describe_difference, look, oracle,
    quiesce, serve_simulation, simulation, stop_simulation, upstream_listener, Api, Backlog, Items,
    Relay, Room, Steady,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_the_upstream_resends_what_the_backup_missed() {
    run(Case::Accepted, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_with_a_message_before_the_rewind_the_rewind_still_starts_from_the_backup() {
    run(Case::Accepted, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_before_reset_the_relay_reads_the_feed_again() {
    run(Case::BeforeReset, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_before_reset_with_a_message_before_the_rewind() {
    run(Case::BeforeReset, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_cursor_not_in_epoch_the_relay_reads_the_feed_again() {
    run(Case::CursorNotInEpoch, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_cursor_not_in_epoch_with_a_message_before_the_rewind() {
    run(Case::CursorNotInEpoch, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_cursor_ahead_the_messages_that_follow_overlap_the_copy() {
    run(Case::CursorAhead, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_cursor_ahead_with_a_message_before_the_rewind() {
    run(Case::CursorAhead, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_reset_pending_the_reset_that_follows_reads_everything_again() {
    run(Case::ResetPending, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_reset_pending_with_a_message_before_the_rewind() {
    run(Case::ResetPending, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reset_the_relay_reads_the_feed_again_without_asking() {
    run(Case::AfterReset, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reset_with_a_message_before_the_rewind_the_feed_is_still_read_again() {
    run(Case::AfterReset, true).await;
}

/// What happened upstream, and so what the rewind after the restore answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    Accepted,
    BeforeReset,
    CursorNotInEpoch,
    CursorAhead,
    ResetPending,
    /// The backup's last message was a reset.
    AfterReset,
}

impl Case {
    /// The API's answer: its plan, the upstream's status and refusal (none when it was not
    /// asked), and what the relay does.
    fn expected(
        self,
    ) -> (
        &'static str,
        Option<(u16, Option<&'static str>)>,
        &'static str,
    ) {
        let refused = |refusal| Some((409, Some(refusal)));
        match self {
            Case::Accepted => ("rewind", Some((202, None)), "nothing"),
            Case::BeforeReset => ("rewind", refused("before_reset"), "reload_begun"),
            Case::CursorNotInEpoch => ("rewind", refused("cursor_not_in_epoch"), "reload_begun"),
            Case::CursorAhead => ("rewind", refused("cursor_ahead"), "nothing"),
            Case::ResetPending => ("rewind", refused("reset_pending"), "nothing"),
            Case::AfterReset => ("read_feed_again", None, "reload_begun"),
        }
    }
}

const ENDPOINTS: usize = 2;
const RATE: f64 = 20.0;
const WORKLOAD: Duration = Duration::from_secs(2);

/// Runs `case`; with `live`, a message reaches the restored relay before the rewind is asked.
async fn run(case: Case, live: bool) {
    let seed = printed_seed(&format!("restore {case:?} (live {live})"));
    let mut rng = ChaCha8Rng::seed_from_u64(seed);

    // 1. A vhost and a Redis key prefix for the test (both relays use them: a restore brings
    // back Postgres only), the relay on a database of its own, the upstream, the tenant.
    let room = Room::new().await;
    let relay = Relay::start(&room).await;
    let (sim_listener, upstream_api) = upstream_listener("127.0.0.1").await;
    let faults = Faults {
        duplicate: 0.1,
        refetch: 0.2,
        ..Faults::default()
    };
    let (upstream, workload, infos) =
        simulation(seed, &relay.app.base_url, ENDPOINTS, faults.clone());
    let key = infos[0].key_token.clone();
    let ids: Vec<Uuid> = infos.iter().map(|i| i.id).collect();
    let (tenant, token) = onboard(&relay.api, &infos, &upstream_api).await;
    let (sim, senders) = serve_simulation(upstream, Duration::from_secs(2), sim_listener).await;

    // 2. Traffic, then the backup's last message: a reset for its case, else events (three
    // messages of one new item each, the first of which the cursor_ahead case rewinds to).
    let steps = sim.clone().run_workload(workload, RATE, WORKLOAD).await;
    quiesce(relay.pool(), &sim, &ids, Duration::from_secs(60), seed).await;
    let mut first_of_three = None;
    if case == Case::AfterReset {
        change_access(&sim, &key, &mut rng);
        quiesce(relay.pool(), &sim, &ids, Duration::from_secs(60), seed).await;
    } else {
        for n in 0..3 {
            let change = create_item(&sim, &key, &mut rng, n);
            first_of_three.get_or_insert(change.position());
            assert!(
                sim.wait_idle(Duration::from_secs(10)).await,
                "seed {seed}: {case:?}: item {} was not delivered",
                change.feed_item_id
            );
        }
        quiesce(relay.pool(), &sim, &ids, Duration::from_secs(60), seed).await;
    }

    // 3. The backup, and what it holds.
    let mut kept = HashMap::new();
    let mut held = HashMap::new();
    for &id in &ids {
        let (through, last_was_reset) = kept_track(relay.pool(), id).await;
        assert_eq!(
            last_was_reset,
            case == Case::AfterReset,
            "seed {seed}: {case:?}: endpoint {id}'s last message taken"
        );
        let through = through.unwrap_or_else(|| panic!("seed {seed}: {id} kept no through"));
        if let Some(first) = first_of_three {
            assert!(
                Cursor::parse(&through).unwrap() > first,
                "seed {seed}: {case:?}: {id} kept through {through}, not past {first}"
            );
        }
        kept.insert(id, through);
        held.insert(id, copy_items(relay.pool(), id).await);
    }
    let archive = relay.app.db.dump().await;

    // 4. Traffic after the backup, with the case's event upstream while the relay is up.
    let (removed, updated) = after_backup(&sim, &key, &held[&ids[0]], case, &mut rng).await;
    quiesce(relay.pool(), &sim, &ids, Duration::from_secs(60), seed).await;
    for &id in &ids {
        let truth = oracle(&sim, id);
        let held_then_removed: Vec<&String> = removed
            .iter()
            .filter(|s| held[&id].contains_key(*s) && !truth.contains_key(*s))
            .collect();
        assert!(
            !held_then_removed.is_empty(),
            "seed {seed}: {case:?}: no item the backup holds for {id} was removed after it"
        );
    }

    // 5. The relay goes; what its publisher sent rebuilds its copy. The backup comes back on a
    // fresh database, `relay restored` marks it, and the tiers start on it.
    let old_url = url_template(&relay.app.base_url);
    let old_db = relay.stop().await;
    let broker = connect_broker(&room.vhost.url(), "restore").await;
    let (published_before, _) = check_tenant_queue_from(
        &broker,
        &old_db.pool,
        &sim,
        ReferenceConsumer::new(tenant),
        &ids,
        seed,
    )
    .await;
    drop(old_db);
    let restored_db = TestDb::restored(&archive).await;
    let epochs = mark_restored(&restored_db.pool, case, &kept, &ids, seed).await;
    let mut relay = Relay::start_on(restored_db, &room).await;

    // 6. With `live`, the upstream reaches the restored relay for one message: an update of an
    // item the old relay had updated after the backup (or a new item), then it is cut off again.
    if live {
        let url = url_template(&relay.app.base_url);
        point_upstream_at(&sim, &ids, &url);
        let subject = live_message(&sim, &key, &updated, &mut rng);
        assert!(
            sim.wait_idle(Duration::from_secs(20)).await,
            "seed {seed}: {case:?}: the live message ({subject}) was not delivered"
        );
        settle(relay.pool(), &sim, &ids, seed, case).await;
        point_upstream_at(&sim, &ids, &old_url);
        for &id in &ids {
            let (through, _) = kept_track(relay.pool(), id).await;
            eprintln!(
                "restore {case:?}: seed {seed}: {id} took {subject} before the rewind: its \
                 track's through is {through:?}, the backup's {}",
                kept[&id]
            );
        }
    }

    // 7. While the upstream cannot reach the relay: the case's event, then the rewind.
    match case {
        Case::CursorAhead => {
            let since = first_of_three.expect("the backup's last message was events");
            for &id in &ids {
                let rewound = sim.change(|up, now| up.rewind(id, since, now));
                assert!(
                    rewound.is_ok(),
                    "seed {seed}: the upstream's own rewind of {id} to {since}: {rewound:?}"
                );
            }
        }
        Case::ResetPending => change_access(&sim, &key, &mut rng),
        _ => {}
    }
    let mut answers = HashMap::new();
    for &id in &ids {
        let answer = relay
            .api
            .ok(
                200,
                "POST",
                &format!("/v1/endpoints/{id}/tracks/feed/rewind"),
                &token,
                None,
            )
            .await;
        check_answer(case, live, &answer, &kept[&id], seed);
        answers.insert(id, answer);
    }

    // 8. The upstream reaches the restored relay; when nothing is left to do, each copy is the
    // oracle's.
    let url = url_template(&relay.app.base_url);
    point_upstream_at(&sim, &ids, &url);
    settle(relay.pool(), &sim, &ids, seed, case).await;
    for &id in &ids {
        let truth = oracle(&sim, id);
        let read = relay.api.copy(&token, id).await;
        let kept_though_removed: Vec<&String> = read
            .keys()
            .filter(|s| !truth.contains_key(*s) && removed.contains(*s))
            .collect();
        assert!(
            read == truth,
            "seed {seed}: {case:?} (rewind answered {}): endpoint {id}'s copy through the API \
             after the restore is not the oracle's ({} items, oracle {}): {}; held though the \
             upstream removed them after the backup: {kept_though_removed:?}",
            answers[&id],
            read.len(),
            truth.len(),
            describe_difference(&read, &truth),
        );
    }

    // 9. The queue across the restore, read by a consumer that drops the message ids it has
    // seen: it took everything the old relay published; what the restored relay publishes is
    // each endpoint's new epoch from its first change, the snapshot, on, under ids never sent
    // before, and it rebuilds the oracle's copy.
    relay.stop_publisher().await;
    let mut consumer = ReferenceConsumer::new(tenant);
    let mut seen: HashSet<String> = HashSet::new();
    for message in &published_before {
        if seen.insert(message.message_id()) {
            consumer.receive(message);
        }
    }
    let (published_after, repeats) =
        check_tenant_queue_from(&broker, relay.pool(), &sim, consumer, &ids, seed).await;
    let reused: Vec<String> = published_after
        .iter()
        .map(|m| m.message_id())
        .filter(|id| seen.contains(id))
        .collect();
    assert!(
        reused.is_empty(),
        "seed {seed}: {case:?}: message ids the old relay sent came again after the restore: \
         {reused:?}"
    );
    for &id in &ids {
        let first = published_after
            .iter()
            .find(|m| m.webhook_endpoint_id == id)
            .unwrap_or_else(|| panic!("seed {seed}: {case:?}: nothing published for {id}"));
        assert_eq!(
            (first.epoch, first.change_seq, first.operation),
            (epochs[&id], 1, Operation::SnapshotBegin),
            "seed {seed}: {case:?}: {id}'s restored stream opens with its snapshot"
        );
        assert!(
            published_before
                .iter()
                .filter(|m| m.webhook_endpoint_id == id)
                .all(|m| m.epoch < first.epoch),
            "seed {seed}: {case:?}: {id}'s new epoch is not above the old relay's"
        );
    }
    eprintln!(
        "restore {case:?} (live {live}): seed {seed} passed: {steps} workload steps, {} items \
         removed after the backup, {} changes published before the restore and {} after \
         ({repeats} repeats)",
        removed.len(),
        published_before.len(),
        published_after.len()
    );

    // 10. Clean up: the servers stop; the vhost, the Redis keys and the databases go when their
    // guards drop.
    let _ = broker.close(200, "done").await;
    stop_simulation(&sim, senders).await;
    drop(relay.stop().await);
    drop(room);
}

/// A tenant made through the API, a token for it, and `infos` registered for it with the
/// upstream's URL and key (the sequencer's reads and the API's rewind use them).
async fn onboard(api: &Api, infos: &[EndpointInfo], upstream_api: &str) -> (Uuid, String) {
    let (tenant, token) = api.tenant("restoring tenant").await;
    for info in infos {
        api.register(&token, info, upstream_api).await;
    }
    (tenant, token)
}

/// What the relay keeps with the copy of an endpoint's feed track: the through of the last
/// message of events applied, and whether the last message it took was a reset.
async fn kept_track(pool: &PgPool, endpoint: Uuid) -> (Option<String>, bool) {
    let (through, last_was_reset): (Option<String>, Option<bool>) = sqlx::query_as(
        "SELECT through, last_was_reset FROM endpoint_tracks
         WHERE endpoint_id = $1 AND track = 'feed'",
    )
    .bind(endpoint)
    .fetch_one(pool)
    .await
    .unwrap();
    (through, last_was_reset.unwrap_or(false))
}

/// Makes the upstream send the endpoints' webhooks to `url` (a URL template).
fn point_upstream_at(sim: &Simulation, ids: &[Uuid], url: &str) {
    sim.change(|up, _| {
        for &id in ids {
            up.set_endpoint_url(id, url);
        }
    });
}

/// The key's access to one company changes (seeded), as a customer's plan change does: the
/// upstream resets every endpoint of the key (reason `access_changed`).
fn change_access(sim: &Simulation, key: &str, rng: &mut ChaCha8Rng) {
    sim.change(|up, now| {
        let companies: Vec<i64> = up.world.companies.keys().copied().collect();
        let company = companies[rng.gen_range(0..companies.len())];
        let next = match up.world.keys[key].access.get(&company) {
            Some(Access::Full) => Some(Access::Teaser),
            Some(Access::Teaser) => None,
            None => Some(Access::Full),
        };
        up.set_access(key, company, next, now)
            .expect("the key is the upstream's");
    });
}

/// A new item of a company the key may read (so every endpoint is sent it).
fn create_item(sim: &Simulation, key: &str, rng: &mut ChaCha8Rng, n: i64) -> Change {
    sim.change(|up, _| {
        let readable: Vec<i64> = up.world.keys[key].access.keys().copied().collect();
        let all: Vec<i64> = up.world.companies.keys().copied().collect();
        let from = if readable.is_empty() { &all } else { &readable };
        let company = from[rng.gen_range(0..from.len())];
        let kind = if rng.gen_bool(0.8) {
            ItemKind::Announcement
        } else {
            ItemKind::PreEarningsAnalysis
        };
        up.create_item(
            kind,
            company,
            &format!("Restore story item {n}"),
            START_MS + 10_000_000 + n * 1_000,
        )
        .expect("a company of the upstream's")
    })
}

#[derive(Debug)]
enum Step {
    Remove(String),
    Update(String),
    Create,
}

/// The traffic after the backup, in a seeded order, a few tens of milliseconds apart (so it
/// goes in several messages): a third of the items the backup `held` removed (two at least),
/// another third updated, four new items; halfway, the case's event upstream. Returns the
/// subjects removed and those updated.
async fn after_backup(
    sim: &Simulation,
    key: &str,
    held: &Items,
    case: Case,
    rng: &mut ChaCha8Rng,
) -> (Vec<String>, Vec<String>) {
    let mut subjects: Vec<String> = {
        let up = sim.lock();
        held.keys()
            .filter(|s| up.world.items.get(*s).is_some_and(|item| item.is_live()))
            .cloned()
            .collect()
    };
    subjects.shuffle(rng);
    let removals = (subjects.len() / 3).max(2).min(subjects.len());
    let updates = (subjects.len() / 3).min(subjects.len() - removals);
    let mut steps: Vec<Step> = subjects[..removals]
        .iter()
        .map(|s| Step::Remove(s.clone()))
        .chain(
            subjects[removals..removals + updates]
                .iter()
                .map(|s| Step::Update(s.clone())),
        )
        .chain((0..4).map(|_| Step::Create))
        .collect();
    steps.shuffle(rng);
    let halfway = steps.len() / 2;
    let mut removed = Vec::new();
    let mut updated = Vec::new();
    for (n, step) in steps.into_iter().enumerate() {
        if n == halfway {
            match case {
                Case::BeforeReset => change_access(sim, key, rng),
                Case::CursorNotInEpoch => sim.change(|up, now| up.restore_feed(now)),
                _ => {}
            }
        }
        let at_ms = START_MS + 20_000_000 + n as i64 * 1_000;
        match step {
            Step::Remove(subject) => {
                let kind = if rng.gen_bool(0.5) {
                    ChangeKind::Hidden
                } else {
                    ChangeKind::Withdrawn
                };
                sim.change(|up, _| up.change_item(&subject, kind, "Removed", at_ms, false))
                    .expect("a live item can be removed");
                removed.push(subject);
            }
            Step::Update(subject) => {
                let kind = if rng.gen_bool(0.5) {
                    ChangeKind::StoryAdded
                } else {
                    ChangeKind::FlashAdded
                };
                let as_refetch = rng.gen_bool(0.2);
                sim.change(|up, _| {
                    up.change_item(
                        &subject,
                        kind,
                        "Updated after the backup",
                        at_ms,
                        as_refetch,
                    )
                })
                .expect("a live item takes a new part");
                updated.push(subject);
            }
            Step::Create => {
                create_item(sim, key, rng, 100 + n as i64);
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(10..60))).await;
    }
    (removed, updated)
}

/// The message a restored relay takes before its rewind: an update of an item the old relay
/// updated after the backup and that is still live (so the rewind resends an older event of the
/// same subject beside it), or, when there is none, a new item. Returns its subject.
fn live_message(sim: &Simulation, key: &str, updated: &[String], rng: &mut ChaCha8Rng) -> String {
    let still_live: Vec<&String> = {
        let up = sim.lock();
        updated
            .iter()
            .filter(|s| up.world.items.get(*s).is_some_and(|item| item.is_live()))
            .collect()
    };
    match still_live.choose(rng) {
        Some(subject) => {
            let at_ms = START_MS + 30_000_000;
            sim.change(|up, _| {
                up.change_item(
                    subject,
                    ChangeKind::FlashAdded,
                    "Updated before the rewind",
                    at_ms,
                    false,
                )
            })
            .expect("a live item takes a new part");
            (*subject).clone()
        }
        None => create_item(sim, key, rng, 1_000).feed_item_id,
    }
}

/// `relay restored` on the restored database, before any tier starts: one line per endpoint,
/// each holding the backup's through for its rewind (or planning to read the feed again after a
/// reset) and opening a new epoch of its change stream. Returns each endpoint's epoch.
async fn mark_restored(
    pool: &PgPool,
    case: Case,
    kept: &HashMap<Uuid, String>,
    ids: &[Uuid],
    seed: u64,
) -> HashMap<Uuid, u64> {
    let mut out = Vec::new();
    let marked = relay::commands::mark_restored(pool, &mut out)
        .await
        .expect("relay restored");
    assert_eq!(marked, ids.len(), "seed {seed}");
    let mut epochs = HashMap::new();
    for line in String::from_utf8(out).unwrap().lines() {
        let line: Value = serde_json::from_str(line).unwrap();
        let id: Uuid = line["webhook_endpoint_id"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        if case == Case::AfterReset {
            assert_eq!(line["plan"], "read_feed_again", "seed {seed}: {line}");
        } else {
            assert_eq!(line["plan"], "rewind", "seed {seed}: {line}");
            assert_eq!(line["since"], kept[&id].as_str(), "seed {seed}: {line}");
        }
        let epoch = line["change_epoch"].as_u64().unwrap();
        assert!(
            epoch > 1,
            "seed {seed}: a restore begins a new epoch: {line}"
        );
        epochs.insert(id, epoch);
    }
    epochs
}

/// Checks the API's answer to the rewind against the case: the plan, the upstream's answer (the
/// simulator's, from its own state), what the relay does, and the kept through asked for.
fn check_answer(case: Case, live: bool, answer: &Value, through: &str, seed: u64) {
    let (plan, upstream, outcome) = case.expected();
    assert_eq!(answer["plan"], plan, "seed {seed}: {case:?}: {answer}");
    match upstream {
        Some((status, refusal)) => {
            assert_eq!(answer["since"], through, "seed {seed}: {case:?}: {answer}");
            assert_eq!(
                answer["upstream"]["status"], status,
                "seed {seed}: {case:?}: {answer}"
            );
            assert_eq!(
                answer["upstream"]["refusal"],
                json!(refusal),
                "seed {seed}: {case:?}: {answer}"
            );
            assert_eq!(
                answer["upstream"]["generation"].is_u64(),
                status == 202,
                "seed {seed}: {case:?}: {answer}"
            );
        }
        None => assert_eq!(
            answer["upstream"],
            Value::Null,
            "seed {seed}: {case:?}: the upstream was asked: {answer}"
        ),
    }
    // A live message under another access_version than the backup's (the key's access changed
    // after it) begins a reload of its own, which the rewind's may find running.
    let running_already =
        live && outcome == "reload_begun" && answer["outcome"] == "reload_already_running";
    if !running_already {
        assert_eq!(
            answer["outcome"], outcome,
            "seed {seed}: {case:?}: {answer}"
        );
    }
    assert_eq!(
        answer["restore"]["through"],
        json!(through),
        "seed {seed}: {case:?}: the rewind answered the restore held: {answer}"
    );
}

/// Waits until the upstream has nothing left to send and the relay nothing left to apply,
/// merge or publish, three looks in a row, whatever the copies hold (the caller compares them
/// with the oracle: a copy that keeps a wrong item fails at once, not after a timeout). Panics
/// after a minute.
async fn settle(pool: &PgPool, sim: &Simulation, endpoints: &[Uuid], seed: u64, case: Case) {
    let limit = Duration::from_secs(60);
    let started = Instant::now();
    let mut steady = Steady::default();
    loop {
        let (idle, left) = look(pool, sim, endpoints).await;
        if steady.look(idle && left == Backlog::NONE) {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "seed {seed}: {case:?}: the restored relay is not done within {limit:?} (upstream \
             idle {idle}, {left:?})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
