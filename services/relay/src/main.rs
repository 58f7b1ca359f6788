#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use relay::cli::{Cli, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse_env();
    // The demo's progress is what a user watches: only warnings beside it.
    let default_level = match cli.command {
        Command::Demo(_) => "warn",
        _ => "info",
    };
    relay::telemetry::init_logging(cli.global.log_format, default_level);
    relay::run(cli).await
}
