//! A stories endpoint, owned: its stored webhooks applied in arrival order, and beside them its
//! sync (seed 000): a removed ticker's stories taken out, a reload in full when one is needed,
//! an added ticker's stories loaded once, and catch-up from `GET /v1/events`.
//!
//! Webhooks and catch-up pages go through the same handler ([`write_events`]), the driver of
//! relay-rules' `decide_stories_run` as its doc says to drive it: fetch-on-notify reads before
//! the transaction, then one relay-store `StoriesWriter` transaction (fence checked, writer lock
//! held, held rows locked) in which the plan's writes run as seed 000's statements and the
//! message cursor, or the catch-up cursor, moves only from where it was read. Runs of stored
//! messages go through the batcher ([`PreparedStoriesRun`]): several endpoints' writers share one
//! transaction, each in a savepoint of it, so each run still commits or fails alone. A reload's writes
//! take the same writer lock, batch by batch, so webhooks keep being applied between them.
//!
//! A story read is tried a few times ([`StoryReadRetry`]); one that still fails does not hold
//! the cursor: the story is owed a read, recorded in the transaction that moves the cursor, and
//! each sync first reads the endpoint's owed stories whose time has come ([`pay_owed_reads`]).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use relay_netguard::RetryPolicy;
use relay_rules::{
    decide_stories_run, decide_ticker_sync, fetched_write, plan_writes, stories_of, StoriesMode,
    StoriesRun, StoryRead, StoryWrite, TickerStep, TickerSyncInput,
};
use relay_store::cursors::PendingMessage;
use relay_store::endpoints::{EndpointRegistration, Source, StoriesSettings};
use relay_store::stories::{self as store, PlanCause, PlanWritten, StoriesWriter};
use relay_store::{EndpointId, TenantId};
use relay_wire::StoryEvent;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::{JoinError, JoinHandle};

use crate::apply::{ApplyError, BatchReport};
use crate::batch::{apply_runs, BatchedRun};
use crate::metrics::SequencerMetrics;
use crate::reload::{BackingOff, FailingMark, Waiter};
use crate::source::{Applied, JobEnded, Owned, SourceKind};
use crate::upstream::{self, UpstreamClient, UpstreamError};
use crate::worker::{announce, WorkerConfig};

/// How a stories endpoint reads a story: `tries` reads at most, `pauses` between them, before
/// the story is owed a read; an owed read that fails again waits as `owed` says, from its first
/// pause to its longest (plus jitter), so a story the upstream keeps failing is asked for rarely.
#[derive(Debug, Clone, Copy)]
pub struct StoryReadRetry {
    pub tries: u32,
    pub pauses: RetryPolicy,
    pub owed: RetryPolicy,
}

/// Three tries in well under a second (a load balancer's 404 is usually one bad hop), then an
/// owed read retried by the sync from a second on, at most every five minutes (the default
/// catch-up interval).
pub const STORY_READ_RETRY: StoryReadRetry = StoryReadRetry {
    tries: 3,
    pauses: RetryPolicy {
        first: Duration::from_millis(25),
        max: Duration::from_millis(250),
    },
    owed: RetryPolicy {
        first: Duration::from_secs(1),
        max: Duration::from_secs(300),
    },
};

/// Owed reads one sync makes at most, the longest waiting first; the rest wait for the next.
const OWED_READS_PER_SYNC: i64 = 500;

/// One owned stories endpoint: its settings as last read, and its upstream client.
pub(crate) struct StoriesContext {
    id: EndpointId,
    tenant: TenantId,
    /// When the endpoint was registered: its claims notify only of events created since.
    registered_at: time::OffsetDateTime,
    http: relay_netguard::GuardedClient,
    page_limit: usize,
    state: RwLock<(StoriesSettings, Option<UpstreamClient>)>,
}

impl StoriesContext {
    fn new(
        registration: &EndpointRegistration,
        settings: StoriesSettings,
        http: relay_netguard::GuardedClient,
        page_limit: usize,
    ) -> Self {
        let context = Self {
            id: registration.id,
            tenant: registration.tenant_id,
            registered_at: registration.created_at,
            http,
            page_limit,
            state: RwLock::new((settings, None)),
        };
        context.update(registration);
        context
    }

    /// Takes the registration as it is now. A registration that is no longer a stories one
    /// cannot happen (the kind is fixed); it keeps the settings it had.
    fn update(&self, registration: &EndpointRegistration) {
        let client = UpstreamClient::new(
            self.http.clone(),
            registration.upstream_base_url.as_deref(),
            registration.upstream_api_key.as_ref(),
        )
        .ok()
        .map(|client| client.with_page_limit(self.page_limit));
        let mut state = self.state.write().expect("not poisoned");
        if let Source::Stories(settings) = &registration.source {
            state.0 = settings.clone();
        }
        state.1 = client;
    }

    fn settings(&self) -> StoriesSettings {
        self.state.read().expect("not poisoned").0.clone()
    }

