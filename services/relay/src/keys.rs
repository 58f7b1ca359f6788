//! The keys that seal secrets at rest, as the tiers and the operator use them: every tier opens
//! its keys against what the database holds before it starts ([`opened`]), `relay migrate`
//! seals what an older relay stored in plain text, and `relay keys` makes a key, reports what
//! each seals and re-seals under the current one.

use std::time::Duration;

use anyhow::Context as _;
use relay_store::sealing::{self, SEALED_COLUMNS};
use relay_store::Keyring;
use sqlx::PgPool;

use crate::cli::{GlobalArgs, KeysCommand};

/// The process's keys, once they are known to open what the database holds: refused (with
/// what to do) when none is configured, when a value is stored in plain text, when a key in use
/// is not configured, or when a configured key has other bytes than those its values were
/// sealed with.
pub async fn opened(global: &GlobalArgs, pool: &PgPool) -> anyhow::Result<Keyring> {
    let keys = global.seal.keyring()?;
    let census = sealing::census(pool)
        .await
        .context("counting the sealed secrets")?;
    if let Some(refusal) = keys.census_refusal(&census) {
        anyhow::bail!("{refusal}");
    }
    sealing::check_keys_open(pool, &keys)
        .await
        .map_err(|error| {
            anyhow::anyhow!("the configured keys do not open the stored secrets: {error}")
        })?;
    Ok(keys)
}

/// Seals every value an older relay stored in plain text, in batches; how many it sealed.
/// Without keys it seals nothing, and says what to set when there is something to seal.
pub async fn seal_plaintext(global: &GlobalArgs, pool: &PgPool) -> anyhow::Result<u64> {
    let census = sealing::census(pool)
        .await
        .context("counting the sealed secrets")?;
    if census.plaintext() == 0 {
        return Ok(0);
    }
    let keys = global.seal.keyring().with_context(|| {
        format!(
            "{} secret(s) are stored in plain text and need a key to be sealed",
            census.plaintext()
        )
    })?;
    let mut sealed = 0;
    for column in SEALED_COLUMNS {
        while let Some(batch) = sealing::seal_plaintext(pool, &keys, column)
            .await
            .with_context(|| format!("sealing {}", column.field))?
        {
            sealed += batch;
        }
    }
    // The old row versions' bytes stay in the tables' pages (a plain VACUUM frees them, it does
    // not overwrite them), where a physical backup or a replica's files would carry them: the
    // tables are written anew. They hold a row or two per endpoint; each is locked only for the
    // moment its copy takes.
    for table in [
        "endpoint_secrets",
        "webhook_endpoints",
        "tenant_destinations",
    ] {
        sqlx::query(&format!("VACUUM FULL {table}"))
            .execute(pool)
            .await
            .with_context(|| format!("vacuuming {table}"))?;
    }
    tracing::info!(sealed, key = %keys.current(), "secrets stored in plain text are sealed");
    Ok(sealed)
}

/// Re-seals every value under an old key under the current one, `pause` between batches; how
/// many it re-sealed.
pub async fn rotate(pool: &PgPool, keys: &Keyring, pause: Duration) -> anyhow::Result<u64> {
    let mut resealed = 0;
    for column in SEALED_COLUMNS {
        while let Some(batch) = sealing::reseal(pool, keys, column)
            .await
            .with_context(|| format!("re-sealing {}", column.field))?
        {
            resealed += batch;
            tracing::info!(
                column = column.field,
                batch,
                "re-sealed under the current key"
            );
            tokio::time::sleep(pause).await;
        }
    }
    Ok(resealed)
}

/// `relay keys`.
pub async fn run(global: &GlobalArgs, command: KeysCommand) -> anyhow::Result<()> {
    let pause = match command {
        KeysCommand::Generate { id } => {
            println!("{}", relay_seal::LocalKeys::generate_entry(&id)?);
            return Ok(());
        }
        KeysCommand::Status => None,
        KeysCommand::Rotate { pause_ms } => Some(Duration::from_millis(pause_ms)),
    };
    let pool = crate::commands::admin_pool(global)?;
    let keys = match pause {
        // Every value must open before any is re-sealed: a key missing or wrong is said once,
        // here, rather than part-way.
        Some(pause) => {
            let keys = opened(global, &pool).await?;
            let resealed = rotate(&pool, &keys, pause).await?;
            eprintln!(
                "re-sealed {resealed} value(s) under key `{}`",
                keys.current()
            );
            keys
        }
        None => global.seal.keyring()?,
    };
    let census = sealing::census(&pool)
        .await
        .context("counting the sealed secrets")?;
    println!(
        "{}",
        serde_json::to_string_pretty(&relay_api::KeysState::of(&keys, census))?
    );
    Ok(())
}
