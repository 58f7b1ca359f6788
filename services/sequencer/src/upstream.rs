//! The upstream's REST API, as the sequencer reads it (shapes: upstream-api.md): the endpoint's
//! filter and language, the pages of `/v1/feed`, and one item for a refetch.
//!
//! Every answer is bounded before anything of it is kept: its body is read up to a cap
//! (relay-netguard's [`GuardedClient::read_body_within`]: the operator's
//! `RELAY_UPSTREAM_MAX_ANSWER_BYTES` for pages, the wire file's largest body for answers of one
//! object), parsed against a budget of the memory its value may take, and checked by
//! relay-wire's [`answer`] module with the checks webhook bodies go through. A reload pass, or a
//! stories endpoint's sync, also has a budget for everything it reads ([`PassBudget`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use relay_netguard::{
    certificate_failure, error_chain, refusal_in, BodyError, GuardedClient, OutboundPolicy,
    Refusal, TrustRoots,
};
use relay_rules::{ReadItem, RefetchAnswer, StoryRead};
use relay_store::SecretText;
use relay_store::{upstream_status, EndpointId, StoreError, TenantId};
use relay_wire::answer::{self, AnswerError};
use relay_wire::{ItemKind, Story, StoryEvent};
use reqwest::{Method, StatusCode};
use serde_json::Value;
use sqlx::PgPool;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("the endpoint has no upstream API base URL or key registered")]
    NotConfigured,
    /// No answer: the connection, TLS, a timeout. Its text is the whole chain of causes.
    #[error("request to {url} failed: {}", error_chain(cause))]
    Request {
        url: String,
        /// Not the error's `source`: the text already says all of it.
        cause: reqwest::Error,
    },
    #[error("{url} answered {status}")]
    Status { url: String, status: StatusCode },
    /// The body is not JSON.
    #[error("{url} answered something unreadable: {detail}")]
    Body { url: String, detail: String },
    /// The answer, or the pass it belongs to, is over its bound: read no further.
    #[error("{url} answered too much: {detail}")]
    TooLarge { url: String, detail: String },
    /// JSON the relay refuses to keep: the wrong shape, or a value the checks of webhook bodies
    /// refuse (a control character in a subject, U+0000 in a story, an overlong id, ...). The
    /// detail names the field.
    #[error("{url} answered something the relay refuses to keep: {detail}")]
    Invalid { url: String, detail: String },
    /// The base URL, or what its name resolves to, is not where the operator lets the relay
    /// send requests.
    #[error("request to {url} refused: {refusal}")]
    Refused { url: String, refusal: Refusal },
    /// `410 cursor_expired` on a page after the first: start the pass again.
    #[error("the feed cursor expired")]
    CursorExpired,
}

impl UpstreamError {
    /// The failure's name for users (the endpoint's state): `certificate_<check>` (unknown_issuer,
    /// name_mismatch, expired, ...) when the upstream's certificate was refused, `refused` (the
    /// operator's outbound policy), `timeout`, `connect`, `request`, `status`, `body` (not
    /// JSON), `too_large` (an answer over `RELAY_UPSTREAM_MAX_ANSWER_BYTES`, or a pass over
    /// `RELAY_SEQUENCER_MAX_RELOAD_BYTES`), `invalid` (JSON the relay refuses to keep),
    /// `not_configured`, `cursor_expired`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotConfigured => "not_configured",
            Self::Request { cause, .. } => match certificate_failure(cause) {
                Some(failure) => failure.kind(),
                None if cause.is_timeout() => "timeout",
                None if cause.is_connect() => "connect",
                None if cause.is_body() || cause.is_decode() => "body",
                None => "request",
            },
            Self::Status { .. } => "status",
            Self::Body { .. } => "body",
            Self::TooLarge { .. } => "too_large",
            Self::Invalid { .. } => "invalid",
            Self::Refused { .. } => "refused",
            Self::CursorExpired => "cursor_expired",
        }
    }

    /// What relay-wire's checks refused in the answer from `url`, as the failure of its kind.
    fn refused(url: &str, error: AnswerError) -> Self {
        let (url, detail) = (url.to_owned(), error.to_string());
        match error.kind() {
            "body" => Self::Body { url, detail },
            "too_large" => Self::TooLarge { url, detail },
            _ => Self::Invalid { url, detail },
        }
    }
}