    fn upstream(&self) -> Result<UpstreamClient, UpstreamError> {
        self.state
            .read()
            .expect("not poisoned")
            .1
            .clone()
            .ok_or(UpstreamError::NotConfigured)
    }

    fn has_upstream(&self) -> bool {
        self.state.read().expect("not poisoned").1.is_some()
    }

    async fn writer(
        &self,
        pool: &PgPool,
        token: i64,
    ) -> Result<StoriesWriter<'static>, ApplyError> {
        store::open(pool, self.tenant, self.id, token)
            .await?
            .ok_or(ApplyError::Fenced)
    }

    async fn failed(&self, pool: &PgPool, call: &str, error: &UpstreamError, m: &SequencerMetrics) {
        m.upstream_failures
            .with_label_values(&[call, error.kind()])
            .inc();
        if let Err(store_error) = upstream::record_failure(pool, self.tenant, self.id, error).await
        {
            tracing::debug!(endpoint = %self.id, %store_error, "could not record the failure");
        }
    }
}

/// What [`write_events`] moves when the events are applied.
enum Moves<'a> {
    /// Stored messages `(from, to]`, one event each, with their arrival numbers.
    Messages {
        from: i64,
        to: i64,
        seqs: &'a [i64],
        last_received_at: Option<time::OffsetDateTime>,
    },
    /// A catch-up page: the cursor from `from` to `to`.
    Page {
        from: Option<&'a str>,
        to: Option<&'a str>,
        caught_up: bool,
    },
}

/// What a run of events needs before its transaction: the endpoint's settings as they were,
/// the stories the events name, and in fetch-on-notify mode each one's read (a story whose
/// read failed is missing from `reads`, with the last error).
struct EventReads {
    settings: StoriesSettings,
    ids: Vec<String>,
    reads: HashMap<String, StoryRead>,
    last_error: String,
}

/// What one run of events wrote, counted once its transaction committed
/// ([`count_written`]).
struct EventsWritten {
    written: PlanWritten,
    owed: u64,
}

/// The reads a run of events needs, made before its transaction so that no lock is held across
/// HTTP (fetch-on-notify: each story the events name, each read tried as [`read_story`] says).
async fn read_events(
    pool: &PgPool,
    ctx: &StoriesContext,
    events: &[Result<StoryEvent, String>],
    config: &WorkerConfig,
    metrics: &SequencerMetrics,
) -> EventReads {
    let settings = ctx.settings();
    let mut ids: BTreeSet<String> = BTreeSet::new();
    for event in events.iter().flatten() {
        ids.extend(stories_of(event));
    }
    let mut reads = HashMap::new();
    let mut last_error = String::new();
    if settings.mode == StoriesMode::FetchOnNotify {
        match ctx.upstream() {
            Ok(client) => {
                for id in &ids {
                    match read_story(pool, ctx, &client, id, config, metrics).await {
                        Ok(read) => {
                            reads.insert(id.clone(), read);
                        }
                        Err(error) => last_error = error.to_string(),
                    }
                }
            }
            Err(error) => last_error = error.to_string(),
        }
    }
    EventReads {
        settings,
        ids: ids.into_iter().collect(),
        reads,
        last_error,
    }
}

/// The one handler of webhooks and catch-up pages, inside the endpoint's writer: held rows, the
/// rules' plan, its writes and claims, the reads that failed owed, the cursor moved. The caller
/// commits.
async fn write_events(
    writer: &mut StoriesWriter<'_>,
    ctx: &StoriesContext,
    events: &[Result<StoryEvent, String>],
    before: &EventReads,
    moves: Moves<'_>,
) -> Result<EventsWritten, ApplyError> {
    let held = writer.held(&before.ids).await?;
    let plan = decide_stories_run(StoriesRun {
        mode: before.settings.mode,
        events,
        held: &held,
        reads: &before.reads,
        tickers: Some(&before.settings.tickers),
        registered_at: Some(ctx.registered_at.unix_timestamp_nanos()),
    });
    let written = writer.write_plan(&plan, PlanCause::Events).await?;
    // The reads that failed are owed with the cursor's move: the cursor never waits on a read.
    writer.owe_reads(&plan.owed, &before.last_error).await?;
    let moved = match moves {
        Moves::Messages {
            from,
            to,
            seqs,
            last_received_at,
        } => {
            let outcomes: Vec<(i64, &str, i32)> = plan
                .outcomes
                .iter()
                .zip(seqs)
                .filter(|(outcome, _)| outcome.is_exception())
                .map(|(outcome, seq)| (*seq, outcome.as_str(), i32::from(outcome.applied())))
                .collect();
            to == from
                || writer
                    .messages_applied((from, to), last_received_at, &outcomes)
                    .await?
        }
        Moves::Page {
            from,
            to,
            caught_up,
        } => writer.move_cursor(from, to, caught_up).await?,
    };
    if !moved {
        return Err(ApplyError::CursorMoved);
    }
    Ok(EventsWritten {
        written,
        owed: plan.owed.len() as u64,
    })
}

