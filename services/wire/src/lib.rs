//! The upstream's (Quanor's) webhook wire contract, version 1, as plain Rust values.
//!
//! Nothing here does IO or reads a clock: callers pass the raw body bytes, the headers and the
//! current time in, and get typed values or a decision out. The front tier, the sequencer and the
//! upstream simulator all use this crate, so the relay verifies with exactly the code the
//! simulator signs with.
//!
//! # Layout
//! - [`limits`]: the numbers of the wire file's `limits` and `signature` sections.
//! - [`signature`]: Standard Webhooks signing and verification over the raw body bytes.
//! - [`message`]: the v1 message body and its events; unknown types, tracks and fields are kept
//!   as "ignored" values, never errors.
//! - [`sequence`]: the feed's `epoch.seq` sequences, long and short forms.
//! - [`story`]: the stories API's events and story objects (seed 000); types it does not name
//!   are kept as ignored events, fields it does not name stay in the story's snapshot.
//! - [`answer`]: what the upstream's REST API answers, parsed against a memory budget and
//!   checked with the same checks as webhook bodies before anything of it is kept.
//! - `fields`: the reader of a JSON object's named fields that feed items, stories events and
//!   answers share, each with its own errors.

pub mod answer;
mod fields;
pub mod limits;
mod message;
mod sequence;
mod signature;
mod story;

pub use message::{
    Event, EventBody, FeedAction, FeedData, FeedItem, ItemKind, Message, MessageError, PartRef,
    ResetData, TestedData, Track,
};
pub use sequence::{Cursor, CursorError, Sequence};
pub use signature::{
    sign, verify, SecretError, SignatureHeaders, SigningSecret, VerifyError, SIGNATURE_VERSION,
};
pub use story::{
    Origin, SnapshotKind, Story, StoryEvent, StoryEventBody, StoryEventError, MAX_ID_BYTES,
};
