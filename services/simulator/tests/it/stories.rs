//! The stories upstream (seed 000): the model's rules, the events' shapes, the oracle, the API
//! (paging, 410, listings, 404s and faults) and the webhook sender (signatures, faults, retries,
//! giving up), and a reference consumer that converges to the oracle over real HTTP.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use relay_simulator::model::World;
use relay_simulator::stories::{CopyRow, StoriesLogEntry, StoryEventType, StoryRead};
use relay_simulator::upstream::{Answer, MessageKind, Outgoing, SenderConfig, Upstream};
use relay_simulator::{
    Faults, Origin, Simulation, Stories, StoriesConfig, StoriesEndpointSpec, StoriesFaults,
    StoriesWorkload, StoriesWorkloadConfig,
};
use relay_wire::{verify, SignatureHeaders, SigningSecret};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::common::verify_received;

const WALL: i64 = 1_791_439_212;
const KEY: &str = "sk_test";
const ALFA: &str = "ALFA B";
const BETA: &str = "BETA";

fn secret() -> SigningSecret {
    SigningSecret::parse("whsec_d2ViaG9vay1leGFtcGxlLXNlY3JldC12MSEh").unwrap()
}

fn spec(url: &str, key: &str, tickers: &[&str]) -> StoriesEndpointSpec {
    StoriesEndpointSpec {
        id: None,
        url: url.to_owned(),
        secrets: vec![secret()],
        api_key: key.to_owned(),
        tickers: tickers.iter().map(|t| t.to_string()).collect(),
    }
}

/// A stories upstream with one endpoint (key [`KEY`]) following `tickers`.
fn stories_with(tickers: &[&str], faults: StoriesFaults) -> (Stories, Uuid) {
    let mut stories = Stories::new(StoriesConfig::default(), faults, 7);
    let id = stories.add_stories_endpoint(spec("http://x/{id}", KEY, tickers));
    (stories, id)
}

/// Sends everything due at `now_ms`, answering each with `answer`; returns what was sent.
fn drain(
    stories: &mut Stories,
    now_ms: u64,
    answer: impl Fn(&Outgoing) -> Answer,
) -> Vec<Outgoing> {
    let mut sent = Vec::new();
    loop {
        let sends = stories.poll_sends(now_ms, WALL);
        if sends.is_empty() {
            return sent;
        }
        for out in sends {
            stories.on_answer(out.endpoint_id, out.serial, answer(&out), now_ms, WALL);
            sent.push(out);
        }
        assert!(sent.len() < 10_000, "the sender does not stop");
    }
}

fn ok(_: &Outgoing) -> Answer {
    Answer::status(200)
}

fn body(out: &Outgoing) -> Value {
    serde_json::from_slice(&out.body).unwrap()
}

// ---- the model ---------------------------------------------------------------------------------

#[test]
fn versions_rise_by_one_and_a_closed_story_never_changes_again() {
    let (mut st, _) = stories_with(&[ALFA], StoriesFaults::default());
    let id = st.create_story(ALFA, "Alfa wins an order", Origin::Live, 0);
    assert_eq!(st.story(&id).unwrap().version, 1);
    st.update_story(
        &id,
        Some("Alfa wins its largest order"),
        true,
        Origin::Live,
        0,
    )
    .unwrap();
    assert_eq!(st.story(&id).unwrap().version, 2);
    assert_eq!(st.story(&id).unwrap().articles.len(), 2);
    st.make_strong(&id, Origin::Live, 0).unwrap();
    assert_eq!(st.story(&id).unwrap().version, 3);
    assert!(st.make_strong(&id, Origin::Live, 0).is_err(), "strong once");
    let article = st.story(&id).unwrap().articles[0].id.clone();
    st.shortlist_article(&id, &article, Origin::Live, 0)
        .unwrap();
    assert_eq!(
        st.story(&id).unwrap().version,
        3,
        "shortlisting is no change"
    );
    st.close_story(&id, Origin::Live, 0).unwrap();
    let closed = st.story(&id).unwrap();
    assert!(closed.closed);
    assert_eq!((closed.version, closed.closing_version), (4, Some(4)));
    let events_before = st.events().len();
    assert!(st
        .update_story(&id, Some("again"), false, Origin::Live, 0)
        .is_err());
    assert!(st.close_story(&id, Origin::Live, 0).is_err());
    assert!(st
        .shortlist_article(&id, &article, Origin::Live, 0)
        .is_err());
    assert_eq!(
        st.events().len(),
        events_before,
        "a refused change publishes nothing"
    );
}

#[test]
fn a_merge_moves_the_articles_and_chains_end_in_the_last_survivor() {
    let (mut st, _) = stories_with(&[ALFA], StoriesFaults::default());
    let a = st.create_story(ALFA, "a", Origin::Live, 0);
    let b = st.create_story(ALFA, "b", Origin::Live, 0);
    let c = st.create_story(ALFA, "c", Origin::Live, 0);
    let other = st.create_story(BETA, "other ticker", Origin::Live, 0);
    assert!(st.merge_stories(&a, &other, Origin::Live, 0).is_err());
    assert!(st.merge_stories(&a, &a, Origin::Live, 0).is_err());

    st.merge_stories(&a, &b, Origin::Live, 0).unwrap();
    let (sa, sb) = (st.story(&a).unwrap(), st.story(&b).unwrap());
    assert!(sa.closed && sa.articles.is_empty());
    assert_eq!(sa.closing_version, Some(2));
    assert_eq!(sa.merged_into.as_deref(), Some(b.as_str()));
    assert_eq!(sb.version, 2);
    assert_eq!(sb.articles.len(), 2);
    assert!(sb.articles.iter().all(|x| x.story_id == b));
    let closed = &st.events().last().unwrap().json;
    assert_eq!(closed["type"], "story.closed");
    assert_eq!(closed["data"]["story_id"], json!(a));
    assert_eq!(closed["data"]["version"], json!(2));
    assert_eq!(closed["data"]["merged_into"], sb.snapshot());

    // B → C: C holds every article of A and B.
    st.merge_stories(&b, &c, Origin::Live, 0).unwrap();
    let sc = st.story(&c).unwrap();
    assert!(st.story(&b).unwrap().closed);
    assert_eq!(st.story(&b).unwrap().closing_version, Some(3));
    assert_eq!(sc.articles.len(), 3);
    assert!(sc.articles.iter().all(|x| x.story_id == c));
    assert!(
        st.merge_stories(&c, &a, Origin::Live, 0).is_err(),
        "A stays closed"
    );
}