/// A catch-up page applied: its reads, then its own transaction. The changes appended.
async fn apply_page(
    pool: &PgPool,
    ctx: &StoriesContext,
    token: i64,
    events: &[Result<StoryEvent, String>],
    moves: Moves<'_>,
    (config, metrics): (&WorkerConfig, &SequencerMetrics),
) -> Result<u64, ApplyError> {
    let before = read_events(pool, ctx, events, config, metrics).await;
    let mut writer = ctx.writer(pool, token).await?;
    let written = write_events(&mut writer, ctx, events, &before, moves).await?;
    let changes = writer.commit().await?;
    count_written(metrics, &written.written, written.owed);
    Ok(changes)
}

/// Counts what a committed transaction wrote: the plan's writes and claims, and the reads it
/// owed.
fn count_written(metrics: &SequencerMetrics, written: &PlanWritten, owed: u64) {
    for (label, count) in [
        ("saved", written.saved),
        ("unchanged", written.unchanged),
        ("closed", written.closed),
        ("already_closed", written.already_closed),
    ] {
        metrics
            .story_writes
            .with_label_values(&[label])
            .inc_by(count);
    }
    metrics.stories_notifications.inc_by(written.notified);
    metrics
        .stories_claims_silent
        .inc_by(written.claimed_silently);
    metrics
        .story_reads_owed
        .with_label_values(&["recorded"])
        .inc_by(owed);
}

/// A run of one stories endpoint's stored messages, one event each, with its reads made: ready
/// to apply beside other stories endpoints' runs.
pub(crate) struct PreparedStoriesRun {
    ctx: Arc<StoriesContext>,
    token: i64,
    /// The apply cursor the messages follow, and where it moves to.
    moves: (i64, i64),
    pending: Vec<PendingMessage>,
    events: Vec<Result<StoryEvent, String>>,
    before: EventReads,
    started: Instant,
}

impl PreparedStoriesRun {
    /// Parses the run's messages and makes the reads they need.
    async fn prepare(
        owned: &Owned<'_>,
        ctx: &Arc<StoriesContext>,
        moves: (i64, i64),
        pending: Vec<PendingMessage>,
    ) -> Self {
        let started = Instant::now();
        let events: Vec<Result<StoryEvent, String>> = pending
            .iter()
            .map(|m| StoryEvent::parse(&m.body).map_err(|e| e.to_string()))
            .collect();
        let before = read_events(owned.pool, ctx, &events, owned.config, owned.metrics).await;
        Self {
            ctx: ctx.clone(),
            token: owned.token,
            moves,
            pending,
            events,
            before,
            started,
        }
    }

    /// The run's writer nested in `tx` (a savepoint: an error rolls back this run only), its
    /// writes, and the savepoint released. What it wrote, and the changes appended.
    async fn write(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    ) -> Result<(EventsWritten, u64), ApplyError> {
        let Some(mut writer) =
            store::open(&mut *tx, self.ctx.tenant, self.ctx.id, self.token).await?
        else {
            return Err(ApplyError::Fenced);
        };
        let seqs: Vec<i64> = self.pending.iter().map(|m| m.arrival_seq).collect();
        let (from, to) = self.moves;
        let moves = Moves::Messages {
            from,
            to,
            seqs: &seqs,
            last_received_at: self.pending.last().map(|m| m.received_at),
        };
        let written =
            write_events(&mut writer, &self.ctx, &self.events, &self.before, moves).await?;
        let changes = writer.commit().await?;
        Ok((written, changes))
    }
}

impl BatchedRun for PreparedStoriesRun {
    fn key(&self) -> (TenantId, EndpointId) {
        (self.ctx.tenant, self.ctx.id)
    }

    fn pending(&self) -> &[PendingMessage] {
        &self.pending
    }

    /// One transaction, each run in a savepoint of it ([`PreparedStoriesRun::write`]): a run
    /// that fails (its fence moved on, its cursor moved, a statement refused what it holds) is
    /// rolled back and answered alone, and the others commit together.
    async fn apply_together(
        conn: &mut sqlx::PgConnection,
        runs: &[&Self],
        metrics: &SequencerMetrics,
    ) -> Result<Vec<Result<BatchReport, ApplyError>>, ApplyError> {
        let mut tx = sqlx::Connection::begin(conn).await?;
        let mut answers = Vec::with_capacity(runs.len());
        for run in runs {
            answers.push(run.write(&mut tx).await);
        }
        tx.commit().await?;
        let now = time::OffsetDateTime::now_utc();
        Ok(answers
            .into_iter()
            .zip(runs)
            .map(|(answer, run)| {
                let (written, changes) = answer?;
                count_written(metrics, &written.written, written.owed);
                metrics.observe_applied(run.started, &run.pending, now);
                Ok(BatchReport {
                    messages: run.pending.len(),
                    changes: usize::try_from(changes).unwrap_or(usize::MAX),
                    reload_pending: false,
                    appended: Vec::new(),
                })
            })
            .collect())
    }
}

