//! An upstream (Quanor) simulator for the webhook relay's tests: it holds the truth, serves the
//! REST API, sends signed webhook messages by the wire file's rules, injects faults from one
//! seed, and says what a receiver's copy must end up holding.
//!
//! # Layout
//! - [`model`]: the truth model (companies, items and parts, keys and access, endpoints and
//!   filters). Pure; time comes in as a value.
//! - [`render`]: the wire file's JSON for items, events and message bodies, with deterministic
//!   ids.
//! - [`upstream`]: the upstream as a sans-IO state machine: change log, each endpoint's track
//!   and sender decisions (retries, 413 halving, pause, resets, rewinds), the oracle
//!   ([`Upstream::expected_copy`]) and the log of what was sent.
//! - [`faults`]: the fault knobs.
//! - [`workload`]: a seeded random workload of item changes and access changes.
//! - [`api`]: the REST API over axum, over http or https ([`api::serve_tls`]).
//! - [`driver`]: the tokio driver: the clock, HTTP sends with reqwest, the workload loop.
//! - [`cli`]: `SimulateArgs` and `run`, for the relay's `simulate` subcommand.
//!
//! # Use from an end-to-end test
//! 1. `Upstream::new(World::default(), SenderConfig::from_wire_limits(compression), faults, seed)`;
//!    add companies and keys on `upstream.world` (or let [`Workload::setup`] make them), and
//!    endpoints with [`Upstream::add_endpoint`] (the URL may hold `{id}`).
//! 2. `let sim = Simulation::new(upstream, send_timeout)`; `api::serve(listener, sim.clone())`
//!    gives the API's address; `sim.spawn_senders()` starts one sender per endpoint.
//! 3. Change the feed with `sim.change(|up, now_ms| up.create_item(..))` (or run a
//!    [`Workload`] with [`Simulation::run_workload`]); `sim.wait_idle(..)` waits until every
//!    message was delivered.
//! 4. Compare the receiver's copy with `sim.lock().expected_copy(endpoint_id)`; read what was
//!    sent and how each answer was taken in `sim.lock().log(endpoint_id)`.

pub mod api;
pub mod cli;
pub mod driver;
mod faults;
pub mod model;
mod render;
pub mod upstream;
pub mod workload;

pub use cli::{run, ApiTlsArgs, SimulateArgs};
pub use driver::Simulation;
pub use faults::Faults;
pub use upstream::{
    Answer, EndpointSpec, ItemRead, LogEntry, MessageKind, Outgoing, RewindRefusal, SenderConfig,
    Upstream,
};
pub use workload::{EndpointInfo, Workload, WorkloadConfig};
