//! A seeded random workload: tenants (keys) and their endpoints, then a stream of item creations,
//! updates, hides and withdrawals, and now and then an access change. The same seed gives the
//! same setup and the same stream of changes.

use std::collections::BTreeMap;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use relay_wire::{ItemKind, SigningSecret};
use uuid::Uuid;

use crate::model::{Access, ChangeKind, Company, Filter, PartKind, UnixMs};
use crate::upstream::{EndpointSpec, Upstream};

/// The feed's virtual start: the wire file's example day.
pub const START_MS: UnixMs = 1_791_439_200_000;

/// What a receiver needs to register an endpoint.
#[derive(Debug, Clone)]
pub struct EndpointInfo {
    pub id: Uuid,
    pub key_token: String,
    /// Every secret in `whsec_` form.
    pub secrets: Vec<String>,
    pub lang: String,
    pub url: String,
}

/// What one step of the workload did (as JSON: `{"created": subject}`, `{"changed": [subject,
/// kind]}`, `{"access_changed": {...}}`, `"nothing"`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    Created(String),
    Changed(String, ChangeKind),
    AccessChanged { key: String, company_id: i64 },
    Nothing,
}

/// The workload's knobs.
#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    pub endpoints: usize,
    /// Tenants; endpoints are spread over them round-robin.
    pub keys: usize,
    pub langs: Vec<String>,
    /// Chance that one step changes a key's access (a reset of its endpoints follows).
    pub access_change: f64,
    /// Chance that an update is sent as a refetch.
    pub refetch: f64,
    /// Give endpoints random filters; otherwise every endpoint selects everything.
    pub random_filters: bool,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            endpoints: 3,
            keys: 2,
            langs: vec!["en".into(), "sv".into()],
            access_change: 0.01,
            refetch: 0.1,
            random_filters: true,
        }
    }
}

/// The company list every run uses.
pub fn companies() -> Vec<Company> {
    let rows: [(i64, &str, &str, &str, &str); 9] = [
        (28, "Alfa Group AB", "Alfa Group", "ALFA B", "XSTO"),
        (31, "Beta Industrier AB", "Beta", "BETA", "XSTO"),
        (44, "Gamma Tech AB", "Gamma", "GAM", "XSTO"),
        (52, "Delta Oyj", "Delta", "DELTA", "XHEL"),
        (57, "Epsilon Oyj", "Epsilon", "EPS1V", "XHEL"),
        (63, "Zeta A/S", "Zeta", "ZETA", "XCSE"),
        (71, "Eta Holding A/S", "Eta", "ETA B", "XCSE"),
        (80, "Theta Energy AB", "Theta", "THETA", "XSTO"),
        (92, "Iota Pharma Oyj", "Iota", "IOTA", "XHEL"),
    ];
    rows.iter()
        .map(|(id, name, short, symbol, mic)| Company {
            company_id: *id,
            name: (*name).into(),
            short_name: (*short).into(),
            symbol: (*symbol).into(),
            mic: (*mic).into(),
        })
        .collect()
}

/// The seeded workload.
#[derive(Debug)]
pub struct Workload {
    rng: ChaCha8Rng,
    config: WorkloadConfig,
    tick: u64,
    keys: Vec<String>,
}