/// `GET /v1/stories/{id}`, tried up to `config.story_reads.tries` times with jittered pauses
/// between: a read that failed is usually one bad hop, and retrying the read costs one request
/// where failing its run would cost the run. Each failure is recorded in the endpoint's state;
/// the last one is returned (the story is then owed a read).
async fn read_story(
    pool: &PgPool,
    ctx: &StoriesContext,
    client: &UpstreamClient,
    id: &str,
    config: &WorkerConfig,
    metrics: &SequencerMetrics,
) -> Result<StoryRead, UpstreamError> {
    let mut pauses = config.story_reads.pauses.pauses();
    let mut tries = 1;
    loop {
        match client.read_story(id).await {
            Ok(read) => {
                let answer = match read {
                    StoryRead::Found(_) => "found",
                    StoryRead::NotFound => "not_found",
                    StoryRead::Failed => "failed",
                };
                metrics.story_reads.with_label_values(&[answer]).inc();
                return Ok(read);
            }
            Err(error) => {
                metrics.story_reads.with_label_values(&["failed"]).inc();
                tracing::info!(endpoint = %ctx.id, story = id, tries, %error,
                    "reading a story failed");
                ctx.failed(pool, "story", &error, metrics).await;
                if tries >= config.story_reads.tries
                    || matches!(error, UpstreamError::TooLarge { .. })
                {
                    return Err(error);
                }
                tries += 1;
                metrics.story_reads_retried.inc();
                tokio::time::sleep(pauses.next_pause()).await;
            }
        }
    }
}

/// The endpoint's owed reads whose time has come (at most [`OWED_READS_PER_SYNC`]), read again:
/// each story read is saved or closed as relay-rules' `plan_writes` plans it against its row
/// under the lock, and its owed row deleted, all in one transaction named by a round of its own
/// (the writes carried out whole, as a run's); one that fails
/// again waits longer (`config.story_reads.owed`), and ends this sync's owed reads.
async fn pay_owed_reads(
    pool: &PgPool,
    ctx: &StoriesContext,
    client: &UpstreamClient,
    token: i64,
    config: &WorkerConfig,
    metrics: &SequencerMetrics,
) -> Result<(), ApplyError> {
    let due = store::owed_reads_due(pool, ctx.id, OWED_READS_PER_SYNC).await?;
    let mut paid = Vec::with_capacity(due.len());
    for owed in due {
        let id = owed.story_id.clone();
        let (reads, error, failed) = match read_story(pool, ctx, client, &id, config, metrics).await
        {
            Ok(read) => (HashMap::from([(id.clone(), read)]), String::new(), false),
            Err(error @ UpstreamError::TooLarge { .. }) => return Err(ApplyError::Upstream(error)),
            Err(error) => (HashMap::new(), error.to_string(), true),
        };
        match fetched_write(id, &reads) {
            Ok(write) => paid.push((owed, write)),
            Err(id) => {
                let retry = config.story_reads.owed;
                let attempts = u32::try_from(owed.attempts).unwrap_or(0);
                let pause =
                    relay_rules::owed_read_pause(attempts, retry.first, retry.max, rand::random());
                store::owed_read_failed(pool, ctx.id, &id, &error, owed.attempts, pause).await?;
                metrics
                    .story_reads_owed
                    .with_label_values(&["failing"])
                    .inc();
            }
        }
        if failed {
            // The upstream failed this read through all its tries: the reads after it wait for
            // a later sync (still owed, due as they were) rather than each holding the
            // tenant's reload slot through tries and timeouts of its own against an upstream
            // failing now.
            break;
        }
    }
    if paid.is_empty() {
        return Ok(());
    }
    // A new endpoint can owe a read (from a webhook) before its first sync made its sync row,
    // which the round is counted in.
    store::sync_state(pool, ctx.tenant, ctx.id).await?;
    let round = store::begin_round(pool, ctx.id, false).await?;
    let ids: Vec<String> = paid.iter().map(|(owed, _)| owed.story_id.clone()).collect();
    let mut writer = ctx.writer(pool, token).await?;
    let held = writer.held(&ids).await?;
    let plan = plan_writes(&held, paid.iter().map(|(_, write)| write.clone()));
    let written = writer.write_plan(&plan, PlanCause::Round(round)).await?;
    let mut done = 0;
    for (owed, _) in &paid {
        if writer.pay_read(owed).await? {
            done += 1;
        }
    }
    if writer.commit().await? > 0 {
        announce(config, ctx.tenant, ctx.id).await;
    }
    count_written(metrics, &written, 0);
    metrics
        .story_reads_owed
        .with_label_values(&["done"])
        .inc_by(done);
    Ok(())
}

/// How a sync ended.
pub(crate) enum SyncEnd {
    /// Caught up with `GET /v1/events` (after whatever reload and ticker loads it needed).
    CaughtUp,
    /// Stopped by its worker, between two of its transactions.
    Stopped,
}

