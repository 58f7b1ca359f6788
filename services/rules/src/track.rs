//! Whole messages, per endpoint and track: generations, access versions, resets and reloads.
//!
//! [`EndpointTrack`] is one row per endpoint and track; [`step`] is the pure transition the
//! sequencer runs for each stored message, in the order received, under that row's lock, writing
//! the new row in the same transaction as the message's event decisions.

use relay_wire::{EventBody, Message, ResetData, Track};
use serde::{Deserialize, Serialize};

use crate::quarantine::{quarantine, Unapplicable};

/// What the copy keeps of one endpoint's track.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointTrack {
    /// The newest generation of a message applied (`None` before the first).
    pub generation: Option<u64>,
    /// The access_version the copy is held under: that of the message that began its reload.
    pub access_version: Option<String>,
    /// The reload begun and not yet merged, if any: kept with the copy, begun again after a
    /// restart.
    pub reload: Option<Reload>,
    /// The `through` of the last message of events applied: where a rewind restarts the track
    /// after the copy is restored from a backup.
    pub through: Option<String>,
    /// True when the last message the copy took was a reset: restoring then means reloading.
    pub last_was_reset: bool,
    /// The generation of the last reset taken.
    pub last_reset_generation: Option<u64>,
    /// How many reloads were begun on this track: each reload is numbered by it ([`Reload::round`]),
    /// and each row the copy writes keeps the number current when it was written, so that a
    /// reload under the generation the copy already holds can tell the rows written before it
    /// began from those written while it read (rule R-MERGE-SAME-GENERATION in RULES.md).
    #[serde(default)]
    pub reloads_begun: u64,
}

/// A reload: read every page of `/v1/feed`, then merge it under `generation`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reload {
    pub generation: u64,
    /// The access_version the pages must carry: the beginning message's. `None` when no message
    /// began it (a refetch's or a rewind's answer, a restore): the pages' agreed one is taken.
    pub access_version: Option<String>,
    pub cause: ReloadCause,
    /// How many times "read /v1/feed again" was asked while this reload ran. A pass that began
    /// before the latest ask is still merged (its items are no worse than what is held), but
    /// the reload then reads another pass: only a pass begun after the ask can hold the change
    /// that asked for it. The pass being read is never thrown away for it, so a run of failing
    /// refetches cannot keep a large reload from ever merging.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read_again: u32,
    /// The track's [`EndpointTrack::reloads_begun`] when this reload began.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub round: u64,
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

impl Reload {
    /// Whether `other` is this reload, however often "read /v1/feed again" was asked of it since.
    pub fn is(&self, other: &Reload) -> bool {
        self.generation == other.generation
            && self.access_version == other.access_version
            && self.cause == other.cause
            && self.round == other.round
    }

    /// The generation the read merges under (rule "Then merge the read into the copy under the
    /// reset's generation"): the beginning message's. A reload no message began ("read /v1/feed
    /// again") has no such message: it merges under the generation the upstream's endpoint read
    /// gives for the track when that is newer than the held one (after a restore from backup,
    /// the upstream may be generations ahead of the copy), so that everything held from before
    /// it is dropped.
    pub fn merge_generation(&self, upstream_generation: Option<u64>) -> u64 {
        match self.cause {
            ReloadCause::ReadAgain => self.generation.max(upstream_generation.unwrap_or(0)),
            _ => self.generation,
        }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What began a reload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReloadCause {
    /// A `webhook_endpoint.reset`, whatever its reason (kept for logs only).
    Reset { reason: String },
    /// A message of events under another access_version than the copy's.
    AccessVersion,
    /// A rule that says "read /v1/feed again" with no message: a refetch's answer, a rewind's
    /// refusal, a restore after a reset.
    ReadAgain,
}

/// A reload begun, and the one it replaces if one was running; or the running one asked to read
/// another pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadStart {
    Begin(Reload),
    Supersede {
        stopped: Reload,
        begun: Reload,
    },
    /// "Read /v1/feed again" while a reload no message superseded was running: it reads another
    /// pass once its current one is merged (see [`Reload::read_again`]).
    ReadAgain(Reload),
}

/// What the sequencer does with one stored message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageDecision {
    /// Only `webhook_endpoint.tested` events: answered, never applied.
    Test,
    /// A track version 1 does not name (or none, on a message that is not a test): ignored.
    IgnoredTrack,
    /// The message's generation is older than the one held (a reset: not newer). Nothing applies.
    SkipOlderGeneration { generation: u64, held: u64 },
    /// A reset, and no reload was running: begin this one.
    BeginReload(Reload),
    /// A reset while a reload was running: stop that one, begin this one.
    SupersedeReload { stopped: Reload, begun: Reload },
    /// A message of events: decide each event at `generation` (see [`crate::event`]). When
    /// `reload` is set, the message is under another access_version than the copy's: a reload
    /// begins as well.
    ApplyEvents {
        generation: u64,
        reload: Option<ReloadStart>,
    },
    /// A message that can never be applied (see [`crate::quarantine`]): kept aside with `why`,
    /// and the feed read again (`reload`), so the endpoint goes on and its copy converges.
    Quarantine {
        why: Unapplicable,
        reload: ReloadStart,
    },
}

