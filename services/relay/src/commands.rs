//! Operator commands: `migrate`, `tenant ...`, `endpoint ...`. Until the control plane's API
//! exists these write Postgres directly; each prints one JSON line describing what it did.

use std::io::Read as _;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context as _};
use relay_store::endpoints::{self, EndpointStatus, NewEndpoint};
use relay_store::{tenants, PoolOptions};
use relay_wire::SigningSecret;
use serde_json::json;
use sqlx::migrate::MigrateDatabase as _;
use sqlx::{PgPool, Postgres};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::cli::{EndpointCommand, GlobalArgs, SimulateCommand, TenantCommand};

fn admin_pool(global: &GlobalArgs) -> anyhow::Result<PgPool> {
    relay_store::connect(
        &global.database_url,
        &PoolOptions {
            max_connections: 2,
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

pub async fn tenant(global: &GlobalArgs, command: TenantCommand) -> anyhow::Result<()> {
    let pool = admin_pool(global)?;
    match command {
        TenantCommand::Add { name, id } => {
            let tenant = tenants::create(&pool, id.unwrap_or_else(Uuid::new_v4), &name).await?;
            println!("{}", json!({"tenant_id": tenant.id, "name": tenant.name}));
        }
    }
    Ok(())
}

pub async fn endpoint(global: &GlobalArgs, command: EndpointCommand) -> anyhow::Result<()> {
    let pool = admin_pool(global)?;
    match command {
        EndpointCommand::Add {
            id,
            tenant,
            secret_file,
            upstream_base_url,
            upstream_api_key_file,
        } => {
            let secret = read_secret(&secret_file)?;
            let upstream_api_key = upstream_api_key_file
                .map(|path| read_text(&path).map(|key| key.trim().to_owned()))
                .transpose()?;
            if let Some(url) = &upstream_base_url {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    bail!("--upstream-base-url must be an http:// or https:// URL");
                }
            }
            endpoints::create(
                &pool,
                &NewEndpoint {
                    id,
                    tenant_id: tenant,
                    secret,
                    upstream_base_url,
                    upstream_api_key,
                },
            )
            .await?;
            println!(
                "{}",
                json!({"webhook_endpoint_id": id, "tenant_id": tenant, "status": "active",
                       "webhook_path": format!("/webhooks/{id}")})
            );
        }
        EndpointCommand::RotateSecret {
            id,
            secret_file,
            overlap_s,
        } => {
            let secret = read_secret(&secret_file)?;
            let rotation = endpoints::rotate_secret(
                &pool,
                id,
                &secret,
                Duration::from_secs(overlap_s),
                OffsetDateTime::now_utc(),
            )
            .await?;
            let expire_at = rotation
                .old_secrets_expire_at
                .format(&time::format_description::well_known::Rfc3339)?;
            println!(
                "{}",
                json!({"webhook_endpoint_id": id, "old_secrets": rotation.old_secrets,
                       "old_secrets_expire_at": expire_at})
            );
        }
        EndpointCommand::Pause { id } => set_status(&pool, id, EndpointStatus::Paused).await?,
        EndpointCommand::Resume { id } => set_status(&pool, id, EndpointStatus::Active).await?,
    }
    Ok(())
}

async fn set_status(pool: &PgPool, id: Uuid, status: EndpointStatus) -> anyhow::Result<()> {
    let previous = endpoints::set_status(pool, id, status).await?;
    println!(
        "{}",
        json!({"webhook_endpoint_id": id, "status": status.as_str(), "was": previous.as_str()})
    );
    Ok(())
}

fn read_text(path: &Path) -> anyhow::Result<String> {
    let mut text = String::new();
    if path == Path::new("-") {
        std::io::stdin()
            .read_to_string(&mut text)
            .context("reading standard input")?;
    } else {
        text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    }
    Ok(text)
}

fn read_secret(path: &Path) -> anyhow::Result<SigningSecret> {
    let text = read_text(path)?;
    SigningSecret::parse(text.trim()).with_context(|| format!("the secret in {}", path.display()))
}

/// `relay simulate`: optionally registers the simulated endpoints, then runs the simulator.
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
                    upstream_base_url: Some(format!("http://{listen}")),
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
    }
    relay_simulator::run(command.args).await
}
