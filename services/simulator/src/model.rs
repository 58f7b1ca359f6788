//! The truth model: companies, feed items and their parts, API keys and their access, webhook
//! endpoints and their filters, and the log of changes.
//!
//! Pure: no IO and no clock. Every change takes the time it happens at (`at_ms`, Unix
//! milliseconds) as a value, so a run driven by a virtual clock is reproducible.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use relay_wire::{Cursor, ItemKind, Sequence, SigningSecret};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// Unix time in milliseconds.
pub type UnixMs = i64;

/// A listed company. Its market (MIC) is what an endpoint's `markets` filter selects by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Company {
    pub company_id: i64,
    pub name: String,
    pub short_name: String,
    pub symbol: String,
    /// Market identifier code: `XSTO`, `XHEL`, `XCSE`, ...
    pub mic: String,
}

impl Company {
    /// The exchange's short name as the upstream writes it (`XSTO` → `STO`).
    pub fn listed_exchange(&self) -> String {
        self.mic.trim_start_matches('X').to_owned()
    }

    /// A stable numeric id for the market, as the upstream's `market_exchange_id`.
    pub fn market_exchange_id(&self) -> i64 {
        match self.mic.as_str() {
            "XSTO" => 1,
            "XHEL" => 2,
            "XCSE" => 3,
            "XOSL" => 4,
            "XICE" => 5,
            _ => 99,
        }
    }
}

/// The two kinds of part an item is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartKind {
    Flash,
    Story,
}

impl PartKind {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "flash" => Some(PartKind::Flash),
            "story" => Some(PartKind::Story),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PartKind::Flash => "flash",
            PartKind::Story => "story",
        }
    }
}

/// One part of an item: a flash (`flash:N`) or a story (`story:N`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub kind: PartKind,
    /// The N of `flash:N` / `story:N`.
    pub number: u64,
    /// Rises every time the part changes; a receiver compares parts by (part_id, part_version).
    pub part_version: i64,
    pub created_at_ms: UnixMs,
    /// The English headline; other languages are rendered from it.
    pub headline: String,
    pub sentiment: i64,
    /// Stories only: how many versions were published, and when the latest was.
    pub version: u64,
    pub version_published_at_ms: UnixMs,
    pub corrected: bool,
}

impl Part {
    pub fn part_id(&self) -> String {
        format!("{}:{}", self.kind.as_str(), self.number)
    }
}

/// Whether an item can be read. Hidden and withdrawn items are final in this model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ItemState {
    Live,
    Hidden,
    Withdrawn,
}

/// A feed item as the upstream holds it (not yet rendered for a language or a key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub kind: ItemKind,
    /// The N of `announcement:N`.
    pub number: u64,
    pub company_id: i64,
    pub title: String,
    pub first_seq: u64,
    pub seq: u64,
    /// The feed's epoch when `seq` was assigned.
    pub epoch: u64,
    pub state: ItemState,
    pub parts: Vec<Part>,
    pub superseded_parts: Vec<String>,
    pub published_at_ms: UnixMs,
    pub corrected_at_ms: Option<UnixMs>,
}

impl Item {
    pub fn feed_item_id(&self) -> String {
        format!("{}:{}", self.kind.as_str(), self.number)
    }

    pub fn sequence(&self) -> Sequence {
        Sequence::from_parts(self.epoch, self.seq)
    }

    pub fn is_live(&self) -> bool {
        self.state == ItemState::Live
    }
}

/// How much of a company's items a key may read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    /// Items rendered whole.
    Full,
    /// Items rendered as teasers (no story text, no link); an endpoint whose filter says
    /// `teasers: false` does not get them at all.
    Teaser,
}

impl Access {
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Full => "full",
            Access::Teaser => "teaser",
        }
    }
}

/// An API key: the bearer token, and the companies it may read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    /// The bearer token itself.
    pub token: String,
    /// Companies absent here are not readable at all.
    pub access: BTreeMap<i64, Access>,
    /// Counts access changes, so that access_version changes even when access returns to an
    /// earlier state (a receiver must then still reload).
    pub revision: u64,
}

impl Key {
    /// Eight hex digits naming this key's access as it is now.
    pub fn access_version(&self) -> String {
        let mut hash = Sha256::new();
        hash.update(self.token.as_bytes());
        hash.update(self.revision.to_be_bytes());
        for (company, access) in &self.access {
            hash.update(company.to_be_bytes());
            hash.update(access.as_str().as_bytes());
        }
        hex::encode(&hash.finalize()[..4])
    }
}

/// An endpoint's filter as the API shows it. `None` means no restriction.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Filter {
    pub companies: Option<Vec<i64>>,
    pub markets: Option<Vec<String>>,
    pub part_kinds: Option<Vec<String>>,
    pub teasers: Option<bool>,
    pub event_types: Option<Vec<String>>,
}

