//! The copy's Postgres layer (`relay_store::copy`) against the rules crate: the SQL writes carry
//! out the rules' decisions exactly as the reference copy (`relay_rules::FeedCopy`) does, and
//! each guarantee the conditional writes exist for holds against a real Postgres.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use relay_rules::{
    decide_event, decide_event_dedup, Decision, FeedCopy, Held, HeldContent, IgnoreReason, ReadItem,
};
use relay_store::copy::{self, Applied, Cause, Operation};
use relay_tests::TestDb;
use relay_wire::{Event, FeedItem, Message, Sequence};
use serde_json::{json, Value};
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

// ---- Events shaped like the wire file's, parsed by relay_wire ----

fn subject(s: u32) -> String {
    format!("announcement:{s}")
}

fn seq(n: u64) -> Sequence {
    Sequence::from_parts(1, n)
}

/// The item a feed event carries at (subject, sequence): a function of (subject, sequence / 2),
/// so some different positions carry an identical item (the rules then decide `Unchanged`), and
/// one position never carries two different items.
fn item_json(s: u32, n: u64) -> Value {
    let v = (n / 2) as i64;
    let mut parts = vec![
        json!({"kind": "flash", "part_id": "flash:1", "part_version": v}),
        json!({"kind": "flash", "part_id": "flash:2", "part_version": 1}),
    ];
    if v % 2 == 0 {
        parts.pop();
    }
    json!({"type": "item", "feed_item_id": subject(s), "item_kind": "announcement",
           "seq": n / 2, "first_seq": n / 2, "op": "changed", "changes": [], "parts": parts,
           "company": {"company_id": 28, "name": "Alfa Group AB"}, "lang": "en",
           "head": {"title": format!("item {s} v{v}")}})
}

/// An event's id names the change: the same (subject, generation, sequence, kind) sent again is
/// the same id.
fn event_id(s: u32, g: u64, n: u64, removal: bool) -> String {
    format!("evt_{s}_{g}_{n}_{removal}")
}

/// One feed event of a message of generation `g`, built as the wire file's events are
/// (`announcement.updated` with the item as data, or `announcement.hidden`) and parsed.
fn feed_event(s: u32, g: u64, n: u64, removal: bool) -> Event {
    let id = event_id(s, g, n, removal);
    let event = if removal {
        json!({"id": id, "type": "announcement.hidden", "subject": subject(s),
               "sequence": seq(n).as_str(), "specversion": "1.0",
               "data": {"type": "hidden", "feed_item_id": subject(s), "seq": n}})
    } else {
        json!({"id": id, "type": "announcement.updated", "subject": subject(s),
               "sequence": seq(n).as_str(), "specversion": "1.0", "data": item_json(s, n)})
    };
    let body = json!({"v": 1, "webhook_endpoint_id": "8d2f0c39-2b63-4c55-9a8a-3f5b1d7c1e20",
                      "track": "feed", "generation": g, "access_version": "b4d934cf",
                      "since": "1.0", "through": format!("1.{n}"), "complete": true,
                      "events": [event]});
    Message::parse(body.to_string().as_bytes())
        .unwrap()
        .events
        .remove(0)
}

/// An item of a reload's `/v1/feed` page at `n`.
fn read_item(s: u32, n: u64) -> ReadItem {
    ReadItem {
        subject: subject(s),
        sequence: seq(n),
        item: FeedItem::from_value(item_json(s, n), "items[0]").unwrap(),
    }
}

// ---- The SQL side, as the sequencer runs it ----

/// Decides an event against the row `load_held` locks, and applies it.
async fn apply_event(
    tx: &mut Transaction<'_, Postgres>,
    tenant: Uuid,
    endpoint: Uuid,
    generation: u64,
    event: &Event,
) -> (Decision, Applied) {
    let first = copy::record_event_id(tx, tenant, endpoint, &event.id)
        .await
        .unwrap();
    let decision = if first {
        let subject = relay_rules::feed_subject(event).unwrap();
        let held = copy::load_held(tx, endpoint, subject).await.unwrap();
        decide_event(held.as_ref(), generation, event)
    } else {
        Decision::Ignore(IgnoreReason::Duplicate)
    };
    let applied = copy::apply(tx, tenant, endpoint, &decision, Cause::Event(&event.id))
        .await
        .unwrap();
    (decision, applied)
}