/// One sync: owed reads paid, then relay-rules' `decide_ticker_sync` steps in order (removed
/// tickers dropped, a reload in full if needed, else added tickers loaded), then catch-up to the end of `GET /v1/events`. It runs under one of the process's reload slots
/// and reads within one pass's budget (`RELAY_SEQUENCER_MAX_RELOAD_BYTES`), as a feed reload's
/// pass does: a reload in full holds its listing until it is done, and a catch-up past the
/// budget ends as `too_large`, its pages so far applied, to go on from there after a pause.
async fn sync(
    pool: PgPool,
    ctx: Arc<StoriesContext>,
    token: i64,
    config: WorkerConfig,
    metrics: SequencerMetrics,
) -> Result<SyncEnd, ApplyError> {
    let client = ctx.upstream().map_err(ApplyError::Upstream)?;
    let waiter = Waiter {
        pool: &pool,
        tenant: ctx.tenant,
        endpoint: ctx.id,
        token,
    };
    let (_reading, budget) = config.reloads.take(waiter, &metrics).await;
    let client = client.with_budget(budget);
    pay_owed_reads(&pool, &ctx, &client, token, &config, &metrics).await?;
    let state = store::sync_state(&pool, ctx.tenant, ctx.id).await?;
    let tickers = ctx.settings().tickers;
    let steps = decide_ticker_sync(TickerSyncInput {
        wanted: &tickers,
        loaded: &state.loaded_tickers,
        reload_needed: state.reload_needed,
    })
    .steps;
    for step in &steps {
        match step {
            TickerStep::Drop { tickers, loaded } => {
                let round = store::begin_round(&pool, ctx.id, false).await?;
                let mut writer = ctx.writer(&pool, token).await?;
                writer.drop_tickers(tickers, round).await?;
                writer.set_loaded_tickers(loaded).await?;
                if writer.commit().await? > 0 {
                    announce(&config, ctx.tenant, ctx.id).await;
                }
            }
            TickerStep::ReloadInFull { tickers } => {
                reload_in_full(&pool, &ctx, &client, token, tickers, &config, &metrics).await?;
            }
            TickerStep::Load { tickers, loaded } => {
                let round = store::begin_round(&pool, ctx.id, false).await?;
                for ticker in tickers {
                    list_and_save(
                        &pool, &ctx, &client, token, ticker, round, &config, &metrics,
                    )
                    .await?;
                }
                let mut writer = ctx.writer(&pool, token).await?;
                writer.set_loaded_tickers(loaded).await?;
                writer.commit().await?;
            }
        }
    }
    catch_up(&pool, &ctx, &client, token, &config, &metrics).await
}

/// Catch-up: pages of `GET /v1/events` from the saved cursor, each applied by the webhooks'
/// handler with the cursor saved in the same transaction. A 410 means a reload in full, then
/// catch-up from the start of the window.
///
/// Rules: S-410-RELOAD (services/rules/RULES.md).
async fn catch_up(
    pool: &PgPool,
    ctx: &Arc<StoriesContext>,
    client: &UpstreamClient,
    token: i64,
    config: &WorkerConfig,
    metrics: &SequencerMetrics,
) -> Result<SyncEnd, ApplyError> {
    let mut cursor = store::sync_state(pool, ctx.tenant, ctx.id).await?.cursor;
    loop {
        let page = match client.read_events(cursor.as_deref()).await {
            Ok(page) => page,
            Err(UpstreamError::CursorExpired) => {
                tracing::info!(endpoint = %ctx.id, "the catch-up cursor expired: reloading in full");
                store::need_reload(pool, ctx.id).await?;
                let tickers = ctx.settings().tickers;
                reload_in_full(pool, ctx, client, token, &tickers, config, metrics).await?;
                cursor = None;
                continue;
            }
            Err(error) => {
                ctx.failed(pool, "events", &error, metrics).await;
                return Err(ApplyError::Upstream(error));
            }
        };
        metrics.stories_catch_up_pages.inc();
        // Past the last page the cursor stays after its last event, for the next catch-up.
        let next = page.next_cursor.clone().or_else(|| cursor.clone());
        let changes = apply_page(
            pool,
            ctx,
            token,
            &page.events,
            Moves::Page {
                from: cursor.as_deref(),
                to: next.as_deref(),
                caught_up: !page.has_more,
            },
            (config, metrics),
        )
        .await?;
        if changes > 0 {
            announce(config, ctx.tenant, ctx.id).await;
        }
        cursor = next;
        if !page.has_more {
            if let Err(error) = upstream::record_success(pool, ctx.tenant, ctx.id).await {
                tracing::debug!(endpoint = %ctx.id, %error, "could not record the success");
            }
            return Ok(SyncEnd::CaughtUp);
        }
    }
}

