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
//! - [`worker`]: one owned endpoint: messages in order, its reload beside them, the lease.
//! - [`stories`]: one owned stories endpoint (seed 000): its webhooks and catch-up pages through
//!   one handler, the driver of relay-rules' `decide_stories_run`; ticker loads and the reload
//!   in full beside them.
//! - [`service`]: the process: wake-ups, the sweep, a bounded set of workers.
//! - [`slots`]: how many workers at once, and how many of them for one tenant.
//! - [`metrics`]: what the sequencer exports.
//!
//! Owning an endpoint (the Redis lease, the fencing token) and the wake-ups are relay-coord's,
//! shared with the front tier and the publisher.
//!
//! The endpoint's source kind picks its worker: the feed's ([`worker`]) or the stories API's
//! ([`stories`]); both own the endpoint the same way and write only under its fence.

mod apply;
mod batch;
mod metrics;
mod reload;
mod service;
mod slots;
mod stories;
mod upstream;
mod worker;

pub use apply::{apply_runs, prepare_run, ApplyError, BatchReport, EndpointContext, PreparedRun};
pub use metrics::{SequencerMetrics, APPLY_STEPS};
pub use reload::{run_reload, ReloadEnd, StopReload};
pub use service::{defaults, Sequencer, SequencerConfig, SequencerError};
pub use stories::{StoryReadRetry, STORY_READ_RETRY};
pub use upstream::{UpstreamClient, UpstreamError};
