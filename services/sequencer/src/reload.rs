//! Running a reload: read every page of `/v1/feed` for the endpoint's selection, pass after pass,
//! and merge each pass relay-rules' [`decide_merge`](relay_rules::decide_merge) says to merge
//! (relay-store's `copy::merge`: one transaction that holds the endpoint and decides under its
//! lock), until the track no longer runs the reload.
//!
//! The worker keeps applying messages while this runs ("While you read, keep applying the
//! messages that follow"); the merge's rule keeps what those wrote. A reload is stopped between
//! statements, never inside its transaction: the worker asks it to stop ([`StopReload`]) and
//! awaits it, so no pooled connection is left inside an aborted transaction.

use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_netguard::RetryPolicy;
use relay_rules::{MergePlan, PagesCheck, Pass, Reload};
use relay_store::copy::{self, Merged};
use relay_store::tracks::{self, TrackClaim};
use sqlx::PgPool;
use tokio::sync::watch;

use crate::apply::{ApplyError, EndpointContext};
use crate::metrics::{SequencerMetrics, RELOAD_READ, RELOAD_TOTAL};
use crate::upstream::{self, UpstreamError};

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

/// The worker's hold on a running reload: asks it to stop at its next await outside a
/// transaction.
#[derive(Debug)]
pub struct StopReload(watch::Sender<bool>);

impl StopReload {
    pub fn new() -> (Self, watch::Receiver<bool>) {
        let (sender, receiver) = watch::channel(false);
        (Self(sender), receiver)
    }

    pub fn stop(&self) {
        self.0.send_replace(true);
    }
}

/// Waits until `stop` says stop (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// Runs `reload` until the track no longer runs it (merged, and no further pass asked for; or
/// replaced), or until `stop`. Errors of the upstream are retried with `retry`'s pauses for as
/// long as the reload is the track's: a reload is never given up, since the copy cannot be right
/// without it. A change of the endpoint's registration ends the pause at once (a rotated key or
/// a moved URL is tried without waiting out the backoff); while the registration names no
/// upstream, nothing is read until one does.
pub async fn run_reload(
    pool: &PgPool,
    ctx: &Arc<EndpointContext>,
    token: i64,
    reload: &Reload,
    retry: RetryPolicy,
    metrics: &SequencerMetrics,
    mut stop: watch::Receiver<bool>,
) -> Result<ReloadEnd, ApplyError> {
    let endpoint = ctx.id();
    let claim = TrackClaim {
        endpoint,
        tenant: ctx.tenant(),
        token,
    };
    let started = Instant::now();
    let mut changes = ctx.changes();
    let mut pauses = retry.pauses();
    let mut passes = 0u32;
    // What the passes merged here: `None` until one is.
    let mut merged: Option<(usize, usize)> = None;
    loop {
        let track = tracks::peek(pool, endpoint).await?;
        let Some(running) = track.reload.filter(|r| r.is(reload)) else {
            return Ok(match merged {
                Some((items, removed)) => ReloadEnd::Merged { items, removed },
                None => ReloadEnd::Superseded,
            });
        };
        passes += 1;
        let read = tokio::select! {
            read = read_pass(ctx, running.read_again) => read,
            _ = stopped(&mut stop) => return Ok(ReloadEnd::Superseded),
        };
        match read {
            Ok(pass) => {
                upstream::record_success(pool, ctx.tenant(), endpoint).await?;
                let read_s = started.elapsed().as_secs_f64();
                match copy::merge(pool, claim, reload, &pass).await? {
                    Merged::Merged { written, removed } => {
                        metrics
                            .reload_duration
                            .with_label_values(&[RELOAD_READ])
                            .observe(read_s);
                        metrics
                            .reload_duration
                            .with_label_values(&[RELOAD_TOTAL])
                            .observe(started.elapsed().as_secs_f64());
                        tracing::info!(%endpoint, generation = reload.generation, written,
                            removed, passes, read_s, "reload pass merged");
                        let (items, gone) = merged.unwrap_or_default();
                        merged = Some((items + written, gone + removed));
                        // The track says whether another pass follows (asked while this one
                        // was read): the loop's check reads it.
                        pauses = retry.pauses();
                        continue;
                    }
                    Merged::Fenced => return Ok(ReloadEnd::Fenced),
                    Merged::NotMerged(MergePlan::Superseded) => continue,
                    Merged::NotMerged(MergePlan::ReadAgain(PagesCheck::OtherAccessVersion {
                        pages,
                    })) => {
                        // The access changed again after the message that began this reload: the
                        // upstream sends a message (or reset) under the new one, which replaces
                        // or re-aims this reload. Until then, keep reading.
                        tracing::info!(%endpoint, passes, pages,
                            wanted = ?reload.access_version, "pages under another access_version");
                    }
                    Merged::NotMerged(_) => {
                        tracing::debug!(%endpoint, passes, "pages disagree: reading again");
                    }
                }
            }
            Err(UpstreamError::CursorExpired) => {
                tracing::debug!(%endpoint, passes, "feed cursor expired: reading again");
            }
            Err(UpstreamError::NotConfigured) => {
                // Every read would fail the same way: wait for the registration to change.
                tracing::info!(%endpoint, "the reload waits for the endpoint's upstream settings");
                tokio::select! {
                    changed = changes.changed() => if changed.is_err() {
                        return Ok(ReloadEnd::Superseded);
                    },
                    _ = stopped(&mut stop) => return Ok(ReloadEnd::Superseded),
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
            _ = stopped(&mut stop) => return Ok(ReloadEnd::Superseded),
            changed = changes.changed() => {
                if changed.is_ok() {
                    tracing::info!(%endpoint, "the endpoint's registration changed: reading again now");
                    pauses = retry.pauses();
                }
            }
        }
    }
}

/// One pass: the endpoint read as it is now ("read the endpoint's filter and language as they
/// are now"), then every page of `/v1/feed` with its selection. `read_again` is the reload's
/// count of asks when the pass began.
async fn read_pass(ctx: &EndpointContext, read_again: u32) -> Result<Pass, UpstreamError> {
    let upstream = ctx.upstream()?;
    let selection = upstream.selection(ctx.id()).await?;
    let feed = upstream.read_feed(&selection).await?;
    Ok(Pass {
        page_access_versions: feed.page_access_versions,
        items: feed.items,
        upstream_generation: selection.generation,
        read_again_at_start: read_again,
    })
}
