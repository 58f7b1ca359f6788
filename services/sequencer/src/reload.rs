//! Running a reload: read every page of `/v1/feed` for the endpoint's selection until one pass's
//! pages agree on the reload's access_version, then merge the pass into the copy under the
//! reload's generation, in one transaction that first checks the reload is still the track's
//! (a newer reset replaces it: "stop: its reload replaces this one").
//!
//! The worker keeps applying messages while this runs ("While you read, keep applying the
//! messages that follow"); the merge's rule keeps what those wrote.

use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_rules::{check_pages, PagesCheck, Reload};
use relay_store::copy;
use sqlx::PgPool;

use crate::apply::{ApplyError, EndpointContext};
use crate::metrics::SequencerMetrics;
use crate::state::{self, FEED_TRACK};
use crate::upstream::{self, FeedPass, UpstreamError};

/// How a reload ended in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadEnd {
    /// Merged: the copy is held under the pages' access_version.
    Merged { items: usize, removed: usize },
    /// The track no longer runs this reload (a newer one replaced it, or it was merged).
    Superseded,
    /// The fence moved on: another worker owns the endpoint and runs the reload there.
    Fenced,
}

/// Pauses between passes that cannot merge: from `first` doubling up to `max`.
#[derive(Debug, Clone, Copy)]
pub struct ReloadBackoff {
    pub first: Duration,
    pub max: Duration,
}

impl Default for ReloadBackoff {
    fn default() -> Self {
        Self {
            first: Duration::from_millis(50),
            max: Duration::from_secs(5),
        }
    }
}

/// Runs `reload` until it is merged or no longer the track's. Errors of the upstream are retried
/// with backoff for as long as the reload is the track's: a reload is never given up, since the
/// copy cannot be right without it.
pub async fn run_reload(
    pool: &PgPool,
    ctx: &Arc<EndpointContext>,
    token: i64,
    reload: &Reload,
    backoff: ReloadBackoff,
    metrics: &SequencerMetrics,
) -> Result<ReloadEnd, ApplyError> {
    let endpoint = ctx.id();
    let started = Instant::now();
    let mut pause = backoff.first;
    let mut passes = 0u32;
    loop {
        let track = state::peek_track(pool, endpoint, FEED_TRACK).await?;
        if track.reload.as_ref() != Some(reload) {
            return Ok(ReloadEnd::Superseded);
        }
        passes += 1;
        match read_pass(ctx).await {
            Ok(pass) => {
                upstream::record_success(pool, ctx.tenant(), endpoint).await?;
                let pages = pass.page_access_versions.iter().map(String::as_str);
                match check_pages(reload.access_version.as_deref(), pages) {
                    PagesCheck::Agree => {
                        let read_s = started.elapsed().as_secs_f64();
                        metrics
                            .reload_duration
                            .with_label_values(&["read"])
                            .observe(read_s);
                        let end = merge(pool, ctx, token, reload, &pass).await?;
                        metrics
                            .reload_duration
                            .with_label_values(&["total"])
                            .observe(started.elapsed().as_secs_f64());
                        if let ReloadEnd::Merged { items, removed } = &end {
                            tracing::info!(%endpoint, generation = reload.generation, items,
                                removed, passes, read_s, "reload merged");
                        }
                        return Ok(end);
                    }
                    PagesCheck::ReadAgain => {
                        tracing::debug!(%endpoint, passes, "pages disagree: reading again");
                    }
                    PagesCheck::OtherAccessVersion { pages } => {
                        // The access changed again after the message that began this reload: the
                        // upstream sends a message (or reset) under the new one, which replaces
                        // or re-aims this reload. Until then, keep reading.
                        tracing::info!(%endpoint, passes, pages,
                            wanted = ?reload.access_version, "pages under another access_version");
                    }
                }
            }
            Err(UpstreamError::CursorExpired) => {
                tracing::debug!(%endpoint, passes, "feed cursor expired: reading again");
            }
            Err(error) => {
                tracing::warn!(%endpoint, passes, %error, kind = error.kind(), "reload read failed");
                upstream::record_failure(pool, ctx.tenant(), endpoint, &error).await?;
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(backoff.max);
    }
}

async fn read_pass(ctx: &EndpointContext) -> Result<FeedPass, UpstreamError> {
    let upstream = ctx
        .upstream
        .as_ref()
        .map_err(|_| UpstreamError::NotConfigured)?;
    // "read the endpoint's filter and language as they are now".
    let selection = upstream.selection(ctx.id()).await?;
    ctx.set_selection(selection.clone()).await;
    upstream.read_feed(&selection).await
}

/// Rule "Then merge the read into the copy under the reset's generation ... Then remove
/// everything held from an older generation", in one transaction, only while `reload` is still
/// the track's running reload.
async fn merge(
    pool: &PgPool,
    ctx: &EndpointContext,
    token: i64,
    reload: &Reload,
    pass: &FeedPass,
) -> Result<ReloadEnd, ApplyError> {
    let (tenant, endpoint) = (ctx.tenant(), ctx.id());
    let mut tx = pool.begin().await?;
    let Some(track) = state::open_track(&mut tx, tenant, endpoint, token, FEED_TRACK).await? else {
        return Ok(ReloadEnd::Fenced);
    };
    if track.reload.as_ref() != Some(reload) {
        return Ok(ReloadEnd::Superseded);
    }
    let written =
        copy::merge_read_items(&mut tx, tenant, endpoint, reload.generation, &pass.items).await?;
    let removed = copy::drop_older_generations(&mut tx, tenant, endpoint, reload.generation)
        .await?
        .len();
    let access_version = &pass.page_access_versions[0];
    let next = track.reload_merged(reload, access_version);
    state::save_track(&mut tx, tenant, endpoint, FEED_TRACK, &next).await?;
    tx.commit().await?;
    Ok(ReloadEnd::Merged {
        items: written,
        removed,
    })
}
