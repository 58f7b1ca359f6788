//! The seam a source kind plugs into: what an owned endpoint's worker ([`crate::worker`]) asks
//! of the kind, and nothing else. The worker is written once: owning the endpoint
//! ([`relay_coord::Held`]), its slot among the process's workers ([`crate::slots`]), its wake-ups,
//! its registration's changes, a message whose apply keeps failing tried again with backoff and
//! then quarantined (relay-rules' `decide_failed_apply`), and a background job beside the
//! messages, started, superseded, paused after a failure and stopped the same way for every kind.
//!
//! A kind is its rules (a pure decision in relay-rules), its store module (relay-store), its
//! message schema (relay-wire) and one implementation of [`SourceKind`]: the feed's
//! ([`crate::feed::FeedSource`]: reloads from `/v1/feed`) and the stories API's
//! ([`crate::stories::StoriesSource`]: ticker sync and catch-up from `/v1/events`).
//!
//! # How the worker drives a kind
//! 1. [`SourceKind::open`] once the endpoint is held (its lock taken); an error lets it go.
//! 2. In a loop, while the lock holds and the sequencer runs:
//!    - [`SourceKind::update`] when the registration changed;
//!    - every stored message available now, in arrival order, from the apply cursor the worker
//!      keeps, read a batch at a time (through the process's shared reader) and given to
//!      [`SourceKind::apply_run`] (numbers only duplicates took to [`SourceKind::skip_gaps`]).
//!      After a failure that may be the messages' ([`ApplyError::may_be_the_message`]), the next
//!      run is one message alone; while that one keeps failing the worker waits as relay-rules
//!      says and at last calls [`SourceKind::quarantine`] for it;
//!    - [`SourceKind::wanted`]: the background job the endpoint needs now, if any; a running job
//!      that is no longer wanted ([`SourceKind::supersedes`]) is stopped; one that ended is given
//!      to [`SourceKind::ended`]; a wanted job starts ([`SourceKind::start`]) unless a failed one
//!      is still pausing;
//!    - then it waits: for a wake-up, the job's end, [`SourceKind::due_at`], or lets go after
//!      `idle_linger` with nothing to do.
//! 3. A job still running when the worker lets go is stopped and awaited.

use std::future::Future;
use std::time::Duration;

use relay_store::cursors::PendingMessage;
use relay_store::endpoints::EndpointRegistration;
use relay_store::EndpointId;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::{JoinError, JoinHandle};

use crate::apply::ApplyError;
use crate::metrics::SequencerMetrics;
use crate::worker::WorkerConfig;

/// What an owned endpoint's worker lends its kind on every call.
pub(crate) struct Owned<'a> {
    pub pool: &'a PgPool,
    /// The endpoint's fencing token: every write checks it in its transaction.
    pub token: i64,
    pub config: &'a WorkerConfig,
    pub metrics: &'a SequencerMetrics,
}

/// What [`SourceKind::apply_run`] did (and, summed, one look at the endpoint's messages).
#[derive(Debug, Default)]
pub(crate) struct Applied {
    pub messages: usize,
    /// The last transaction left work for the background job (the feed: a reload on the track).
    pub job_pending: bool,
}

/// The last run the worker tried, when it was one message alone: (the cursor it followed, its
/// arrival_seq). After a failure, that message's failure.
#[derive(Default)]
pub(crate) struct Tried {
    pub alone: Option<(i64, i64)>,
}

/// How a background job ended, as the kind judged it.
pub(crate) enum JobEnded {
    /// Done (or superseded by a newer one): the pauses start over.
    Done,
    /// The endpoint's fence moved on: the worker lets go.
    Fenced,
    /// Failed: the next job waits a pause, longer while failures repeat.
    Failed,
}

/// One source kind's part of an owned endpoint's work (see the module doc for the order of
/// calls). Every method is called by the endpoint's one worker, never concurrently.
pub(crate) trait SourceKind: Sized + Send + 'static {
    /// Which background job: compared to tell whether a running one is still wanted.
    type Job: Clone + Send + Sync + 'static;
    /// What a finished job answers.
    type End: Send + 'static;

    /// The kind's state for an endpoint just taken.
    fn open(
        registration: EndpointRegistration,
        http: relay_netguard::GuardedClient,
        owned: &Owned<'_>,
    ) -> impl Future<Output = Result<Self, ApplyError>> + Send;

    /// The endpoint.
    fn id(&self) -> EndpointId;

    /// Takes the registration as it is now.
    fn update(&mut self, registration: &EndpointRegistration);

    /// Applies one run: the stored messages `pending`, in arrival order, in one transaction
    /// that moves the apply cursor from `moves.0` to `moves.1` (only from there: the statement
    /// decides that this transaction is the one moving it).
    fn apply_run(
        &mut self,
        owned: &Owned<'_>,
        moves: (i64, i64),
        pending: Vec<PendingMessage>,
    ) -> impl Future<Output = Result<Applied, ApplyError>> + Send;

    /// Moves the apply cursor from `moves.0` to `moves.1` over numbers no message holds (a
    /// duplicate took them).
    fn skip_gaps(
        &mut self,
        owned: &Owned<'_>,
        moves: (i64, i64),
    ) -> impl Future<Output = Result<(), ApplyError>> + Send;

    /// Sets the message aside (it kept failing): `next` is (the cursor it follows, its
    /// arrival_seq), `why` (its attempts, the last error). The cursor moves past it and the
    /// message is recorded as quarantined, in one transaction.
    fn quarantine(
        &mut self,
        owned: &Owned<'_>,
        next: (i64, i64),
        why: (u32, String),
    ) -> impl Future<Output = Result<(), ApplyError>> + Send;

    /// The job the endpoint needs now (`applied`: what the last look at its messages did;
    /// `running`: the job running, if any).
    fn wanted(
        &mut self,
        owned: &Owned<'_>,
        applied: &Applied,
        running: Option<&Self::Job>,
    ) -> impl Future<Output = Result<Option<Self::Job>, ApplyError>> + Send;

    /// Whether `running` must stop because `wanted` is what the endpoint needs now.
    fn supersedes(running: &Self::Job, wanted: Option<&Self::Job>) -> bool;

    /// Whether a wanted job can start (the feed's and the stories' need an upstream).
    fn can_start(&self) -> bool;

    /// Starts `job` as a task of its own; it stops soon after `stop` says so (at its next await
    /// outside a transaction, or where dropping it loses nothing).
    fn start(
        &self,
        owned: &Owned<'_>,
        job: Self::Job,
        stop: watch::Receiver<bool>,
    ) -> JoinHandle<Result<Self::End, ApplyError>>;

    /// Takes a finished job's answer (metrics, the endpoint's state) and judges it.
    fn ended(
        &mut self,
        owned: &Owned<'_>,
        end: Result<Result<Self::End, ApplyError>, JoinError>,
    ) -> impl Future<Output = JobEnded> + Send;

    /// When the kind wants to look again without a wake-up (the stories' next catch-up), if
    /// within `within`.
    fn due_at(&self, within: Duration) -> Option<tokio::time::Instant>;

    /// Whether the endpoint still has reason to stay owned with nothing to apply and no job
    /// running (the stories: a message came within `idle_linger`).
    fn busy(&self, idle_linger: Duration) -> bool;
}