/// Records `error` as the endpoint's last upstream failure (its state shows it, with the
/// failures in a row, which this returns).
pub async fn record_failure(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    error: &UpstreamError,
) -> Result<i32, StoreError> {
    upstream_status::record_failure(pool, tenant, endpoint, error.kind(), &error.to_string()).await
}

/// The failure's name when Postgres refused to keep what the upstream answered (a reload's
/// merge, a stories endpoint's writes): the endpoint's state shows it as the upstream's.
pub const STORE_REFUSED: &str = "store";

/// What one read, a reload pass or a stories endpoint's sync, may still read: its answers'
/// bytes, or the memory their values take once parsed when that is more
/// (`RELAY_SEQUENCER_MAX_RELOAD_BYTES`). Every answer is read with at most what is left as its
/// cap, so the whole never holds more than the budget.
#[derive(Debug)]
pub struct PassBudget {
    max: u64,
    left: AtomicU64,
}

impl PassBudget {
    pub fn new(max: u64) -> Arc<Self> {
        Arc::new(Self {
            max,
            left: AtomicU64::new(max),
        })
    }

    /// What was read so far.
    pub fn used(&self) -> u64 {
        self.max - self.left.load(Ordering::SeqCst)
    }

    fn left(&self) -> u64 {
        self.left.load(Ordering::SeqCst)
    }

    fn charge(&self, cost: u64) {
        let _ = self
            .left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                Some(left.saturating_sub(cost))
            });
    }
}

/// What an answer holds: one page of a listing, or one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holds {
    /// A page of `/v1/feed`, `/v1/events` or `/v1/stories`: up to the operator's cap.
    Page,
    /// An endpoint, an item or a story: up to [`MAX_OBJECT_ANSWER_BYTES`].
    Object,
}

/// The most an answer of one object (an endpoint, an item, a story) is read: the wire file's
/// largest body. The upstream sends any item or story in a webhook of at most that size (an
/// item larger than a message's share is sent alone), so a read of one is no larger; a worker
/// holds at most one such answer at a time.
pub const MAX_OBJECT_ANSWER_BYTES: u64 = relay_wire::limits::MAX_BODY_BYTES as u64;

/// What an answer's value may take once parsed (as relay-wire's `answer::parse` estimates it),
/// per byte of its cap. A large answer is large for its text, which takes about its own size
/// once parsed; what takes more is small objects and arrays (the benchmark's 1 KB items are
/// estimated at 8 KB each), and four times the cap holds a page of 500 of them many times over.
/// Past it the answer is refused as too large, however few bytes it was read from. A reload
/// pass's answers are bounded by what the pass has left too.
const WEIGHT_PER_BYTE: u64 = 4;

/// One answer: its status, where it came from, and its body as JSON (`None`: not JSON).
struct Answered {
    status: StatusCode,
    url: String,
    json: Option<Value>,
}

/// Records that the endpoint's upstream answered well: ends a failing stretch, if one runs.
pub async fn record_success(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
) -> Result<(), StoreError> {
    upstream_status::record_success(pool, tenant, endpoint).await
}

/// One endpoint's view of the upstream: where to read and with which key.
#[derive(Clone)]
pub struct UpstreamClient {
    http: GuardedClient,
    base_url: String,
    api_key: SecretText,
    /// Items asked for per `/v1/feed` page.
    page_limit: usize,
    /// What the pass this client reads for may still read (`None`: one answer at a time is
    /// bounded, nothing more).
    budget: Option<Arc<PassBudget>>,
}

impl std::fmt::Debug for UpstreamClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is a secret: never in logs.
        f.debug_struct("UpstreamClient")
            .field("base_url", &self.base_url)
            .finish_non_exhaustive()
    }
}

