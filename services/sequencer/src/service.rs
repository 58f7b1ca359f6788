//! The sequencer process: wake-ups and the sweep find endpoints with work; a worker per endpoint
//! (at most `max_concurrent_endpoints` at once, and at most a tenant's share of them for one
//! tenant: [`crate::slots`]) owns it and applies it.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use relay_coord::{listen, wake_channel, Owners, OwnershipConfig, OwnershipError};
use relay_rules::ApplyBackoff;
use relay_store::endpoints::Source;
use relay_store::EndpointId;
use sqlx::PgPool;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::batch::{Announce, ApplyBatcher, PendingReader};
use crate::feed::FeedSource;
use crate::metrics::SequencerMetrics;
use crate::reload::ReloadLimits;
use crate::slots::Slots;
use crate::stories::StoriesSource;
use crate::upstream::UpstreamClient;
use crate::worker::{run_worker, Assignment, IdleClock, WorkerConfig, WorkerExit, WorkerSignal};

/// Each setting's default, written once: [`SequencerConfig::default`] and relay's command line
/// both take them from here.
pub mod defaults {
    /// An endpoint's lock lasts this long unless renewed.
    pub const LEASE_MS: u64 = 10_000;
    pub const MAX_CONCURRENT_ENDPOINTS: usize = 128;
    /// The most of a process's workers one tenant may hold: half, so one tenant's endpoints
    /// (many, or stuck on a hanging upstream) always leave the other half to the others.
    pub const MAX_TENANT_SHARE: f64 = 0.5;
    /// Tries of a message whose apply fails before it is quarantined: with the default
    /// backoff, about 7 s of trying, enough to outlast a brief fault without holding the
    /// endpoint long.
    pub const APPLY_ATTEMPTS: u32 = 5;
    pub const APPLIERS: usize = 2;
    /// An apply transaction waits at most this long for more endpoints' runs (and only while
    /// they are on their way or arriving closer together than this): a few commits' time, so
    /// at a steady rate several runs share one, within the few milliseconds a change may take
    /// from receipt to its queue.
    pub const APPLY_LINGER_US: u64 = 5_000;
    pub const RUNS_PER_TRANSACTION: usize = 64;
    pub const MESSAGES_PER_TRANSACTION: usize = 256;
    pub const MESSAGES_PER_READ: i64 = 100;
    pub const SWEEP_INTERVAL_MS: u64 = 1_000;
    /// An endpoint is kept five minutes after its last message: at light load an endpoint's
    /// messages come tens of seconds apart, and taking it again for each would cost more than
    /// the message (a lock, a fencing-token commit, its registration, track and cursor read,
    /// and its first message read back), while holding it costs a share of one renewal round
    /// trip (relay-coord's `Held`).
    pub const IDLE_LINGER_MS: u64 = 300_000;
    /// Idle endpoints one process keeps at most (the longest idle let go first): a worker
    /// waiting for its endpoint's next message holds a few kilobytes and no connection or
    /// slot, so this bounds their memory, not their work.
    pub const MAX_IDLE_ENDPOINTS: usize = 10_000;
    /// Applied event ids are kept a month: as long as the oldest backup likely to be restored,
    /// plus a day (see [`super::SequencerConfig::applied_events_retention`]).
    pub const APPLIED_EVENTS_RETENTION_DAYS: f64 = 31.0;
    /// Applied messages are kept a week: they are for support (the message listing, a
    /// quarantined message's retry) and audit, not for correctness. A restore from a backup
    /// needs none of them: the upstream's rewind resends what the backup lacks, and what it
    /// resends is recognised by the applied event ids, kept a month.
    pub const MESSAGE_RETENTION_DAYS: f64 = 7.0;
    /// Published changes are kept a week: what `POST .../replay` can send again (a consumer
    /// that lost more resyncs from the copy).
    pub const CHANGE_RETENTION_DAYS: f64 = 7.0;
    /// Retention sweeps run every ten minutes: a week's retention is kept to within minutes.
    pub const RETENTION_INTERVAL_S: u64 = 600;
    pub const UPSTREAM_TIMEOUT_MS: u64 = 10_000;
    /// A stories endpoint catches up from `GET /v1/events` this often as a safety net under its
    /// webhooks (seed 000: "every few minutes"), besides on start-up and after downtime.
    pub const STORIES_CATCH_UP_INTERVAL_S: u64 = 300;
    /// Reload passes (and stories endpoints' syncs) reading at once in one process, each tenant
    /// at most `MAX_TENANT_SHARE` of them: two, one a tenant, so a hostile or huge tenant holds
    /// one while another tenant's reload runs; with `MAX_RELOAD_BYTES` the bound on what
    /// reloads hold (README, "Memory").
    pub const MAX_CONCURRENT_RELOADS: usize = 2;
    /// The most one reload pass (or one stories sync) reads: the memory its answers' values
    /// take once parsed, as estimated while parsing (or their bytes, when more). 1 GiB: the
    /// 100,000-item benchmark's pass (items of about 1 KB, 6.5 KB each once parsed) is
    /// estimated at 814 MB, so a pass of about 130,000 such items fits; measured, a pass costs
    /// the process at most 1.6 times its estimate until it is merged (README, "Memory").
    pub const MAX_RELOAD_BYTES: u64 = 1024 * 1024 * 1024;
}