/// The transition for one message, applied in the order received (rule "Apply each endpoint's
/// stored messages one at a time, for each track, in the order you received them").
///
/// - Rule "A webhook_endpoint.tested event is a test": `Test`, state unchanged.
/// - Rule "Ignore an event type, a track ... version 1 does not name": `IgnoredTrack`.
/// - Rule "Ignore a message of an older generation than the one held": `SkipOlderGeneration`.
/// - Rule "Apply each endpoint's stored messages ...": a message applied ahead of an earlier reset
///   makes that reset read as older, so a reset not newer than the held generation is skipped.
/// - Rule "Handle every webhook_endpoint.reset the same way, whatever its reason": a newer reset
///   begins a reload under its generation and access_version (`BeginReload`); rule "If a newer
///   reset arrives during the read, stop: its reload replaces this one" (`SupersedeReload`).
/// - Rule "The copy is held under the access_version of the message that began its reload ... or
///   one under another access_version than the copy's, which means: read /v1/feed again, under
///   the generation that message arrived at": `ApplyEvents { reload: Some(..) }`; its events are
///   still applied by the same rules ("While you read, keep applying the messages that follow").
/// - Rule "A rewind raises the generation too but sends no reset, and a reload it overtakes goes
///   on": a newer generation without a reset leaves a running reload alone.
/// - A feed message without a generation can never be applied: `Quarantine`, and the feed is
///   read again (see [`crate::quarantine`]).
/// - Rule "Keep, with the copy, the through of the last message of events applied": a message of
///   events sets `through` and clears `last_was_reset`; a reset sets `last_was_reset`.
///
/// A message holding a reset is a reset message (version 1 sends a reset alone); its other
/// events are not applied.
///
/// Rules: R-ORDER, R-OLDER-GEN, R-ROUTE, R-ACCESS-VERSION, R-THROUGH, R-TEST, R-IGNORE-UNKNOWN (see
/// services/rules/RULES.md).
pub fn step(state: &EndpointTrack, message: &Message) -> (EndpointTrack, MessageDecision) {
    let same = |d| (state.clone(), d);
    if message.is_test() {
        return same(MessageDecision::Test);
    }
    if message.track != Some(Track::Feed) {
        return same(MessageDecision::IgnoredTrack);
    }
    let reset = message.events.iter().find_map(|e| match &e.body {
        EventBody::Reset(r) => Some(r),
        _ => None,
    });
    if let Some(reset) = reset {
        return step_reset(state, reset);
    }
    let Some(generation) = message.generation else {
        return quarantine(state, Unapplicable::MissingGeneration);
    };
    if let Some(held) = state.generation {
        if generation < held {
            return same(MessageDecision::SkipOlderGeneration { generation, held });
        }
    }
    let mut next = state.clone();
    next.generation = Some(state.generation.map_or(generation, |h| h.max(generation)));
    if message.through.is_some() {
        next.through = message.through.clone();
    }
    next.last_was_reset = false;
    let reload = match &message.access_version {
        Some(av) if state.access_version.as_deref() != Some(av.as_str()) => {
            let begun = Reload {
                generation,
                access_version: Some(av.clone()),
                cause: ReloadCause::AccessVersion,
                read_again: 0,
                round: 0,
            };
            Some(next.begin(begun))
        }
        _ => None,
    };
    (next, MessageDecision::ApplyEvents { generation, reload })
}

