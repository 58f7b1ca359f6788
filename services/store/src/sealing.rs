//! The sealed columns (relay-seal) as a whole: what each holds under which key, sealing what an
//! older relay stored in plain text, and re-sealing under the current key, each in bounded
//! batches of single statements so every tier keeps running while they go.
//!
//! The three columns' writes and reads in the course of business live with their tables
//! ([`crate::endpoints`], [`crate::destinations`]); this module holds only the statements that
//! treat them alike, built from each column's [`SealedColumn`].

use relay_seal::{Census, Field, Keyring, Sealed, UnsealError};
use relay_wire::SigningSecret;
use sqlx::PgPool;
use uuid::Uuid;

use crate::StoreError;

/// One column the relay keeps sealed, and the row identity its values are bound to.
#[derive(Debug, Clone, Copy)]
pub struct SealedColumn {
    /// `table.column`: the name in the associated data and in counts.
    pub field: &'static str,
    table: &'static str,
    /// The uuid the value is bound to (an endpoint's or a tenant's).
    row: &'static str,
    /// The plain-text column an older relay wrote.
    plain: &'static str,
    sealed: &'static str,
    key_id: &'static str,
    /// Signing secrets carry a fingerprint, the plain text's `whsec_` form is parsed.
    signing_secret: bool,
}

impl SealedColumn {
    pub(crate) fn field(&self, row: Uuid) -> Field {
        Field {
            column: self.field,
            row,
        }
    }
}

/// `endpoint_secrets.secret`: an endpoint's signing secrets (the key's bytes).
pub const SIGNING_SECRETS: SealedColumn = SealedColumn {
    field: "endpoint_secrets.secret",
    table: "endpoint_secrets",
    row: "endpoint_id",
    plain: "secret",
    sealed: "secret_sealed",
    key_id: "secret_key_id",
    signing_secret: true,
};

/// `webhook_endpoints.upstream_api_key`: the key that reads the tenant's feed upstream.
pub const UPSTREAM_API_KEYS: SealedColumn = SealedColumn {
    field: "webhook_endpoints.upstream_api_key",
    table: "webhook_endpoints",
    row: "id",
    plain: "upstream_api_key",
    sealed: "upstream_api_key_sealed",
    key_id: "upstream_api_key_key_id",
    signing_secret: false,
};

/// `tenant_destinations.amqp_url`: an own broker's URL, its password in it.
pub const BROKER_URLS: SealedColumn = SealedColumn {
    field: "tenant_destinations.amqp_url",
    table: "tenant_destinations",
    row: "tenant_id",
    plain: "amqp_url",
    sealed: "amqp_url_sealed",
    key_id: "amqp_url_key_id",
    signing_secret: false,
};

/// Every sealed column.
pub const SEALED_COLUMNS: [SealedColumn; 3] = [SIGNING_SECRETS, UPSTREAM_API_KEYS, BROKER_URLS];

/// Values per statement of [`seal_plaintext`] and [`reseal`].
pub const BATCH: i64 = 500;

/// How many values each column holds under each key, and in plain text.
pub async fn census(pool: &PgPool) -> Result<Census, StoreError> {
    let mut counts = Vec::new();
    for column in SEALED_COLUMNS {
        let SealedColumn {
            table,
            plain,
            sealed,
            key_id,
            ..
        } = column;
        let rows: Vec<(Option<String>, i64)> = sqlx::query_as(&format!(
            "SELECT {key_id}, count(*) FROM {table} WHERE {sealed} IS NOT NULL GROUP BY {key_id}
             UNION ALL
             SELECT NULL, count(*) FROM {table} WHERE {plain} IS NOT NULL"
        ))
        .fetch_all(pool)
        .await?;
        counts.extend(
            rows.into_iter()
                .filter(|(_, n)| *n > 0)
                .map(|(key, n)| (column.field.to_owned(), key, n)),
        );
    }
    Ok(Census { counts })
}

/// Opens one value sealed under each key the database uses, so a key configured with other
/// bytes than those it sealed with is found at start-up rather than at the first message.
pub async fn check_keys_open(pool: &PgPool, keys: &Keyring) -> Result<(), String> {
    for column in SEALED_COLUMNS {
        let SealedColumn {
            table,
            row,
            sealed,
            key_id,
            ..
        } = column;
        let samples: Vec<(Uuid, String, Vec<u8>)> = sqlx::query_as(&format!(
            "SELECT DISTINCT ON ({key_id}) {row}, {key_id}, {sealed} FROM {table}
             WHERE {sealed} IS NOT NULL ORDER BY {key_id}"
        ))
        .fetch_all(pool)
        .await
        .map_err(|e| format!("reading {}: {e}", column.field))?;
        for (id, key, bytes) in samples {
            let value = Sealed { key_id: key, bytes };
            if let Err(error) = keys.unseal(&value, column.field(id)) {
                return Err(format!("{} of {id}: {error}", column.field));
            }
        }
    }
    Ok(())
}

