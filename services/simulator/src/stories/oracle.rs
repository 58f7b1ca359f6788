//! What a receiver of a stories endpoint must end up with: its copy (seed 000's `stories` table)
//! and the notifications it sends once.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;
use uuid::Uuid;

use super::events::{Origin, StoryEventType};
use super::Stories;

/// One story as the oracle expects a receiver's copy to hold it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpectedStory {
    pub ticker: String,
    /// The current version; for a closed story, its closing version.
    pub version: u64,
    pub closed: bool,
    /// The exact snapshot GET /v1/stories/{id} answers (no fault); `None` once closed.
    pub story: Option<Value>,
}

/// One row of a receiver's copy, for [`Stories::compare_copy`]. A row closed from a 404 alone
/// may know no ticker, and its version may be 0.
#[derive(Debug, Clone, PartialEq)]
pub struct CopyRow {
    pub ticker: Option<String>,
    pub version: u64,
    pub closed: bool,
    pub story: Option<Value>,
}

impl Stories {
    /// For the endpoint's tickers now: every open story with its version and exact snapshot,
    /// and every closed story (closed, its closing version, no snapshot).
    pub fn expected_stories(&self, id: Uuid) -> BTreeMap<String, ExpectedStory> {
        let Some(endpoint) = self.endpoints.get(&id) else {
            return BTreeMap::new();
        };
        let tickers = endpoint.tickers();
        self.book
            .stories()
            .filter(|s| tickers.contains(&s.ticker))
            .map(|s| {
                let expected = ExpectedStory {
                    ticker: s.ticker.clone(),
                    version: s.version,
                    closed: s.closed,
                    story: (!s.closed).then(|| s.snapshot()),
                };
                (s.id.clone(), expected)
            })
            .collect()
    }

    /// The stories a correct receiver notifies, each once: those with a `story.became_strong`
    /// of origin `live` in the endpoint's stream (published while it was subscribed to the
    /// story's ticker) created at or after the endpoint's registration
    /// ([`Stories::set_registered_at`]; one created before it is claimed silently, and a story
    /// becomes strong once). Counts every event of the stream as received: an event lost from
    /// both webhooks (given up) and the window (expired) cannot be notified.
    pub fn expected_notifications(&self, id: Uuid) -> BTreeSet<String> {
        let Some(endpoint) = self.endpoints.get(&id) else {
            return BTreeSet::new();
        };
        self.events
            .iter()
            .filter(|e| e.event_type == StoryEventType::BecameStrong && e.origin == Origin::Live)
            .filter(|e| endpoint.receives(&e.ticker, e.position))
            .filter(|e| {
                endpoint
                    .registered_at
                    .is_none_or(|registered| self.created_at(e) >= registered)
            })
            .map(|e| e.story_id.clone())
            .collect()
    }

    /// The stories whose only `story.became_strong` was a backfill, of any ticker the endpoint
    /// ever followed: a receiver must never notify them.
    pub fn backfill_strong(&self, id: Uuid) -> BTreeSet<String> {
        let Some(endpoint) = self.endpoints.get(&id) else {
            return BTreeSet::new();
        };
        let tickers = endpoint.tickers_ever();
        self.events
            .iter()
            .filter(|e| {
                e.event_type == StoryEventType::BecameStrong && e.origin == Origin::Backfill
            })
            .filter(|e| tickers.contains(&e.ticker))
            .map(|e| e.story_id.clone())
            .collect()
    }

    /// How a receiver's copy differs from the oracle, one line each (empty: correct). Correct
    /// means: its open rows are exactly the oracle's open stories (id, version, snapshot), and
    /// every row it holds closed is closed in the oracle at no newer a version than the closing
    /// one. It may lack rows for stories that closed before it saw them.
    /// Whether `story_id` is closed and of a ticker the endpoint followed at some time.
    fn closed_story_ever_followed(&self, id: Uuid, story_id: &str) -> bool {
        let ever = self
            .stories_endpoint(id)
            .map(|endpoint| endpoint.tickers_ever())
            .unwrap_or_default();
        self.story(story_id)
            .is_some_and(|story| story.closed && ever.contains(&story.ticker))
    }

