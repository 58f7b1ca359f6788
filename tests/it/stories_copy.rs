//! A stories endpoint's copy (relay-store's `stories` around relay-rules'
//! `decide_stories_run`) against the in-memory executor of seed 000's two statements
//! (`relay_rules::StoriesCopy`), and each failure seed 000 names, against a real Postgres.
//!
//! The model-based property plays random event streams per story (created, updated,
//! became_strong with rising versions, a close that may merge into another story, duplicates),
//! shuffled and cut into runs at random points, once through the production statements and once
//! through the executor, and finds equal after every run: every row (ticker, version, closed,
//! snapshot), the outbox (numbered 1..=n; replayed in order it rebuilds the copy) and the
//! notifications claimed (once per story, none for backfill).
//!
//! Seeded: `RELAY_TEST_SEED` replays one seed; every failure message names its seed.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_rules::{
    decide_stories_run, plan_writes, stories_of_run, PlannedClaim, StoriesCopy, StoriesMode,
    StoriesPlan, StoriesRun, StoryChange, StoryWrite,
};
use relay_store::endpoints::{self, Registration, Source, StoriesSettings};
use relay_store::stories::{self as store, PlanCause, PlanWritten};
use relay_store::{EndpointId, TenantId};
use relay_tests::{random_secret, rows_of, TestDb};
use relay_wire::{Story, StoryEvent};
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

/// A snapshot-mode stories endpoint of a new tenant, following `tickers`, with no upstream (so
/// a sequencer runs no sync for it: only its messages are applied).
pub(crate) async fn register_stories(db: &TestDb, tickers: &[&str]) -> (TenantId, EndpointId) {
    let tenant = TenantId(db.tenant().await);
    let endpoint = EndpointId(Uuid::new_v4());
    endpoints::register(
        &db.pool,
        &relay_tests::keys(),
        tenant,
        &Registration {
            id: endpoint,
            name: None,
            source: Source::Stories(StoriesSettings {
                mode: StoriesMode::Snapshot,
                tickers: tickers.iter().map(|t| t.to_string()).collect(),
            }),
            lang: None,
            upstream_base_url: None,
            upstream_api_key: None,
            secrets: vec![random_secret()],
        },
    )
    .await
    .unwrap();
    (tenant, endpoint)
}

/// A stories endpoint registered for a new tenant, and its fencing token (claimed: no
/// sequencer may run beside it).
async fn stories_endpoint(db: &TestDb) -> (TenantId, EndpointId, i64) {
    let (tenant, endpoint) = register_stories(db, &["ALFA B", "BETA"]).await;
    let token = db.claim_fence(endpoint.0).await;
    (tenant, endpoint, token)
}

fn snapshot(id: &str, ticker: &str, version: i64, headline: &str) -> Value {
    json!({"id": id, "ticker": ticker, "version": version, "headline": headline,
           "articles": [{"id": format!("ar_{id}_{version}"), "story_id": id}]})
}

fn event(id: &str, kind: &str, origin: &str, data: Value) -> StoryEvent {
    StoryEvent::from_value(&json!({
        "event_id": id, "type": kind, "origin": origin,
        "created_at": "2026-10-08T06:40:00.300000Z", "data": data,
    }))
    .unwrap()
}

fn snapshot_event(event_id: &str, kind: &str, story: Value) -> StoryEvent {
    event(event_id, kind, "live", json!({ "story": story }))
}

fn closed_event(event_id: &str, id: &str, version: i64, merged_into: Option<Value>) -> StoryEvent {
    event(
        event_id,
        "story.closed",
        "live",
        json!({"story_id": id, "version": version, "merged_into": merged_into}),
    )
}

/// What the relay's handler does with a run of events (the sequencer's `apply_events`, without
/// its reads and cursors): held rows under the lock, the rules' plan, carried out whole by the
/// store's `write_plan`. The changes appended.
async fn apply(
    pool: &PgPool,
    (tenant, endpoint, token): (TenantId, EndpointId, i64),
    events: &[StoryEvent],
) -> u64 {
    let events: Vec<Result<StoryEvent, String>> = events.iter().cloned().map(Ok).collect();
    let ids = stories_of_run(&events);
    let mut writer = store::open(pool, tenant, endpoint, token)
        .await
        .unwrap()
        .expect("the fence is ours");
    let held = writer.held(&ids).await.unwrap();
    let plan = decide_stories_run(StoriesRun {
        tickers: None,
        mode: StoriesMode::Snapshot,
        events: &events,
        held: &held,
        reads: &HashMap::new(),
        registered_at: None,
    });
    assert_eq!(plan.outcomes.len(), events.len());
    assert!(plan.owed.is_empty(), "snapshot mode reads nothing");
    let written = writer.write_plan(&plan, PlanCause::Events).await.unwrap();
    assert_eq!(written.changes, writer.commit().await.unwrap());
    written.changes
}

