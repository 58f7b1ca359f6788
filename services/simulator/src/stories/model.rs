//! The stories' truth model: tickers' stories, their articles and versions. Pure: no clock, no
//! randomness; every operation says what changed as a [`StoryChange`], which the upstream
//! publishes as an event.
//!
//! The rules (seed 000 and upstream-api.md's stories part):
//! - `version` starts at 1 and rises by one with every change of the story;
//! - a story becomes strong at most once;
//! - shortlisting an article changes nothing in the story (its version stays);
//! - closing gives the story its closing version (the last version + 1); a closed story never
//!   changes again, and never opens again;
//! - merging A into B (same ticker) closes A and moves its articles to B, whose version rises.

use std::collections::BTreeMap;

use serde_json::{json, Value};

/// An article of a story.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Article {
    pub id: String,
    pub story_id: String,
}

impl Article {
    pub fn to_json(&self) -> Value {
        json!({"id": self.id, "story_id": self.story_id})
    }
}

/// A story as the upstream holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Story {
    /// `st_<n>`.
    pub id: String,
    pub ticker: String,
    /// The current version; once closed, the closing version.
    pub version: u64,
    pub headline: String,
    pub articles: Vec<Article>,
    pub strong: bool,
    pub closed: bool,
    pub closing_version: Option<u64>,
    /// The story this one was merged into, when it closed by a merge.
    pub merged_into: Option<String>,
    /// Stories merged into this one.
    pub merged_from: Vec<String>,
}

impl Story {
    /// The snapshot every event and read carries: `{id, ticker, version, headline, articles}`.
    pub fn snapshot(&self) -> Value {
        json!({
            "id": self.id,
            "ticker": self.ticker,
            "version": self.version,
            "headline": self.headline,
            "articles": self.articles.iter().map(Article::to_json).collect::<Vec<_>>(),
        })
    }

    /// The number in `st_<n>`, for ordering listings.
    pub fn number(&self) -> u64 {
        story_number(&self.id).unwrap_or(0)
    }
}

/// The number in `st_<n>`.
pub fn story_number(id: &str) -> Option<u64> {
    id.strip_prefix("st_")?.parse().ok()
}

/// What one operation changed: the event it publishes, before rendering.
#[derive(Debug, Clone, PartialEq)]
pub enum StoryChange {
    Created {
        story: Value,
    },
    Updated {
        story: Value,
    },
    BecameStrong {
        story: Value,
    },
    Shortlisted {
        article: Article,
    },
    /// `merged_into` is the surviving story's new snapshot.
    Closed {
        story_id: String,
        version: u64,
        merged_into: Option<Value>,
    },
}

/// Why an operation was refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoryError {
    #[error("no story `{0}`")]
    UnknownStory(String),
    #[error("story `{0}` is closed: a closed story never changes again")]
    Closed(String),
    #[error("story `{0}` is already strong")]
    AlreadyStrong(String),
    #[error("a story cannot merge into itself (`{0}`)")]
    SameStory(String),
    #[error("`{from}` and `{into}` are stories of different tickers")]
    TickerMismatch { from: String, into: String },
    #[error("story `{story}` has no article `{article}`")]
    UnknownArticle { story: String, article: String },
}

/// Every story, with each open version's snapshot (stale reads serve older ones).
#[derive(Debug, Clone, Default)]
pub struct StoryBook {
    stories: BTreeMap<String, Story>,
    /// Each story's snapshots by version, from 1 to its last open version.
    history: BTreeMap<String, Vec<Value>>,
    stories_made: u64,
    articles_made: u64,
}

impl StoryBook {
    pub fn story(&self, id: &str) -> Option<&Story> {
        self.stories.get(id)
    }

    /// Every story, open and closed, by id.
    pub fn stories(&self) -> impl Iterator<Item = &Story> {
        self.stories.values()
    }

    /// The open stories of `ticker` (of every ticker when `None`), in id order.
    pub fn open_stories<'a>(&'a self, ticker: Option<&'a str>) -> impl Iterator<Item = &'a Story> {
        self.stories
            .values()
            .filter(move |s| !s.closed && ticker.is_none_or(|t| s.ticker == t))
    }

    /// The snapshots of the story's open versions, oldest first.
    pub fn history(&self, id: &str) -> &[Value] {
        self.history.get(id).map(Vec::as_slice).unwrap_or(&[])
    }

    fn new_article(&mut self, story_id: &str) -> Article {
        self.articles_made += 1;
        Article {
            id: format!("ar_{}", self.articles_made),
            story_id: story_id.to_owned(),
        }
    }

