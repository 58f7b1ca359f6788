//! Operator commands: `migrate`, `restored` (run once on a database restored from a backup,
//! before any tier starts on it: `docs/restore.md`), and `simulate --register` (which registers
//! the simulator's tenants and endpoints straight in Postgres, for development). Tenants, endpoints and secrets
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

/// A small pool on RELAY_DATABASE_URL for one-off statements.
pub(crate) fn admin_pool(global: &GlobalArgs) -> anyhow::Result<PgPool> {
    crate::startup::connect(
        global,
        PoolOptions {
            max_connections: 2,
            ..PoolOptions::default()
        },
    )
}

/// Creates the database when missing, then applies pending migrations.
///
/// With several servers (a primary and its standbys), the first that can make the database
/// makes it: a standby refuses, and the primary's database reaches the standbys by replication.
pub async fn migrate(global: &GlobalArgs) -> anyhow::Result<()> {
    let mut failure = None;
    for server in relay_store::server_urls(&global.database_url) {
        match create_if_missing(&server).await {
            Ok(()) => {
                failure = None;
                break;
            }
            Err(error) => failure = Some(error),
        }
    }
    if let Some(error) = failure {
        return Err(error);
    }
    let pool = admin_pool(global)?;
    relay_store::MIGRATOR
        .run(&pool)
        .await
        .context("applying migrations")?;
    tracing::info!("migrations applied");
    crate::keys::seal_plaintext(global, &pool).await?;
    Ok(())
}

/// Creates the database `server` (one server's URL) names when it is missing there.
async fn create_if_missing(server: &str) -> anyhow::Result<()> {
    if !Postgres::database_exists(server)
        .await
        .context("connecting to Postgres")?
    {
        Postgres::create_database(server)
            .await
            .context("creating the database")?;
        tracing::info!("created the database");
    }
    Ok(())
}

/// The plan of a stories endpoint in `relay restored`'s lines: nothing to rewind, its worker
/// catches up from the cursor the backup kept (`GET /v1/events`) as soon as it starts.
pub(crate) const CATCH_UP: &str = "catch_up";

/// One endpoint's line of `relay restored`.
#[derive(Debug, serde::Serialize)]
struct RestoredLine {
    webhook_endpoint_id: Uuid,
    tenant_id: Uuid,
    /// The new epoch of the endpoint's change stream, opened by a snapshot of the copy.
    change_epoch: i64,
    snapshot_items: i64,
    /// What the feed endpoint's rewind (`POST /v1/endpoints/{id}/tracks/feed/rewind`) will do:
    /// `rewind` from `since`, or `read_feed_again`; a stories endpoint's is [`CATCH_UP`].
    plan: &'static str,
    since: Option<String>,
}

/// Marks every endpoint of a database restored from a backup (see [`mark_restored`]). Migrates
/// first: a backup may be of an older schema. Prints one JSON line per endpoint on stdout.
pub async fn restored(global: &GlobalArgs) -> anyhow::Result<()> {
    migrate(global).await?;
    let pool = admin_pool(global)?;
    let marked = mark_restored(&pool, &mut std::io::stdout().lock()).await?;
    tracing::info!(
        endpoints = marked,
        "every endpoint is marked restored: start the tiers, then rewind each endpoint"
    );
    Ok(())
}

/// Marks every endpoint restored (relay-store's `restores::mark`): each holds the backup's kept
/// `through` for its rewind and begins a new epoch of its change stream, opened by a snapshot
/// of its copy. Writes one JSON line per endpoint to `out`; returns how many it marked.
pub async fn mark_restored(pool: &PgPool, out: &mut dyn std::io::Write) -> anyhow::Result<usize> {
    let ids = relay_store::restores::endpoints(pool)
        .await
        .context("listing the endpoints")?;
    let mut marked_count = 0;
    for id in ids {
        let Some(marked) = relay_store::restores::mark(pool, id)
            .await
            .with_context(|| format!("marking endpoint {id} restored"))?
        else {
            continue; // deleted meanwhile
        };
        let plan = marked.restore.as_ref().map(|restore| {
            relay_rules::restore_plan(&relay_rules::EndpointTrack::default(), Some(&restore.held))
        });
        let (plan, since) = match plan {
            Some(relay_rules::RestorePlan::Rewind { since }) => ("rewind", Some(since)),
            Some(relay_rules::RestorePlan::Reload) => ("read_feed_again", None),
            None => (CATCH_UP, None),
        };
        let line = RestoredLine {
            webhook_endpoint_id: marked.endpoint.0,
            tenant_id: marked.tenant.0,
            change_epoch: marked.epoch,
            snapshot_items: marked.snapshot_items,
            plan,
            since,
        };
        serde_json::to_writer(&mut *out, &line)?;
        out.write_all(b"\n")?;
        marked_count += 1;
    }
    out.flush()?;
    Ok(marked_count)
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
        let api_url = format!("{}://{listen}", command.tls.scheme());
        let pool = admin_pool(global)?;
        let keys = crate::keys::opened(global, &pool).await?;
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
                &keys,
                &NewEndpoint {
                    id: info.id,
                    tenant_id,
                    secret: SigningSecret::parse(secret)?,
                    upstream_base_url: Some(api_url.clone()),
                    upstream_api_key: Some(info.key_token.clone().into()),
                },
            )
            .await;
            match created {
                Ok(()) | Err(relay_store::StoreError::AlreadyExists { .. }) => {}
                Err(error) => return Err(error.into()),
            }
            // The tenant id is what `relay tail --tenant` and the API's tokens need.
            println!(
                "{}",
                serde_json::json!({
                    "event": "registered",
                    "tenant_id": tenant_id,
                    "webhook_endpoint_id": info.id,
                    "queue": relay_publisher::tenant_queue(tenant_id),
                })
            );
        }
        eprintln!("registered {} simulated endpoints", infos.len());
        // Whether the relay's own policy takes the simulator's API as an upstream URL (a
        // literal address is checked here; a name is checked again when connecting).
        if let Err(refusal) = global.outbound.policy().check_url(&api_url) {
            let https = command.tls.tls_cert_file.is_some();
            eprintln!(
                "the relay reads this simulator's API at {api_url}, which its settings refuse \
                 ({refusal}): run its sequencer and API with {}RELAY_UPSTREAM_ALLOW_PRIVATE=true \
                 (or RELAY_UPSTREAM_ALLOW_NETWORKS naming {}){}",
                if https {
                    ""
                } else {
                    "RELAY_UPSTREAM_ALLOW_HTTP=true, "
                },
                listen.ip(),
                if https {
                    " and RELAY_TLS_CA_FILE naming the CA that signed --tls-cert-file"
                } else {
                    ""
                }
            );
        }
    }
    relay_simulator::run(command.args, command.tls).await
}