/// What `apply` must answer for a decision made under `load_held`'s lock.
fn expected_applied(decision: &Decision, applied: Applied) -> bool {
    match decision {
        Decision::Ignore(_) | Decision::Refetch { .. } => applied == Applied::Nothing,
        d if d.is_change() => matches!(
            applied,
            Applied::Written {
                change_seq: Some(_)
            }
        ),
        _ => applied == Applied::Written { change_seq: None },
    }
}

fn items_of(rows: &BTreeMap<String, Held>) -> BTreeMap<String, Value> {
    rows.iter()
        .filter_map(|(s, h)| match &h.content {
            HeldContent::Item { item, .. } => Some((s.clone(), item.clone())),
            HeldContent::Tombstone => None,
        })
        .collect()
}

/// The outbox replayed in change_seq order onto an empty map; also checks the numbering is
/// exactly 1..=n and that every removal removes an item the replay holds.
async fn replay_changes(
    db: impl sqlx::PgExecutor<'_>,
    endpoint: Uuid,
) -> Result<(BTreeMap<String, Value>, usize), TestCaseError> {
    let changes = copy::list_changes(db, endpoint).await.unwrap();
    let seqs: Vec<i64> = changes.iter().map(|c| c.change_seq).collect();
    let gapless: Vec<i64> = (1..=changes.len() as i64).collect();
    prop_assert_eq!(seqs, gapless);
    let mut replay = BTreeMap::new();
    for change in &changes {
        match change.operation {
            Operation::Upsert => {
                replay.insert(change.subject.clone(), change.item.clone().unwrap());
            }
            Operation::Remove => {
                prop_assert!(
                    replay.remove(&change.subject).is_some(),
                    "change {} removes {}, which the replay does not hold",
                    change.change_seq,
                    change.subject
                );
            }
        }
    }
    Ok((replay, changes.len()))
}

// ---- The model-based test ----

#[derive(Debug, Clone)]
enum Step {
    /// A feed event of generation `g` at sequence `n`.
    Event {
        s: u32,
        g: u64,
        n: u64,
        removal: bool,
    },
    /// A reload of generation `g`: its read merged, then older generations dropped.
    Merge { g: u64, read: Vec<(u32, u64)> },
}

/// 1-4 subjects, 1-3 generations, sequences 1-8 (so updates and removals meet at equal
/// sequences), some events sent two or three times, an occasional merge, in a random order.
fn steps() -> impl Strategy<Value = Vec<Step>> {
    (1u32..=4).prop_flat_map(|subjects| {
        let event = (0..subjects, 1u64..=3, 1u64..=8, any::<bool>(), 1usize..=3)
            .prop_map(|(s, g, n, removal, times)| vec![Step::Event { s, g, n, removal }; times]);
        let merge = (
            1u64..=3,
            prop::collection::btree_map(0..subjects, 1u64..=8, 0..=subjects as usize),
        )
            .prop_map(|(g, read)| {
                vec![Step::Merge {
                    g,
                    read: read.into_iter().collect(),
                }]
            });
        prop::collection::vec(prop_oneof![6 => event, 1 => merge], 0..20)
            .prop_map(|v| v.into_iter().flatten().collect::<Vec<_>>())
            .prop_shuffle()
    })
}