/// Seed 000's reload in full over `tickers`, recorded as loaded when it finishes: 1. each
/// ticker's stories listed and saved; 2. each story the copy holds open that the listing did
/// not return fetched (saved, or closed on 404); 3. the cursor cleared (catch-up then starts
/// from the window's start). Closed rows and claims stay.
/// A step-two read that still fails after its tries is owed, recorded with the reload's end.
async fn reload_in_full(
    pool: &PgPool,
    ctx: &Arc<StoriesContext>,
    client: &UpstreamClient,
    token: i64,
    tickers: &[String],
    config: &WorkerConfig,
    metrics: &SequencerMetrics,
) -> Result<(), ApplyError> {
    let started = Instant::now();
    let round = store::begin_round(pool, ctx.id, true).await?;
    let mut listed = HashSet::new();
    let (mut owed, mut last_error) = (Vec::new(), String::new());
    for ticker in tickers {
        listed
            .extend(list_and_save(pool, ctx, client, token, ticker, round, config, metrics).await?);
    }
    let mut after: Option<String> = None;
    loop {
        let open = store::open_ids(pool, ctx.id, after.as_deref(), STEP_TWO_BATCH).await?;
        let Some(last) = open.last().cloned() else {
            break;
        };
        let unlisted: Vec<String> = open.into_iter().filter(|id| !listed.contains(id)).collect();
        let mut writes = Vec::with_capacity(unlisted.len());
        let mut reads = HashMap::with_capacity(unlisted.len());
        // A few reads at once: they are independent, and one at a time the reload waits on
        // each round trip in turn. The pass's budget bounds what they hold together.
        let mut answers = Vec::with_capacity(unlisted.len());
        {
            let mut to_read = unlisted.iter();
            let mut reading = futures::stream::FuturesUnordered::new();
            loop {
                while reading.len() < STEP_TWO_READS_AT_ONCE {
                    let Some(id) = to_read.next() else { break };
                    reading.push(async move {
                        (
                            id.clone(),
                            read_story(pool, ctx, client, id, config, metrics).await,
                        )
                    });
                }
                match reading.next().await {
                    Some(answer) => answers.push(answer),
                    None => break,
                }
            }
        }
        for (id, answer) in answers {
            match answer {
                Ok(read) => {
                    reads.insert(id, read);
                }
                // The pass's budget is spent: the reload stops, as a listing's would.
                Err(error @ UpstreamError::TooLarge { .. }) => {
                    return Err(ApplyError::Upstream(error))
                }
                Err(error) => last_error = error.to_string(),
            }
        }
        for id in unlisted {
            match fetched_write(id, &reads) {
                Ok(write) => writes.push(write),
                Err(id) => owed.push(id),
            }
        }
        write_round(pool, ctx, token, round, &writes, config, metrics).await?;
        after = Some(last);
    }
    let mut writer = ctx.writer(pool, token).await?;
    writer.set_loaded_tickers(tickers).await?;
    writer.owe_reads(&owed, &last_error).await?;
    let finished = writer.finish_reload(round).await?;
    writer.commit().await?;
    metrics
        .story_reads_owed
        .with_label_values(&["recorded"])
        .inc_by(owed.len() as u64);
    metrics
        .stories_reloads
        .with_label_values(&[if finished { "finished" } else { "superseded" }])
        .inc();
    tracing::info!(endpoint = %ctx.id, round, listed = listed.len(),
        seconds = started.elapsed().as_secs_f64(), "reloaded in full");
    Ok(())
}

/// The longest run of stored messages that joins other endpoints' runs in a shared transaction.
/// A stories run's statements are its own (each run in a savepoint, not one statement for all
/// runs as the feed's), so a shared transaction saves each run its transaction's fixed cost (a
/// connection, begin, commit and its WAL flush) but runs the runs one after another: worth it
/// for the short runs of a steady stream, not for a backlog's long runs, which apply in
/// transactions of their own, side by side.
const SHARED_RUN_MESSAGES: usize = 4;

/// Open stories the copy holds, read per step-two batch.
const STEP_TWO_BATCH: i64 = 500;

/// Step-two reads one reload makes at once (and the process runs at most
/// `RELAY_SEQUENCER_MAX_CONCURRENT_RELOADS` reloads).
const STEP_TWO_READS_AT_ONCE: usize = 8;

/// Lists a ticker's open stories page by page, each page saved in one transaction; the ids
/// listed.
#[allow(clippy::too_many_arguments)]
async fn list_and_save(
    pool: &PgPool,
    ctx: &Arc<StoriesContext>,
    client: &UpstreamClient,
    token: i64,
    ticker: &str,
    round: i64,
    config: &WorkerConfig,
    metrics: &SequencerMetrics,
) -> Result<Vec<String>, ApplyError> {
    let mut ids = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let (stories, next) = match client.list_stories(ticker, cursor.as_deref()).await {
            Ok(page) => page,
            Err(error) => {
                ctx.failed(pool, "stories", &error, metrics).await;
                return Err(ApplyError::Upstream(error));
            }
        };
        ids.extend(stories.iter().map(|s| s.id.clone()));
        let writes: Vec<StoryWrite> = stories.into_iter().map(StoryWrite::Save).collect();
        write_round(pool, ctx, token, round, &writes, config, metrics).await?;
        match next {
            Some(next) => cursor = Some(next),
            None => return Ok(ids),
        }
    }
}