impl Filter {
    /// Whether an event of this type is sent to the endpoint at all.
    pub fn sends_event_type(&self, event_type: &str) -> bool {
        self.event_types
            .as_ref()
            .is_none_or(|types| types.iter().any(|t| t == event_type))
    }

    /// The item kinds the filter's event_types name (`None`: all).
    pub fn item_kinds(&self) -> Option<BTreeSet<ItemKind>> {
        self.event_types.as_ref().map(|types| {
            types
                .iter()
                .filter_map(|t| t.split_once('.'))
                .filter_map(|(kind, _)| ItemKind::parse(kind))
                .collect()
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndpointStatus {
    Active,
    /// After a 410: nothing is sent until it is resumed.
    Paused,
}

/// A webhook endpoint: where messages go, whose key it belongs to and what it selects.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub id: Uuid,
    pub key_token: String,
    pub lang: String,
    pub filter: Filter,
    pub status: EndpointStatus,
    /// Every secret that signs now; several during a rotation, newest last.
    pub secrets: Vec<SigningSecret>,
    /// Where messages are POSTed.
    pub url: String,
}

/// What an API read or an endpoint selects: the feed's query parameters, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    pub lang: String,
    pub companies: Option<BTreeSet<i64>>,
    pub markets: Option<BTreeSet<String>>,
    pub part_kinds: Option<BTreeSet<PartKind>>,
    pub teasers: Option<bool>,
    pub item_kinds: Option<BTreeSet<ItemKind>>,
}

impl Selection {
    /// Everything, in one language.
    pub fn all(lang: &str) -> Self {
        Self {
            lang: lang.to_owned(),
            ..Self::default()
        }
    }

    /// The selection the wire file's reload rule reads for an endpoint.
    pub fn for_endpoint(endpoint: &Endpoint) -> Self {
        let filter = &endpoint.filter;
        Self {
            lang: endpoint.lang.clone(),
            companies: filter
                .companies
                .as_ref()
                .map(|c| c.iter().copied().collect()),
            markets: filter.markets.as_ref().map(|m| m.iter().cloned().collect()),
            part_kinds: filter
                .part_kinds
                .as_ref()
                .map(|k| k.iter().filter_map(|k| PartKind::parse(k)).collect()),
            teasers: filter.teasers,
            item_kinds: filter.item_kinds(),
        }
    }

    /// The access under which `key` sees `item` through this selection, or `None` when the item
    /// is not selected. Liveness is not considered here (see [`World::visible`]).
    pub fn selects(&self, key: &Key, company: &Company, item: &Item) -> Option<Access> {
        let access = *key.access.get(&item.company_id)?;
        if access == Access::Teaser && self.teasers == Some(false) {
            return None;
        }
        if let Some(companies) = &self.companies {
            if !companies.contains(&item.company_id) {
                return None;
            }
        }
        if let Some(markets) = &self.markets {
            if !markets.contains(&company.mic) {
                return None;
            }
        }
        if let Some(kinds) = &self.item_kinds {
            if !kinds.contains(&item.kind) {
                return None;
            }
        }
        if let Some(part_kinds) = &self.part_kinds {
            // An item with no part of a selected kind has nothing to show.
            if !item.parts.iter().any(|p| part_kinds.contains(&p.kind)) {
                return None;
            }
        }
        Some(access)
    }
}

/// What one change did to an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    Created,
    /// A new flash was added.
    FlashAdded,
    /// A flash replaced an earlier one, which becomes a superseded part.
    FlashReplaced,
    /// A story was added.
    StoryAdded,
    /// A story's new version (part_version rises).
    StoryRevised,
    /// A correction of a story: flags.corrected and corrected_at are set.
    Corrected,
    Hidden,
    Withdrawn,
}

impl ChangeKind {
    pub fn is_removal(self) -> bool {
        matches!(self, ChangeKind::Hidden | ChangeKind::Withdrawn)
    }
}

/// One change in the feed's log: the item before and after it.
#[derive(Debug, Clone)]
pub struct Change {
    pub epoch: u64,
    pub seq: u64,
    pub kind: ChangeKind,
    pub feed_item_id: String,
    pub before: Option<Arc<Item>>,
    pub after: Arc<Item>,
    /// Sent as a refetch (`data.type = "refetch"`) instead of carrying the item.
    pub as_refetch: bool,
}

impl Change {
    pub fn position(&self) -> Cursor {
        Cursor {
            epoch: self.epoch,
            seq: self.seq,
        }
    }
}

/// Why a change to the model was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("no company {0}")]
    UnknownCompany(i64),
    #[error("no item {0}")]
    UnknownItem(String),
    #[error("item {0} is hidden or withdrawn and changes no more")]
    ItemGone(String),
    #[error("item {item} has no {kind} part to change")]
    NoSuchPart { item: String, kind: &'static str },
    #[error("no key {0}")]
    UnknownKey(String),
}

/// What the feed holds now: companies, items and keys. Cheap to clone (items are shared), so
/// the API can keep stale snapshots.
#[derive(Debug, Clone)]
pub struct World {
    pub epoch: u64,
    /// The last seq assigned (the feed's head).
    pub seq: u64,
    pub companies: BTreeMap<i64, Company>,
    pub items: BTreeMap<String, Arc<Item>>,
    pub keys: BTreeMap<String, Key>,
    next_item_number: u64,
    next_part_number: u64,
}

impl Default for World {
    fn default() -> Self {
        Self::new(1, 1000)
    }
}

impl World {
    /// An empty feed at `epoch` whose first change will get `start_seq + 1`.
    pub fn new(epoch: u64, start_seq: u64) -> Self {
        Self {
            epoch,
            seq: start_seq,
            companies: BTreeMap::new(),
            items: BTreeMap::new(),
            keys: BTreeMap::new(),
            next_item_number: 88_000,
            next_part_number: 10,
        }
    }