async fn run_case(pool: &PgPool, tenant: Uuid, steps: &[Step]) -> Result<(), TestCaseError> {
    let endpoint = Uuid::new_v4();
    let mut tx = pool.begin().await.unwrap();
    copy::lock_endpoint(&mut tx, tenant, endpoint)
        .await
        .unwrap();
    let mut model = FeedCopy::new();
    let mut model_ids = BTreeSet::new();
    let mut model_changes = 0usize;

    for (i, step) in steps.iter().enumerate() {
        match step {
            &Step::Event { s, g, n, removal } => {
                let event = feed_event(s, g, n, removal);
                let held = model.get(&subject(s)).cloned();
                let expected =
                    decide_event_dedup(|id| model_ids.contains(id), held.as_ref(), g, &event);
                model.apply(&expected);
                model_ids.insert(event.id.clone());
                model_changes += usize::from(expected.is_change());

                let (decision, applied) = apply_event(&mut tx, tenant, endpoint, g, &event).await;
                prop_assert_eq!(&decision, &expected, "step {}: {:?}", i, step);
                prop_assert!(
                    expected_applied(&decision, applied),
                    "step {}: {:?} was {:?}",
                    i,
                    decision,
                    applied
                );
            }
            Step::Merge { g, read } => {
                let read: Vec<ReadItem> = read.iter().map(|&(s, n)| read_item(s, n)).collect();
                let (model_decisions, model_removed) = model.merge(*g, &read);
                model_changes += model_decisions.iter().filter(|d| d.is_change()).count();
                model_changes += model_removed.len();
                for (r, expected) in read.iter().zip(&model_decisions) {
                    let (decision, applied) =
                        copy::merge_read_item(&mut tx, tenant, endpoint, *g, r)
                            .await
                            .unwrap();
                    prop_assert_eq!(&decision, expected, "step {}: {:?}", i, step);
                    prop_assert!(expected_applied(&decision, applied));
                }
                let removed = copy::drop_older_generations(&mut tx, tenant, endpoint, *g)
                    .await
                    .unwrap();
                prop_assert_eq!(&removed, &model_removed, "step {}: {:?}", i, step);
            }
        }
    }

    // The copies are equal: generation, sequence, tombstone, parts and item of every row.
    let rows = copy::copy_rows(&mut *tx, endpoint).await.unwrap();
    prop_assert_eq!(&rows, model.rows());
    // The outbox is gapless, one row per change the rules decided, and rebuilds the items.
    let (replay, count) = replay_changes(&mut *tx, endpoint).await?;
    prop_assert_eq!(count, model_changes);
    prop_assert_eq!(replay, items_of(&rows));
    // The event ids applied are kept with the copy, once each.
    let ids: i64 = sqlx::query_scalar("SELECT count(*) FROM applied_events WHERE endpoint_id = $1")
        .bind(endpoint)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    prop_assert_eq!(ids as usize, model_ids.len());
    tx.rollback().await.unwrap();
    Ok(())
}

/// Random feed events and merges, applied in a random order both through the reference copy and
/// through the SQL layer (each deciding with the same rules against its own rows): the same
/// decisions step by step, the same copies at the end, a gapless outbox that rebuilds the
/// copy's items.
#[test]
fn the_sql_copy_ends_equal_to_the_rules_reference_copy() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let tenant = runtime.block_on(db.tenant());
    // 64 cases by default; PROPTEST_CASES runs more.
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(64);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&steps(), |steps| {
        runtime.block_on(run_case(&db.pool, tenant, &steps))
    });
    runtime.block_on(db.pool.close());
    drop(db);
    if let Err(e) = result {
        panic!("{e}");
    }
}

// ---- One test per guarantee ----

async fn fresh() -> (TestDb, Uuid, Uuid) {
    let db = TestDb::new().await;
    let tenant = db.tenant().await;
    (db, tenant, Uuid::new_v4())
}

async fn changes(db: &TestDb, endpoint: Uuid) -> Vec<copy::Change> {
    copy::list_changes(&db.pool, endpoint).await.unwrap()
}

