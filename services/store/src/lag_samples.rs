//! Each endpoint's activity, sampled: its apply lag minute by minute for the last two hours
//! (`endpoint_lag_samples`), and quarter hour by quarter hour for the last eight days its
//! arrival and change numbers with the greatest lag (`endpoint_activity_samples`), what the
//! console charts. Nothing is written per message: the sequencers sample the endpoints with
//! messages waiting every few seconds and every endpoint's numbers every minute, each sample
//! one statement.

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::{EndpointId, StoreError};

/// The quarter hour's row of an endpoint: its numbers now, keeping the highest of each seen in
/// the quarter and the greatest lag (`excluded` is the row offered).
const QUARTER_UPSERT: &str = "ON CONFLICT (endpoint_id, quarter) DO UPDATE
     SET arrivals_through = GREATEST(s.arrivals_through, excluded.arrivals_through),
         change_epoch = GREATEST(s.change_epoch, excluded.change_epoch),
         changes_through = CASE
             WHEN excluded.change_epoch > s.change_epoch THEN excluded.changes_through
             WHEN excluded.change_epoch = s.change_epoch
                 THEN GREATEST(s.changes_through, excluded.changes_through)
             ELSE s.changes_through END,
         apply_lag_s = GREATEST(s.apply_lag_s, excluded.apply_lag_s)";

/// The quarter hour holding now, aligned to the Unix epoch.
const THIS_QUARTER: &str = "date_bin('15 minutes', now(), TIMESTAMPTZ '1970-01-01 00:00:00+00')";

/// Samples the apply lag of every endpoint with stored messages above its apply cursor (the
/// age of the oldest), in one statement: into the minute's row, which keeps the most any
/// sample of the minute saw, and into the quarter hour's row with the endpoint's numbers now.
/// Minute rows older than two hours go. Returns (endpoints sampled, rows deleted). An endpoint
/// with nothing waiting is only read; one being deleted is not sampled (its purge deletes its
/// samples). Any number of sequencer processes may run it at once.
pub async fn sample(pool: &PgPool) -> Result<(u64, u64), StoreError> {
    let (sampled, forgotten): (i64, i64) = sqlx::query_as(&format!(
        "WITH waiting AS (
             SELECT n.endpoint_id, e.tenant_id, n.last_arrival_seq,
                    COALESCE(k.epoch, 1) AS change_epoch, COALESCE(k.last, 0) AS changes_through,
                    GREATEST(EXTRACT(EPOCH FROM now() - w.received_at)::float8, 0) AS lag
             FROM endpoint_arrival_counters n
             JOIN webhook_endpoints e ON e.id = n.endpoint_id
             LEFT JOIN endpoint_apply_cursors c ON c.endpoint_id = n.endpoint_id
             LEFT JOIN endpoint_change_counters k ON k.endpoint_id = n.endpoint_id
             CROSS JOIN LATERAL (
                 SELECT m.received_at FROM messages m
                 WHERE m.endpoint_id = n.endpoint_id
                   AND m.arrival_seq > COALESCE(c.applied_arrival_seq, 0)
                 ORDER BY m.arrival_seq LIMIT 1
             ) w
             WHERE n.last_arrival_seq > COALESCE(c.applied_arrival_seq, 0)
               AND e.status <> 'deleting'
         ),
         sampled AS (
             INSERT INTO endpoint_lag_samples AS s (endpoint_id, minute, tenant_id, apply_lag_s)
             SELECT endpoint_id, date_trunc('minute', now()), tenant_id, lag FROM waiting
             ON CONFLICT (endpoint_id, minute) DO UPDATE
                 SET apply_lag_s = GREATEST(s.apply_lag_s, excluded.apply_lag_s)
             RETURNING 1
         ),
         quartered AS (
             INSERT INTO endpoint_activity_samples AS s
                 (endpoint_id, quarter, tenant_id, arrivals_through, change_epoch,
                  changes_through, apply_lag_s)
             SELECT endpoint_id, {THIS_QUARTER}, tenant_id, last_arrival_seq, change_epoch,
                    changes_through, lag
             FROM waiting
             {QUARTER_UPSERT}
         ),
         forgotten AS (
             DELETE FROM endpoint_lag_samples WHERE minute < now() - interval '2 hours'
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM sampled), (SELECT count(*) FROM forgotten)"
    ))
    .fetch_one(pool)
    .await?;
    Ok((sampled as u64, forgotten as u64))
}

/// Samples every endpoint's numbers (its arrival counter, change epoch and counter) into the
/// quarter hour's row, in one statement; an endpoint whose numbers are those of its latest row
/// writes nothing. Quarter rows older than eight days go, but each endpoint's latest (what its
/// next quarter's counts are taken against). Returns (endpoints written, rows deleted).
///
/// A quarter's counts are differences of numbers that only grow, so they are exact however
/// seldom this runs; how often only decides how near a quarter's edge a message may be counted
/// in the next one. Any number of sequencer processes may run it at once.
pub async fn sample_activity(pool: &PgPool) -> Result<(u64, u64), StoreError> {
    let (written, forgotten): (i64, i64) = sqlx::query_as(&format!(
        "WITH written AS (
             INSERT INTO endpoint_activity_samples AS s
                 (endpoint_id, quarter, tenant_id, arrivals_through, change_epoch,
                  changes_through, apply_lag_s)
             SELECT n.endpoint_id, {THIS_QUARTER}, e.tenant_id, n.last_arrival_seq,
                    COALESCE(k.epoch, 1), COALESCE(k.last, 0), 0
             FROM endpoint_arrival_counters n
             JOIN webhook_endpoints e ON e.id = n.endpoint_id
             LEFT JOIN endpoint_change_counters k ON k.endpoint_id = n.endpoint_id
             LEFT JOIN LATERAL (
                 SELECT p.arrivals_through, p.change_epoch, p.changes_through
                 FROM endpoint_activity_samples p WHERE p.endpoint_id = n.endpoint_id
                 ORDER BY p.quarter DESC LIMIT 1
             ) latest ON true
             WHERE e.status <> 'deleting'
               AND (latest.arrivals_through, latest.change_epoch, latest.changes_through)
                   IS DISTINCT FROM
                   (n.last_arrival_seq, COALESCE(k.epoch, 1), COALESCE(k.last, 0))
             {QUARTER_UPSERT}
             RETURNING 1
         ),
         forgotten AS (
             DELETE FROM endpoint_activity_samples old
             WHERE old.quarter < now() - interval '8 days'
               AND EXISTS (SELECT 1 FROM endpoint_activity_samples newer
                           WHERE newer.endpoint_id = old.endpoint_id
                             AND newer.quarter > old.quarter)
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM written), (SELECT count(*) FROM forgotten)"
    ))
    .fetch_one(pool)
    .await?;
    Ok((written as u64, forgotten as u64))
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
