//! A stories endpoint's sync before its catch-up ([`relay_rules::decide_ticker_sync`]) and which
//! claimed notifications it sends ([`relay_rules::decide_notify`]).
//!
//! The ticker sync is carried out here on a model of the upstream (each ticker's open stories)
//! and of the endpoint (its open stories, the tickers it records as loaded, whether it needs a
//! reload), step by step as the sequencer does, and cut short after any step. The model's
//! starting state is one a sync can leave: every story of a ticker recorded as loaded is held,
//! and every story held open is of a ticker recorded as loaded or wanted (a webhook may have
//! saved a story of a wanted ticker before its load).
//!
//! The number of cases is each block's default unless `PROPTEST_CASES` is set.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use common::{config, snapshot_plan};
use proptest::prelude::*;
use proptest::sample::Index;
use relay_rules::{
    decide_notify, decide_ticker_sync, stories_of_run, NotifyDecision, StoriesCopy, TickerStep,
    TickerSync, TickerSyncInput,
};
use relay_wire::StoryEvent;
use serde_json::json;

// ---------------------------------------------------------------------------------------------
// Ticker sync.

const TICKERS: u8 = 5;

fn ticker(n: u8) -> String {
    format!("T{}", n % TICKERS)
}

fn tickers(ns: &[u8]) -> Vec<String> {
    ns.iter().copied().map(ticker).collect()
}

fn set(tickers: &[String]) -> BTreeSet<String> {
    tickers.iter().cloned().collect()
}

/// The upstream: each ticker's open stories (`GET /v1/stories?ticker=`); a story id names its
/// ticker, so a story is open upstream exactly when its ticker's listing holds it.
#[derive(Debug, Clone)]
struct Upstream(BTreeMap<String, BTreeSet<String>>);

impl Upstream {
    /// Ticker `n` lists story `j` (of 0..3) when bit `j` of `masks[n]` is set.
    fn new(masks: &[u8]) -> Self {
        let mut listings = BTreeMap::new();
        for n in 0..TICKERS {
            let mask = masks.get(usize::from(n)).copied().unwrap_or(0);
            let stories = (0..3)
                .filter(|j| mask & (1 << j) != 0)
                .map(|j| format!("{}/s{j}", ticker(n)))
                .collect();
            listings.insert(ticker(n), stories);
        }
        Upstream(listings)
    }

    fn listing(&self, ticker: &str) -> BTreeSet<String> {
        self.0.get(ticker).cloned().unwrap_or_default()
    }

    fn is_open(&self, story: &str) -> bool {
        self.0.values().any(|stories| stories.contains(story))
    }

    fn of(&self, tickers: &BTreeSet<String>) -> BTreeSet<String> {
        tickers.iter().flat_map(|t| self.listing(t)).collect()
    }
}

fn ticker_of(story: &str) -> &str {
    story
        .split('/')
        .next()
        .expect("a story id names its ticker")
}

/// The endpoint's side: its open stories (`stories` rows not closed), `loaded_tickers` and
/// `reload_needed` (`stories_sync`).
#[derive(Debug, Clone)]
struct Endpoint {
    open: BTreeSet<String>,
    loaded: Vec<String>,
    reload_needed: bool,
}

impl Endpoint {
    fn decide(&self, wanted: &[String]) -> TickerSync {
        decide_ticker_sync(TickerSyncInput {
            wanted,
            loaded: &self.loaded,
            reload_needed: self.reload_needed,
        })
    }

    /// One step as the sequencer carries it out (`sequencer/src/stories.rs`).
    fn carry_out(&mut self, step: &TickerStep, upstream: &Upstream) {
        match step {
            TickerStep::Drop { tickers, loaded } => {
                self.open
                    .retain(|s| !tickers.iter().any(|t| t == ticker_of(s)));
                self.loaded = loaded.clone();
            }
            TickerStep::ReloadInFull { tickers } => {
                // 1. Each ticker listed and saved.
                let listed = upstream.of(&set(tickers));
                self.open.extend(listed.iter().cloned());
                // 2. Each story held open that the listing did not return: read, kept if it
                // exists, closed on 404.
                let unlisted: Vec<String> = self.open.difference(&listed).cloned().collect();
                for story in unlisted {
                    if !upstream.is_open(&story) {
                        self.open.remove(&story);
                    }
                }
                // 3. The reload finished: its tickers recorded, the need cleared.
                self.loaded = tickers.clone();
                self.reload_needed = false;
            }
            TickerStep::Load { tickers, loaded } => {
                for t in tickers {
                    self.open.extend(upstream.listing(t));
                }
                self.loaded = loaded.clone();
            }
        }
    }

