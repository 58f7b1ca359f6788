//! A stories endpoint, owned: its stored webhooks applied in arrival order, and beside them its
//! sync (seed 000): a removed ticker's stories taken out, a reload in full when one is needed,
//! an added ticker's stories loaded once, and catch-up from `GET /v1/events`.
//!
//! Webhooks and catch-up pages go through the same handler ([`apply_events`]), the driver of
//! relay-rules' `decide_stories_run` as its doc says to drive it: fetch-on-notify reads before
//! the transaction, then one relay-store `StoriesWriter` transaction (fence checked, writer lock
//! held, held rows locked) in which the plan's writes run as seed 000's statements and the
//! message cursor, or the catch-up cursor, moves only from where it was read. A reload's writes
//! take the same writer lock, batch by batch, so webhooks keep being applied between them.
//!
//! A story read is tried a few times ([`StoryReadRetry`]); one that still fails does not hold
//! the cursor: the story is owed a read, recorded in the transaction that moves the cursor, and
//! each sync first reads the endpoint's owed stories whose time has come ([`pay_owed_reads`]).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use relay_coord::Owners;
use relay_netguard::RetryPolicy;
use relay_rules::{
    apply_write, decide_notify, decide_stories_run, decide_ticker_sync, fetched_write, stories_of,
    HeldStory, NotifyDecision, StoriesMode, StoriesRun, StoryRead, StoryWrite, TickerStep,
    TickerSyncInput,
};
use relay_store::endpoints::{self, EndpointRegistration, Source, StoriesSettings};
use relay_store::stories::{self as store, Cause, Claimed, StoriesWriter, StoryRow};
use relay_store::{cursors, EndpointId, TenantId};
use relay_wire::{Story, StoryEvent};
use sqlx::PgPool;
use tokio::task::JoinHandle;

use crate::apply::ApplyError;
use crate::metrics::SequencerMetrics;
use crate::reload::BackingOff;
use crate::slots::{Slot, Slots};
use crate::upstream::{self, UpstreamClient, UpstreamError};
use crate::worker::{announce, wait_or_stop, WorkerConfig, WorkerExit, WorkerSignal};

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
            registration.upstream_api_key.as_deref(),
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

    async fn writer(&self, pool: &PgPool, token: i64) -> Result<StoriesWriter, ApplyError> {
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

/// What [`apply_events`] moves when the events are applied.
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

/// What [`apply_events`] did.
struct EventsApplied {
    changes: u64,
}

/// The one handler of webhooks and catch-up pages: reads (fetch-on-notify), then one
/// transaction: held rows, the rules' plan, its writes and claims, the cursor moved.
async fn apply_events(
    pool: &PgPool,
    ctx: &StoriesContext,
    token: i64,
    events: &[Result<StoryEvent, String>],
    moves: Moves<'_>,
    (config, metrics): (&WorkerConfig, &SequencerMetrics),
) -> Result<EventsApplied, ApplyError> {
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
    let ids: Vec<String> = ids.into_iter().collect();
    let mut writer = ctx.writer(pool, token).await?;
    let held = writer.held(&ids).await?;
    let plan = decide_stories_run(StoriesRun {
        mode: settings.mode,
        events,
        held: &held,
        reads: &reads,
        tickers: Some(&settings.tickers),
    });
    for planned in &plan.writes {
        execute(
            &mut writer,
            &planned.write,
            planned.change.is_some(),
            Cause::Event(&planned.event_id),
            metrics,
        )
        .await?;
    }
    let (mut notified, mut silent) = (0, 0);
    for claim in &plan.claims {
        let (event, story) =
            claimed_story(events, &claim.event_id, &claim.story_id).ok_or_else(|| {
                ApplyError::Store(relay_store::StoreError::Invalid(format!(
                    "claim {} names no story of its event",
                    claim.key
                )))
            })?;
        let notify = decide_notify(event.created_at, ctx.registered_at) == NotifyDecision::Notify;
        match writer
            .claim_strong(row(story), &claim.event_id, notify)
            .await?
        {
            Claimed::Notified => notified += 1,
            Claimed::Silently => silent += 1,
            Claimed::Already => {}
        }
    }
    // The reads that failed are owed with the cursor's move: the cursor never waits on a read.
    writer.owe_reads(&plan.owed, &last_error).await?;
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
    let changes = writer.commit().await?;
    metrics.stories_notifications.inc_by(notified);
    metrics.stories_claims_silent.inc_by(silent);
    metrics
        .story_reads_owed
        .with_label_values(&["recorded"])
        .inc_by(plan.owed.len() as u64);
    Ok(EventsApplied { changes })
}

/// A claim's event and the snapshot it carries of its story (a `story.became_strong`'s
/// `data.story`).
fn claimed_story<'a>(
    events: &'a [Result<StoryEvent, String>],
    event_id: &str,
    story_id: &str,
) -> Option<(&'a StoryEvent, &'a Story)> {
    events.iter().flatten().find_map(|event| match &event.body {
        relay_wire::StoryEventBody::Snapshot { story, .. }
            if event.event_id == event_id && story.id == story_id =>
        {
            Some((event, story))
        }
        _ => None,
    })
}

