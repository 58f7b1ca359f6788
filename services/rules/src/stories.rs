//! The stories source (seed 000, "Keeping a copy in sync") as pure decisions: which of the seed's
//! two writes an event asks for, what each write does to the one row it touches, which
//! notification an event claims, and a whole run of events planned at once
//! ([`decide_stories_run`] → [`StoriesPlan`]).
//!
//! The seed's point is that no decision here is "check, then write": each write is one statement
//! that checks and writes at once, so the order events arrive in, and applying one twice, do not
//! matter. [`save_wins`] is the save statement's `where`; [`apply_write`] is what either
//! statement leaves in the row; [`StoriesCopy`] executes the same two statements in memory.
//!
//! # How to drive it
//! For each stories endpoint, in one transaction that holds the endpoint (its fence and writer
//! lock):
//! 1. Before the transaction, parse the run's stored events in arrival order (one that does not
//!    parse is `Err(reason)`). In fetch-on-notify mode, read `GET /v1/stories/{id}` for every
//!    story [`stories_of_run`] names and classify each answer ([`StoryRead::from_answer`]): no
//!    lock is held across HTTP, and a read that is slow or stale cannot undo a newer write (the
//!    version check refuses it, a closed row stays closed).
//! 2. Under the lock, read the rows of [`stories_of_run`] (sorted: the order to lock them in).
//! 3. Call [`decide_stories_run`] with the endpoint's registration (whether each claim
//!    notifies, [`decide_notify`]). It calls nothing else and reads no clock.
//! 4. Carry out the [`StoriesPlan`] whole, in its order: each [`PlannedStoryWrite`] as the
//!    seed's statement for it ([`StoryWrite`]), its change (when [`PlannedStoryWrite::change`]
//!    is some) appended to the outbox; then each [`PlannedClaim`] as
//!    `insert into claimed ... on conflict do nothing returning key`, a notification appended
//!    only when a row came back and [`PlannedClaim::notify`] holds. The plan carries all the
//!    statements need (the claims their story's snapshot), so the store carries it out in one
//!    set-based statement however many writes it has (relay-store's
//!    `StoriesWriter::write_plan`), each write still deciding against its row. Under the lock a
//!    write always does what the plan says; one that does not means another writer, and the
//!    transaction must roll back.
//!    Record each of [`StoriesPlan::owed`] as a read owed, in the same transaction.
//! 5. Move the endpoint's apply cursor past the run's events and commit. A read that failed
//!    does not hold the run back: its event is applied for its other effects (its claim uses the
//!    event's own snapshot) and the story is owed a read ([`StoryOutcome::ReadOwed`]), which the
//!    endpoint's sync makes later: its writes, as a reload's batches', are planned by
//!    [`plan_writes`] and carried out as an event's are.
//!
//! [`StoriesCopy::execute`] carries out a plan the same way in memory, so the property tests
//! check the plan production writes.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use relay_wire::{Origin, SnapshotKind, Story, StoryEvent, StoryEventBody};
use serde_json::Value;

use crate::notify::{decide_notify, NotifyDecision};

/// How an endpoint gets the snapshots it saves (seed: "Either way below uses the same two
/// writes. Pick one.").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum StoriesMode {
    /// Apply the snapshot in the event: no API calls.
    #[default]
    Snapshot,
    /// Read each story an event names from the API, and save what it answers.
    FetchOnNotify,
}

impl StoriesMode {
    pub const ALL: [StoriesMode; 2] = [StoriesMode::Snapshot, StoriesMode::FetchOnNotify];

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "snapshot" => Some(StoriesMode::Snapshot),
            "fetch_on_notify" => Some(StoriesMode::FetchOnNotify),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            StoriesMode::Snapshot => "snapshot",
            StoriesMode::FetchOnNotify => "fetch_on_notify",
        }
    }
}

/// What the copy holds of one story (the stories row): the seed's `version` and `closed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeldStory {
    pub version: i64,
    pub closed: bool,
}

/// The seed's two writes.
#[derive(Debug, Clone, PartialEq)]
pub enum StoryWrite {
    /// Save a snapshot: the seed's insert ... `where not stories.closed and stories.version <
    /// excluded.version`.
    Save(Story),
    /// Close a story for good: the seed's insert ... `closed = true, story = null, version =
    /// greatest(stories.version, excluded.version)`.
    ///
    /// `version`: the closing version from story.closed, or 0 when all that is known is a 404.
    /// `merged_into`: the surviving story's id when the close is a merge (for the change
    /// message).
    Close {
        story_id: String,
        version: i64,
        merged_into: Option<String>,
    },
}

