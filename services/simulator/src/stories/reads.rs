//! The stories API's answers (upstream-api.md: GET /v1/events, /v1/stories, /v1/stories/{id}),
//! with their faults. An API key reads what its endpoint's tickers hold.

use rand::Rng;
use serde_json::{json, Value};

use super::model::story_number;
use super::{Stories, StoriesEndpoint};
use crate::upstream::ApiError;

/// Why a stories API call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoriesApiError {
    #[error(transparent)]
    Api(#[from] ApiError),
    /// 503 `{"error": "unavailable"}`: the API is paused, or the server-error fault struck.
    #[error("unavailable")]
    Unavailable,
}

/// GET /v1/stories/{id}'s answer.
#[derive(Debug, Clone, PartialEq)]
pub enum StoryRead {
    /// 200 with the story's snapshot.
    Found(Value),
    /// A fault: 200 with a snapshot some versions old (from before its close, for a closed
    /// story), answered after `delay_ms`.
    Stale { story: Value, delay_ms: u64 },
    /// 404 `{"error": "not_found"}`: closed, never existed, or of a ticker the key does not
    /// follow.
    NotFound,
    /// A load balancer's 404: plain text, no JSON.
    LoadBalancer404,
}

const EVENTS_CURSOR: &str = "evc_";
const STORIES_CURSOR: &str = "stc_";

fn parse_cursor(text: &str, prefix: &str) -> Result<u64, ApiError> {
    text.strip_prefix(prefix)
        .and_then(|hex| u64::from_str_radix(hex, 16).ok())
        .ok_or_else(|| ApiError::BadRequest(format!("`{text}` is not a cursor this API gave")))
}

/// How long after a story's change a read may still answer the version before it: the read
/// began before the change and was slow to answer. Driver milliseconds.
pub const STALE_HORIZON_MS: u64 = 2_000;

impl Stories {
    fn endpoint_of_key(&self, token: &str) -> Result<&StoriesEndpoint, ApiError> {
        self.keys
            .get(token)
            .and_then(|id| self.endpoints.get(id))
            .ok_or(ApiError::Unauthorized)
    }

    /// The checks every call makes first: the API paused (503), the key (401), the server-error
    /// fault (503).
    fn admit(&mut self, token: &str) -> Result<(), StoriesApiError> {
        if self.api_paused {
            return Err(StoriesApiError::Unavailable);
        }
        self.endpoint_of_key(token)?;
        let p = self.faults.server_error.clamp(0.0, 1.0);
        if self.api_rng.gen_bool(p) {
            return Err(StoriesApiError::Unavailable);
        }
        Ok(())
    }

    /// GET /v1/events: the key's stream within the window, after `cursor`, in publication order:
    /// `{"data": [...], "next_cursor": "...", "has_more": bool}`. `next_cursor` is always given:
    /// when `has_more` is false it is the log's head, for the next catch-up.
    pub fn events_page(
        &mut self,
        token: &str,
        cursor: Option<&str>,
        limit: usize,
        now_ms: u64,
    ) -> Result<Value, StoriesApiError> {
        self.admit(token)?;
        let start = self.window_start(now_ms);
        let from = match cursor {
            None => start,
            Some(text) => {
                let position = parse_cursor(text, EVENTS_CURSOR)? as usize;
                if position > self.events.len() {
                    return Err(
                        ApiError::BadRequest(format!("`{text}` is ahead of the log")).into(),
                    );
                }
                if position < start {
                    return Err(ApiError::CursorExpired.into());
                }
                position
            }
        };
        let endpoint = self.endpoint_of_key(token)?;
        let limit = limit.clamp(1, 500);
        let mut matching = self.events[from..]
            .iter()
            .filter(|e| endpoint.receives(&e.ticker, e.position));
        let page: Vec<_> = matching.by_ref().take(limit).collect();
        let has_more = matching.next().is_some();
        let next = match page.last() {
            Some(last) if has_more => last.position + 1,
            _ => self.events.len(),
        };
        Ok(json!({
            "data": page.iter().map(|e| e.json.clone()).collect::<Vec<_>>(),
            "next_cursor": format!("{EVENTS_CURSOR}{next:x}"),
            "has_more": has_more,
        }))
    }

    /// GET /v1/stories?ticker=: the ticker's open stories now, in id order. A ticker the key
    /// does not follow is 404 `not_found`.
    pub fn stories_page(
        &mut self,
        token: &str,
        ticker: Option<&str>,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<Value, StoriesApiError> {
        self.admit(token)?;
        let ticker = ticker.ok_or_else(|| ApiError::BadRequest("ticker is required".to_owned()))?;
        if !self.endpoint_of_key(token)?.tickers().contains(ticker) {
            return Err(ApiError::NotFound.into());
        }
        let after = cursor
            .map(|text| parse_cursor(text, STORIES_CURSOR))
            .transpose()?
            .unwrap_or(0);
        let limit = limit.clamp(1, 500);
        let mut open: Vec<_> = self
            .book
            .open_stories(Some(ticker))
            .filter(|s| s.number() > after)
            .collect();
        open.sort_by_key(|s| s.number());
        let has_more = open.len() > limit;
        open.truncate(limit);
        let next = open.last().map_or(after, |s| s.number());
        Ok(json!({
            "data": open.iter().map(|s| s.snapshot()).collect::<Vec<_>>(),
            "next_cursor": format!("{STORIES_CURSOR}{next:x}"),
            "has_more": has_more,
        }))
    }

    /// GET /v1/stories/{id}. With the `stale_reads` fault, a story changed within
    /// [`STALE_HORIZON_MS`] may answer the version before that change (a 200 from before its
    /// close, for a closed one), after `stale_read_ms`.
    pub fn story_read(
        &mut self,
        token: &str,
        id: &str,
        now_ms: u64,
    ) -> Result<StoryRead, StoriesApiError> {
        self.admit(token)?;
        let tickers = self.endpoint_of_key(token)?.tickers();
        let Some(story) = self
            .book
            .story(id)
            .filter(|s| tickers.contains(&s.ticker) && story_number(id).is_some())
        else {
            return Ok(StoryRead::NotFound);
        };
        let (closed, snapshot) = (story.closed, story.snapshot());
        if self.api_rng.gen_bool(self.faults.lb_404.clamp(0.0, 1.0)) {
            return Ok(StoryRead::LoadBalancer404);
        }
        // A slow read began before the story's last change and answers after it: possible only
        // while that change is recent. A story that changed long ago reads as it is.
        let changed_recently = self
            .events
            .iter()
            .rev()
            .find(|e| e.story_id == id)
            .is_some_and(|e| now_ms <= e.published_ms.saturating_add(STALE_HORIZON_MS));
        if changed_recently
            && self
                .api_rng
                .gen_bool(self.faults.stale_reads.clamp(0.0, 1.0))
        {
            let history = self.book.history(id);
            // An open story's current version is the last; a closed one's every version is old.
            let older = if closed {
                history.len()
            } else {
                history.len().saturating_sub(1)
            };
            if older > 0 {
                let story = history[older - 1].clone();
                return Ok(StoryRead::Stale {
                    story,
                    delay_ms: self.faults.stale_read_ms,
                });
            }
        }
        Ok(if closed {
            StoryRead::NotFound
        } else {
            StoryRead::Found(snapshot)
        })
    }
}
