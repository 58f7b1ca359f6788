//! The sequencer: applies each endpoint's stored messages, in the order received, into the
//! endpoint's copy of the feed, by the reading rules of relay-rules.
//!
//! # Layout
//! - [`upstream`]: the upstream's REST API as reloads and refetches read it.
//! - [`apply`]: the driver of relay-rules' `decide_run`: runs of messages decided whole and
//!   written by relay-store's `runs`, several endpoints' runs in one transaction (refetch reads
//!   before it).
//! - [`batch`]: group commit: workers' runs gathered into shared apply transactions.
//! - [`reload`]: reading `/v1/feed` pass after pass, each merged as relay-rules'
//!   `decide_merge` says (relay-store's `copy::merge`).
//! - [`source`]: the seam a source kind plugs into (`SourceKind`), and how the worker drives it.
//! - [`worker`]: one owned endpoint of any kind: messages in order, bounded apply attempts and
//!   quarantine, the kind's background job beside them, the lease, its slot.
//! - [`feed`]: the feed's kind: runs decided whole, group commit, reloads from `/v1/feed`.
//! - [`stories`]: the stories API's kind (seed 000): its webhooks and catch-up pages through
//!   one handler, the driver of relay-rules' `decide_stories_run`; owed reads, ticker sync and
//!   the reload in full beside them.
//! - [`service`]: the process: wake-ups, the sweep, a bounded set of workers.
//! - [`slots`]: how many workers at once, and how many of them for one tenant.
//! - [`metrics`]: what the sequencer exports.
//!
//! Owning an endpoint (the Redis lease, the fencing token) and the wake-ups are relay-coord's,
//! shared with the front tier and the publisher.
//!
//! An endpoint's source kind is chosen in one place (the scheduler, by its registration); the
//! worker is the same for every kind, which writes only under the endpoint's fence.

mod apply;
mod batch;
mod feed;
mod metrics;
mod reload;
mod service;
mod slots;
mod source;
mod stories;
mod upstream;
mod worker;

pub use apply::{prepare_run, ApplyError, BatchReport, EndpointContext, PreparedRun};
pub use batch::{apply_runs, BatchedRun};
pub use metrics::{SequencerMetrics, APPLY_STEPS};
pub use reload::{run_reload, ReloadEnd, StopReload};
pub use service::{defaults, Sequencer, SequencerConfig, SequencerError};
pub use stories::{StoryReadRetry, STORY_READ_RETRY};
pub use upstream::{UpstreamClient, UpstreamError};