impl StoryWrite {
    /// The story whose row the write touches.
    pub fn story_id(&self) -> &str {
        match self {
            StoryWrite::Save(story) => &story.id,
            StoryWrite::Close { story_id, .. } => story_id,
        }
    }
}

/// What a write did to the row: the change the tenant's queue receives, if any.
#[derive(Debug, Clone, PartialEq)]
pub enum StoryChange {
    /// The row now holds this snapshot, open.
    Saved(Story),
    /// The row is now closed, at `version` (the row's version after the write, so that a copy
    /// rebuilt from the changes ends with the relay's version).
    Closed {
        story_id: String,
        version: i64,
        merged_into: Option<String>,
    },
}

impl StoryChange {
    /// The story whose row changed.
    pub fn story_id(&self) -> &str {
        match self {
            StoryChange::Saved(story) => &story.id,
            StoryChange::Closed { story_id, .. } => story_id,
        }
    }

    /// The row's version after the change.
    pub fn version(&self) -> i64 {
        match self {
            StoryChange::Saved(story) => story.version,
            StoryChange::Closed { version, .. } => *version,
        }
    }
}

/// The answer of `GET /v1/stories/{id}`.
#[derive(Debug, Clone, PartialEq)]
pub enum StoryRead {
    /// `200` with the story's snapshot.
    Found(Story),
    /// `404` with `{"error": "not_found"}`: the story is closed (or never existed).
    NotFound,
    /// A load balancer's `404` without that body, a `5xx`, a timeout, an answer that is not the
    /// story asked for: a read that failed.
    Failed,
}

impl StoryRead {
    /// Classifies the answer to `GET /v1/stories/{asked}`: `status` and the body read.
    ///
    /// Seed: "A 404 means closed", and `upstream-api.md`: "A `404` without that body is a load
    /// balancer's: a read that failed." A `200` whose body is not a story, or is another story
    /// than the one asked for, is taken as a failed read too: saving it would write a row the
    /// run did not read, and closing on it would be a guess.
    pub fn from_answer(asked: &str, status: u16, body: &[u8]) -> StoryRead {
        match status {
            200 => match serde_json::from_slice::<Value>(body)
                .ok()
                .and_then(|value| Story::from_value(&value).ok())
            {
                Some(story) if story.id == asked => StoryRead::Found(story),
                _ => StoryRead::Failed,
            },
            404 => match serde_json::from_slice::<Value>(body) {
                Ok(value) if value.get("error").and_then(Value::as_str) == Some("not_found") => {
                    StoryRead::NotFound
                }
                _ => StoryRead::Failed,
            },
            _ => StoryRead::Failed,
        }
    }
}

/// How long an owed story read that failed again waits before it is tried next: `first`
/// doubled for each failure before this one (`attempts` so far), at most `max`, plus a random
/// part of itself (`jitter` in `[0, 1)`, drawn by the caller), as the retry policy's pauses
/// grow; so owed reads failing together are not tried together.
pub fn owed_read_pause(attempts: u32, first: Duration, max: Duration, jitter: f64) -> Duration {
    let ceiling = first.saturating_mul(1u32 << attempts.min(30)).min(max);
    let jitter = if jitter.is_finite() {
        jitter.clamp(0.0, 1.0)
    } else {
        0.0
    };
    ceiling + ceiling.mul_f64(jitter)
}

/// Seed: "Save a snapshot only if it is newer than the row and the row isn't closed": the save
/// statement's `where` (no row, or not closed and held.version < version), checked and written
/// in one step.
///
/// Rules: S-SAVE-NEWER (services/rules/RULES.md).
pub fn save_wins(held: Option<HeldStory>, version: i64) -> bool {
    match held {
        None => true,
        Some(held) => !held.closed && held.version < version,
    }
}

