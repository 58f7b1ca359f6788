//! The control plane: an HTTP API (axum, under `/v1`) through which operators manage tenants and
//! tenants manage their own webhook endpoints, signing secrets and destination, rewind a track
//! after a restore, and read their endpoints' copies, state and stored messages. Its OpenAPI
//! document, generated from the handlers, is served at `/openapi.json`.
//!
//! # Layout
//! - [`config`]: `relay api` and `relay token issue` flags ([`ApiArgs`], [`TokenArgs`]), the
//!   validated [`ApiConfig`], and [`issue_token`].
//! - [`auth`]: HS256 JWTs: minting, verifying (with a previous key during a rotation, only
//!   tokens issued before it began, until its overlap ends), and the [`auth::TenantId`] and
//!   [`auth::Operator`] extractors every handler starts with.
//! - [`envelope`]: each caller's share of the control plane: the middleware that identifies the
//!   caller once and bounds its requests in flight, and the bound on each tenant's rewinds.
//! - [`broker`]: the relay's own broker: where it is (destinations there are refused) and its
//!   management API, where each tenant's user is made.
//! - [`error`]: [`ApiError`], its JSON form (`{"error", "field", "detail"}`), and the JSON body
//!   extractor whose errors name the field. A lost database connection is a 503 with
//!   Retry-After, never a 500.
//! - `retry`: a read whose database connection was lost is asked once more.
//! - [`routes`]: one module per resource; each query is scoped by the caller's tenant.
//! - [`upstream`]: the upstream's rewind call.
//! - [`metrics`]: `relay_api_requests_total`, `relay_api_request_duration_seconds`,
//!   `relay_api_rewinds_total`, `relay_api_throttled_total`, `relay_api_quota_refusals_total`,
//!   registered on [`ApiConfig::registry`].
//! - `offboarding`: the purge that finishes each delete of an endpoint or a tenant.
//! - [`server`]: [`ApiServer`]: bind, serve, stop gracefully.
//! - `console`: the web console's page, script and style, served at `/console/` with a Content
//!   Security Policy; it calls the API with the user's token like any other client.
//!
//! Secrets, upstream API keys and broker URLs are write-only: no answer and no log line holds
//! them.

mod auth;
mod broker;
mod config;
mod console;
mod envelope;
mod error;
mod metrics;
mod offboarding;
mod retry;
mod routes;
mod sealed_census;
mod server;
mod upstream;

pub use auth::{mint, JwtKeys, Rotation, Subject};
pub use broker::{dead_letter_queue, BrokerAccess, DeadLetters, ManagementSettings};
pub use config::{issue_token, ApiArgs, ApiConfig, ConfigError, JwtKeyArgs, TokenArgs};
pub use envelope::{EnvelopeLimits, ENVELOPE_LIMITS};
pub use error::ApiError;
pub use routes::keys::KeysState;
pub use routes::openapi;
pub use server::{ApiServer, ServeError};