/// The copy's rows: id → (ticker, version, closed, snapshot).
type Rows = BTreeMap<String, (Option<String>, i64, bool, Option<Value>)>;

async fn rows(pool: &PgPool, endpoint: EndpointId) -> Rows {
    let rows: Vec<store::CopiedStory> = rows_of(
        pool,
        "SELECT id, ticker, version, closed, story FROM stories WHERE endpoint_id = $1",
        endpoint,
    )
    .await;
    rows.into_iter()
        .map(|r| (r.id, (r.ticker, r.version, r.closed, r.story)))
        .collect()
}

fn model_rows(copy: &StoriesCopy) -> Rows {
    copy.rows
        .iter()
        .map(|(id, row)| {
            (
                id.clone(),
                (
                    row.ticker.clone(),
                    row.version,
                    row.closed,
                    row.story.clone(),
                ),
            )
        })
        .collect()
}

/// The outbox in change_seq order: (seq, kind, operation, subject, version, merged_into, item).
type OutboxRow = (
    i64,
    String,
    String,
    String,
    Option<i64>,
    Option<String>,
    Option<Value>,
);

async fn outbox(pool: &PgPool, endpoint: EndpointId) -> Vec<OutboxRow> {
    rows_of(
        pool,
        "SELECT change_seq, kind, operation, subject, story_version, merged_into, item::jsonb
         FROM changes WHERE endpoint_id = $1 ORDER BY change_seq",
        endpoint,
    )
    .await
}

/// The copy a consumer rebuilds from the outbox (what `relay tail` does with the queue).
fn replayed(outbox: &[OutboxRow]) -> StoriesCopy {
    let mut copy = StoriesCopy::default();
    for (_, kind, operation, subject, version, merged_into, item) in outbox {
        if kind != "story" {
            continue;
        }
        let change = match operation.as_str() {
            "saved" => StoryChange::Saved(Story::from_value(item.as_ref().unwrap()).unwrap()),
            "closed" => StoryChange::Closed {
                story_id: subject.clone(),
                version: version.unwrap(),
                merged_into: merged_into.clone(),
            },
            other => panic!("operation {other} in a stories outbox"),
        };
        copy.apply_change(&change);
    }
    copy
}

#[tokio::test]
async fn a_late_update_does_not_overwrite_a_newer_one() {
    let db = TestDb::new().await;
    let at = stories_endpoint(&db).await;
    let newer = snapshot_event(
        "evt_2",
        "story.updated",
        snapshot("st_1", "BETA", 3, "newer"),
    );
    let older = snapshot_event(
        "evt_1",
        "story.updated",
        snapshot("st_1", "BETA", 2, "older"),
    );
    assert_eq!(apply(&db.pool, at, &[newer]).await, 1);
    assert_eq!(
        apply(&db.pool, at, &[older]).await,
        0,
        "the late update changes nothing"
    );
    let copy = rows(&db.pool, at.1).await;
    assert_eq!(copy["st_1"].1, 3);
    assert_eq!(copy["st_1"].3.as_ref().unwrap()["headline"], "newer");
}

#[tokio::test]
async fn a_story_that_merged_away_is_not_saved_again_by_a_late_create() {
    let db = TestDb::new().await;
    let at = stories_endpoint(&db).await;
    let survivor = snapshot("st_b", "BETA", 4, "survivor");
    apply(
        &db.pool,
        at,
        &[closed_event("evt_close", "st_a", 3, Some(survivor))],
    )
    .await;
    let late = snapshot_event(
        "evt_create",
        "story.created",
        snapshot("st_a", "BETA", 1, "late"),
    );
    let late_update = snapshot_event(
        "evt_upd",
        "story.updated",
        snapshot("st_a", "BETA", 2, "late"),
    );
    assert_eq!(apply(&db.pool, at, &[late, late_update]).await, 0);
    let copy = rows(&db.pool, at.1).await;
    assert_eq!(copy["st_a"], (None, 3, true, None), "closed for good");
    assert!(!copy["st_b"].2);
    assert_eq!(copy["st_b"].1, 4);
    // The outbox says so, merge included.
    let changes = outbox(&db.pool, at.1).await;
    assert_eq!(changes.len(), 2);
    assert_eq!(
        (changes[0].2.as_str(), changes[0].5.as_deref()),
        ("closed", Some("st_b"))
    );
    assert_eq!(changes[1].2, "saved");
}