/// What one of the seed's two writes leaves in the row, and the change it makes.
///
/// Seed: "Save a snapshot only if it is newer than the row and the row isn't closed" (a save
/// that loses changes nothing), and "Close a story for good. version is the closing version from
/// story.closed, or 0 when all you know is that the API answered 404" (the row is closed at
/// `greatest(held.version, version)`). A close is a change only when the row was absent or open,
/// or closed at a smaller version: closing a row closed at that version or later writes nothing
/// new, and a queue consumer's copy rebuilt from the changes ends at the relay's version.
///
/// Rules: S-KEEP-ROW, S-SAVE-NEWER, S-CLOSE-FOR-GOOD, S-MERGE-CHAINS, S-RELOAD-KEEPS (see
/// services/rules/RULES.md).
pub fn apply_write(
    held: Option<HeldStory>,
    write: &StoryWrite,
) -> (HeldStory, Option<StoryChange>) {
    match write {
        StoryWrite::Save(story) => match held {
            Some(held) if !save_wins(Some(held), story.version) => (held, None),
            _ => {
                let after = HeldStory {
                    version: story.version,
                    closed: false,
                };
                (after, Some(StoryChange::Saved(story.clone())))
            }
        },
        StoryWrite::Close {
            story_id,
            version,
            merged_into,
        } => {
            let after = HeldStory {
                version: held.map_or(*version, |held| held.version.max(*version)),
                closed: true,
            };
            let changed = match held {
                None => true,
                Some(held) => !held.closed || held.version < *version,
            };
            let change = changed.then(|| StoryChange::Closed {
                story_id: story_id.clone(),
                version: after.version,
                merged_into: merged_into.clone(),
            });
            (after, change)
        }
    }
}

/// Snapshot mode, the seed's `applySnapshot`: "Apply the snapshot in the event. No API calls."
/// story.created, story.updated and story.became_strong save `data.story`; story.closed closes
/// `data.story_id` at `data.version`, then saves `data.merged_into` when there is one. Every
/// other type (article.shortlisted included) writes nothing.
///
/// Rules: S-SNAPSHOT, S-MERGE-CHAINS (services/rules/RULES.md).
pub fn snapshot_writes(event: &StoryEvent) -> Vec<StoryWrite> {
    match &event.body {
        StoryEventBody::Snapshot { story, .. } => vec![StoryWrite::Save(story.clone())],
        StoryEventBody::Closed {
            story_id,
            version,
            merged_into,
        } => {
            let mut writes = vec![StoryWrite::Close {
                story_id: story_id.clone(),
                version: *version,
                merged_into: merged_into.as_ref().map(|story| story.id.clone()),
            }];
            writes.extend(merged_into.iter().cloned().map(StoryWrite::Save));
            writes
        }
        StoryEventBody::ArticleShortlisted { .. } | StoryEventBody::Ignored { .. } => Vec::new(),
    }
}

/// The seed's `storiesOf`: "the story in the event: data.story.id, data.article.story_id for
/// article.shortlisted, and for story.closed both data.story_id and the surviving story". Once
/// each, in that order; nothing for a type the relay does not name.
///
/// Rules: S-FETCH-ON-NOTIFY (services/rules/RULES.md).
pub fn stories_of(event: &StoryEvent) -> Vec<String> {
    let mut ids = Vec::with_capacity(2);
    match &event.body {
        StoryEventBody::Snapshot { story, .. } => ids.push(story.id.clone()),
        StoryEventBody::ArticleShortlisted { story_id } => ids.push(story_id.clone()),
        StoryEventBody::Closed {
            story_id,
            merged_into,
            ..
        } => {
            ids.push(story_id.clone());
            if let Some(survivor) = merged_into {
                if survivor.id != *story_id {
                    ids.push(survivor.id.clone());
                }
            }
        }
        StoryEventBody::Ignored { .. } => {}
    }
    ids
}

/// Every story a run's events name ([`stories_of`]), sorted, once each: the rows to read and
/// lock, and, in fetch-on-notify mode, the stories to read from the API.
pub fn stories_of_run(events: &[Result<StoryEvent, String>]) -> Vec<String> {
    let ids: BTreeSet<String> = events.iter().flatten().flat_map(stories_of).collect();
    ids.into_iter().collect()
}