    /// What holds after every step: a ticker is recorded as loaded only with all its stories
    /// held, and no open story is of a ticker that is neither recorded nor wanted (no later sync
    /// would know to drop it).
    fn check(&self, upstream: &Upstream, wanted: &[String]) -> Result<(), TestCaseError> {
        for t in &self.loaded {
            let missing: Vec<_> = upstream
                .listing(t)
                .difference(&self.open)
                .cloned()
                .collect();
            prop_assert!(
                missing.is_empty(),
                "{t} is recorded as loaded without {missing:?}: {self:?}"
            );
        }
        for story in &self.open {
            let t = ticker_of(story).to_owned();
            prop_assert!(
                self.loaded.contains(&t) || wanted.contains(&t),
                "{story} is held open, its ticker neither recorded nor wanted: {self:?}"
            );
        }
        Ok(())
    }
}

/// A starting state a sync can leave (module doc): the stories of `loaded`, plus `extra` held
/// open (any of `loaded` and `wanted`'s, open upstream or not) when a reload is needed, or
/// stories of wanted tickers a webhook saved before their load.
fn start(
    upstream: &Upstream,
    wanted: &[String],
    loaded: &[String],
    reload_needed: bool,
    extra: &[(u8, u8)],
) -> Endpoint {
    let mut open = upstream.of(&set(loaded));
    let allowed: Vec<&String> = loaded.iter().chain(wanted).collect();
    for (t, j) in extra {
        let Some(t) = allowed.get(usize::from(*t) % allowed.len().max(1)) else {
            break;
        };
        let story = format!("{t}/s{}", j % 4);
        if reload_needed || upstream.is_open(&story) {
            open.insert(story);
        }
    }
    Endpoint {
        open,
        loaded: loaded.to_vec(),
        reload_needed,
    }
}

/// (wanted, loaded, reload_needed, each ticker's listing as a bit mask, extra stories held).
type SyncCase = (Vec<u8>, Vec<u8>, bool, Vec<u8>, Vec<(u8, u8)>);

fn sync_input() -> impl Strategy<Value = SyncCase> {
    (
        prop::collection::vec(0..TICKERS, 0..6),
        prop::collection::vec(0..TICKERS, 0..6),
        any::<bool>(),
        prop::collection::vec(0u8..8, TICKERS as usize),
        prop::collection::vec((any::<u8>(), any::<u8>()), 0..4),
    )
}

#[test]
fn a_removed_ticker_is_dropped_then_an_added_one_loaded() {
    let plan = decide_ticker_sync(TickerSyncInput {
        wanted: &tickers(&[1, 2]),
        loaded: &tickers(&[0, 1]),
        reload_needed: false,
    });
    assert_eq!(
        plan.steps,
        vec![
            TickerStep::Drop {
                tickers: tickers(&[0]),
                loaded: tickers(&[1]),
            },
            TickerStep::Load {
                tickers: tickers(&[2]),
                loaded: tickers(&[1, 2]),
            },
        ]
    );
}

#[test]
fn a_new_endpoint_is_reloaded_in_full_over_its_tickers_and_lists_none_twice() {
    let plan = decide_ticker_sync(TickerSyncInput {
        wanted: &tickers(&[3, 1]),
        loaded: &[],
        reload_needed: true,
    });
    assert_eq!(
        plan.steps,
        vec![TickerStep::ReloadInFull {
            tickers: tickers(&[3, 1]),
        }]
    );
}

#[test]
fn a_reload_after_a_removal_comes_after_the_drop() {
    let plan = decide_ticker_sync(TickerSyncInput {
        wanted: &tickers(&[1, 2]),
        loaded: &tickers(&[0, 1, 0]),
        reload_needed: true,
    });
    assert_eq!(
        plan.steps,
        vec![
            TickerStep::Drop {
                tickers: tickers(&[0]),
                loaded: tickers(&[1]),
            },
            TickerStep::ReloadInFull {
                tickers: tickers(&[1, 2]),
            },
        ]
    );
}

#[test]
fn tickers_loaded_as_wanted_need_no_step() {
    let plan = decide_ticker_sync(TickerSyncInput {
        wanted: &tickers(&[1, 2]),
        loaded: &tickers(&[2, 1]),
        reload_needed: false,
    });
    assert_eq!(plan, TickerSync::default());
}