/// Over a long random workload: each story's versions in its events rise by one per change
/// (shortlisting none), nothing follows a close, merges keep articles, and chains happen.
#[test]
fn the_random_workload_keeps_the_rules_and_makes_chains() {
    for seed in [1, 2, 3] {
        let mut st = Stories::new(StoriesConfig::default(), StoriesFaults::default(), seed);
        let mut workload = StoriesWorkload::new(seed, StoriesWorkloadConfig::default());
        workload.setup(&mut st, "http://x/{id}");
        for tick in 0..3_000 {
            workload.step(&mut st, tick);
        }
        let mut version: HashMap<String, u64> = HashMap::new();
        let mut closed: BTreeSet<String> = BTreeSet::new();
        let mut merged_into: HashMap<String, String> = HashMap::new();
        let mut backfill = 0;
        for event in st.events() {
            let data = &event.json["data"];
            if event.origin == Origin::Backfill {
                backfill += 1;
            }
            assert!(
                !closed.contains(&event.story_id),
                "{} after its close",
                event.event_id
            );
            match event.event_type {
                StoryEventType::Created => {
                    assert_eq!(data["story"]["version"], 1);
                    version.insert(event.story_id.clone(), 1);
                }
                StoryEventType::Updated | StoryEventType::BecameStrong => {
                    let v = version.get_mut(&event.story_id).unwrap();
                    *v += 1;
                    assert_eq!(data["story"]["version"], *v);
                }
                StoryEventType::Shortlisted => {}
                StoryEventType::Closed => {
                    let v = version[&event.story_id] + 1;
                    assert_eq!(data["version"], v, "the closing version");
                    version.insert(event.story_id.clone(), v);
                    closed.insert(event.story_id.clone());
                    if let Some(into) = data["merged_into"].as_object() {
                        let into_id = into["id"].as_str().unwrap().to_owned();
                        assert!(!closed.contains(&into_id));
                        let w = version.get_mut(&into_id).unwrap();
                        *w += 1;
                        assert_eq!(into["version"], *w);
                        merged_into.insert(event.story_id.clone(), into_id);
                    }
                }
            }
        }
        for story in st.book().stories() {
            assert_eq!(story.version, version[&story.id]);
            assert_eq!(story.closed, closed.contains(&story.id));
        }
        // Every article that ever appeared is held by exactly one story now, under its id.
        let mut appeared = BTreeSet::new();
        for event in st.events() {
            let data = &event.json["data"];
            for story in [&data["story"], &data["merged_into"]] {
                for article in story["articles"].as_array().into_iter().flatten() {
                    appeared.insert(article["id"].as_str().unwrap().to_owned());
                }
            }
        }
        let mut held = BTreeSet::new();
        for story in st.book().stories() {
            for article in &story.articles {
                assert_eq!(article.story_id, story.id);
                assert!(held.insert(article.id.clone()), "{} held twice", article.id);
            }
        }
        assert_eq!(held, appeared, "no article lost or made up by merges");
        let chains = merged_into
            .values()
            .filter(|into| merged_into.contains_key(*into))
            .count();
        assert!(chains > 0, "seed {seed}: no merge chain");
        assert!(backfill > 0, "seed {seed}: no backfill");
        assert!(st.book().open_stories(None).count() > 0);
    }
}

// ---- the events' shapes ------------------------------------------------------------------------

fn keys(value: &Value) -> Vec<&str> {
    let mut keys: Vec<&str> = value
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort();
    keys
}

