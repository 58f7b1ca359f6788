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
//!   endpoint's next change is sent only once the one before it is confirmed ([`tenant`]).
//! - At least once, repeats only of the same message_id: a change is sent again only when the
//!   publisher cannot know the broker has it (no confirm came: the connection failed or the
//!   confirm timed out), or knows and did not record it (it died, or lost its tenant, between
//!   the confirm and the mark). A consumer that drops change_seqs it has seen gets each change
//!   once ([`ReferenceConsumer`]).
//!
//! # Layout
//! - [`config`]: [`PublisherConfig`] and the `RELAY_*` flags, [`PublisherArgs`].
//! - [`publisher`]: start/stop, and the coordinator that hears the sequencer's announcements
//!   and polls for tenants with a backlog.
//! - [`tenant`]: one owned tenant's stream: read, publish, confirm, mark; broker trouble.
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
pub use tail::{tail, tail_until, QueueReader, TailArgs, TailOutput};

/// The AMQP client, for callers (and tests) that talk to a broker beside the publisher.
pub use lapin;