/// Fetch-on-notify, the seed's `fetchOnNotify`: "Each event means 'these stories changed'; ask
/// the API for their current state. A 404 means closed." The write a read of one of
/// [`stories_of`] asks for: a story found is saved, a 404 closes it at version 0
/// (`closeStory(id, null)`). `Err(id)` when the read failed or was not made; a found story that
/// is not the one asked for is taken as a failed read (see [`StoryRead::from_answer`]).
///
/// Rules: S-FETCH-ON-NOTIFY (services/rules/RULES.md).
pub fn fetched_write(id: String, reads: &HashMap<String, StoryRead>) -> Result<StoryWrite, String> {
    match reads.get(&id) {
        Some(StoryRead::Found(story)) if story.id == id => Ok(StoryWrite::Save(story.clone())),
        Some(StoryRead::NotFound) => Ok(StoryWrite::Close {
            story_id: id,
            version: 0,
            merged_into: None,
        }),
        _ => Err(id),
    }
}

/// What `event` itself says of story `id`, as snapshot mode writes it: its snapshot, or its
/// close. `None` when the event carries no state of the story (article.shortlisted).
fn event_write(event: &StoryEvent, id: &str) -> Option<StoryWrite> {
    snapshot_writes(event)
        .into_iter()
        .find(|write| write.story_id() == id)
}

/// Whether a fetch-on-notify read answered a state older than the event that asked for it: a
/// story found open where the event closed it, or found at a version before the event's. Seed
/// 000: "a slow API response that read the story before it closed". Saving such a read changes
/// nothing (the version check), but the change the event announced would then never be
/// written: the event's own state is written instead.
fn read_is_older(read: &StoryWrite, own: &StoryWrite) -> bool {
    match (read, own) {
        (StoryWrite::Save(_), StoryWrite::Close { .. }) => true,
        (StoryWrite::Save(read), StoryWrite::Save(own)) => read.version < own.version,
        (StoryWrite::Close { .. }, _) => false,
    }
}

/// The notification an event claims. Seed: "Claim them with a single insert: insert into
/// claimed (key) values ('strong:' || $1)", and "Skip notifications for events whose origin is
/// backfill". `Some("strong:<story id>")` for a live story.became_strong; `None` for anything
/// else.
///
/// Rules: S-CLAIM-ONCE, S-NO-BACKFILL-NOTIFY (services/rules/RULES.md).
pub fn notification_claim(event: &StoryEvent) -> Option<String> {
    notified_story(event).map(|story| format!("strong:{}", story.id))
}

/// The story a live story.became_strong is about: the one event that notifies.
fn notified_story(event: &StoryEvent) -> Option<&Story> {
    match (&event.body, event.origin) {
        (
            StoryEventBody::Snapshot {
                kind: SnapshotKind::BecameStrong,
                story,
            },
            Origin::Live,
        ) => Some(story),
        _ => None,
    }
}

/// What [`decide_stories_run`] takes.
#[derive(Debug, Clone, Copy)]
pub struct StoriesRun<'a> {
    pub mode: StoriesMode,
    /// The events in the order they are applied (a stored message that is not a stories event is
    /// `Err(reason)`).
    pub events: &'a [Result<StoryEvent, String>],
    /// What the copy holds of every story the events name, as read under the lock (absent key:
    /// no row).
    pub held: &'a HashMap<String, HeldStory>,
    /// Fetch-on-notify reads, by story id (ignored in snapshot mode).
    pub reads: &'a HashMap<String, StoryRead>,
    /// The endpoint's tickers (`None`: every ticker). A snapshot of a story of another ticker
    /// is not saved, nor is its notification claimed: its ticker was removed from the endpoint,
    /// and its event came late, or from catch-up reading what was published before the removal.
    /// A close is still written: a closed row only keeps the story from coming back.
    pub tickers: Option<&'a [String]>,
    /// When the endpoint was registered, in Unix nanoseconds (`unix_timestamp_nanos` of the
    /// registration's `created_at`, the unit each claim compares its event's `created_at` in):
    /// a claim notifies only as [`decide_notify`] says. `None`: every claim notifies.
    pub registered_at: Option<i128>,
}

impl StoriesRun<'_> {
    fn follows(&self, story: &Story) -> bool {
        match (self.tickers, &story.ticker) {
            (Some(tickers), Some(ticker)) => tickers.contains(ticker),
            _ => true,
        }
    }
}

/// One write of a plan, the change it makes (computed against the row as the plan's earlier
/// writes left it), and the event that asked for it (`None` for a round's write: a reload's
/// batch, an owed read paid).
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedStoryWrite {
    pub write: StoryWrite,
    pub change: Option<StoryChange>,
    pub event_id: Option<String>,
}