fn row(story: &Story) -> StoryRow<'_> {
    StoryRow {
        id: &story.id,
        ticker: story.ticker.as_deref(),
        version: story.version,
        snapshot: &story.snapshot,
    }
}

/// One planned write, as seed 000's statement; `changes`: whether the plan says it changes the
/// row (the statement refuses to do otherwise).
async fn execute(
    writer: &mut StoriesWriter,
    write: &StoryWrite,
    changes: bool,
    cause: Cause<'_>,
    metrics: &SequencerMetrics,
) -> Result<(), ApplyError> {
    let label = match write {
        StoryWrite::Save(story) => {
            writer.save(row(story), cause, changes).await?;
            if changes {
                "saved"
            } else {
                "unchanged"
            }
        }
        StoryWrite::Close {
            story_id,
            version,
            merged_into,
        } => {
            writer
                .close((story_id, *version, merged_into.as_deref()), cause, changes)
                .await?;
            if changes {
                "closed"
            } else {
                "already_closed"
            }
        }
    };
    metrics.story_writes.with_label_values(&[label]).inc();
    Ok(())
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
/// each story read is saved or closed as `apply_write` decides against its row under the lock,
/// and its owed row deleted, all in one transaction named by a round of its own; one that fails
/// again waits longer (`config.story_reads.owed`).
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
        let (reads, error) = match read_story(pool, ctx, client, &id, config, metrics).await {
            Ok(read) => (HashMap::from([(id.clone(), read)]), String::new()),
            Err(error @ UpstreamError::TooLarge { .. }) => return Err(ApplyError::Upstream(error)),
            Err(error) => (HashMap::new(), error.to_string()),
        };
        match fetched_write(id, &reads) {
            Ok(write) => paid.push((owed, write)),
            Err(id) => {
                let retry = config.story_reads.owed;
                store::owed_read_failed(pool, ctx.id, &id, &error, (retry.first, retry.max))
                    .await?;
                metrics
                    .story_reads_owed
                    .with_label_values(&["failing"])
                    .inc();
            }
        }
    }
    if paid.is_empty() {
        return Ok(());
    }
    let round = store::begin_round(pool, ctx.id, false).await?;
    let ids: Vec<String> = paid.iter().map(|(owed, _)| owed.story_id.clone()).collect();
    let mut writer = ctx.writer(pool, token).await?;
    let mut held: HashMap<String, HeldStory> = writer.held(&ids).await?;
    let mut done = 0;
    for (owed, write) in &paid {
        let (after, change) = apply_write(held.get(&owed.story_id).copied(), write);
        execute(
            &mut writer,
            write,
            change.is_some(),
            Cause::Round(round),
            metrics,
        )
        .await?;
        held.insert(owed.story_id.clone(), after);
        if writer.pay_read(owed).await? {
            done += 1;
        }
    }
    if writer.commit().await? > 0 {
        announce(config, ctx.tenant, ctx.id).await;
    }
    metrics
        .story_reads_owed
        .with_label_values(&["done"])
        .inc_by(done);
    Ok(())
}

/// Applies every stored message available now, in arrival order (a fetch-on-notify read that
/// failed is owed, and does not hold the messages after it).
async fn apply_messages(
    pool: &PgPool,
    ctx: &StoriesContext,
    token: i64,
    cursor: &mut Option<i64>,
    config: &WorkerConfig,
    metrics: &SequencerMetrics,
) -> Result<usize, ApplyError> {
    let mut applied = match *cursor {
        Some(applied) => applied,
        None => cursors::applied_through(pool, ctx.id).await?,
    };
    let mut total = 0;
    loop {
        let (counter, pending) =
            cursors::pending_messages(pool, ctx.id, applied, config.messages_per_read).await?;
        if pending.is_empty() {
            if counter > applied {
                // Only gaps left (numbers a duplicate took and did not use): skip them.
                let writer = ctx.writer(pool, token).await?;
                let mut writer = writer;
                if !writer
                    .messages_applied((applied, counter), None, &[])
                    .await?
                {
                    return Err(ApplyError::CursorMoved);
                }
                writer.commit().await?;
                *cursor = Some(counter);
            }
            return Ok(total);
        }
        let complete = (pending.len() as i64) < config.messages_per_read;
        let last = pending.last().map_or(applied, |m| m.arrival_seq);
        let through = if complete { counter.max(last) } else { last };
        let events: Vec<Result<StoryEvent, String>> = pending
            .iter()
            .map(|m| StoryEvent::parse(&m.body).map_err(|e| e.to_string()))
            .collect();
        let seqs: Vec<i64> = pending.iter().map(|m| m.arrival_seq).collect();
        let result = apply_events(
            pool,
            ctx,
            token,
            &events,
            Moves::Messages {
                from: applied,
                to: through,
                seqs: &seqs,
                last_received_at: pending.last().map(|m| m.received_at),
            },
            (config, metrics),
        )
        .await;
        let done = match result {
            Ok(done) => done,
            Err(error) => {
                *cursor = None;
                return Err(error);
            }
        };
        if done.changes > 0 {
            announce(config, ctx.tenant, ctx.id).await;
        }
        total += events.len();
        applied = through;
        *cursor = Some(applied);
        if complete {
            return Ok(total);
        }
    }
}