proptest! {
    #![proptest_config(config(512))]

    /// The steps' shape: a drop first when anything loaded is not wanted (of exactly that), a
    /// reload in full when one is needed (over every wanted ticker, once each) standing in for
    /// every load, otherwise one load of exactly the wanted tickers not loaded.
    #[test]
    fn ticker_sync_drops_first_and_a_reload_subsumes_the_loads(
        (wanted, loaded, reload_needed, _, _) in sync_input()
    ) {
        let (wanted, loaded) = (tickers(&wanted), tickers(&loaded));
        let plan = decide_ticker_sync(TickerSyncInput {
            wanted: &wanted, loaded: &loaded, reload_needed,
        });
        let removed: BTreeSet<String> = set(&loaded).difference(&set(&wanted)).cloned().collect();
        let added: BTreeSet<String> = set(&wanted).difference(&set(&loaded)).cloned().collect();
        let mut steps = plan.steps.iter().peekable();
        if !removed.is_empty() {
            match steps.next() {
                Some(TickerStep::Drop { tickers, loaded: recorded }) => {
                    prop_assert_eq!(set(tickers), removed.clone());
                    prop_assert_eq!(tickers.len(), removed.len(), "each dropped once");
                    prop_assert!(set(recorded).is_subset(&set(&wanted)));
                }
                other => prop_assert!(false, "the first step is {other:?}, not the drop"),
            }
        }
        let rest: Vec<&TickerStep> = steps.collect();
        prop_assert!(
            !rest.iter().any(|s| matches!(s, TickerStep::Drop { .. })),
            "a drop after a load: {:?}", plan.steps
        );
        if reload_needed {
            prop_assert_eq!(rest.len(), 1, "{:?}", plan.steps);
            match rest[0] {
                TickerStep::ReloadInFull { tickers } => {
                    prop_assert_eq!(set(tickers), set(&wanted));
                    prop_assert_eq!(tickers.len(), set(&wanted).len(), "each listed once");
                }
                other => prop_assert!(false, "a reload was needed, the step is {other:?}"),
            }
        } else if added.is_empty() {
            prop_assert!(rest.is_empty(), "{:?}", plan.steps);
        } else {
            prop_assert_eq!(rest.len(), 1, "{:?}", plan.steps);
            match rest[0] {
                TickerStep::Load { tickers, loaded: recorded } => {
                    prop_assert_eq!(set(tickers), added.clone());
                    prop_assert_eq!(tickers.len(), added.len(), "each listed once");
                    prop_assert_eq!(set(recorded), set(&wanted));
                }
                other => prop_assert!(false, "the step is {other:?}, not the load"),
            }
        }
        for step in &plan.steps {
            if let TickerStep::Drop { tickers, .. } = step {
                prop_assert!(tickers.iter().all(|t| !wanted.contains(t)), "a wanted ticker dropped");
            }
        }
    }

    /// Carried out in full: the tickers recorded as loaded are the wanted ones, the copy holds
    /// open exactly the wanted tickers' stories, and a second sync has nothing to do.
    #[test]
    fn ticker_sync_ends_loaded_with_the_wanted_tickers_and_their_stories(
        (wanted, loaded, reload_needed, masks, extra) in sync_input()
    ) {
        let (wanted, loaded) = (tickers(&wanted), tickers(&loaded));
        let upstream = Upstream::new(&masks);
        let mut endpoint = start(&upstream, &wanted, &loaded, reload_needed, &extra);
        endpoint.check(&upstream, &wanted)?;
        for step in endpoint.decide(&wanted).steps {
            endpoint.carry_out(&step, &upstream);
            endpoint.check(&upstream, &wanted)?;
        }
        prop_assert_eq!(set(&endpoint.loaded), set(&wanted));
        prop_assert!(!endpoint.reload_needed);
        let wanted_stories = upstream.of(&set(&wanted));
        if reload_needed {
            prop_assert_eq!(&endpoint.open, &wanted_stories);
        } else {
            // Without a reload a story a webhook saved stays until events close it.
            prop_assert!(wanted_stories.is_subset(&endpoint.open));
            prop_assert!(endpoint.open.iter().all(|s| wanted.iter().any(|t| t == ticker_of(s))));
        }
        prop_assert_eq!(endpoint.decide(&wanted), TickerSync::default());
    }

    /// A sync cut short after any of its steps (the process died, the sync failed), then run
    /// again from what was recorded, ends as an uninterrupted one: every intermediate state
    /// keeps the invariants, and the tickers recorded are the wanted ones.
    #[test]
    fn ticker_sync_cut_short_after_any_step_then_run_again_ends_the_same(
        (wanted, loaded, reload_needed, masks, extra) in sync_input(),
        cut in any::<Index>(),
    ) {
        let (wanted, loaded) = (tickers(&wanted), tickers(&loaded));
        let upstream = Upstream::new(&masks);
        let mut endpoint = start(&upstream, &wanted, &loaded, reload_needed, &extra);
        let steps = endpoint.decide(&wanted).steps;
        let done = cut.index(steps.len() + 1);
        for step in &steps[..done] {
            endpoint.carry_out(step, &upstream);
            endpoint.check(&upstream, &wanted)?;
        }
        for step in endpoint.decide(&wanted).steps {
            endpoint.carry_out(&step, &upstream);
            endpoint.check(&upstream, &wanted)?;
        }
        prop_assert_eq!(set(&endpoint.loaded), set(&wanted));
        prop_assert!(!endpoint.reload_needed);
        prop_assert!(upstream.of(&set(&wanted)).is_subset(&endpoint.open));
        prop_assert_eq!(endpoint.decide(&wanted), TickerSync::default());
    }
}

