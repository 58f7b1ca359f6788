//! The feed's source kind ([`FeedSource`]): runs of messages decided whole by relay-rules'
//! `decide_run` (group commit through the batcher), and beside them the reload the endpoint's
//! track holds, read from `/v1/feed` ([`crate::reload`]).

use std::sync::Arc;
use std::time::Duration;

use relay_rules::Reload;
use relay_store::cursors::{self, PendingMessage};
use relay_store::endpoints::EndpointRegistration;
use relay_store::{tracks, EndpointId};
use tokio::sync::watch;
use tokio::task::{JoinError, JoinHandle};

use crate::apply::{ApplyError, EndpointContext};
use crate::reload::{run_reload, ReloadEnd};
use crate::source::{Applied, JobEnded, Owned, SourceKind};
use crate::worker::announce;

/// A feed endpoint, owned.
pub(crate) struct FeedSource {
    ctx: Arc<EndpointContext>,
}

impl SourceKind for FeedSource {
    type Job = Reload;
    type End = ReloadEnd;

    async fn open(
        registration: EndpointRegistration,
        http: relay_netguard::GuardedClient,
        owned: &Owned<'_>,
    ) -> Result<Self, ApplyError> {
        tracks::ensure(owned.pool, registration.tenant_id, registration.id).await?;
        let ctx = EndpointContext::new(registration, http)
            .with_feed_page_limit(owned.config.feed_page_limit)
            .with_reloads(owned.config.reloads.clone());
        Ok(Self { ctx: Arc::new(ctx) })
    }

    fn id(&self) -> EndpointId {
        self.ctx.id()
    }

    fn update(&mut self, registration: &EndpointRegistration) {
        self.ctx.update(registration);
    }

    async fn apply_run(
        &mut self,
        owned: &Owned<'_>,
        moves: (i64, i64),
        pending: Vec<PendingMessage>,
    ) -> Result<Applied, ApplyError> {
        let Owned {
            pool,
            token,
            config,
            metrics,
        } = *owned;
        // Counted from now (before the parse and any refetch read) so that a transaction being
        // gathered can wait for this run, as for the others woken with it.
        let coming = config.feed_runs.coming();
        let run =
            crate::apply::prepare_run(pool, &self.ctx, token, moves, pending, metrics).await?;
        // The batcher announces the changes of every run it committed, together.
        let report = config.feed_runs.apply(run, coming).await?;
        Ok(Applied {
            messages: report.messages,
            job_pending: report.reload_pending,
        })
    }

    async fn skip_gaps(
        &mut self,
        owned: &Owned<'_>,
        (applied, counter): (i64, i64),
    ) -> Result<(), ApplyError> {
        let endpoint = self.ctx.id();
        let mut tx = owned.pool.begin().await?;
        if !relay_coord::check_fence(&mut tx, endpoint, owned.token).await? {
            return Err(ApplyError::Fenced);
        }
        if !cursors::advance_cursor(&mut tx, self.ctx.tenant(), endpoint, applied, counter, None)
            .await?
        {
            return Err(ApplyError::CursorMoved);
        }
        tx.commit().await?;
        Ok(())
    }

    async fn quarantine(
        &mut self,
        owned: &Owned<'_>,
        next: (i64, i64),
        why: (u32, String),
    ) -> Result<(), ApplyError> {
        crate::apply::quarantine_failing(
            owned.pool,
            &self.ctx,
            owned.token,
            next,
            why,
            owned.metrics,
        )
        .await
    }

    /// The reload the track holds now (a message may have begun or replaced it, and the
    /// control plane's rewind may have begun one). Read when it can have changed: messages
    /// left a reload pending, one is running, or the worker was woken with no message to
    /// apply (the sweep wakes endpoints whose track holds a reload). Otherwise none.
    async fn wanted(
        &mut self,
        owned: &Owned<'_>,
        applied: &Applied,
        running: Option<&Reload>,
    ) -> Result<Option<Reload>, ApplyError> {
        if applied.job_pending || running.is_some() || applied.messages == 0 {
            Ok(tracks::peek(owned.pool, self.ctx.id()).await?.reload)
        } else {
            Ok(None)
        }
    }

    /// A reload stops when the track no longer holds it (a newer one replaced it, or it was
    /// merged): never inside its merge, which checks under the lock that it is still the
    /// track's.
    fn supersedes(running: &Reload, wanted: Option<&Reload>) -> bool {
        !wanted.is_some_and(|wanted| wanted.is(running))
    }

    fn can_start(&self) -> bool {
        self.ctx.has_upstream()
    }

    /// Also the path by which a reload begun and not merged starts again after a restart: the
    /// track says one is running, and nothing here runs it.
    fn start(
        &self,
        owned: &Owned<'_>,
        reload: Reload,
        stop: watch::Receiver<bool>,
    ) -> JoinHandle<Result<ReloadEnd, ApplyError>> {
        owned.metrics.reloads_running.inc();
        let (pool, ctx, metrics) = (owned.pool.clone(), self.ctx.clone(), owned.metrics.clone());
        let (token, retry) = (owned.token, owned.config.reload_retry);
        tokio::spawn(
            async move { run_reload(&pool, &ctx, token, &reload, retry, &metrics, stop).await },
        )
    }

    async fn ended(
        &mut self,
        owned: &Owned<'_>,
        end: Result<Result<ReloadEnd, ApplyError>, JoinError>,
    ) -> JobEnded {
        let (metrics, endpoint) = (owned.metrics, self.ctx.id());
        metrics.reloads_running.dec();
        let (label, ended) = match end {
            Ok(Ok(ReloadEnd::Merged { .. })) => {
                announce(owned.config, self.ctx.tenant(), endpoint).await;
                ("merged", JobEnded::Done)
            }
            Ok(Ok(ReloadEnd::Superseded)) => ("abandoned", JobEnded::Done),
            Ok(Ok(ReloadEnd::Fenced)) => ("abandoned", JobEnded::Fenced),
            Ok(Err(error)) => {
                tracing::warn!(%endpoint, %error, "reload failed; it starts again after a pause");
                ("abandoned", JobEnded::Failed)
            }
            Err(error) => {
                tracing::error!(%endpoint, %error,
                    "the reload task ended abnormally; it starts again after a pause");
                ("abandoned", JobEnded::Failed)
            }
        };
        metrics.reloads.with_label_values(&[label]).inc();
        ended
    }

    fn due_at(&self, _within: Duration) -> Option<tokio::time::Instant> {
        None
    }

    fn busy(&self, _idle_linger: Duration) -> bool {
        false
    }
}