/// How a sync ended.
enum SyncEnd {
    /// Caught up with `GET /v1/events` (after whatever reload and ticker loads it needed).
    CaughtUp,
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
    let (_reading, budget) = config.reloads.take(ctx.tenant, &metrics).await;
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
        let done = apply_events(
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
        if done.changes > 0 {
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
        for id in &unlisted {
            match read_story(pool, ctx, client, id, config, metrics).await {
                Ok(read) => {
                    reads.insert(id.clone(), read);
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

/// Open stories the copy holds, read per step-two batch.
const STEP_TWO_BATCH: i64 = 500;

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

/// A round's writes in one transaction, each decided against the row as held under the lock
/// (relay-rules' `apply_write`, the same decision `decide_stories_run` makes per write).
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
    let ids: Vec<String> = writes.iter().map(|w| written_id(w).to_owned()).collect();
    let mut writer = ctx.writer(pool, token).await?;
    let mut held: HashMap<String, HeldStory> = writer.held(&ids).await?;
    for write in writes {
        let id = written_id(write).to_owned();
        let (after, change) = apply_write(held.get(&id).copied(), write);
        execute(
            &mut writer,
            write,
            change.is_some(),
            Cause::Round(round),
            metrics,
        )
        .await?;
        held.insert(id, after);
    }
    if writer.commit().await? > 0 {
        announce(config, ctx.tenant, ctx.id).await;
    }
    Ok(())
}

fn written_id(write: &StoryWrite) -> &str {
    match write {
        StoryWrite::Save(story) => &story.id,
        StoryWrite::Close { story_id, .. } => story_id,
    }
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

/// Owns the stories endpoint if nobody else does, and works it until idle: messages as they
/// come, a sync at once when one is due (the sweep wakes endpoints whose catch-up is due) and
/// every `catch_up_interval` while it stays owned.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_stories_worker(
    pool: PgPool,
    owners: Owners,
    http: relay_netguard::GuardedClient,
    registration: EndpointRegistration,
    settings: StoriesSettings,
    signal: Arc<WorkerSignal>,
    (config, catch_up_interval, started_at): (WorkerConfig, Duration, time::OffsetDateTime),
    metrics: SequencerMetrics,
    stopping: Arc<AtomicBool>,
    (slots, slot): (Arc<Slots>, Slot),
) -> WorkerExit {
    let endpoint = registration.id;
    let tenant = registration.tenant_id;
    let mut permit = Some(slot);
    let mut wakes_seen = signal.wakes.load(Ordering::SeqCst);
    let exit = |wakes_seen| WorkerExit {
        endpoint: endpoint.0,
        wakes_seen,
    };
    let held = match owners.hold(endpoint.0).await {
        Ok(Some(held)) => held,
        Ok(None) => return exit(wakes_seen),
        Err(error) => {
            tracing::warn!(%endpoint, %error, "could not take the endpoint's lock");
            return exit(wakes_seen);
        }
    };
    metrics.endpoints_owned.inc();
    let token = held.token();
    let ctx = Arc::new(StoriesContext::new(
        &registration,
        settings,
        http,
        config.feed_page_limit,
    ));
    let mut cursor: Option<i64> = None;
    let mut syncing: Option<JoinHandle<Result<SyncEnd, ApplyError>>> = None;
    // A sync at once when one is due (the sweep's own condition); otherwise a worker started
    // for messages syncs after an interval, if it is still owned then.
    let due = store::due(&pool, catch_up_interval, started_at, Some(endpoint), 1).await;
    let mut next_sync = tokio::time::Instant::now()
        + if due.is_ok_and(|due| due.is_empty()) {
            catch_up_interval
        } else {
            Duration::ZERO
        };
    let mut last_message = Instant::now();
    // Failing syncs and failing reads each wait longer every time, with jitter, to the retry
    // policy's cap; a success starts them over.
    let mut sync_pauses = config.reload_retry.pauses();
    let mut read_pauses = config.reload_retry.pauses();
    let mut sync_backing_off: Option<BackingOff> = None;

    loop {
        if held.is_lost() {
            metrics.lock_losses.inc();
            tracing::warn!(%endpoint, "the endpoint's lock was lost: stopping");
            break;
        }
        if stopping.load(Ordering::SeqCst) {
            break;
        }
        if permit.is_none() {
            permit = Some(slots.take(tenant).await);
        }
        wakes_seen = signal.wakes.load(Ordering::SeqCst);
        if signal.take_registration_changed() {
            match endpoints::load_registration(&pool, endpoint).await {
                Ok(Some(registration)) => {
                    ctx.update(&registration);
                    // New tickers are loaded, removed ones dropped, by the next sync: now.
                    next_sync = tokio::time::Instant::now();
                }
                Ok(None) => break,
                Err(error) => {
                    tracing::warn!(%endpoint, %error, "reading the registration failed; retrying");
                    signal.registration_changed();
                    tokio::time::sleep(config.error_pause).await;
                    continue;
                }
            }
        }
        match apply_messages(&pool, &ctx, token, &mut cursor, &config, &metrics).await {
            Ok(applied) => {
                read_pauses = config.reload_retry.pauses();
                if applied > 0 {
                    last_message = Instant::now();
                }
            }
            Err(ApplyError::Fenced | ApplyError::CursorMoved) => {
                metrics.lock_losses.inc();
                break;
            }
            Err(error @ (ApplyError::Unread | ApplyError::Upstream(_))) => {
                // A story read failed (recorded in the endpoint's state): its message waits,
                // and is tried again after a pause that grows while the reads keep failing. The
                // wait holds no slot, and new messages do not cut it short.
                let pause = read_pauses.next_pause();
                tracing::info!(%endpoint, %error, ?pause, "a stories message waits for its read");
                permit = None;
                let _backing_off = BackingOff::new(&metrics, "story");
                wait_or_stop(&signal, &stopping, &held, pause).await;
                continue;
            }
            Err(error) => {
                tracing::info!(%endpoint, %error, "applying stories messages failed; retrying");
                tokio::time::sleep(config.error_pause).await;
                continue;
            }
        }
        if let Some(task) = syncing.as_ref().filter(|task| task.is_finished()) {
            let _ = task;
            let task = syncing.take().expect("checked above");
            match task.await {
                Ok(Ok(SyncEnd::CaughtUp)) => {
                    sync_pauses = config.reload_retry.pauses();
                    sync_backing_off = None;
                    next_sync = tokio::time::Instant::now() + catch_up_interval
                }
                Ok(Err(ApplyError::Fenced | ApplyError::CursorMoved)) => {
                    metrics.lock_losses.inc();
                    break;
                }
                Ok(Err(error)) => {
                    let pause = sync_pauses.next_pause();
                    sync_failed(&pool, &ctx, &error, &metrics).await;
                    tracing::info!(%endpoint, %error, ?pause,
                        "the stories sync failed; it runs again after a pause");
                    sync_backing_off
                        .get_or_insert_with(|| BackingOff::new(&metrics, "stories_sync"));
                    next_sync = tokio::time::Instant::now() + pause;
                }
                Err(error) => {
                    let pause = sync_pauses.next_pause();
                    tracing::error!(%endpoint, %error, ?pause, "the stories sync ended abnormally");
                    next_sync = tokio::time::Instant::now() + pause;
                }
            }
        }
        if syncing.is_none() && ctx.has_upstream() && tokio::time::Instant::now() >= next_sync {
            let (pool, ctx, config, metrics) =
                (pool.clone(), ctx.clone(), config.clone(), metrics.clone());
            syncing = Some(tokio::spawn(sync(pool, ctx, token, config, metrics)));
            continue;
        }
        permit = None;
        let idle = last_message.elapsed() >= config.idle_linger;
        match &syncing {
            Some(task) => {
                tokio::select! {
                    _ = signal.notify.notified() => {}
                    _ = wait_finished(task) => {}
                }
            }
            None if idle => {
                // Nothing to apply and no sync running: the sweep starts a worker again when
                // messages come or the next catch-up is due.
                tokio::select! {
                    _ = signal.notify.notified() => {}
                    _ = tokio::time::sleep(config.idle_linger) => break,
                }
            }
            None => {
                tokio::select! {
                    _ = signal.notify.notified() => {}
                    _ = tokio::time::sleep_until(next_sync) => {}
                    _ = tokio::time::sleep(config.idle_linger) => {}
                }
            }
        }
    }
    if let Some(task) = syncing {
        // Its writes are each a whole transaction; stopping it between them loses nothing.
        task.abort();
        let _ = task.await;
    }
    held.release().await;
    metrics.endpoints_owned.dec();
    exit(wakes_seen)
}

async fn wait_finished<T>(task: &JoinHandle<T>) {
    while !task.is_finished() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
