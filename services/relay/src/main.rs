#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use relay::cli::{Cli, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse_env();
    relay::telemetry::init_logging(cli.global.log_format);
    match cli.command {
        Command::Migrate => relay::commands::migrate(&cli.global).await,
        Command::Restored => relay::commands::restored(&cli.global).await,
        Command::Ingest(args) => relay::startup::run_ingest(&cli.global, &args).await,
        Command::Sequencer(command) => relay::startup::run_sequencer(&cli.global, &command).await,
        Command::Publisher(command) => relay::startup::run_publisher(&cli.global, &command).await,
        Command::Api(command) => relay::startup::run_api(&cli.global, &command).await,
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
        Command::Token(relay::cli::TokenCommand::Issue(args)) => {
            let issued = relay_api::issue_token(&args)?;
            println!("{}", serde_json::to_string(&issued)?);
            Ok(())
        }
        Command::All(args) => {
            relay::commands::migrate(&cli.global).await?;
            relay::startup::run_all(&cli.global, &args).await
        }
        Command::Bench(command) => relay::bench::run(&cli.global, command).await,
        Command::Loadgen(args) => relay::loadgen::run(&cli.global, args).await,
        Command::Simulate(command) => relay::commands::simulate(&cli.global, command).await,
    }
}