/// Seals, in one statement, up to [`BATCH`] of `column`'s values that an older relay stored in
/// plain text, emptying their plain text; how many it sealed, or `None` when none was left. A
/// value changed since it was read is left for the next call.
pub async fn seal_plaintext(
    pool: &PgPool,
    keys: &Keyring,
    column: SealedColumn,
) -> Result<Option<u64>, StoreError> {
    let SealedColumn {
        table,
        row,
        plain,
        sealed,
        key_id,
        ..
    } = column;
    let found: Vec<(Uuid, String)> = sqlx::query_as(&format!(
        "SELECT {row}, {plain} FROM {table} WHERE {plain} IS NOT NULL LIMIT $1"
    ))
    .bind(BATCH)
    .fetch_all(pool)
    .await?;
    if found.is_empty() {
        return Ok(None);
    }
    let (mut rows, mut plains, mut seals, mut prints) = (vec![], vec![], vec![], vec![]);
    for (id, text) in found {
        let field = column.field(id);
        let value = if column.signing_secret {
            let secret = SigningSecret::parse(&text).map_err(|error| {
                StoreError::Invalid(format!(
                    "a signing secret of endpoint {id} stored in plain text cannot be read \
                     ({error}); delete it (DELETE FROM endpoint_secrets WHERE endpoint_id = \
                     '{id}' AND secret IS NOT NULL) and add the upstream's secret again"
                ))
            })?;
            prints.push(Keyring::fingerprint(secret.as_bytes(), field).to_vec());
            keys.seal(secret.as_bytes(), field)
        } else {
            keys.seal(text.as_bytes(), field)
        };
        rows.push(id);
        plains.push(text);
        seals.push(value.bytes);
    }
    let fingerprint = if column.signing_secret {
        ", secret_fingerprint = u.fingerprint"
    } else {
        ""
    };
    let sealed_now = sqlx::query(&format!(
        "UPDATE {table} t
         SET {plain} = NULL, {sealed} = u.sealed, {key_id} = $4{fingerprint}
         FROM unnest($1::uuid[], $2::text[], $3::bytea[], $5::bytea[])
              AS u(row_id, plain, sealed, fingerprint)
         WHERE t.{row} = u.row_id AND t.{plain} = u.plain"
    ))
    .bind(&rows)
    .bind(&plains)
    .bind(&seals)
    .bind(keys.current().as_str())
    .bind(if column.signing_secret {
        prints
    } else {
        vec![Vec::new(); rows.len()]
    })
    .execute(pool)
    .await?
    .rows_affected();
    Ok(Some(sealed_now))
}

/// Re-seals, in one statement, up to [`BATCH`] of `column`'s values sealed under a key other than
/// the current one (their data keys re-wrapped; the values' ciphertexts kept); how many it
/// re-sealed, or `None` when none was left. A value written again since it was read keeps what
/// was written.
/// A value that does not open stops the pass with the row it is in: it was sealed under a key
/// with other bytes, or moved from another row.
pub async fn reseal(
    pool: &PgPool,
    keys: &Keyring,
    column: SealedColumn,
) -> Result<Option<u64>, StoreError> {
    let SealedColumn {
        table,
        row,
        sealed,
        key_id,
        ..
    } = column;
    let found: Vec<(Uuid, String, Vec<u8>)> = sqlx::query_as(&format!(
        "SELECT {row}, {key_id}, {sealed} FROM {table}
         WHERE {sealed} IS NOT NULL AND {key_id} <> $1 LIMIT $2"
    ))
    .bind(keys.current().as_str())
    .bind(BATCH)
    .fetch_all(pool)
    .await?;
    if found.is_empty() {
        return Ok(None);
    }
    let (mut rows, mut olds, mut news) = (vec![], vec![], vec![]);
    for (id, key, bytes) in found {
        let old = Sealed { key_id: key, bytes };
        let new = keys
            .reseal(&old, column.field(id))
            .map_err(|error: UnsealError| {
                StoreError::Invalid(format!("{} of {id}: {error}", column.field))
            })?
            .expect("selected under another key than the current");
        rows.push(id);
        olds.push(old.bytes);
        news.push(new.bytes);
    }
    let resealed = sqlx::query(&format!(
        "UPDATE {table} t SET {sealed} = u.new, {key_id} = $4
         FROM unnest($1::uuid[], $2::bytea[], $3::bytea[]) AS u(row_id, old, new)
         WHERE t.{row} = u.row_id AND t.{sealed} = u.old"
    ))
    .bind(&rows)
    .bind(&olds)
    .bind(&news)
    .bind(keys.current().as_str())
    .execute(pool)
    .await?
    .rows_affected();
    Ok(Some(resealed))
}
