//! An endpoint's activity over the last hour, day or week: the messages the front tier stored,
//! the changes the apply wrote, and the apply lag, in buckets, what the console's charts draw.
//!
//! - The hour, minute by minute, is counted from the rows themselves (`messages.received_at`,
//!   `changes.created_at`): each read scans at most [`ACTIVITY_ROWS`] of the endpoint's latest
//!   rows of each table, and says when that bound cut the hour short. Its lag is the
//!   sequencers' minute samples.
//! - The day (quarter hours) and the week (hours) are the sequencers' quarter-hour samples of
//!   the endpoint's arrival and change numbers (relay-store's `lag_samples`): a bucket's
//!   messages are how far the arrival number moved in it; at most 8 days' rows per endpoint,
//!   whatever its rate, so no bound cuts them.

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::Json;
use relay_store::lag_samples::{self, QuarterSample};
use relay_store::{changes, messages};
use serde::{Deserialize, Serialize};
use time::{Duration, OffsetDateTime};
use utoipa::ToSchema;

use super::{owned_endpoint, parse_endpoint_id, AppState, QueryArgs};
use crate::auth::TenantId;
use crate::error::{ApiError, ErrorBody};

/// The most rows of each table one read of the hour scans: an hour at about 14 messages a
/// second. An endpoint busier than that has its earliest minutes cut (`received_cut`,
/// `written_cut`).
const ACTIVITY_ROWS: i64 = 50_000;

/// How far back a chart reaches: the last `hour` by minute (the default), the last `day` by
/// quarter hour, or the last `week` by hour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ActivityWindow {
    Hour,
    Day,
    Week,
}