    fn open_mut(&mut self, id: &str) -> Result<&mut Story, StoryError> {
        let story = self
            .stories
            .get_mut(id)
            .ok_or_else(|| StoryError::UnknownStory(id.to_owned()))?;
        if story.closed {
            return Err(StoryError::Closed(id.to_owned()));
        }
        Ok(story)
    }

    /// Records the story's new open version and returns its snapshot.
    fn remember(&mut self, id: &str) -> Value {
        let snapshot = self.stories[id].snapshot();
        self.history
            .entry(id.to_owned())
            .or_default()
            .push(snapshot.clone());
        snapshot
    }

    /// A new story of `ticker` at version 1, with one article.
    pub fn create(&mut self, ticker: &str, headline: &str) -> (String, StoryChange) {
        self.stories_made += 1;
        let id = format!("st_{}", self.stories_made);
        let article = self.new_article(&id);
        self.stories.insert(
            id.clone(),
            Story {
                id: id.clone(),
                ticker: ticker.to_owned(),
                version: 1,
                headline: headline.to_owned(),
                articles: vec![article],
                strong: false,
                closed: false,
                closing_version: None,
                merged_into: None,
                merged_from: Vec::new(),
            },
        );
        let story = self.remember(&id);
        (id, StoryChange::Created { story })
    }

    /// A new headline (when given) and, with `add_article`, one more article: version + 1.
    pub fn update(
        &mut self,
        id: &str,
        headline: Option<&str>,
        add_article: bool,
    ) -> Result<StoryChange, StoryError> {
        self.open_mut(id)?;
        let article = add_article.then(|| self.new_article(id));
        let story = self.open_mut(id)?;
        if let Some(headline) = headline {
            story.headline = headline.to_owned();
        }
        story.articles.extend(article);
        story.version += 1;
        Ok(StoryChange::Updated {
            story: self.remember(id),
        })
    }

    /// The story becomes strong (once): version + 1.
    pub fn make_strong(&mut self, id: &str) -> Result<StoryChange, StoryError> {
        let story = self.open_mut(id)?;
        if story.strong {
            return Err(StoryError::AlreadyStrong(id.to_owned()));
        }
        story.strong = true;
        story.version += 1;
        Ok(StoryChange::BecameStrong {
            story: self.remember(id),
        })
    }

    /// One of the story's articles is shortlisted. The story's version does not change.
    pub fn shortlist(&mut self, id: &str, article_id: &str) -> Result<StoryChange, StoryError> {
        let story = self.open_mut(id)?;
        let article = story
            .articles
            .iter()
            .find(|a| a.id == article_id)
            .cloned()
            .ok_or_else(|| StoryError::UnknownArticle {
                story: id.to_owned(),
                article: article_id.to_owned(),
            })?;
        Ok(StoryChange::Shortlisted { article })
    }

    /// Closes the story for good: its closing version is its version + 1.
    pub fn close(&mut self, id: &str) -> Result<StoryChange, StoryError> {
        let story = self.open_mut(id)?;
        story.version += 1;
        story.closed = true;
        story.closing_version = Some(story.version);
        Ok(StoryChange::Closed {
            story_id: id.to_owned(),
            version: story.version,
            merged_into: None,
        })
    }

    /// Merges `from` into `into` (both open, one ticker): `from` closes, `into` takes its
    /// articles and its version rises by one.
    pub fn merge(&mut self, from: &str, into: &str) -> Result<StoryChange, StoryError> {
        if from == into {
            return Err(StoryError::SameStory(from.to_owned()));
        }
        let from_ticker = self.open_mut(from)?.ticker.clone();
        if self.open_mut(into)?.ticker != from_ticker {
            return Err(StoryError::TickerMismatch {
                from: from.to_owned(),
                into: into.to_owned(),
            });
        }
        let source = self.open_mut(from)?;
        let moved = std::mem::take(&mut source.articles);
        source.version += 1;
        source.closed = true;
        source.closing_version = Some(source.version);
        source.merged_into = Some(into.to_owned());
        let closing_version = source.version;
        let target = self.open_mut(into)?;
        target
            .articles
            .extend(moved.into_iter().map(|article| Article {
                story_id: into.to_owned(),
                ..article
            }));
        target.version += 1;
        target.merged_from.push(from.to_owned());
        Ok(StoryChange::Closed {
            story_id: from.to_owned(),
            version: closing_version,
            merged_into: Some(self.remember(into)),
        })
    }
}