#[test]
fn events_have_upstream_api_shapes() {
    let (mut st, _) = stories_with(&[ALFA], StoriesFaults::default());
    let a = st.create_story(ALFA, "a", Origin::Live, 1_300);
    let b = st.create_story(ALFA, "b", Origin::Backfill, 1_300);
    st.update_story(&a, Some("a2"), false, Origin::Live, 1_300)
        .unwrap();
    st.make_strong(&a, Origin::Live, 1_300).unwrap();
    let article = st.story(&a).unwrap().articles[0].id.clone();
    st.shortlist_article(&a, &article, Origin::Live, 1_300)
        .unwrap();
    st.close_story(&b, Origin::Live, 1_300).unwrap();
    let c = st.create_story(ALFA, "c", Origin::Live, 1_300);
    st.merge_stories(&a, &c, Origin::Live, 1_300).unwrap();

    let events: Vec<&Value> = st.events().iter().map(|e| &e.json).collect();
    let mut ids = BTreeSet::new();
    for event in &events {
        assert_eq!(
            keys(event),
            ["created_at", "data", "event_id", "origin", "type"]
        );
        let id = event["event_id"].as_str().unwrap();
        let hex = id.strip_prefix("evt_").unwrap();
        assert_eq!(hex.len(), 16);
        assert!(hex.bytes().all(|c| c.is_ascii_hexdigit()));
        assert!(ids.insert(id.to_owned()), "event ids are unique");
        // The wire file's example day, 1.3 s in, with microseconds.
        assert_eq!(event["created_at"], "2026-10-08T06:00:01.300000Z");
    }
    assert_eq!(events[0]["type"], "story.created");
    assert_eq!(events[0]["origin"], "live");
    assert_eq!(events[1]["origin"], "backfill");
    assert_eq!(keys(&events[0]["data"]), ["story"]);
    assert_eq!(
        events[0]["data"]["story"],
        json!({"id": a, "ticker": ALFA, "version": 1, "headline": "a",
               "articles": [{"id": "ar_1", "story_id": a}]})
    );
    assert_eq!(events[2]["type"], "story.updated");
    assert_eq!(events[2]["data"]["story"]["version"], 2);
    assert_eq!(events[3]["type"], "story.became_strong");
    assert_eq!(events[3]["data"]["story"]["version"], 3);
    assert_eq!(events[4]["type"], "article.shortlisted");
    assert_eq!(
        events[4]["data"],
        json!({"article": {"id": article, "story_id": a}})
    );
    assert_eq!(events[5]["type"], "story.closed");
    assert_eq!(
        events[5]["data"],
        json!({"story_id": b, "version": 2, "merged_into": null})
    );
    assert_eq!(events[7]["type"], "story.closed");
    assert_eq!(
        keys(&events[7]["data"]),
        ["merged_into", "story_id", "version"]
    );
    assert_eq!(events[7]["data"]["story_id"], json!(a));
    assert_eq!(events[7]["data"]["version"], 4);
    assert_eq!(events[7]["data"]["merged_into"]["id"], json!(c));
    assert_eq!(events[7]["data"]["merged_into"]["version"], 2);
    // The body bytes are the event's JSON.
    for event in st.events() {
        assert_eq!(
            serde_json::from_slice::<Value>(&event.body).unwrap(),
            event.json
        );
    }
}

// ---- the oracle --------------------------------------------------------------------------------

#[test]
fn the_oracle_after_a_scripted_scenario() {
    let (mut st, ep) = stories_with(&[ALFA], StoriesFaults::default());
    // Before BETA is followed: no webhooks, no notifications, but its stories count once it is.
    let beta_early = st.create_story(BETA, "beta early", Origin::Live, 0);
    st.make_strong(&beta_early, Origin::Live, 0).unwrap();

    let a = st.create_story(ALFA, "a", Origin::Live, 0);
    let b = st.create_story(ALFA, "b", Origin::Live, 0);
    let c = st.create_story(ALFA, "c", Origin::Live, 0);
    let d = st.create_story(ALFA, "d", Origin::Live, 0);
    st.make_strong(&a, Origin::Live, 0).unwrap();
    st.make_strong(&b, Origin::Backfill, 0).unwrap();
    st.update_story(&c, Some("c2"), true, Origin::Backfill, 0)
        .unwrap();
    st.merge_stories(&a, &b, Origin::Live, 0).unwrap();
    st.merge_stories(&b, &c, Origin::Live, 0).unwrap();
    st.close_story(&d, Origin::Live, 0).unwrap();
    st.set_stories_tickers(ep, [ALFA.to_owned(), BETA.to_owned()]);
    let beta_late = st.create_story(BETA, "beta late", Origin::Live, 0);
    st.make_strong(&beta_late, Origin::Live, 0).unwrap();

    let expected = st.expected_stories(ep);
    assert_eq!(
        expected.keys().cloned().collect::<BTreeSet<_>>(),
        [&a, &b, &c, &d, &beta_early, &beta_late]
            .into_iter()
            .cloned()
            .collect()
    );
    let open: BTreeSet<&str> = expected
        .iter()
        .filter(|(_, e)| !e.closed)
        .map(|(id, _)| id.as_str())
        .collect();
    assert_eq!(
        open,
        [c.as_str(), beta_early.as_str(), beta_late.as_str()].into()
    );
    let ec = &expected[&c];
    assert_eq!(
        ec.version, 3,
        "created, updated, took b (which had taken a)"
    );
    assert_eq!(
        ec.story.as_ref().unwrap()["articles"]
            .as_array()
            .unwrap()
            .len(),
        4
    );
    assert_eq!(ec.story.as_ref(), Some(&st.story(&c).unwrap().snapshot()));
    assert!(expected[&a].closed && expected[&a].story.is_none());
    assert_eq!(expected[&a].version, 3, "a: created, strong, merged away");
    assert_eq!(
        expected[&b].version, 4,
        "b: created, strong, took a, merged away"
    );
    assert_eq!(expected[&d].version, 2);

    assert_eq!(
        st.expected_notifications(ep),
        [a.clone(), beta_late.clone()].into(),
        "live and in the stream: not b (backfill), not beta_early (before BETA was followed)"
    );
    assert_eq!(st.backfill_strong(ep), [b.clone()].into());

    // A copy that matches, and ones that do not.
    let mut copy: BTreeMap<String, CopyRow> = expected
        .iter()
        .filter(|(id, _)| **id != d)
        .map(|(id, e)| {
            let row = CopyRow {
                ticker: Some(e.ticker.clone()),
                version: e.version,
                closed: e.closed,
                story: e.story.clone(),
            };
            (id.clone(), row)
        })
        .collect();
    assert_eq!(st.compare_copy(ep, &copy), Vec::<String>::new());
    copy.get_mut(&a).unwrap().version = 0; // closed from a 404 alone
    assert_eq!(st.compare_copy(ep, &copy), Vec::<String>::new());
    copy.get_mut(&c).unwrap().version = 2;
    copy.insert(
        d.clone(),
        CopyRow {
            ticker: Some(ALFA.into()),
            version: 1,
            closed: false,
            story: None,
        },
    );
    assert_eq!(st.compare_copy(ep, &copy).len(), 2);
}

