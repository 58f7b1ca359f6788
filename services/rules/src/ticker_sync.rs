//! A stories endpoint's tickers brought in line with its registration (seed 000, "Adding a
//! ticker" and "Reloading in full"): which loaded tickers are dropped, whether the copy is
//! reloaded in full, which tickers are listed and saved once, and what the endpoint records as
//! loaded after each of those steps ([`decide_ticker_sync`] → [`TickerSync`]).
//!
//! Seed: "When you add a ticker, load its current stories once with GET /v1/stories; events keep
//! it up to date from there." A removed ticker is the relay's own rule (`docs/stories.md`,
//! "Tickers"): its open stories leave the copy, its closed rows stay.
//!
//! # How to drive it
//! At the start of a stories endpoint's sync, before its catch-up:
//! 1. Read the endpoint's tickers as registered now (`wanted`) and its sync state
//!    (`stories_sync`: `loaded_tickers`, `reload_needed`).
//! 2. Call [`decide_ticker_sync`]. It calls nothing else and reads no clock.
//! 3. Carry out [`TickerSync::steps`] in their order, each in full before the next:
//!    - [`TickerStep::Drop`]: one transaction that takes the open stories of `tickers` out of
//!      the copy (a `dropped` change each) and records `loaded` as the loaded tickers;
//!    - [`TickerStep::ReloadInFull`]: the seed's three steps over `tickers`, which records
//!      `tickers` as loaded in the transaction that finishes the reload;
//!    - [`TickerStep::Load`]: each of `tickers` listed and saved (`GET /v1/stories?ticker=`),
//!      then `loaded` recorded.
//! 4. Catch up from the saved cursor.
//!
//! Each step records only what it finished, so a sync cut short between two steps leaves a
//! state from which the next sync decides the rest: nothing is recorded as loaded before its
//! stories were saved, and a dropped ticker is no longer recorded once its stories are gone.

use std::collections::HashSet;

/// What [`decide_ticker_sync`] takes.
#[derive(Debug, Clone, Copy)]
pub struct TickerSyncInput<'a> {
    /// The endpoint's tickers as registered now.
    pub wanted: &'a [String],
    /// The tickers whose stories the copy was loaded with (`stories_sync.loaded_tickers`).
    pub loaded: &'a [String],
    /// Whether a reload in full is needed (`stories_sync.reload_needed`: a new endpoint, a 410,
    /// an operator's resync, or a reload that did not finish).
    pub reload_needed: bool,
}

/// One step of a sync, carried out in full before the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickerStep {
    /// Take the open stories of `tickers` out of the copy, and record `loaded` as the loaded
    /// tickers in the same transaction.
    Drop {
        tickers: Vec<String>,
        loaded: Vec<String>,
    },
    /// Reload in full over `tickers` (seed 000's three steps); the reload's last transaction
    /// records `tickers` as loaded.
    ReloadInFull { tickers: Vec<String> },
    /// List and save each of `tickers` once, then record `loaded`.
    Load {
        tickers: Vec<String>,
        loaded: Vec<String>,
    },
}

/// A sync's steps before its catch-up, in the order to carry them out. Empty when the copy is
/// loaded with exactly the wanted tickers and needs no reload.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TickerSync {
    pub steps: Vec<TickerStep>,
}

/// Decides a sync's ticker steps (see the module doc for how to drive it).
///
/// - A loaded ticker no longer wanted is dropped, first. A reload's second step reads every
///   story the copy holds open that its listing did not return, so a removed ticker's stories
///   still held would be read again, and saved again when they exist. And a removed ticker
///   stops being recorded as loaded only in the transaction that drops its stories: were a
///   load to record the new set first, a sync cut short before the drop would leave stories
///   of a ticker that no later sync knows to drop.
/// - When a reload in full is needed it lists every wanted ticker, so it stands in for every
///   load ("For each ticker, list its stories"): no ticker is listed twice in one sync.
/// - Otherwise each wanted ticker not loaded is listed and saved once: the seed's "load its
///   current stories once"; a ticker already loaded is kept up to date by events, not listed
///   again.
///
/// Tickers are taken once each, in the order given (`loaded`'s for what stays loaded,
/// `wanted`'s for what is added).
///
/// Rules: S-410-RELOAD, S-RELOAD-STEPS, S-ADD-TICKER, S-REMOVE-TICKER (services/rules/RULES.md).
pub fn decide_ticker_sync(input: TickerSyncInput<'_>) -> TickerSync {
    let wanted = once_each(input.wanted);
    let loaded = once_each(input.loaded);
    let wanted_set: HashSet<&String> = wanted.iter().collect();
    let (kept, dropped): (Vec<String>, Vec<String>) = loaded
        .iter()
        .cloned()
        .partition(|ticker| wanted_set.contains(ticker));
    let mut steps = Vec::new();
    if !dropped.is_empty() {
        steps.push(TickerStep::Drop {
            tickers: dropped,
            loaded: kept.clone(),
        });
    }
    if input.reload_needed {
        steps.push(TickerStep::ReloadInFull { tickers: wanted });
    } else {
        let kept_set: HashSet<&String> = kept.iter().collect();
        let added: Vec<String> = wanted
            .iter()
            .filter(|ticker| !kept_set.contains(ticker))
            .cloned()
            .collect();
        if !added.is_empty() {
            let mut loaded = kept.clone();
            loaded.extend(added.iter().cloned());
            steps.push(TickerStep::Load {
                tickers: added,
                loaded,
            });
        }
    }
    TickerSync { steps }
}

/// `tickers` without repeats, each where it first appears.
fn once_each(tickers: &[String]) -> Vec<String> {
    let mut seen = HashSet::new();
    tickers
        .iter()
        .filter(|ticker| seen.insert(*ticker))
        .cloned()
        .collect()
}
