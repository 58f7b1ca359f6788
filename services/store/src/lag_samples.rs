//! Each endpoint's apply lag, sampled minute by minute for the last two hours
//! (`endpoint_lag_samples`): what the console charts beside the throughput that the messages
//! and changes themselves give. Nothing is written per message: the sequencers sample every
//! endpoint with messages waiting every few seconds, each sample one statement.

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::{EndpointId, StoreError};

/// Samples every endpoint's apply lag now (the age of its oldest stored message above its apply
/// cursor), keeping the most of each minute, and deletes samples older than two hours, in one
/// statement: (endpoints sampled, samples deleted). Any number of sequencer processes may run it
/// at once; each minute's row keeps the greatest lag any of them saw. An endpoint being deleted
/// is not sampled (its purge deletes its samples).
pub async fn sample(pool: &PgPool) -> Result<(u64, u64), StoreError> {
    let (sampled, forgotten): (i64, i64) = sqlx::query_as(
        "WITH sampled AS (
             INSERT INTO endpoint_lag_samples AS s (endpoint_id, minute, tenant_id, apply_lag_s)
             SELECT n.endpoint_id, date_trunc('minute', now()), e.tenant_id,
                    GREATEST(EXTRACT(EPOCH FROM now() - w.received_at)::float8, 0)
             FROM endpoint_arrival_counters n
             JOIN webhook_endpoints e ON e.id = n.endpoint_id
             LEFT JOIN endpoint_apply_cursors c ON c.endpoint_id = n.endpoint_id
             CROSS JOIN LATERAL (
                 SELECT m.received_at FROM messages m
                 WHERE m.endpoint_id = n.endpoint_id
                   AND m.arrival_seq > COALESCE(c.applied_arrival_seq, 0)
                 ORDER BY m.arrival_seq LIMIT 1
             ) w
             WHERE n.last_arrival_seq > COALESCE(c.applied_arrival_seq, 0)
               AND e.status <> 'deleting'
             ON CONFLICT (endpoint_id, minute) DO UPDATE
                 SET apply_lag_s = GREATEST(s.apply_lag_s, excluded.apply_lag_s)
             RETURNING 1
         ),
         forgotten AS (
             DELETE FROM endpoint_lag_samples WHERE minute < now() - interval '2 hours'
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM sampled), (SELECT count(*) FROM forgotten)",
    )
    .fetch_one(pool)
    .await?;
    Ok((sampled as u64, forgotten as u64))
}

/// The endpoint's greatest apply lag sampled in each minute at or after `since`, oldest first;
/// a minute without a row had nothing waiting when sampled.
pub async fn by_minute(
    pool: &PgPool,
    endpoint: EndpointId,
    since: OffsetDateTime,
) -> Result<Vec<(OffsetDateTime, f64)>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT minute, apply_lag_s FROM endpoint_lag_samples
         WHERE endpoint_id = $1 AND minute >= $2 ORDER BY minute",
    )
    .bind(endpoint)
    .bind(since)
    .fetch_all(pool)
    .await?)
}
