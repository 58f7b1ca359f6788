//! Counts, once a minute, what each key-encryption key seals, for the metrics an operator
//! watches during a rotation (`relay_sealed_secrets`, `relay_sealed_secrets_under_old_keys`).

use std::time::Duration;

use prometheus::{IntGauge, IntGaugeVec, Opts, Registry};
use relay_store::Keyring;
use sqlx::PgPool;

/// Between two counts: a rotation of thousands of values takes seconds, and the count is
/// three small grouped scans.
const INTERVAL: Duration = Duration::from_secs(60);

pub(crate) struct SealedGauges {
    values: IntGaugeVec,
    under_old_keys: IntGauge,
}

impl SealedGauges {
    pub(crate) fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let values = prometheus::register_int_gauge_vec_with_registry!(
            Opts::new(
                "relay_sealed_secrets",
                "Secrets stored, by column and by the key-encryption key that seals them \
                 (`plaintext`: not sealed yet), counted once a minute by the control plane.",
            ),
            &["column", "key"],
            registry
        )?;
        let under_old_keys = prometheus::register_int_gauge_with_registry!(
            Opts::new(
                "relay_sealed_secrets_under_old_keys",
                "Secrets sealed under a key other than the control plane's current one (or in \
                 plain text): `relay keys rotate` re-seals them; an old key may go at 0.",
            ),
            registry
        )?;
        Ok(Self {
            values,
            under_old_keys,
        })
    }
}

/// Counts for ever; a failed count is logged and tried at the next interval.
pub(crate) async fn run(pool: PgPool, keys: Keyring, gauges: SealedGauges) {
    let mut ticks = tokio::time::interval(INTERVAL);
    loop {
        ticks.tick().await;
        match relay_store::sealing::census(&pool).await {
            Ok(census) => {
                gauges.values.reset();
                for (column, key, values) in &census.counts {
                    gauges
                        .values
                        .with_label_values(&[column, key.as_deref().unwrap_or("plaintext")])
                        .set(*values);
                }
                gauges
                    .under_old_keys
                    .set(census.under_old_keys(keys.current().as_str()) + census.plaintext());
            }
            Err(error) => tracing::warn!(%error, "counting the sealed secrets"),
        }
    }
}