/// How the sequencer behaves. The defaults suit one machine with the front tier beside it.
#[derive(Debug, Clone)]
pub struct SequencerConfig {
    pub redis_url: String,
    /// Prefix of every Redis key and channel (locks, wake-ups).
    pub key_prefix: String,
    /// How long an endpoint's lock lasts unless renewed (renewed every third of it).
    pub lease: Duration,
    /// Endpoints worked at once by this process.
    pub max_concurrent_endpoints: usize,
    /// The most of those one tenant may hold, as a fraction (see [`crate::slots`]).
    pub max_tenant_share: f64,
    /// Tries of a stored message whose apply fails before it is quarantined.
    pub apply_attempts: u32,
    /// The waits between those tries.
    pub apply_backoff: ApplyBackoff,
    /// Messages read from Postgres at a time per endpoint.
    pub messages_per_read: i64,
    /// Apply transactions open at once for each source kind (each takes the runs of its kind
    /// that gathered while the others committed): see [`crate::batch`].
    pub appliers: usize,
    /// How long an apply transaction may wait for more endpoints' runs (see relay-coord's
    /// `Linger`).
    pub apply_linger: Duration,
    /// Endpoints' runs applied in one transaction at most.
    pub runs_per_transaction: usize,
    /// No more runs join a transaction once it holds this many messages.
    pub messages_per_transaction: usize,
    /// How often Postgres is swept for endpoints with work (the safety net under wake-ups).
    pub sweep_interval: Duration,
    /// How long an idle worker keeps its endpoint before letting go (see
    /// [`defaults::IDLE_LINGER_MS`]).
    pub idle_linger: Duration,
    /// The most idle endpoints this process keeps: past it, the longest idle are let go.
    pub max_idle_endpoints: usize,
    /// How long applied event ids are kept (`None`: for ever). Keep them as long as the oldest
    /// backup that may be restored, plus a day: a rewind after a restore resends what was
    /// applied since that backup, and its events must still be recognised.
    pub applied_events_retention: Option<Duration>,
    /// How long applied messages are kept (`None`: for ever); quarantined ones not acted on
    /// are kept regardless.
    pub message_retention: Option<Duration>,
    /// How long published changes are kept (`None`: for ever); unpublished ones are kept
    /// regardless.
    pub change_retention: Option<Duration>,
    /// How often rows past their retention are deleted (and the tables' sizes read).
    pub retention_interval: Duration,
    /// Timeout of each upstream API request.
    pub upstream_timeout: Duration,
    /// Where upstream requests may go (the operator's setting; https to public addresses by
    /// default).
    pub outbound: relay_netguard::OutboundPolicy,
    /// The roots TLS connections trust: the upstream's https, and Redis' `rediss://`.
    pub trust: relay_netguard::TrustRoots,
    /// Items per `/v1/feed` page a reload asks for: the most the API gives (500) by default, so
    /// a pass makes the fewest reads; tests ask for fewer, so that a pass has several pages.
    pub feed_page_limit: usize,
    /// Pauses between a reload's passes that cannot merge (and, for a stories endpoint,
    /// before a failed sync runs again).
    pub reload_retry: relay_netguard::RetryPolicy,
    /// How often each stories endpoint catches up from `GET /v1/events`.
    pub stories_catch_up_interval: Duration,
    /// Tries of a stories endpoint's story read, and the backoff of its reads owed.
    pub story_read_retry: crate::stories::StoryReadRetry,
    /// Reload passes (and stories syncs) reading at once in this process; a tenant holds at
    /// most `max_tenant_share` of them.
    pub max_concurrent_reloads: usize,
    /// The most one reload pass (or stories sync) reads (see [`defaults::MAX_RELOAD_BYTES`]).
    pub max_reload_bytes: u64,
    /// The publisher of this process, when one runs here (`relay all`): the changes an apply
    /// commits are handed to it in memory rather than read back (see [`crate::batch`]).
    pub changes_handoff: Option<relay_coord::Handoff<relay_store::changes::Unpublished>>,
    /// The front tier of this process, when one runs here (`relay all`): each worker takes the
    /// messages it stores for the worker's endpoint in memory, and reads Postgres only for what
    /// was not handed (see `worker::apply_available`).
    pub messages_handoff: Option<relay_coord::Handoff<relay_store::cursors::PendingMessage>>,
}