impl Workload {
    pub fn new(seed: u64, config: WorkloadConfig) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
            config,
            tick: 0,
            keys: Vec::new(),
        }
    }

    /// Adds the companies, the keys and the endpoints. `url_template` names the receiver:
    /// `{id}` is replaced by the endpoint's id (e.g. `http://127.0.0.1:8080/webhooks/{id}`).
    pub fn setup(
        &mut self,
        upstream: &mut Upstream,
        url_template: &str,
        now_ms: u64,
    ) -> Vec<EndpointInfo> {
        let companies = companies();
        for company in &companies {
            upstream.world.add_company(company.clone());
        }
        for index in 0..self.config.keys.max(1) {
            let token = format!("qk_{:016x}{index:02}", self.rng.gen::<u64>());
            let mut access = BTreeMap::new();
            for company in &companies {
                match self.rng.gen_range(0..10) {
                    0 => {}
                    1 | 2 => {
                        access.insert(company.company_id, Access::Teaser);
                    }
                    _ => {
                        access.insert(company.company_id, Access::Full);
                    }
                }
            }
            upstream.world.add_key(&token, access);
            self.keys.push(token);
        }
        let mut infos = Vec::new();
        for index in 0..self.config.endpoints {
            let key_token = self.keys[index % self.keys.len()].clone();
            let lang = self
                .config
                .langs
                .choose(&mut self.rng)
                .cloned()
                .unwrap_or_else(|| "en".into());
            let filter = if self.config.random_filters {
                self.random_filter(&companies)
            } else {
                Filter::default()
            };
            let secret_bytes: [u8; 32] = self.rng.gen();
            let secret = SigningSecret::from_bytes(secret_bytes.to_vec()).expect("32 bytes");
            let id = upstream.add_endpoint(
                EndpointSpec {
                    key_token: key_token.clone(),
                    lang: lang.clone(),
                    filter,
                    url: url_template.to_owned(),
                    secrets: vec![secret.clone()],
                    id: None,
                    initial_reset: true,
                },
                now_ms,
            );
            infos.push(EndpointInfo {
                id,
                key_token,
                secrets: vec![secret.to_whsec()],
                lang,
                url: upstream
                    .endpoint(id)
                    .map(|e| e.url.clone())
                    .unwrap_or_default(),
            });
        }
        infos
    }

    fn random_filter(&mut self, companies: &[Company]) -> Filter {
        let rng = &mut self.rng;
        let companies_filter = rng.gen_bool(0.3).then(|| {
            let mut chosen: Vec<i64> = companies
                .iter()
                .filter(|_| rng.gen_bool(0.5))
                .map(|c| c.company_id)
                .collect();
            if chosen.is_empty() {
                chosen.push(companies[0].company_id);
            }
            chosen
        });
        let markets = rng.gen_bool(0.2).then(|| {
            let all = ["XSTO", "XHEL", "XCSE"];
            vec![all[rng.gen_range(0..all.len())].to_owned()]
        });
        let teasers = match rng.gen_range(0..4) {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        };
        let event_types = rng.gen_bool(0.25).then(|| {
            ["updated", "withdrawn", "hidden"]
                .iter()
                .map(|a| format!("announcement.{a}"))
                .collect()
        });
        Filter {
            companies: companies_filter,
            markets,
            part_kinds: None,
            teasers,
            event_types,
        }
    }

    pub fn keys(&self) -> &[String] {
        &self.keys
    }

    /// The virtual time of the current tick, for item timestamps.
    pub fn at_ms(&self) -> UnixMs {
        START_MS + self.tick as i64 * 1_000
    }

    /// Makes one random change.
    pub fn step(&mut self, upstream: &mut Upstream, now_ms: u64) -> Step {
        self.tick += 1;
        let at_ms = self.at_ms();
        if !self.keys.is_empty() && self.rng.gen_bool(self.config.access_change.clamp(0.0, 1.0)) {
            let key = self.keys[self.rng.gen_range(0..self.keys.len())].clone();
            let companies: Vec<i64> = upstream.world.companies.keys().copied().collect();
            let company_id = companies[self.rng.gen_range(0..companies.len())];
            let access = match self.rng.gen_range(0..3) {
                0 => None,
                1 => Some(Access::Teaser),
                _ => Some(Access::Full),
            };
            if upstream
                .set_access(&key, company_id, access, now_ms)
                .is_ok()
            {
                return Step::AccessChanged { key, company_id };
            }
        }
        let live: Vec<(String, bool)> = upstream
            .world
            .items
            .values()
            .filter(|item| item.is_live())
            .map(|item| {
                let has_story = item.parts.iter().any(|p| p.kind == PartKind::Story);
                (item.feed_item_id(), has_story)
            })
            .collect();
        let roll = self.rng.gen_range(0..100);
        if live.is_empty() || roll < 30 {
            let companies: Vec<i64> = upstream.world.companies.keys().copied().collect();
            let company_id = companies[self.rng.gen_range(0..companies.len())];
            let kind = if self.rng.gen_bool(0.8) {
                ItemKind::Announcement
            } else {
                ItemKind::PreEarningsAnalysis
            };
            let title = format!("Update {} from company {company_id}", self.tick);
            return match upstream.create_item(kind, company_id, &title, at_ms) {
                Ok(change) => Step::Created(change.feed_item_id),
                Err(_) => Step::Nothing,
            };
        }
        let (feed_item_id, has_story) = live[self.rng.gen_range(0..live.len())].clone();
        let kind = match roll {
            30..=44 => ChangeKind::FlashAdded,
            45..=54 => ChangeKind::FlashReplaced,
            55..=69 if has_story => ChangeKind::StoryRevised,
            55..=69 => ChangeKind::StoryAdded,
            70..=79 if has_story => ChangeKind::Corrected,
            70..=79 => ChangeKind::StoryAdded,
            80..=91 => ChangeKind::StoryAdded,
            92..=96 => ChangeKind::Hidden,
            _ => ChangeKind::Withdrawn,
        };
        let as_refetch = self.rng.gen_bool(self.config.refetch.clamp(0.0, 1.0));
        let headline = format!("Headline {}", self.tick);
        match upstream.change_item(&feed_item_id, kind, &headline, at_ms, as_refetch) {
            Ok(_) => Step::Changed(feed_item_id, kind),
            Err(_) => Step::Nothing,
        }
    }
}