// ---------------------------------------------------------------------------------------------
// Notifications of a newly registered endpoint.

/// The endpoint's registration: 2026-10-08T06:40:30Z, in Unix nanoseconds.
const REGISTERED_AT: i128 = 1_791_441_630_000_000_000;

/// One published event: (story 0..3, kind, live, created_at in seconds relative to the
/// registration). Kind 0 is `story.became_strong`, anything else `story.updated`.
type Published = (u8, u8, bool, i64);

/// Published event `n`, its `created_at` that many seconds from the registration (none when
/// `None`).
fn story_event(n: usize, (story, kind, live, _): Published, created_at: Option<i64>) -> StoryEvent {
    let id = format!("st_{}", story % 3);
    let mut event = json!({
        "event_id": format!("evt_{n}"),
        "type": if kind == 0 { "story.became_strong" } else { "story.updated" },
        "origin": if live { "live" } else { "backfill" },
        "data": {"story": {"id": id, "ticker": "ALFA B", "version": n + 1}},
    });
    if let Some(seconds) = created_at {
        event["created_at"] = json!(format!("2026-10-08T06:40:{:02}Z", 30 + seconds));
    }
    StoryEvent::from_value(&event).expect("the builder's events parse")
}

/// The sequencer's handler with the policy wired in: each run decided with the endpoint's
/// registration (each claim saying whether it notifies, as [`decide_notify`] says) and carried
/// out. The stories of the claims that came back and notify, in order.
fn notifications(
    published: &[Published],
    arrivals: &[usize],
    cuts: &[usize],
    created_at: &HashMap<String, Option<i64>>,
) -> Vec<String> {
    let events: Vec<Result<StoryEvent, String>> = arrivals
        .iter()
        .map(|&n| {
            let when = created_at.get(&format!("evt_{n}")).copied().flatten();
            Ok(story_event(n, published[n], when))
        })
        .collect();
    let mut copy = StoriesCopy::default();
    let mut notified = Vec::new();
    let mut at = 0;
    let mut cuts = cuts.iter().cycle();
    while at < events.len() {
        let end = (at + cuts.next().copied().unwrap_or(1)).min(events.len());
        let run = &events[at..end];
        let ids = stories_of_run(run);
        let held = copy.held_of(ids.iter().map(String::as_str));
        let plan = snapshot_plan(run, &held, Some(REGISTERED_AT));
        let claimed = copy.execute(&plan).expect("a plan matches its rows");
        for claim in claimed {
            // The plan's decision, in nanoseconds, is the policy's on the test's scale.
            let when = created_at.get(&claim.event_id).copied().flatten();
            let decided = decide_notify(when, 0) == NotifyDecision::Notify;
            assert_eq!(
                claim.notify, decided,
                "{} created at {when:?}",
                claim.event_id
            );
            if claim.notify {
                notified.push(claim.story.id);
            }
        }
        at = end;
    }
    notified
}

