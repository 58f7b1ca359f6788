//! What the tiers share to work together through Redis and Postgres: one owner at a time, the
//! wake-ups that tell a tier there is work, opening Redis, and group commit's batches.
//!
//! The front tier, the sequencer and the publisher each depend on this crate, never on one
//! another.
//!
//! # Layout
//! - `ownership`: one owner at a time (an endpoint's worker in the sequencer, a tenant's task in
//!   the publisher): a Redis lock with a lease ([`Owners`], held and renewed as a [`Held`]), and a fencing token in
//!   Postgres that the owner's writes check (an endpoint's with [`check_fence`]; the publisher's
//!   mark checks its tenant's in its own statement), so a lost lock is harmless. The tokens'
//!   statements are relay-store's (`relay_store::fences`).
//! - `wake`: the Redis wake-ups: the front tier tells the sequencer which endpoints have new
//!   messages ([`wake_channel`]), the sequencer tells the publisher which have new changes
//!   ([`changes_channel`]). Hints that may be lost: each tier also polls Postgres.
//! - `redis_client`: opening Redis ([`open_redis`]: `redis://`, or `rediss://` checked against
//!   the operator's trust roots), and whether it answers ([`redis_answers`], for readiness).
//! - `handoff`: when two tiers run in one process, what one committed handed to the other's
//!   owning task in memory ([`Handoff`]), so it is not read back from Postgres.
//! - `gather`: group commit: tasks sharing a queue each take what gathered while they were busy
//!   ([`Gather`], within [`GatherLimits`]), waiting a bounded moment for jobs on their way
//!   ([`Linger`], as the queue's [`Arrivals`] suggest), so many callers' jobs share one transaction.

mod gather;
mod handoff;
mod ownership;
mod redis_client;
mod wake;

pub use gather::{Arrivals, Coming, Gather, GatherLimits, Linger};
pub use handoff::{Handoff, Inbox};
pub use ownership::{
    check_fence, Fence, Held, Lease, Owned, Owners, OwnershipConfig, OwnershipError,
};
pub use redis_client::{open_redis, redis_answers, DEFAULT_KEY_PREFIX, DEFAULT_REDIS_URL};
pub use wake::{
    change_payload, changes_channel, listen, listen_parsed, parse_change_payload, wake_channel,
    Waker,
};