/// The endpoint's filter and language as the upstream holds them now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FeedSelection {
    pub lang: String,
    pub companies: Option<Vec<i64>>,
    pub markets: Option<Vec<String>>,
    pub part_kinds: Option<Vec<String>>,
    pub teasers: Option<bool>,
    /// The item kinds the filter's event_types name (`None`: no restriction).
    pub item_kinds: Option<Vec<ItemKind>>,
    /// The feed track's generation as the endpoint read gave it: where a reload no message
    /// began merges (relay-rules' `Reload::merge_generation`).
    pub generation: Option<u64>,
}

impl FeedSelection {
    /// The query parameters `/v1/feed` takes for this selection (an absent list: no restriction).
    fn query(&self) -> Vec<(&'static str, String)> {
        let join = |v: &[String]| v.join(",");
        let mut query = vec![("lang", self.lang.clone())];
        if let Some(companies) = &self.companies {
            let ids: Vec<String> = companies.iter().map(i64::to_string).collect();
            query.push(("companies", join(&ids)));
        }
        if let Some(markets) = &self.markets {
            query.push(("markets", join(markets)));
        }
        if let Some(kinds) = &self.part_kinds {
            query.push(("part_kinds", join(kinds)));
        }
        if let Some(teasers) = self.teasers {
            query.push(("teasers", teasers.to_string()));
        }
        if let Some(kinds) = &self.item_kinds {
            let kinds: Vec<String> = kinds.iter().map(|k| k.as_str().to_owned()).collect();
            query.push(("item_kinds", join(&kinds)));
        }
        query
    }
}

/// One pass over `/v1/feed`: every item, and the access_version of each page.
#[derive(Debug, Clone, Default)]
pub struct FeedPass {
    pub items: Vec<ReadItem>,
    pub page_access_versions: Vec<String>,
}

/// Items per `/v1/feed` page by default: the most the API gives, so a pass makes the fewest
/// reads.
pub const FEED_PAGE_LIMIT: usize = 500;

impl UpstreamClient {
    pub fn new(
        http: GuardedClient,
        base_url: Option<&str>,
        api_key: Option<&SecretText>,
    ) -> Result<Self, UpstreamError> {
        match (base_url, api_key) {
            (Some(base), Some(key)) if !base.is_empty() && !key.expose().is_empty() => Ok(Self {
                http,
                base_url: base.trim_end_matches('/').to_owned(),
                api_key: key.clone(),
                page_limit: FEED_PAGE_LIMIT,
                budget: None,
            }),
            _ => Err(UpstreamError::NotConfigured),
        }
    }

    /// Asks for `limit` items per `/v1/feed` page (1 to 500) instead of the most: tests use
    /// small pages so that a pass has several, and the faults between pages strike.
    pub fn with_page_limit(mut self, limit: usize) -> Self {
        self.page_limit = limit.clamp(1, FEED_PAGE_LIMIT);
        self
    }