// ---- the sender (pure) -------------------------------------------------------------------------

#[test]
fn one_webhook_per_event_of_the_endpoints_tickers_from_when_it_subscribed() {
    let (mut st, ep) = stories_with(&[ALFA], StoriesFaults::default());
    let other = st.add_stories_endpoint(spec("http://y/{id}", "sk_other", &[BETA]));
    let a = st.create_story(ALFA, "a", Origin::Live, 0);
    st.create_story(BETA, "b", Origin::Live, 0);
    st.update_story(&a, Some("a2"), false, Origin::Backfill, 0)
        .unwrap();
    let sent = drain(&mut st, 0, ok);
    let to_ep: Vec<Value> = sent
        .iter()
        .filter(|o| o.endpoint_id == ep)
        .map(body)
        .collect();
    assert_eq!(
        to_ep,
        vec![st.events()[0].json.clone(), st.events()[2].json.clone()]
    );
    let to_other: Vec<&Outgoing> = sent.iter().filter(|o| o.endpoint_id == other).collect();
    assert_eq!(to_other.len(), 1);
    assert_eq!(to_other[0].url, format!("http://y/{other}"));
    assert!(st.is_idle());

    // BETA from now on: the earlier BETA story's events are not sent.
    st.set_stories_tickers(ep, [ALFA.to_owned(), BETA.to_owned()]);
    let b2 = st.create_story(BETA, "b2", Origin::Live, 0);
    let sent = drain(&mut st, 0, ok);
    assert_eq!(sent.iter().filter(|o| o.endpoint_id == ep).count(), 1);
    assert_eq!(body(&sent[0])["data"]["story"]["id"], json!(b2));
    st.set_stories_tickers(ep, [BETA.to_owned()]);
    st.create_story(ALFA, "a3", Origin::Live, 0);
    assert!(drain(&mut st, 0, ok).iter().all(|o| o.endpoint_id != ep));
}

#[test]
fn duplicates_repeat_the_webhook_id_and_body() {
    let (mut st, _) = stories_with(
        &[ALFA],
        StoriesFaults {
            duplicate: 1.0,
            ..StoriesFaults::default()
        },
    );
    st.create_story(ALFA, "a", Origin::Live, 0);
    let sent = drain(&mut st, 0, ok);
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[1].kind, MessageKind::Duplicate);
    assert_eq!(sent[1].webhook_id, sent[0].webhook_id);
    assert_eq!(sent[1].body, sent[0].body);
    assert_eq!(st.delivered(sent[0].endpoint_id).len(), 2);
}

#[test]
fn concurrency_and_delays_deliver_out_of_order() {
    let (mut st, _) = stories_with(
        &[ALFA],
        StoriesFaults {
            reorder: 0.5,
            reorder_delay_ms: 100,
            concurrency: 4,
            ..StoriesFaults::default()
        },
    );
    let a = st.create_story(ALFA, "a", Origin::Live, 0);
    for n in 0..30 {
        st.update_story(&a, Some(&format!("a{n}")), false, Origin::Live, 0)
            .unwrap();
    }
    let mut pending = st.poll_sends(0, WALL);
    pending.extend(st.poll_sends(0, WALL));
    assert!(pending.len() <= 4, "at most four in flight");
    let mut order = Vec::new();
    for now in 0..=200 {
        pending.extend(st.poll_sends(now, WALL));
        // Answer the newest in flight first.
        while let Some(out) = pending.pop() {
            order.push(body(&out)["data"]["story"]["version"].as_u64().unwrap());
            st.on_answer(out.endpoint_id, out.serial, Answer::status(200), now, WALL);
        }
    }
    assert_eq!(order.len(), 31);
    assert!(st.is_idle());
    let sorted = {
        let mut s = order.clone();
        s.sort();
        s
    };
    assert_ne!(order, sorted, "some overtaken");
    assert_eq!(sorted, (1..=31).collect::<Vec<u64>>());
}

