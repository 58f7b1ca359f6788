//! The sequencer: applies each endpoint's stored messages, one at a time and in arrival order,
//! into the endpoint's copy, by the rules of `relay-rules`.
//!
//! So far this crate holds the part every other piece stands on: who may apply an endpoint's
//! messages. The apply loop, reloads and refetches build on it.
//!
//! # Layout
//! - [`ownership`]: one worker per endpoint at a time: a Redis lock for who works on it, and a
//!   fencing token in Postgres that every apply transaction checks, so a worker that stalled
//!   past its lock's expiry cannot write.

pub mod ownership;

pub use ownership::{check_fence, Lease, Owners, OwnershipConfig, OwnershipError};
