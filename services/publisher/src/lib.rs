//! The publisher: sends every change of each endpoint's outbox (`changes`, filled by the
//! sequencer) to its tenant's RabbitMQ destination, once confirmed and in change_seq order, and
//! marks it published only after the broker confirmed it.
//!
//! Run it with [`Publisher::start`] (settings: [`PublisherConfig`], or [`PublisherArgs`] from
//! the command line) and stop it with [`PublisherHandle::stop`]. [`tail()`] is `relay tail`.
//!
//! # Guarantees
//! - Every change reaches the destination: rows are marked only after the broker's confirm (an
//!   ack, not returned), so whatever fails the backlog waits in Postgres and is sent when the
//!   broker is back.
//! - Per endpoint, in order: one publisher owns a tenant at a time ([`ownership`]), and an
//!   endpoint's changes are published in change_seq order on the tenant's one channel, several
//!   in flight at once ([`tenant`]). After broker trouble (a nack, a return, a lost channel or
//!   connection, a confirm that did not come in time) the change in trouble is sent again with
//!   every change of its endpoint sent after it, so a change may be followed by a repeat of
//!   earlier ones (the broker took some of the first copies), but the last copy of every
//!   change_seq is published after the last copy of every earlier one.
//! - At least once, repeats only of the same message_id: a change is sent again after broker
//!   trouble as above, or when the publisher knew the broker had it and did not record it (it
//!   died, or lost its tenant, between the confirm and the mark). A consumer that drops the
//!   change_seqs it has applied, and holds a change that comes ahead of its predecessor until
//!   the predecessor comes, gets each change exactly once and in order ([`ReferenceConsumer`],
//!   and so `relay tail`).
//!
//! # Layout
//! - [`config`]: [`PublisherConfig`] and the `RELAY_*` flags, [`PublisherArgs`].
//! - [`publisher`]: start/stop, and the coordinator that hears the sequencer's announcements
//!   and polls for tenants with a backlog.
//! - [`tenant`]: one owned tenant's stream: read, publish, confirm, mark; broker trouble.
//! - [`stream`]: its books, pure: each endpoint's window, confirms taken in turn, going back.
//! - [`ownership`]: the per-tenant Redis lease and its Postgres fencing token.
//! - [`outbox`]: the outbox's rows (read through relay-store) checked and made messages.
//! - [`broker`]: AMQP via lapin on tokio: connections, the tenant queue, confirmed publishes.
//! - [`message`]: the change message v1 (`docs/change-message.v1.schema.json`) and a stories
//!   endpoint's story message v1 (`docs/story-message.v1.schema.json`); [`Delivered`] is either.
//! - [`consumer`]: [`ReferenceConsumer`], the pure rebuild of a copy (a feed's items, or a
//!   stories endpoint's stories and notifications) from the messages.
//! - [`tail`](mod@tail): `relay tail`, the reference consumer over a queue.
//! - [`metrics`]: the Prometheus metrics.

mod broker;
mod config;
mod consumer;
mod message;
mod metrics;
mod outbox;
mod ownership;
mod publisher;
mod stream;
mod tail;
mod tenant;

pub use broker::{
    broker_urls, classify, connect, connect_any, declare_tenant_queue, tenant_queue, BrokerError,
    Outcome,
};
pub use config::{
    redact, BeforeMark, DestinationArgs, OnConfirm, PublisherArgs, PublisherConfig,
    DEFAULT_AMQP_URL,
};
pub use consumer::{
    ConsumerStats, EndpointReplica, Received, ReferenceConsumer, ReplicaItem, ReplicaStory,
};
pub use message::{
    message_id, ChangeMessage, DecodeError, Delivered, Operation, Outbound, PartsDiff, StoryKind,
    StoryMessage, StoryOperation, FIRST_EPOCH, SCHEMA, STORY_SCHEMA,
};
pub use metrics::PublisherMetrics;
pub use publisher::{Publisher, PublisherError, PublisherHandle};
pub use tail::{tail, tail_until, Interruption, QueueFollower, QueueReader, TailArgs, TailOutput};

/// The AMQP client, for callers (and tests) that talk to a broker beside the publisher.
pub use lapin;
