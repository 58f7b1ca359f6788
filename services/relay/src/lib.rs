//! The `relay` binary's library half: configuration, startup of each tier, and the operator
//! commands. `main.rs` only parses the command line and calls in here, so tests start the tiers
//! exactly as the binary does.
//!
//! # Layout
//! - [`cli`]: flags, environment variables and their defaults.
//! - [`startup`]: binds listeners and runs the tiers until shutdown.
//! - [`telemetry`]: logging and the `/metrics` endpoint.
//! - [`commands`]: `migrate`, `tenant`, `endpoint`.
//! - [`loadgen`]: the front tier's load generator.
//! - [`cpu`]: where the machine's CPU went during a benchmark window.
//! - [`bench`]: the benchmarks; `bench_isolation` is `relay bench isolation`, what one tenant's
//!   attacks cost another.

pub mod bench;
mod bench_isolation;
pub mod cli;
pub mod commands;
mod cpu;
pub mod loadgen;
pub mod startup;
pub mod telemetry;