/// A new epoch's snapshot (a resync, a restore) says of a story merged away what its close
/// said: closed, at its version, merged into the survivor. A consumer rebuilding from the
/// snapshot alone holds what the relay holds.
#[tokio::test]
async fn a_new_epochs_snapshot_keeps_what_a_closed_story_merged_into() {
    let db = TestDb::new().await;
    let at = stories_endpoint(&db).await;
    let (tenant, endpoint, _) = at;
    let survivor = snapshot("st_b", "BETA", 4, "survivor");
    apply(
        &db.pool,
        at,
        &[
            closed_event("evt_merge", "st_a", 3, Some(survivor)),
            closed_event("evt_close", "st_c", 2, None),
        ],
    )
    .await;
    relay_store::restores::resync(&db.pool, tenant, endpoint)
        .await
        .unwrap()
        .expect("the tenant's endpoint");
    let snapshot: Vec<(String, String, Option<i64>, Option<String>)> = outbox(&db.pool, endpoint)
        .await
        .into_iter()
        .map(|c| (c.2, c.3, c.4, c.5))
        .collect();
    let change = |operation: &str, subject: &str, version: Option<i64>, into: Option<&str>| {
        (
            operation.to_owned(),
            subject.to_owned(),
            version,
            into.map(str::to_owned),
        )
    };
    assert_eq!(
        snapshot,
        vec![
            change("snapshot_begin", "", None, None),
            change("closed", "st_a", Some(3), Some("st_b")),
            change("saved", "st_b", Some(4), None),
            change("closed", "st_c", Some(2), None),
            change("snapshot_end", "", None, None),
        ]
    );
    // Rebuilt from the new epoch alone, the copy is the relay's.
    assert_eq!(
        model_rows(&replayed(&outbox(&db.pool, endpoint).await)),
        rows(&db.pool, endpoint).await
    );
}

#[tokio::test]
async fn a_slow_read_from_before_the_close_cannot_reopen_it() {
    // Fetch-on-notify's slow read: the API read the story (version 2) before it closed, and its
    // answer is applied after the close. The save is refused by the row, not by the caller.
    let db = TestDb::new().await;
    let at = stories_endpoint(&db).await;
    apply(&db.pool, at, &[closed_event("evt_c", "st_1", 3, None)]).await;
    let stale = Story::from_value(&snapshot("st_1", "BETA", 2, "read before the close")).unwrap();
    let mut writer = store::open(&db.pool, at.0, at.1, at.2)
        .await
        .unwrap()
        .unwrap();
    let held = writer.held(&["st_1".to_owned()]).await.unwrap();
    let plan = plan_writes(&held, [StoryWrite::Save(stale.clone())]);
    assert_eq!(plan.writes[0].change, None, "the rules refuse it");
    // Planned against no row, the plan expects a change: the statement itself still refuses
    // to write, and the writer refuses the plan.
    let raced = plan_writes(&HashMap::new(), [StoryWrite::Save(stale)]);
    let refused = writer.write_plan(&raced, PlanCause::Round(1)).await;
    assert!(
        matches!(refused, Err(relay_store::StoreError::Refused(_))),
        "{refused:?}"
    );
    drop(writer);
    assert_eq!(rows(&db.pool, at.1).await["st_1"], (None, 3, true, None));
}

/// The outbox's causes in change_seq order: (operation, subject, event_id, reload_generation).
async fn causes(
    pool: &PgPool,
    endpoint: EndpointId,
) -> Vec<(String, String, Option<String>, Option<i64>)> {
    rows_of(
        pool,
        "SELECT operation, subject, event_id, reload_generation FROM changes
         WHERE endpoint_id = $1 ORDER BY change_seq",
        endpoint,
    )
    .await
}

