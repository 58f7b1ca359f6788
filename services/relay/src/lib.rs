//! The `relay` binary's library half: configuration, startup of each tier, and the operator
//! commands. `main.rs` only parses the command line and calls in here, so tests start the tiers
//! exactly as the binary does.
//!
//! # Layout
//! - [`cli`]: flags, environment variables and their defaults.
//! - [`startup`]: binds listeners and runs the tiers until shutdown.
//! - [`telemetry`]: logging and the `/metrics` endpoint.
//! - [`commands`]: `migrate`, `restored`, `simulate`.
//! - [`keys`]: the keys that seal secrets at rest: opened against the database before a tier
//!   starts, `relay keys`.
//! - [`demo`]: `relay demo`, every tier and the simulator on this machine, to a verdict.
//! - [`loadgen`]: the front tier's load generator.
//! - [`cpu`]: where the machine's CPU went during a benchmark window.
//! - [`bench`]: the benchmarks; `bench_isolation` is `relay bench isolation`, what one tenant's
//!   attacks cost another.

pub mod bench;
mod bench_isolation;
mod bench_path;
mod bench_stories;
pub mod cli;
pub mod commands;
mod cpu;
pub mod demo;
pub mod keys;
pub mod loadgen;
pub mod startup;
pub mod telemetry;

/// Runs the command `cli` names, as the `relay` binary does once it has parsed its command line
/// and started logging.
pub async fn run(cli: cli::Cli) -> anyhow::Result<()> {
    use cli::Command;
    match cli.command {
        Command::Migrate => crate::commands::migrate(&cli.global).await,
        Command::Demo(args) => crate::demo::run(&cli.global, *args).await,
        Command::Restored => crate::commands::restored(&cli.global).await,
        Command::Ingest(args) => crate::startup::run_ingest(&cli.global, &args).await,
        Command::Sequencer(command) => crate::startup::run_sequencer(&cli.global, &command).await,
        Command::Publisher(command) => crate::startup::run_publisher(&cli.global, &command).await,
        Command::Api(command) => crate::startup::run_api(&cli.global, &command).await,
        Command::Tail(args) => {
            let stats =
                relay_publisher::tail(&args, &cli.global.trust()?, &mut std::io::stdout()).await?;
            eprintln!("{}", serde_json::to_string(&stats)?);
            if stats.waiting > 0 {
                anyhow::bail!(
                    "{} changes are held behind changes that never came: the copy is not whole",
                    stats.waiting
                );
            }
            Ok(())
        }
        Command::Token(crate::cli::TokenCommand::Issue(args)) => {
            let issued = relay_api::issue_token(&args)?;
            println!("{}", serde_json::to_string(&issued)?);
            Ok(())
        }
        Command::All(args) => {
            crate::commands::migrate(&cli.global).await?;
            crate::startup::run_all(&cli.global, &args).await
        }
        Command::Keys(command) => crate::keys::run(&cli.global, command).await,
        Command::Bench(command) => crate::bench::run(&cli.global, command).await,
        Command::Loadgen(args) => crate::loadgen::run(&cli.global, args).await,
        Command::Simulate(command) => crate::commands::simulate(&cli.global, command).await,
    }
}