/// Rule "On withdrawn and hidden, remove the item and keep a tombstone ... an older update
/// arriving after a removal would otherwise bring the item back".
#[tokio::test]
async fn an_older_update_after_a_removal_does_not_bring_the_item_back() {
    let (db, tenant, endpoint) = fresh().await;
    let mut tx = db.pool.begin().await.unwrap();
    apply_event(&mut tx, tenant, endpoint, 1, &feed_event(1, 1, 5, false)).await;
    let (removal, applied) =
        apply_event(&mut tx, tenant, endpoint, 1, &feed_event(1, 1, 6, true)).await;
    assert!(matches!(
        removal,
        Decision::Tombstone {
            removed_item: true,
            ..
        }
    ));
    assert_eq!(
        applied,
        Applied::Written {
            change_seq: Some(2)
        }
    );
    tx.commit().await.unwrap();

    // Late: an update older than the removal, and one at the removal's own sequence.
    let mut tx = db.pool.begin().await.unwrap();
    for n in [4, 6] {
        let (decision, applied) =
            apply_event(&mut tx, tenant, endpoint, 1, &feed_event(1, 1, n, false)).await;
        assert_eq!(decision, Decision::Ignore(IgnoreReason::Older));
        assert_eq!(applied, Applied::Nothing);
        // And carried out regardless, as a caller that had seen nothing held would decide it:
        // the statement itself refuses it.
        let stale = decide_event(None, 1, &feed_event(1, 1, n, false));
        let applied = copy::apply(&mut tx, tenant, endpoint, &stale, Cause::Event("evt_late"))
            .await
            .unwrap();
        assert_eq!(applied, Applied::Refused);
    }
    tx.commit().await.unwrap();

    let rows = copy::copy_rows(&db.pool, endpoint).await.unwrap();
    let held = &rows[&subject(1)];
    assert!(held.is_tombstone());
    assert_eq!((held.generation, &held.sequence), (1, &seq(6)));
    let ops: Vec<Operation> = changes(&db, endpoint)
        .await
        .iter()
        .map(|c| c.operation)
        .collect();
    assert_eq!(ops, vec![Operation::Upsert, Operation::Remove]);
}

/// Rule "De-duplicate events by id, for each endpoint": the insert decides, also between two
/// transactions racing on one id.
#[tokio::test]
async fn a_duplicate_event_id_is_recorded_once() {
    let (db, tenant, endpoint) = fresh().await;
    let id = "evt_2qyd41b3mqbv451ksq45hkm6tf";
    let mut conn = db.pool.acquire().await.unwrap();
    assert!(copy::record_event_id(&mut conn, tenant, endpoint, id)
        .await
        .unwrap());
    assert!(!copy::record_event_id(&mut conn, tenant, endpoint, id)
        .await
        .unwrap());
    // Per endpoint: another endpoint applies the same id once too.
    let other = Uuid::new_v4();
    assert!(copy::record_event_id(&mut conn, tenant, other, id)
        .await
        .unwrap());

    // Racing: the second waits for the first's commit, then sees a duplicate.
    let racing = "evt_1zrs9j3563b1tqssanx7rs4ajv";
    let mut first = db.pool.begin().await.unwrap();
    assert!(copy::record_event_id(&mut first, tenant, endpoint, racing)
        .await
        .unwrap());
    let pool = db.pool.clone();
    let second = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let recorded = copy::record_event_id(&mut tx, tenant, endpoint, racing)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        recorded
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !second.is_finished(),
        "the second insert waits for the first"
    );
    first.commit().await.unwrap();
    assert!(!second.await.unwrap());

    let rows: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT endpoint_id, event_id FROM applied_events ORDER BY endpoint_id, event_id",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    let mut expected = vec![
        (endpoint, id.to_owned()),
        (endpoint, racing.to_owned()),
        (other, id.to_owned()),
    ];
    expected.sort();
    assert_eq!(rows, expected);
}