/// One run writes a story several times (saves, a late save, a close that merges, a save after
/// the close): one statement carries the plan out, each write deciding against the row as the
/// one before left it, each change appended in order with its own event, the claim's after.
#[tokio::test]
async fn one_plan_writing_a_story_several_times_appends_each_change_in_order() {
    let db = TestDb::new().await;
    let at = stories_endpoint(&db).await;
    let run = [
        snapshot_event("e1", "story.created", snapshot("st_1", "BETA", 1, "v1")),
        snapshot_event("e2", "story.updated", snapshot("st_1", "BETA", 2, "v2")),
        snapshot_event("e3", "story.updated", snapshot("st_1", "BETA", 1, "v1")),
        snapshot_event(
            "e4",
            "story.became_strong",
            snapshot("st_1", "BETA", 3, "v3"),
        ),
        closed_event(
            "e5",
            "st_1",
            4,
            Some(snapshot("st_2", "BETA", 5, "survivor")),
        ),
        snapshot_event("e6", "story.updated", snapshot("st_1", "BETA", 5, "late")),
    ];
    assert_eq!(apply(&db.pool, at, &run).await, 6);
    let mut model = StoriesCopy::default();
    for write in run.iter().flat_map(relay_rules::snapshot_writes) {
        model.apply(&write);
    }
    assert_eq!(rows(&db.pool, at.1).await, model_rows(&model));
    // (change_seq, operation, subject, story_version, merged_into)
    type Change = (i64, String, String, Option<i64>, Option<String>);
    let changes: Vec<Change> = outbox(&db.pool, at.1)
        .await
        .into_iter()
        .map(|c| (c.0, c.2, c.3, c.4, c.5))
        .collect();
    let change = |seq, operation: &str, subject: &str, version, merged_into: Option<&str>| {
        let merged_into = merged_into.map(str::to_owned);
        (
            seq,
            operation.to_owned(),
            subject.to_owned(),
            Some(version),
            merged_into,
        )
    };
    assert_eq!(
        changes,
        vec![
            change(1, "saved", "st_1", 1, None),
            change(2, "saved", "st_1", 2, None),
            change(3, "saved", "st_1", 3, None),
            change(4, "closed", "st_1", 4, Some("st_2")),
            change(5, "saved", "st_2", 5, None),
            change(6, "notified", "st_1", 3, None),
        ]
    );
    let events: Vec<Option<String>> = causes(&db.pool, at.1)
        .await
        .into_iter()
        .map(|(_, _, event_id, round)| {
            assert_eq!(round, None);
            event_id
        })
        .collect();
    let expected = ["e1", "e2", "e4", "e5", "e5", "e4"].map(|e| Some(e.to_owned()));
    assert_eq!(events, expected);
    let closed = store::find(&db.pool, at.0, at.1, "st_1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(closed.merged_into.as_deref(), Some("st_2"));
    // The same run again changes nothing, and claims nothing again.
    assert_eq!(apply(&db.pool, at, &run).await, 0);
}

/// A round's plan (a reload's batch) names its round on each change, and no event.
#[tokio::test]
async fn a_rounds_plan_names_its_round_and_no_event() {
    let db = TestDb::new().await;
    let (tenant, endpoint, token) = stories_endpoint(&db).await;
    let story =
        |id: &str, version| Story::from_value(&snapshot(id, "ALFA B", version, "listed")).unwrap();
    let mut writer = store::open(&db.pool, tenant, endpoint, token)
        .await
        .unwrap()
        .expect("the fence is ours");
    let ids = ["st_1".to_owned(), "st_2".to_owned()];
    let held = writer.held(&ids).await.unwrap();
    let plan = plan_writes(
        &held,
        [
            StoryWrite::Save(story("st_1", 2)),
            StoryWrite::Save(story("st_2", 1)),
            StoryWrite::Save(story("st_1", 1)),
            StoryWrite::Close {
                story_id: "st_2".into(),
                version: 0,
                merged_into: None,
            },
        ],
    );
    let written = writer.write_plan(&plan, PlanCause::Round(7)).await.unwrap();
    assert_eq!(
        written,
        PlanWritten {
            saved: 2,
            unchanged: 1,
            closed: 1,
            changes: 3,
            ..PlanWritten::default()
        }
    );
    assert_eq!(writer.commit().await.unwrap(), 3);
    let round =
        |operation: &str, subject: &str| (operation.to_owned(), subject.to_owned(), None, Some(7));
    assert_eq!(
        causes(&db.pool, endpoint).await,
        vec![
            round("saved", "st_1"),
            round("saved", "st_2"),
            round("closed", "st_2")
        ]
    );
    // Closed on a 404 at 0: the row keeps the version it had.
    assert_eq!(
        rows(&db.pool, endpoint).await["st_2"],
        (Some("ALFA B".into()), 1, true, None)
    );
}

/// A plan decided against rows that are not the rows held (another writer's, in a race the
/// lock prevents) is refused whole: the writer's transaction, rolled back, wrote nothing, not
/// even the plan's writes that did what it said.
#[tokio::test]
async fn a_plan_decided_against_other_rows_is_refused_whole() {
    let db = TestDb::new().await;
    let at = stories_endpoint(&db).await;
    let newer = snapshot_event("e1", "story.updated", snapshot("st_b", "BETA", 3, "newer"));
    apply(&db.pool, at, &[newer]).await;
    let events: Vec<Result<StoryEvent, String>> = [
        snapshot_event("e2", "story.created", snapshot("st_a", "BETA", 1, "new")),
        snapshot_event("e3", "story.updated", snapshot("st_b", "BETA", 2, "older")),
    ]
    .into_iter()
    .map(Ok)
    .collect();
    let mut writer = store::open(&db.pool, at.0, at.1, at.2)
        .await
        .unwrap()
        .expect("the fence is ours");
    writer.held(&stories_of_run(&events)).await.unwrap();
    // Decided as if st_b were not held: its save is planned to change the row.
    let plan = decide_stories_run(StoriesRun {
        tickers: None,
        mode: StoriesMode::Snapshot,
        events: &events,
        held: &HashMap::new(),
        reads: &HashMap::new(),
        registered_at: None,
    });
    let refused = writer.write_plan(&plan, PlanCause::Events).await;
    assert!(
        matches!(&refused, Err(relay_store::StoreError::Refused(why)) if why.contains("st_b")),
        "{refused:?}"
    );
    drop(writer);
    let copy = rows(&db.pool, at.1).await;
    assert_eq!(copy.keys().collect::<Vec<_>>(), vec!["st_b"]);
    assert_eq!(copy["st_b"].1, 3);
    assert_eq!(outbox(&db.pool, at.1).await.len(), 1);
}

#[tokio::test]
async fn two_handlers_checking_is_this_newer_at_once_end_with_the_newest() {
    let seed = relay_tests::seed();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let db = TestDb::new().await;
    let at = stories_endpoint(&db).await;
    for round in 0..20 {
        let id = format!("st_{round}");
        let mut versions: Vec<i64> = (1..=6).collect();
        versions.shuffle(&mut rng);
        let tasks: Vec<_> = versions
            .iter()
            .map(|&v| {
                let pool = db.pool.clone();
                let story = snapshot(&id, "BETA", v, &format!("v{v}"));
                tokio::spawn(async move {
                    let e = snapshot_event(&format!("evt_{v}"), "story.updated", story);
                    apply(&pool, at, &[e]).await
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let copy = rows(&db.pool, at.1).await;
        assert_eq!(
            copy[&id].1, 6,
            "seed {seed}: story {id} ended at {:?}",
            copy[&id]
        );
    }
    // Every save that wrote appended one change, numbered without gaps, and replaying them
    // rebuilds the copy.
    let changes = outbox(&db.pool, at.1).await;
    let seqs: Vec<i64> = changes.iter().map(|c| c.0).collect();
    assert_eq!(
        seqs,
        (1..=changes.len() as i64).collect::<Vec<_>>(),
        "seed {seed}"
    );
    assert_eq!(
        model_rows(&replayed(&changes)),
        rows(&db.pool, at.1).await,
        "seed {seed}"
    );
}

#[tokio::test]
async fn a_story_is_notified_once_and_never_for_backfill() {
    let db = TestDb::new().await;
    let at = stories_endpoint(&db).await;
    let strong = |event_id: &str, origin: &str, id: &str, v: i64| {
        event(
            event_id,
            "story.became_strong",
            origin,
            json!({ "story": snapshot(id, "BETA", v, "strong") }),
        )
    };
    apply(&db.pool, at, &[strong("evt_1", "live", "st_1", 2)]).await;
    // The same event again, another live one, and in a run with it twice.
    apply(&db.pool, at, &[strong("evt_1", "live", "st_1", 2)]).await;
    apply(
        &db.pool,
        at,
        &[
            strong("evt_9", "live", "st_1", 3),
            strong("evt_9", "live", "st_1", 3),
        ],
    )
    .await;
    apply(&db.pool, at, &[strong("evt_2", "backfill", "st_2", 2)]).await;
    let claimed: Vec<String> =
        sqlx::query_scalar("SELECT key FROM claimed WHERE endpoint_id = $1 ORDER BY key")
            .bind(at.1)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(claimed, vec!["strong:st_1".to_owned()]);
    let notified: Vec<String> = outbox(&db.pool, at.1)
        .await
        .into_iter()
        .filter(|c| c.1 == "notification")
        .map(|c| c.3)
        .collect();
    assert_eq!(notified, vec!["st_1".to_owned()]);
    // The backfill event still changed the copy.
    assert_eq!(rows(&db.pool, at.1).await["st_2"].1, 2);
}

/// A claim told not to notify (its event predates the endpoint's registration) takes the key
/// and appends nothing; the story's later claims, notifying or not, find the key taken.
#[tokio::test]
async fn a_silent_claim_takes_the_key_and_a_later_one_notifies_nothing() {
    let db = TestDb::new().await;
    let (tenant, endpoint, token) = stories_endpoint(&db).await;
    let old = Story::from_value(&snapshot("st_old", "BETA", 2, "strong before")).unwrap();
    let new = Story::from_value(&snapshot("st_new", "BETA", 2, "strong since")).unwrap();
    let mut writer = store::open(&db.pool, tenant, endpoint, token)
        .await
        .unwrap()
        .expect("the fence is ours");
    // (notified, claimed silently, claimed before) of each claim, a plan of its own.
    let claims = [
        (&old, "evt_old", false, (0, 1, 0)),
        (&old, "evt_old_again", true, (0, 0, 1)),
        (&new, "evt_new", true, (1, 0, 0)),
        (&new, "evt_new_again", false, (0, 0, 1)),
    ];
    for (story, event_id, notify, expected) in claims {
        let plan = StoriesPlan {
            claims: vec![PlannedClaim {
                key: format!("strong:{}", story.id),
                story: story.clone(),
                event_id: event_id.to_owned(),
                notify,
            }],
            ..StoriesPlan::default()
        };
        let PlanWritten {
            notified,
            claimed_silently,
            claimed_before,
            ..
        } = writer.write_plan(&plan, PlanCause::Events).await.unwrap();
        assert_eq!(
            (notified, claimed_silently, claimed_before),
            expected,
            "{event_id} (notify {notify})"
        );
    }
    assert_eq!(writer.commit().await.unwrap(), 1, "one change appended");
    let claimed: Vec<(String, Option<String>)> = rows_of(
        &db.pool,
        "SELECT key, event_id FROM claimed WHERE endpoint_id = $1 ORDER BY key",
        endpoint,
    )
    .await;
    assert_eq!(
        claimed,
        vec![
            ("strong:st_new".to_owned(), Some("evt_new".to_owned())),
            ("strong:st_old".to_owned(), Some("evt_old".to_owned())),
        ]
    );
    let notified: Vec<(i64, String)> = outbox(&db.pool, endpoint)
        .await
        .into_iter()
        .map(|c| (c.0, c.3))
        .collect();
    assert_eq!(notified, vec![(1, "st_new".to_owned())]);
}

/// A resync (or a restore) opens a new epoch: the old epoch's changes go, but a notification
/// it had not yet published follows the new epoch's snapshot, since its claim is taken and no
/// later event can notify the story again; one already published is not sent twice.
#[tokio::test]
async fn a_notification_not_yet_published_survives_a_new_epoch() {
    let db = TestDb::new().await;
    let at = stories_endpoint(&db).await;
    let (tenant, endpoint, _) = at;
    let strong = |event_id: &str, id: &str| {
        event(
            event_id,
            "story.became_strong",
            "live",
            json!({ "story": snapshot(id, "BETA", 2, "strong") }),
        )
    };
    apply(&db.pool, at, &[strong("evt_1", "st_1")]).await;
    let sent = outbox(&db.pool, endpoint).await.len() as i64;
    let publisher = relay_store::fences::claim_tenant(&db.pool, tenant)
        .await
        .unwrap();
    relay_store::changes::mark_published(&db.pool, tenant, publisher, &[(endpoint, sent)])
        .await
        .unwrap();
    apply(&db.pool, at, &[strong("evt_2", "st_2")]).await;

    relay_store::restores::resync(&db.pool, tenant, endpoint)
        .await
        .unwrap()
        .expect("the tenant's endpoint");
    let epoch: Vec<(i64, String, String)> = outbox(&db.pool, endpoint)
        .await
        .into_iter()
        .map(|c| (c.0, c.2, c.3))
        .collect();
    let change =
        |seq: i64, operation: &str, subject: &str| (seq, operation.to_owned(), subject.to_owned());
    assert_eq!(
        epoch,
        vec![
            change(1, "snapshot_begin", ""),
            change(2, "saved", "st_1"),
            change(3, "saved", "st_2"),
            change(4, "snapshot_end", ""),
            change(5, "notified", "st_2"),
        ]
    );
    let carried: (Option<String>, Option<String>, Option<i64>, bool) = sqlx::query_as(
        "SELECT event_id, ticker, story_version, snapshot FROM changes
         WHERE endpoint_id = $1 AND change_seq = 5",
    )
    .bind(endpoint)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        carried,
        (
            Some("evt_2".to_owned()),
            Some("BETA".to_owned()),
            Some(2),
            false
        )
    );
    // The counter is past the carried notification: the next change follows it.
    apply(&db.pool, at, &[closed_event("evt_3", "st_1", 3, None)]).await;
    let last = outbox(&db.pool, endpoint)
        .await
        .last()
        .map(|c| (c.0, c.2.clone()));
    assert_eq!(last, Some((6, "closed".to_owned())));
}

/// One story's events as the upstream publishes them: created, updates, maybe strong, maybe a
/// close (merging into `into` when given). Versions rise by one per change.
fn story_events(rng: &mut ChaCha8Rng, n: usize, into: Option<&str>, start: i64) -> Vec<StoryEvent> {
    let id = format!("st_{n}");
    let ticker = if n.is_multiple_of(2) {
        "ALFA B"
    } else {
        "BETA"
    };
    let mut events = vec![snapshot_event(
        &format!("evt_{n}_1"),
        "story.created",
        snapshot(&id, ticker, start, "created"),
    )];
    let changes = rng.gen_range(0..4);
    let mut version = start;
    for _ in 0..changes {
        version += 1;
        let kind = if rng.gen_bool(0.3) {
            "story.became_strong"
        } else {
            "story.updated"
        };
        let origin = if rng.gen_bool(0.2) {
            "backfill"
        } else {
            "live"
        };
        events.push(event(
            &format!("evt_{n}_{version}"),
            kind,
            origin,
            json!({ "story": snapshot(&id, ticker, version, &format!("v{version}")) }),
        ));
    }
    if rng.gen_bool(0.5) {
        version += 1;
        let merged = into.map(|into| snapshot(into, ticker, 100 + version, "merged"));
        events.push(closed_event(
            &format!("evt_{n}_close"),
            &id,
            version,
            merged,
        ));
    }
    events
}

#[tokio::test]
async fn random_streams_through_the_statements_and_the_rules_give_the_same_copy() {
    let base = relay_tests::seed();
    let db = TestDb::new().await;
    for case in 0..12u64 {
        let seed = base.wrapping_add(case);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let at = stories_endpoint(&db).await;
        let mut events = Vec::new();
        for n in 0..6 {
            // Stories 0..3 may merge into the next one: chains.
            let into = (n < 3).then(|| format!("st_{}", n + 1));
            events.extend(story_events(&mut rng, n, into.as_deref(), 1));
        }
        // Duplicates, then any order.
        let duplicates: Vec<StoryEvent> = events
            .iter()
            .filter(|_| rng.gen_bool(0.2))
            .cloned()
            .collect();
        events.extend(duplicates);
        events.shuffle(&mut rng);
        let mut model = StoriesCopy::default();
        let mut notified_model = BTreeSet::new();
        let mut rest = &events[..];
        while !rest.is_empty() {
            let cut = rng.gen_range(1..=rest.len().min(5));
            let (run, after) = rest.split_at(cut);
            rest = after;
            apply(&db.pool, at, run).await;
            for event in run {
                for write in relay_rules::snapshot_writes(event) {
                    model.apply(&write);
                }
                if let Some(key) = relay_rules::notification_claim(event) {
                    notified_model.insert(key);
                }
            }
            assert_eq!(
                rows(&db.pool, at.1).await,
                model_rows(&model),
                "seed {seed}: the copy after a run of {cut}"
            );
        }
        let changes = outbox(&db.pool, at.1).await;
        let seqs: Vec<i64> = changes.iter().map(|c| c.0).collect();
        assert_eq!(
            seqs,
            (1..=changes.len() as i64).collect::<Vec<_>>(),
            "seed {seed}"
        );
        assert_eq!(
            model_rows(&replayed(&changes)),
            model_rows(&model),
            "seed {seed}: replay"
        );
        let notified: BTreeSet<String> = changes
            .iter()
            .filter(|c| c.1 == "notification")
            .map(|c| format!("strong:{}", c.3))
            .collect();
        assert_eq!(notified, notified_model, "seed {seed}: notifications");
    }
}

/// The stories owed a read, with how many times each was recorded.
async fn owed(pool: &PgPool, endpoint: EndpointId) -> Vec<(String, i64)> {
    rows_of(
        pool,
        "SELECT story_id, recorded FROM story_reads_owed WHERE endpoint_id = $1 ORDER BY story_id",
        endpoint,
    )
    .await
}

/// A read owed is written in the transaction that moves the cursor: both commit, or neither
/// (the cursor moved under the writer, and it rolled back); a fenced writer opens nothing. An
/// owed read is paid only at the recording count it was read at: a failed read recorded since
/// (perhaps for a newer change) keeps the debt.
#[tokio::test]
async fn a_read_owed_commits_with_the_cursors_move_or_not_at_all() {
    let db = TestDb::new().await;
    let (tenant, endpoint, token) = stories_endpoint(&db).await;
    store::sync_state(&db.pool, tenant, endpoint).await.unwrap();
    let owe = |stories: Vec<&str>| stories.into_iter().map(str::to_owned).collect::<Vec<_>>();

    let mut writer = store::open(&db.pool, tenant, endpoint, token)
        .await
        .unwrap()
        .expect("the fence is ours");
    writer
        .owe_reads(&owe(vec!["st_1", "st_2"]), "404")
        .await
        .unwrap();
    assert!(writer
        .move_cursor(None, Some("evc_8"), false)
        .await
        .unwrap());
    writer.commit().await.unwrap();
    assert_eq!(
        owed(&db.pool, endpoint).await,
        vec![("st_1".to_owned(), 1), ("st_2".to_owned(), 1)]
    );

    // The cursor is no longer where this writer read it: it rolls back, its debt with it.
    let mut writer = store::open(&db.pool, tenant, endpoint, token)
        .await
        .unwrap()
        .expect("the fence is ours");
    writer
        .owe_reads(&owe(vec!["st_2", "st_3"]), "404")
        .await
        .unwrap();
    assert!(!writer
        .move_cursor(None, Some("evc_9"), false)
        .await
        .unwrap());
    drop(writer);
    assert_eq!(
        owed(&db.pool, endpoint).await,
        vec![("st_1".to_owned(), 1), ("st_2".to_owned(), 1)]
    );

    // Another worker took the endpoint: the old token opens no writer, and writes nothing.
    let newer = db.claim_fence(endpoint.0).await;
    assert!(newer > token);
    assert!(store::open(&db.pool, tenant, endpoint, token)
        .await
        .unwrap()
        .is_none());

    // Paying: the row read at recording 1 of st_1 goes; st_2, recorded again since, stays.
    let due = store::owed_reads_due(&db.pool, endpoint, 10).await.unwrap();
    assert_eq!(due.len(), 2);
    let mut writer = store::open(&db.pool, tenant, endpoint, newer)
        .await
        .unwrap()
        .expect("the fence is ours");
    writer.owe_reads(&owe(vec!["st_2"]), "503").await.unwrap();
    assert!(writer.pay_read(&due[0]).await.unwrap());
    assert!(!writer.pay_read(&due[1]).await.unwrap());
    writer.commit().await.unwrap();
    assert_eq!(owed(&db.pool, endpoint).await, vec![("st_2".to_owned(), 2)]);

    // A read that fails again waits: nothing is due until its pause passes. A second worker
    // that failed the same read, as it was, moves nothing more.
    let seen = store::owed_reads_due(&db.pool, endpoint, 10).await.unwrap();
    let pause = relay_rules::owed_read_pause(
        seen[0].attempts as u32,
        std::time::Duration::from_secs(60),
        std::time::Duration::from_secs(300),
        0.5,
    );
    for _ in 0..2 {
        store::owed_read_failed(&db.pool, endpoint, "st_2", "503", seen[0].attempts, pause)
            .await
            .unwrap();
    }
    assert!(store::owed_reads_due(&db.pool, endpoint, 10)
        .await
        .unwrap()
        .is_empty());
    let attempts: i32 = sqlx::query_scalar(
        "SELECT attempts FROM story_reads_owed WHERE endpoint_id = $1 AND story_id = 'st_2'",
    )
    .bind(endpoint)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(attempts, seen[0].attempts + 1);
}
