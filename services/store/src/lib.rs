//! The relay's Postgres layer: the schema (`migrations/` at the workspace root) and the queries
//! that more than one tier runs.
//!
//! Every write that decides something decides it in the statement itself (a conflict target, a
//! `WHERE` on the row being written), never by reading first and writing second.
//!
//! # Layout
//! - `db` (its items at the root): connecting, the embedded migrations, and a read-only
//!   snapshot for reads that must agree.
//! - [`TenantId`], [`EndpointId`]: the ids every call that names a tenant or an endpoint takes,
//!   typed so that the two cannot be swapped.
//! - [`tenants`]: tenant rows.
//! - [`quotas`]: each tenant's quotas: the operator's defaults, its overrides, what is in force.
//! - [`broker_users`]: each tenant's user on the relay's broker (the user lives in RabbitMQ).
//! - [`endpoints`]: webhook endpoints, their status and their signing secrets.
//! - [`messages`]: the stored webhook messages, written in batches.
//! - [`lag_samples`]: each endpoint's activity, sampled for the console's charts: its apply lag
//!   minute by minute (two hours), its arrival and change numbers by quarter hour (eight days).
//! - [`quarantine`]: stored messages the sequencer set aside, their retry and discard.
//! - [`upstream_status`]: how each endpoint's calls to its upstream fare (the last failure,
//!   since when, the last recovery).
//! - [`reload_waits`]: which endpoints' reloads wait for one of a sequencer's reload slots, and
//!   since when.
//! - [`tracks`]: each endpoint's track row (relay-rules' `EndpointTrack`), opened under the
//!   endpoint's fence and writer lock, and the control plane's changes of it.
//! - [`cursors`]: each endpoint's apply cursor, the stored messages past it, and the backlog of
//!   its outbox.
//! - [`runs`]: the apply transaction's two statements: relay-rules' `RunPlan` carried out for
//!   several endpoints at once.
//! - [`copy`]: each endpoint's copy of the feed, the event ids applied to it, and its outbox of
//!   changes; a reload's merge carried out.
//! - [`changes`]: publishing the outbox: the backlog, an endpoint's next changes, and the publish
//!   cursors the publisher's mark moves under its tenant's fence.
//! - [`destinations`]: where each tenant's changes go, and why the publisher refuses it.
//! - [`restores`]: after a restore from backup: each endpoint's restore held until its rewind
//!   is answered, and the new epoch of its change stream, opened by a snapshot of the copy.
//! - [`offboard`]: deleting an endpoint or a tenant: marked in one statement every tier sees,
//!   then purged in batches; the one module that deletes from every endpoint table.
//! - [`stories`]: a stories endpoint's copy (seed 000's table and its two writes), its claimed
//!   notifications, its catch-up cursor and reload state, each write appending its change.
//! - [`sealing`]: the sealed columns (signing secrets, upstream API keys, broker URLs) as a
//!   whole: what each key seals, sealing an older relay's plain text, re-sealing under the
//!   current key.
//! - [`fences`]: the fencing tokens of relay-coord's ownership (an endpoint's, a tenant's):
//!   claimed by each new owner, checked by its writes.
//!
//! Every table's SQL lives in its module here; no statement text leaves this crate.

pub mod broker_users;
pub mod changes;
pub mod copy;
pub mod cursors;
mod db;
pub mod destinations;
pub mod endpoints;
mod failover;
pub mod fences;
mod ids;
pub mod lag_samples;
pub mod messages;
pub mod offboard;
pub mod quarantine;
pub mod quotas;
pub mod reload_waits;
pub mod restores;
pub mod runs;
pub mod sealing;
pub mod stories;
pub mod tenants;
pub mod tracks;
pub mod upstream_status;

pub use db::{
    connect, connection_lost, read_snapshot, table_sizes, with_every_connection_checked,
    KeptConnection, PoolOptions, GROWING_TABLES, MIGRATOR,
};
pub use failover::server_urls;
pub use ids::{EndpointId, TenantId};
pub use relay_seal::{Keyring, SecretText};

/// A store call failed. Callers at the edges add context; this keeps the cause.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error("{0}")]
    Invalid(String),
    #[error("{what} {id} does not exist")]
    NotFound { what: &'static str, id: String },
    #[error("{what} {id} already exists")]
    AlreadyExists { what: &'static str, id: String },
    /// A write a tenant's quota does not leave room for ([`quotas`]): `quota` names it,
    /// `limit` is its value in force. Nothing was written.
    #[error("the tenant's {quota} quota ({limit}) is reached")]
    OverQuota { quota: &'static str, limit: u32 },
    /// A write that decides in its statement refused part of a plan made under the endpoint's
    /// lock: another writer changed a row since it was read. Roll back; open and decide again.
    #[error("a planned write was refused: {0}")]
    Refused(String),
}