/// A caller whose decision was made from a row that changed since (it read before another
/// writer committed) cannot write an older position: the `where` refuses it, no change row.
#[tokio::test]
async fn a_stale_caller_cannot_overwrite_a_newer_row() {
    let (db, tenant, endpoint) = fresh().await;
    let s = subject(1);

    // The stale caller reads (nothing held, or the item at 5) and decides.
    let mut seed = db.pool.begin().await.unwrap();
    apply_event(&mut seed, tenant, endpoint, 2, &feed_event(1, 2, 5, false)).await;
    seed.commit().await.unwrap();
    let seen = copy::load_held(&mut db.pool.acquire().await.unwrap(), endpoint, &s)
        .await
        .unwrap();
    let stale_decisions = [
        // An update at 6 over the item at 5.
        decide_event(seen.as_ref(), 2, &feed_event(1, 2, 6, false)),
        // The same item again at 7 (content of 6 and 7 is equal): `Unchanged` over 6.
        Decision::Unchanged {
            subject: s.clone(),
            generation: 2,
            sequence: seq(7),
        },
        // A removal at 7.
        decide_event(seen.as_ref(), 2, &feed_event(1, 2, 7, true)),
        // Nothing held, as seen before the first write: an update of an older generation.
        decide_event(None, 1, &feed_event(1, 1, 99, false)),
        // And an older generation's removal.
        decide_event(None, 1, &feed_event(1, 1, 99, true)),
    ];
    assert!(matches!(stale_decisions[0], Decision::Store { .. }));
    assert!(matches!(stale_decisions[2], Decision::Tombstone { .. }));

    // Meanwhile another writer stores the item at 8 and commits.
    let mut writer = db.pool.begin().await.unwrap();
    let (_, applied) = apply_event(
        &mut writer,
        tenant,
        endpoint,
        2,
        &feed_event(1, 2, 8, false),
    )
    .await;
    assert_eq!(
        applied,
        Applied::Written {
            change_seq: Some(2)
        }
    );
    writer.commit().await.unwrap();
    let newer = copy::copy_rows(&db.pool, endpoint).await.unwrap();

    let mut stale = db.pool.begin().await.unwrap();
    for decision in &stale_decisions {
        let applied = copy::apply(
            &mut stale,
            tenant,
            endpoint,
            decision,
            Cause::Event("stale"),
        )
        .await
        .unwrap();
        assert_eq!(applied, Applied::Refused, "{decision:?}");
    }
    stale.commit().await.unwrap();

    assert_eq!(copy::copy_rows(&db.pool, endpoint).await.unwrap(), newer);
    assert_eq!(newer[&s].sequence, seq(8));
    let seqs: Vec<i64> = changes(&db, endpoint)
        .await
        .iter()
        .map(|c| c.change_seq)
        .collect();
    assert_eq!(seqs, vec![1, 2], "the refused writes appended no change");
    let stale_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM changes WHERE event_id = 'stale'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(stale_rows, 0);
}

/// Two connections applying events to one endpoint at once, several per transaction, some
/// transactions rolled back: change_seq is exactly 1..=n, each committed change has its number,
/// and the outbox rebuilds the copy's items.
#[tokio::test]
async fn concurrent_applies_to_one_endpoint_keep_change_seq_gapless() {
    let (db, tenant, endpoint) = fresh().await;
    let next_seq = Arc::new(AtomicU64::new(1));

    let writer = |task: u32| {
        let pool = db.pool.clone();
        let next_seq = next_seq.clone();
        tokio::spawn(async move {
            let mut committed = Vec::new();
            for round in 0..30u32 {
                let mut tx = pool.begin().await.unwrap();
                copy::lock_endpoint(&mut tx, tenant, endpoint)
                    .await
                    .unwrap();
                let mut numbers = Vec::new();
                for k in 0..=(round % 3) {
                    let n = next_seq.fetch_add(1, Ordering::SeqCst);
                    let s = (task + round + k) % 3;
                    let event = feed_event(s, 1, n, n.is_multiple_of(5));
                    let (_, applied) = apply_event(&mut tx, tenant, endpoint, 1, &event).await;
                    if let Applied::Written {
                        change_seq: Some(c),
                    } = applied
                    {
                        numbers.push(c);
                    }
                    tokio::task::yield_now().await;
                }
                if round % 7 == 3 {
                    tx.rollback().await.unwrap();
                } else {
                    tx.commit().await.unwrap();
                    committed.extend(numbers);
                }
            }
            committed
        })
    };
    let (a, b) = tokio::join!(writer(0), writer(1));
    let mut committed: Vec<i64> = a.unwrap().into_iter().chain(b.unwrap()).collect();
    committed.sort_unstable();

    let (replay, count) = replay_changes(&db.pool, endpoint).await.unwrap();
    assert!(count > 20, "only {count} changes");
    assert_eq!(committed, (1..=count as i64).collect::<Vec<_>>());
    let rows = copy::copy_rows(&db.pool, endpoint).await.unwrap();
    assert_eq!(replay, items_of(&rows));
}