    pub fn head(&self) -> Cursor {
        Cursor {
            epoch: self.epoch,
            seq: self.seq,
        }
    }

    pub fn add_company(&mut self, company: Company) {
        self.companies.insert(company.company_id, company);
    }

    pub fn add_key(&mut self, token: &str, access: BTreeMap<i64, Access>) {
        self.keys.insert(
            token.to_owned(),
            Key {
                token: token.to_owned(),
                access,
                revision: 0,
            },
        );
    }

    /// Sets (or, with `None`, removes) a key's access to one company. Returns the new
    /// access_version. The caller resets the key's endpoints (see `Upstream::set_access`).
    pub fn set_access(
        &mut self,
        token: &str,
        company_id: i64,
        access: Option<Access>,
    ) -> Result<String, ModelError> {
        let key = self
            .keys
            .get_mut(token)
            .ok_or_else(|| ModelError::UnknownKey(token.to_owned()))?;
        match access {
            Some(a) => key.access.insert(company_id, a),
            None => key.access.remove(&company_id),
        };
        key.revision += 1;
        Ok(key.access_version())
    }

    /// Whether `key` sees `item` through `selection` now, and under which access.
    pub fn visible(&self, key: &Key, selection: &Selection, item: &Item) -> Option<Access> {
        if !item.is_live() {
            return None;
        }
        let company = self.companies.get(&item.company_id)?;
        selection.selects(key, company, item)
    }