#[test]
fn a_late_created_arrives_after_the_close() {
    let (mut st, ep) = stories_with(
        &[ALFA],
        StoriesFaults {
            late_created: 1.0,
            late_created_max_hold_ms: 60_000,
            ..StoriesFaults::default()
        },
    );
    let a = st.create_story(ALFA, "a", Origin::Live, 0);
    st.update_story(&a, None, true, Origin::Live, 0).unwrap();
    assert_eq!(
        drain(&mut st, 0, ok).len(),
        1,
        "the update goes; the created waits"
    );
    assert!(!st.is_endpoint_idle(ep));
    st.close_story(&a, Origin::Live, 0).unwrap();
    let types: Vec<String> = drain(&mut st, 1, ok)
        .iter()
        .map(|o| body(o)["type"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(types, ["story.closed", "story.created"]);
    // A story that never closes: its created goes once the hold runs out.
    st.create_story(ALFA, "b", Origin::Live, 10);
    assert!(drain(&mut st, 10, ok).is_empty());
    assert_eq!(drain(&mut st, 60_010, ok).len(), 1);
    assert!(st.is_idle());
}

/// Runs the sender on virtual time, answering every attempt with `answer`, until idle.
fn run_until_idle(st: &mut Stories, answer: impl Fn(&Outgoing) -> Answer) -> Vec<(u64, Outgoing)> {
    let mut now = 0;
    let mut sent = Vec::new();
    while !st.is_idle() {
        for out in drain(st, now, &answer) {
            sent.push((now, out));
        }
        now = st.next_send_at().unwrap_or(now).max(now + 1);
        assert!(sent.len() < 1_000);
    }
    sent
}

#[test]
fn retries_with_backoff_then_gives_up() {
    let mut config = StoriesConfig::from_wire_limits(1.0);
    config.sender.max_attempts = 4;
    let mut st = Stories::new(config, StoriesFaults::default(), 7);
    let ep = st.add_stories_endpoint(spec("http://x/{id}", KEY, &[ALFA]));
    st.create_story(ALFA, "a", Origin::Live, 0);
    let sent = run_until_idle(&mut st, |_| Answer::status(500));
    assert_eq!(sent.len(), 4);
    assert!(sent
        .iter()
        .all(|(_, o)| o.webhook_id == sent[0].1.webhook_id));
    let attempts: Vec<u32> = sent.iter().map(|(_, o)| o.attempt).collect();
    assert_eq!(attempts, [1, 2, 3, 4]);
    // Full jitter under a doubling ceiling: 1 s, 2 s, 4 s.
    for (n, pair) in sent.windows(2).enumerate() {
        assert!(
            pair[1].0 - pair[0].0 <= 1_000 << n,
            "{n}: {:?}",
            pair[1].0 - pair[0].0
        );
    }
    assert_eq!(st.given_up(ep), vec![st.events()[0].event_id.clone()]);
    assert!(matches!(
        st.stories_log(ep).last(),
        Some(StoriesLogEntry::GaveUp { attempts: 4, .. })
    ));

    // A 503 with Retry-After waits as long as it says; then a 2xx delivers it.
    st.create_story(ALFA, "b", Origin::Live, 0);
    let answers = Mutex::new(vec![
        Answer::status(200),
        Answer::Status {
            code: 503,
            retry_after: Some("120".into()),
        },
    ]);
    let sent = run_until_idle(&mut st, |_| answers.lock().unwrap().pop().unwrap());
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[1].0 - sent[0].0, 120_000);
    assert_eq!(st.given_up(ep).len(), 1);
}

#[test]
fn giving_up_by_time_and_a_410_pauses() {
    let mut config = StoriesConfig::from_wire_limits(3600.0);
    config.sender.give_up_after_ms = 50;
    config.sender.max_attempts = u32::MAX;
    let mut st = Stories::new(config, StoriesFaults::default(), 7);
    let ep = st.add_stories_endpoint(spec("http://x/{id}", KEY, &[ALFA]));
    st.create_story(ALFA, "a", Origin::Live, 0);
    let sent = run_until_idle(&mut st, |_| Answer::NoAnswer);
    assert!(sent.len() > 1);
    assert!(sent.last().unwrap().0 >= 50);
    assert_eq!(st.given_up(ep).len(), 1);

    st.create_story(ALFA, "b", Origin::Live, 100);
    assert_eq!(drain(&mut st, 100, |_| Answer::status(410)).len(), 1);
    assert!(st.stories_endpoint(ep).unwrap().paused);
    assert!(st.is_idle(), "a paused endpoint waits");
    assert!(!st.is_endpoint_idle(ep));
    st.resume_stories_endpoint(ep, 200);
    assert_eq!(drain(&mut st, 200, ok).len(), 1);
    assert!(st.is_endpoint_idle(ep));
}

// ---- the API -----------------------------------------------------------------------------------

async fn serve(stories: Stories) -> (Arc<Simulation>, String) {
    let upstream = Upstream::new(
        World::default(),
        SenderConfig::default(),
        Faults::default(),
        7,
    );
    let sim = Simulation::with_stories(upstream, stories, Duration::from_secs(2));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = relay_simulator::api::serve(listener, sim.clone())
        .await
        .unwrap();
    (sim, format!("http://{addr}"))
}

async fn get(url: &str, token: Option<&str>) -> (u16, Option<String>, String) {
    let mut request = reqwest::Client::new().get(url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, content_type, response.text().await.unwrap())
}

async fn get_json(url: &str) -> (u16, Value) {
    let (status, _, text) = get(url, Some(KEY)).await;
    (status, serde_json::from_str(&text).unwrap())
}

#[tokio::test]
async fn events_page_in_order_and_an_expired_cursor_answers_410() {
    let (mut st, _) = stories_with(&[ALFA], StoriesFaults::default());
    let a = st.create_story(ALFA, "a", Origin::Live, 0);
    st.create_story(BETA, "not followed", Origin::Live, 0);
    for n in 0..4 {
        st.update_story(&a, Some(&format!("a{n}")), false, Origin::Live, 0)
            .unwrap();
    }
    let (sim, base) = serve(st).await;
    assert_eq!(get(&format!("{base}/v1/events"), None).await.0, 401);
    assert_eq!(
        get(&format!("{base}/v1/events"), Some("sk_nobody")).await.0,
        401
    );

    // Pages of two, following the cursors: every ALFA event in publication order.
    let mut seen = Vec::new();
    let mut url = format!("{base}/v1/events?limit=2");
    let cursor = loop {
        let (status, page) = get_json(&url).await;
        assert_eq!(status, 200);
        seen.extend(page["data"].as_array().unwrap().iter().cloned());
        let cursor = page["next_cursor"].as_str().unwrap().to_owned();
        if page["has_more"] == false {
            break cursor;
        }
        url = format!("{base}/v1/events?limit=2&cursor={cursor}");
    };
    let expected: Vec<Value> = sim
        .stories()
        .events()
        .iter()
        .filter(|e| e.ticker == ALFA)
        .map(|e| e.json.clone())
        .collect();
    assert_eq!(seen, expected);
    assert_eq!(seen.len(), 5);

    // Caught up: an empty page that keeps the cursor usable.
    let (_, page) = get_json(&format!("{base}/v1/events?cursor={cursor}")).await;
    assert_eq!(page["data"], json!([]));
    assert_eq!(page["has_more"], false);

    // Two more events, then the window moves past them: the old cursor is expired.
    sim.change_stories(|st, now| {
        st.update_story(&a, Some("later"), false, Origin::Live, now)
            .unwrap();
        st.create_story(ALFA, "later", Origin::Live, now);
        st.advance_window();
    });
    let (status, body) = get_json(&format!("{base}/v1/events?cursor={cursor}")).await;
    assert_eq!((status, body), (410, json!({"error": "cursor_expired"})));
    // A first read serves the window only; a cursor at the window's start is fine.
    let (_, page) = get_json(&format!("{base}/v1/events")).await;
    assert_eq!(page["data"], json!([]));
    let head = page["next_cursor"].as_str().unwrap().to_owned();
    sim.change_stories(|st, now| st.create_story(ALFA, "newest", Origin::Live, now));
    let (_, page) = get_json(&format!("{base}/v1/events?cursor={head}")).await;
    assert_eq!(page["data"].as_array().unwrap().len(), 1);

    // A window of events: only the newest two are served.
    sim.change_stories(|st, now| {
        for n in 0..3 {
            st.create_story(ALFA, &format!("more {n}"), Origin::Live, now);
        }
        let mut config = st.config().clone();
        config.window_events = Some(2);
        st.set_config(config);
    });
    let (status, _) = get_json(&format!("{base}/v1/events?cursor={head}")).await;
    assert_eq!(status, 410);
    let (status, body) = get_json(&format!("{base}/v1/events?cursor=bogus")).await;
    assert_eq!(status, 400, "{body}");

    // The API paused: 503.
    sim.stories().set_api_paused(true);
    let (status, body) = get_json(&format!("{base}/v1/events")).await;
    assert_eq!((status, body), (503, json!({"error": "unavailable"})));
}

#[tokio::test]
async fn stories_lists_only_open_stories_of_the_ticker() {
    let (mut st, _) = stories_with(&[ALFA], StoriesFaults::default());
    let ids: Vec<String> = (0..5)
        .map(|n| st.create_story(ALFA, &format!("s{n}"), Origin::Live, 0))
        .collect();
    st.create_story(BETA, "beta", Origin::Live, 0);
    st.close_story(&ids[1], Origin::Live, 0).unwrap();
    st.merge_stories(&ids[3], &ids[4], Origin::Live, 0).unwrap();
    let (sim, base) = serve(st).await;

    let mut listed = Vec::new();
    let mut url = format!("{base}/v1/stories?ticker=ALFA%20B&limit=2");
    loop {
        let (status, page) = get_json(&url).await;
        assert_eq!(status, 200);
        listed.extend(page["data"].as_array().unwrap().iter().cloned());
        if page["has_more"] == false {
            break;
        }
        let cursor = page["next_cursor"].as_str().unwrap();
        url = format!("{base}/v1/stories?ticker=ALFA%20B&limit=2&cursor={cursor}");
    }
    let expected: Vec<Value> = [&ids[0], &ids[2], &ids[4]]
        .iter()
        .map(|id| sim.stories().story(id).unwrap().snapshot())
        .collect();
    assert_eq!(listed, expected);
    assert_eq!(listed[2]["version"], 2);
    assert_eq!(
        get_json(&format!("{base}/v1/stories?ticker=BETA")).await.0,
        404
    );
    assert_eq!(get_json(&format!("{base}/v1/stories")).await.0, 400);
    assert_eq!(
        get(&format!("{base}/v1/stories?ticker=ALFA%20B"), None)
            .await
            .0,
        401
    );
}

#[tokio::test]
async fn story_reads_404_with_json_and_the_faults_answer_otherwise() {
    let (mut st, _) = stories_with(&[ALFA], StoriesFaults::default());
    let a = st.create_story(ALFA, "a", Origin::Live, 0);
    st.update_story(&a, Some("a2"), false, Origin::Live, 0)
        .unwrap();
    let b = st.create_story(ALFA, "b", Origin::Live, 0);
    st.close_story(&b, Origin::Live, 0).unwrap();
    let beta = st.create_story(BETA, "beta", Origin::Live, 0);
    let (sim, base) = serve(st).await;

    let (status, story) = get_json(&format!("{base}/v1/stories/{a}")).await;
    assert_eq!(status, 200);
    let ep = sim.stories().stories_endpoint_ids()[0];
    let expected = sim.stories().expected_stories(ep);
    assert_eq!(Some(&story), expected[&a].story.as_ref());
    assert_eq!(story["version"], 2);
    for id in [b.as_str(), "st_999", "nonsense", beta.as_str()] {
        let (status, content_type, text) = get(&format!("{base}/v1/stories/{id}"), Some(KEY)).await;
        assert_eq!(status, 404, "{id}");
        assert_eq!(content_type.as_deref(), Some("application/json"));
        assert_eq!(
            serde_json::from_str::<Value>(&text).unwrap(),
            json!({"error": "not_found"})
        );
    }

    // A load balancer's 404: plain text.
    sim.stories().set_faults(StoriesFaults {
        lb_404: 1.0,
        ..StoriesFaults::default()
    });
    let (status, content_type, text) = get(&format!("{base}/v1/stories/{a}"), Some(KEY)).await;
    assert_eq!((status, content_type.as_deref()), (404, Some("text/plain")));
    assert!(serde_json::from_str::<Value>(&text).is_err());

    // Stale reads: an older version of an open story; a closed story's, from before its close.
    sim.stories().set_faults(StoriesFaults {
        stale_reads: 1.0,
        stale_read_ms: 20,
        ..StoriesFaults::default()
    });
    let (status, story) = get_json(&format!("{base}/v1/stories/{a}")).await;
    assert_eq!((status, story["version"].clone()), (200, json!(1)));
    let (status, story) = get_json(&format!("{base}/v1/stories/{b}")).await;
    assert_eq!((status, story["version"].clone()), (200, json!(1)));
    assert!(matches!(
        sim.stories().story_read(KEY, &b, sim.clock.now_ms()),
        Ok(StoryRead::Stale { delay_ms: 20, .. })
    ));

    sim.stories().set_faults(StoriesFaults {
        server_error: 1.0,
        ..StoriesFaults::default()
    });
    assert_eq!(get_json(&format!("{base}/v1/stories/{a}")).await.0, 503);
}

// ---- over HTTP: signatures, and a reference consumer that converges ---------------------------

/// Seed 000's reference consumer, in memory: the two writes, the claimed notifications, and
/// catch-up. Answers 503 while `down`.
#[derive(Default)]
struct Consumer {
    secrets: Vec<SigningSecret>,
    rows: Mutex<BTreeMap<String, CopyRow>>,
    claimed: Mutex<BTreeSet<String>>,
    verified: Mutex<usize>,
    refused: Mutex<Vec<String>>,
    webhook_ids: Mutex<Vec<String>>,
    down: Mutex<bool>,
}

impl Consumer {
    fn save(&self, story: &Value) {
        let id = story["id"].as_str().unwrap().to_owned();
        let version = story["version"].as_u64().unwrap();
        let mut rows = self.rows.lock().unwrap();
        match rows.get_mut(&id) {
            Some(row) if row.closed || row.version >= version => {}
            Some(row) => {
                row.version = version;
                row.story = Some(story.clone());
                row.ticker = story["ticker"].as_str().map(str::to_owned);
            }
            None => {
                rows.insert(
                    id,
                    CopyRow {
                        ticker: story["ticker"].as_str().map(str::to_owned),
                        version,
                        closed: false,
                        story: Some(story.clone()),
                    },
                );
            }
        }
    }

    fn close(&self, id: &str, version: u64) {
        let mut rows = self.rows.lock().unwrap();
        let row = rows.entry(id.to_owned()).or_insert(CopyRow {
            ticker: None,
            version: 0,
            closed: true,
            story: None,
        });
        row.closed = true;
        row.story = None;
        row.version = row.version.max(version);
    }

    fn apply(&self, event: &Value) {
        let data = &event["data"];
        match event["type"].as_str().unwrap() {
            "story.created" | "story.updated" | "story.became_strong" => self.save(&data["story"]),
            "story.closed" => {
                self.close(
                    data["story_id"].as_str().unwrap(),
                    data["version"].as_u64().unwrap(),
                );
                if data["merged_into"].is_object() {
                    self.save(&data["merged_into"]);
                }
            }
            _ => {}
        }
        if event["type"] == "story.became_strong" && event["origin"] == "live" {
            // Claimed by one insert: a repeat (duplicate, catch-up) claims nothing.
            let id = data["story"]["id"].as_str().unwrap().to_owned();
            self.claimed.lock().unwrap().insert(id);
        }
    }
}

async fn receive(
    State(consumer): State<Arc<Consumer>>,
    headers: HeaderMap,
    body: bytes::Bytes,
) -> StatusCode {
    if *consumer.down.lock().unwrap() {
        return StatusCode::SERVICE_UNAVAILABLE;
    }
    if let Err(error) = verify_received(&headers, &body, &consumer.secrets) {
        consumer.refused.lock().unwrap().push(error.to_string());
        return StatusCode::UNAUTHORIZED;
    }
    *consumer.verified.lock().unwrap() += 1;
    consumer
        .webhook_ids
        .lock()
        .unwrap()
        .push(headers["webhook-id"].to_str().unwrap().to_owned());
    let event: Value = serde_json::from_slice(&body).unwrap();
    consumer.apply(&event);
    StatusCode::NO_CONTENT
}

async fn receiver(consumer: Arc<Consumer>) -> String {
    let app = Router::new()
        .route("/hooks/{id}", post(receive))
        .with_state(consumer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}/hooks/{{id}}")
}

/// Catch-up through GET /v1/events from `cursor`, applying every event; returns the new cursor
/// (`None` on a 410).
async fn catch_up(
    consumer: &Consumer,
    base: &str,
    key: &str,
    mut cursor: Option<String>,
) -> Option<String> {
    loop {
        let url = match &cursor {
            Some(c) => format!("{base}/v1/events?limit=50&cursor={c}"),
            None => format!("{base}/v1/events?limit=50"),
        };
        let (status, _, text) = get(&url, Some(key)).await;
        match status {
            200 => {}
            410 => return None,
            _ => {
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
        }
        let page: Value = serde_json::from_str(&text).unwrap();
        for event in page["data"].as_array().unwrap() {
            consumer.apply(event);
        }
        cursor = page["next_cursor"].as_str().map(str::to_owned);
        if page["has_more"] == false {
            return cursor;
        }
    }
}

#[tokio::test]
async fn signed_webhooks_verify_and_a_consumer_converges_to_the_oracle() {
    let consumer = Arc::new(Consumer {
        secrets: vec![secret()],
        ..Consumer::default()
    });
    let url = receiver(consumer.clone()).await;
    let faults = StoriesFaults {
        reorder_delay_ms: 30,
        late_created_max_hold_ms: 200,
        // No API faults: the catch-up below reads the API plainly.
        stale_reads: 0.0,
        lb_404: 0.0,
        server_error: 0.0,
        ..StoriesFaults::all()
    };
    let mut st = Stories::new(StoriesConfig::from_wire_limits(1000.0), faults, 11);
    let ep = st.add_stories_endpoint(StoriesEndpointSpec {
        url: url.clone(),
        ..spec("", KEY, &[ALFA, BETA])
    });
    let (sim, base) = serve(st).await;
    sim.spawn_stories_sender();
    let workload = StoriesWorkload::new(
        11,
        StoriesWorkloadConfig {
            tickers: vec![ALFA.into(), BETA.into()],
            ..StoriesWorkloadConfig::default()
        },
    );
    let steps = sim
        .clone()
        .run_stories_workload(workload, 400.0, Duration::from_millis(600))
        .await;
    assert!(steps > 50);
    assert!(
        sim.wait_idle(Duration::from_secs(20)).await,
        "all delivered"
    );

    assert!(consumer.refused.lock().unwrap().is_empty());
    let events = sim.stories().events().len();
    assert!(
        *consumer.verified.lock().unwrap() > events,
        "duplicates came too"
    );
    let ids = consumer.webhook_ids.lock().unwrap().clone();
    assert!(ids.len() > ids.iter().collect::<BTreeSet<_>>().len());
    let log = sim.stories().stories_log(ep).to_vec();
    let sent_in_order: Vec<&str> = log
        .iter()
        .filter_map(|e| match e {
            StoriesLogEntry::Sent {
                event_id,
                kind: MessageKind::Events,
                ..
            } => Some(event_id.as_str()),
            _ => None,
        })
        .collect();
    let published: Vec<String> = sim
        .stories()
        .events()
        .iter()
        .map(|e| e.event_id.clone())
        .collect();
    assert_eq!(sent_in_order.len(), published.len());
    assert_ne!(sent_in_order, published, "reordered");

    let copy = consumer.rows.lock().unwrap().clone();
    assert_eq!(sim.stories().compare_copy(ep, &copy), Vec::<String>::new());
    assert_eq!(
        *consumer.claimed.lock().unwrap(),
        sim.stories().expected_notifications(ep)
    );
    assert!(!sim.stories().expected_notifications(ep).is_empty());
    assert!(consumer
        .claimed
        .lock()
        .unwrap()
        .is_disjoint(&sim.stories().backfill_strong(ep)));

    // An outage longer than the retries: webhooks are given up; catch-up recovers them.
    sim.change_stories(|st, _| {
        let mut config = st.config().clone();
        config.sender.max_attempts = 2;
        st.set_config(config);
    });
    let cursor = catch_up(&consumer, &base, KEY, None).await;
    *consumer.down.lock().unwrap() = true;
    let workload = StoriesWorkload::new(
        12,
        StoriesWorkloadConfig {
            tickers: vec![ALFA.into(), BETA.into()],
            ..StoriesWorkloadConfig::default()
        },
    );
    sim.clone()
        .run_stories_workload(workload, 400.0, Duration::from_millis(200))
        .await;
    assert!(sim.wait_idle(Duration::from_secs(20)).await);
    assert!(!sim.stories().given_up(ep).is_empty());
    *consumer.down.lock().unwrap() = false;
    let copy = consumer.rows.lock().unwrap().clone();
    assert!(!sim.stories().compare_copy(ep, &copy).is_empty(), "behind");
    catch_up(&consumer, &base, KEY, cursor).await.unwrap();
    let copy = consumer.rows.lock().unwrap().clone();
    assert_eq!(sim.stories().compare_copy(ep, &copy), Vec::<String>::new());
    assert_eq!(
        *consumer.claimed.lock().unwrap(),
        sim.stories().expected_notifications(ep)
    );
    sim.shutdown();
}

#[tokio::test]
async fn a_webhook_over_http_is_signed_as_the_feeds_are() {
    let consumer = Arc::new(Consumer {
        secrets: vec![secret()],
        ..Consumer::default()
    });
    let url = receiver(consumer.clone()).await;
    let mut st = Stories::new(StoriesConfig::default(), StoriesFaults::default(), 3);
    let ep = st.add_stories_endpoint(StoriesEndpointSpec {
        url,
        ..spec("", KEY, &[ALFA])
    });
    st.create_story(ALFA, "a", Origin::Live, 0);
    let (sim, _) = serve(st).await;
    // Checked by hand too: the headers the sender sends.
    let out = sim.stories().poll_sends(0, WALL).pop().unwrap();
    let header = |name: &str| {
        out.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(header("webhook-id"), Some(out.webhook_id.as_str()));
    assert!(out.webhook_id.starts_with("msg_"));
    assert_eq!(header("webhook-timestamp"), Some("1791439212"));
    assert_eq!(header("quanor-webhook-attempt"), Some("1"));
    assert_eq!(header("content-type"), Some("application/json"));
    assert_eq!(header("user-agent"), Some("Quanor-Webhooks/1"));
    let signed = SignatureHeaders {
        webhook_id: header("webhook-id"),
        webhook_timestamp: header("webhook-timestamp"),
        webhook_signature: header("webhook-signature"),
    };
    assert_eq!(verify(signed, &out.body, &[secret()], WALL), Ok(WALL));
    let other = SigningSecret::from_bytes(vec![9; 32]).unwrap();
    assert!(verify(signed, &out.body, &[other], WALL).is_err());
    // Left unanswered in the core, the same webhook goes over HTTP after a failed attempt.
    sim.stories()
        .on_answer(ep, out.serial, Answer::NoAnswer, 0, WALL);
    sim.spawn_stories_sender();
    assert!(sim.wait_idle(Duration::from_secs(10)).await);
    assert_eq!(*consumer.verified.lock().unwrap(), 1);
    assert_eq!(consumer.webhook_ids.lock().unwrap()[0], out.webhook_id);
    sim.shutdown();
}
