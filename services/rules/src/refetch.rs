//! The answer of a refetch's item read.
//!
//! Rule "On a feed item's event whose data is a refetch": read `/v1/feed/items/{feed_item_id}`
//! and apply what it answers at the event's generation and sequence, by the feed item rule, when
//! its access_version is the copy's; a 404 under the copy's access_version removes the item at
//! that sequence; an answer under another access_version (a 404 among them) means read
//! `/v1/feed` again; a 404 without one (a load balancer's) is a failed read: try again a few
//! times, then read `/v1/feed` again.
//!
//! The relay reads each refetch before applying the message after it (the rule's first way), so
//! no answer is ever kept across a reset: its second way, a read kept in the background and
//! dropped when a newer reset arrives, is not needed.

use relay_wire::{FeedItem, Sequence};

use crate::event::{decide_removal, decide_update, Decision};
use crate::precedence::Held;

/// How many reads a refetch makes before it gives up and reads `/v1/feed` again.
pub const REFETCH_ATTEMPTS: u32 = 3;

/// A refetch decided and not yet answered: kept with the copy, as a reload is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRefetch {
    pub subject: String,
    pub feed_item_id: String,
    /// The refetch event's generation and sequence: where the answer applies.
    pub generation: u64,
    pub sequence: Sequence,
}

impl PendingRefetch {
    /// The pending read of a `Decision::Refetch`; `None` for any other decision.
    pub fn from_decision(decision: &Decision) -> Option<Self> {
        match decision {
            Decision::Refetch {
                subject,
                feed_item_id,
                generation,
                sequence,
            } => Some(Self {
                subject: subject.clone(),
                feed_item_id: feed_item_id.clone(),
                generation: *generation,
                sequence: sequence.clone(),
            }),
            _ => None,
        }
    }
}

/// A refetch's answer as read, and how many reads it took.
#[derive(Debug, Clone, PartialEq)]
pub struct RefetchRead {
    pub answer: RefetchAnswer,
    pub attempts: u32,
}

impl RefetchAnswer {
    /// A read that failed (no answer, or a load balancer's 404): try it again, up to
    /// [`REFETCH_ATTEMPTS`] reads in all.
    pub fn failed(&self) -> bool {
        matches!(self, RefetchAnswer::LoadBalancer404 | RefetchAnswer::Failed)
    }
}

/// What `GET /v1/feed/items/{feed_item_id}` answered.
#[derive(Debug, Clone, PartialEq)]
pub enum RefetchAnswer {
    /// `200`: the item, under `access_version`. Its `sequence` is the item's own; the rule
    /// applies it at the event's instead.
    Found {
        access_version: String,
        sequence: Sequence,
        item: FeedItem,
    },
    /// `404` whose body carries an access_version: the item is gone under that access.
    NotFound { access_version: String },
    /// `404` with no access_version: a load balancer's, a read that failed.
    LoadBalancer404,
    /// No answer, or any other failure.
    Failed,
}

/// What to do with a refetch's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum RefetchOutcome {
    /// Carry out this decision (a `Store`, `Unchanged`, `Tombstone` or `Ignore`) on the subject.
    Apply(Box<Decision>),
    /// Read again; `attempt` is the number of the next read, from 2.
    Retry { attempt: u32 },
    /// Read `/v1/feed` again (see [`EndpointTrack::read_feed_again`](crate::track::EndpointTrack::read_feed_again)).
    Reload,
}

/// Decides what the answer of read number `attempt` (from 1) of `pending` does, given the copy's
/// access_version and what it holds of the subject now (rule quoted in the module doc).
///
/// Rules: R-REFETCH (services/rules/RULES.md).
pub fn decide_refetch(
    copy_access_version: Option<&str>,
    held: Option<&Held>,
    pending: &PendingRefetch,
    attempt: u32,
    answer: &RefetchAnswer,
) -> RefetchOutcome {
    let ours = |av: &str| copy_access_version == Some(av);
    match answer {
        RefetchAnswer::Found {
            access_version,
            item,
            ..
        } if ours(access_version) => RefetchOutcome::Apply(Box::new(decide_update(
            held,
            &pending.subject,
            pending.generation,
            &pending.sequence,
            item,
        ))),
        RefetchAnswer::NotFound { access_version } if ours(access_version) => {
            RefetchOutcome::Apply(Box::new(decide_removal(
                held,
                &pending.subject,
                pending.generation,
                &pending.sequence,
            )))
        }
        RefetchAnswer::Found { .. } | RefetchAnswer::NotFound { .. } => RefetchOutcome::Reload,
        RefetchAnswer::LoadBalancer404 | RefetchAnswer::Failed => {
            if attempt < REFETCH_ATTEMPTS {
                RefetchOutcome::Retry {
                    attempt: attempt + 1,
                }
            } else {
                RefetchOutcome::Reload
            }
        }
    }
}
