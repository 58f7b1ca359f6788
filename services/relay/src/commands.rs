//! Operator commands: `migrate`, and `simulate --register` (which registers the simulator's
//! tenants and endpoints straight in Postgres, for development). Tenants, endpoints and secrets
//! are managed through the control plane's API (`relay api`); the `relay tenant` and `relay
//! endpoint` commands that wrote Postgres before it existed are retired.

use anyhow::{bail, Context as _};
use relay_store::endpoints::{self, NewEndpoint};
use relay_store::{tenants, PoolOptions};
use relay_wire::SigningSecret;
use sqlx::migrate::MigrateDatabase as _;
use sqlx::{PgPool, Postgres};
use uuid::Uuid;

use crate::cli::{GlobalArgs, SimulateCommand};

fn admin_pool(global: &GlobalArgs) -> anyhow::Result<PgPool> {
    relay_store::connect(
        &global.database_url,
        &PoolOptions {
            max_connections: 2,
            ca_file: global.trust()?.ca_file().map(std::path::Path::to_path_buf),
            ..PoolOptions::default()
        },
    )
    .context("reading RELAY_DATABASE_URL")
}

/// Creates the database when missing, then applies pending migrations.
pub async fn migrate(global: &GlobalArgs) -> anyhow::Result<()> {
    if !Postgres::database_exists(&global.database_url)
        .await
        .context("connecting to Postgres")?
    {
        Postgres::create_database(&global.database_url)
            .await
            .context("creating the database")?;
        tracing::info!("created the database");
    }
    let pool = admin_pool(global)?;
    relay_store::MIGRATOR
        .run(&pool)
        .await
        .context("applying migrations")?;
    tracing::info!("migrations applied");
    Ok(())
}

pub async fn simulate(global: &GlobalArgs, command: SimulateCommand) -> anyhow::Result<()> {
    if command.register {
        let listen: std::net::SocketAddr = command
            .args
            .listen
            .parse()
            .context("--listen must be an address like 127.0.0.1:9700")?;
        if listen.port() == 0 {
            bail!("--register needs --listen with a fixed port: the relay must know the API's address");
        }
        let (_, _, infos) = relay_simulator::cli::prepare(&command.args)?;
        let pool = admin_pool(global)?;
        for info in &infos {
            // One tenant per simulated API key; the same key always maps to the same tenant.
            let tenant_id = Uuid::new_v5(&Uuid::NAMESPACE_URL, info.key_token.as_bytes());
            match tenants::create(
                &pool,
                tenant_id,
                &format!(
                    "simulated {}",
                    &info.key_token[..8.min(info.key_token.len())]
                ),
            )
            .await
            {
                Ok(_) | Err(relay_store::StoreError::AlreadyExists { .. }) => {}
                Err(error) => return Err(error.into()),
            }
            let secret = info
                .secrets
                .first()
                .context("a simulated endpoint has a secret")?;
            let created = endpoints::create(
                &pool,
                &NewEndpoint {
                    id: info.id,
                    tenant_id,
                    secret: SigningSecret::parse(secret)?,
                    upstream_base_url: Some(format!("{}://{listen}", command.tls.scheme())),
                    upstream_api_key: Some(info.key_token.clone()),
                },
            )
            .await;
            match created {
                Ok(()) | Err(relay_store::StoreError::AlreadyExists { .. }) => {}
                Err(error) => return Err(error.into()),
            }
        }
        eprintln!("registered {} simulated endpoints", infos.len());
        let outbound = global.outbound.policy();
        let https = command.tls.tls_cert_file.is_some();
        if !(outbound.allow_http || https) || !outbound.allow_private {
            eprintln!(
                "the relay reads this simulator's API at {}://{listen}: run its sequencer and \
                 API with RELAY_UPSTREAM_ALLOW_PRIVATE=true{}",
                command.tls.scheme(),
                if https {
                    " and RELAY_TLS_CA_FILE naming the CA that signed --tls-cert-file"
                } else {
                    " and RELAY_UPSTREAM_ALLOW_HTTP=true"
                }
            );
        }
    }
    relay_simulator::run(command.args, command.tls).await
}