fn catch_up_window() -> impl Strategy<Value = (Vec<Published>, Vec<usize>, Vec<usize>)> {
    prop::collection::vec((0u8..3, 0u8..2, any::<bool>(), -3i64..3), 1..12).prop_flat_map(
        |published| {
            let n = published.len();
            let order = Just((0..n).collect::<Vec<_>>()).prop_shuffle();
            let repeats = prop::collection::vec(any::<Index>(), 0..4);
            let cuts = prop::collection::vec(1usize..4, 1..4);
            (Just(published), order, repeats, cuts).prop_map(
                |(published, mut order, repeats, cuts)| {
                    for repeat in repeats {
                        let n = order[repeat.index(order.len())];
                        let at = repeat.index(order.len() + 1);
                        order.insert(at, n);
                    }
                    (published, order, cuts)
                },
            )
        },
    )
}

/// The plan says whether each claim notifies: an event created before the registration claims
/// silently, one at or after it (or without a `created_at`) notifies, and with no registration
/// given every claim notifies.
#[test]
fn a_planned_claim_notifies_only_for_an_event_created_since_the_registration() {
    let published: Vec<Published> = vec![(0, 0, true, 0), (1, 0, true, 0), (2, 0, true, 0)];
    let events: Vec<Result<StoryEvent, String>> = [Some(-1), Some(0), None]
        .into_iter()
        .enumerate()
        .map(|(n, created_at)| Ok(story_event(n, published[n], created_at)))
        .collect();
    let notify = |registered_at| -> Vec<bool> {
        snapshot_plan(&events, &HashMap::new(), registered_at)
            .claims
            .iter()
            .map(|claim| claim.notify)
            .collect()
    };
    assert_eq!(notify(Some(REGISTERED_AT)), vec![false, true, true]);
    assert_eq!(notify(None), vec![true, true, true]);
}

#[test]
fn a_new_endpoints_first_catch_up_notifies_only_what_happened_since_it_registered() {
    // The window holds a story that became strong a day before the registration, one that
    // became strong after it, and a backfill one after it; catch-up then a webhook repeat.
    let published: Vec<Published> = vec![(0, 0, true, -1), (1, 0, true, 1), (2, 0, false, 1)];
    let created_at: HashMap<String, Option<i64>> = published
        .iter()
        .enumerate()
        .map(|(n, p)| (format!("evt_{n}"), Some(p.3)))
        .collect();
    let notified = notifications(&published, &[0, 1, 2, 1, 0], &[3, 2], &created_at);
    assert_eq!(notified, vec!["st_1".to_owned()]);
}

#[test]
fn a_story_claimed_silently_is_not_notified_by_a_later_became_strong() {
    let published: Vec<Published> = vec![(0, 0, true, -2), (0, 0, true, 2)];
    let created_at: HashMap<String, Option<i64>> = [
        ("evt_0".to_owned(), Some(-2)),
        ("evt_1".to_owned(), Some(2)),
    ]
    .into();
    assert_eq!(
        notifications(&published, &[0, 1], &[1], &created_at),
        Vec::<String>::new()
    );
    // Arriving the other way round, the event after the registration claims first.
    assert_eq!(
        notifications(&published, &[1, 0], &[1], &created_at),
        vec!["st_0".to_owned()]
    );
}

proptest! {
    #![proptest_config(config(512))]

    /// Any window, delivered in any order with repeats and cut into runs of any lengths: a
    /// story is notified at most once, never for backfill, and exactly when the first live
    /// `story.became_strong` of it to arrive was created at or after the registration (or
    /// carries no `created_at`).
    #[test]
    fn notify_policy_each_story_at_most_once_and_only_for_events_since_the_registration(
        (published, arrivals, cuts) in catch_up_window(),
        missing in prop::collection::vec(any::<bool>(), 12),
    ) {
        let created_at: HashMap<String, Option<i64>> = published
            .iter()
            .enumerate()
            .map(|(n, p)| (format!("evt_{n}"), (!missing[n]).then_some(p.3)))
            .collect();
        let notified = notifications(&published, &arrivals, &cuts, &created_at);
        let once: BTreeSet<&String> = notified.iter().collect();
        prop_assert_eq!(once.len(), notified.len(), "notified twice: {:?}", notified);
        let mut expected = BTreeSet::new();
        let mut first: BTreeSet<String> = BTreeSet::new();
        for &n in &arrivals {
            let (story, kind, live, _) = published[n];
            let id = format!("st_{}", story % 3);
            if kind == 0 && live && first.insert(id.clone()) {
                let when = created_at[&format!("evt_{n}")];
                if when.is_none_or(|at| at >= 0) {
                    expected.insert(id);
                }
            }
        }
        let notified: BTreeSet<String> = notified.into_iter().collect();
        prop_assert_eq!(notified, expected);
    }
}