/// A reset message: skipped unless newer than what is held, else begins (or supersedes) a reload
/// under the reset's own generation and access_version.
fn step_reset(state: &EndpointTrack, reset: &ResetData) -> (EndpointTrack, MessageDecision) {
    if let Some(held) = state.generation {
        if reset.generation <= held {
            return (
                state.clone(),
                MessageDecision::SkipOlderGeneration {
                    generation: reset.generation,
                    held,
                },
            );
        }
    }
    let mut next = state.clone();
    next.generation = Some(reset.generation);
    next.last_was_reset = true;
    next.last_reset_generation = Some(reset.generation);
    let begun = Reload {
        generation: reset.generation,
        access_version: Some(reset.access_version.clone()),
        cause: ReloadCause::Reset {
            reason: reset.reason.clone(),
        },
        read_again: 0,
        round: 0,
    };
    let decision = match next.begin(begun) {
        ReloadStart::Supersede { stopped, begun } => {
            MessageDecision::SupersedeReload { stopped, begun }
        }
        // `begin` never asks a running reload to read again.
        ReloadStart::Begin(r) | ReloadStart::ReadAgain(r) => MessageDecision::BeginReload(r),
    };
    (next, decision)
}

impl EndpointTrack {
    /// Makes `begun` the running reload and holds the copy under its access_version (rule "The
    /// copy is held under the access_version of the message that began its reload").
    fn begin(&mut self, mut begun: Reload) -> ReloadStart {
        self.reloads_begun += 1;
        begun.round = self.reloads_begun;
        if begun.access_version.is_some() {
            self.access_version = begun.access_version.clone();
        }
        match self.reload.replace(begun.clone()) {
            Some(stopped) => ReloadStart::Supersede { stopped, begun },
            None => ReloadStart::Begin(begun),
        }
    }

    /// Begins a reload no message began ("read /v1/feed again", from a refetch's answer, a
    /// rewind's refusal or a restore), under the held generation; the pages' access_version will
    /// be taken.
    ///
    /// A running reload is not begun again: it is asked to read another pass after the one it
    /// is reading ([`Reload::read_again`]), since the pages it is reading may have been read
    /// before the change that asks for this (an item created after them, whose refetch failed),
    /// and the event's id is applied, so nothing else would bring that change. It keeps its
    /// generation, access_version and cause, so reading again never relaxes what its pages must
    /// agree on.
    pub fn read_feed_again(&self) -> (EndpointTrack, ReloadStart) {
        let mut next = self.clone();
        if let Some(running) = &mut next.reload {
            running.read_again += 1;
            let again = running.clone();
            return (next, ReloadStart::ReadAgain(again));
        }
        let start = next.begin(Reload {
            generation: self.generation.unwrap_or(0),
            access_version: None,
            cause: ReloadCause::ReadAgain,
            read_again: 0,
            round: 0,
        });
        (next, start)
    }

    /// A pass of the reload `merged` was merged into the copy under `generation`, its pages under
    /// `pages_access_version`; the pass began when the reload's [`Reload::read_again`] was
    /// `read_again_at_start`. The copy is held under that access_version and at least at that
    /// generation; the reload is over unless "read /v1/feed again" was asked since the pass
    /// began (then it reads another). A reload that was superseded meanwhile changes nothing
    /// (its merge must not have been carried out).
    pub fn reload_merged(
        &self,
        merged: &Reload,
        read_again_at_start: u32,
        generation: u64,
        pages_access_version: &str,
    ) -> EndpointTrack {
        let Some(running) = self.reload.as_ref().filter(|r| r.is(merged)) else {
            return self.clone();
        };
        let mut next = self.clone();
        if running.read_again == read_again_at_start {
            next.reload = None;
        }
        next.access_version = Some(pages_access_version.to_owned());
        next.generation = Some(self.generation.map_or(generation, |g| g.max(generation)));
        next
    }
}