impl Default for SequencerConfig {
    fn default() -> Self {
        let ms = Duration::from_millis;
        Self {
            redis_url: relay_coord::DEFAULT_REDIS_URL.to_owned(),
            key_prefix: relay_coord::DEFAULT_KEY_PREFIX.to_owned(),
            lease: ms(defaults::LEASE_MS),
            max_concurrent_endpoints: defaults::MAX_CONCURRENT_ENDPOINTS,
            max_tenant_share: defaults::MAX_TENANT_SHARE,
            apply_attempts: defaults::APPLY_ATTEMPTS,
            apply_backoff: ApplyBackoff {
                first: Duration::from_millis(500),
                max: Duration::from_secs(30),
            },
            messages_per_read: defaults::MESSAGES_PER_READ,
            appliers: defaults::APPLIERS,
            apply_linger: Duration::from_micros(defaults::APPLY_LINGER_US),
            runs_per_transaction: defaults::RUNS_PER_TRANSACTION,
            messages_per_transaction: defaults::MESSAGES_PER_TRANSACTION,
            sweep_interval: ms(defaults::SWEEP_INTERVAL_MS),
            idle_linger: ms(defaults::IDLE_LINGER_MS),
            max_idle_endpoints: defaults::MAX_IDLE_ENDPOINTS,
            applied_events_retention: Some(Duration::from_secs_f64(
                defaults::APPLIED_EVENTS_RETENTION_DAYS * 24.0 * 3600.0,
            )),
            message_retention: Some(Duration::from_secs_f64(
                defaults::MESSAGE_RETENTION_DAYS * 24.0 * 3600.0,
            )),
            change_retention: Some(Duration::from_secs_f64(
                defaults::CHANGE_RETENTION_DAYS * 24.0 * 3600.0,
            )),
            retention_interval: Duration::from_secs(defaults::RETENTION_INTERVAL_S),
            upstream_timeout: ms(defaults::UPSTREAM_TIMEOUT_MS),
            outbound: relay_netguard::OutboundPolicy::default(),
            trust: relay_netguard::TrustRoots::platform(),
            feed_page_limit: crate::upstream::FEED_PAGE_LIMIT,
            reload_retry: crate::reload::RELOAD_RETRY,
            stories_catch_up_interval: Duration::from_secs(defaults::STORIES_CATCH_UP_INTERVAL_S),
            story_read_retry: crate::stories::STORY_READ_RETRY,
            max_concurrent_reloads: defaults::MAX_CONCURRENT_RELOADS,
            max_reload_bytes: defaults::MAX_RELOAD_BYTES,
            changes_handoff: None,
            messages_handoff: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SequencerError {
    #[error(transparent)]
    Ownership(#[from] OwnershipError),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// A running sequencer; [`Sequencer::stop`] lets every worker finish its transaction and
/// release its endpoint.
pub struct Sequencer {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Sequencer {
    pub async fn start(
        pool: PgPool,
        config: SequencerConfig,
        keys: relay_store::Keyring,
        metrics: SequencerMetrics,
    ) -> Result<Self, SequencerError> {
        let owners = Owners::connect(
            &config.redis_url,
            pool.clone(),
            OwnershipConfig {
                key_prefix: config.key_prefix.clone(),
                lease: config.lease,
                trust: config.trust.clone(),
                ..OwnershipConfig::default()
            },
        )
        .await?;
        // Fail at start, not in the background, when Redis is not there.
        relay_coord::open_redis(&config.redis_url, &config.trust)?
            .get_multiplexed_async_connection()
            .await?;
        let changes_waker = relay_coord::Waker::connect_channel(
            &config.redis_url,
            &config.trust,
            relay_coord::changes_channel(&config.key_prefix),
        )
        .await?;
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(schedule(
            pool,
            owners,
            config,
            keys,
            metrics,
            changes_waker,
            stop_rx,
        ));
        Ok(Self { stop, task })
    }

    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }

    /// Stops without letting workers finish (a test's stand-in for a killed process: locks
    /// stay in Redis until they expire).
    pub fn abort(self) {
        self.task.abort();
    }
}

async fn schedule(
    pool: PgPool,
    owners: Owners,
    config: SequencerConfig,
    keys: relay_store::Keyring,
    metrics: SequencerMetrics,
    changes_waker: relay_coord::Waker,
    mut stop: watch::Receiver<bool>,
) {
    let (wake_tx, mut wake_rx) = mpsc::unbounded_channel::<Uuid>();
    let listener = tokio::spawn(listen(
        config.redis_url.clone(),
        config.trust.clone(),
        wake_channel(&config.key_prefix),
        wake_tx.clone(),
        stop.clone(),
    ));
    let retention_task = tokio::spawn(retention(
        pool.clone(),
        Retention {
            applied_events: config.applied_events_retention,
            messages: config.message_retention,
            changes: config.change_retention,
        },
        config.retention_interval,
        metrics.clone(),
        stop.clone(),
    ));
    let lag_sampler = tokio::spawn(sample_lag(pool.clone(), stop.clone()));
    let (changed_tx, mut changed_rx) = mpsc::unbounded_channel::<Option<Uuid>>();
    let registration_listener = tokio::spawn(listen_registration_changes(
        pool.clone(),
        changed_tx,
        stop.clone(),
    ));
    // Catch-up on start-up: every stories endpoint not caught up since this moment is due.
    let started_at = time::OffsetDateTime::now_utc();
    let catch_up_interval = config.stories_catch_up_interval;
    let sweeper = tokio::spawn(sweep(
        pool.clone(),
        (config.sweep_interval, catch_up_interval, started_at),
        wake_tx.clone(),
        stop.clone(),
    ));
    let http = UpstreamClient::http_client(config.upstream_timeout, config.outbound, &config.trust);
    // Each kind's runs share transactions with their kind's only: a kind's transaction is its
    // own statements.
    let batch_limits = (config.runs_per_transaction, config.messages_per_transaction);
    let announce = Announce {
        handoff: config.changes_handoff.clone(),
        waker: Some(changes_waker.clone()),
    };
    let (feed_runs, mut appliers) = ApplyBatcher::start(
        pool.clone(),
        (config.appliers, config.apply_linger),
        batch_limits,
        announce.clone(),
        metrics.clone(),
    );
    let (stories_runs, stories_appliers) = ApplyBatcher::start(
        pool.clone(),
        (config.appliers, config.apply_linger),
        batch_limits,
        announce,
        metrics.clone(),
    );
    appliers.extend(stories_appliers);
    let (reader, readers) = PendingReader::start(
        pool.clone(),
        config.appliers,
        config.runs_per_transaction,
        config.messages_per_read,
    );
    let worker_config = WorkerConfig {
        keys,
        changes_waker: Some(changes_waker),
        feed_runs,
        stories_runs,
        reader: Some(reader),
        messages_handoff: config.messages_handoff.clone(),
        messages_per_read: config.messages_per_read,
        idle_linger: config.idle_linger,
        idle_clock: IdleClock::new(),
        reload_retry: config.reload_retry,
        reloads: ReloadLimits::new(
            config.max_concurrent_reloads,
            config.max_tenant_share,
            config.max_reload_bytes,
        ),
        error_pause: Duration::from_millis(200),
        feed_page_limit: config.feed_page_limit,
        apply_attempts: config.apply_attempts,
        apply_backoff: config.apply_backoff,
        story_reads: config.story_read_retry,
        stories_catch_up: (catch_up_interval, started_at),
    };
    let slots = Slots::new(config.max_concurrent_endpoints, config.max_tenant_share);
    let reload_slots = worker_config.reloads.slots.clone();
    let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut active: HashMap<Uuid, Arc<WorkerSignal>> = HashMap::new();
    // Workers abort with the set when the scheduler itself is aborted (`Sequencer::abort`).
    let mut workers: JoinSet<WorkerExit> = JoinSet::new();

    // Which endpoint each worker task works: a task that panicked says only its id.
    let mut tasks: HashMap<tokio::task::Id, Uuid> = HashMap::new();

    let spawn = |workers: &mut JoinSet<WorkerExit>,
                 (active, tasks): (
        &mut HashMap<Uuid, Arc<WorkerSignal>>,
        &mut HashMap<tokio::task::Id, Uuid>,
    ),
                 endpoint: Uuid| {
        let signal = Arc::new(WorkerSignal::default());
        active.insert(endpoint, signal.clone());
        let (pool, owners, http) = (pool.clone(), owners.clone(), http.clone());
        let (config, metrics) = (worker_config.clone(), metrics.clone());
        let slots = slots.clone();
        let stopping = stopping.clone();
        let task = workers.spawn(async move {
            let gone = WorkerExit {
                endpoint,
                wakes_seen: 0,
            };
            // The endpoint's tenant decides which share its worker counts against: read under
            // one of the process's slots (so reads are as bounded as workers), then that slot is
            // kept or, while the tenant is at its share, given back.
            let any = slots.take_any().await;
            if stopping.load(Ordering::SeqCst) {
                return gone;
            }
            let registration = match relay_store::endpoints::load_registration(
                &pool,
                &config.keys,
                EndpointId(endpoint),
            )
            .await
            {
                Ok(Some(registration)) => registration,
                Ok(None) => {
                    tracing::warn!(%endpoint, "messages for an endpoint that is not registered");
                    return gone;
                }
                Err(error) => {
                    tracing::warn!(%endpoint, %error, "could not read the endpoint");
                    return gone;
                }
            };
            let slot = slots.take_holding(registration.tenant_id, any).await;
            if stopping.load(Ordering::SeqCst) {
                return gone;
            }
            let assignment = Assignment {
                pool,
                owners,
                http,
                registration,
                signal,
                config,
                metrics,
                stopping,
                slots: (slots, slot),
            };
            // The one place a source kind is chosen: its worker is the same.
            match assignment.registration.source {
                Source::Feed => run_worker::<FeedSource>(assignment).await,
                Source::Stories(_) => run_worker::<StoriesSource>(assignment).await,
            }
        });
        tasks.insert(task.id(), endpoint);
    };

    loop {
        tokio::select! {
            Some(endpoint) = wake_rx.recv() => {
                match active.get(&endpoint) {
                    Some(signal) => signal.wake(),
                    None => {
                        spawn(&mut workers, (&mut active, &mut tasks), endpoint);
                        let_longest_idle_go(&active, config.max_idle_endpoints);
                    }
                }
            }
            Some(change) = changed_rx.recv() => match change {
                Some(endpoint) => match active.get(&endpoint) {
                    Some(signal) => signal.registration_changed(),
                    // Owned by no worker here: one starts if the change gave it work (settings
                    // that a waiting reload needed).
                    None => {
                        let (pool, wakes) = (pool.clone(), wake_tx.clone());
                        tokio::spawn(async move {
                            if let Ok(found) =
                                relay_store::cursors::endpoints_with_work(&pool, Some(endpoint), 1).await
                            {
                                for endpoint in found {
                                    let _ = wakes.send(endpoint);
                                }
                            }
                        });
                    }
                },
                // Changes may have been missed: every worker reads its registration again.
                None => {
                    for signal in active.values() {
                        signal.registration_changed();
                    }
                }
            },
            Some(done) = workers.join_next_with_id(), if !workers.is_empty() => {
                slots.forget_idle();
                reload_slots.forget_idle();
                let exit = match done {
                    Ok((task, exit)) => {
                        tasks.remove(&task);
                        exit
                    }
                    Err(error) => {
                        // A worker that panicked: its endpoint is free for the next wake-up
                        // (the sweep's, when it has work), not started again at once, which
                        // could repeat the panic in a loop.
                        if let Some(endpoint) = tasks.remove(&error.id()) {
                            tracing::error!(%endpoint, %error, "an endpoint's worker ended abnormally");
                            active.remove(&endpoint);
                        }
                        continue;
                    }
                };
                if let Some(signal) = active.remove(&exit.endpoint) {
                    if signal.wakes.load(Ordering::SeqCst) > exit.wakes_seen
                        && !stopping.load(Ordering::SeqCst)
                    {
                        // Woken after its last look: look again.
                        spawn(&mut workers, (&mut active, &mut tasks), exit.endpoint);
                    }
                }
            }
            _ = stop.changed() => break,
        }
    }
    stopping.store(true, Ordering::SeqCst);
    for signal in active.values() {
        signal.wake();
    }
    while workers.join_next().await.is_some() {}
    // Every worker has had its answer: nothing waits on the appliers any more.
    for task in appliers.into_iter().chain(readers) {
        task.abort();
    }
    listener.abort();
    registration_listener.abort();
    sweeper.abort();
    retention_task.abort();
    lag_sampler.abort();
}

/// When the process holds more than `max_idle` idle endpoints, asks the longest idle of them to
/// let theirs go: the excess and a sixteenth of the bound more, so that the next spawns need
/// not look again.
fn let_longest_idle_go(active: &HashMap<Uuid, Arc<WorkerSignal>>, max_idle: usize) {
    if active.len() <= max_idle {
        return;
    }
    let mut idle: Vec<(u64, &Arc<WorkerSignal>)> = active
        .values()
        .filter_map(|signal| signal.idle_since().map(|since| (since, signal)))
        .collect();
    if idle.len() <= max_idle {
        return;
    }
    let excess = idle.len() - max_idle + max_idle / 16;
    if excess < idle.len() {
        idle.select_nth_unstable_by_key(excess, |(since, _)| *since);
    }
    for (_, signal) in idle.into_iter().take(excess) {
        signal.let_go();
    }
}

/// How long each kind of row is kept (`None`: for ever).
#[derive(Debug, Clone, Copy)]
struct Retention {
    applied_events: Option<Duration>,
    messages: Option<Duration>,
    changes: Option<Duration>,
}

/// Every `interval`: deletes applied event ids, applied messages and published changes past
/// their retention, in batches (short statements, so no write of the tiers waits long behind
/// one), until none is left; then reads the growing tables' sizes and the stories endpoints'
/// syncs (counted, no endpoint named) into the metrics. Every sequencer process runs it; two
/// deleting the same rows simply find less to do.
async fn retention(
    pool: PgPool,
    keep: Retention,
    interval: Duration,
    metrics: SequencerMetrics,
    mut stop: watch::Receiver<bool>,
) {
    const BATCH: i64 = 10_000;
    /// Endpoints per message or change statement, and rows of each at most.
    const ENDPOINTS_PER_STATEMENT: i64 = 50;
    const ROWS_PER_ENDPOINT: i64 = 500;
    loop {
        if let Some(retention) = keep.applied_events {
            loop {
                match relay_store::copy::forget_applied_events(&pool, retention, BATCH).await {
                    Ok(deleted) => {
                        metrics.applied_events_forgotten.inc_by(deleted);
                        if (deleted as i64) < BATCH || *stop.borrow() {
                            break;
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "deleting old applied event ids failed");
                        break;
                    }
                }
            }
        }
        if let Some(retention) = keep.messages {
            let cutoff = time::OffsetDateTime::now_utc() - retention;
            let forgotten = every_page(&stop, |after| {
                relay_store::messages::forget_applied(
                    &pool,
                    cutoff,
                    after,
                    ENDPOINTS_PER_STATEMENT,
                    ROWS_PER_ENDPOINT,
                )
            })
            .await;
            count_forgotten(forgotten, &metrics.messages_forgotten, "applied messages");
        }
        if let Some(retention) = keep.changes {
            let cutoff = time::OffsetDateTime::now_utc() - retention;
            let forgotten = every_page(&stop, |after| {
                relay_store::changes::forget_published(
                    &pool,
                    cutoff,
                    after,
                    ENDPOINTS_PER_STATEMENT,
                    ROWS_PER_ENDPOINT,
                )
            })
            .await;
            count_forgotten(forgotten, &metrics.changes_forgotten, "published changes");
        }
        match relay_store::table_sizes(&pool).await {
            Ok(sizes) => {
                for (table, bytes, rows) in sizes {
                    metrics.table_bytes.with_label_values(&[table]).set(bytes);
                    metrics.table_rows.with_label_values(&[table]).set(rows);
                }
            }
            Err(error) => tracing::warn!(%error, "reading the tables' sizes failed"),
        }
        match relay_store::stories::sync_summary(&pool).await {
            Ok(summary) => metrics.observe_stories(&summary),
            Err(error) => tracing::warn!(%error, "counting the stories endpoints' syncs failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.changed() => return,
        }
    }
}

/// How often each sequencer process samples the apply lag of the endpoints with messages
/// waiting, for the console's charts: a few samples a minute, of which each minute keeps the
/// greatest.
const LAG_SAMPLE_INTERVAL: Duration = Duration::from_secs(15);

/// Every how many lag samples every endpoint's numbers are sampled too (once a minute): a
/// quarter hour's counts are exact however seldom, and reading every endpoint costs more.
const ACTIVITY_SAMPLE_EVERY: u32 = 4;

/// Every [`LAG_SAMPLE_INTERVAL`]: samples the endpoints' apply lag, and every
/// [`ACTIVITY_SAMPLE_EVERY`]th time every endpoint's numbers (relay-store's `lag_samples`),
/// each one statement that also forgets what is past keeping.
async fn sample_lag(pool: PgPool, mut stop: watch::Receiver<bool>) {
    for round in 0u32.. {
        if let Err(error) = relay_store::lag_samples::sample(&pool).await {
            tracing::warn!(%error, "sampling the endpoints' apply lag failed");
        }
        if round % ACTIVITY_SAMPLE_EVERY == 0 {
            if let Err(error) = relay_store::lag_samples::sample_activity(&pool).await {
                tracing::warn!(%error, "sampling the endpoints' activity failed");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(LAG_SAMPLE_INTERVAL) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Counts what a retention pass deleted, or says why it failed (the next round tries again).
fn count_forgotten(
    forgotten: Result<u64, relay_store::StoreError>,
    counter: &prometheus::IntCounter,
    what: &str,
) {
    match forgotten {
        Ok(deleted) => counter.inc_by(deleted),
        Err(error) => tracing::warn!(%error, "deleting old {what} failed"),
    }
}

/// Runs `delete` over every page of endpoints (each call takes the last endpoint of the page
/// before, and answers how many rows went and its own last), passes after passes until a whole
/// pass deletes nothing (or `stop`): what was past its retention is then gone. Returns how many
/// rows went.
async fn every_page<F, Fut>(
    stop: &watch::Receiver<bool>,
    mut delete: F,
) -> Result<u64, relay_store::StoreError>
where
    F: FnMut(Option<EndpointId>) -> Fut,
    Fut: std::future::Future<Output = Result<(u64, Option<EndpointId>), relay_store::StoreError>>,
{
    let (mut total, mut pass, mut after) = (0, 0, None);
    loop {
        let (deleted, next) = delete(after).await?;
        total += deleted;
        pass += deleted;
        after = next;
        if after.is_none() {
            if pass == 0 {
                return Ok(total);
            }
            pass = 0;
        }
        if *stop.borrow() {
            return Ok(total);
        }
    }
}

/// Listens for changes to endpoints' registrations (the Postgres notifications the front tier
/// also listens for) until `stop`, and forwards each endpoint's id; `None` after (re)connecting,
/// when changes may have been missed.
async fn listen_registration_changes(
    pool: PgPool,
    changes: mpsc::UnboundedSender<Option<Uuid>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut pauses = LISTEN_RETRY.pauses();
    loop {
        let listened = async {
            let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
            listener
                .listen(relay_store::endpoints::CHANGED_CHANNEL)
                .await?;
            let _ = changes.send(None);
            pauses = LISTEN_RETRY.pauses();
            // `try_recv` answers `None` when the connection dropped (changes may be lost).
            while let Some(notification) = listener.try_recv().await? {
                if let Ok(endpoint) = Uuid::parse_str(notification.payload()) {
                    let _ = changes.send(Some(endpoint));
                }
            }
            Ok::<(), sqlx::Error>(())
        };
        tokio::select! {
            result = listened => {
                if let Err(error) = result {
                    tracing::warn!(error = %relay_netguard::error_chain(&error),
                        "listening for endpoint changes failed; retrying");
                }
            }
            _ = stop.changed() => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(pauses.next_pause()) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Pauses before listening again for endpoint changes after the connection failed.
const LISTEN_RETRY: relay_netguard::RetryPolicy = relay_netguard::RetryPolicy {
    first: Duration::from_millis(100),
    max: Duration::from_secs(5),
};

async fn sweep(
    pool: PgPool,
    (interval, catch_up_interval, started_at): (Duration, Duration, time::OffsetDateTime),
    wakes: mpsc::UnboundedSender<Uuid>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let due = relay_store::stories::due(&pool, catch_up_interval, started_at, None, 100_000);
        let with_work = relay_store::cursors::endpoints_with_work(&pool, None, 100_000);
        for found in [with_work.await, due.await] {
            match found {
                Ok(endpoints) => {
                    for endpoint in endpoints {
                        if wakes.send(endpoint).is_err() {
                            return;
                        }
                    }
                }
                Err(error) => tracing::warn!(%error, "sweep failed"),
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Workers of `count` endpoints, idle since their index (0: busy) as `idle` says.
    fn workers(idle: &[u64]) -> (Vec<Uuid>, HashMap<Uuid, Arc<WorkerSignal>>) {
        let ids: Vec<Uuid> = idle.iter().map(|_| Uuid::new_v4()).collect();
        let active = ids
            .iter()
            .zip(idle)
            .map(|(id, &since)| {
                let signal = WorkerSignal::default();
                signal.idle_since.store(since, Ordering::SeqCst);
                (*id, Arc::new(signal))
            })
            .collect();
        (ids, active)
    }

    fn let_go(ids: &[Uuid], active: &HashMap<Uuid, Arc<WorkerSignal>>) -> Vec<usize> {
        ids.iter()
            .enumerate()
            .filter(|(_, id)| active[*id].let_go.load(Ordering::SeqCst))
            .map(|(i, _)| i)
            .collect()
    }

    #[test]
    fn past_the_bound_the_longest_idle_are_let_go_and_busy_ones_never() {
        // 40 workers: the even ones idle, since 1000 - i (the later in the list, the longer);
        // the odd ones busy. 20 idle against a bound of 16: 4 over, plus a sixteenth of 16.
        let idle: Vec<u64> = (0..40)
            .map(|i| if i % 2 == 0 { 1000 - i } else { 0 })
            .collect();
        let (ids, active) = workers(&idle);
        let_longest_idle_go(&active, 16);
        assert_eq!(let_go(&ids, &active), vec![30, 32, 34, 36, 38]);

        // Within the bound (the busy ones do not count against it): nobody.
        let (ids, active) = workers(&idle);
        let_longest_idle_go(&active, 20);
        assert!(let_go(&ids, &active).is_empty());
        let_longest_idle_go(&active, 60);
        assert!(let_go(&ids, &active).is_empty());

        // A bound of none: every idle one goes.
        let (ids, active) = workers(&idle);
        let_longest_idle_go(&active, 0);
        assert_eq!(let_go(&ids, &active).len(), 20);
    }
}
