//! A seeded random stories workload: endpoints with random tickers, then a stream of creations,
//! updates, strong stories, shortlisted articles, closes and merges (chains among them: a story
//! that absorbed others is often merged on), a share of them backfill. The same seed gives the
//! same setup and the same stream.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_wire::SigningSecret;
use uuid::Uuid;

use super::events::Origin;
use super::{Stories, StoriesEndpointSpec};

/// The workload's knobs.
#[derive(Debug, Clone)]
pub struct StoriesWorkloadConfig {
    pub tickers: Vec<String>,
    /// Endpoints [`StoriesWorkload::setup`] makes, each following a random non-empty subset of
    /// the tickers (the first follows them all).
    pub endpoints: usize,
    /// The share of changes published with origin `backfill`.
    pub backfill: f64,
    /// Above this many open stories of a ticker, a step prefers closing and merging to creating.
    pub open_per_ticker: usize,
}

impl Default for StoriesWorkloadConfig {
    fn default() -> Self {
        Self {
            tickers: crate::workload::companies()
                .into_iter()
                .take(4)
                .map(|c| c.symbol)
                .collect(),
            endpoints: 2,
            backfill: 0.15,
            open_per_ticker: 6,
        }
    }
}

/// What a receiver needs to register a stories endpoint.
#[derive(Debug, Clone)]
pub struct StoriesEndpointInfo {
    pub id: Uuid,
    pub api_key: String,
    /// Every secret in `whsec_` form.
    pub secrets: Vec<String>,
    pub tickers: Vec<String>,
    pub url: String,
}

/// What one step did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StoryStep {
    Created {
        story: String,
        origin: Origin,
    },
    Updated {
        story: String,
        origin: Origin,
    },
    BecameStrong {
        story: String,
        origin: Origin,
    },
    Shortlisted {
        story: String,
        article: String,
        origin: Origin,
    },
    Closed {
        story: String,
        origin: Origin,
    },
    Merged {
        from: String,
        into: String,
        origin: Origin,
    },
    Nothing,
}

/// The seeded stories workload.
#[derive(Debug)]
pub struct StoriesWorkload {
    rng: ChaCha8Rng,
    config: StoriesWorkloadConfig,
    tick: u64,
}

impl StoriesWorkload {
    pub fn new(seed: u64, config: StoriesWorkloadConfig) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x5707_1E5B),
            config,
            tick: 0,
        }
    }

    pub fn config(&self) -> &StoriesWorkloadConfig {
        &self.config
    }

    /// Adds the endpoints. `url_template` names the receiver: `{id}` is replaced by the
    /// endpoint's id.
    pub fn setup(&mut self, stories: &mut Stories, url_template: &str) -> Vec<StoriesEndpointInfo> {
        let mut infos = Vec::new();
        for index in 0..self.config.endpoints {
            let mut tickers: Vec<String> = if index == 0 {
                self.config.tickers.clone()
            } else {
                let rng = &mut self.rng;
                self.config
                    .tickers
                    .iter()
                    .filter(|_| rng.gen_bool(0.6))
                    .cloned()
                    .collect()
            };
            if tickers.is_empty() {
                tickers.extend(self.config.tickers.choose(&mut self.rng).cloned());
            }
            let api_key = format!("sk_{:016x}{index:02}", self.rng.gen::<u64>());
            let secret_bytes: [u8; 32] = self.rng.gen();
            let secret = SigningSecret::from_bytes(secret_bytes.to_vec()).expect("32 bytes");
            let id = stories.add_stories_endpoint(StoriesEndpointSpec {
                id: None,
                url: url_template.to_owned(),
                secrets: vec![secret.clone()],
                api_key: api_key.clone(),
                tickers: tickers.iter().cloned().collect(),
            });
            infos.push(StoriesEndpointInfo {
                id,
                api_key,
                secrets: vec![secret.to_whsec()],
                tickers,
                url: stories
                    .stories_endpoint(id)
                    .map(|e| e.url.clone())
                    .unwrap_or_default(),
            });
        }
        infos
    }

    /// Makes one random change.
    pub fn step(&mut self, stories: &mut Stories, now_ms: u64) -> StoryStep {
        self.tick += 1;
        if self.config.tickers.is_empty() {
            return StoryStep::Nothing;
        }
        let origin = if self.rng.gen_bool(self.config.backfill.clamp(0.0, 1.0)) {
            Origin::Backfill
        } else {
            Origin::Live
        };
        let ticker = self.config.tickers[self.rng.gen_range(0..self.config.tickers.len())].clone();
        let open: Vec<(String, bool, bool, Vec<String>)> = stories
            .book()
            .open_stories(Some(&ticker))
            .map(|s| {
                let absorbed = !s.merged_from.is_empty();
                let articles = s.articles.iter().map(|a| a.id.clone()).collect();
                (s.id.clone(), s.strong, absorbed, articles)
            })
            .collect();
        let crowded = open.len() >= self.config.open_per_ticker;
        let roll = self.rng.gen_range(0..100);
        if open.is_empty() || (roll < 22 && !crowded) {
            let headline = format!("{ticker}: story {}", self.tick);
            let story = stories.create_story(&ticker, &headline, origin, now_ms);
            return StoryStep::Created { story, origin };
        }
        let (story, strong, _, articles) = open[self.rng.gen_range(0..open.len())].clone();
        let result = match roll {
            0..=21 | 80..=89 => {
                // A merge, when the ticker has two open stories; a chain when the one merged
                // away had absorbed others.
                if open.len() < 2 {
                    stories
                        .close_story(&story, origin, now_ms)
                        .map(|()| StoryStep::Closed { story, origin })
                } else {
                    let absorbed: Vec<&String> = open
                        .iter()
                        .filter(|(_, _, absorbed, _)| *absorbed)
                        .map(|(id, ..)| id)
                        .collect();
                    let from = if !absorbed.is_empty() && self.rng.gen_bool(0.5) {
                        absorbed[self.rng.gen_range(0..absorbed.len())].clone()
                    } else {
                        story
                    };
                    let others: Vec<&String> = open
                        .iter()
                        .map(|(id, ..)| id)
                        .filter(|id| **id != from)
                        .collect();
                    let into = others[self.rng.gen_range(0..others.len())].clone();
                    stories
                        .merge_stories(&from, &into, origin, now_ms)
                        .map(|()| StoryStep::Merged { from, into, origin })
                }
            }
            22..=51 | 90..=99 => {
                let headline = format!("{ticker}: story {} revised at {}", story, self.tick);
                let add_article = self.rng.gen_bool(0.5);
                stories
                    .update_story(&story, Some(&headline), add_article, origin, now_ms)
                    .map(|()| StoryStep::Updated { story, origin })
            }
            52..=63 if !strong => stories
                .make_strong(&story, origin, now_ms)
                .map(|()| StoryStep::BecameStrong { story, origin }),
            52..=71 if !articles.is_empty() => {
                let article = articles[self.rng.gen_range(0..articles.len())].clone();
                stories
                    .shortlist_article(&story, &article, origin, now_ms)
                    .map(|()| StoryStep::Shortlisted {
                        story,
                        article,
                        origin,
                    })
            }
            _ => stories
                .close_story(&story, origin, now_ms)
                .map(|()| StoryStep::Closed { story, origin }),
        };
        result.unwrap_or(StoryStep::Nothing)
    }
}