/// One notification to claim: `key` into `claimed`, and a notification about `story` only when
/// the insert returned a row and `notify` holds (a claim that does not notify still takes the
/// key, so no later event of the story notifies).
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedClaim {
    pub key: String,
    /// The story as the claiming `story.became_strong` carries it: the notification's content.
    pub story: Story,
    pub event_id: String,
    /// [`decide_notify`] of the event's `created_at` and the endpoint's registration.
    pub notify: bool,
}

/// How one event of a run was taken, kept for support reads and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoryOutcome {
    /// Its writes and claim are in the plan (even when none of them changes anything).
    Applied,
    /// A type the relay does not name.
    Ignored,
    /// Not a stories event: why.
    Malformed(String),
    /// Fetch-on-notify: applied, but the read of this story (the first of the event's that
    /// failed) is owed: the story is in [`StoriesPlan::owed`].
    ReadOwed(String),
}

impl StoryOutcome {
    pub fn as_str(&self) -> &'static str {
        match self {
            StoryOutcome::Applied => "applied",
            StoryOutcome::Ignored => "ignored_type",
            StoryOutcome::Malformed(_) => "malformed",
            StoryOutcome::ReadOwed(_) => "read_owed",
        }
    }

    /// Whether the event's effects are in the plan (an event with a read owed is: what it could
    /// do without the read).
    pub fn applied(&self) -> bool {
        matches!(self, StoryOutcome::Applied | StoryOutcome::ReadOwed(_))
    }

    /// Whether the webhook's outcome is kept in a row of its own: every one but `Applied`,
    /// which the apply cursor passing it already says (as the feed's [`crate::MessagePlan`]).
    pub fn is_exception(&self) -> bool {
        !matches!(self, StoryOutcome::Applied)
    }
}

/// Everything a run writes, in the order to write it (one transaction; see the module doc):
/// 1. [`writes`](Self::writes), in order, each as its statement, its change to the outbox;
/// 2. [`claims`](Self::claims), in event order, a notification for each that returns a row
///    and notifies;
/// 3. [`owed`](Self::owed) recorded as reads owed;
/// 4. the apply cursor moved past every event of the run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StoriesPlan {
    pub writes: Vec<PlannedStoryWrite>,
    /// Once per key in a run (a second insert of a key could never return a row).
    pub claims: Vec<PlannedClaim>,
    /// One per event of the run, in order: a run never stops (a failed read is owed instead).
    pub outcomes: Vec<StoryOutcome>,
    /// Fetch-on-notify: the stories whose read failed (or was not made), sorted, once each: the
    /// reads owed, recorded with the cursor's move. A story also read well in the run is still
    /// owed: the failed read was another event's, and may have been the newer.
    pub owed: Vec<String>,
    /// The rows after the plan: every row read for the run, and every row it writes.
    pub rows: HashMap<String, HeldStory>,
}

impl StoriesPlan {
    /// The changes for the outbox, in order.
    pub fn changes(&self) -> impl Iterator<Item = &StoryChange> {
        self.writes.iter().filter_map(|w| w.change.as_ref())
    }

    /// Adds `write` to the plan: its change is [`apply_write`] against the row as the plan's
    /// earlier writes left it, and the row is then what the write leaves.
    fn push_write(&mut self, write: StoryWrite, event_id: Option<&str>) {
        let id = write.story_id().to_owned();
        let (after, change) = apply_write(self.rows.get(&id).copied(), &write);
        self.rows.insert(id, after);
        self.writes.push(PlannedStoryWrite {
            write,
            change,
            event_id: event_id.map(str::to_owned),
        });
    }
}

/// Plans a round's writes (a reload's batch, owed reads paid) against `held`, the rows as read
/// under the lock, in order, as [`decide_stories_run`] plans an event's: the same two writes,
/// the same [`apply_write`]. The plan has no claims, outcomes or reads owed.
pub fn plan_writes(
    held: &HashMap<String, HeldStory>,
    writes: impl IntoIterator<Item = StoryWrite>,
) -> StoriesPlan {
    let mut plan = StoriesPlan {
        rows: held.clone(),
        ..StoriesPlan::default()
    };
    for write in writes {
        plan.push_write(write, None);
    }
    plan
}

