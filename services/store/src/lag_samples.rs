//! Each endpoint's activity, sampled: its apply lag minute by minute for the last two hours
//! (`endpoint_lag_samples`), and quarter hour by quarter hour for the last eight days its
//! arrival and change numbers with the greatest lag (`endpoint_activity_samples`), what the
//! console charts. Nothing is written per message: the sequencers sample every endpoint every
//! few seconds, each sample one statement.

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::{EndpointId, StoreError};

/// Samples every endpoint now, in one statement: (endpoints whose lag was sampled, samples
/// deleted).
///
/// - An endpoint with stored messages above its apply cursor gets its lag (the age of the
///   oldest) into the minute's row, which keeps the most any sample of the minute saw.
/// - Every endpoint gets its arrival counter, change epoch and counter, and lag (0 when nothing
///   waits) into the quarter hour's row, which keeps the highest of each; an endpoint whose
///   numbers are those of its latest row, with nothing waiting, writes nothing.
/// - Minute rows older than two hours go, and quarter rows older than eight days but each
///   endpoint's latest (what the next quarter's counts are taken against).
///
/// Any number of sequencer processes may run it at once. An endpoint being deleted is not
/// sampled (its purge deletes its samples).
pub async fn sample(pool: &PgPool) -> Result<(u64, u64), StoreError> {
    let (sampled, forgotten): (i64, i64) = sqlx::query_as(
        "WITH current AS (
             SELECT n.endpoint_id, e.tenant_id, n.last_arrival_seq,
                    COALESCE(k.epoch, 1) AS change_epoch, COALESCE(k.last, 0) AS changes_through,
                    GREATEST(EXTRACT(EPOCH FROM now() - w.received_at)::float8, 0) AS lag
             FROM endpoint_arrival_counters n
             JOIN webhook_endpoints e ON e.id = n.endpoint_id
             LEFT JOIN endpoint_apply_cursors c ON c.endpoint_id = n.endpoint_id
             LEFT JOIN endpoint_change_counters k ON k.endpoint_id = n.endpoint_id
             LEFT JOIN LATERAL (
                 SELECT m.received_at FROM messages m
                 WHERE n.last_arrival_seq > COALESCE(c.applied_arrival_seq, 0)
                   AND m.endpoint_id = n.endpoint_id
                   AND m.arrival_seq > COALESCE(c.applied_arrival_seq, 0)
                 ORDER BY m.arrival_seq LIMIT 1
             ) w ON true
             WHERE e.status <> 'deleting'
         ),
         sampled AS (
             INSERT INTO endpoint_lag_samples AS s (endpoint_id, minute, tenant_id, apply_lag_s)
             SELECT endpoint_id, date_trunc('minute', now()), tenant_id, lag
             FROM current WHERE lag IS NOT NULL
             ON CONFLICT (endpoint_id, minute) DO UPDATE
                 SET apply_lag_s = GREATEST(s.apply_lag_s, excluded.apply_lag_s)
             RETURNING 1
         ),
         quartered AS (
             INSERT INTO endpoint_activity_samples AS s
                 (endpoint_id, quarter, tenant_id, arrivals_through, change_epoch,
                  changes_through, apply_lag_s)
             SELECT cur.endpoint_id,
                    date_bin('15 minutes', now(), TIMESTAMPTZ '2000-01-01 00:00:00+00'),
                    cur.tenant_id, cur.last_arrival_seq, cur.change_epoch, cur.changes_through,
                    COALESCE(cur.lag, 0)
             FROM current cur
             LEFT JOIN LATERAL (
                 SELECT p.arrivals_through, p.change_epoch, p.changes_through
                 FROM endpoint_activity_samples p WHERE p.endpoint_id = cur.endpoint_id
                 ORDER BY p.quarter DESC LIMIT 1
             ) latest ON true
             WHERE cur.lag IS NOT NULL
                OR (latest.arrivals_through, latest.change_epoch, latest.changes_through)
                   IS DISTINCT FROM
                   (cur.last_arrival_seq, cur.change_epoch, cur.changes_through)
             ON CONFLICT (endpoint_id, quarter) DO UPDATE
                 SET arrivals_through = GREATEST(s.arrivals_through, excluded.arrivals_through),
                     change_epoch = GREATEST(s.change_epoch, excluded.change_epoch),
                     changes_through = CASE
                         WHEN excluded.change_epoch > s.change_epoch
                             THEN excluded.changes_through
                         WHEN excluded.change_epoch = s.change_epoch
                             THEN GREATEST(s.changes_through, excluded.changes_through)
                         ELSE s.changes_through END,
                     apply_lag_s = GREATEST(s.apply_lag_s, excluded.apply_lag_s)
         ),
         forgotten AS (
             DELETE FROM endpoint_lag_samples WHERE minute < now() - interval '2 hours'
             RETURNING 1
         ),
         forgotten_quarters AS (
             DELETE FROM endpoint_activity_samples old
             WHERE old.quarter < now() - interval '8 days'
               AND EXISTS (SELECT 1 FROM endpoint_activity_samples newer
                           WHERE newer.endpoint_id = old.endpoint_id
                             AND newer.quarter > old.quarter)
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM sampled),
                (SELECT count(*) FROM forgotten) + (SELECT count(*) FROM forgotten_quarters)",
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

/// One quarter hour's sample of an endpoint: the highest numbers seen in it and the greatest
/// lag.
#[derive(Debug, Clone, Copy, PartialEq, sqlx::FromRow)]
pub struct QuarterSample {
    pub quarter: OffsetDateTime,
    pub arrivals_through: i64,
    pub change_epoch: i64,
    pub changes_through: i64,
    pub apply_lag_s: f64,
}

/// The endpoint's quarter-hour samples at or after `since`, oldest first, led by its latest
/// sample before `since` when there is one (what the first quarter's counts are taken against).
pub async fn quarters(
    pool: &PgPool,
    endpoint: EndpointId,
    since: OffsetDateTime,
) -> Result<Vec<QuarterSample>, StoreError> {
    Ok(sqlx::query_as(
        "(SELECT quarter, arrivals_through, change_epoch, changes_through, apply_lag_s
          FROM endpoint_activity_samples WHERE endpoint_id = $1 AND quarter < $2
          ORDER BY quarter DESC LIMIT 1)
         UNION ALL
         (SELECT quarter, arrivals_through, change_epoch, changes_through, apply_lag_s
          FROM endpoint_activity_samples WHERE endpoint_id = $1 AND quarter >= $2
          ORDER BY quarter)
         ORDER BY quarter",
    )
    .bind(endpoint)
    .bind(since)
    .fetch_all(pool)
    .await?)
}