/// A round's writes in one transaction, planned against the rows as held under the lock
/// (relay-rules' `plan_writes`, the same decisions `decide_stories_run` makes per write) and
/// carried out whole.
async fn write_round(
    pool: &PgPool,
    ctx: &StoriesContext,
    token: i64,
    round: i64,
    writes: &[StoryWrite],
    config: &WorkerConfig,
    metrics: &SequencerMetrics,
) -> Result<(), ApplyError> {
    if writes.is_empty() {
        return Ok(());
    }
    let ids: Vec<String> = writes.iter().map(|w| w.story_id().to_owned()).collect();
    let mut writer = ctx.writer(pool, token).await?;
    let held = writer.held(&ids).await?;
    let plan = plan_writes(&held, writes.to_vec());
    let written = writer.write_plan(&plan, PlanCause::Round(round)).await?;
    if writer.commit().await? > 0 {
        announce(config, ctx.tenant, ctx.id).await;
    }
    count_written(metrics, &written, 0);
    Ok(())
}

/// A sync that failed other than by an upstream read (each of those is recorded where it
/// failed): when Postgres refused what the upstream answered (a write of its stories), the
/// endpoint's state says so (`store`), as for a feed reload's merge.
async fn sync_failed(
    pool: &PgPool,
    ctx: &StoriesContext,
    error: &ApplyError,
    metrics: &SequencerMetrics,
) {
    if matches!(error, ApplyError::Upstream(_)) || !error.may_be_the_message() {
        return;
    }
    metrics
        .upstream_failures
        .with_label_values(&["stories_sync", upstream::STORE_REFUSED])
        .inc();
    let detail = format!("the stories sync's writes were refused: {error}");
    if let Err(store_error) = relay_store::upstream_status::record_failure(
        pool,
        ctx.tenant,
        ctx.id,
        upstream::STORE_REFUSED,
        &detail,
    )
    .await
    {
        tracing::debug!(endpoint = %ctx.id, %store_error, "could not record the failure");
    }
}

/// A stories endpoint, owned: its messages as they come, and a sync (owed reads, ticker sync,
/// catch-up) at once when one is due (the sweep wakes endpoints whose catch-up is due) and every
/// `catch_up_interval` while it stays owned.
pub(crate) struct StoriesSource {
    ctx: Arc<StoriesContext>,
    /// When the next sync is due.
    next_sync: tokio::time::Instant,
    last_message: Instant,
    catch_up_interval: Duration,
    /// While syncs keep failing, the endpoint counts as backing off, and its tenant's syncs and
    /// reloads take the failing lane's reload slots.
    backing_off: Option<(BackingOff, FailingMark)>,
}

/// A stories endpoint's background job: one sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sync;

impl SourceKind for StoriesSource {
    type Job = Sync;
    type End = SyncEnd;

    async fn open(
        registration: EndpointRegistration,
        http: relay_netguard::GuardedClient,
        owned: &Owned<'_>,
    ) -> Result<Self, ApplyError> {
        let Source::Stories(settings) = registration.source.clone() else {
            return Err(ApplyError::Store(relay_store::StoreError::Invalid(
                "not a stories endpoint".into(),
            )));
        };
        let (catch_up_interval, started_at) = owned.config.stories_catch_up;
        let ctx = StoriesContext::new(&registration, settings, http, owned.config.feed_page_limit);
        // A sync at once when one is due (the sweep's own condition); otherwise a worker
        // started for messages syncs after an interval, if it is still owned then.
        let due = store::due(owned.pool, catch_up_interval, started_at, Some(ctx.id), 1).await?;
        let next_sync = tokio::time::Instant::now()
            + if due.is_empty() {
                catch_up_interval
            } else {
                Duration::ZERO
            };
        Ok(Self {
            ctx: Arc::new(ctx),
            next_sync,
            last_message: Instant::now(),
            catch_up_interval,
            backing_off: None,
        })
    }

    fn id(&self) -> EndpointId {
        self.ctx.id
    }

    /// New tickers are loaded, removed ones dropped, by the next sync: now.
    fn update(&mut self, registration: &EndpointRegistration) {
        self.ctx.update(registration);
        self.next_sync = tokio::time::Instant::now();
    }

    async fn apply_run(
        &mut self,
        owned: &Owned<'_>,
        moves: (i64, i64),
        pending: Vec<PendingMessage>,
    ) -> Result<Applied, ApplyError> {
        let coming =
            (pending.len() <= SHARED_RUN_MESSAGES).then(|| owned.config.stories_runs.coming());
        let run = PreparedStoriesRun::prepare(owned, &self.ctx, moves, pending).await;
        let report = if let Some(coming) = coming {
            // The batcher announces the changes of every run it committed, together.
            owned.config.stories_runs.apply(run, coming).await?
        } else {
            let mut connection = relay_store::KeptConnection::new(owned.pool.clone());
            let report = apply_runs(&mut connection, vec![run], owned.metrics)
                .await
                .pop()
                .expect("one answer per run")?;
            if report.changes > 0 {
                announce(owned.config, self.ctx.tenant, self.ctx.id).await;
            }
            report
        };
        self.last_message = Instant::now();
        Ok(Applied {
            messages: report.messages,
            job_pending: false,
        })
    }