/// Decides a whole run of one endpoint's events (see the module doc for how to drive it).
///
/// Each event is taken in order: its writes are [`snapshot_writes`] or, in fetch-on-notify mode,
/// [`fetched_write`] of each of its stories read before the run (one whose read failed is
/// owed, and its event still claims what it claims); each write's change is
/// [`apply_write`] against the row as the run's earlier writes left it; its claim is
/// [`notification_claim`]. Seed: "With these two writes, applying an event twice changes
/// nothing, and the order events arrive in doesn't matter", so nothing here looks at event ids.
///
/// Rules: S-ORDER-FREE, S-SAME-HANDLER, S-REMOVE-TICKER (services/rules/RULES.md).
pub fn decide_stories_run(run: StoriesRun<'_>) -> StoriesPlan {
    let mut plan = StoriesPlan {
        rows: run.held.clone(),
        ..StoriesPlan::default()
    };
    let mut claimed: HashSet<String> = HashSet::new();
    let mut owed: BTreeSet<String> = BTreeSet::new();
    for event in run.events {
        let event = match event {
            Err(reason) => {
                plan.outcomes.push(StoryOutcome::Malformed(reason.clone()));
                continue;
            }
            Ok(event) => event,
        };
        if let StoryEventBody::Ignored { .. } = event.body {
            plan.outcomes.push(StoryOutcome::Ignored);
            continue;
        }
        let mut outcome = StoryOutcome::Applied;
        let writes = match run.mode {
            StoriesMode::Snapshot => snapshot_writes(event),
            StoriesMode::FetchOnNotify => {
                let mut writes = Vec::new();
                for id in stories_of(event) {
                    let own = event_write(event, &id);
                    match fetched_write(id, run.reads) {
                        Ok(read) => writes.push(match own {
                            Some(own) if read_is_older(&read, &own) => own,
                            _ => read,
                        }),
                        Err(id) => {
                            // What the event itself says is written now; the read, owed, may
                            // bring a newer state later.
                            writes.extend(own);
                            if outcome == StoryOutcome::Applied {
                                outcome = StoryOutcome::ReadOwed(id.clone());
                            }
                            owed.insert(id);
                        }
                    }
                }
                writes
            }
        };
        for write in writes {
            if let StoryWrite::Save(story) = &write {
                if !run.follows(story) {
                    continue;
                }
            }
            plan.push_write(write, Some(&event.event_id));
        }
        if let (Some(key), Some(story)) = (notification_claim(event), notified_story(event)) {
            if run.follows(story) && claimed.insert(key.clone()) {
                let created_at = event.created_at.map(|at| at.unix_timestamp_nanos());
                let notify = match run.registered_at {
                    Some(registered_at) => {
                        decide_notify(created_at, registered_at) == NotifyDecision::Notify
                    }
                    None => true,
                };
                plan.claims.push(PlannedClaim {
                    key,
                    story: story.clone(),
                    event_id: event.event_id.clone(),
                    notify,
                });
            }
        }
        plan.outcomes.push(outcome);
    }
    plan.owed = owed.into_iter().collect();
    plan
}

/// One row of the in-memory copy: the seed's `stories` table.
#[derive(Debug, Clone, PartialEq)]
pub struct CopiedStory {
    pub ticker: Option<String>,
    pub version: i64,
    pub closed: bool,
    /// The snapshot; `None` once closed.
    pub story: Option<Value>,
}

impl CopiedStory {
    pub fn held(&self) -> HeldStory {
        HeldStory {
            version: self.version,
            closed: self.closed,
        }
    }
}

/// Where a plan and the rows it was carried out on disagree: a statement did not do what the
/// plan said, so another writer changed a row the run read (the transaction must roll back).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("write {index} of the plan made {made:?}, the plan said {planned:?}")]
pub struct PlanMismatch {
    pub index: usize,
    pub planned: Option<StoryChange>,
    pub made: Option<StoryChange>,
}

/// A stories copy in memory: the seed's `stories` and `claimed` tables, written by the seed's
/// statements exactly. For the property tests and the relay's own test harness.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StoriesCopy {
    pub rows: BTreeMap<String, CopiedStory>,
    pub claimed: BTreeSet<String>,
}

impl StoriesCopy {
    /// What the copy holds of `id`.
    pub fn held(&self, id: &str) -> Option<HeldStory> {
        self.rows.get(id).map(CopiedStory::held)
    }

