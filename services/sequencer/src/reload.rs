//! Running a reload: read every page of `/v1/feed` for the endpoint's selection until one pass's
//! pages agree on the reload's access_version, then merge the pass into the copy under the
//! reload's generation, in one transaction that first checks the reload is still the track's
//! (a newer reset replaces it: "stop: its reload replaces this one").
//!
//! The worker keeps applying messages while this runs ("While you read, keep applying the
//! messages that follow"); the merge's rule keeps what those wrote.

use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_netguard::RetryPolicy;
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

/// Pauses between passes that cannot merge (a failed read, pages that disagree), by default.
pub const RELOAD_RETRY: RetryPolicy = RetryPolicy {
    first: Duration::from_millis(50),
    max: Duration::from_secs(5),
};

/// Runs `reload` until it is merged or no longer the track's. Errors of the upstream are retried
/// with `retry`'s pauses for as long as the reload is the track's: a reload is never given up,
/// since the copy cannot be right without it. A change of the endpoint's registration ends the
/// pause at once (a rotated key or a moved URL is tried without waiting out the backoff); while
/// the registration names no upstream, nothing is read until one does.
pub async fn run_reload(
    pool: &PgPool,
    ctx: &Arc<EndpointContext>,
    token: i64,
    reload: &Reload,
    retry: RetryPolicy,
    metrics: &SequencerMetrics,
) -> Result<ReloadEnd, ApplyError> {
    let endpoint = ctx.id();
    let started = Instant::now();
    let mut changes = ctx.changes();
    let mut pauses = retry.pauses();
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
            Err(UpstreamError::NotConfigured) => {
                // Every read would fail the same way: wait for the registration to change.
                tracing::info!(%endpoint, "the reload waits for the endpoint's upstream settings");
                if changes.changed().await.is_err() {
                    return Ok(ReloadEnd::Superseded);
                }
                pauses = retry.pauses();
                continue;
            }
            Err(error) => {
                metrics
                    .upstream_failures
                    .with_label_values(&["reload", error.kind()])
                    .inc();
                tracing::warn!(%endpoint, passes, %error, kind = error.kind(), "reload read failed");
                upstream::record_failure(pool, ctx.tenant(), endpoint, &error).await?;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(pauses.next_pause()) => {}
            changed = changes.changed() => {
                if changed.is_ok() {
                    tracing::info!(%endpoint, "the endpoint's registration changed: reading again now");
                    pauses = retry.pauses();
                }
            }
        }
    }
}

async fn read_pass(ctx: &EndpointContext) -> Result<FeedPass, UpstreamError> {
    let upstream = ctx.upstream()?;
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