/// The same without `lock_endpoint`, one event per transaction (each touches one subject row,
/// then the counter): the counter row taken inside `apply`'s statement alone keeps change_seq
/// gapless.
#[tokio::test]
async fn concurrent_single_applies_without_the_endpoint_lock_keep_change_seq_gapless() {
    let (db, tenant, endpoint) = fresh().await;
    let next_seq = Arc::new(AtomicU64::new(1));

    let writer = |task: u32| {
        let pool = db.pool.clone();
        let next_seq = next_seq.clone();
        tokio::spawn(async move {
            let mut committed = Vec::new();
            for round in 0..40u32 {
                let mut tx = pool.begin().await.unwrap();
                let n = next_seq.fetch_add(1, Ordering::SeqCst);
                let event = feed_event((task + round) % 2, 1, n, n.is_multiple_of(4));
                let (_, applied) = apply_event(&mut tx, tenant, endpoint, 1, &event).await;
                tokio::task::yield_now().await;
                if round % 9 == 4 {
                    tx.rollback().await.unwrap();
                } else {
                    tx.commit().await.unwrap();
                    if let Applied::Written {
                        change_seq: Some(c),
                    } = applied
                    {
                        committed.push(c);
                    }
                }
            }
            committed
        })
    };
    let (a, b) = tokio::join!(writer(0), writer(1));
    let mut committed: Vec<i64> = a.unwrap().into_iter().chain(b.unwrap()).collect();
    committed.sort_unstable();

    let (replay, count) = replay_changes(&db.pool, endpoint).await.unwrap();
    assert!(count > 20, "only {count} changes");
    assert_eq!(committed, (1..=count as i64).collect::<Vec<_>>());
    let rows = copy::copy_rows(&db.pool, endpoint).await.unwrap();
    assert_eq!(replay, items_of(&rows));
}

/// Applied event ids past their retention are deleted in batches; the recent ones stay, so a
/// redelivery inside the retention is still recognised.
#[tokio::test]
async fn applied_event_ids_past_their_retention_are_forgotten_in_batches() {
    let (db, tenant, endpoint) = fresh().await;
    let retention = Duration::from_secs(31 * 24 * 3600);
    for (id, age_days) in [
        ("old-1", 40),
        ("old-2", 32),
        ("old-3", 365),
        ("new-1", 30),
        ("new-2", 0),
    ] {
        sqlx::query(
            "INSERT INTO applied_events (endpoint_id, event_id, tenant_id, applied_at)
             VALUES ($1, $2, $3, now() - make_interval(days => $4))",
        )
        .bind(endpoint)
        .bind(id)
        .bind(tenant)
        .bind(age_days)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let mut batches = Vec::new();
    loop {
        let deleted = copy::forget_applied_events(&db.pool, retention, 2)
            .await
            .unwrap();
        batches.push(deleted);
        if deleted < 2 {
            break;
        }
    }
    assert_eq!(batches, vec![2, 1]);
    let left: BTreeSet<String> = sqlx::query_scalar("SELECT event_id FROM applied_events")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(
        left,
        BTreeSet::from(["new-1".to_owned(), "new-2".to_owned()])
    );
    // What is still remembered is still a duplicate.
    let mut conn = db.pool.acquire().await.unwrap();
    let first_seen = copy::record_event_ids(&mut conn, tenant, endpoint, &["new-1", "old-1"])
        .await
        .unwrap();
    assert_eq!(
        first_seen,
        std::collections::HashSet::from(["old-1".to_owned()])
    );
}
