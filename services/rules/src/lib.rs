//! The wire file's reading rules as pure decisions: what the relay does with each message and
//! each event the upstream sends, given what its copy of the endpoint's feed holds.
//!
//! Nothing here does IO, awaits, or reads a clock (the quinn-proto shape): the sequencer loads
//! the held row(s), asks this crate, and carries the answer out in one conditional SQL write.
//! Every decision is stated as a comparison on the one row it writes (what the copy holds of one
//! subject, or the endpoint track's row), never as read-then-decide over many rows, so that the
//! Postgres layer can put the same comparison in the `where` of its `on conflict do update`.
//!
//! Each public function quotes, in its own words, the reading rule of the wire file
//! (`seeds/003_8b9456903465df40.txt`, `reading`) it implements.
//!
//! # Layout
//! - [`precedence`](mod@precedence): what the copy holds of a subject ([`Held`]) and which event
//!   wins over it.
//! - [`parts`]: the parts diff between a held item and a new one, for the outbox.
//! - [`event`]: one event in, one [`Decision`] out (store, tombstone, refetch, ignore), and the
//!   event-id de-duplication helper.
//! - [`track`]: the per endpoint-and-track state machine over whole messages: generations,
//!   access versions, resets and the reloads they begin, the kept `through`.
//! - [`reload`]: a reload's pass merged into the copy ([`decide_merge`] → [`MergePlan`]), and
//!   whether its pages agree.
//! - [`quarantine`]: a stored message that cannot be applied: retried with backoff, then kept
//!   aside and the feed read again.
//! - [`refetch`]: what to do with the answer of a refetch's item read.
//! - [`rewind`]: what to do after restoring the copy from a backup, and with a rewind's answer.
//! - [`address`]: which IP addresses are public, and why the others are not: the one
//!   classification behind every outbound check.
//! - [`destination`]: where a tenant's own-exchange destination may point (not the relay's own
//!   broker; public addresses unless the operator allows others).
//! - [`run`](mod@run): a whole run of stored messages decided at once ([`decide_run`] → [`RunPlan`]):
//!   the one way the sequencer drives the rules for messages, documented there.
//! - [`model`]: [`FeedCopy`], the rows a run is decided against, and [`Endpoint`], a thin
//!   executor of [`RunPlan`] and [`MergePlan`] in memory, for the property tests.
//! - [`stories`](mod@stories): the stories source (seed 000): the seed's two writes and what
//!   each does to its row ([`apply_write`]), the writes an event asks for in either mode, the
//!   notification it claims, a whole run decided at once ([`decide_stories_run`] →
//!   [`StoriesPlan`], "How to drive it" there), a round's writes planned the same way
//!   ([`plan_writes`]), and [`StoriesCopy`], its executor in memory.
//! - [`ticker_sync`]: a stories sync's steps before its catch-up: removed tickers dropped, a
//!   reload in full, added tickers loaded once ([`decide_ticker_sync`] → [`TickerSync`]).
//! - [`notify`]: which claimed notifications a stories endpoint sends: only those of events
//!   created since its registration ([`decide_notify`]).
//!
//! `RULES.md` beside this crate lists every reading rule of the wire file with its id, the
//! function that decides it, the statement that carries it out, and its tests.

mod address;
mod destination;
mod event;
mod model;
mod notify;
mod parts;
mod precedence;
mod quarantine;
mod refetch;
mod reload;
mod rewind;
mod run;
mod stories;
mod ticker_sync;
mod track;

pub use address::{classify, AddressKind};
pub use destination::{canonical, is_public, same_listener, DestinationPolicy, Refusal};
pub use event::{decide_event, feed_subject, Decision, IgnoreReason};
pub use model::{Endpoint, FeedCopy, ModelChange};
pub use notify::{decide_notify, NotifyDecision};
pub use parts::{diff_parts, PartsDiff};
pub use precedence::{precedence, Held, HeldContent, Precedence};
pub use quarantine::{decide_failed_apply, quarantine, ApplyBackoff, FailedApply, Unapplicable};
pub use refetch::{
    decide_refetch, PendingRefetch, RefetchAnswer, RefetchOutcome, RefetchRead, REFETCH_ATTEMPTS,
};
pub use reload::{
    check_pages, decide_merge, merge_item, merge_read_item, pages_agree, HeldRow, Merge,
    MergeDecision, MergePlan, PagesCheck, Pass, ReadItem,
};
pub use rewind::{
    answer_rewind, decide_rewind, reload_after_restore, restore_plan, PendingRestore, RestorePlan,
    RewindAnswer, RewindAnswered, RewindOutcome, RewindRefusal,
};
pub use run::{
    decide_run, event_ids, refetches_wanted, subjects, EventOutcome, MessagePlan, Outcome,
    PlannedChange, PlannedRow, Run, RunPlan, StoredMessage,
};
pub use stories::{
    apply_write, decide_stories_run, fetched_write, notification_claim, owed_read_pause,
    plan_writes, save_wins, snapshot_writes, stories_of, stories_of_run, CopiedStory, HeldStory,
    PlanMismatch, PlannedClaim, PlannedStoryWrite, StoriesCopy, StoriesMode, StoriesPlan,
    StoriesRun, StoryChange, StoryOutcome, StoryRead, StoryWrite,
};
pub use ticker_sync::{decide_ticker_sync, TickerStep, TickerSync, TickerSyncInput};
pub use track::{step, EndpointTrack, MessageDecision, Reload, ReloadCause, ReloadStart};
