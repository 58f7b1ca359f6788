//! The relay's Postgres layer: the schema (`migrations/` at the workspace root) and the queries
//! that more than one tier runs.
//!
//! Every write that decides something decides it in the statement itself (a conflict target, a
//! `WHERE` on the row being written), never by reading first and writing second.
//!
//! # Layout
//! - [`db`]: connecting, and the embedded migrations.
//! - [`tenants`]: tenant rows.
//! - [`broker_users`]: each tenant's user on the relay's broker (the user lives in RabbitMQ).
//! - [`endpoints`]: webhook endpoints, their status and their signing secrets.
//! - [`messages`]: the stored webhook messages, written in batches.
//! - [`quarantine`]: stored messages the sequencer set aside, their retry and discard.
//! - [`upstream_status`]: how each endpoint's calls to its upstream fare (the last failure,
//!   since when, the last recovery).
//! - [`copy`]: each endpoint's copy of the feed, the event ids applied to it, and its outbox of
//!   changes: the rules crate's decisions carried out as conditional writes.

pub mod broker_users;
pub mod copy;
pub mod db;
pub mod endpoints;
pub mod messages;
pub mod quarantine;
pub mod tenants;
pub mod upstream_status;

pub use db::{connect, KeptConnection, PoolOptions, MIGRATOR};

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
}
