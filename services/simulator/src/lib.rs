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
//! - [`stories`]: the stories upstream (seed 000): its truth model, events, webhook sender with
//!   faults, its API's answers ([`stories::routes`], merged into [`api::router`]), the oracle
//!   and a seeded workload; [`Simulation`] drives it beside the feed.
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
//!
//! # Use from an end-to-end test of the stories
//! 1. `let faults = Faults::all();` (its `stories` field holds the stories knobs, [`StoriesFaults`])
//!    and `let mut stories = Stories::new(StoriesConfig::from_wire_limits(compression),
//!    faults.stories.clone(), seed)`; set `config.sender.max_attempts` low for a quick give-up,
//!    `config.window_events`/`window_ms` for a short window.
//! 2. Endpoints: `stories.add_stories_endpoint(StoriesEndpointSpec { id, url, secrets, api_key,
//!    tickers })` (the URL may hold `{id}`; the key reads the API for the endpoint's tickers), or
//!    let [`StoriesWorkload::setup`] make them ([`StoriesEndpointInfo`]: id, key, `whsec_`
//!    secrets, tickers, url).
//! 3. `let sim = Simulation::with_stories(upstream, stories, send_timeout)` (`upstream` a feed
//!    upstream, with no endpoints if only stories are tested; its `slow_reads` knob delays the
//!    stories API too); `api::serve(listener, sim.clone())` serves GET /v1/events, /v1/stories
//!    and /v1/stories/{id} beside the feed; `sim.spawn_stories_sender()` starts sending.
//! 4. Change the stories with `sim.change_stories(|st, now_ms| st.create_story(..))` (also
//!    `update_story`, `make_strong`, `shortlist_article`, `close_story`, `merge_stories`,
//!    `set_stories_tickers`), or run a [`StoriesWorkload`] with
//!    [`Simulation::run_stories_workload`]. `sim.wait_idle(..)` waits until every webhook was
//!    delivered or given up.
//! 5. Outages: `st.set_api_paused(true)` makes every stories API call answer 503;
//!    `st.pause_stories_endpoint(id)` holds webhooks back; `st.advance_window()` or
//!    `st.expire_cursors_before(now_ms)` drops what was published so far from the window, so a
//!    cursor that had not read it all answers 410 `cursor_expired`.
//! 6. Compare: `sim.stories().expected_stories(id)` (or `compare_copy(id, &rows)`),
//!    `expected_notifications(id)` and `backfill_strong(id)`; what was sent, how each answer
//!    was taken and what was given up: `stories_log(id)`, `given_up(id)`.

pub mod api;
pub mod cli;
pub mod driver;
mod faults;
pub mod model;
mod render;
pub mod stories;
pub mod upstream;
pub mod workload;

pub use cli::{run, ApiTlsArgs, SimulateArgs};
pub use driver::Simulation;
pub use faults::{Faults, StoriesFaults};
pub use stories::{
    ExpectedStory, Origin, Stories, StoriesConfig, StoriesEndpointInfo, StoriesEndpointSpec,
    StoriesWorkload, StoriesWorkloadConfig,
};
pub use upstream::{
    Answer, EndpointSpec, ItemRead, LogEntry, MessageKind, Outgoing, RewindRefusal, SenderConfig,
    Upstream,
};
pub use workload::{EndpointInfo, Workload, WorkloadConfig};