    /// This client, reading for a pass that may read `budget`'s bytes at most (its answers fail
    /// as [`UpstreamError::TooLarge`] past it).
    pub fn with_budget(mut self, budget: Arc<PassBudget>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// A client for this crate's reads: every request bounded by `timeout`, sent only where
    /// `policy` allows, no redirect followed, and every answer read up to the policy's
    /// `max_answer_bytes` (see [`GuardedClient`]).
    pub fn http_client(
        timeout: Duration,
        policy: OutboundPolicy,
        trust: &TrustRoots,
    ) -> GuardedClient {
        GuardedClient::new(policy, trust, timeout)
            .expect("a reqwest client with a resolver and timeouts")
    }

    /// `GET {path}`: the answer's body read up to what it may hold (and what the pass has
    /// left), then parsed against the same bound on the memory its value takes. Both count
    /// against the pass's budget.
    async fn get(
        &self,
        path: &str,
        query: &[(&str, String)],
        holds: Holds,
    ) -> Result<Answered, UpstreamError> {
        let url = format!("{}{path}", self.base_url);
        let cap = match holds {
            Holds::Page => self.http.max_answer_bytes(),
            Holds::Object => MAX_OBJECT_ANSWER_BYTES.min(self.http.max_answer_bytes()),
        };
        let left = self.budget.as_ref().map_or(u64::MAX, |b| b.left());
        let pass_bound = |budget: &PassBudget| UpstreamError::TooLarge {
            url: url.clone(),
            detail: format!(
                "the pass read {} bytes, past its bound of {} \
                 (RELAY_SEQUENCER_MAX_RELOAD_BYTES)",
                budget.used(),
                budget.max
            ),
        };
        if let Some(budget) = self.budget.as_ref().filter(|b| b.left() == 0) {
            return Err(pass_bound(budget));
        }
        let refused = |url: &str, refusal: Refusal| UpstreamError::Refused {
            url: url.to_owned(),
            refusal,
        };
        let answer = self
            .http
            .request(Method::GET, &url)
            .map_err(|refusal| refused(&url, refusal))?
            .bearer_auth(self.api_key.expose())
            .query(query)
            .send()
            .await
            .map_err(|cause| match refusal_in(&cause) {
                Some(refusal) => refused(&url, refusal.clone()),
                // The URL is said once, by this error.
                None => UpstreamError::Request {
                    url: url.clone(),
                    cause: cause.without_url(),
                },
            })?;
        let status = answer.status();
        // Past what the pass has left, the pass's bound is what refused it.
        let by_pass = left < cap;
        let body = self
            .http
            .read_body_within(answer, cap.min(left))
            .await
            .map_err(|error| match error {
                BodyError::TooLarge { .. } if by_pass => {
                    pass_bound(self.budget.as_deref().expect("a pass bound"))
                }
                BodyError::TooLarge { .. } => UpstreamError::TooLarge {
                    url: url.clone(),
                    detail: match holds {
                        Holds::Page => format!("{error} (RELAY_UPSTREAM_MAX_ANSWER_BYTES)"),
                        Holds::Object => format!("{error}, the most an answer of one object is"),
                    },
                },
                BodyError::Read(cause) => UpstreamError::Request {
                    url: url.clone(),
                    cause: cause.without_url(),
                },
            })?;
        let weight_cap = cap.saturating_mul(WEIGHT_PER_BYTE).min(left);
        let json = match answer::parse(&body, weight_cap) {
            Ok(parsed) => {
                if let Some(budget) = &self.budget {
                    budget.charge(parsed.weight.max(body.len() as u64));
                }
                Some(parsed.value)
            }
            Err(AnswerError::TooLarge { .. }) if weight_cap == left => {
                return Err(pass_bound(self.budget.as_deref().expect("a pass bound")))
            }
            Err(error @ AnswerError::TooLarge { .. }) => {
                return Err(UpstreamError::refused(&url, error))
            }
            Err(_) => {
                if let Some(budget) = &self.budget {
                    budget.charge(body.len() as u64);
                }
                None
            }
        };
        Ok(Answered { status, url, json })
    }

    /// The JSON of an answer that must be JSON.
    fn json(answered: Answered) -> Result<(String, Value), UpstreamError> {
        match answered.json {
            Some(json) => Ok((answered.url, json)),
            None => Err(UpstreamError::Body {
                url: answered.url,
                detail: "not JSON".to_owned(),
            }),
        }
    }

    /// `GET /v1/webhook-endpoints/{id}`: the filter and language as they are now, as the
    /// selection `/v1/feed` takes.
    pub async fn selection(&self, endpoint: EndpointId) -> Result<FeedSelection, UpstreamError> {
        let answered = self
            .get(
                &format!("/v1/webhook-endpoints/{endpoint}"),
                &[],
                Holds::Object,
            )
            .await?;
        if answered.status != StatusCode::OK {
            return Err(UpstreamError::Status {
                url: answered.url,
                status: answered.status,
            });
        }
        let (url, json) = Self::json(answered)?;
        let view = answer::EndpointAnswer::from_value(&json)
            .map_err(|e| UpstreamError::refused(&url, e))?;
        let filter = view.filter;
        // "the item kinds its event_types name": `announcement.updated` names `announcement`.
        let item_kinds = filter.event_types.map(|types| {
            let mut kinds: Vec<ItemKind> = types
                .iter()
                .filter_map(|t| {
                    t.split_once('.')
                        .and_then(|(kind, _)| ItemKind::parse(kind))
                })
                .collect();
            kinds.sort();
            kinds.dedup();
            kinds
        });
        Ok(FeedSelection {
            lang: view.lang,
            companies: filter.companies,
            markets: filter.markets,
            part_kinds: filter.part_kinds,
            teasers: filter.teasers,
            item_kinds,
            generation: view.feed_generation,
        })
    }

    /// Reads every page of `/v1/feed` for `selection`, once. Each page is checked whole
    /// (relay-wire's [`answer::FeedPage`]) before any of it joins the pass.
    pub async fn read_feed(&self, selection: &FeedSelection) -> Result<FeedPass, UpstreamError> {
        let mut pass = FeedPass::default();
        let mut cursor: Option<String> = None;
        loop {
            let (url, json) = self
                .read_page(
                    "/v1/feed",
                    selection.query(),
                    cursor.as_deref(),
                    self.page_limit,
                )
                .await?;
            let page =
                answer::FeedPage::from_value(json).map_err(|e| UpstreamError::refused(&url, e))?;
            pass.items
                .extend(page.entries.into_iter().map(|entry| ReadItem {
                    subject: entry.subject,
                    sequence: entry.sequence,
                    item: entry.item,
                }));
            pass.page_access_versions.push(page.access_version);
            match page.next_cursor {
                Some(next) => cursor = Some(next),
                None => return Ok(pass),
            }
        }
    }

    /// `GET /v1/feed/items/{feed_item_id}` in the endpoint's language (and its part kinds, so the
    /// item is rendered as the feed renders it), as the refetch rule reads the answer. An error
    /// is a read that failed (no answer, an unexpected status, an unreadable item): the rule's
    /// [`RefetchAnswer::Failed`], with what went wrong for the endpoint's state.
    pub async fn read_item(
        &self,
        selection: &FeedSelection,
        feed_item_id: &str,
    ) -> Result<RefetchAnswer, UpstreamError> {
        let mut query = vec![("lang", selection.lang.clone())];
        if let Some(kinds) = &selection.part_kinds {
            query.push(("part_kinds", kinds.join(",")));
        }
        let path = format!("/v1/feed/items/{}", urlencode(feed_item_id));
        let answered = self.get(&path, &query, Holds::Object).await?;
        let (status, url) = (answered.status, answered.url);
        let access_version = match &answered.json {
            Some(json) => {
                answer::access_version(json).map_err(|e| UpstreamError::refused(&url, e))?
            }
            None => None,
        };
        match (status, access_version) {
            (StatusCode::OK, Some(_)) => {
                let json = answered.json.unwrap_or_default();
                let found = answer::ItemAnswer::from_value(json)
                    .map_err(|e| UpstreamError::refused(&url, e))?;
                Ok(RefetchAnswer::Found {
                    access_version: found.access_version,
                    sequence: found.sequence,
                    item: found.item,
                })
            }
            (StatusCode::NOT_FOUND, Some(access_version)) => {
                Ok(RefetchAnswer::NotFound { access_version })
            }
            // "a 404 that carries none (a load balancer's) is a read that failed".
            (StatusCode::NOT_FOUND, None) => Ok(RefetchAnswer::LoadBalancer404),
            (StatusCode::OK, None) => Err(UpstreamError::Invalid {
                url,
                detail: "access_version is missing".to_owned(),
            }),
            (status, _) => Err(UpstreamError::Status { url, status }),
        }
    }
}

/// Events per `GET /v1/events` page, and stories per `GET /v1/stories` page: the most the API
/// gives.
pub const STORIES_PAGE_LIMIT: usize = 500;

/// One page of `GET /v1/events`: each event parsed, or why it is not a stories event.
#[derive(Debug)]
pub struct EventsPage {
    pub events: Vec<Result<StoryEvent, String>>,
    pub next_cursor: Option<String>,
    pub has_more: bool,
}

impl UpstreamClient {
    /// The stories API's listings answer at most [`STORIES_PAGE_LIMIT`] a page.
    fn stories_page_limit(&self) -> usize {
        self.page_limit.min(STORIES_PAGE_LIMIT)
    }