    pub fn compare_copy(&self, id: Uuid, copy: &BTreeMap<String, CopyRow>) -> Vec<String> {
        let expected = self.expected_stories(id);
        let mut differences = Vec::new();
        for (story_id, want) in expected.iter().filter(|(_, e)| !e.closed) {
            match copy.get(story_id) {
                None => differences.push(format!("{story_id}: open v{} missing", want.version)),
                Some(row) if row.closed => differences.push(format!(
                    "{story_id}: held closed (v{}), open at v{}",
                    row.version, want.version
                )),
                Some(row) if row.version != want.version || row.story != want.story => differences
                    .push(format!(
                        "{story_id}: held v{} {:?}, expected v{} {:?}",
                        row.version, row.story, want.version, want.story
                    )),
                Some(_) => {}
            }
        }
        for (story_id, row) in copy {
            match expected.get(story_id) {
                // A receiver keeps the closed rows of a ticker it stopped following: they only
                // keep a closed story from coming back. Closed it must be.
                None if row.closed && self.closed_story_ever_followed(id, story_id) => {}
                None if row.closed => differences.push(format!(
                    "{story_id}: held closed, not a closed story of the endpoint's tickers"
                )),
                None => differences.push(format!(
                    "{story_id}: held open (v{}), not an open story of the endpoint's tickers",
                    row.version
                )),
                Some(want) if row.closed && !want.closed => {} // reported above
                Some(want) if row.closed && row.version > want.version => {
                    differences.push(format!(
                        "{story_id}: held closed at v{}, closed at v{}",
                        row.version, want.version
                    ))
                }
                Some(want) if !row.closed && want.closed => differences.push(format!(
                    "{story_id}: held open (v{}), closed at v{}",
                    row.version, want.version
                )),
                Some(_) => {}
            }
        }
        differences
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::StoriesFaults;
    use crate::stories::{StoriesConfig, StoriesEndpointSpec};

    #[test]
    fn a_story_strong_before_the_registration_is_not_expected_notified() {
        let mut st = Stories::new(StoriesConfig::default(), StoriesFaults::default(), 5);
        let ep = st.add_stories_endpoint(StoriesEndpointSpec {
            id: None,
            url: "http://x/{id}".to_owned(),
            secrets: Vec::new(),
            api_key: "key".to_owned(),
            tickers: ["ALFA".to_owned()].into(),
        });
        let early = st.create_story("ALFA", "early", Origin::Live, 1_000);
        st.make_strong(&early, Origin::Live, 1_000).unwrap();
        let on_time = st.create_story("ALFA", "on time", Origin::Live, 2_000);
        st.make_strong(&on_time, Origin::Live, 2_000).unwrap();
        let late = st.create_story("ALFA", "late", Origin::Live, 3_000);
        st.make_strong(&late, Origin::Live, 3_000).unwrap();
        let all: BTreeSet<String> = [early.clone(), on_time.clone(), late.clone()].into();
        assert_eq!(st.expected_notifications(ep), all, "no registration known");

        // Registered at the instant `on_time` became strong: an event created then notifies.
        let strong_at = |st: &Stories, story: &str| {
            let event = st
                .events()
                .iter()
                .find(|e| e.story_id == story && e.event_type == StoryEventType::BecameStrong)
                .unwrap();
            (st.created_at(event), event.json["created_at"].clone())
        };
        let (registered, rendered) = strong_at(&st, &on_time);
        assert_eq!(rendered, "2026-10-08T06:00:02.000000Z");
        st.set_registered_at(ep, registered);
        assert_eq!(
            st.expected_notifications(ep),
            [on_time.clone(), late.clone()].into()
        );
        // A microsecond later, and `on_time` predates it.
        st.set_registered_at(ep, registered + time::Duration::microseconds(1));
        assert_eq!(st.expected_notifications(ep), [late].into());
    }
}