    /// What the copy holds of each of `ids` that it has a row for: a run's `held`.
    pub fn held_of<'a>(
        &self,
        ids: impl IntoIterator<Item = &'a str>,
    ) -> HashMap<String, HeldStory> {
        ids.into_iter()
            .filter_map(|id| self.held(id).map(|held| (id.to_owned(), held)))
            .collect()
    }

    /// Carries out one write as the seed's statement, and returns the change it made: what the
    /// statement's `returning` would answer once its update skips a row it leaves as it was.
    ///
    /// ```sql
    /// insert into stories (id, ticker, version, closed, story)
    /// values ($1, $2, $3, false, $4)
    /// on conflict (id) do update
    ///   set ticker = excluded.ticker, version = excluded.version, story = excluded.story
    ///   where not stories.closed and stories.version < excluded.version
    ///
    /// insert into stories (id, version, closed, story)
    /// values ($1, $2, true, null)
    /// on conflict (id) do update
    ///   set closed = true, story = null,
    ///     version = greatest(stories.version, excluded.version)
    /// ```
    pub fn apply(&mut self, write: &StoryWrite) -> Option<StoryChange> {
        let id = write.story_id();
        let before = self.rows.get(id).cloned();
        let after = match (write, before.clone()) {
            (StoryWrite::Save(story), None) => CopiedStory {
                ticker: story.ticker.clone(),
                version: story.version,
                closed: false,
                story: Some(story.snapshot.clone()),
            },
            (StoryWrite::Save(story), Some(row)) => {
                if !row.closed && row.version < story.version {
                    CopiedStory {
                        ticker: story.ticker.clone(),
                        version: story.version,
                        closed: row.closed,
                        story: Some(story.snapshot.clone()),
                    }
                } else {
                    row
                }
            }
            (StoryWrite::Close { version, .. }, None) => CopiedStory {
                ticker: None,
                version: *version,
                closed: true,
                story: None,
            },
            (StoryWrite::Close { version, .. }, Some(row)) => CopiedStory {
                ticker: row.ticker,
                version: row.version.max(*version),
                closed: true,
                story: None,
            },
        };
        if before.as_ref() == Some(&after) {
            return None;
        }
        let change = match write {
            StoryWrite::Save(story) => StoryChange::Saved(story.clone()),
            StoryWrite::Close {
                story_id,
                merged_into,
                ..
            } => StoryChange::Closed {
                story_id: story_id.clone(),
                version: after.version,
                merged_into: merged_into.clone(),
            },
        };
        self.rows.insert(id.to_owned(), after);
        Some(change)
    }

    /// The seed's claim: `insert into claimed (key) values ($1) on conflict do nothing returning
    /// key`. True when a row came back (notify).
    pub fn claim(&mut self, key: &str) -> bool {
        self.claimed.insert(key.to_owned())
    }

    /// What a queue consumer does to rebuild the copy from the changes: a saved story is its row,
    /// open; a closed one is closed at the change's version, without a snapshot, keeping the
    /// ticker it had (none, for a story it never saw).
    pub fn apply_change(&mut self, change: &StoryChange) {
        match change {
            StoryChange::Saved(story) => {
                self.rows.insert(
                    story.id.clone(),
                    CopiedStory {
                        ticker: story.ticker.clone(),
                        version: story.version,
                        closed: false,
                        story: Some(story.snapshot.clone()),
                    },
                );
            }
            StoryChange::Closed {
                story_id, version, ..
            } => {
                let ticker = self.rows.remove(story_id).and_then(|row| row.ticker);
                self.rows.insert(
                    story_id.clone(),
                    CopiedStory {
                        ticker,
                        version: *version,
                        closed: true,
                        story: None,
                    },
                );
            }
        }
    }

    /// Carries out a plan as the sequencer does (module doc, step 4): each write as its
    /// statement, checking it made the planned change, then each claim. Returns the claims that
    /// came back: the notifications to send are those of them that notify. On a mismatch the
    /// copy is left part written, as a transaction before its rollback.
    pub fn execute(&mut self, plan: &StoriesPlan) -> Result<Vec<PlannedClaim>, Box<PlanMismatch>> {
        for (index, planned) in plan.writes.iter().enumerate() {
            let made = self.apply(&planned.write);
            if made != planned.change {
                return Err(Box::new(PlanMismatch {
                    index,
                    planned: planned.change.clone(),
                    made,
                }));
            }
        }
        Ok(plan
            .claims
            .iter()
            .filter(|claim| self.claim(&claim.key))
            .cloned()
            .collect())
    }
}