    /// One page of a listing at `path` (`limit` and `cursor` added to `query`), as JSON; a
    /// 410 is the cursor's expiry.
    async fn read_page(
        &self,
        path: &str,
        mut query: Vec<(&'static str, String)>,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<(String, Value), UpstreamError> {
        query.push(("limit", limit.to_string()));
        if let Some(cursor) = cursor {
            query.push(("cursor", cursor.to_owned()));
        }
        let answered = self.get(path, &query, Holds::Page).await?;
        if answered.status == StatusCode::GONE {
            return Err(UpstreamError::CursorExpired);
        }
        if answered.status != StatusCode::OK {
            return Err(UpstreamError::Status {
                url: answered.url,
                status: answered.status,
            });
        }
        Self::json(answered)
    }

    /// `GET /v1/events` after `cursor` (from the start of the window when `None`): one page of
    /// every event for the key's tickers, in the order published. `CursorExpired` on a 410: the
    /// cursor is older than the window, and the copy must be reloaded in full.
    pub async fn read_events(&self, cursor: Option<&str>) -> Result<EventsPage, UpstreamError> {
        let (url, json) = self
            .read_page("/v1/events", Vec::new(), cursor, self.stories_page_limit())
            .await?;
        let page =
            answer::EventsAnswer::from_value(&json).map_err(|e| UpstreamError::refused(&url, e))?;
        Ok(EventsPage {
            events: page.events,
            next_cursor: page.next_cursor,
            has_more: page.has_more,
        })
    }

    /// One page of `GET /v1/stories?ticker=`: the ticker's open stories now, and the cursor of
    /// the next page (`None` after the last).
    pub async fn list_stories(
        &self,
        ticker: &str,
        cursor: Option<&str>,
    ) -> Result<(Vec<Story>, Option<String>), UpstreamError> {
        let (url, json) = self
            .read_page(
                "/v1/stories",
                vec![("ticker", ticker.to_owned())],
                cursor,
                self.stories_page_limit(),
            )
            .await?;
        let page = answer::StoriesAnswer::from_value(&json)
            .map_err(|e| UpstreamError::refused(&url, e))?;
        Ok((page.stories, page.next_cursor))
    }

    /// `GET /v1/stories/{id}`: the story now, or [`StoryRead::NotFound`] on a 404 whose body says
    /// `not_found` (closed, or never existed). Any other answer is a read that failed (a 404
    /// without that body is a load balancer's), returned as the error for the endpoint's state.
    pub async fn read_story(&self, id: &str) -> Result<StoryRead, UpstreamError> {
        let path = format!("/v1/stories/{}", urlencode(id));
        let answered = self.get(&path, &[], Holds::Object).await?;
        let (status, url) = (answered.status, answered.url);
        match (status, answered.json) {
            (StatusCode::OK, Some(json)) => match Story::from_value(&json) {
                Ok(story) if story.id == id => Ok(StoryRead::Found(story)),
                Ok(story) => Err(UpstreamError::Invalid {
                    url,
                    detail: format!("asked for story {id:?}, answered {:?}", story.id),
                }),
                Err(error) => Err(UpstreamError::refused(&url, error.into())),
            },
            (StatusCode::OK, None) => Err(UpstreamError::Body {
                url,
                detail: "not JSON".to_owned(),
            }),
            (StatusCode::NOT_FOUND, Some(json))
                if answer::error_code(&json)
                    .map_err(|e| UpstreamError::refused(&url, e))?
                    .as_deref()
                    == Some("not_found") =>
            {
                Ok(StoryRead::NotFound)
            }
            (status, _) => Err(UpstreamError::Status { url, status }),
        }
    }
}

/// Percent-encodes a path segment (`announcement:88001` keeps its colon: it is allowed there).
fn urlencode(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for byte in segment.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b':' => {
                out.push(byte as char)
            }
            other => out.push_str(&format!("%{other:02X}")),
        }
    }
    out
}