    async fn skip_gaps(&mut self, owned: &Owned<'_>, moves: (i64, i64)) -> Result<(), ApplyError> {
        let mut writer = self.ctx.writer(owned.pool, owned.token).await?;
        if !writer.messages_applied(moves, None, &[]).await? {
            return Err(ApplyError::CursorMoved);
        }
        writer.commit().await?;
        Ok(())
    }

    /// The message is set aside as a feed's is. What it said is not lost: its events are in
    /// the upstream's window, and catch-up reads them.
    async fn quarantine(
        &mut self,
        owned: &Owned<'_>,
        (applied, arrival_seq): (i64, i64),
        (attempts, error): (u32, String),
    ) -> Result<(), ApplyError> {
        let ctx = &self.ctx;
        let mut tx = owned.pool.begin().await?;
        if !relay_coord::check_fence(&mut tx, ctx.id, owned.token).await? {
            return Err(ApplyError::Fenced);
        }
        let reason = relay_rules::Unapplicable::KeepsFailing { attempts, error }.to_string();
        let attempts = i32::try_from(attempts).unwrap_or(i32::MAX);
        let moved = relay_store::runs::quarantine_next(
            &mut tx,
            (ctx.tenant, ctx.id),
            (applied, arrival_seq),
            (&reason, attempts),
            None,
        )
        .await?;
        if !moved {
            return Err(ApplyError::CursorMoved);
        }
        tx.commit().await?;
        tracing::warn!(endpoint = %ctx.id, arrival_seq, %reason, "stories message quarantined");
        owned
            .metrics
            .messages
            .with_label_values(&[relay_rules::Outcome::Quarantined.as_str()])
            .inc();
        Ok(())
    }

    async fn wanted(
        &mut self,
        _owned: &Owned<'_>,
        _applied: &Applied,
        running: Option<&Sync>,
    ) -> Result<Option<Sync>, ApplyError> {
        Ok((running.is_some() || tokio::time::Instant::now() >= self.next_sync).then_some(Sync))
    }

    /// A sync runs to its end: what it writes is each a whole transaction, and what it would
    /// do again next is the same.
    fn supersedes(_running: &Sync, _wanted: Option<&Sync>) -> bool {
        false
    }

    fn can_start(&self) -> bool {
        self.ctx.has_upstream()
    }

    /// Stopped between its transactions, a sync loses nothing (each is whole), so it is
    /// dropped where it waits.
    fn start(
        &self,
        owned: &Owned<'_>,
        _job: Sync,
        mut stop: watch::Receiver<bool>,
    ) -> JoinHandle<Result<SyncEnd, ApplyError>> {
        let (pool, ctx) = (owned.pool.clone(), self.ctx.clone());
        let (config, metrics) = (owned.config.clone(), owned.metrics.clone());
        let token = owned.token;
        tokio::spawn(async move {
            tokio::select! {
                end = sync(pool, ctx, token, config, metrics) => end,
                _ = stop.wait_for(|stop| *stop) => Ok(SyncEnd::Stopped),
            }
        })
    }

    async fn ended(
        &mut self,
        owned: &Owned<'_>,
        end: Result<Result<SyncEnd, ApplyError>, JoinError>,
    ) -> JobEnded {
        let endpoint = self.ctx.id;
        match end {
            Ok(Ok(SyncEnd::CaughtUp)) => {
                self.backing_off = None;
                self.next_sync = tokio::time::Instant::now() + self.catch_up_interval;
                JobEnded::Done
            }
            Ok(Ok(SyncEnd::Stopped)) => JobEnded::Done,
            Ok(Err(ApplyError::Fenced | ApplyError::CursorMoved)) => JobEnded::Fenced,
            Ok(Err(error)) => {
                sync_failed(owned.pool, &self.ctx, &error, owned.metrics).await;
                tracing::info!(%endpoint, %error, "the stories sync failed");
                self.backing_off.get_or_insert_with(|| {
                    (
                        BackingOff::new(owned.metrics, "stories_sync"),
                        owned.config.reloads.failing(self.ctx.tenant),
                    )
                });
                JobEnded::Failed
            }
            Err(error) => {
                tracing::error!(%endpoint, %error, "the stories sync ended abnormally");
                JobEnded::Failed
            }
        }
    }

    fn due_at(&self, within: Duration) -> Option<tokio::time::Instant> {
        (self.next_sync <= tokio::time::Instant::now() + within).then_some(self.next_sync)
    }

    fn busy(&self, idle_linger: Duration) -> bool {
        self.last_message.elapsed() < idle_linger
    }
}