impl ActivityWindow {
    /// The width of a bucket and how many buckets the window holds.
    fn buckets(self) -> (Duration, i64) {
        match self {
            Self::Hour => (Duration::minutes(1), 60),
            Self::Day => (Duration::minutes(15), 96),
            Self::Week => (Duration::hours(1), 168),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ActivityView {
    pub window: ActivityWindow,
    /// Each bucket's width, in seconds: 60, 900 or 3600.
    pub bucket_s: i64,
    /// The window's first bucket; `buckets` holds every bucket from it to the current one.
    #[serde(with = "time::serde::rfc3339")]
    pub since: OffsetDateTime,
    pub buckets: Vec<BucketView>,
    /// The hour's buckets again, under the name this answer first had them (window `hour`
    /// only; read `buckets`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub minutes: Option<Vec<BucketView>>,
    /// The endpoint's latest messages the read may scan do not reach back to `since`: the
    /// earlier buckets' `received` are undercounted (window `hour` only).
    pub received_cut: bool,
    /// As `received_cut`, for `written`.
    pub written_cut: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct BucketView {
    /// The bucket's start.
    #[serde(with = "time::serde::rfc3339")]
    pub at: OffsetDateTime,
    /// Messages stored in it (duplicates of a stored message are not stored again).
    pub received: i64,
    /// Changes the apply wrote to the endpoint's stream in it.
    pub written: i64,
    /// The greatest apply lag sampled in it, in seconds: how long the oldest stored message
    /// not yet applied had waited; 0 when nothing was waiting when sampled.
    pub apply_lag_s: f64,
}

#[utoipa::path(
    get, path = "/v1/endpoints/{endpoint_id}/activity", tag = "reads",
    security(("bearer" = [])),
    params(
        ("endpoint_id" = Uuid, Path),
        ("window" = Option<ActivityWindow>, Query,
         description = "hour (default: 60 buckets of a minute), day (96 of a quarter hour) or \
                        week (168 of an hour)"),
    ),
    responses(
        (status = 200, body = ActivityView, description = "The endpoint's messages received, \
            changes written and greatest apply lag in each bucket of the window"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    )
)]
pub async fn endpoint_activity(
    State(state): State<AppState>,
    TenantId(tenant): TenantId,
    Path(endpoint_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<ActivityView>, ApiError> {
    let id = parse_endpoint_id(&endpoint_id)?;
    let query = QueryArgs::new(query, &["window"])?;
    let window = query
        .one_of::<ActivityWindow>("window", "hour, day or week")?
        .unwrap_or(ActivityWindow::Hour);
    owned_endpoint(&state.pool, tenant, id).await?;
    let (width, count) = window.buckets();
    let since = window_start(OffsetDateTime::now_utc(), width, count);
    let (buckets, received_cut, written_cut) = match window {
        ActivityWindow::Hour => {
            let (received, received_cut) =
                messages::arrivals_by_minute(&state.pool, id, since, ACTIVITY_ROWS).await?;
            let (written, written_cut) =
                changes::written_by_minute(&state.pool, id, since, ACTIVITY_ROWS).await?;
            let lags = lag_samples::by_minute(&state.pool, id, since).await?;
            let buckets = minute_buckets(since, count, &received, &written, &lags);
            (buckets, received_cut, written_cut)
        }
        ActivityWindow::Day | ActivityWindow::Week => {
            let samples = lag_samples::quarters(&state.pool, id, since).await?;
            (sampled_buckets(since, width, count, &samples), false, false)
        }
    };
    Ok(Json(ActivityView {
        window,
        bucket_s: width.whole_seconds(),
        since,
        minutes: (window == ActivityWindow::Hour).then(|| buckets.clone()),
        buckets,
        received_cut,
        written_cut,
    }))
}

/// The start of the first of `count` buckets of `width` ending with the one holding `now`
/// (buckets aligned to the Unix epoch, as the samples' quarter hours are).
fn window_start(now: OffsetDateTime, width: Duration, count: i64) -> OffsetDateTime {
    let width_s = width.whole_seconds();
    let now_s = now.unix_timestamp();
    let current = now_s - now_s.rem_euclid(width_s);
    OffsetDateTime::from_unix_timestamp(current - (count - 1) * width_s).unwrap_or(now)
}

/// The hour's minutes from the counts by minute and the lag samples.
fn minute_buckets(
    since: OffsetDateTime,
    count: i64,
    received: &[(OffsetDateTime, i64)],
    written: &[(OffsetDateTime, i64)],
    lags: &[(OffsetDateTime, f64)],
) -> Vec<BucketView> {
    let count_at = |counts: &[(OffsetDateTime, i64)], at: OffsetDateTime| {
        counts.iter().find(|(m, _)| *m == at).map_or(0, |(_, n)| *n)
    };
    (0..count)
        .map(|i| {
            let at = since + Duration::minutes(i);
            BucketView {
                at,
                received: count_at(received, at),
                written: count_at(written, at),
                apply_lag_s: lags
                    .iter()
                    .find(|(m, _)| *m == at)
                    .map_or(0.0, |(_, lag)| *lag),
            }
        })
        .collect()
}

/// The window's buckets from the endpoint's quarter-hour samples (oldest first, led by the
/// latest one before the window when there is one). A sample's messages are its arrival number
/// less the sample before it's (arrival numbers have no gaps; a quarter with no sample had no
/// arrival); its changes the same within one epoch, and all of its epoch's changes when a new
/// epoch began (numbered from 1 again). An endpoint's first sample counts from 0, as its
/// numbers do (an endpoint older than the samples has a first row far in the past holding its
/// numbers then). Each goes to the bucket holding its quarter.
fn sampled_buckets(
    since: OffsetDateTime,
    width: Duration,
    count: i64,
    samples: &[QuarterSample],
) -> Vec<BucketView> {
    let mut buckets: Vec<BucketView> = (0..count)
        .map(|i| BucketView {
            at: since + width * (i as i32),
            received: 0,
            written: 0,
            apply_lag_s: 0.0,
        })
        .collect();
    let mut before: Option<&QuarterSample> = None;
    for sample in samples {
        let (received, written) = match before {
            None => (sample.arrivals_through, sample.changes_through),
            Some(b) => (
                (sample.arrivals_through - b.arrivals_through).max(0),
                if sample.change_epoch == b.change_epoch {
                    (sample.changes_through - b.changes_through).max(0)
                } else {
                    sample.changes_through
                },
            ),
        };
        before = Some(sample);
        if sample.quarter < since {
            continue;
        }
        let index = ((sample.quarter - since).whole_seconds() / width.whole_seconds()) as usize;
        if let Some(bucket) = buckets.get_mut(index) {
            bucket.received += received;
            bucket.written += written;
            bucket.apply_lag_s = bucket.apply_lag_s.max(sample.apply_lag_s);
        }
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(s).unwrap()
    }

    fn sample(quarter: i64, arrivals: i64, epoch: i64, changes: i64, lag: f64) -> QuarterSample {
        QuarterSample {
            quarter: at(quarter),
            arrivals_through: arrivals,
            change_epoch: epoch,
            changes_through: changes,
            apply_lag_s: lag,
        }
    }

    #[test]
    fn windows_end_with_the_bucket_holding_now_and_align_to_the_epoch() {
        let now = at(1_800_000_123);
        let (width, count) = ActivityWindow::Day.buckets();
        let since = window_start(now, width, count);
        assert_eq!(since.unix_timestamp() % 900, 0);
        assert_eq!((now - since).whole_seconds() / 900, 95);
        let (width, count) = ActivityWindow::Week.buckets();
        let since = window_start(now, width, count);
        assert_eq!(since.unix_timestamp() % 3600, 0);
        assert_eq!((now - since).whole_hours(), 167);
    }

    #[test]
    fn sampled_buckets_count_what_moved_since_the_sample_before() {
        let q = 900;
        let since = at(100 * q);
        let samples = [
            // Before the window: what the first quarter is counted against.
            sample(98 * q, 40, 1, 30, 0.0),
            sample(100 * q, 45, 1, 33, 2.5),
            // Nothing sampled at 101: nothing came.
            sample(102 * q, 52, 1, 40, 0.0),
            // A new epoch: its changes are numbered from 1 again.
            sample(103 * q, 52, 2, 12, 7.0),
        ];
        let buckets = sampled_buckets(since, Duration::seconds(q), 4, &samples);
        let counts: Vec<_> = buckets
            .iter()
            .map(|b| (b.received, b.written, b.apply_lag_s))
            .collect();
        assert_eq!(
            counts,
            [(5, 3, 2.5), (0, 0, 0.0), (7, 7, 0.0), (0, 12, 7.0)]
        );
        // Hours: four quarters each.
        let hours = sampled_buckets(since, Duration::hours(1), 2, &samples);
        assert_eq!((hours[0].received, hours[0].written), (12, 22));
        assert_eq!(hours[0].apply_lag_s, 7.0);
    }

    #[test]
    fn an_endpoints_first_sample_counts_from_zero() {
        let samples = [sample(900, 12, 1, 9, 0.0), sample(1_800, 22, 1, 14, 0.0)];
        let buckets = sampled_buckets(at(900), Duration::seconds(900), 2, &samples);
        assert_eq!((buckets[0].received, buckets[0].written), (12, 9));
        assert_eq!((buckets[1].received, buckets[1].written), (10, 5));
    }
}