    fn next_position(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Publishes a new item with one main flash.
    pub fn create_item(
        &mut self,
        kind: ItemKind,
        company_id: i64,
        title: &str,
        at_ms: UnixMs,
    ) -> Result<Change, ModelError> {
        if !self.companies.contains_key(&company_id) {
            return Err(ModelError::UnknownCompany(company_id));
        }
        let seq = self.next_position();
        self.next_item_number += 1;
        let flash = Part {
            kind: PartKind::Flash,
            number: self.take_part_number(),
            part_version: at_ms * 1000,
            created_at_ms: at_ms,
            headline: title.to_owned(),
            sentiment: 3,
            version: 1,
            version_published_at_ms: at_ms,
            corrected: false,
        };
        let item = Item {
            kind,
            number: self.next_item_number,
            company_id,
            title: title.to_owned(),
            first_seq: seq,
            seq,
            epoch: self.epoch,
            state: ItemState::Live,
            parts: vec![flash],
            superseded_parts: Vec::new(),
            published_at_ms: at_ms,
            corrected_at_ms: None,
        };
        Ok(self.record(None, item, ChangeKind::Created))
    }

    /// Changes an item's parts (any kind but `Created`, `Hidden` and `Withdrawn`) or removes it
    /// (`Hidden`, `Withdrawn`).
    pub fn change_item(
        &mut self,
        feed_item_id: &str,
        kind: ChangeKind,
        headline: &str,
        at_ms: UnixMs,
    ) -> Result<Change, ModelError> {
        let before = self
            .items
            .get(feed_item_id)
            .cloned()
            .ok_or_else(|| ModelError::UnknownItem(feed_item_id.to_owned()))?;
        if !before.is_live() {
            return Err(ModelError::ItemGone(feed_item_id.to_owned()));
        }
        let mut item = (*before).clone();
        let at_us = at_ms * 1000;
        match kind {
            ChangeKind::Created => {}
            ChangeKind::Hidden => item.state = ItemState::Hidden,
            ChangeKind::Withdrawn => item.state = ItemState::Withdrawn,
            ChangeKind::FlashAdded | ChangeKind::FlashReplaced => {
                let number = self.take_part_number();
                let flash = Part {
                    kind: PartKind::Flash,
                    number,
                    part_version: at_us,
                    created_at_ms: at_ms,
                    headline: headline.to_owned(),
                    sentiment: 3,
                    version: 1,
                    version_published_at_ms: at_ms,
                    corrected: false,
                };
                if kind == ChangeKind::FlashReplaced {
                    let old = item
                        .parts
                        .iter()
                        .position(|p| p.kind == PartKind::Flash)
                        .ok_or_else(|| ModelError::NoSuchPart {
                            item: feed_item_id.to_owned(),
                            kind: "flash",
                        })?;
                    let old = item.parts.remove(old);
                    item.superseded_parts.push(old.part_id());
                }
                item.parts.push(flash);
            }
            ChangeKind::StoryAdded => {
                let number = self.take_part_number();
                item.parts.push(Part {
                    kind: PartKind::Story,
                    number,
                    part_version: 1,
                    created_at_ms: at_ms,
                    headline: headline.to_owned(),
                    sentiment: 3,
                    version: 1,
                    version_published_at_ms: at_ms,
                    corrected: false,
                });
            }
            ChangeKind::StoryRevised | ChangeKind::Corrected => {
                let story = item
                    .parts
                    .iter_mut()
                    .find(|p| p.kind == PartKind::Story)
                    .ok_or_else(|| ModelError::NoSuchPart {
                        item: feed_item_id.to_owned(),
                        kind: "story",
                    })?;
                story.part_version += 1;
                story.version += 1;
                story.version_published_at_ms = at_ms;
                story.headline = headline.to_owned();
                if kind == ChangeKind::Corrected {
                    story.corrected = true;
                    item.corrected_at_ms = Some(at_ms);
                }
            }
        }
        item.seq = self.next_position();
        item.epoch = self.epoch;
        Ok(self.record(Some(before), item, kind))
    }

    fn take_part_number(&mut self) -> u64 {
        self.next_part_number += 1;
        self.next_part_number
    }

    fn record(&mut self, before: Option<Arc<Item>>, item: Item, kind: ChangeKind) -> Change {
        let after = Arc::new(item);
        let feed_item_id = after.feed_item_id();
        self.items.insert(feed_item_id.clone(), after.clone());
        Change {
            epoch: self.epoch,
            seq: after.seq,
            kind,
            feed_item_id,
            before,
            after,
            as_refetch: false,
        }
    }

    /// The items `key` reads through `selection` now, in the feed's stable order (by first_seq).
    pub fn feed(&self, key: &Key, selection: &Selection) -> Vec<(Arc<Item>, Access)> {
        let mut items: Vec<(Arc<Item>, Access)> = self
            .items
            .values()
            .filter_map(|item| {
                self.visible(key, selection, item)
                    .map(|access| (item.clone(), access))
            })
            .collect();
        items.sort_by_key(|(item, _)| item.first_seq);
        items
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world() -> World {
        let mut w = World::new(1, 1000);
        w.add_company(Company {
            company_id: 28,
            name: "Alfa Group AB".into(),
            short_name: "Alfa Group".into(),
            symbol: "ALFA B".into(),
            mic: "XSTO".into(),
        });
        w.add_key("k", BTreeMap::from([(28, Access::Full)]));
        w
    }

    #[test]
    fn changes_raise_seq_and_part_versions() {
        let mut w = world();
        let c = w
            .create_item(ItemKind::Announcement, 28, "Alfa wins", 1_000)
            .unwrap();
        assert_eq!((c.seq, c.after.first_seq), (1001, 1001));
        let id = c.feed_item_id.clone();
        w.change_item(&id, ChangeKind::StoryAdded, "story", 2_000)
            .unwrap();
        let c = w
            .change_item(&id, ChangeKind::Corrected, "fixed", 3_000)
            .unwrap();
        let story = c.after.parts.iter().find(|p| p.kind == PartKind::Story);
        assert_eq!(story.unwrap().part_version, 2);
        let c = w
            .change_item(&id, ChangeKind::FlashReplaced, "new flash", 4_000)
            .unwrap();
        assert_eq!(c.after.superseded_parts.len(), 1);
        assert_eq!(c.seq, 1004);
        w.change_item(&id, ChangeKind::Hidden, "", 5_000).unwrap();
        assert_eq!(
            w.change_item(&id, ChangeKind::StoryRevised, "x", 6_000)
                .unwrap_err(),
            ModelError::ItemGone(id)
        );
    }

    #[test]
    fn access_version_changes_with_every_access_change() {
        let mut w = world();
        let first = w.keys["k"].access_version();
        let second = w.set_access("k", 28, Some(Access::Teaser)).unwrap();
        let third = w.set_access("k", 28, Some(Access::Full)).unwrap();
        assert_eq!(first.len(), 8);
        assert_ne!(first, second);
        assert_ne!(first, third);
    }
}
