//! The upstream's REST API, as the sequencer reads it (shapes: upstream-api.md): the endpoint's
//! filter and language, the pages of `/v1/feed`, and one item for a refetch.

use std::time::Duration;

use relay_netguard::{
    certificate_failure, error_chain, refusal_in, GuardedClient, OutboundPolicy, Refusal,
    TrustRoots,
};
use relay_rules::{ReadItem, RefetchAnswer, StoryRead};
use relay_store::{upstream_status, EndpointId, StoreError, TenantId};
use relay_wire::{FeedItem, ItemKind, Sequence, Story, StoryEvent};
use reqwest::{Method, StatusCode};
use serde::Deserialize;
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
    #[error("{url} answered something unreadable: {detail}")]
    Body { url: String, detail: String },
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
    /// operator's outbound policy), `timeout`, `connect`, `request`, `status`, `body`,
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
            Self::Refused { .. } => "refused",
            Self::CursorExpired => "cursor_expired",
        }
    }
}

/// Records `error` as the endpoint's last upstream failure (its state shows it).
pub async fn record_failure(
    pool: &PgPool,
    tenant: TenantId,
    endpoint: EndpointId,
    error: &UpstreamError,
) -> Result<(), StoreError> {
    upstream_status::record_failure(pool, tenant, endpoint, error.kind(), &error.to_string()).await
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
    api_key: String,
    /// Items asked for per `/v1/feed` page.
    page_limit: usize,
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

#[derive(Deserialize)]
struct EndpointView {
    lang: String,
    #[serde(default)]
    filter: Option<Filter>,
    #[serde(default)]
    tracks: Option<TrackViews>,
}

#[derive(Deserialize, Default)]
struct TrackViews {
    feed: Option<TrackView>,
}

#[derive(Deserialize)]
struct TrackView {
    generation: Option<u64>,
}

#[derive(Deserialize, Default)]
struct Filter {
    companies: Option<Vec<i64>>,
    markets: Option<Vec<String>>,
    part_kinds: Option<Vec<String>>,
    teasers: Option<bool>,
    event_types: Option<Vec<String>>,
}

/// One pass over `/v1/feed`: every item, and the access_version of each page.
#[derive(Debug, Clone, Default)]
pub struct FeedPass {
    pub items: Vec<ReadItem>,
    pub page_access_versions: Vec<String>,
}

#[derive(Deserialize)]
struct Page {
    access_version: String,
    data: Vec<PageItem>,
    next_cursor: Option<String>,
    #[serde(default)]
    has_more: bool,
}

#[derive(Deserialize)]
struct PageItem {
    subject: String,
    sequence: String,
    item: Value,
}

/// Items per `/v1/feed` page by default: the most the API gives, so a pass makes the fewest
/// reads.
pub const FEED_PAGE_LIMIT: usize = 500;

impl UpstreamClient {
    pub fn new(
        http: GuardedClient,
        base_url: Option<&str>,
        api_key: Option<&str>,
    ) -> Result<Self, UpstreamError> {
        match (base_url, api_key) {
            (Some(base), Some(key)) if !base.is_empty() && !key.is_empty() => Ok(Self {
                http,
                base_url: base.trim_end_matches('/').to_owned(),
                api_key: key.to_owned(),
                page_limit: FEED_PAGE_LIMIT,
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

    /// A client for this crate's reads: every request bounded by `timeout`, sent only where
    /// `policy` allows, and no redirect followed (see [`GuardedClient`]).
    pub fn http_client(
        timeout: Duration,
        policy: OutboundPolicy,
        trust: &TrustRoots,
    ) -> GuardedClient {
        GuardedClient::new(policy, trust, timeout)
            .expect("a reqwest client with a resolver and timeouts")
    }

    async fn get(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<(StatusCode, String, bytes::Bytes), UpstreamError> {
        let url = format!("{}{path}", self.base_url);
        let refused = |url: &str, refusal: Refusal| UpstreamError::Refused {
            url: url.to_owned(),
            refusal,
        };
        let answer = self
            .http
            .request(Method::GET, &url)
            .map_err(|refusal| refused(&url, refusal))?
            .bearer_auth(&self.api_key)
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
        let body = answer
            .bytes()
            .await
            .map_err(|cause| UpstreamError::Request {
                url: url.clone(),
                cause: cause.without_url(),
            })?;
        Ok((status, url, body))
    }

    /// `GET /v1/webhook-endpoints/{id}`: the filter and language as they are now, as the
    /// selection `/v1/feed` takes.
    pub async fn selection(&self, endpoint: EndpointId) -> Result<FeedSelection, UpstreamError> {
        let (status, url, body) = self
            .get(&format!("/v1/webhook-endpoints/{endpoint}"), &[])
            .await?;
        if status != StatusCode::OK {
            return Err(UpstreamError::Status { url, status });
        }
        let view: EndpointView =
            serde_json::from_slice(&body).map_err(|e| UpstreamError::Body {
                url,
                detail: e.to_string(),
            })?;
        let filter = view.filter.unwrap_or_default();
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
            generation: view.tracks.and_then(|t| t.feed).and_then(|f| f.generation),
        })
    }

    /// Reads every page of `/v1/feed` for `selection`, once.
    pub async fn read_feed(&self, selection: &FeedSelection) -> Result<FeedPass, UpstreamError> {
        let mut pass = FeedPass::default();
        let mut cursor: Option<String> = None;
        loop {
            let mut query = selection.query();
            query.push(("limit", self.page_limit.to_string()));
            if let Some(cursor) = &cursor {
                query.push(("cursor", cursor.clone()));
            }
            let (status, url, body) = self.get("/v1/feed", &query).await?;
            if status == StatusCode::GONE {
                return Err(UpstreamError::CursorExpired);
            }
            if status != StatusCode::OK {
                return Err(UpstreamError::Status { url, status });
            }
            let page: Page = serde_json::from_slice(&body).map_err(|e| UpstreamError::Body {
                url: url.clone(),
                detail: e.to_string(),
            })?;
            for (i, entry) in page.data.into_iter().enumerate() {
                let item =
                    FeedItem::from_value(entry.item, &format!("data[{i}].item")).map_err(|e| {
                        UpstreamError::Body {
                            url: url.clone(),
                            detail: e.to_string(),
                        }
                    })?;
                pass.items.push(ReadItem {
                    subject: entry.subject,
                    sequence: Sequence::new(entry.sequence),
                    item,
                });
            }
            pass.page_access_versions.push(page.access_version);
            match page.next_cursor {
                Some(next) if page.has_more => cursor = Some(next),
                _ => return Ok(pass),
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
        let (status, url, body) = self.get(&path, &query).await?;
        let json: Option<Value> = serde_json::from_slice(&body).ok();
        let access_version = json
            .as_ref()
            .and_then(|v| v.get("access_version"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        match (status, access_version) {
            (StatusCode::OK, Some(access_version)) => {
                let json = json.unwrap_or_default();
                let sequence = json.get("sequence").and_then(Value::as_str);
                let item = json
                    .get("item")
                    .cloned()
                    .map(|item| FeedItem::from_value(item, "item"));
                match (sequence, item) {
                    (Some(sequence), Some(Ok(item))) => Ok(RefetchAnswer::Found {
                        access_version,
                        sequence: Sequence::new(sequence.to_owned()),
                        item,
                    }),
                    (_, Some(Err(error))) => Err(UpstreamError::Body {
                        url,
                        detail: error.to_string(),
                    }),
                    _ => Err(UpstreamError::Body {
                        url,
                        detail: "no sequence or item".to_owned(),
                    }),
                }
            }
            (StatusCode::NOT_FOUND, Some(access_version)) => {
                Ok(RefetchAnswer::NotFound { access_version })
            }
            // "a 404 that carries none (a load balancer's) is a read that failed".
            (StatusCode::NOT_FOUND, None) => Ok(RefetchAnswer::LoadBalancer404),
            (StatusCode::OK, None) => Err(UpstreamError::Body {
                url,
                detail: "no access_version".to_owned(),
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

#[derive(Deserialize)]
struct RawPage {
    data: Vec<Value>,
    next_cursor: Option<String>,
    #[serde(default)]
    has_more: bool,
}

impl UpstreamClient {
    async fn read_page(
        &self,
        path: &str,
        mut query: Vec<(&'static str, String)>,
        cursor: Option<&str>,
    ) -> Result<RawPage, UpstreamError> {
        query.push(("limit", self.page_limit.min(STORIES_PAGE_LIMIT).to_string()));
        if let Some(cursor) = cursor {
            query.push(("cursor", cursor.to_owned()));
        }
        let (status, url, body) = self.get(path, &query).await?;
        if status == StatusCode::GONE {
            return Err(UpstreamError::CursorExpired);
        }
        if status != StatusCode::OK {
            return Err(UpstreamError::Status { url, status });
        }
        serde_json::from_slice(&body).map_err(|e| UpstreamError::Body {
            url,
            detail: e.to_string(),
        })
    }

    /// `GET /v1/events` after `cursor` (from the start of the window when `None`): one page of
    /// every event for the key's tickers, in the order published. `CursorExpired` on a 410: the
    /// cursor is older than the window, and the copy must be reloaded in full.
    pub async fn read_events(&self, cursor: Option<&str>) -> Result<EventsPage, UpstreamError> {
        let page = self.read_page("/v1/events", Vec::new(), cursor).await?;
        Ok(EventsPage {
            events: page
                .data
                .iter()
                .map(|event| StoryEvent::from_value(event).map_err(|e| e.to_string()))
                .collect(),
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
        let page = self
            .read_page("/v1/stories", vec![("ticker", ticker.to_owned())], cursor)
            .await?;
        let stories = page
            .data
            .iter()
            .map(Story::from_value)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| UpstreamError::Body {
                url: format!("{}/v1/stories", self.base_url),
                detail: e.to_string(),
            })?;
        let next = page.next_cursor.filter(|_| page.has_more);
        Ok((stories, next))
    }

    /// `GET /v1/stories/{id}`: the story now, or [`StoryRead::NotFound`] on a 404 whose body says
    /// `not_found` (closed, or never existed). Any other answer is a read that failed (a 404
    /// without that body is a load balancer's), returned as the error for the endpoint's state.
    pub async fn read_story(&self, id: &str) -> Result<StoryRead, UpstreamError> {
        let path = format!("/v1/stories/{}", urlencode(id));
        let (status, url, body) = self.get(&path, &[]).await?;
        let json: Option<Value> = serde_json::from_slice(&body).ok();
        match status {
            StatusCode::OK => {
                let story = json.as_ref().map(Story::from_value);
                match story {
                    Some(Ok(story)) if story.id == id => Ok(StoryRead::Found(story)),
                    Some(Ok(story)) => Err(UpstreamError::Body {
                        url,
                        detail: format!("asked for story {id:?}, answered {:?}", story.id),
                    }),
                    Some(Err(error)) => Err(UpstreamError::Body {
                        url,
                        detail: error.to_string(),
                    }),
                    None => Err(UpstreamError::Body {
                        url,
                        detail: "not JSON".to_owned(),
                    }),
                }
            }
            StatusCode::NOT_FOUND
                if json
                    .as_ref()
                    .and_then(|v| v.get("error"))
                    .and_then(Value::as_str)
                    == Some("not_found") =>
            {
                Ok(StoryRead::NotFound)
            }
            status => Err(UpstreamError::Status { url, status }),
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
